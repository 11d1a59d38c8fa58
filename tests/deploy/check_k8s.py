#!/usr/bin/env python3
"""Offline validation of the Kubernetes manifests in deploy/k8s (ctest: deploy_k8s_manifests).

Checks, without a cluster:
  * every file parses; every object has apiVersion, kind, metadata.name and the sparsex labels;
    kustomization.yaml lists exactly the manifests of the folder
  * schema: field names and value types of every object against the Kubernetes API models of
    the python3-kubernetes package, and its required fields (skipped, with a note, when the
    package is missing)
  * workloads: selectors match their pod labels; StatefulSets name an existing headless Service;
    every container of a SparseX component has readiness and liveness probes whose port is a
    declared container port and whose path is a health endpoint that binary serves; a `grpc`
    probe (Kubernetes >= 1.24) names the container's gRPC port by number and a grpc.health.v1
    service that binary reports (GRPC_HEALTH_SERVICES); the router's readiness asks for
    sparsex.v1.SparseX (SERVING only with a healthy worker) and the worker's liveness is not
    gRPC (NOT_SERVING while draining would restart it mid-drain)
  * services: each selects at least one pod template, and each target port exists there
  * flags: every --flag in a SparseX container's args exists in that binary's sources
    (cache_server/main.cc, gpu_worker/service/main.cc, router/main.cc); the ports in the flags
    are the declared container ports; nothing binds loopback; $(VAR) references are defined
  * references: ConfigMaps and keys (env, volumes, subPath), PVCs, ServiceAccounts, Roles
  * cluster wiring: CACHE_SERVERS names every cache-server replica by its StatefulSet DNS name
    and gRPC port; ETCD_ENDPOINTS points at an etcd Service port; etcd's --initial-cluster
    names every replica; the worker asks for a GPU and its grace period outlasts its drain
  * credentials: every SparseX container runs with mutual TLS (--tls_ca/--tls_cert/--tls_key),
    the router also with --api_keys_file and --scope_key_file, the worker with --kv_mac_key_file;
    no --insecure_loopback anywhere;
    each of those paths is a key of a mounted Secret (cert and key from the same one; the key
    files without subPath, so changes reach the router); every Secret a pod uses is defined or
    made by the kustomization's secretGenerator, whose sources lie in a folder deploy/k8s/.gitignore
    ignores and never include the CA key or a tenant's API key; no committed file holds a private
    key; no gRPC probe of a mutual-TLS port (the kubelet's probe speaks plaintext); Secret files
    readable by the non-root process (world read, or group read with a pod fsGroup)
  * network policies: a default-deny ingress policy, every workload selected by one, and who may
    connect to each port of each component exactly as EXPECTED_INGRESS says (router API from
    anywhere, worker gRPC from routers, cache servers on every TCP port from workers, etcd from
    routers and workers, metrics from Prometheus)
  * monitoring: the Prometheus scrape jobs select existing pods and ports, the Prometheus pod
    mounts the rules where rule_files looks, prometheus.io/port annotations name the metrics
    port; every metric the alert rules use exists in the sources; monitoring-config.yaml is
    up to date (gen-configmaps.py --check); ConfigMaps stay under 1 MiB

  check_k8s.py [K8S_DIR]   (default deploy/k8s)
Exit 0 when everything holds, 1 with one line per problem otherwise.
"""
import glob
import os
import re
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(REPO, "deploy", "k8s")
if len(sys.argv) > 1:  # another copy of the folder (the checker's own tests mutate one)
    K8S = os.path.abspath(sys.argv[1])
NAMESPACE = "sparsex"

errors = []
notes = []


def err(msg):
    errors.append(msg)


def oid(o):
    return f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"


# ------------------------------------------------------------------------------ loading

def load():
    objs = []
    files = sorted(f for f in glob.glob(os.path.join(K8S, "*.yaml")) if not f.endswith("kustomization.yaml"))
    for path in files:
        try:
            with open(path) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            err(f"{os.path.basename(path)}: YAML: {e}")
            continue
        for d in docs:
            if not isinstance(d, dict):
                err(f"{os.path.basename(path)}: a document is not a mapping")
                continue
            d["__file__"] = os.path.basename(path)
            objs.append(d)
    return files, objs


def check_basics(files, objs):
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    listed = kust.get("resources", [])
    have = [os.path.basename(f) for f in files]
    for r in listed:
        if r not in have:
            err(f"kustomization.yaml: resource {r} does not exist")
    for h in have:
        if h not in listed:
            err(f"kustomization.yaml: {h} is not listed in resources")
    if kust.get("namespace") != NAMESPACE:
        err(f"kustomization.yaml: namespace must be {NAMESPACE}")
    images = {c["image"].split(":")[0] for o in objs for c in containers(o)}
    for im in kust.get("images", []):
        if im["name"] not in images:
            err(f"kustomization.yaml: image {im['name']} is used by no container")
    seen = set()
    for o in objs:
        for field in ("apiVersion", "kind"):
            if not o.get(field):
                err(f"{o['__file__']}: object without {field}")
        md = o.get("metadata") or {}
        if not md.get("name"):
            err(f"{o['__file__']}: {o.get('kind')} without metadata.name")
        key = (o.get("kind"), md.get("name"))
        if key in seen:
            err(f"{o['__file__']}: duplicate {key[0]}/{key[1]}")
        seen.add(key)
        ns = md.get("namespace")
        if ns not in (None, NAMESPACE):
            err(f"{oid(o)}: namespace {ns} (everything lives in {NAMESPACE})")
        labels = md.get("labels") or {}
        if labels.get("app.kubernetes.io/name") != "sparsex" or labels.get("app.kubernetes.io/part-of") != "sparsex":
            err(f"{oid(o)}: missing labels app.kubernetes.io/name=sparsex, app.kubernetes.io/part-of=sparsex")
    ns_objs = [o for o in objs if o.get("kind") == "Namespace"]
    if [o["metadata"]["name"] for o in ns_objs] != [NAMESPACE]:
        err(f"expected exactly one Namespace object named {NAMESPACE}")


