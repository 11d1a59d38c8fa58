#!/usr/bin/env python3
"""Static checks of deploy/docker/Dockerfile (ctest: deploy_dockerfile). No Docker engine runs
here, so this checks what can go wrong without building:

  * stages: unique names; every `--target` the header documents exists; COPY --from names an
    earlier stage; the worker's runtime is an nvidia/cuda runtime image, the others debian slim
  * build context: every COPY source exists and is not filtered out by Dockerfile.dockerignore;
    the build trees are filtered out
  * staging: each runtime image copies /staging/<image>/ from a build stage whose stage.sh call
    stages that image, installs deploy/docker/packages/<image>.txt (Debian images), and its
    ENTRYPOINT is where stage.sh installs that image's binary
  * flags and ports: CMD flags exist in the binary's sources; EXPOSE equals the container ports
    of the same image in deploy/k8s; the images run as a non-root user
  * scripts: bash -n deploy/docker/stage.sh; deploy/docker/libcheck.py compiles
"""
import fnmatch
import glob
import os
import re
import subprocess
import sys

import yaml

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_k8s import SOURCES, source_flags, arg_flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCKER = os.path.join(REPO, "deploy", "docker")
errors = []

# stage.sh's layout: image -> (binaries, entrypoint of the image)
STAGED = {
    "cache-server": (["sparsex-cache-server", "sparsex-cache-cli"], "/usr/local/bin/sparsex-cache-server"),
    "router": (["sparsex-router", "sparsex-rag"], "/usr/local/bin/sparsex-router"),
    "worker-cpu": (["sparsex-worker"], "/usr/local/bin/sparsex-worker"),
    "worker-cuda": (["sparsex-worker"], "/opt/sparsex/bin/sparsex-worker"),
}
# Dockerfile target -> (staged image, k8s image name)
TARGETS = {"cache-server": ("cache-server", "sparsex/cache-server"),
           "router": ("router", "sparsex/router"),
           "worker-cpu": ("worker-cpu", "sparsex/worker-cpu"),
           "worker": ("worker-cuda", "sparsex/worker")}


def err(m):
    errors.append(m)


