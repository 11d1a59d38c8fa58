#!/usr/bin/env python3
"""kubectl's client-side checks of deploy/k8s without a cluster (ctest: deploy_kubectl_dry_run).

`kubectl apply --dry-run=client` still asks an API server which kinds exist (discovery) and
whether each object exists. This script serves exactly that from 127.0.0.1: the discovery
documents of the built-in API groups the manifests use, and 404 for every object, then runs

  deploy/k8s/make-secrets.sh tenant-a tenant-b     (in a copy of deploy/k8s: fresh credentials)
  kubectl kustomize <copy>                                           (the kustomization builds)
  kubectl apply --dry-run=client --validate=false -f <built> -s http://127.0.0.1:PORT

so kubectl parses and maps every object (unknown kinds or API versions, broken YAML, objects
kubectl cannot decode fail). The built Secrets are checked too: the five of the
secretGenerator with exactly their keys, every Secret a pod mounts among them (kustomize's
hashed names), and neither the CA's private key nor a tenant's API key anywhere in the output.
Schema checks of the fields are in check_k8s.py. Skips (77) without kubectl or openssl.
"""
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# group/version -> [(resource, kind, namespaced)]
RESOURCES = {
    "v1": [("namespaces", "Namespace", False), ("configmaps", "ConfigMap", True),
           ("services", "Service", True), ("persistentvolumeclaims", "PersistentVolumeClaim", True),
           ("serviceaccounts", "ServiceAccount", True), ("pods", "Pod", True),
           ("secrets", "Secret", True)],
    "apps/v1": [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True),
                ("daemonsets", "DaemonSet", True)],
    "batch/v1": [("jobs", "Job", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "rbac.authorization.k8s.io/v1": [("roles", "Role", True), ("rolebindings", "RoleBinding", True),
                                     ("clusterroles", "ClusterRole", False),
                                     ("clusterrolebindings", "ClusterRoleBinding", False)],
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def resource_list(gv):
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
            "resources": [{"name": r, "singularName": k.lower(), "namespaced": ns, "kind": k,
                           "verbs": VERBS} for r, k, ns in RESOURCES[gv]]}


class Handler(BaseHTTPRequestHandler):
    seen = []

    def log_message(self, *args):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        Handler.seen.append(("GET", path))
        if path == "/api":
            return self.reply(200, {"kind": "APIVersions", "versions": ["v1"],
                                    "serverAddressByClientCIDRs": [
                                        {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]})
        if path == "/apis":
            groups = []
            for gv in RESOURCES:
                if "/" not in gv:
                    continue
                g, v = gv.split("/")
                groups.append({"name": g, "versions": [{"groupVersion": gv, "version": v}],
                               "preferredVersion": {"groupVersion": gv, "version": v}})
            return self.reply(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        if path == "/api/v1":
            return self.reply(200, resource_list("v1"))
        if path.startswith("/apis/") and path[len("/apis/"):] in RESOURCES:
            return self.reply(200, resource_list(path[len("/apis/"):]))
        if path == "/version":
            return self.reply(200, {"major": "1", "minor": "30", "gitVersion": "v1.30.0"})
        self.reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "message": "not found", "reason": "NotFound", "code": 404})


def main():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("SKIP: kubectl not installed (Debian: kubernetes-client); check_k8s.py still "
              "validates the manifests")
        return 77
    if shutil.which("openssl") is None:
        print("SKIP: openssl not installed (make-secrets.sh needs it); check_k8s.py still "
              "validates the manifests")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        # A copy without the operator's own secrets/ (if any): fresh credentials each time.
        k8s = os.path.join(tmp, "deploy", "k8s")
        shutil.copytree(os.path.join(REPO, "deploy", "k8s"), k8s,
                        ignore=shutil.ignore_patterns("secrets"))
        shutil.copytree(os.path.join(REPO, "deploy", "local"), os.path.join(tmp, "deploy", "local"))
        made = subprocess.run([os.path.join(k8s, "make-secrets.sh"), "tenant-a", "tenant-b"],
                              capture_output=True, text=True)
        if made.returncode != 0:
            print(f"FAIL: make-secrets.sh:\n{made.stdout}{made.stderr}")
            return 1
        built = subprocess.run([kubectl, "kustomize", k8s], capture_output=True, text=True)
        if built.returncode != 0:
            print(f"FAIL: kubectl kustomize deploy/k8s:\n{built.stderr}")
            return 1
        problems = check_secrets(built.stdout, os.path.join(k8s, "secrets"))
        if problems:
            for p in problems:
                print(f"FAIL: {p}")
            return 1
        rc = dry_run(kubectl, built.stdout, tmp)
    return rc


def check_secrets(text, secrets_dir):
    """The built Secrets against what make-secrets.sh wrote."""
    import yaml
    docs = [d for d in yaml.safe_load_all(text) if d]
    built = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Secret"}
    problems = []
    want = {"sparsex-tls-router": {"ca.crt", "tls.crt", "tls.key"},
            "sparsex-tls-worker": {"ca.crt", "tls.crt", "tls.key"},
            "sparsex-tls-cache": {"ca.crt", "tls.crt", "tls.key"},
            "sparsex-api-keys": {"api_keys.json", "scope.key"},
            "sparsex-kv-mac": {"kv_mac.key"}}
    for base, keys in want.items():
        hits = [n for n in built if n == base or re.fullmatch(re.escape(base) + r"-[a-z0-9]{10}", n)]
        if len(hits) != 1:
            problems.append(f"Secret {base}: built {len(hits)} times ({sorted(built)})")
            continue
        got = set((built[hits[0]].get("data") or {}).keys())
        if got != keys:
            problems.append(f"Secret {hits[0]}: keys {sorted(got)}, expected {sorted(keys)}")
    # Each role's certificate is that role's, and the CA is the one that signed it.
    role_file = {"sparsex-tls-router": "router", "sparsex-tls-worker": "worker",
                 "sparsex-tls-cache": "cache"}
    for name, d in built.items():
        base = re.sub(r"-[a-z0-9]{10}$", "", name)
        role = role_file.get(base)
        if role is None:
            continue
        data = d.get("data") or {}
        for key, path in (("tls.crt", f"tls/{role}.pem"), ("tls.key", f"tls/{role}-key.pem"),
                          ("ca.crt", "tls/ca.pem")):
            with open(os.path.join(secrets_dir, path), "rb") as f:
                if base64.b64decode(data.get(key, "")) != f.read():
                    problems.append(f"Secret {name}: {key} is not {path}")
    # Every Secret a pod mounts exists under its built (hashed) name.
    for d in docs:
        spec = (d.get("spec") or {}).get("template", {}).get("spec") or {}
        for v in spec.get("volumes", []) or []:
            name = (v.get("secret") or {}).get("secretName")
            if name and name not in built:
                problems.append(f"{d['kind']}/{d['metadata']['name']}: volume {v['name']} mounts "
                                f"Secret {name}, which the kustomization does not build")
    # What must never reach the cluster: the CA's key and the tenants' API keys (plain or base64).
    secrets = [("the CA's private key", os.path.join(secrets_dir, "tls", "ca-key.pem"))]
    secrets += [(f"API key {p}", os.path.join(secrets_dir, p)) for p in os.listdir(secrets_dir)
                if p.startswith("api_key.")]
    for what, path in secrets:
        raw = open(path, "rb").read()
        for form in (raw, raw.strip(), base64.b64encode(raw), base64.b64encode(raw.strip())):
            if form.decode(errors="replace") in text:
                problems.append(f"{what} is in the built manifests")
                break
    return problems


def dry_run(kubectl, text, tmp):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    manifest = os.path.join(tmp, "sparsex.yaml")
    with open(manifest, "w") as f:
        f.write(text)
    env = dict(os.environ, KUBECONFIG=os.path.join(tmp, "kubeconfig"), HOME=tmp)
    out = subprocess.run([kubectl, "apply", "--dry-run=client", "--validate=false",
                          "-s", url, "-f", manifest], capture_output=True, text=True,
                         env=env, timeout=120)
    server.shutdown()
    print(out.stdout, end="")
    if out.returncode != 0:
        print(f"FAIL: kubectl apply --dry-run=client (exit {out.returncode}):\n{out.stderr}")
        return 1
    want = text.count("\nkind: ") + text.startswith("kind: ")
    got = sum(1 for line in out.stdout.splitlines() if "(dry run)" in line)
    if got != want:
        print(f"FAIL: kubectl accepted {got} objects, the kustomization builds {want}")
        return 1
    print(f"OK: kubectl kustomize + apply --dry-run=client accepted all {got} objects")
    return 0


if __name__ == "__main__":
    sys.exit(main())