# ------------------------------------------------------------------------------- schema

def schema_check(objs):
    try:
        import kubernetes.client as kc
        from kubernetes.client import ApiClient
    except ImportError:
        notes.append("schema check skipped: python3-kubernetes is not installed "
                     "(scripts/setup.sh installs it; run with Debian's /usr/bin/python3)")
        return
    api = ApiClient()

    def model_of(o):
        group_version, kind = o.get("apiVersion", ""), o.get("kind", "")
        version = group_version.split("/")[-1]
        return getattr(kc, version.capitalize() + kind, None)

    def walk(value, typ, path):
        if value is None:
            return
        if typ.startswith("list["):
            if not isinstance(value, list):
                return err(f"{path}: expected a list, got {type(value).__name__}")
            for i, v in enumerate(value):
                walk(v, typ[5:-1], f"{path}[{i}]")
        elif typ.startswith("dict("):
            if not isinstance(value, dict):
                return err(f"{path}: expected a mapping, got {type(value).__name__}")
            inner = typ[5:-1].split(", ", 1)[1]
            for k, v in value.items():
                if inner == "str" and isinstance(v, (int, float)) and not isinstance(v, bool) \
                        and (path.endswith(".requests") or path.endswith(".limits")):
                    continue  # resource quantities may be plain numbers
                walk(v, inner, f"{path}.{k}")
        elif typ == "str":
            if not isinstance(value, str):
                err(f"{path}: expected a string, got {type(value).__name__} ({value!r})")
        elif typ == "int":
            if not isinstance(value, int) or isinstance(value, bool):
                err(f"{path}: expected an integer, got {value!r}")
        elif typ == "bool":
            if not isinstance(value, bool):
                err(f"{path}: expected true/false, got {value!r}")
        elif typ == "float":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                err(f"{path}: expected a number, got {value!r}")
        elif typ in ("object", "datetime", "date"):
            return
        else:
            cls = getattr(kc, typ, None)
            if cls is None:
                return
            if not isinstance(value, dict):
                return err(f"{path}: expected a {typ} mapping, got {type(value).__name__}")
            json_to_attr = {v: k for k, v in cls.attribute_map.items()}
            for k, v in value.items():
                if typ == "V1Probe" and k == "grpc" and k not in json_to_attr:
                    check_grpc_action(v, f"{path}.{k}")
                    continue
                if k not in json_to_attr:
                    err(f"{path}: unknown field '{k}' ({typ})")
                    continue
                walk(v, cls.openapi_types[json_to_attr[k]], f"{path}.{k}")

    for o in objs:
        cls = model_of(o)
        if cls is None:
            err(f"{oid(o)}: no API model for {o.get('apiVersion')} {o.get('kind')}")
            continue
        body = {k: v for k, v in o.items() if k != "__file__"}
        walk(body, cls.__name__, oid(o))
        try:
            api._ApiClient__deserialize(body, cls.__name__)  # raises on missing required fields
        except (ValueError, TypeError) as e:
            err(f"{oid(o)}: {e}")


def check_grpc_action(value, path):
    """Probe.grpc (GRPCAction, Kubernetes >= 1.24), which the python3-kubernetes models of
    Debian 12 (client 22.6, API 1.22) predate: port (int32, required; a name is not allowed),
    service (string, optional)."""
    if not isinstance(value, dict):
        return err(f"{path}: expected a V1GRPCAction mapping, got {type(value).__name__}")
    for k in value:
        if k not in ("port", "service"):
            err(f"{path}: unknown field '{k}' (V1GRPCAction)")
    port = value.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        err(f"{path}.port: must be a port number (1-65535; names are not allowed), got {port!r}")
    if "service" in value and not isinstance(value["service"], str):
        err(f"{path}.service: expected a string, got {value['service']!r}")


# ---------------------------------------------------------------------------- workloads

def pod_spec(o):
    if o.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return o.get("spec", {}).get("template", {}).get("spec", {})
    return None


def pod_labels(o):
    return o.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}) or {}


def containers(o):
    ps = pod_spec(o)
    return (ps or {}).get("containers", []) or []


def workloads(objs):
    return [o for o in objs if pod_spec(o) is not None]


def by_kind(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o.get("kind") == kind}


