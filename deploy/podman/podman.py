#!/usr/bin/env python3
"""Turns the deployment files into what buildah and `podman kube play` (4.3, Debian 12) run.

  podman.py containerfile --dockerfile deploy/docker/Dockerfile --out FILE
      deploy/docker/Dockerfile with its build stages replaced by one stage that copies the
      binaries staged from a local CPU build (deploy/docker/stage.sh) from the build context:
      `FROM scratch AS build` + `COPY staging/ /staging/`. The runtime stages (runtime,
      cache-server, router, worker-cpu: user, packages, COPY, USER, EXPOSE, ENTRYPOINT, CMD)
      are kept verbatim, so the images are the Dockerfile's. The CUDA stages are dropped (their
      base images live on a registry this machine cannot reach).

  podman.py kube --k8s deploy/k8s --out FILE --tag TAG --models-dir DIR [--model-path PATH]
                 --credentials DIR --secret-volumes DIR
      deploy/k8s (the kustomization's resources, in order) rendered for `podman kube play`,
      one replica of each tier, every change printed in the output's header. podman 4.3 plays
      Pods, Deployments, PersistentVolumeClaims and ConfigMaps only and has no Services, so:
        - StatefulSets and Deployments become Pods named <name>-<i> (what a StatefulSet
          names its pods; the pod name is what podman's network DNS resolves), their
          volumeClaimTemplates PersistentVolumeClaims named <template>-<pod> (podman volumes);
        - Service names in the ConfigMap become those pod names;
        - the GPU worker runs the CPU image with --device=cpu and no GPU request;
        - sizes meant for an 8B model on a GPU node are scaled to stories260K on this VM;
        - status.podIP (not supported by podman) is replaced by the pod name;
        - Secret volumes (the kustomization's secretGenerator: TLS per role, API keys) become
          hostPath folders under --secret-volumes holding the Secret's keys as files (mode
          0440, group: the pod's fsGroup), made from --credentials, a folder laid out as
          deploy/k8s/secrets (deploy/local/make-credentials.sh writes it); the flags and
          mount paths stay the manifests';
        - the models PVC becomes a hostPath volume of the host's model folder, still mounted
          read-only (a podman volume bound to it fails: podman chowns a named volume to the
          container's user, "lchown ...: read-only file system", and must never chown the
          shared model folder);
        - $(VAR) in command and args is expanded by the render (Kubernetes does it from the
          container's env; podman 4.3 passes "$(MODEL_PATH)" through literally);
        - container ports are dropped: podman 4.3's kube play publishes every containerPort on
          the same host port, so any process of the host on 8000, 50051, ... keeps the pod
          from starting ("cannot listen on the TCP port"); the pods reach each other, and
          up.sh reaches them, by their addresses on the bridge network, on any port;
        - probes are dropped: podman 4.3 ignores gRPC probes, and runs HTTP ones as
          curl healthchecks on systemd timers (no systemd here, no curl in the images);
          up.sh checks every component's health endpoint instead;
        - Services, PodDisruptionBudgets, Namespace and the monitoring objects (Prometheus)
          are left out (nothing in podman plays them).
"""
import argparse
import copy
import os
import re
import sys

import yaml

# Images: the manifests' image -> the image up.sh builds.
IMAGES = {
    "sparsex/cache-server": "localhost/sparsex/cache-server",
    "sparsex/router": "localhost/sparsex/router",
    "sparsex/worker": "localhost/sparsex/worker-cpu",
    "quay.io/coreos/etcd": "localhost/sparsex/etcd",
}

# Flags whose values are sized for a GPU node serving an 8B model: the values for stories260K
# on this VM (the flag must exist in the manifest: a renamed flag fails the render).
ARG_OVERRIDES = {
    "sparsex-worker": {
        "--device": "cpu",
        "--kv_blocks": "2048",
        "--host_store_mb": "256",
    },
    "sparsex-cache": {
        "--memory_capacity": "256M",
        "--disk_capacity": "1G",
        "--warm_load_bytes": "64M",
    },
}

# Memory limits per workload (the manifests ask for up to 96 GiB).
MEMORY_LIMITS = {
    "sparsex-etcd": "512Mi",
    "sparsex-cache": "1Gi",
    "sparsex-worker": "2Gi",
    "sparsex-router": "1Gi",
}

KEEP_WORKLOADS = ("sparsex-etcd", "sparsex-cache", "sparsex-worker", "sparsex-router")


def fail(msg):
    print(f"podman.py: {msg}", file=sys.stderr)
    sys.exit(1)


