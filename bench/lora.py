#!/usr/bin/env python3
"""What serving LoRA adapters costs: one kvwarden `serve` with four rank-16 adapters, the
same load on the base model and spread over the adapters, in the same run.

    bench/lora.py                   # run it on an otherwise idle machine
    QUICK=1 bench/lora.py           # tiny workloads: proves the pipeline, figures meaningless
    MODEL=path/to/other.gguf RANK=32 bench/lora.py

It builds kvwarden (release), writes four synthetic adapters for MODEL (`kvwarden
synth-lora`, rank RANK (default 16) on all seven weights of every layer, f32, seeds 1 to 4),
starts `serve` with all four (`--lora a1=...` ... `--lora a4=...`) and THREADS threads, then
for ROUNDS rounds (default 3) alternates two loads of the same prompts with `kvwarden bench
serve` (streaming /v1/completions, token-id prompts, ignore_eos):

  base      8 clients, 32 requests of 200 prompt + 64 out, `model` = the base model
  adapters  the same, request i sending `model` = a{i mod 4 + 1} (`--models`): every step
            mixes rows of all four adapters

and prints each load's median output tok/s and adapters / base (the issue asks >= 0.8),
writing everything to bench/results/lora-<time>.json (git-ignored). Timings here are never
pass/fail tests.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (bench/serve.py: the build, the servers and the client)

ROOT = serve.ROOT
ROUNDS = int(os.environ.get("ROUNDS", "3"))
RANK = int(os.environ.get("RANK", "16"))
QUICK = os.environ.get("QUICK") == "1"
CLIENTS, REQUESTS, PROMPT, OUT = (2, 4, 32, 8) if QUICK else (8, 32, 200, 64)
ADAPTERS = [f"a{i}" for i in range(1, 5)]


def load(url, models, seed, tmp):
    path = Path(tmp) / f"report-{seed}-{time.monotonic_ns()}.json"
    serve.run([serve.BIN, "bench", "serve", "--base-url", url, "--concurrency", CLIENTS,
               "--num-requests", REQUESTS, "--prompt-tokens", PROMPT,
               "--token-id-range", serve.TOKEN_ID_RANGE, "--max-tokens", OUT, "--ignore-eos",
               "--models", ",".join(models), "--seed", seed, "--json", path])
    return json.loads(path.read_text())


def main():
    serve.log("building kvwarden (release)")
    serve.run(["cargo", "build", "--release", "-q", "-p", "kvwarden"])
    if serve.MODEL == serve.DEFAULT_MODEL:
        serve.run([ROOT / "scripts" / "fetch-model.sh"])
    base = serve.MODEL.name.removesuffix(".gguf")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvwarden-lora-") as tmp:
        flags = []
        for seed, name in enumerate(ADAPTERS, start=1):
            path = Path(tmp) / f"{name}.gguf"
            serve.run([serve.BIN, "synth-lora", "--base", serve.MODEL, "--out", path,
                       "--rank", RANK, "--seed", seed])
            flags += ["--lora", f"{name}={path}"]
        port = serve.free_port()
        cmd = serve.server_commands(None, port)["kvwarden"] + flags
        server = serve.Server("kvwarden-lora", cmd, port, tmp)
        try:
            load(server.url, [base], 999, tmp)
            for i in range(ROUNDS):
                order = [("base", [base]), ("adapters", ADAPTERS)]
                if i % 2:
                    order.reverse()
                results = {}
                for label, models in order:
                    serve.log(f"round {i + 1}: {label}")
                    results[label] = load(server.url, models, i, tmp)
                rounds.append(results)
        finally:
            server.stop()
    tok_s = {label: sorted(r[label]["output_tok_s"] for r in rounds)[len(rounds) // 2]
             for label in ("base", "adapters")}
    ratio = tok_s["adapters"] / tok_s["base"]
    print(f"{CLIENTS} clients, {REQUESTS} requests of {PROMPT} + {OUT}, rank {RANK}, {serve.THREADS} threads")
    print(f"base model: {tok_s['base']:.1f} output tok/s")
    print(f"4 adapters: {tok_s['adapters']:.1f} output tok/s")
    print(f"adapters / base: {ratio:.3f}  (per round: "
          + ", ".join(f"{r['adapters']['output_tok_s'] / r['base']['output_tok_s']:.3f}" for r in rounds) + ")")
    out = ROOT / "bench" / "results" / f"lora-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"tok_s": tok_s, "ratio": ratio, "rounds": rounds, "rank": RANK,
                               "model": str(serve.MODEL)}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
