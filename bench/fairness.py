#!/usr/bin/env python3
"""One tenant's flood against another's first token, with default fairness settings.

    bench/fairness.py                  # ROUNDS=2 BOB=20 by default
    ROUNDS=1 BOB=40 bench/fairness.py
    KVWARDEN_ARGS="--max-running 16" bench/fairness.py
    KVWARDEN_BIN=/path/to/other/kvwarden bench/fairness.py   # another build, for before/after
    DEPLOYMENT=cluster .venv/bin/python bench/fairness.py   # router + prefill + decode node

`kvwarden serve` (release build, the default model, two API keys and no tenant limits,
`--kv-pool-tokens POOL`, default 12288): Bob's time to first token alone (the fastest of 5 one-token
streaming requests), then while Alice keeps 48 streams of 400 generated tokens in flight
(more than the 32 running slots; her streams run HOLD seconds first, so they are hundreds
of tokens deep and the pool is short), BOB requests of Bob's one after the other, each
after a random pause of 0-80 ms. Reported: Bob's loaded times over his unloaded one
(median, 90th percentile, worst), Alice's output tok/s, and the engine's mean step time
under the flood. Issue 26's bound is 3x. Writes bench/results/fairness-<time>.json
(git-ignored). With DEPLOYMENT=cluster the same runs through `kvwarden router` over one
prefill and one decode node (the test suite's `Cluster`, so the Python environment of
scripts/python-env.sh), the three processes on the same cores. Timings are never pass/fail
tests.
"""

import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (bench/serve.py: the build, the servers)

ROOT = serve.ROOT
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ROUNDS = int(os.environ.get("ROUNDS", "2"))
BOB = int(os.environ.get("BOB", "20"))
HOLD = float(os.environ.get("HOLD", "10"))
POOL = int(os.environ.get("POOL", "12288"))
DEPLOYMENT = os.environ.get("DEPLOYMENT", "serve")
# Another build to compare (built by whoever sets it); by default this checkout's release.
BIN = Path(os.environ.get("KVWARDEN_BIN") or serve.BIN)
ALICE, BOB_KEY = "alice-key-0123456789", "bob-key-0123456789"
MODEL_ID = [""]


def post_stream(url, key, body):
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return urllib.request.urlopen(req, timeout=300)


def model_id(url):
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {BOB_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def first_token(url, prompt):
    t = time.monotonic()
    with post_stream(url, BOB_KEY, {"model": MODEL_ID[0], "prompt": prompt, "max_tokens": 1,
                                    "temperature": 0, "stream": True}) as r:
        for line in r:
            if line.startswith(b"data: {"):
                return time.monotonic() - t
    raise RuntimeError("no token")


def metric(url, name):
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {BOB_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return float("nan")  # a router reports its nodes' engine counters on their own /metrics


def one_round(tmp):
    keys = Path(tmp) / "keys.txt"
    keys.write_text(f"{ALICE} alice\n{BOB_KEY} bob\n")
    args = ["--kv-pool-tokens", POOL, "--api-keys", keys,
            *os.environ.get("KVWARDEN_ARGS", "").split()]
    if DEPLOYMENT == "cluster":
        os.environ["KVWARDEN_BIN"] = str(BIN)
        sys.path.insert(0, str(ROOT / "tests" / "python"))
        import conftest  # noqa: E402  (the suite's cluster: certificates, nodes, router)
        server = conftest.Cluster(args, Path(tmp) / "cluster")
    else:
        port = serve.free_port()
        cmd = [BIN, "--threads", serve.THREADS, "serve", "--model", MODEL, "--port", port,
               *args]
        server = serve.Server("kvwarden", cmd, port, tmp)
    url = server.url
    try:
        MODEL_ID[0] = model_id(url)
        unloaded = min(first_token(url, f"Bob asks question {i}.") for i in range(5))
        stop, tokens, started = threading.Event(), [0], threading.Semaphore(0)
        failures = []

        def alice(i):
            body = {"model": MODEL_ID[0], "prompt": f"Alice's essay number {i} begins:",
                    "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
            while not stop.is_set():
                try:
                    with post_stream(url, ALICE, body) as r:
                        first = True
                        for line in r:
                            if line.startswith(b"data: {"):
                                tokens[0] += 1
                                if first:
                                    started.release()
                                    first = False
                            if stop.is_set():
                                break
                except OSError as e:
                    if not stop.is_set():
                        failures.append(repr(e))
                    return

        flood = [threading.Thread(target=alice, args=(i,), daemon=True) for i in range(48)]
        for t in flood:
            t.start()
        for _ in range(32):
            if not started.acquire(timeout=120):
                sys.exit(f"bench/fairness: Alice's streams did not start: {failures[:3]}")
        time.sleep(HOLD)
        steps0, busy0 = metric(url, "kvwarden_engine_steps_total"), time.monotonic()
        tok0 = tokens[0]
        loaded = []
        for i in range(BOB):
            time.sleep(random.uniform(0, 0.08))
            loaded.append(first_token(url, f"Bob asks question {i} again."))
        elapsed = time.monotonic() - busy0
        steps = metric(url, "kvwarden_engine_steps_total") - steps0
        alice_tps = (tokens[0] - tok0) / elapsed
        stop.set()
    finally:
        server.stop()
    ratios = sorted(x / unloaded for x in loaded)
    return {
        "unloaded_s": unloaded,
        "loaded_s": loaded,
        "median": statistics.median(ratios),
        "p90": ratios[int(0.9 * (len(ratios) - 1) + 0.5)],
        "worst": ratios[-1],
        "alice_tok_s": alice_tps,
        "mean_step_ms": 1000 * elapsed / max(steps, 1),
    }


def main():
    if BIN == serve.BIN:
        serve.log("building kvwarden (release)")
        serve.run(["cargo", "build", "--release", "-q", "-p", "kvwarden"])
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = os.environ.get("LOGDIR", tmp)
        for i in range(ROUNDS):
            r = one_round(tmp)
            serve.log(f"{DEPLOYMENT} round {i + 1}: unloaded {1000 * r['unloaded_s']:.1f} ms; loaded / "
                      f"unloaded median {r['median']:.2f}, p90 {r['p90']:.2f}, worst "
                      f"{r['worst']:.2f}; Alice {r['alice_tok_s']:.1f} tok/s; a step "
                      f"{r['mean_step_ms']:.1f} ms")
            rounds.append(r)
    out = ROOT / "bench" / "results" / f"fairness-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"deployment": DEPLOYMENT,
                               "args": os.environ.get("KVWARDEN_ARGS", ""), "rounds": rounds},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
