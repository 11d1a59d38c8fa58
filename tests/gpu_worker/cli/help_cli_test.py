#!/usr/bin/env python3
"""`sparsex --help` and every subcommand's --help, checked against the code.

- `sparsex --help` exits 0 and names every command;
- `sparsex CMD --help` exits 0 for each; its flags are the ones it lists;
- the flags each command's code reads (Opt/Need/get/list/count/at/find calls with a literal
  name, found in gpu_worker/cli/*.cc by function) all appear in that command's help, and every
  flag the help lists is read by the code (no documented flag that does nothing);
- the parser accepts every listed flag (`--FLAG [value] --help` exits 0) and refuses an unknown
  one with exit 2.

  help_cli_test.py --bin build/bin/sparsex --src .
"""
import argparse
import os
import re
import subprocess
import sys


def run(args):
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def flags_read_by_code(src):
    """{command: set of flag names} from the command functions in gpu_worker/cli/*.cc."""
    out = {}
    read = re.compile(r'(?:\b(?:Opt|Need)\(a,\s*|\bget\(|\blist\(|\ba\.(?:count|at|find)\()'
                      r'"([a-z0-9-]+)"')
    func = re.compile(r'^absl::Status (\w+)\(const Args& a\) \{', re.M)
    cli = os.path.join(src, "gpu_worker", "cli")
    for name in sorted(os.listdir(cli)):
        if not name.endswith(".cc") or name == "main.cc":
            continue
        text = open(os.path.join(cli, name)).read()
        starts = [(m.start(), m.group(1)) for m in func.finditer(text)]
        for k, (pos, fn) in enumerate(starts):
            end = starts[k + 1][0] if k + 1 < len(starts) else len(text)
            out.setdefault(fn.lower(), set()).update(read.findall(text[pos:end]))
    return out


def help_flags(text):
    """[(flag, takes_value)] listed under 'flags:' in a command's help."""
    flags = []
    for line in text.split("\n"):
        m = re.match(r"^  --([a-z0-9-]+)( \S+)?\s", line + " ")
        if m:
            flags.append((m.group(1), bool(m.group(2))))
    return flags


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--src", required=True)
    a = ap.parse_args()
    if not os.path.isfile(a.bin):
        print(f"skipped: no {a.bin}")
        return 77
    errors = []
    top = run([a.bin, "--help"])
    if top.returncode != 0:
        errors.append(f"sparsex --help exited {top.returncode}")
    commands = re.findall(r"^  ([a-z]+)\s", top.stdout.split("commands:", 1)[-1], re.M)
    code = flags_read_by_code(a.src)
    for fn in code:
        if fn not in commands:
            errors.append(f"the code has command function {fn} but sparsex --help lists no '{fn}'")
    if not commands:
        errors.append(f"sparsex --help lists no commands:\n{top.stdout}")
    checked = 0
    for cmd in commands:
        h = run([a.bin, cmd, "--help"])
        if h.returncode != 0:
            errors.append(f"sparsex {cmd} --help exited {h.returncode}: {h.stderr}")
            continue
        listed = help_flags(h.stdout)
        names = {f for f, _ in listed}
        for f in sorted(code.get(cmd, set()) - names):
            errors.append(f"sparsex {cmd}: the code reads --{f} but --help does not list it")
        for f in sorted(names - code.get(cmd, set()) - {"help"}):
            errors.append(f"sparsex {cmd}: --help lists --{f} but the code never reads it")
        for f, takes_value in listed:
            if f == "help":
                continue
            r = run([a.bin, cmd, f"--{f}"] + (["x"] if takes_value else []) + ["--help"])
            checked += 1
            if r.returncode != 0:
                errors.append(f"sparsex {cmd} --{f}: refused by the parser ({r.stderr.strip()})")
        bad = run([a.bin, cmd, "--no-such-flag", "1"])
        if bad.returncode != 2 or "unknown flag" not in bad.stderr:
            errors.append(f"sparsex {cmd} --no-such-flag: exit {bad.returncode}, {bad.stderr!r}")
    for e in errors:
        print(e)
    print(f"{len(commands)} commands, {checked} flags checked, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
