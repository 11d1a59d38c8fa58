#!/usr/bin/env python3
"""The credential and NetworkPolicy checks of check_k8s.py catch what they claim to
(ctest: deploy_k8s_checker). Each case breaks one thing in a copy of deploy/k8s and expects
check_k8s.py to fail with a line naming it; the unchanged copy must pass.

  check_k8s_mutations.py      exit 0 when every case is caught, 1 otherwise
"""
import copy
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CHECKER = os.path.join(HERE, "check_k8s.py")


def load(k8s, name):
    with open(os.path.join(k8s, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def save(k8s, name, docs):
    with open(os.path.join(k8s, name), "w") as f:
        yaml.safe_dump_all(docs, f, sort_keys=False)


def edit(name, kind, obj_name, fn):
    """A mutation that applies fn to one object of a manifest."""
    def apply(k8s):
        docs = load(k8s, name)
        hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == obj_name]
        assert len(hits) == 1, f"{name}: {kind}/{obj_name} not found"
        fn(hits[0])
        save(k8s, name, docs)
    return apply


def container(d):
    return d["spec"]["template"]["spec"]["containers"][0]


def drop_arg(prefix):
    def fn(d):
        c = container(d)
        before = len(c["args"])
        c["args"] = [a for a in c["args"] if not a.startswith(prefix)]
        assert len(c["args"]) < before, prefix
    return fn


def add_arg(arg):
    return lambda d: container(d)["args"].append(arg)


def set_volume_secret(vol, secret):
    def fn(d):
        v = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == vol][0]
        v["secret"]["secretName"] = secret
    return fn


def grpc_readiness(port):
    def fn(d):
        container(d)["readinessProbe"] = {"grpc": {"port": port}, "periodSeconds": 5}
    return fn


def subpath_auth(d):
    c = container(d)
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "auth"]
    c["volumeMounts"].append({"name": "auth", "mountPath": "/etc/sparsex/auth/api_keys.json",
                              "subPath": "api_keys.json", "readOnly": True})
    c["args"] = [a if not a.startswith("--api_keys_file=") else
                 "--api_keys_file=/etc/sparsex/auth/api_keys.json" for a in c["args"]]


def drop_fs_group(d):
    d["spec"]["template"]["spec"]["securityContext"].pop("fsGroup")


def drop_policy(name):
    def apply(k8s):
        docs = load(k8s, "networkpolicy.yaml")
        kept = [d for d in docs if d["metadata"]["name"] != name]
        assert len(kept) == len(docs) - 1, name
        save(k8s, "networkpolicy.yaml", kept)
    return apply


def worker_grpc_from_namespace(d):
    d["spec"]["ingress"][0]["from"] = [{"podSelector": {}}]


def cache_grpc_only(d):
    d["spec"]["ingress"][0]["ports"] = [{"port": "grpc", "protocol": "TCP"}]


def kustomization(fn):
    def apply(k8s):
        path = os.path.join(k8s, "kustomization.yaml")
        with open(path) as f:
            k = yaml.safe_load(f)
        fn(k)
        with open(path, "w") as f:
            yaml.safe_dump(k, f, sort_keys=False)
    return apply


def ca_key_in_secret(k):
    k["secretGenerator"][0]["files"].append("ca.key=secrets/tls/ca-key.pem")


def generator_outside_ignored(k):
    k["secretGenerator"][0]["files"][0] = "ca.crt=tls/ca.pem"


def committed_private_key(k8s):
    with open(os.path.join(k8s, "notes.txt"), "w") as f:
        f.write("-----BEGIN EC PRIVATE KEY-----\nMHcCAQEE\n-----END EC PRIVATE KEY-----\n")


