#!/usr/bin/env python3
"""kvwarden `serve` against llama.cpp's `llama-server`, side by side: the one benchmark.

    bench/serve.py                      # the comparison; run it on an otherwise idle machine
    QUICK=1 bench/serve.py              # tiny workloads: proves the pipeline, figures meaningless
    MODEL=path/to/other.gguf bench/serve.py

It builds kvwarden (release) and llama.cpp's llama-server and llama-bench
(bench/build-llama-server.sh, cached in .peer/), fetches the default model
(scripts/fetch-model.sh), then for ROUNDS rounds (default 2) runs each server in turn on the
same GGUF, the same thread count (THREADS, default nproc), 32 slots, flash attention, a
32,768-token KV, and loads it with `kvwarden bench serve` (streaming /v1/completions,
token-id prompts, ignore_eos):

  (a) one stream, 500-token prompt, 128 out: time to first token and decode tok/s;
  (b) 8 clients, 32 requests of 200 prompt + 64 out: output tok/s;
  (c) 32 clients, 64 requests of 200 + 64: output tok/s and p99 latency;
  (d) (b) with every answer constrained to bench/story-schema.json (`--json-schema`, sent as
      llama.cpp's `json_schema` field; its story runs past 64 tokens, so every answer is
      64 tokens, as with ignore_eos): output tok/s, and for each server (d) / (b), what
      structured outputs cost it;
  (e) 8 clients, 32 chat requests (/v1/chat/completions) of 200 random words + 64 out,
      ignore_eos: output tok/s;
  (f) (e) with every request declaring bench/story-tool.json's function with
      `tool_choice: "required"` (`--tools`; its story runs past 64 tokens, so every answer
      is 64 tokens of a forced call): output tok/s, and (f) / (e), what a forced tool call
      costs;
  (g) one stream, 500-token prompt, 1 out: the request's latency, the time to the first
      token as the client sees it whatever the server streams (llama-server holds back text
      that is not yet whole UTF-8, so on a synthetic file's random output its first streamed
      token comes with the last, and (a)'s time to first token measures its whole answer);

plus each server's peak RSS (VmHWM just before it is stopped), the seconds from its start to
a healthy /health (the model file already in the page cache: the servers alternate on one
file) and to full speed (kvwarden serves from the file's rows while it repacks its weights
and logs "weights ready" when done; the workloads start after it; llama-server repacks
before it is healthy), and the kernels' pp512/tg128
(kvwarden's `cargo bench -p model --bench throughput`, llama.cpp's llama-bench). The order of
the two servers alternates between rounds. It prints each metric for both, medians over the
rounds and the ratio kvwarden / llama.cpp, and writes all of it, with every round's raw
reports, to bench/results/serve-<time>.json (git-ignored).

Environment: THREADS, MODEL, ROUNDS, QUICK=1, ONLY (workload names, space-separated: only
those), TOKEN_ID_RANGE (ids the prompts are drawn
from, default 1000..10000, clear of special tokens), KVWARDEN_ARGS and LLAMA_ARGS (extra
flags for each server, split on spaces). Where llama.cpp's default (repacked) path crashes,
as on some AMX Xeons, it runs with --no-repack / --repack 0 and the results say so.
Timings here are never pass/fail tests.
"""

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "target" / "release" / "kvwarden"
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PEER_VERSION = "0.3.36"
KV_TOKENS = 32768
SLOTS = 32

QUICK = os.environ.get("QUICK", "") not in ("", "0")
THREADS = int(os.environ.get("THREADS") or os.cpu_count() or 1)
ROUNDS = int(os.environ.get("ROUNDS", "2"))
MODEL = Path(os.environ.get("MODEL") or DEFAULT_MODEL).resolve()
TOKEN_ID_RANGE = os.environ.get("TOKEN_ID_RANGE", "1000..10000")

# name: (clients, requests, prompt tokens, output tokens)
WORKLOADS = {
    "a_one_stream": (1, 5, 500, 128),
    "b_8_clients": (8, 32, 200, 64),
    "c_32_clients": (32, 64, 200, 64),
    "d_8_clients_schema": (8, 32, 200, 64),
    "e_8_clients_chat": (8, 32, 200, 64),
    "f_8_clients_tool": (8, 32, 200, 64),
    "g_first_token": (1, 5, 500, 1),
}
SCHEMA = ROOT / "bench" / "story-schema.json"
TOOLS = ROOT / "bench" / "story-tool.json"
KERNEL = (512, 128)
if QUICK:
    WORKLOADS = {
        "a_one_stream": (1, 2, 32, 8),
        "b_8_clients": (2, 4, 16, 8),
        "c_32_clients": (4, 8, 16, 8),
        "d_8_clients_schema": (2, 4, 16, 8),
        "e_8_clients_chat": (2, 4, 16, 8),
        "f_8_clients_tool": (2, 4, 16, 8),
        "g_first_token": (1, 2, 32, 1),
    }
    KERNEL = (32, 8)