def component(o):
    return (o.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/component")


# Binary of each SparseX image, and the source file that defines its flags.
SOURCES = {
    "sparsex/cache-server": "cache_server/main.cc",
    "sparsex/worker": "gpu_worker/service/main.cc",
    "sparsex/worker-cpu": "gpu_worker/service/main.cc",
    "sparsex/router": "router/main.cc",
}
# Health endpoints each binary serves (from the sources: common/metrics/http_server.cc,
# router/http_frontend.cc), and etcd's / Prometheus's own.
HEALTH_PATHS = {
    "sparsex/cache-server": {"/healthz", "/metrics"},
    "sparsex/worker": {"/healthz", "/metrics"},
    "sparsex/worker-cpu": {"/healthz", "/metrics"},
    "sparsex/router": {"/healthz", "/livez", "/metrics"},
    "quay.io/coreos/etcd": {"/health", "/health?serializable=true", "/metrics"},
    "prom/prometheus": {"/-/ready", "/-/healthy"},
}

# grpc.health.v1 service names each binary reports (proto/grpc_health.h): "" is the process; the
# router also reports sparsex.v1.SparseX, SERVING only while a worker is healthy
# (router/grpc_frontend.cc).
GRPC_HEALTH_SERVICES = {
    "sparsex/cache-server": {""},
    "sparsex/worker": {""},
    "sparsex/worker-cpu": {""},
    "sparsex/router": {"", "sparsex.v1.SparseX"},
}


# Binaries whose gRPC server takes only mutual TLS under the cluster CA (proto/grpc_tls.h); the
# router's public gRPC port is plaintext (API keys authenticate its callers).
MTLS_GRPC = {"sparsex/cache-server", "sparsex/worker", "sparsex/worker-cpu"}


def source_flags(rel):
    with open(os.path.join(REPO, rel)) as f:
        src = f.read()
    flags = set(re.findall(r'\bf\["([a-z0-9_]+)"\]', src))        # cache_server/main.cc
    flags |= set(re.findall(r'\bf\.Add\(\s*"([a-z0-9_]+)"', src))  # common/flags.h FlagSet
    return flags


def arg_flags(args):
    """{flag: value} of '--name=value' args (value None for a bare '--name')."""
    out = {}
    for a in args:
        if not isinstance(a, str) or not a.startswith("--"):
            continue
        name, eq, value = a[2:].partition("=")
        out[name] = value if eq else None
    return out


def port_of(value):
    m = re.search(r":(\d+)$", value or "")
    return int(m.group(1)) if m else (int(value) if value and value.isdigit() else None)


def check_workloads(objs):
    services = by_kind(objs, "Service")
    cms = by_kind(objs, "ConfigMap")
    pvcs = by_kind(objs, "PersistentVolumeClaim")
    sas = by_kind(objs, "ServiceAccount")
    for o in workloads(objs):
        spec = o.get("spec", {})
        sel = (spec.get("selector") or {}).get("matchLabels") or {}
        labels = pod_labels(o)
        if not sel or any(labels.get(k) != v for k, v in sel.items()):
            err(f"{oid(o)}: selector {sel} does not match the pod labels {labels}")
        if o["kind"] == "StatefulSet":
            svc = services.get(spec.get("serviceName"))
            if svc is None:
                err(f"{oid(o)}: serviceName {spec.get('serviceName')} is not a Service here")
            elif svc["spec"].get("clusterIP") != "None":
                err(f"{oid(o)}: its Service {svc['metadata']['name']} must be headless (clusterIP: None)")
        ps = pod_spec(o)
        if ps.get("serviceAccountName") and ps["serviceAccountName"] not in sas:
            err(f"{oid(o)}: serviceAccountName {ps['serviceAccountName']} is not defined")
        volumes = {v["name"]: v for v in ps.get("volumes", []) or []}
        claim_templates = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", []) or []}
        for v in volumes.values():
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in pvcs:
                err(f"{oid(o)}: volume {v['name']} claims {v['persistentVolumeClaim']['claimName']}, not defined")
            if "configMap" in v and v["configMap"]["name"] not in cms:
                err(f"{oid(o)}: volume {v['name']} uses ConfigMap {v['configMap']['name']}, not defined")
        for c in containers(o):
            where = f"{oid(o)} container {c.get('name')}"
            image = c.get("image", "").rsplit(":", 1)[0]
            ports = {p.get("name"): p["containerPort"] for p in c.get("ports", []) or []}
            numbers = set(ports.values())
            for m in c.get("volumeMounts", []) or []:
                if m["name"] not in volumes and m["name"] not in claim_templates:
                    err(f"{where}: volumeMount {m['name']} has no volume")
                elif m.get("subPath") and "configMap" in volumes.get(m["name"], {}):
                    cm = cms.get(volumes[m["name"]]["configMap"]["name"])
                    if cm is not None and m["subPath"] not in (cm.get("data") or {}):
                        err(f"{where}: subPath {m['subPath']} is not a key of ConfigMap {cm['metadata']['name']}")
            env = {}
            for e in c.get("env", []) or []:
                env[e["name"]] = e
                ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                if ref:
                    cm = cms.get(ref["name"])
                    if cm is None:
                        err(f"{where}: env {e['name']} reads ConfigMap {ref['name']}, not defined")
                    elif ref["key"] not in (cm.get("data") or {}):
                        err(f"{where}: env {e['name']} reads key {ref['key']}, not in ConfigMap {ref['name']}")
            for a in (c.get("args", []) or []) + (c.get("command", []) or []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(a)):
                    if var not in env:
                        err(f"{where}: $({var}) in '{a}' is not an env var of the container "
                            "(Kubernetes would pass it through literally)")
            # Probes.
            sparsex = image in SOURCES
            for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
                probe = c.get(kind)
                if probe is None:
                    if kind != "startupProbe" and (sparsex or image in HEALTH_PATHS):
                        err(f"{where}: no {kind}")
                    continue
                if "grpc" in probe:
                    g = probe["grpc"] or {}
                    if not isinstance(g, dict):
                        continue  # reported by the schema check
                    if sparsex and g.get("port") != ports.get("grpc"):
                        err(f"{where}: {kind} grpc port {g.get('port')!r} is not the container's "
                            f"grpc port ({ports.get('grpc')!r})")
                    elif g.get("port") not in numbers:
                        err(f"{where}: {kind} grpc port {g.get('port')!r} is not a declared container port")
                    if image in GRPC_HEALTH_SERVICES and g.get("service", "") not in GRPC_HEALTH_SERVICES[image]:
                        err(f"{where}: {kind} asks for grpc.health.v1 service {g.get('service')!r}, "
                            f"which {image} does not report ({sorted(GRPC_HEALTH_SERVICES[image])})")
                    if image == "sparsex/router" and kind == "readinessProbe" and \
                            g.get("service") != "sparsex.v1.SparseX":
                        err(f"{where}: readinessProbe must ask for service sparsex.v1.SparseX (the "
                            "overall status stays SERVING without workers)")
                    if image.startswith("sparsex/worker") and kind == "livenessProbe":
                        err(f"{where}: livenessProbe must not be gRPC (a draining worker is "
                            "NOT_SERVING: the drain would be cut short by a restart)")
                    if image in MTLS_GRPC and g.get("port") == ports.get("grpc"):
                        err(f"{where}: {kind} is a gRPC probe of the mutual-TLS gRPC port: the "
                            "kubelet's gRPC probe speaks plaintext and never passes the "
                            "handshake (probe /healthz on the metrics port)")
                    continue
                handler = probe.get("httpGet") or probe.get("tcpSocket")
                if handler is None:
                    err(f"{where}: {kind} is none of grpc, httpGet, tcpSocket")
                    continue
                p = handler.get("port")
                if (isinstance(p, str) and p not in ports) or (isinstance(p, int) and p not in numbers):
                    err(f"{where}: {kind} port {p!r} is not a declared container port {sorted(ports)}")
                if "httpGet" in probe and image in HEALTH_PATHS:
                    if probe["httpGet"].get("path") not in HEALTH_PATHS[image]:
                        err(f"{where}: {kind} path {probe['httpGet'].get('path')} is not an endpoint "
                            f"of {image} ({sorted(HEALTH_PATHS[image])})")
                    if sparsex and kind == "readinessProbe" and probe["httpGet"].get("path") != "/healthz":
                        err(f"{where}: readinessProbe must use /healthz")
            # Prometheus annotations name the metrics port.
            ann = o["spec"]["template"].get("metadata", {}).get("annotations", {}) or {}
            if ann.get("prometheus.io/scrape") == "true":
                if not ann.get("prometheus.io/port", "").isdigit() or int(ann["prometheus.io/port"]) not in numbers:
                    err(f"{where}: prometheus.io/port {ann.get('prometheus.io/port')} is not a container port")
            if sparsex:
                check_sparsex_container(o, c, image, ports, where)
            if image == "quay.io/coreos/etcd":
                check_etcd(o, c, ports, where)


def check_sparsex_container(o, c, image, ports, where):
    known = source_flags(SOURCES[image])
    flags = arg_flags(c.get("args", []) or [])
    for name in flags:
        base = name[2:] if name.startswith("no") and name[2:] in known else name
        if base not in known:
            err(f"{where}: --{name} is not a flag of {SOURCES[image]}")
    loopback = [f"--{k}={v}" for k, v in flags.items() if v and re.match(r"^(127\.|localhost)", v)]
    if loopback:
        err(f"{where}: binds loopback, unreachable from other pods: {loopback}")
    want = {}
    if image == "sparsex/cache-server":
        want = {"grpc": port_of(flags.get("grpc_port")), "metrics": port_of(flags.get("metrics_port"))}
        if flags.get("address") not in ("0.0.0.0",):
            err(f"{where}: --address=0.0.0.0 needed (default binds 127.0.0.1)")
        if not flags.get("disk_path"):
            err(f"{where}: --disk_path is required for the RocksDB tier")
        else:
            mounts = [m["mountPath"] for m in c.get("volumeMounts", []) or []]
            if flags["disk_path"] not in mounts:
                err(f"{where}: --disk_path {flags['disk_path']} is not a mounted volume {mounts}")
    elif image in ("sparsex/worker", "sparsex/worker-cpu"):
        want = {"grpc": port_of(flags.get("port")), "metrics": port_of(flags.get("metrics_port"))}
        if flags.get("address") != "0.0.0.0":
            err(f"{where}: --address=0.0.0.0 needed (default binds 127.0.0.1)")
        adv = flags.get("advertise_address")
        if not adv or port_of(adv) != want["grpc"]:
            err(f"{where}: --advertise_address must name the pod address and the gRPC port {want['grpc']}")
        for required in ("model", "etcd", "worker_id"):
            if not flags.get(required):
                err(f"{where}: --{required} is not set")
        drain_s = int(flags.get("drain_timeout_ms") or 30000) / 1000
        grace = pod_spec(o).get("terminationGracePeriodSeconds", 30)
        if grace <= drain_s:
            err(f"{where}: terminationGracePeriodSeconds {grace} must exceed the drain timeout ({drain_s:g} s)")
        if image == "sparsex/worker":
            res = c.get("resources", {}) or {}
            gpu_l = (res.get("limits") or {}).get("nvidia.com/gpu")
            gpu_r = (res.get("requests") or {}).get("nvidia.com/gpu", gpu_l)
            if not gpu_l or int(gpu_l) < 1 or gpu_r != gpu_l:
                err(f"{where}: needs nvidia.com/gpu in limits (and equal requests)")
            if flags.get("device") != "cuda":
                err(f"{where}: --device=cuda expected on the GPU image")
    elif image == "sparsex/router":
        want = {"grpc": port_of(flags.get("grpc_address")), "http": port_of(flags.get("http_address"))}
        if flags.get("admin_address"):
            want["admin"] = port_of(flags["admin_address"])
        for k in ("grpc_address", "http_address") + (("admin_address",) if "admin" in want else ()):
            if not (flags.get(k) or "").startswith("0.0.0.0:"):
                err(f"{where}: --{k} must bind 0.0.0.0 (default binds 127.0.0.1)")
        if not flags.get("model") or not (flags.get("etcd") or flags.get("workers")):
            err(f"{where}: --model and --etcd (or --workers) are required")
    for name, port in want.items():
        if port is None:
            err(f"{where}: no port flag for '{name}'")
        elif ports.get(name) != port:
            err(f"{where}: the flags serve '{name}' on {port}, the container port says {ports.get(name)}")
    extra = set(ports) - set(want)
    if extra:
        err(f"{where}: container ports {sorted(extra)} match no flag")


def check_etcd(o, c, ports, where):
    flags = arg_flags(c.get("args", []) or [])
    if port_of(flags.get("listen-client-urls")) != ports.get("client"):
        err(f"{where}: --listen-client-urls port is not the 'client' container port")
    if port_of(flags.get("listen-peer-urls")) != ports.get("peer"):
        err(f"{where}: --listen-peer-urls port is not the 'peer' container port")
    replicas = o["spec"].get("replicas", 1)
    members = dict(m.split("=", 1) for m in (flags.get("initial-cluster") or "").split(",") if "=" in m)
    name, svc = o["metadata"]["name"], o["spec"].get("serviceName")
    want = {f"{name}-{i}": f"http://{name}-{i}.{svc}:{ports.get('peer')}" for i in range(replicas)}
    if members != want:
        err(f"{where}: --initial-cluster {members} should list the {replicas} replicas: {want}")


def check_services(objs):
    pods = workloads(objs)
    for s in by_kind(objs, "Service").values():
        sel = s["spec"].get("selector") or {}
        matched = [w for w in pods if sel and all(pod_labels(w).get(k) == v for k, v in sel.items())]
        if not matched:
            err(f"{oid(s)}: selector {sel} matches no pod template")
            continue
        for p in s["spec"].get("ports", []) or []:
            tp = p.get("targetPort", p.get("port"))
            for w in matched:
                cports = [cp for c in containers(w) for cp in c.get("ports", []) or []]
                ok = any(cp.get("name") == tp for cp in cports) if isinstance(tp, str) else \
                    any(cp["containerPort"] == tp for cp in cports)
                if not ok:
                    err(f"{oid(s)}: port {p.get('name')} targets {tp!r}, which {oid(w)} does not declare")
                if isinstance(tp, str) and p.get("name") != tp:
                    notes.append(f"{oid(s)}: port named {p.get('name')} targets {tp}")


def check_rbac(objs):
    roles, sas = by_kind(objs, "Role"), by_kind(objs, "ServiceAccount")
    for rb in by_kind(objs, "RoleBinding").values():
        if rb["roleRef"]["kind"] == "Role" and rb["roleRef"]["name"] not in roles:
            err(f"{oid(rb)}: roleRef {rb['roleRef']['name']} is not a Role here")
        for s in rb.get("subjects", []):
            if s["kind"] == "ServiceAccount" and s["name"] not in sas:
                err(f"{oid(rb)}: subject {s['name']} is not a ServiceAccount here")
            if s["kind"] == "ServiceAccount" and s.get("namespace") != NAMESPACE:
                err(f"{oid(rb)}: ServiceAccount subject {s['name']} needs namespace {NAMESPACE}")


def check_wiring(objs):
    cfg = by_kind(objs, "ConfigMap").get("sparsex-config", {}).get("data", {})
    sts = by_kind(objs, "StatefulSet")
    services = by_kind(objs, "Service")
    cache = next((s for s in sts.values() if component(s) == "cache-server"), None)
    if cache is None:
        return err("no cache-server StatefulSet")
    grpc = next(p["containerPort"] for c in containers(cache) for p in c["ports"] if p["name"] == "grpc")
    name, svc, replicas = cache["metadata"]["name"], cache["spec"]["serviceName"], cache["spec"].get("replicas", 1)
    want = [f"{name}-{i}.{svc}:{grpc}" for i in range(replicas)]
    have = [s.strip() for s in cfg.get("CACHE_SERVERS", "").split(",") if s.strip()]
    if have != want:
        err(f"ConfigMap sparsex-config: CACHE_SERVERS {have} must list every cache-server replica: {want}")
    for ep in [s.strip() for s in cfg.get("ETCD_ENDPOINTS", "").split(",") if s.strip()]:
        host, _, port = ep.rpartition(":")
        base = host.split(".")[0]
        svc_obj = services.get(base) or services.get(host)
        if svc_obj is None:
            if "." not in host:
                err(f"ConfigMap sparsex-config: ETCD_ENDPOINTS {ep} is no Service here")
            continue  # an external etcd
        if int(port) not in [p["port"] for p in svc_obj["spec"]["ports"]]:
            err(f"ConfigMap sparsex-config: ETCD_ENDPOINTS {ep}: {host} has no port {port}")
    if cfg.get("UCX_NET_DEVICES", "") in ("lo",):
        err("ConfigMap sparsex-config: UCX_NET_DEVICES must not be lo")


# --------------------------------------------------------------------------- credentials

# Path flags each SparseX binary needs in Kubernetes: mutual TLS everywhere (cluster CA, own
# certificate and key), and on the router the API key file and the scope key. Plaintext
# (--insecure_loopback) is for a single host only and never appears here.
TLS_FLAGS = ("tls_ca", "tls_cert", "tls_key")
ROUTER_AUTH_FLAGS = ("api_keys_file", "scope_key_file")
# The workers seal the KV blocks they write to the cache cluster and verify what they fetch.
WORKER_KEY_FLAGS = ("kv_mac_key_file",)
# File names of a private key the kustomization must never turn into a Secret (the CA's signs
# any certificate; the tenants' API keys belong to the tenants).
NEVER_IN_SECRETS = (r"(^|/)ca-key\.pem$", r"(^|/)api_key\.[^/]+$")


def kustomization():
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        return yaml.safe_load(f) or {}


def generated_secrets():
    """{name: {key: source path}} of the kustomization's secretGenerator."""
    out = {}
    for g in kustomization().get("secretGenerator", []) or []:
        keys = {}
        for entry in (g.get("files", []) or []):
            key, eq, path = entry.partition("=")
            if not eq:
                key, path = os.path.basename(entry), entry
            keys[key] = path
        for lit in (g.get("literals", []) or []):
            keys[lit.split("=", 1)[0]] = None
        if g.get("envs") or g.get("env"):
            err(f"kustomization.yaml: secretGenerator {g.get('name')}: env files are not "
                "checked here; use files:")
        out[g.get("name")] = keys
    return out


def ignored_dirs():
    """Folders deploy/k8s/.gitignore excludes (lines like /secrets/)."""
    path = os.path.join(K8S, ".gitignore")
    if not os.path.exists(path):
        return []
    dirs = []
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#") and line.endswith("/"):
            dirs.append(line.strip("/"))
    return dirs


def check_credentials(objs):
    gen = generated_secrets()
    secrets = {name: set((o.get("data") or {}).keys()) | set((o.get("stringData") or {}).keys())
               for name, o in by_kind(objs, "Secret").items()}
    known = {name: set(keys) for name, keys in gen.items()}
    known.update(secrets)
    # Generated Secrets: sources inside an ignored folder of the kustomization (key material is
    # never committed), never the CA's private key or a tenant's API key.
    ignored = ignored_dirs()
    missing = []
    for name, keys in gen.items():
        for key, path in keys.items():
            if path is None:
                err(f"kustomization.yaml: secretGenerator {name}: literal {key} would commit a secret")
                continue
            norm = os.path.normpath(path)
            if os.path.isabs(path) or norm.startswith(".."):
                err(f"kustomization.yaml: secretGenerator {name}: {path} is outside deploy/k8s "
                    "(kustomize refuses it)")
            elif norm.split(os.sep)[0] not in ignored:
                err(f"kustomization.yaml: secretGenerator {name}: {path} is not in a folder "
                    f"deploy/k8s/.gitignore ignores ({ignored}): key material would be committed")
            if any(re.search(p, norm) for p in NEVER_IN_SECRETS):
                err(f"kustomization.yaml: secretGenerator {name}: {path} must never go into "
                    "the cluster")
            if not os.path.exists(os.path.join(K8S, path)) and path not in missing:
                missing.append(path)
    if missing:
        notes.append(f"{len(missing)} secretGenerator source(s) absent (e.g. {missing[0]}): "
                     "deploy/k8s/make-secrets.sh makes them; kubectl_dry_run.py checks a "
                     "generated set")
    # Committed manifests carry no private key.
    for root, dirs, files in os.walk(K8S):
        rel = os.path.relpath(root, K8S)
        if rel.split(os.sep)[0] in ignored:
            dirs[:] = []
            continue
        for fn in files:
            with open(os.path.join(root, fn), errors="replace") as f:
                if re.search(r"-----BEGIN [A-Z ]*PRIVATE KEY-----", f.read()):
                    err(f"{os.path.join(rel, fn)}: contains a private key")

    for o in workloads(objs):
        ps = pod_spec(o)
        volumes = {v["name"]: v for v in ps.get("volumes", []) or []}
        for v in volumes.values():
            refs = []
            if "secret" in v:
                refs.append((v["secret"].get("secretName"), v["secret"].get("items")))
            for src in (v.get("projected") or {}).get("sources", []) or []:
                if "secret" in src:
                    refs.append((src["secret"].get("name"), src["secret"].get("items")))
            mode = (v.get("secret") or {}).get("defaultMode", 0o644)
            if "secret" in v and not mode & 0o004:
                # Secret files belong to root, group fsGroup: a non-root process reads them only
                # through the group, which fsGroup adds to its groups.
                sc = ps.get("securityContext") or {}
                if sc.get("runAsUser", 0) != 0 and not (sc.get("fsGroup") is not None and mode & 0o040):
                    err(f"{oid(o)}: volume {v['name']}: mode {mode:04o} without world read needs "
                        "group read and a pod fsGroup, or the process (non-root) cannot read its "
                        "credentials")
            for name, items in refs:
                if name not in known:
                    err(f"{oid(o)}: volume {v['name']} mounts Secret {name}, which is neither "
                        "defined nor generated by the kustomization")
                    continue
                for it in items or []:
                    if it.get("key") not in known[name]:
                        err(f"{oid(o)}: volume {v['name']}: key {it.get('key')} is not in Secret {name}")
        for c in (ps.get("containers", []) or []) + (ps.get("initContainers", []) or []):
            where = f"{oid(o)} container {c.get('name')}"
            for e in c.get("env", []) or []:
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref and (ref.get("name") not in known or ref.get("key") not in known[ref.get("name")]):
                    err(f"{where}: env {e['name']} reads Secret {ref.get('name')} key {ref.get('key')}, "
                        "which is neither defined nor generated")
            for ef in c.get("envFrom", []) or []:
                name = (ef.get("secretRef") or {}).get("name")
                if name and name not in known:
                    err(f"{where}: envFrom Secret {name} is neither defined nor generated")
            args = [str(a) for a in (c.get("args", []) or []) + (c.get("command", []) or [])]
            if any(a.split("=", 1)[0] == "--insecure_loopback" for a in args):
                err(f"{where}: --insecure_loopback (plaintext, no API keys) is for one host; "
                    "Kubernetes runs with TLS and API keys")
            image = c.get("image", "").rsplit(":", 1)[0]
            if image not in SOURCES:
                continue
            flags = arg_flags(c.get("args", []) or [])
            need = TLS_FLAGS + (ROUTER_AUTH_FLAGS if image == "sparsex/router" else ()) + \
                (WORKER_KEY_FLAGS if image in ("sparsex/worker", "sparsex/worker-cpu") else ())
            secret_of = {}
            for flag in need:
                if not flags.get(flag):
                    err(f"{where}: --{flag} is not set (every SparseX process runs with mutual "
                        "TLS; the router also with API keys)")
                    continue
                secret_of[flag] = mounted_secret_key(c, volumes, known, flags[flag], where, flag)
            if secret_of.get("tls_cert") and secret_of.get("tls_key") and \
                    secret_of["tls_cert"][0] != secret_of["tls_key"][0]:
                err(f"{where}: --tls_cert and --tls_key come from different Secrets "
                    f"({secret_of['tls_cert'][0]}, {secret_of['tls_key'][0]})")
            for flag in ROUTER_AUTH_FLAGS:
                if secret_of.get(flag) and secret_of[flag][2]:
                    err(f"{where}: --{flag} is mounted with subPath: kubelet never updates a "
                        "subPath mount, so the router would not see a changed key file")


def mounted_secret_key(c, volumes, known, path, where, flag):
    """(secret, key, subPath?) of the Secret file at `path` in container c, or None (reported)."""
    for m in c.get("volumeMounts", []) or []:
        v = volumes.get(m["name"], {})
        sec = (v.get("secret") or {}).get("secretName")
        if sec is None:
            continue
        mp = m["mountPath"].rstrip("/")
        if m.get("subPath"):
            if path == mp:
                key = m["subPath"]
            else:
                continue
        elif path.startswith(mp + "/"):
            key = path[len(mp) + 1:]
        else:
            continue
        items = (v.get("secret") or {}).get("items")
        if items:  # items rename keys to paths
            by_path = {it.get("path"): it.get("key") for it in items}
            if key not in by_path:
                err(f"{where}: --{flag}={path}: {key} is not a path of volume {m['name']}'s items")
                return None
            key = by_path[key]
        if sec in known and key not in known[sec]:
            err(f"{where}: --{flag}={path}: Secret {sec} has no key {key} ({sorted(known[sec])})")
            return None
        return (sec, key, bool(m.get("subPath")))
    err(f"{where}: --{flag}={path} is not a file of a mounted Secret")
    return None


# ----------------------------------------------------------------------- network policies

ANY = "anywhere"            # a rule without `from`, an ipBlock or a namespaceSelector peer
NS_PODS = "namespace-pods"  # podSelector {}: every pod of the namespace
OTHER_PORT = "other TCP ports"
# Who may open a connection to each component's ports (container port names; OTHER_PORT: any
# undeclared TCP port, e.g. UCX's ephemeral listeners). Exact: a path missing here is broken,
# a path added here is a hole.
EXPECTED_INGRESS = {
    "router": {"grpc": {ANY}, "http": {ANY}, "admin": {"prometheus"}, OTHER_PORT: set()},
    "worker": {"grpc": {"router"}, "metrics": {"prometheus"}, OTHER_PORT: set()},
    "cache-server": {"grpc": {"worker"}, "metrics": {"worker", "prometheus"},
                     OTHER_PORT: {"worker"}},
    "etcd": {"client": {"router", "worker"}, "peer": {"etcd"}, "metrics": {"prometheus"},
             OTHER_PORT: set()},
    "prometheus": {"web": {NS_PODS}, OTHER_PORT: set()},
}


def selector_matches(sel, labels):
    if sel is None:
        return False
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e.get("key"), e.get("operator"), e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and labels.get(k) in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def check_network_policies(objs):
    pols = list(by_kind(objs, "NetworkPolicy").values())
    pods = [w for w in workloads(objs) if component(w)]
    if not any(p["spec"].get("podSelector") == {} and "Ingress" in (p["spec"].get("policyTypes") or [])
               and not p["spec"].get("ingress") for p in pols):
        err("no default-deny ingress NetworkPolicy (podSelector: {}, policyTypes: [Ingress], "
            "no ingress rules)")

    def sources(rule, where):
        peers = rule.get("from")
        if not peers:
            return {ANY}
        out = set()
        for peer in peers:
            if "ipBlock" in peer or "namespaceSelector" in peer:
                out.add(ANY)
            elif peer.get("podSelector") == {}:
                out.add(NS_PODS)
            elif "podSelector" in peer:
                hit = {component(w) for w in pods if selector_matches(peer["podSelector"], pod_labels(w))}
                if not hit:
                    err(f"{where}: from podSelector {peer['podSelector']} matches no pod")
                out |= hit
        return out

    def port_matches(rule_port, cport):
        if rule_port.get("protocol", "TCP") != cport.get("protocol", "TCP"):
            return False
        p = rule_port.get("port")
        if p is None:
            return True
        if isinstance(p, str):
            return cport.get("name") == p
        end = rule_port.get("endPort", p)
        return cport.get("containerPort") is not None and p <= cport["containerPort"] <= end

    for w in pods:
        comp = component(w)
        labels = pod_labels(w)
        selected = [p for p in pols if selector_matches(p["spec"].get("podSelector"), labels)
                    and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])]
        if not selected:
            err(f"{oid(w)}: no NetworkPolicy selects its pods (all ingress allowed)")
            continue
        cports = [cp for c in containers(w) for cp in c.get("ports", []) or []]
        allowed = {cp.get("name") or str(cp["containerPort"]): set() for cp in cports}
        allowed[OTHER_PORT] = set()
        other = {"name": None, "containerPort": None, "protocol": "TCP"}
        for p in selected:
            for i, rule in enumerate(p["spec"].get("ingress", []) or []):
                where = f"{oid(p)} ingress[{i}]"
                src = sources(rule, where)
                rports = rule.get("ports") or [{}]
                for rp in rports:
                    if isinstance(rp.get("port"), str) and not any(cp.get("name") == rp["port"] for cp in cports):
                        err(f"{where}: port {rp['port']} is no container port name of {oid(w)}")
                for cp in cports + [other]:
                    if any(port_matches(rp, cp) for rp in rports):
                        allowed[cp.get("name") or (str(cp["containerPort"]) if cp["containerPort"] else OTHER_PORT)] |= src
        for name, src in allowed.items():
            if name != OTHER_PORT and not src:
                err(f"{oid(w)}: port {name} admits no connection (NetworkPolicy)")
        want = EXPECTED_INGRESS.get(comp)
        if want is None:
            err(f"{oid(w)}: component {comp} has no expected ingress in check_k8s.py "
                "(EXPECTED_INGRESS): decide who may reach it")
            continue
        for name in sorted(set(want) | set(allowed)):
            if allowed.get(name, set()) != want.get(name, set()):
                err(f"{oid(w)}: port {name} admits {sorted(allowed.get(name, set())) or 'nothing'}, "
                    f"expected {sorted(want.get(name, set())) or 'nothing'}")
    for p in pols:
        sel = p["spec"].get("podSelector")
        if sel and not any(selector_matches(sel, pod_labels(w)) for w in pods):
            err(f"{oid(p)}: podSelector {sel} matches no pod")


