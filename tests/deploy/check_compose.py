#!/usr/bin/env python3
"""Offline checks of the single-host compose files in deploy/compose (ctest: deploy_compose).
No Docker or podman engine runs here, so this checks what can go wrong without one:

  * compose.yaml and compose.podman.yaml parse (YAML) and use only ${VAR}, ${VAR:-default} and
    ${VAR:?message} interpolation, which Docker Compose and podman-compose both understand;
    `docker-compose config` accepts both files (its schema; skipped, with a note, without it)
  * services: etcd, cache, worker and router; each SparseX image is a target of
    deploy/docker/Dockerfile (sparsex/<target>), its command holds only --flag=value args whose
    flags exist in that binary's sources (as check_k8s.py does for deploy/k8s)
  * credentials: every flag deploy/k8s gives the same image with a path under /etc/sparsex/ (mutual
    TLS files, the router's API keys and scope key, any later one) is in the compose command with
    the same path; no --insecure_loopback; each such path lies in a read-only bind mount of
    ./secrets/<...>, and deploy/compose/prepare.sh, run into a scratch folder, makes exactly the
    files those flags name (skipped, with a note, without openssl)
  * wiring: --etcd, --cache_servers and --advertise_address name the etcd, cache and worker
    services at the ports their own flags listen on; router and worker serve the same --model;
    nothing binds loopback inside a container; published ports are ports the service listens on
  * GPU: the worker reserves NVIDIA GPUs the Docker way (deploy.resources.reservations.devices,
    driver nvidia, capability gpu) and compose.podman.yaml adds the CDI device nvidia.com/gpu=all;
    no other service gets a GPU
  * the model directory is mounted read-only; prepare.sh passes bash -n; deploy/compose/.gitignore
    keeps secrets/ out of git and Dockerfile.dockerignore out of image builds
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_k8s import SOURCES, source_flags, arg_flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE = os.path.join(REPO, "deploy", "compose")
K8S = os.path.join(REPO, "deploy", "k8s")
errors, notes = [], []
IMAGES = {"cache": "sparsex/cache-server", "worker": "sparsex/worker", "router": "sparsex/router"}
INTERP = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def err(m):
    errors.append(m)


def expand(s):
    """The string with every ${VAR...} replaced as if VAR were unset (its default, or X)."""
    def one(m):
        op, arg = m.group(2), m.group(3)
        if op in ("-", ":-"):
            return arg
        return "X"
    return INTERP.sub(one, s)


def check_interpolation(path, text):
    # Comments are not interpolated; values are.
    text = "\n".join("" if ln.lstrip().startswith("#") else ln for ln in text.splitlines())
    for m in re.finditer(r"\$\{[^}]*\}", text):
        if not INTERP.fullmatch(m.group(0)):
            err(f"{path}: {m.group(0)}: only ${{VAR}}, ${{VAR:-default}}, ${{VAR:?message}}")
    for m in re.finditer(r"\$(?![{$])", text):
        line = text[:m.start()].count("\n") + 1
        err(f"{path}:{line}: a bare '$' (compose would interpolate it; write $$)")


def k8s_args():
    """{image without tag: [args]} of the SparseX containers in deploy/k8s."""
    out = {}
    for f in sorted(glob.glob(os.path.join(K8S, "*.yaml"))):
        with open(f) as fh:
            for doc in yaml.safe_load_all(fh):
                if not isinstance(doc, dict):
                    continue
                pod = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
                for c in pod.get("containers", []) or []:
                    image = (c.get("image") or "").rsplit(":", 1)[0]
                    if image in SOURCES:
                        out.setdefault(image, []).extend(c.get("args", []) or [])
    return out


def port_of(value):
    m = re.search(r":(\d+)$", value or "")
    return m.group(1) if m else value


def bind_mounts(svc):
    """[(source, target, read_only)] of the service's short-syntax volumes."""
    out = []
    for v in svc.get("volumes", []) or []:
        if not isinstance(v, str):
            err(f"volume {v!r}: use the short syntax SOURCE:TARGET[:ro] (both tools read it)")
            continue
        parts = v.split(":")
        if len(parts) < 2:
            continue
        out.append((":".join(parts[:-2]) if len(parts) > 2 else parts[0],
                    parts[-2] if len(parts) > 2 else parts[1],
                    len(parts) > 2 and "ro" in parts[-1].split(",")))
    return out