# ------------------------------------------------------------------------ containerfile
def containerfile(args):
    text = open(args.dockerfile).read()
    lines = text.splitlines()
    preamble, stages, cur = [], [], None
    for line in lines:
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?\s*$", line, re.I)
        if m:
            cur = {"from": m.group(1), "name": m.group(2), "lines": [line]}
            stages.append(cur)
        elif cur is None:
            preamble.append(line)
        else:
            cur["lines"].append(line)
    names = [s["name"] for s in stages]
    keep = ["runtime", "cache-server", "router", "worker-cpu"]
    for n in keep + ["build"]:
        if n not in names:
            fail(f"{args.dockerfile}: stage {n} not found (stages: {names})")
    out = [
        "# Generated by deploy/podman/podman.py from deploy/docker/Dockerfile: the build",
        "# stages are replaced by the binaries staged from a local CPU build (stage.sh);",
        "# the runtime stages below are the Dockerfile's, unchanged.",
    ]
    out += [l for l in preamble if l.startswith("ARG ")]
    out += ["", "FROM scratch AS build", "COPY staging/ /staging/", ""]
    for s in stages:
        if s["name"] in keep:
            # A stage's trailing comment lines introduce the next stage: keep them anyway.
            out += s["lines"]
    body = "\n".join(out) + "\n"
    # Every stage kept must take what it copies from the build stage from /staging.
    for m in re.finditer(r"COPY --from=(\S+) (\S+)", body):
        if m.group(1) != "build" or not m.group(2).startswith("/staging/"):
            fail(f"unexpected COPY --from in a runtime stage: {m.group(0)}")
    open(args.out, "w").write(body)


# ------------------------------------------------------------------------------- kube
def secret_generators(k8s_dir):
    """{Secret name: {key: source path relative to k8s_dir}} of the kustomization."""
    kust = yaml.safe_load(open(os.path.join(k8s_dir, "kustomization.yaml")))
    out = {}
    for g in kust.get("secretGenerator", []) or []:
        keys = {}
        for entry in g.get("files", []) or []:
            key, eq, path = entry.partition("=")
            keys[key if eq else os.path.basename(entry)] = path if eq else entry
        out[g["name"]] = keys
    return out


def secret_volume(v, pod_spec, generators, credentials, out_dir, where, changes):
    """Turns a Secret volume into a hostPath folder with the Secret's keys as files."""
    name = v["secret"]["secretName"]
    if name not in generators:
        fail(f"{where}: volume {v['name']}: Secret {name} is not made by the kustomization's "
             "secretGenerator")
    if v["secret"].get("items"):
        fail(f"{where}: volume {v['name']}: Secret items are not rendered")
    folder = os.path.join(out_dir, name)
    os.makedirs(folder, exist_ok=True)
    sc = pod_spec.get("securityContext") or {}
    gid = sc.get("fsGroup", sc.get("runAsGroup", 0))
    for key, src in generators[name].items():
        # The kustomization reads secrets/<path>; the same file lies at <credentials>/<path>.
        head, _, rest = src.partition("/")
        if head != "secrets" or not rest:
            fail(f"{where}: Secret {name}: source {src} is not under secrets/")
        path = os.path.join(credentials, rest)
        if not os.path.isfile(path):
            fail(f"{where}: Secret {name} key {key}: {path} does not exist "
                 "(deploy/local/make-credentials.sh makes it)")
        dst = os.path.join(folder, key)
        with open(path, "rb") as f_in, open(dst + ".tmp", "wb") as f_out:
            f_out.write(f_in.read())
        os.chown(dst + ".tmp", 0, gid)
        os.chmod(dst + ".tmp", 0o440)
        os.replace(dst + ".tmp", dst)
    os.chown(folder, 0, gid)
    os.chmod(folder, 0o750)
    v.pop("secret")
    v["hostPath"] = {"path": folder, "type": "Directory"}
    changes.append(f"{where}: volume {v['name']} (Secret {name}) -> hostPath {folder} "
                   f"({', '.join(sorted(generators[name]))}; mode 0440, group {gid})")


def load_k8s(k8s_dir):
    kust = yaml.safe_load(open(os.path.join(k8s_dir, "kustomization.yaml")))
    docs = []
    for res in kust["resources"]:
        for d in yaml.safe_load_all(open(os.path.join(k8s_dir, res))):
            if d:
                docs.append((res, d))
    return docs


