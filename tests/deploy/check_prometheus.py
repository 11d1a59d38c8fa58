#!/usr/bin/env python3
"""promtool on the SparseX monitoring files (ctest: deploy_prometheus_rules):

  promtool check rules deploy/k8s/prometheus/alerts.yml
  promtool test rules  deploy/k8s/prometheus/alerts_test.yml   (every alert fires when it should)
  promtool check config on prometheus.yml, with the rule_files pointed at alerts.yml; where
      this promtool lacks Kubernetes service discovery (Debian's prometheus package is built
      without it), the kubernetes_sd_configs blocks are swapped for empty static_configs so
      that the rest (relabelling regexes, intervals, rule files) is still checked.

Skips (77) without promtool (Debian: prometheus).
"""
import os
import shutil
import subprocess
import sys
import tempfile

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROM = os.path.join(REPO, "deploy", "k8s", "prometheus")


def run(cmd, cwd=None):
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    print(f"$ {' '.join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd)}")
    print((r.stdout + r.stderr).rstrip())
    return r


def main():
    promtool = shutil.which("promtool")
    if promtool is None:
        print("SKIP: promtool not installed (Debian package prometheus)")
        return 77
    failed = False
    failed |= run([promtool, "check", "rules", os.path.join(PROM, "alerts.yml")]).returncode != 0
    failed |= run([promtool, "test", "rules", "alerts_test.yml"], cwd=PROM).returncode != 0
    with open(os.path.join(PROM, "prometheus.yml")) as f:
        cfg = yaml.safe_load(f)
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "rules"))
        shutil.copy(os.path.join(PROM, "alerts.yml"), os.path.join(tmp, "rules", "sparsex-alerts.yml"))
        cfg["rule_files"] = [os.path.join(tmp, "rules", "*.yml")]
        path = os.path.join(tmp, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        r = run([promtool, "check", "config", path])
        if r.returncode != 0 and "kubernetes_sd_configs not found" in r.stdout + r.stderr:
            print("note: this promtool has no Kubernetes service discovery; checking the rest")
            for job in cfg["scrape_configs"]:
                if job.pop("kubernetes_sd_configs", None) is not None:
                    job["static_configs"] = [{"targets": []}]
            with open(path, "w") as f:
                yaml.safe_dump(cfg, f)
            r = run([promtool, "check", "config", path])
        failed |= r.returncode != 0
    print("FAIL" if failed else "OK: rules, rule unit tests and scrape configuration")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
