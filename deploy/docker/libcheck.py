#!/usr/bin/env python3
"""Shared-library checks for the runtime images (called by deploy/docker/stage.sh).

  libcheck.py packages --list packages/router.txt [--base libc6 ...] FILE...
      Every library `ldd FILE` resolves must be owned (dpkg -S) by a package that
      `apt-get install --no-install-recommends <list>` installs on debian:12-slim: a listed
      package, a base package, or one of their Depends / Pre-Depends, recursively, as the dpkg
      database of this (build) machine records them. Also fails on "not found" libraries.

  libcheck.py bundle --lib-dir DIR --base worker-cuda.base FILE...
      Copies every library FILE needs, except the sonames the base image provides, into DIR
      (UCX transport modules into DIR/ucx, where libucs looks for them), then checks with
      `LD_LIBRARY_PATH=DIR ldd` that every library resolves inside DIR or is a base soname.

Only the Python standard library; Debian's python3 is enough.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

UCX_MODULE_DIR = "/usr/lib/x86_64-linux-gnu/ucx"


def ldd(path, env=None):
    """Returns [(soname, resolved path or None)] for every library ldd lists."""
    e = dict(os.environ)
    e.pop("LD_LIBRARY_PATH", None)
    if env:
        e.update(env)
    out = subprocess.run(["ldd", path], capture_output=True, text=True, env=e)
    if out.returncode != 0:
        raise SystemExit(f"libcheck: ldd {path} failed: {out.stderr.strip() or out.stdout.strip()}")
    libs = []
    for line in out.stdout.splitlines():
        line = line.strip()
        m = re.match(r"^(\S+) => not found", line)
        if m:
            libs.append((m.group(1), None))
            continue
        m = re.match(r"^(\S+) => (\S+) \(0x[0-9a-f]+\)$", line)
        if m:
            libs.append((m.group(1), m.group(2)))
            continue
        m = re.match(r"^(\S+) \(0x[0-9a-f]+\)$", line)  # vdso, the dynamic loader
        if m:
            name = m.group(1)
            libs.append((os.path.basename(name), name if name.startswith("/") else None))
    return libs


def needs_ucx_modules(files):
    """True if a file links libucs (UCX then dlopens its transport modules at runtime)."""
    for f in files:
        for soname, _ in ldd(f):
            if soname.startswith("libucs.so"):
                return True
    return False


def ucx_modules():
    if not os.path.isdir(UCX_MODULE_DIR):
        return []
    # The soname-level names (libuct_tcp.so.0) are the ones UCX opens.
    return sorted(os.path.join(UCX_MODULE_DIR, f) for f in os.listdir(UCX_MODULE_DIR)
                  if re.match(r"^lib\w+\.so\.\d+$", f))


# ---------------------------------------------------------------------------- package mode

_owner_cache = {}


def _usr_twins(path):
    out = [path, os.path.realpath(path)]
    for p in list(out):
        if p.startswith("/usr/lib/") or p.startswith("/usr/lib64/"):
            out.append(p[len("/usr"):])
        elif p.startswith("/lib/") or p.startswith("/lib64/"):
            out.append("/usr" + p)
    return out


def dpkg_owners(paths):
    """path -> the Debian package that installed it (or its /usr-merged twin), one dpkg call."""
    want = {}
    for p in paths:
        if p not in _owner_cache:
            for t in _usr_twins(p):
                want.setdefault(t, p)
    if want:
        out = subprocess.run(["dpkg-query", "-S"] + sorted(want), capture_output=True, text=True)
        for line in out.stdout.splitlines():
            # "libfoo1:amd64: /usr/lib/..." ("diversion by ..." lines have no owner)
            if ": " not in line or line.startswith("diversion"):
                continue
            owner, path = line.split(": ", 1)
            owner = owner.split(",")[0].strip().split(":")[0]
            if path in want and want[path] not in _owner_cache:
                _owner_cache[want[path]] = owner
    return {p: _owner_cache.get(p) for p in paths}


_status = None


def status_index():
    """installed package -> (Depends, Pre-Depends); virtual name -> providers."""
    global _status
    if _status is None:
        out = subprocess.run(["dpkg-query", "-W",
                              "-f=${Package}\t${Status}\t${Depends}\t${Pre-Depends}\t${Provides}\n"],
                             capture_output=True, text=True, check=True)
        installed, provides = {}, {}
        for line in out.stdout.splitlines():
            parts = (line.split("\t") + [""] * 5)[:5]
            if "install ok installed" not in parts[1]:
                continue
            installed[parts[0]] = (parts[2], parts[3])
            for p in parts[4].split(","):
                p = p.strip().split(" ")[0].split(":")[0]
                if p:
                    provides.setdefault(p, []).append(parts[0])
        _status = (installed, provides)
    return _status


def closure(roots):
    """Packages apt installs for `roots` (Depends + Pre-Depends, recursively; for an
    alternative 'a | b' the first installed one, as apt would keep it). Returns (set, errors)."""
    installed, provides = status_index()
    seen, errors, todo = set(), [], list(roots)
    while todo:
        pkg = todo.pop()
        if pkg in seen:
            continue
        if pkg not in installed:
            if pkg in provides:
                seen.add(pkg)
                todo.extend(provides[pkg])
            elif pkg in roots:
                errors.append(f"package {pkg} is listed but not installed on this build machine")
            continue
        seen.add(pkg)
        dep, pre = installed[pkg]
        for clause in (dep + "," + pre).split(","):
            clause = clause.strip()
            if not clause:
                continue
            for alt in clause.split("|"):
                name = alt.strip().split(" ")[0].split(":")[0]
                if name in installed or name in provides:
                    todo.append(name)
                    break
    return seen, errors


def read_list(path):
    items = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                items.append(line)
    return items


def cmd_packages(args):
    listed = read_list(args.list)
    base = [b for b in args.base.split(",") if b]
    pkgs, errors = closure(listed + base)
    files = list(args.files)
    if needs_ucx_modules(files):
        files += ucx_modules()
    owners_needed = set()
    resolved = []
    for f in files:
        for soname, path in ldd(f):
            if soname.startswith("linux-vdso"):
                continue
            if path is None:
                errors.append(f"{os.path.basename(f)}: {soname} not found")
                continue
            resolved.append((f, soname, path))
    owners = dpkg_owners(sorted({p for _, _, p in resolved}))
    for f, soname, path in resolved:
        owner = owners[path]
        if owner is None:
            errors.append(f"{os.path.basename(f)}: {soname} ({path}) belongs to no Debian "
                          "package: the runtime image cannot install it")
            continue
        owners_needed.add(owner)
        if owner not in pkgs:
            errors.append(f"{os.path.basename(f)}: {soname} ({path}) comes from {owner}, which "
                          f"{os.path.basename(args.list)} does not install: add {owner}")
    # A listed package nothing needs makes the image bigger; report it (not an error).
    for p in listed:
        if p not in owners_needed:
            sub, _ = closure([p])
            if not (sub & owners_needed):
                print(f"libcheck: note: {p} in {os.path.basename(args.list)} provides no library "
                      "these binaries need", file=sys.stderr)
    for e in errors:
        print(f"libcheck: ERROR: {e}", file=sys.stderr)
    print(f"libcheck: {os.path.basename(args.list)}: {len(files)} files, "
          f"{len(owners_needed)} owning packages, closure of {len(pkgs)} packages: "
          f"{'FAIL' if errors else 'ok'}")
    return 1 if errors else 0


# ----------------------------------------------------------------------------- bundle mode

def cmd_bundle(args):
    base = set(read_list(args.base))
    lib_dir = os.path.abspath(args.lib_dir)
    os.makedirs(lib_dir, exist_ok=True)
    errors = []
    files = list(args.files)
    if needs_ucx_modules(files):
        os.makedirs(os.path.join(lib_dir, "ucx"), exist_ok=True)
        for m in ucx_modules():
            dst = os.path.join(lib_dir, "ucx", os.path.basename(m))
            shutil.copy2(os.path.realpath(m), dst)
            files.append(dst)
    # Copy to a fixpoint: a copied library may need more libraries.
    todo, done = list(files), set()
    while todo:
        f = todo.pop()
        if f in done:
            continue
        done.add(f)
        for soname, path in ldd(f):
            if soname in base:
                continue
            if path is None:
                errors.append(f"{os.path.basename(f)}: {soname} not found on the build machine")
                continue
            dst = os.path.join(lib_dir, soname)
            if not os.path.exists(dst):
                shutil.copy2(os.path.realpath(path), dst)
                os.chmod(dst, 0o755)
            todo.append(dst)
    # Verify what the image's loader will see.
    env = {"LD_LIBRARY_PATH": lib_dir}
    checked = list(files) + [os.path.join(lib_dir, f) for f in os.listdir(lib_dir)
                             if os.path.isfile(os.path.join(lib_dir, f))]
    for f in checked:
        for soname, path in ldd(f, env):
            if soname in base:
                continue
            if path is None:
                errors.append(f"{os.path.basename(f)}: {soname} not found in the bundle")
            elif not os.path.realpath(path).startswith(lib_dir + os.sep):
                errors.append(f"{os.path.basename(f)}: {soname} resolves outside the bundle "
                              f"({path}) and is not provided by the base image")
    for e in errors:
        print(f"libcheck: ERROR: {e}", file=sys.stderr)
    n = len([f for f in os.listdir(lib_dir) if os.path.isfile(os.path.join(lib_dir, f))])
    print(f"libcheck: bundle {lib_dir}: {n} libraries, base provides "
          f"{len(base)} sonames: {'FAIL' if errors else 'ok'}")
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("packages")
    p.add_argument("--list", required=True)
    p.add_argument("--base", default="libc6",
                   help="comma-separated packages the base image has (default: libc6)")
    p.add_argument("files", nargs="+")
    b = sub.add_parser("bundle")
    b.add_argument("--lib-dir", required=True)
    b.add_argument("--base", required=True)
    b.add_argument("files", nargs="+")
    args = ap.parse_args()
    return cmd_packages(args) if args.cmd == "packages" else cmd_bundle(args)


if __name__ == "__main__":
    sys.exit(main())
