#!/usr/bin/env python3
"""sparsex-loadgen end to end on the CPU: one sparsex-worker (stories260K) and a sparsex-router
with static membership on 127.0.0.1, driven by each workload of docs/benchmarks.md "Load
generator workloads":

  trace       a synthetic Mooncake trace written here (shared prefix blocks, timestamps over
              3 s, replayed at --time_scale 0.5): every request completes, arrivals follow the
              scaled timestamps, output lengths are the recorded ones capped, and the shared
              blocks are served from cache; the recorded trace's first seconds too when
              ../shared/traces has it (sizes scaled down to the model).
  longdocqa   documents asked about twice, interleaved, 2 in flight, after a prime round.
  multiround  users x rounds paced at a rate: a user's round starts after its previous one ended.
  textrag     text documents pasted into one chat message over the OpenAI API; the server's
              reused share next to bench/chunk_reuse.py's offline chunk share.
  sweep       a two-point rag sweep: sustained flags, the sweep's goodput on every record,
              bench/serving_records.py turning the points into serving.json records.

Exit 77 (ctest: skipped) without the model or a binary. Every process is started here and
stopped by its PID.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

FAILURES = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)


def wait_ready(proc, path, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


class Cluster:
    def __init__(self, a, run_dir, model):
        self.a, self.dir, self.model, self.procs = a, run_dir, model, []

    def spawn(self, name, argv):
        log = open(os.path.join(self.dir, name + ".log"), "w", encoding="utf-8")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p))
        return p

    def up(self):
        ready = os.path.join(self.dir, "worker.ready")
        w = self.spawn("worker", [os.path.join(self.a.bin_dir, "sparsex-worker"), "--model",
                                  self.model, "--device", "cpu", "--port", "0", "--metrics_port",
                                  "0", "--worker_id", "worker-0", "--kv_blocks", "2048",
                                  "--load_report_ms", "100", "--insecure_loopback",
                                  "--ready_file", ready])
        j = wait_ready(w, ready)
        if j is None:
            raise RuntimeError("worker did not start")
        ready = os.path.join(self.dir, "router.ready")
        r = self.spawn("router", [os.path.join(self.a.bin_dir, "sparsex-router"), "--model",
                                  self.model, "--workers", f"127.0.0.1:{j['grpc_port']}",
                                  "--grpc_address", "127.0.0.1:0", "--http_address",
                                  "127.0.0.1:0", "--insecure_loopback",
                                  # one client sends every stream: no per-client cap
                                  "--http_max_streams_per_client", "-1", "--ready_file",
                                  ready])
        j = wait_ready(r, ready)
        if j is None:
            raise RuntimeError("router did not start")
        self.grpc = f"127.0.0.1:{j['grpc_port']}"
        self.http = f"127.0.0.1:{j['http_port']}"

    def down(self):
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def tail(self):
        for name, _ in self.procs:
            path = os.path.join(self.dir, name + ".log")
            with open(path, encoding="utf-8", errors="replace") as f:
                print(f"---- {name}.log (tail) ----\n" + f.read()[-3000:])


def loadgen(a, run_dir, name, args, expect_rc=0):
    out = os.path.join(run_dir, name + ".json")
    rec = os.path.join(run_dir, name + ".records.jsonl")
    argv = [os.path.join(a.bin_dir, "sparsex-loadgen"), "--progress=false", "--out", out,
            "--records", rec, "--timeout_ms", "60000", "--wait_ready_s", "30"] + args
    t = time.time()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    print(f"---- loadgen {name} ({time.time() - t:.1f} s, exit {p.returncode}) ----")
    print(p.stdout[-2500:])
    if p.returncode != expect_rc:
        print(p.stderr[-3000:])
    check(p.returncode == expect_rc, f"{name}: exit status {p.returncode}")
    summary = None
    records = []
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            summary = json.load(f)
    if os.path.exists(rec):
        with open(rec, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    return summary, records, p


def all_ok(name, s, records, n=None):
    check(s is not None, f"{name}: summary written")
    if s is None:
        return False
    check(s["errors"] == 0, f"{name}: no errors ({s['errors_by_code']})")
    check(s["completed"] == s["requests"], f"{name}: {s['completed']} of {s['requests']} completed")
    if n is not None:
        check(s["requests"] == n, f"{name}: {s['requests']} requests sent, want {n}")
    check(len(records) == s["requests"], f"{name}: a record per request")
    check(all("usage" in r for r in records), f"{name}: every record carries the usage")
    return True


def write_synthetic_trace(path):
    """12 conversations of 2 turns: a turn re-sends its conversation's blocks and adds one;
    every request starts with block 0 (a shared system prompt), as in the Mooncake trace."""
    lines, next_id, t = [], 1, 0
    convs = []
    for c in range(12):
        ids = [0] + list(range(next_id, next_id + 2))
        next_id += 2
        convs.append(ids)
    rows = []
    for c, ids in enumerate(convs):
        rows.append((c * 120, len(ids) * 512 - 100, 7 + c % 3, ids))
    for c, ids in enumerate(convs):
        more = ids + [next_id]
        next_id += 1
        rows.append((1500 + c * 130, len(more) * 512 - 30, 3, more))
    for ts, n, out, ids in rows:
        lines.append(json.dumps({"timestamp": ts, "input_length": n, "output_length": out,
                                 "hash_ids": ids}))
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return sorted(rows, key=lambda r: r[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--run-dir", required=True)
    a = ap.parse_args()
    models = os.environ.get("SPARSEX_MODELS") or os.path.join(a.source_dir, "..", "shared",
                                                               "models")
    model = os.path.join(models, "stories260K", "stories260K.gguf")
    text = os.path.join(models, "tinystories-text", "tinystories_sample.txt")
    for path in [model, text] + [os.path.join(a.bin_dir, b) for b in
                                 ("sparsex-worker", "sparsex-router", "sparsex-loadgen")]:
        if not os.path.exists(path):
            print(f"skipped: {path} not found")
            return 77
    shutil.rmtree(a.run_dir, ignore_errors=True)
    os.makedirs(a.run_dir)
    ids = ["--min_id", "3", "--max_id", "500"]  # stories260K's vocabulary is 512
    cl = Cluster(a, a.run_dir, model)
    try:
        cl.up()
        g = ["--target", cl.grpc]

        # ---- a synthetic trace: blocks of 512 scaled to 16 tokens, 3 s of arrivals at x2 ----
        trace = os.path.join(a.run_dir, "synthetic_trace.jsonl")
        rows = write_synthetic_trace(trace)
        s, recs, _ = loadgen(a, a.run_dir, "trace", g + ids + [
            "--trace", trace, "--time_scale", "0.5", "--trace_token_scale", "0.03125",
            "--max_output_tokens", "8"])
        if all_ok("trace", s, recs, n=len(rows)):
            check(s["arrival"] == "trace" and s["config"]["time_scale"] == 0.5,
                  "trace: arrival 'trace' at time_scale 0.5")
            span_s = (rows[-1][0] - rows[0][0]) / 1000 * 0.5
            check(abs(s["rate"] - len(rows) / span_s) < 1e-6,
                  f"trace: offered rate {s['rate']} = {len(rows)} requests / {span_s} s")
            for r in recs:
                ts, _, out, _ = rows[r["index"]]
                want_ms = (ts - rows[0][0]) * 0.5
                if abs(r["scheduled_ms"] - want_ms) > 1e-3 or r["max_tokens"] != min(out, 8):
                    check(False, f"trace: request {r['index']} scheduled {r['scheduled_ms']} ms "
                                 f"(want {want_ms}), max_tokens {r['max_tokens']}")
                    break
            else:
                check(True, "trace: every request scheduled at its scaled timestamp with its "
                            "recorded output length (capped at 8)")
            check(all(r["tokens"] == r["max_tokens"] for r in recs),
                  "trace: output lengths as recorded (ignore_eos)")
            cached = s["prefix_tokens"] + s["reused_tokens"]
            # Blocks seen before: every request's block 0 after the first, and each second
            # turn's first three blocks.
            check(cached / s["prompt_tokens"] > 0.3,
                  f"trace: shared blocks served from cache ({cached} of {s['prompt_tokens']})")
        # A line of the trace that is wrong: the error names it.
        bad = os.path.join(a.run_dir, "bad_trace.jsonl")
        with open(trace, encoding="utf-8") as f, open(bad, "w", encoding="utf-8") as o:
            lines = f.read().splitlines()
            lines[4] = lines[4].replace('"hash_ids"', '"hashes"')
            o.write("\n".join(lines) + "\n")
        _, _, p = loadgen(a, a.run_dir, "bad_trace", g + ["--trace", bad], expect_rc=1)
        check("bad_trace.jsonl:5: unsupported key 'hashes'" in p.stderr,
              f"bad trace: the error names the line ({p.stderr.strip()[:160]})")

        # ---- the recorded Mooncake trace's first 3 s, when present ----
        traces = os.environ.get("SPARSEX_TRACES") or os.path.join(a.source_dir, "..", "shared",
                                                                   "traces")
        real = os.path.join(traces, "mooncake_conversation_trace.jsonl")
        if os.path.exists(real):
            s, recs, _ = loadgen(a, a.run_dir, "mooncake", g + ids + [
                "--trace", real, "--start_s", "0", "--duration_s", "3", "--time_scale", "0.5",
                "--trace_token_scale", "0.03125", "--max_input_tokens", "400",
                "--max_output_tokens", "4"])
            if all_ok("mooncake", s, recs):
                check(s["requests"] >= 5, f"mooncake: {s['requests']} requests in the window")
                check(s["prefix_tokens"] + s["reused_tokens"] > 0,
                      "mooncake: the shared first block is served from cache")
        else:
            print(f"(no {real}: the recorded trace's window is not replayed)")

        # ---- longdocqa: 3 documents, each asked twice, interleaved, 2 in flight ----
        s, recs, _ = loadgen(a, a.run_dir, "longdocqa", g + ids + [
            "--workload", "longdocqa", "--documents", "3", "--document_tokens", "200",
            "--repeat", "2", "--repeat_mode", "interleave", "--question_tokens", "8",
            "--concurrency", "2", "--prime", "1", "--max_tokens", "4", "--min_requests", "12",
            "--min_seconds", "0"])
        if all_ok("longdocqa", s, recs):
            check(s["requests"] >= 12, f"longdocqa: at least --min_requests ({s['requests']})")
            check(s["sustained"] is True, "longdocqa: sustained under --min_requests 12 "
                                          "--min_seconds 0")
            share = (s["prefix_tokens"] + s["reused_tokens"]) / s["prompt_tokens"]
            check(share > 0.8, f"longdocqa: primed documents served from cache ({share:.3f})")

        # ---- multiround: 3 users x 3 rounds at 6 requests/s ----
        s, recs, _ = loadgen(a, a.run_dir, "multiround", g + ids + [
            "--workload", "multiround", "--users", "3", "--rounds", "3",
            "--shared_system_tokens", "60", "--user_history_tokens", "60", "--round_tokens",
            "10", "--answer_tokens", "6", "--rate", "6", "--min_requests", "15",
            "--min_seconds", "2"])
        if all_ok("multiround", s, recs):
            check(s["arrival"] == "paced" and s["duration_s"] >= 2,
                  f"multiround: paced arrivals for at least --min_seconds ({s['duration_s']} s)")
            by_index = {r["index"]: r for r in recs}
            late, follows = [], 0
            for r in recs:
                prev = by_index.get(r.get("after", -1))
                if prev is None:
                    continue
                follows += 1
                # Sent (scheduled + lag) only after the user's previous round ended.
                start = r["scheduled_ms"] + r["lag_ms"]
                prev_end = prev["scheduled_ms"] + prev["lag_ms"] + prev["e2e_ms"]
                if start + 1.0 < prev_end:
                    late.append(r["index"])
            check(follows >= 6, f"multiround: {follows} requests follow their user's previous round")
            check(not late, f"multiround: no round sent before its user's previous one ended "
                            f"({late})")
            check(all(r["max_tokens"] == 6 and r["tokens"] == 6 for r in recs),
                  "multiround: answers of --answer_tokens")
            check(s["prefix_tokens"] + s["reused_tokens"] > 0.3 * s["prompt_tokens"],
                  "multiround: the system prompt and earlier rounds served from cache")

        # ---- textrag over the OpenAI chat API + the offline chunk analysis ----
        dump = os.path.join(a.run_dir, "textrag.requests.jsonl")
        s, recs, _ = loadgen(a, a.run_dir, "textrag", [
            "--workload", "textrag", "--target", cl.http, "--docs", text, "--doc_chars", "250",
            "--pool", "6", "--docs_per_request", "3", "--question_tokens", "6", "--rate", "4",
            "--min_requests", "16", "--min_seconds", "0", "--max_tokens", "4",
            "--dump_requests", dump])
        if all_ok("textrag", s, recs):
            check(s["config"]["api"] == "openai" and s["content"] == "text",
                  "textrag: sent through the OpenAI chat API as text")
            check(all(r.get("http_status") == 200 for r in recs), "textrag: every HTTP 200")
            check(all(r["usage"]["prompt_tokens"] > 0 for r in recs),
                  "textrag: usage read from the stream's usage chunk")
            with open(dump, encoding="utf-8") as f:
                reqs = [json.loads(line) for line in f if line.strip()]
            check(len(reqs) == s["requests"] and
                  all(len([m for m in q["messages"] if m["role"] == "user"]) == 1 for q in reqs),
                  "textrag: each request one user message with the documents pasted in")
            out = os.path.join(a.run_dir, "chunk_reuse.json")
            p = subprocess.run([sys.executable, os.path.join(a.source_dir, "bench",
                                                             "chunk_reuse.py"), dump,
                                "--records", os.path.join(a.run_dir, "textrag.records.jsonl"),
                                "--chunking", "paragraphs", "--json", out],
                               capture_output=True, text=True, timeout=120)
            print(p.stdout + p.stderr)
            check(p.returncode == 0, "chunk_reuse.py: exit 0")
            if p.returncode == 0:
                with open(out, encoding="utf-8") as f:
                    cr = json.load(f)
                # 6 documents, 3 a request: after the first requests every paragraph was seen.
                check(cr["chunk_reused_share"] > 0.5,
                      f"chunk_reuse.py: offline share {cr['chunk_reused_share']:.3f}")
                check(cr["server_requests"] == s["requests"] and
                      abs(cr["server_reused_share"] - s["reused_share"]) < 1e-9,
                      "chunk_reuse.py: the server's share from the records matches the summary")

        # ---- a two-point sweep: goodput, sustained flags, serving.json records ----
        s, recs, _ = loadgen(a, a.run_dir, "sweep", g + ids + [
            "--workload", "rag", "--pool", "8", "--docs_per_request", "2", "--doc_tokens", "64",
            "--question_tokens", "8", "--max_tokens", "4", "--sweep", "2,4",
            "--min_requests", "8", "--min_seconds", "1", "--slo_ttft_ms", "60000",
            "--slo_tpot_ms", "60000"])
        check(isinstance(s, list) and len(s) == 2, "sweep: two points")
        if isinstance(s, list) and len(s) == 2:
            check(all(p["sustained"] and p["requests"] >= 8 and p["duration_s"] >= 1 for p in s),
                  "sweep: both points sustained (>= 8 requests, >= 1 s)")
            check(all(p["sweep_goodput"] == 4 for p in s),
                  f"sweep: goodput 4 requests/s under a loose SLO ({[p['sweep_goodput'] for p in s]})")
            serving = os.path.join(a.run_dir, "serving.json")
            with open(serving, "w", encoding="utf-8") as f:
                f.write("[]")
            p = subprocess.run([sys.executable, os.path.join(a.source_dir, "bench",
                                                             "serving_records.py"),
                                os.path.join(a.run_dir, "sweep.json"), "--to", serving,
                                "--run", "e2e", "--machine", "CPU, stories260K",
                                "--commit", "test"], capture_output=True, text=True)
            print(p.stdout + p.stderr)
            with open(serving, encoding="utf-8") as f:
                recs2 = json.load(f)
            check(p.returncode == 0 and len(recs2) == 2 and
                  all(r["run"] == "e2e" and r["machine"] and r["commit"] == "test" and
                      "ttft_p99_ms" in r for r in recs2),
                  "serving_records.py: two records in serving.json's shape")
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        check(False, str(e))
    finally:
        cl.down()
        if FAILURES:
            cl.tail()
    print(f"\n{len(FAILURES)} failure(s)" + ("".join("\n  " + f for f in FAILURES)))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
