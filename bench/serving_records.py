#!/usr/bin/env python3
"""Append sparsex-loadgen summaries to docs/bench/serving.json in its record shape.

A record of serving.json is a loadgen summary (`--out`: one object, or an array with
`--sweep`) plus what says where it ran: `run` (a label), `commit`, `machine`, and optionally
`variant`, `worker_args`, `scheduler`, `note`. This script adds those fields to every summary
of the given files and appends them to the array (`--to`, default docs/bench/serving.json),
refusing a summary that lacks the fields a serving record has always carried, and, unless
`--allow-unsustained`, a point that ran below the sustained rule (`"sustained": false`, or a
summary written before the rule existed). `--dry-run` prints the records instead.

Only python3's standard library (CI has no PyPI).

  python3 bench/serving_records.py rag_on.json rag_off.json --run "H100 rag sweep" \\
      --machine "1x H100 80GB, synthetic:llama3-8b" --variant "prime 2"
"""
import argparse
import json
import os
import subprocess
import sys

# Fields every serving.json record has had, whatever wrote it.
REQUIRED = ("workload", "mode", "rate", "requests", "completed", "errors", "ttft_p50_ms",
            "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "throughput_rps", "reused_share",
            "prefix_share", "goodput_ok")


def git_commit(repo):
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def load_summaries(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    items = data if isinstance(data, list) else [data]
    for i, s in enumerate(items):
        if not isinstance(s, dict):
            raise ValueError(f"{path}: item {i} is not a JSON object")
        missing = [k for k in REQUIRED if k not in s]
        if missing:
            raise ValueError(f"{path}: item {i} is not a loadgen summary (missing "
                             f"{', '.join(missing)})")
    return items


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="+", help="sparsex-loadgen --out files")
    ap.add_argument("--to", default=None, help="the records file (docs/bench/serving.json)")
    ap.add_argument("--run", required=True, help="a label for this measurement")
    ap.add_argument("--machine", required=True, help="where it ran (GPU, model, cluster)")
    ap.add_argument("--commit", help="the commit measured (default: git HEAD, short)")
    ap.add_argument("--variant", help="what distinguishes this run (flags, settings)")
    ap.add_argument("--worker-args", help="the workers' flags")
    ap.add_argument("--scheduler", help="the scheduler setting")
    ap.add_argument("--note", help="free text")
    ap.add_argument("--allow-unsustained", action="store_true",
                    help="also append points below the sustained rule")
    ap.add_argument("--dry-run", action="store_true", help="print the records, change nothing")
    args = ap.parse_args()

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    to = args.to or os.path.join(repo, "docs", "bench", "serving.json")
    commit = args.commit or git_commit(repo)
    if not commit:
        ap.error("no --commit and git HEAD is unknown")
    new = []
    try:
        for path in args.summaries:
            for s in load_summaries(path):
                if not s.get("sustained", False) and not args.allow_unsustained:
                    raise ValueError(
                        f"{path}: the {s.get('workload')} point at rate {s.get('rate')} / "
                        f"concurrency {s.get('concurrency')} ran {s.get('requests')} requests in "
                        f"{s.get('duration_s')} s, below the sustained rule "
                        "(--allow-unsustained to append it anyway)")
                rec = dict(s)
                rec["run"] = args.run
                rec["commit"] = commit
                rec["machine"] = args.machine
                for k, v in (("variant", args.variant), ("worker_args", args.worker_args),
                             ("scheduler", args.scheduler), ("note", args.note)):
                    if v is not None:
                        rec[k] = v
                new.append(rec)
    except (OSError, ValueError) as e:
        sys.exit(f"serving_records.py: {e}")
    if args.dry_run:
        json.dump(new, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    records = []
    if os.path.exists(to):
        with open(to, encoding="utf-8") as f:
            records = json.load(f)
        if not isinstance(records, list):
            sys.exit(f"serving_records.py: {to} is not a JSON array")
    records.extend(new)
    tmp = to + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)  # the file's own layout: one-space indent, no final LF
    os.replace(tmp, to)
    print(f"appended {len(new)} records to {to} ({len(records)} in all)")


if __name__ == "__main__":
    main()
