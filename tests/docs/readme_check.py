#!/usr/bin/env python3
"""Checks that what the README and the docs tell a newcomer to run exists, and runs the
README quickstart's cluster steps.

  readme_check.py --files        every local link (and its #anchor) in README.md, CHANGELOG.md
                                 and docs/*.md resolves; every repository path, `build/bin/X`
                                 program and `synthetic:NAME` model the README names exists
  readme_check.py --run --bin-dir DIR
                                 runs the quickstart's steps from `deploy/local/cluster.sh up` to
                                 `... down` as written (the run directory moved to a temporary
                                 one, ports chosen free), and checks that the request answers
                                 the text the README shows. Steps 1-3 (packages, build, model
                                 download) need sudo and the network: this test does not run them.
                                 Exit 77 (skipped) without the binaries, etcd or stories260K.
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def slug(heading):
    """GitHub's anchor of a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    out = set()
    in_code = False
    for line in open(path, encoding="utf-8"):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def executables():
    names = set()
    for cm in glob.glob(os.path.join(ROOT, "**", "CMakeLists.txt"), recursive=True):
        if "/build" in os.path.relpath(cm, ROOT).replace("\\", "/")[:6]:
            continue
        for m in re.finditer(r"add_executable\(\s*([\w\-]+)", open(cm, encoding="utf-8").read()):
            names.add(m.group(1))
    return names


def check_files():
    errors = []
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "CHANGELOG.md")]
    docs += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    for doc in docs:
        if not os.path.exists(doc):
            errors.append(f"{os.path.relpath(doc, ROOT)}: missing")
            continue
        text = open(doc, encoding="utf-8").read()
        base = os.path.dirname(doc)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(base, path)) if path else doc
            if not os.path.exists(full):
                errors.append(f"{os.path.relpath(doc, ROOT)}: link to a missing file: {target}")
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                errors.append(f"{os.path.relpath(doc, ROOT)}: link to a missing heading: {target}")
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    # Repository paths the README names (in code spans and blocks).
    code = "\n".join(re.findall(r"```.*?```", readme, re.S) + re.findall(r"`[^`\n]+`", readme))
    for m in re.finditer(r"(?<![\w./$-])((?:scripts|deploy|docs|bench|tests|model|router|"
                         r"gpu_worker|cache_server|cache_client|common|kernels|proto)/[\w./-]*\w)",
                         code):
        p = m.group(1)
        if not os.path.exists(os.path.join(ROOT, p)):
            errors.append(f"README.md: names a path that does not exist: {p}")
    exes = executables()
    for m in re.finditer(r"build/bin/([\w-]+)", code):
        if m.group(1) not in exes:
            errors.append(f"README.md: names a program no CMakeLists.txt builds: build/bin/{m.group(1)}")
    synth = open(os.path.join(ROOT, "model", "synthetic.cc"), encoding="utf-8").read()
    for m in re.finditer(r"synthetic:([\w-]+)", readme):
        if f'name == "{m.group(1)}"' not in synth:
            errors.append(f"README.md: names a synthetic model model/synthetic.cc does not make: "
                          f"synthetic:{m.group(1)}")
    return errors


def quickstart():
    """The quickstart's shell block and the answer the README shows."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    sec = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w*)\n(.*?)```", sec, re.S)
    sh = next(b for lang, b in blocks if lang == "sh")
    answer = next(b for lang, b in blocks if lang == "json")
    text = re.search(r'"text":"((?:[^"\\]|\\.)*)"', answer).group(1)
    lines = sh.split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith("deploy/local/cluster.sh up"))
    end = next(i for i, l in enumerate(lines) if l.startswith("deploy/local/cluster.sh down"))
    return lines[start:end], lines[end], json.loads(f'"{text}"')


def run(bin_dir, timeout):
    models = os.environ.get("SPARSEX_MODELS", os.path.join(os.path.dirname(ROOT), "shared", "models"))
    for b in ("sparsex-worker", "sparsex-router", "sparsex-cache-server"):
        if not os.access(os.path.join(bin_dir, b), os.X_OK):
            print(f"skipped: {bin_dir}/{b} not built")
            return 77
    if not shutil.which("etcd"):
        print("skipped: etcd not installed")
        return 77
    if not os.path.exists(os.path.join(models, "stories260K", "stories260K.gguf")):
        print(f"skipped: no stories260K under {models}")
        return 77
    steps, down, expected = quickstart()
    run_dir = tempfile.mkdtemp(prefix="sparsex-quickstart-")
    default_dir = "/tmp/sparsex-cluster-$(id -un)"
    script = "\n".join(steps).replace(default_dir, run_dir)
    env = dict(os.environ, SPARSEX_RUN_DIR=run_dir, SPARSEX_BIN_DIR=bin_dir, SPARSEX_MODELS=models,
               SPARSEX_GRPC_PORT="0", SPARSEX_HTTP_PORT="0")
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            print(f"the quickstart's steps failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
            return 1
        body = r.stdout.strip().splitlines()[-1]
        got = json.loads(body)["choices"][0]["text"]
        if got != expected:
            print(f"the quickstart answered {got!r}, the README shows {expected!r}")
            return 1
        print(f"quickstart answered as the README shows: {got!r}")
        return 0
    finally:
        subprocess.run(["bash", "-c", down], cwd=ROOT, env=env, capture_output=True, timeout=60)
        shutil.rmtree(run_dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", action="store_true")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--timeout", type=int, default=150)
    a = ap.parse_args()
    if a.files:
        errors = check_files()
        for e in errors:
            print(e)
        if errors:
            return 1
        print("every link, path, program and synthetic model the docs name exists")
    if a.run:
        return run(os.path.abspath(a.bin_dir), a.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