def image_for(image, tag, changes):
    repo = image.rsplit(":", 1)[0] if ":" in image.split("/")[-1] else image
    if repo not in IMAGES:
        fail(f"no local image for {image}")
    new = f"{IMAGES[repo]}:{tag}"
    changes.append(f"image {image} -> {new}")
    return new


def set_flag(args, flag, value, where, changes):
    for i, a in enumerate(args):
        if a.split("=", 1)[0] == flag:
            if a != f"{flag}={value}":
                changes.append(f"{where}: {a} -> {flag}={value}")
            args[i] = f"{flag}={value}"
            return
    fail(f"{where}: flag {flag} not in the manifest's args (renamed?)")


def expand_vars(c, pod_name, config, where, changes):
    """Kubernetes expands $(VAR) in command and args from the container's env; podman 4.3's
    kube play does not (the process gets the literal "$(MODEL_PATH)"), so the render does it,
    from the same sources: value, configMapKeyRef (sparsex-config) and fieldRef metadata.name."""
    values = {}
    for e in c.get("env", []):
        if "value" in e:
            values[e["name"]] = e["value"]
            continue
        src = e.get("valueFrom", {})
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            if ref["name"] != "sparsex-config" or ref["key"] not in config:
                fail(f"{where}: env {e['name']}: unknown ConfigMap key {ref}")
            values[e["name"]] = config[ref["key"]]
        elif src.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            values[e["name"]] = pod_name
        else:
            fail(f"{where}: env {e['name']}: unsupported source {src}")

    def sub(a):
        def one(m):
            if m.group(1) not in values:
                fail(f"{where}: $({m.group(1)}) is not defined in env")
            return values[m.group(1)]
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, a)

    for key in ("command", "args"):
        if key in c:
            before = list(c[key])
            c[key] = [sub(a) for a in c[key]]
            if c[key] != before:
                changes.append(f"{where}: $(VAR) in {key} expanded by the render (podman 4.3 "
                               "does not)")