# ONLY="a_one_stream b_8_clients": those workloads alone (a synthetic file has no chat
# template for (e) and (f), and a large model makes the whole set long).
if os.environ.get("ONLY"):
    unknown = set(os.environ["ONLY"].split()) - set(WORKLOADS)
    if unknown:
        sys.exit(f"bench/serve: ONLY names unknown workloads {sorted(unknown)}: {sorted(WORKLOADS)}")
    WORKLOADS = {k: v for k, v in WORKLOADS.items() if k in os.environ["ONLY"].split()}

PP, TG = f"pp{KERNEL[0]}", f"tg{KERNEL[1]}"
# (label, how to read it from one round's results, True when higher is better)
METRICS = [
    ("(a) time to first token p50, ms", lambda r: r["a_one_stream"]["ttft_ms"]["p50"], False),
    ("(a) decode tok/s", lambda r: 1000.0 / r["a_one_stream"]["tpot_ms"]["p50"], True),
    ("(b) 8 clients: output tok/s", lambda r: r["b_8_clients"]["output_tok_s"], True),
    ("(b) 8 clients: p99 latency, ms", lambda r: r["b_8_clients"]["e2e_ms"]["p99"], False),
    ("(c) 32 clients: output tok/s", lambda r: r["c_32_clients"]["output_tok_s"], True),
    ("(c) 32 clients: p99 latency, ms", lambda r: r["c_32_clients"]["e2e_ms"]["p99"], False),
    ("(d) 8 clients, JSON schema: output tok/s", lambda r: r["d_8_clients_schema"]["output_tok_s"], True),
    ("(d) / (b): schema / none, output tok/s",
     lambda r: r["d_8_clients_schema"]["output_tok_s"] / r["b_8_clients"]["output_tok_s"], True),
    ("(e) 8 clients, chat: output tok/s", lambda r: r["e_8_clients_chat"]["output_tok_s"], True),
    ("(f) 8 clients, forced tool call: output tok/s", lambda r: r["f_8_clients_tool"]["output_tok_s"], True),
    ("(f) / (e): tool call / none, output tok/s",
     lambda r: r["f_8_clients_tool"]["output_tok_s"] / r["e_8_clients_chat"]["output_tok_s"], True),
    ("(g) 500 tokens in, 1 out: latency p50, ms", lambda r: r["g_first_token"]["e2e_ms"]["p50"], False),
    ("peak RSS, MiB", lambda r: r["peak_rss_kib"] / 1024.0, False),
    ("start to a healthy /health, s", lambda r: r["start_s"], False),
    ("start to full speed, s", lambda r: r["ready_s"], False),
    (f"kernel {PP} tok/s", lambda r: r["kernel"][PP], True),
    (f"kernel {TG} tok/s", lambda r: r["kernel"][TG], True),
]


