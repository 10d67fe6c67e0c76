#!/usr/bin/env python3
"""Long prompts: kvwarden `serve` against llama.cpp's `llama-server`, side by side.

    bench/long-context.py                 # SmolLM2 at 8,000 tokens, Gemma 3 at 30,000
    CASES=smollm2 bench/long-context.py   # one of them (smollm2, gemma3)
    PROMPT=2000 CASES=smollm2 bench/long-context.py

For each case, each server in turn on the same GGUF (same threads, one slot, flash
attention, a KV of the prompt plus the answer) answers ROUNDS (default 1) streaming
requests of PROMPT random token ids (ids from TOKEN_ID_RANGE, default 1000..10000) and 64
tokens out, ignore_eos, through `kvwarden bench serve`: time to first token, decode tok/s at
that depth (from the inter-token times), peak RSS. A fresh server per round, so no prefix
cache helps. It prints both, the ratios kvwarden / llama.cpp, and writes it all to
bench/results/long-context-<time>.json (git-ignored). Where llama.cpp's default (repacked)
path crashes it runs with --no-repack and says so. Timings are never pass/fail tests.
"""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (bench/serve.py: the build, the servers and the client)

ROOT = serve.ROOT
CASES = {
    "smollm2": (ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf", "scripts/fetch-model.sh", 8000),
    "gemma3": (ROOT / "models" / "gemma-3-270m-q4_k_m.gguf", "scripts/fetch-gemma3.sh", 30000),
}
OUT_TOKENS = 64
ROUNDS = int(os.environ.get("ROUNDS", "1"))
THREADS = serve.THREADS


def commands(name, model, ctx, llama_server, port):
    if name == "kvwarden":
        return [serve.BIN, "--threads", THREADS, "serve", "--model", model, "--port", port,
                "--kv-pool-tokens", ctx, "--max-running", 1,
                *os.environ.get("KVWARDEN_ARGS", "").split()]
    cmd = [llama_server, "-m", model, "-t", THREADS, "-tb", THREADS, "-np", 1, "-fa", "on",
           "-c", ctx, "--host", "127.0.0.1", "--port", port, "--no-webui",
           *os.environ.get("LLAMA_ARGS", "").split()]
    return cmd + (["--no-repack"] if serve.LLAMA_FALLBACK else [])


def start(name, model, ctx, llama_server, tmp):
    port = serve.free_port()
    try:
        return serve.Server(name, commands(name, model, ctx, llama_server, port), port, tmp)
    except serve.Crashed as e:
        if name != "llama.cpp" or serve.LLAMA_FALLBACK:
            sys.exit(f"bench/long-context: {e}")
        serve.LLAMA_FALLBACK.append(str(e))
        serve.log(f"{e}: llama.cpp runs without repacking from here (--no-repack)")
        return start(name, model, ctx, llama_server, tmp)


def one(name, model, prompt, llama_server, tmp, seed):
    ctx = prompt + OUT_TOKENS + 64
    server = start(name, model, ctx, llama_server, tmp)
    try:
        r = serve.bench_serve(server.url, 1, 1, prompt, OUT_TOKENS, seed, tmp)
        rss = serve.peak_rss_kib(server.proc.pid)
    finally:
        server.stop()
    return {
        "ttft_s": r["ttft_ms"]["p50"] / 1000.0,
        "decode_tok_s": 1000.0 / r["tpot_ms"]["p50"],
        "peak_rss_mib": rss / 1024.0,
    }


def main():
    llama_server, _ = serve.build()
    chosen = os.environ.get("CASES", ",".join(CASES)).split(",")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvwarden-long-") as tmp:
        for case in chosen:
            model, fetch, prompt = CASES[case]
            prompt = int(os.environ.get("PROMPT") or prompt)
            serve.run([ROOT / fetch])
            rounds = []
            for i in range(ROUNDS):
                order = ["kvwarden", "llama.cpp"] if i % 2 == 0 else ["llama.cpp", "kvwarden"]
                rnd = {}
                for name in order:
                    serve.log(f"{case}, {prompt} tokens, round {i + 1}: {name}")
                    rnd[name] = one(name, model, prompt, llama_server, tmp, 100 + i)
                rounds.append(rnd)
            results[case] = {"model": str(model), "prompt_tokens": prompt, "rounds": rounds}
    print(f"kvwarden vs llama.cpp {serve.PEER_VERSION}, {THREADS} threads, one request, "
          f"{OUT_TOKENS} tokens out, medians of {ROUNDS} round(s)")
    if serve.LLAMA_FALLBACK:
        print(f"llama.cpp without repacking ({serve.LLAMA_FALLBACK[0]} on its default path)")
    print(f"{'case':<22}{'metric':<22}{'kvwarden':>10}{'llama.cpp':>11}{'ratio':>8}")
    for case, res in results.items():
        for metric in ("ttft_s", "decode_tok_s", "peak_rss_mib"):
            ours = statistics.median(r["kvwarden"][metric] for r in res["rounds"])
            theirs = statistics.median(r["llama.cpp"][metric] for r in res["rounds"])
            res.setdefault("summary", {})[metric] = {"kvwarden": ours, "llama.cpp": theirs,
                                                     "ratio": ours / theirs}
            print(f"{case + ' ' + str(res['prompt_tokens']):<22}{metric:<22}{ours:>10.2f}"
                  f"{theirs:>11.2f}{ours / theirs:>8.2f}")
    out = ROOT / "bench" / "results" / time.strftime("long-context-%Y%m%dT%H%M%SZ.json", time.gmtime())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"threads": THREADS, "results": results,
                               "llama_cpp_fallback": serve.LLAMA_FALLBACK}, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