# ---------------------------------------------------------------------------- monitoring

def metric_names_in_sources():
    names = set()
    paths = glob.glob(os.path.join(REPO, "**", "*.cc"), recursive=True) + \
        glob.glob(os.path.join(REPO, "**", "*.h"), recursive=True)
    for path in paths:
        if "/build" in path[len(REPO):]:
            continue
        with open(path, errors="replace") as f:
            names |= set(re.findall(r'"(sparsex_[a-z0-9_]+)"', f.read()))
    return names


def used_metrics(text):
    found = set()
    for m in re.findall(r"\b(sparsex_[a-z0-9_]+)", text):
        found.add(re.sub(r"_(bucket|sum|count)$", "", m))
    return found


def check_monitoring(objs):
    cms = by_kind(objs, "ConfigMap")
    for cm in cms.values():
        size = sum(len(k) + len(v.encode()) for k, v in (cm.get("data") or {}).items())
        if size > 1024 * 1024 - 4096:
            err(f"{oid(cm)}: {size} bytes of data; a ConfigMap holds at most 1 MiB")
    out = subprocess.run([sys.executable, os.path.join(K8S, "gen-configmaps.py"), "--check"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        err(out.stderr.strip() or "gen-configmaps.py --check failed")
    prom_cm = cms.get("sparsex-prometheus-config")
    rules_cm = cms.get("sparsex-prometheus-rules")
    if prom_cm is None or rules_cm is None:
        return err("the Prometheus ConfigMaps are missing (monitoring-config.yaml)")
    prom = yaml.safe_load(prom_cm["data"]["prometheus.yml"])
    # Where the Prometheus pod finds config and rules.
    deploy = next((d for d in workloads(objs) if component(d) == "prometheus"), None)
    if deploy is None:
        return err("no Prometheus Deployment")
    c = containers(deploy)[0]
    flags = arg_flags(c.get("args", []))
    vols = {v["name"]: v for v in pod_spec(deploy).get("volumes", [])}
    mounts = {}
    for m in c.get("volumeMounts", []):
        cm_name = (vols.get(m["name"], {}).get("configMap") or {}).get("name")
        mounts[m["mountPath"]] = (cm_name, m.get("subPath"))
    if mounts.get(flags.get("config.file")) != ("sparsex-prometheus-config", "prometheus.yml"):
        err(f"{oid(deploy)}: --config.file {flags.get('config.file')} is not the mounted prometheus.yml")
    for pattern in prom.get("rule_files", []):
        d, _, glob_part = pattern.rpartition("/")
        if mounts.get(d, (None,))[0] != "sparsex-prometheus-rules":
            err(f"{oid(deploy)}: rule_files {pattern}: {d} is not where sparsex-prometheus-rules is mounted")
        for key in rules_cm["data"]:
            if not glob.fnmatch.fnmatch(key, glob_part):
                err(f"rule file {key} does not match rule_files {pattern}")
    # Scrape jobs select existing pods and ports.
    pods = workloads(objs)
    jobs = {}
    for job in prom.get("scrape_configs", []):
        jobs[job["job_name"]] = job
        if "kubernetes_sd_configs" not in job:
            continue
        for sd in job["kubernetes_sd_configs"]:
            if sd.get("role") != "pod" or NAMESPACE not in sd.get("namespaces", {}).get("names", []):
                err(f"scrape job {job['job_name']}: expects role pod in namespace {NAMESPACE}")
        keep = {r["source_labels"][0]: r["regex"] for r in job.get("relabel_configs", [])
                if r.get("action") == "keep"}
        comp_re = keep.get("__meta_kubernetes_pod_label_app_kubernetes_io_component")
        port_re = keep.get("__meta_kubernetes_pod_container_port_name")
        matched = [w for w in pods if comp_re and re.fullmatch(comp_re, pod_labels(w).get("app.kubernetes.io/component", ""))]
        if not matched:
            err(f"scrape job {job['job_name']}: component regex {comp_re!r} matches no pod")
        for w in matched:
            names = [p.get("name", "") for cc in containers(w) for p in cc.get("ports", []) or []]
            hits = [n for n in names if port_re and re.fullmatch(port_re, n)]
            if len(hits) != 1:
                err(f"scrape job {job['job_name']}: port regex {port_re!r} must match exactly one port of {oid(w)} {names}")
            ann = w["spec"]["template"].get("metadata", {}).get("annotations", {}) or {}
            by_name = {p.get("name"): p["containerPort"] for cc in containers(w) for p in cc.get("ports", []) or []}
            if hits and ann.get("prometheus.io/port") and int(ann["prometheus.io/port"]) != by_name[hits[0]]:
                err(f"{oid(w)}: prometheus.io/port {ann['prometheus.io/port']} differs from the scraped port {hits[0]}")
    # Alert rules: the jobs they name exist; the metrics they use exist in the code.
    rules_text = rules_cm["data"]["sparsex-alerts.yml"]
    for j in set(re.findall(r'job="([^"]+)"', rules_text)):
        if j not in jobs:
            err(f"alert rules use job=\"{j}\", which prometheus.yml does not scrape")
    known = metric_names_in_sources()
    for m in sorted(used_metrics(rules_text)):
        if m not in known:
            err(f"alert rules use {m}, which no source file defines")
    # Dashboards: report metrics the code does not define.
    dash = cms.get("sparsex-grafana-dashboards", {}).get("data") or {}
    if not dash:
        notes.append("no Grafana dashboard in deploy/grafana yet")
    for name, text in dash.items():
        unknown = sorted(m for m in used_metrics(text) if m not in known)
        if unknown:
            notes.append(f"dashboard {name} uses metrics no source file defines: {unknown}")


def main():
    files, objs = load()
    check_basics(files, objs)
    schema_check(objs)
    for check in (check_workloads, check_services, check_rbac, check_wiring, check_credentials,
                  check_network_policies, check_monitoring):
        try:
            check(objs)
        except Exception as e:  # a malformed object: report it, keep the other checks
            err(f"{check.__name__} stopped on a malformed object: {type(e).__name__}: {e}")
    for n in notes:
        print(f"note: {n}")
    for e in errors:
        print(f"FAIL: {e}")
    print(f"{len(objs)} objects in {len(files)} files: "
          f"{'OK' if not errors else str(len(errors)) + ' problem(s)'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