def main():
    docs = {}
    for name in ("compose.yaml", "compose.podman.yaml"):
        path = os.path.join(COMPOSE, name)
        with open(path) as f:
            text = f.read()
        check_interpolation(name, text)
        try:
            docs[name] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            err(f"{name}: {e}")
    if errors:
        return report()
    services = docs["compose.yaml"].get("services") or {}
    for want in ("etcd", "cache", "worker", "router"):
        if want not in services:
            err(f"compose.yaml: no service {want}")
    if errors:
        return report()

    with open(os.path.join(REPO, "deploy", "docker", "Dockerfile")) as f:
        targets = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", f.read(), re.M | re.I))
    k8s = k8s_args()
    flags_of = {}
    for name, image in IMAGES.items():
        svc = services[name]
        img = expand(str(svc.get("image", "")))
        if img != image + ":latest":
            err(f"{name}: image {svc.get('image')} is not {image} (by default)")
        target = image.split("/", 1)[1]
        if target not in targets:
            err(f"{name}: {image}: no target {target} in deploy/docker/Dockerfile")
        cmd = svc.get("command")
        if not isinstance(cmd, list):
            err(f"{name}: command must be a list of --flag=value args (the image's ENTRYPOINT is the binary)")
            continue
        cmd = [expand(str(a)) for a in cmd]
        for a in cmd:
            if not a.startswith("--") or "=" not in a:
                err(f"{name}: arg {a!r} is not --flag=value")
        flags = arg_flags(cmd)
        flags_of[name] = flags
        known = source_flags(SOURCES[image])
        for flag in flags:
            if flag not in known:
                err(f"{name}: --{flag} is not a flag of {SOURCES[image]}")
        if "insecure_loopback" in flags:
            err(f"{name}: --insecure_loopback (the compose network is not loopback)")
        for flag, value in flags.items():
            if value and (value.startswith("127.") or value.startswith("localhost")):
                err(f"{name}: --{flag}={value} binds loopback inside the container")
        # Credentials: what deploy/k8s gives this image, with the same paths.
        mounts = bind_mounts(svc)
        for flag, value in arg_flags(k8s.get(image, [])).items():
            if not (value or "").startswith("/etc/sparsex/"):
                continue
            if flags.get(flag) != value:
                err(f"{name}: deploy/k8s runs {image} with --{flag}={value}; compose has "
                    f"{'--' + flag + '=' + flags[flag] if flag in flags else 'no --' + flag}")
        for flag, value in flags.items():
            if not (value or "").startswith("/etc/sparsex/"):
                continue
            inside = [m for m in mounts if value.startswith(m[1].rstrip("/") + "/")]
            if not inside:
                err(f"{name}: --{flag}={value} is in no mounted directory")
                continue
            src, target, ro = inside[0]
            if not ro:
                err(f"{name}: {src}:{target} must be mounted read-only")
            if not src.startswith("./secrets/"):
                err(f"{name}: {src}: credentials come from ./secrets/ (prepare.sh)")
        for src, target, ro in mounts:
            if target == "/models" and not ro:
                err(f"{name}: the model directory must be mounted read-only")

    # Wiring between the services.
    f = flags_of
    if f.get("worker") and f.get("router") and f.get("cache"):
        cache_port = f["cache"].get("grpc_port")
        if f["worker"].get("cache_servers") != f"cache:{cache_port}":
            err(f"worker: --cache_servers={f['worker'].get('cache_servers')}, expected cache:{cache_port}")
        if f["worker"].get("advertise_address") != f"worker:{f['worker'].get('port')}":
            err(f"worker: --advertise_address must be worker:<--port> (the router dials it)")
        for name in ("worker", "router"):
            if f[name].get("etcd") != "etcd:2379":
                err(f"{name}: --etcd={f[name].get('etcd')}, expected etcd:2379")
        if f["worker"].get("model") != f["router"].get("model"):
            err("router and worker serve different --model paths")
        if f["worker"].get("device") != "cuda":
            err("worker: --device=cuda expected (the CUDA image)")
        etcd_cmd = " ".join(map(str, services["etcd"].get("command") or []))
        if "--listen-client-urls=http://0.0.0.0:2379" not in etcd_cmd:
            err("etcd: must listen for clients on 0.0.0.0:2379")
        listens = {
            "router": {port_of(f["router"].get(k)) for k in ("grpc_address", "http_address", "admin_address")},
            "worker": {f["worker"].get("port"), f["worker"].get("metrics_port")},
            "cache": {f["cache"].get("grpc_port"), f["cache"].get("metrics_port")},
        }
        for name, ports in listens.items():
            for p in services[name].get("ports", []) or []:
                container = expand(str(p)).rsplit(":", 1)[-1]
                if container not in ports:
                    err(f"{name}: publishes {p}, but the service listens on {sorted(ports)}")

    # GPU: Docker's device reservation in compose.yaml, CDI in the podman override.
    for name, svc in services.items():
        devs = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices")
        if name == "worker":
            ok = any(d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])
                     and (d.get("count") == "all" or d.get("device_ids")) for d in devs or [])
            if not ok:
                err("worker: no deploy.resources.reservations.devices entry with driver nvidia, "
                    "capabilities [gpu] and count all")
        elif devs or svc.get("devices"):
            err(f"{name}: only the worker gets a GPU")
    pod = (docs["compose.podman.yaml"].get("services") or {})
    if set(pod) != {"worker"}:
        err(f"compose.podman.yaml: overrides {sorted(pod)}, expected the worker only")
    elif "nvidia.com/gpu=all" not in (pod["worker"].get("devices") or []):
        err("compose.podman.yaml: the worker needs devices: [nvidia.com/gpu=all] (CDI)")

    # Docker Compose's own reading (schema, interpolation, the merge of the podman override),
    # where docker-compose is installed; `config` starts nothing.
    dc = shutil.which("docker-compose")
    if dc is None:
        notes.append("no docker-compose: its schema check not run")
    else:
        env = dict(os.environ, SPX_MODELS_DIR="/models-on-host", SPX_MODEL="model")
        r = subprocess.run([dc, "-f", "compose.yaml", "-f", "compose.podman.yaml", "config", "-q"],
                           cwd=COMPOSE, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            err(f"docker-compose config: {(r.stderr or r.stdout).strip()}")
        env.pop("SPX_MODEL")
        r = subprocess.run([dc, "-f", "compose.yaml", "config", "-q"], cwd=COMPOSE, env=env,
                           capture_output=True, text=True)
        if r.returncode == 0 or "SPX_MODEL" not in r.stderr:
            err("docker-compose config: an unset SPX_MODEL must stop it, naming the variable")

    # prepare.sh makes the files the flags name.
    prep = os.path.join(COMPOSE, "prepare.sh")
    if subprocess.run(["bash", "-n", prep]).returncode != 0:
        err("prepare.sh: bash -n failed")
    if not os.access(prep, os.X_OK):
        err("prepare.sh is not executable")
    with open(os.path.join(COMPOSE, ".gitignore")) as fh:
        if "/secrets/" not in fh.read().split():
            err("deploy/compose/.gitignore must ignore /secrets/")
    with open(os.path.join(REPO, "deploy", "docker", "Dockerfile.dockerignore")) as fh:
        if "deploy/compose/secrets" not in fh.read().split():
            err("deploy/docker/Dockerfile.dockerignore must keep deploy/compose/secrets out of builds")
    if shutil.which("openssl") is None:
        notes.append("no openssl: prepare.sh not run")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            # A copy of deploy/compose and deploy/local, so the run writes under the scratch dir.
            for sub in ("compose", "local"):
                shutil.copytree(os.path.join(REPO, "deploy", sub), os.path.join(tmp, "deploy", sub),
                                ignore=shutil.ignore_patterns("secrets"))
            r = subprocess.run([os.path.join(tmp, "deploy", "compose", "prepare.sh"), "acme"],
                               capture_output=True, text=True)
            if r.returncode != 0:
                err(f"prepare.sh failed: {r.stderr.strip()}")
            else:
                base = os.path.join(tmp, "deploy", "compose")
                secrets = os.path.join(base, "secrets")
                if os.stat(secrets).st_mode & 0o077:
                    err("prepare.sh: secrets/ must be accessible to its owner only (0700)")
                for name in IMAGES:
                    mounts = bind_mounts(services[name])
                    for flag, value in flags_of.get(name, {}).items():
                        if not (value or "").startswith("/etc/sparsex/"):
                            continue
                        for src, target, _ in mounts:
                            if value.startswith(target.rstrip("/") + "/"):
                                host = os.path.join(base, src, value[len(target.rstrip("/")) + 1:])
                                if not os.path.isfile(host):
                                    err(f"{name}: --{flag}={value}: prepare.sh makes no {src}/"
                                        f"{os.path.relpath(host, os.path.join(base, src))}")
                                elif not os.stat(host).st_mode & 0o004:
                                    err(f"{name}: {host}: not readable by the container's uid 10001")
                if os.path.exists(os.path.join(secrets, "router", "tls", "ca-key.pem")) or \
                        glob.glob(os.path.join(secrets, "*", "**", "api_key.*"), recursive=True):
                    err("prepare.sh: the CA key or a tenant's API key is in a mounted directory")
    return report()


def report():
    for n in notes:
        print(f"note: {n}")
    for e in errors:
        print(f"FAIL: {e}")
    print(f"deploy/compose: {'OK' if not errors else str(len(errors)) + ' problem(s)'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