CASES = [
    ("worker without --tls_key", edit("worker.yaml", "Deployment", "sparsex-worker",
                                      drop_arg("--tls_key=")), "--tls_key is not set"),
    ("worker without --kv_mac_key_file", edit("worker.yaml", "Deployment", "sparsex-worker",
                                              drop_arg("--kv_mac_key_file=")),
     "--kv_mac_key_file is not set"),
    ("cache server without --tls_ca", edit("cache-server.yaml", "StatefulSet", "sparsex-cache",
                                           drop_arg("--tls_ca=")), "--tls_ca is not set"),
    ("router with --insecure_loopback", edit("router.yaml", "Deployment", "sparsex-router",
                                             add_arg("--insecure_loopback")), "--insecure_loopback"),
    ("router without --api_keys_file", edit("router.yaml", "Deployment", "sparsex-router",
                                            drop_arg("--api_keys_file=")),
     "--api_keys_file is not set"),
    ("router without --scope_key_file", edit("router.yaml", "Deployment", "sparsex-router",
                                             drop_arg("--scope_key_file=")),
     "--scope_key_file is not set"),
    ("TLS path not in a mounted Secret", edit("worker.yaml", "Deployment", "sparsex-worker",
                                              lambda d: container(d)["args"].__setitem__(
                                                  container(d)["args"].index("--tls_ca=/etc/sparsex/tls/ca.crt"),
                                                  "--tls_ca=/etc/ssl/ca.crt")),
     "--tls_ca=/etc/ssl/ca.crt is not a file of a mounted Secret"),
    ("TLS key name not in the Secret", edit("router.yaml", "Deployment", "sparsex-router",
                                            lambda d: container(d)["args"].__setitem__(
                                                container(d)["args"].index("--tls_key=/etc/sparsex/tls/tls.key"),
                                                "--tls_key=/etc/sparsex/tls/router-key.pem")),
     "has no key router-key.pem"),
    ("Secret neither defined nor generated", edit("cache-server.yaml", "StatefulSet", "sparsex-cache",
                                                  set_volume_secret("tls", "sparsex-tls-nope")),
     "mounts Secret sparsex-tls-nope, which is neither defined nor generated"),
    ("API key file mounted with subPath", edit("router.yaml", "Deployment", "sparsex-router",
                                               subpath_auth), "mounted with subPath"),
    ("Secret files unreadable by the process", edit("router.yaml", "Deployment", "sparsex-router",
                                                    drop_fs_group),
     "the process (non-root) cannot read its credentials"),
    ("gRPC probe of the worker's mTLS port", edit("worker.yaml", "Deployment", "sparsex-worker",
                                                  grpc_readiness(50060)),
     "gRPC probe of the mutual-TLS gRPC port"),
    ("CA key in a Secret", kustomization(ca_key_in_secret), "must never go into the cluster"),
    ("generator source outside the ignored folder", kustomization(generator_outside_ignored),
     "is not in a folder deploy/k8s/.gitignore ignores"),
    ("private key committed", committed_private_key, "notes.txt: contains a private key"),
    ("no default deny", drop_policy("sparsex-default-deny-ingress"), "no default-deny ingress"),
    ("worker gRPC open to the namespace", edit("networkpolicy.yaml", "NetworkPolicy", "sparsex-worker",
                                               worker_grpc_from_namespace),
     "Deployment/sparsex-worker: port grpc admits ['namespace-pods'], expected ['router']"),
    ("cache servers without a policy", drop_policy("sparsex-cache"),
     "StatefulSet/sparsex-cache: port grpc admits no connection"),
    ("UCX ports closed", edit("networkpolicy.yaml", "NetworkPolicy", "sparsex-cache", cache_grpc_only),
     "StatefulSet/sparsex-cache: port other TCP ports admits nothing, expected ['worker']"),
    ("etcd open to everything", drop_policy("sparsex-etcd"),
     "StatefulSet/sparsex-etcd: port client admits no connection"),
]


def run(k8s):
    out = subprocess.run([sys.executable, CHECKER, k8s], capture_output=True, text=True)
    return out.returncode, out.stdout + out.stderr


def main():
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        # deploy/k8s beside deploy/grafana, as gen-configmaps.py --check expects.
        os.makedirs(os.path.join(tmp, "deploy"))
        os.symlink(os.path.join(REPO, "deploy", "grafana"), os.path.join(tmp, "deploy", "grafana"))
        pristine = os.path.join(tmp, "pristine")
        shutil.copytree(os.path.join(REPO, "deploy", "k8s"), pristine,
                        ignore=shutil.ignore_patterns("secrets"))
        k8s = os.path.join(tmp, "deploy", "k8s")
        shutil.copytree(pristine, k8s)
        rc, out = run(k8s)
        if rc != 0:
            print(f"FAIL: the unchanged copy does not pass:\n{out}")
            return 1
        print("ok: unchanged copy passes")
        for what, mutate, expect in CASES:
            shutil.rmtree(k8s)
            shutil.copytree(pristine, k8s)
            mutate(k8s)
            rc, out = run(k8s)
            fails = [l for l in out.splitlines() if l.startswith("FAIL: ")]
            if rc == 1 and any(expect in l for l in fails):
                print(f"ok: {what}: caught")
            else:
                failures += 1
                print(f"FAIL: {what}: expected a failure containing {expect!r}; got rc {rc}:")
                print("  " + "\n  ".join(fails or out.splitlines()[-5:]))
    print(f"{len(CASES) - failures} of {len(CASES)} broken manifests caught")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
