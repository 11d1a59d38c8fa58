#!/usr/bin/env python3
"""deploy/compose/compose.yaml run with podman-compose, the CUDA worker swapped for the CPU one
(ctest: deploy_compose_cpu, label podman, opt-in). What it shows: the services find each other by
name over mutual TLS with the credentials prepare.sh lays out (mounted read-only, read by uid
10001), the worker registers in etcd and the router routes to it, the API refuses a request
without a key and serves one with it, and a restarted worker fetches its segments from the cache
server over UCX. What it cannot show: the GPU (no CUDA image, no GPU here) and Docker.

The compose file is copied into a scratch folder with prepare.sh's credentials, and changed only
where a CPU run needs it: the worker's image is worker-cpu, --device=cpu, the CUDA-sized
--kv_blocks and --host_store_mb and the cache server's capacities are dropped or made small, and
no port is published (the test talks to the containers' addresses). Every other flag, mount and
name is the file's.

Images: localhost/sparsex/{etcd,cache-server,router,worker-cpu}:podman in the podman storage of
deploy/podman/up.sh (`deploy/podman/up.sh images`, work folder $SPARSEX_PODMAN_WORK, default
/var/tmp/sparsex-podman). Skipped (77) unless SPARSEX_PODMAN_TEST=1, root, podman and
podman-compose, those images and stories260K under $SPARSEX_MODELS.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import yaml

sys.dont_write_bytecode = True
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORK = os.environ.get("SPARSEX_PODMAN_WORK", "/var/tmp/sparsex-podman")
MODELS = os.environ.get("SPARSEX_MODELS", os.path.join(os.path.dirname(REPO), "shared", "models"))
MODEL = "stories260K/stories260K.gguf"
PROJECT = f"spxcompose{os.getpid()}"
IMAGES = ["etcd", "cache-server", "router", "worker-cpu"]


def skip(why):
    print(f"skipped: {why}")
    sys.exit(77)


def podman_env():
    env = dict(os.environ)
    env["CONTAINERS_CONF"] = os.path.join(WORK, "containers.conf")
    env["CONTAINERS_STORAGE_CONF"] = os.path.join(WORK, "storage.conf")
    return env


def run(cmd, env, check=True, timeout=300, **kw):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return r


def http(url, key=None, body=None, timeout=30):
    req = urllib.request.Request(url, data=body.encode() if body else None)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e)


def cpu_variant(src, dst):
    """compose.yaml with the CUDA worker swapped for the CPU one and no published ports."""
    with open(src) as f:
        c = yaml.safe_load(f)
    for s in c["services"].values():
        s.pop("ports", None)
        s.pop("deploy", None)
    w = c["services"]["worker"]
    w["image"] = w["image"].replace("}worker:", "}worker-cpu:")
    drop = ("--kv_blocks=", "--host_store_mb=")
    w["command"] = [a.replace("--device=cuda", "--device=cpu") for a in w["command"]
                    if not a.startswith(drop)]
    small = {"--memory_capacity=": "256M", "--disk_capacity=": "1G"}
    cache = c["services"]["cache"]
    cache["command"] = [next((k + v for k, v in small.items() if a.startswith(k)), a)
                        for a in cache["command"]]
    with open(dst, "w") as f:
        yaml.safe_dump(c, f, sort_keys=False)


def main():
    if os.environ.get("SPARSEX_PODMAN_TEST") != "1":
        skip("set SPARSEX_PODMAN_TEST=1 (root, podman, podman-compose, deploy/podman images)")
    if os.geteuid() != 0:
        skip("needs root (the podman setup of deploy/podman/up.sh)")
    for tool in ("podman", "podman-compose"):
        if shutil.which(tool) is None:
            skip(f"no {tool}")
    if not os.path.isfile(os.path.join(MODELS, MODEL)):
        skip(f"no {MODEL} under {MODELS}")
    env = podman_env()
    if not os.path.isfile(env["CONTAINERS_CONF"]):
        skip(f"no podman setup in {WORK} (deploy/podman/up.sh images)")
    for img in IMAGES:
        if run(["podman", "image", "exists", f"localhost/sparsex/{img}:podman"], env,
               check=False).returncode != 0:
            skip(f"no image localhost/sparsex/{img}:podman (deploy/podman/up.sh images)")

    tmp = tempfile.mkdtemp(prefix="spx-compose-")
    for sub in ("compose", "local"):
        shutil.copytree(os.path.join(REPO, "deploy", sub), os.path.join(tmp, "deploy", sub),
                        ignore=shutil.ignore_patterns("secrets"))
    base = os.path.join(tmp, "deploy", "compose")
    run([os.path.join(base, "prepare.sh"), "smoke"], env)
    key = open(os.path.join(base, "secrets", "api_key.smoke")).read().strip()
    cpu_variant(os.path.join(base, "compose.yaml"), os.path.join(base, "compose.cpu.yaml"))
    env.update(SPX_MODELS_DIR=MODELS, SPX_MODEL=MODEL, SPX_IMAGE_PREFIX="localhost/sparsex/",
               SPX_TAG="podman", SPX_ETCD_IMAGE="localhost/sparsex/etcd:podman")
    compose = ["podman-compose", "-p", PROJECT, "-f", "compose.cpu.yaml"]
    failures = []
    try:
        run(compose + ["up", "-d"], env, cwd=base)
        ip = run(["podman", "inspect", "-f",
                  "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                  f"{PROJECT}_router_1"], env).stdout.strip()
        api = f"http://{ip}:8000"
        deadline = time.time() + 120
        while True:
            status, body = http(api + "/healthz")
            if status == 200 and '"healthy_workers":1' in body:
                break
            if time.time() > deadline:
                raise RuntimeError(f"router not healthy with one worker after 120 s: {status} {body}")
            time.sleep(0.5)
        print(f"router {api}: {body}")

        status, _ = http(api + "/v1/models")
        if status != 401:
            failures.append(f"/v1/models without a key: {status}, expected 401")
        status, body = http(api + "/v1/models", key)
        models = json.loads(body)["data"] if status == 200 else []
        if not models or models[0].get("workers") != 1:
            failures.append(f"/v1/models: {status} {body}")

        a = "Lily had a red ball. She liked to play with it in the park every day and every night."
        b = "Tom saw the ball and wanted it. He asked Lily if he could play too, and she said yes."

        def complete(segments, store_first=False):
            req = {"segments": segments, "max_tokens": 4, "temperature": 0}
            if store_first:
                req["reuse"] = {"store_after_misses": 1}
            status, body = http(api + "/v1/completions", key, json.dumps(req))
            if status != 200:
                raise RuntimeError(f"completion: {status} {body}")
            return json.loads(body)["usage"]

        # Both segments computed, stored at their first miss and written back to the cache
        # server; then reused in another order.
        for _ in range(2):
            complete([a, b, "What happened?"], store_first=True)
        complete([b, a, "Then?"], store_first=True)
        time.sleep(2)  # write-back to the cache server runs after the responses
        run(compose + ["restart", "worker"], env, cwd=base)  # empty memory and host tiers
        deadline = time.time() + 120
        while '"healthy_workers":1' not in http(api + "/healthz")[1]:
            if time.time() > deadline:
                raise RuntimeError("the restarted worker did not come back in 120 s")
            time.sleep(0.5)
        time.sleep(2)  # the router's index follows the new instance
        u = complete(["Why?", b, a, "Then?"])["sparsex"]
        print(f"after the worker restart: {u}")
        if u["segments_fetched"] < 1 or u["fetch_failures"] != 0:
            failures.append(f"restarted worker: segments_fetched {u['segments_fetched']}, "
                            f"fetch_failures {u['fetch_failures']}: expected >= 1 and 0")
    except Exception as e:  # a step that failed: report it with the containers' logs
        failures.append(str(e))
        for svc in ("etcd", "cache", "worker", "router"):
            logs = run(["podman", "logs", "--tail", "20", f"{PROJECT}_{svc}_1"], env, check=False)
            print(f"--- {svc}\n{logs.stdout}{logs.stderr}")
    finally:
        run(compose + ["down", "-v"], env, check=False, cwd=base)
        run(["podman", "network", "rm", "-f", f"{PROJECT}_default"], env, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    for f in failures:
        print(f"FAIL: {f}")
    print(f"deploy/compose on podman (CPU worker): {'OK' if not failures else 'FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