def render_pod(workload, index, template, tag, replicas, claims, config, models_dir,
               secrets, changes):
    name = workload["metadata"]["name"]
    pod_name = f"{name}-{index}"
    spec = copy.deepcopy(template["spec"])
    where = pod_name
    for key in ("affinity", "tolerations"):
        if spec.pop(key, None) is not None:
            changes.append(f"{where}: {key} dropped (one node)")
    spec["hostname"] = pod_name
    for c in spec["containers"]:
        c["image"] = image_for(c["image"], tag, changes)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if c.pop(probe, None) is not None:
                changes.append(f"{where}/{c['name']}: {probe} dropped (podman 4.3: no gRPC "
                               "probes; HTTP ones need systemd timers)")
        if c.pop("ports", None):
            changes.append(f"{where}/{c['name']}: ports not published on the host (reached "
                           "on the bridge network)")
        if "lifecycle" in c:
            c.pop("lifecycle")
            changes.append(f"{where}/{c['name']}: preStop dropped (no endpoints to drain)")
        mem = MEMORY_LIMITS[name]
        c["resources"] = {"limits": {"memory": mem}}
        changes.append(f"{where}/{c['name']}: resources -> memory limit {mem}")
        env = []
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if ref == "status.podIP":
                changes.append(f"{where}/{c['name']}: env {e['name']} (status.podIP) dropped; "
                               "$(" + e["name"] + ") -> $(POD_NAME) (resolved by podman DNS)")
                c["args"] = [a.replace("$(" + e["name"] + ")", "$(POD_NAME)")
                             for a in c.get("args", [])]
                continue
            env.append(e)
        if env:
            c["env"] = env
        args = c.get("args", [])
        for flag, value in ARG_OVERRIDES.get(name, {}).items():
            set_flag(args, flag, value, f"{where}/{c['name']}", changes)
        if name == "sparsex-etcd":
            headless = workload["spec"]["serviceName"]
            members = ",".join(f"{name}-{i}=http://{name}-{i}:2380" for i in range(replicas))
            for i, a in enumerate(args):
                if a.startswith("--initial-cluster="):
                    args[i] = f"--initial-cluster={members}"
                else:
                    args[i] = a.replace(f"$(POD_NAME).{headless}", "$(POD_NAME)")
            changes.append(f"{where}: etcd peer/client URLs $(POD_NAME).{headless} -> "
                           f"$(POD_NAME), --initial-cluster={members}")
        expand_vars(c, pod_name, config, f"{where}/{c['name']}", changes)
    volumes = spec.get("volumes", [])
    for v in volumes:
        if "secret" in v:
            secret_volume(v, spec, *secrets, where, changes)
        if v.get("persistentVolumeClaim", {}).get("claimName") == "sparsex-models":
            v.pop("persistentVolumeClaim")
            v["hostPath"] = {"path": models_dir, "type": "Directory"}
            changes.append(f"{where}: volume {v['name']} (PVC sparsex-models) -> hostPath "
                           f"{models_dir} (mounted read-only as in the manifest)")
    for tmpl in workload["spec"].get("volumeClaimTemplates", []):
        claim = f"{tmpl['metadata']['name']}-{pod_name}"
        volumes.append({"name": tmpl["metadata"]["name"],
                        "persistentVolumeClaim": {"claimName": claim}})
        claims.append(claim)
        changes.append(f"{where}: volumeClaimTemplate {tmpl['metadata']['name']} -> PVC {claim}")
    if volumes:
        spec["volumes"] = volumes
    meta = {"name": pod_name, "labels": dict(template["metadata"].get("labels", {}))}
    if template["metadata"].get("annotations"):
        meta["annotations"] = dict(template["metadata"]["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def kube(args):
    docs = load_k8s(args.k8s)
    changes, out, claims = [], [], []
    workloads = {}
    config = None
    for res, d in docs:
        kind, name = d["kind"], d["metadata"]["name"]
        if kind in ("StatefulSet", "Deployment") and name in KEEP_WORKLOADS:
            workloads[name] = d
        elif kind == "ConfigMap" and name == "sparsex-config":
            config = copy.deepcopy(d)
        else:
            changes.append(f"{res}: {kind} {name} left out")
    for n in KEEP_WORKLOADS:
        if n not in workloads:
            fail(f"workload {n} not in {args.k8s}")
    if config is None:
        fail("ConfigMap sparsex-config not found")

    replicas = 1
    data = config["data"]
    new = {
        "ETCD_ENDPOINTS": ",".join(f"sparsex-etcd-{i}:2379" for i in range(replicas)),
        "CACHE_SERVERS": ",".join(f"sparsex-cache-{i}:50070" for i in range(replicas)),
        "MODEL_PATH": args.model_path,
    }
    for k, v in new.items():
        if k not in data:
            fail(f"ConfigMap sparsex-config has no {k}")
        if data[k] != v:
            changes.append(f"ConfigMap sparsex-config: {k} {data[k]} -> {v}")
            data[k] = v
    config["metadata"].pop("namespace", None)

    secrets = (secret_generators(args.k8s), os.path.abspath(args.credentials),
               os.path.abspath(args.secret_volumes))
    pods = {}
    for name in KEEP_WORKLOADS:
        w = workloads[name]
        if w["spec"].get("replicas", 1) != replicas:
            changes.append(f"{w['kind']} {name}: replicas {w['spec'].get('replicas', 1)} -> "
                           f"{replicas}")
        pods[name] = [render_pod(w, i, w["spec"]["template"], args.tag, replicas, claims,
                                 data, os.path.abspath(args.models_dir), secrets, changes)
                      for i in range(replicas)]

    out.append(config)
    for claim in claims:
        out.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "metadata": {"name": claim},
                    "spec": {"accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": "1Gi"}}}})
    for name in KEEP_WORKLOADS:
        out += pods[name]

    header = ["# Generated by deploy/podman/podman.py kube from deploy/k8s for `podman kube play`.",
              "# Changes from the Kubernetes manifests:"]
    header += [f"#   {c}" for c in dict.fromkeys(changes)]
    with open(args.out, "w") as f:
        f.write("\n".join(header) + "\n")
        yaml.safe_dump_all(out, f, sort_keys=False, explicit_start=True)
    for p in [p for n in KEEP_WORKLOADS for p in pods[n]]:
        print(p["metadata"]["name"])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("containerfile")
    c.add_argument("--dockerfile", required=True)
    c.add_argument("--out", required=True)
    k = sub.add_parser("kube")
    k.add_argument("--k8s", required=True)
    k.add_argument("--out", required=True)
    k.add_argument("--tag", required=True)
    k.add_argument("--model-path", default="/models/stories260K/stories260K.gguf")
    k.add_argument("--models-dir", required=True, help="host folder mounted at /models")
    k.add_argument("--credentials", required=True,
                   help="credentials laid out as deploy/k8s/secrets (make-credentials.sh)")
    k.add_argument("--secret-volumes", required=True,
                   help="folder for the Secrets' files (one hostPath folder per Secret)")
    args = ap.parse_args()
    {"containerfile": containerfile, "kube": kube}[args.cmd](args)


if __name__ == "__main__":
    main()
