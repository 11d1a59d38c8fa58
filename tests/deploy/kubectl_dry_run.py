#!/usr/bin/env python3
"""kubectl's client-side checks of deploy/k8s without a cluster (ctest: deploy_kubectl_dry_run).

`kubectl apply --dry-run=client` still asks an API server which kinds exist (discovery) and
whether each object exists. This script serves exactly that from 127.0.0.1: the discovery
documents of the built-in API groups the manifests use, and 404 for every object, then runs

  kubectl kustomize deploy/k8s                                       (the kustomization builds)
  kubectl apply --dry-run=client --validate=false -f <built> -s http://127.0.0.1:PORT

so kubectl parses and maps every object (unknown kinds or API versions, broken YAML, objects
kubectl cannot decode fail). Schema checks of the fields are in check_k8s.py. Skips (77)
without kubectl.
"""
import json
import os
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
    built = subprocess.run([kubectl, "kustomize", os.path.join(REPO, "deploy", "k8s")],
                           capture_output=True, text=True)
    if built.returncode != 0:
        print(f"FAIL: kubectl kustomize deploy/k8s:\n{built.stderr}")
        return 1
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        manifest = os.path.join(tmp, "sparsex.yaml")
        with open(manifest, "w") as f:
            f.write(built.stdout)
        env = dict(os.environ, KUBECONFIG=os.path.join(tmp, "kubeconfig"), HOME=tmp)
        out = subprocess.run([kubectl, "apply", "--dry-run=client", "--validate=false",
                              "-s", url, "-f", manifest], capture_output=True, text=True,
                             env=env, timeout=120)
    server.shutdown()
    print(out.stdout, end="")
    if out.returncode != 0:
        print(f"FAIL: kubectl apply --dry-run=client (exit {out.returncode}):\n{out.stderr}")
        return 1
    want = built.stdout.count("\nkind: ") + built.stdout.startswith("kind: ")
    got = sum(1 for line in out.stdout.splitlines() if "(dry run)" in line)
    if got != want:
        print(f"FAIL: kubectl accepted {got} objects, the kustomization builds {want}")
        return 1
    print(f"OK: kubectl kustomize + apply --dry-run=client accepted all {got} objects")
    return 0


if __name__ == "__main__":
    sys.exit(main())