def log(msg):
    print(f"bench/serve: {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw):
    """Runs a command; its failure ends the benchmark with the command's own output."""
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"bench/serve: {' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return r.stdout


def build():
    log("building kvwarden (release)")
    run(["cargo", "build", "--release", "-q", "-p", "kvwarden"])
    log("building llama.cpp's llama-server and llama-bench (cached in .peer/)")
    server = Path(run([ROOT / "bench" / "build-llama-server.sh"]).strip().splitlines()[-1])
    llama_bench = ROOT / ".peer" / f"llama-bench-{PEER_VERSION}"
    if not llama_bench.is_file():
        sys.exit(f"bench/serve: {llama_bench} is missing: remove .peer/ and run bench/build-llama-server.sh")
    if MODEL == DEFAULT_MODEL:
        run([ROOT / "scripts" / "fetch-model.sh"])
    elif not MODEL.is_file():
        sys.exit(f"bench/serve: MODEL={MODEL} does not exist")
    return server, llama_bench


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    sys.exit(f"bench/serve: no VmHWM in /proc/{pid}/status")


class Crashed(Exception):
    """A server died by a signal while starting."""


# On some Xeons llama.cpp's repacked (AMX) kernels crash (SIGILL or SIGSEGV): its default
# path cannot run there, so after such a crash llama-server runs with --no-repack and
# llama-bench with --repack 0, for the rest of the run, and the results say so.
LLAMA_FALLBACK = []


class Server:
    """One server process, started directly (so its pid is the server's own)."""

    def __init__(self, name, cmd, port, logdir):
        self.name, self.cmd, self.url = name, [str(c) for c in cmd], f"http://127.0.0.1:{port}"
        self.log_path = Path(logdir) / f"{name}.log"
        started = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "wb")
        )
        deadline = started + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.proc.returncode < 0:
                    raise Crashed(f"{self.name} died by signal {-self.proc.returncode} while starting")
                self.fail(f"exited with {self.proc.returncode} while starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.start_s = time.monotonic() - started
                        self.ready_s = self.full_speed(started, deadline)
                        return
            except (urllib.error.URLError, OSError):
                pass
            # Polled finely: the time to a healthy /health is one of the figures.
            time.sleep(0.02)
        self.fail("did not become healthy within 300 s")

    def full_speed(self, started, deadline):
        """Seconds from start to full speed. kvwarden answers while it repacks its weights
        and says "weights ready" when done (the workloads are measured from there);
        llama-server repacks before it is healthy."""
        if self.name != "kvwarden":
            return self.start_s
        while time.monotonic() < deadline:
            if b"weights ready" in self.log_path.read_bytes():
                return time.monotonic() - started
            if self.proc.poll() is not None:
                self.fail(f"exited with {self.proc.returncode} while repacking")
            time.sleep(0.02)
        self.fail("did not say \"weights ready\" within 300 s")

    def fail(self, why):
        self.stop()
        sys.exit(f"bench/serve: {self.name} {why}:\n{self.log_path.read_text(errors='replace')[-4000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_commands(llama_server, port):
    kvwarden = [
        BIN, "--threads", THREADS, "serve", "--model", MODEL, "--port", port,
        "--kv-pool-tokens", KV_TOKENS, "--max-running", SLOTS,
        *os.environ.get("KVWARDEN_ARGS", "").split(),
    ]
    llama = [
        llama_server, "-m", MODEL, "-t", THREADS, "-tb", THREADS, "-np", SLOTS, "-fa", "on",
        "-c", KV_TOKENS, "--host", "127.0.0.1", "--port", port, "--no-webui",
        *os.environ.get("LLAMA_ARGS", "").split(),
    ]
    return {"kvwarden": kvwarden, "llama.cpp": llama}


def bench_serve(url, clients, requests, prompt, out, seed, tmp, workload=""):
    path = Path(tmp) / f"report-{seed}.json"
    # A schema's or a forced call's answers end where it says (these run past max_tokens),
    # not at EOS.
    if workload.endswith("_schema"):
        shape = ["--json-schema", SCHEMA]
    elif workload.endswith("_tool"):
        shape = ["--tools", TOOLS, "--tool-choice", "required"]
    else:
        shape = ["--ignore-eos"]
    if workload.endswith(("_chat", "_tool")):
        prompts = ["--chat", "--prompt-words", prompt]
    else:
        prompts = ["--prompt-tokens", prompt, "--token-id-range", TOKEN_ID_RANGE]
    run([
        BIN, "bench", "serve", "--base-url", url, "--concurrency", clients,
        "--num-requests", requests, *prompts, "--max-tokens", out,
        *shape, "--seed", seed, "--json", path,
    ])
    return json.loads(path.read_text())


def kernels(name, llama_bench):
    """pp/tg tok/s of the kernels alone (no server), or None where it cannot be measured."""
    pp, tg = KERNEL
    if name == "kvwarden":
        env = dict(os.environ, RAYON_NUM_THREADS=str(THREADS), BENCH_PP=str(pp), BENCH_TG=str(tg),
                   BENCH_MODEL=str(MODEL))
        # The median of three runs (llama-bench averages its five repetitions): one decode
        # run on a VM lands up to 25% off its neighbours, as bench/quants.sh found.
        runs = []
        for _ in range(1 if QUICK else 3):
            line = run(["cargo", "bench", "-q", "-p", "model", "--bench", "throughput"], env=env).strip().splitlines()[-1]
            runs.append(dict(f.split("=") for f in line.split()[1:]))
        return {k: statistics.median(float(r[k]) for r in runs) for k in (PP, TG)}
    cmd = [llama_bench, "-m", MODEL, "-t", THREADS, "-fa", "on", "-p", pp, "-n", tg,
           "-r", 1 if QUICK else 5, "-o", "json"]
    if LLAMA_FALLBACK:
        cmd += ["--repack", "0"]
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
    if r.returncode < 0 and not LLAMA_FALLBACK:
        LLAMA_FALLBACK.append(f"llama-bench died by signal {-r.returncode}")
        log(f"{LLAMA_FALLBACK[-1]}: llama.cpp runs without repacking from here (--repack 0, --no-repack)")
        return kernels(name, llama_bench)
    rows = json.loads(run(cmd))
    speed = {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in rows}
    return {PP: speed[(pp, 0)], TG: speed[(0, tg)]}


def one_round(index, llama_server, llama_bench, tmp):
    order = ["kvwarden", "llama.cpp"] if index % 2 == 0 else ["llama.cpp", "kvwarden"]
    results, commands = {}, {}
    for name in order:
        port = free_port()
        cmd = server_commands(llama_server, port)[name]
        if name == "llama.cpp" and LLAMA_FALLBACK:
            cmd += ["--no-repack"]
        commands[name] = " ".join(map(str, cmd))
        log(f"round {index + 1}: {name}")
        try:
            server = Server(name, cmd, port, tmp)
        except Crashed as e:
            if name != "llama.cpp" or LLAMA_FALLBACK:
                sys.exit(f"bench/serve: {e}")
            LLAMA_FALLBACK.append(str(e))
            log(f"{e}: llama.cpp runs without repacking from here (--no-repack, --repack 0)")
            cmd += ["--no-repack"]
            commands[name] = " ".join(map(str, cmd))
            server = Server(name, cmd, port, tmp)
        try:
            # Warm-up, not recorded: the first request may pay for lazy set-up.
            bench_serve(server.url, 1, 1, 8, 4, 999, tmp)
            r = {}
            for seed, (w, (clients, requests, prompt, out)) in enumerate(WORKLOADS.items()):
                # (d) sends prompts of (b)'s shape and (f) of (e)'s, each under a seed of its
                # own: the same prompts again would be served from the prefix cache, which
                # would flatter the constrained run.
                r[w] = bench_serve(server.url, clients, requests, prompt, out, seed, tmp, w)
            r["peak_rss_kib"] = peak_rss_kib(server.proc.pid)
            r["start_s"] = server.start_s
            r["ready_s"] = server.ready_s
        finally:
            server.stop()
        r["kernel"] = kernels(name, llama_bench)
        results[name] = r
    return results, commands


def value(get, r):
    try:
        return get(r)
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def summarize(rounds):
    rows = []
    for label, get, higher in METRICS:
        row = {"metric": label, "higher_is_better": higher}
        for name in ("kvwarden", "llama.cpp"):
            vals = [value(get, r[name]) for r in rounds]
            row[name] = statistics.median(vals) if all(v is not None for v in vals) else None
        ours, theirs = row["kvwarden"], row["llama.cpp"]
        row["ratio"] = ours / theirs if ours is not None and theirs else None
        rows.append(row)
    return rows


def table(rows):
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"{'metric (medians of rounds)':<36}{'kvwarden':>12}{'llama.cpp':>12}{'ratio':>8}"]
    for r in rows:
        lines.append(
            f"{r['metric']:<36}{fmt(r['kvwarden'], '.1f'):>12}{fmt(r['llama.cpp'], '.1f'):>12}{fmt(r['ratio'], '.2f'):>8}"
        )
    return "\n".join(lines)


def main():
    llama_server, llama_bench = build()
    rounds, commands = [], {}
    with tempfile.TemporaryDirectory(prefix="kvwarden-bench-") as tmp:
        for i in range(ROUNDS):
            r, commands = one_round(i, llama_server, llama_bench, tmp)
            rounds.append(r)
    rows = summarize(rounds)
    print(f"kvwarden vs llama.cpp {PEER_VERSION}: {MODEL.name}, {THREADS} threads, {SLOTS} slots, "
          f"{KV_TOKENS}-token KV, {ROUNDS} rounds{' (QUICK: tiny workloads, figures meaningless)' if QUICK else ''}")
    if LLAMA_FALLBACK:
        print(f"llama.cpp without repacking ({LLAMA_FALLBACK[0]} on its default path)")
    print(table(rows))
    out = ROOT / "bench" / "results" / time.strftime("serve-%Y%m%dT%H%M%SZ.json", time.gmtime())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": str(MODEL), "threads": THREADS, "slots": SLOTS, "kv_tokens": KV_TOKENS,
        "quick": QUICK, "workloads": WORKLOADS, "kernel": {"pp": KERNEL[0], "tg": KERNEL[1]},
        "commands": commands, "summary": rows, "rounds": rounds, "llama_cpp_fallback": LLAMA_FALLBACK,
    }, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
