"""kvwarden router + 1 prefill + 1 decode against the monolithic server, same machine, same
run, same binary (target/release/kvwarden), streaming /v1/completions with token-id
prompts and ignore_eos. Prints TTFT and output tokens/s for each, their ratios, and the KV
bytes moved per prompt token. Run on an otherwise idle machine: `python3 bench/disagg.py`.

The monolithic server gets --threads 2; each node gets --threads 1 (NODE_THREADS to
change it), so both deployments use the same two cores.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "target" / "release" / "kvwarden"
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def start(args, log):
    p = subprocess.Popen([str(BIN), *args], stdout=subprocess.DEVNULL, stderr=open(log, "wb"), cwd=ROOT)
    return p


def wait(log, pattern, proc):
    deadline = time.time() + 120
    while time.time() < deadline:
        m = re.search(pattern, Path(log).read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            sys.exit(Path(log).read_text())
        time.sleep(0.05)
    sys.exit(f"timeout waiting for {pattern} in {log}")


def stream(url, prompt, max_tokens):
    """(ttft seconds, output tokens, total seconds) of one streamed completion."""
    body = json.dumps({
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, n = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if ev.get("error"):
                    sys.exit(f"error: {ev}")
                if ev["choices"][0]["text"]:
                    n += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    return ttft, n, time.perf_counter() - t0


def prompt(seed, n):
    return [1000 + (i * 37 + seed * 101) % 40000 for i in range(n)]


def workload(url):
    stream(url, prompt(99, 32), 4)  # warm up
    single = [stream(url, prompt(s, 500), 128) for s in range(3)]
    ttft = statistics.median(x[0] for x in single)
    decode = statistics.median((x[1] - 1) / (x[2] - x[0]) for x in single)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        out = list(pool.map(lambda s: stream(url, prompt(100 + s, 200), 64), range(32)))
    wall = time.perf_counter() - t0
    return {"ttft_500": ttft, "decode_tok_s": decode, "8x_output_tok_s": sum(x[1] for x in out) / wall}


def metrics(url):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return dict(
        (k, float(v)) for k, _, v in (line.rpartition(" ") for line in text.splitlines() if line and line[0] != "#")
    )


def main():
    if not BIN.exists():
        sys.exit("build first: cargo build --release -p kvwarden")
    tmp = Path(tempfile.mkdtemp())
    results = {}
    mono = start(["--threads", "2", "serve", "--port", "0", "--kv-pool-tokens", "32768",
                  "--served-model-name", "m", "--model", str(MODEL)], tmp / "mono.log")
    url = wait(tmp / "mono.log", r"listening on (http://[0-9.:]+)", mono)
    results["monolithic"] = workload(url)
    mono.terminate(); mono.wait()

    subprocess.run([str(BIN), "certs", "--out", str(tmp / "c"), "--name", "r", "--name", "p", "--name", "d"],
                   check=True, capture_output=True)
    tls = lambda n: ["--tls-ca", str(tmp / "c/ca.pem"), "--tls-cert", str(tmp / f"c/{n}.pem"), "--tls-key", str(tmp / f"c/{n}.key")]  # noqa: E731
    procs = []
    addrs = {}
    for role, n in (("prefill", "p"), ("decode", "d")):
        p = start(["--threads", os.environ.get("NODE_THREADS", "1"), "serve", "--role", role, "--port", "0", "--metrics-port", "0",
                   "--kv-pool-tokens", "32768", "--model", str(MODEL), *tls(n)], tmp / f"{n}.log")
        procs.append(p)
        addrs[role] = wait(tmp / f"{n}.log", r"internal API on ([0-9.:]+)", p)
        addrs[role + "_metrics"] = wait(tmp / f"{n}.log", r"metrics on (http://[0-9.:]+)", p)
    router = start(["router", "--port", "0", "--served-model-name", "m", "--model", str(MODEL),
                    "--prefill", addrs["prefill"], "--decode", addrs["decode"], *tls("r")], tmp / "r.log")
    procs.append(router)
    url = wait(tmp / "r.log", r"listening on (http://[0-9.:]+)", router)
    results["router+1+1"] = workload(url)
    m = metrics(addrs["decode_metrics"])
    pm = metrics(addrs["prefill_metrics"])
    moved = m['kvwarden_transfer_bytes_total{direction="received"}']
    prompt_tokens = pm["kvwarden_prompt_tokens_total"]
    for p in procs:
        p.terminate(); p.wait()

    for k in results["monolithic"]:
        a, b = results["router+1+1"][k], results["monolithic"][k]
        print(f"{k:>16}: router+1+1 {a:9.3f}  monolithic {b:9.3f}  ratio {a / b:.2f}")
    print(f"KV bytes moved per prompt token: {moved / prompt_tokens:.0f} ({moved:.0f} bytes, {prompt_tokens:.0f} prompt tokens)")


if __name__ == "__main__":
    main()