def instructions(text):
    """[(INSTRUCTION, argument string)] with line continuations joined, comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if cur and s.startswith("#"):
            continue
        cur += (" " if cur else "") + s.rstrip("\\").strip()
        if not s.endswith("\\"):
            word, _, rest = cur.partition(" ")
            out.append((word.upper(), rest.strip()))
            cur = ""
    return out


def json_or_words(arg):
    arg = arg.strip()
    if arg.startswith("["):
        import json
        return json.loads(arg)
    return arg.split()


def main():
    path = os.path.join(DOCKER, "Dockerfile")
    with open(path) as f:
        text = f.read()
    ins = instructions(text)
    args = {}
    stages = {}  # name -> {"from": image, "ins": [...]}
    order = []
    cur = None
    for op, arg in ins:
        if op == "ARG" and cur is None:
            k, _, v = arg.partition("=")
            args[k] = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), v)
            continue
        if op == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?$", arg, re.I)
            image = re.sub(r"\$\{(\w+)\}", lambda mm: args.get(mm.group(1), ""), m.group(1))
            name = m.group(2)
            if not name:
                err(f"FROM {arg}: every stage needs a name")
                continue
            if name in stages:
                err(f"stage {name} defined twice")
            cur = {"from": image, "ins": [], "base": image if image not in stages else stages[image]["base"]}
            stages[name] = cur
            order.append(name)
            continue
        if cur is not None:
            cur["ins"].append((op, arg))
    # Documented targets.
    for t in re.findall(r"--target (\S+)", text):
        if t not in stages:
            err(f"header documents --target {t}, no such stage")
    for t in TARGETS:
        if t not in stages:
            err(f"stage {t} is missing")
    # .dockerignore
    ign_path = os.path.join(DOCKER, "Dockerfile.dockerignore")
    ignore = []
    if not os.path.exists(ign_path):
        err("deploy/docker/Dockerfile.dockerignore is missing (build trees would enter the context)")
    else:
        with open(ign_path) as f:
            ignore = [l.strip().rstrip("/") for l in f if l.strip() and not l.startswith("#")]
    def ignored(rel):
        parts = rel.split("/")
        return any(fnmatch.fnmatch("/".join(parts[:i]), pat) for pat in ignore for i in range(1, len(parts) + 1))
    for d in ("build", "build-deploy", ".git"):
        if not ignored(d):
            err(f"Dockerfile.dockerignore does not exclude {d}")
    # Which images each build stage stages.
    staged_by = {}
    for name, st in stages.items():
        for op, arg in st["ins"]:
            if op == "RUN" and "stage.sh" in arg:
                m = re.search(r"stage\.sh(.*?)(?:&&|$)", arg)
                staged_by[name] = set(w for w in m.group(1).split() if w in STAGED) if m else set()
    # Instructions.
    k8s_ports = k8s_container_ports()
    for name, st in stages.items():
        copies_from = []
        for op, arg in st["ins"]:
            if op in ("COPY", "ADD"):
                words = arg.split()
                opts = [w for w in words if w.startswith("--")]
                rest = [w for w in words if not w.startswith("--")]
                src, dst = rest[:-1], rest[-1]
                frm = next((o.split("=", 1)[1] for o in opts if o.startswith("--from=")), None)
                if frm is None:
                    for s in src:
                        rel = os.path.normpath(s).lstrip("./") or "."
                        if rel != "." and not os.path.exists(os.path.join(REPO, rel)):
                            err(f"stage {name}: COPY {s}: not in the repository")
                        elif rel != "." and ignored(rel):
                            err(f"stage {name}: COPY {s}: excluded by Dockerfile.dockerignore")
                else:
                    if frm not in stages or order.index(frm) >= order.index(name):
                        err(f"stage {name}: COPY --from={frm}: not an earlier stage")
                    copies_from.append((frm, src, dst))
        if name in TARGETS:
            image, k8s_image = TARGETS[name]
            ops = dict((op, arg) for op, arg in st["ins"])
            staged = [c for c in copies_from if any(s.rstrip("/") == f"/staging/{image}" for s in c[1])]
            if not staged:
                err(f"stage {name}: does not COPY /staging/{image}/")
            for frm, _, dst in staged:
                if image not in staged_by.get(frm, set()):
                    err(f"stage {name}: copies /staging/{image} from {frm}, whose stage.sh call does not stage {image}")
                if dst != "/":
                    err(f"stage {name}: /staging/{image}/ must be copied to /")
            ep = json_or_words(ops.get("ENTRYPOINT", "[]"))
            if ep[:1] != [STAGED[image][1]]:
                err(f"stage {name}: ENTRYPOINT {ep} is not {STAGED[image][1]} (stage.sh's layout)")
            if image != "worker-cuda":
                pk = f"deploy/docker/packages/{image}.txt"
                if not any(op == "COPY" and pk in arg for op, arg in st["ins"]):
                    err(f"stage {name}: does not install {pk}")
                if not st["base"].startswith("debian:") or "slim" not in st["base"]:
                    err(f"stage {name}: runtime base {st['base']} should be debian slim")
            elif not re.match(r"nvidia/cuda:.*-runtime-", st["base"]):
                err(f"stage {name}: the CUDA worker runs on an nvidia/cuda runtime image, not {st['base']}")
            src = SOURCES.get(k8s_image)
            if src:
                known = source_flags(src)
                for flag in arg_flags(json_or_words(ops.get("CMD", "[]"))):
                    if flag not in known:
                        err(f"stage {name}: CMD flag --{flag} is not a flag of {src}")
            exposed = sorted(int(p.split("/")[0]) for op, arg in st["ins"] if op == "EXPOSE" for p in arg.split())
            if k8s_image in k8s_ports and exposed != sorted(k8s_ports[k8s_image]):
                err(f"stage {name}: EXPOSE {exposed} differs from the container ports in deploy/k8s "
                    f"{sorted(k8s_ports[k8s_image])}")
            users = [arg for op, arg in st["ins"] if op == "USER"]
            if not users or users[-1].split(":")[0] in ("0", "root"):
                err(f"stage {name}: runs as root")
    # Scripts.
    r = subprocess.run(["bash", "-n", os.path.join(DOCKER, "stage.sh")], capture_output=True, text=True)
    if r.returncode != 0:
        err(f"stage.sh: {r.stderr.strip()}")
    try:
        with open(os.path.join(DOCKER, "libcheck.py")) as f:
            compile(f.read(), "libcheck.py", "exec")
    except SyntaxError as e:
        err(f"libcheck.py: {e}")
    for p in glob.glob(os.path.join(DOCKER, "packages", "*.txt")):
        image = os.path.basename(p)[:-4]
        if image not in STAGED:
            err(f"packages/{image}.txt belongs to no image")
    for e in errors:
        print(f"FAIL: {e}")
    print(f"Dockerfile: {len(stages)} stages, targets {sorted(TARGETS)}: "
          f"{'OK' if not errors else str(len(errors)) + ' problem(s)'}")
    return 1 if errors else 0


def k8s_container_ports():
    ports = {}
    for path in glob.glob(os.path.join(REPO, "deploy", "k8s", "*.yaml")):
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if not isinstance(d, dict):
                    continue
                spec = (d.get("spec") or {}).get("template", {}).get("spec") if isinstance(d.get("spec"), dict) else None
                for c in (spec or {}).get("containers", []) or []:
                    image = c.get("image", "").rsplit(":", 1)[0]
                    ports[image] = [p["containerPort"] for p in c.get("ports", []) or []]
    return ports


if __name__ == "__main__":
    sys.exit(main())
