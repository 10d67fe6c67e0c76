#!/usr/bin/env python3
"""Speculative decoding: kvwarden with `--speculation off`, with the default (`auto`) and
llama.cpp's `llama-server` (no speculation), side by side in one run.

    bench/speculation.py
    ROUNDS=2 bench/speculation.py
    MODEL=models/SmolLM2-135M-Instruct.Q8_0.gguf DRAFT_MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf \
        bench/speculation.py

On the default model (bench/serve.py's build, servers and settings: THREADS, 32 slots, a
32,768-token KV, flash attention for llama.cpp) each server in turn answers, through
`kvwarden bench serve`, streaming /v1/completions, temperature 0:
  (s) one stream, 8 input-grounded requests (`--repeat-words 120`: a passage of 120 common
      words and the instruction to repeat it), up to 192 tokens out, ending where the model
      ends: output tok/s;
  (a) one stream, 5 requests of 500 random token ids + 128 out, ignore_eos (bench/serve.py's
      (a), text that rarely repeats): output tok/s;
  (c) 32 clients, 64 requests of 200 + 64, ignore_eos (bench/serve.py's (c)): output tok/s.
It prints each figure, the ratios against `--speculation off` and against llama.cpp, the
draft tokens kvwarden verified and kept, and writes it all to
bench/results/speculation-<time>.json (git-ignored). Where llama.cpp's default (repacked)
path crashes it runs with --no-repack and says so. Timings are never pass/fail tests.

With DRAFT_MODEL set, the drafts come from that model (`--draft-model`) instead of prompt
lookup, kvwarden also runs with `--speculation on`, and llama.cpp speculates with the same
draft model (`-md`; its verification batches rows, so its tokens may drift from its plain
decoding's, which kvwarden's cannot).
"""

import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402  (bench/serve.py: the build, the servers and the client)

ROOT = serve.ROOT
ROUNDS = int(os.environ.get("ROUNDS", "1"))
# name: (clients, requests, prompt flags, max tokens, extra flags)
WORKLOADS = {
    "s_one_stream_repeat": (1, 8, ["--repeat-words", 120], 192, []),
    "a_one_stream": (1, 5, ["--prompt-tokens", 500, "--token-id-range", serve.TOKEN_ID_RANGE], 128,
                     ["--ignore-eos"]),
    "c_32_clients": (32, 64, ["--prompt-tokens", 200, "--token-id-range", serve.TOKEN_ID_RANGE], 64,
                     ["--ignore-eos"]),
}
DRAFT = os.environ.get("DRAFT_MODEL")
DRAFT = str(Path(DRAFT).resolve()) if DRAFT else None
SERVERS = ["kvwarden off", "kvwarden auto"] + (["kvwarden on"] if DRAFT else []) + ["llama.cpp"]


def command(name, llama_server, port):
    cmds = serve.server_commands(llama_server, port)
    if name.startswith("kvwarden"):
        mode = name.split()[1]
        drafting = ["--draft-model", DRAFT] if DRAFT and mode != "off" else []
        return cmds["kvwarden"] + ["--speculation", mode, *drafting]
    drafting = ["-md", DRAFT] if DRAFT else []
    return cmds["llama.cpp"] + drafting + (["--no-repack"] if serve.LLAMA_FALLBACK else [])


def start(name, llama_server, tmp):
    port = serve.free_port()
    try:
        return serve.Server(name.replace(" ", "-"), command(name, llama_server, port), port, tmp)
    except serve.Crashed as e:
        if name != "llama.cpp" or serve.LLAMA_FALLBACK:
            sys.exit(f"bench/speculation: {e}")
        serve.LLAMA_FALLBACK.append(str(e))
        serve.log(f"{e}: llama.cpp runs without repacking from here (--no-repack)")
        return start(name, llama_server, tmp)


def load(url, clients, requests, prompt, out, extra, seed, tmp):
    path = Path(tmp) / f"report-{seed}-{time.monotonic_ns()}.json"
    serve.run([serve.BIN, "bench", "serve", "--base-url", url, "--concurrency", clients,
               "--num-requests", requests, *prompt, "--max-tokens", out, *extra,
               "--seed", seed, "--json", path])
    return json.loads(path.read_text())


def drafts(url):
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("kvwarden_") and "draft" in line:
            name, value = line.split()
            values[name] = float(value)
    return values


def main():
    llama_server, _ = serve.build()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kvwarden-spec-") as tmp:
        for i in range(ROUNDS):
            results = {}
            order = SERVERS if i % 2 == 0 else SERVERS[::-1]
            for name in order:
                serve.log(f"round {i + 1}: {name}")
                server = start(name, llama_server, tmp)
                try:
                    load(server.url, 1, 1, ["--prompt-tokens", 8], 4, [], 999, tmp)
                    r = {}
                    for seed, (w, (clients, requests, prompt, out, extra)) in enumerate(WORKLOADS.items()):
                        before = drafts(server.url) if name.startswith("kvwarden") else {}
                        r[w] = load(server.url, clients, requests, prompt, out, extra, seed, tmp)
                        if name.startswith("kvwarden"):
                            after = drafts(server.url)
                            r[w]["drafts"] = {k: after[k] - before.get(k, 0) for k in after}
                finally:
                    server.stop()
                results[name] = r
            rounds.append(results)
    rows = []
    for w in WORKLOADS:
        tok_s = {n: sorted(r[n][w]["output_tok_s"] for r in rounds)[ROUNDS // 2] for n in SERVERS}
        d = rounds[-1]["kvwarden auto"][w].get("drafts", {})
        rows.append({
            "workload": w, **{f"{n} output tok/s": tok_s[n] for n in SERVERS},
            "auto / off": tok_s["kvwarden auto"] / tok_s["kvwarden off"],
            **({"on / off": tok_s["kvwarden on"] / tok_s["kvwarden off"]} if DRAFT else {}),
            "auto / llama.cpp": tok_s["kvwarden auto"] / tok_s["llama.cpp"],
            "draft tokens": d.get("kvwarden_draft_tokens_total"),
            "kept": d.get("kvwarden_accepted_draft_tokens_total"),
        })
    print(f"{'workload':<22}{'off':>9}{'auto':>9}{'llama.cpp':>11}{'auto/off':>10}{'auto/llama':>12}{'drafted':>9}{'kept':>8}")
    for r in rows:
        print(f"{r['workload']:<22}{r['kvwarden off output tok/s']:>9.1f}{r['kvwarden auto output tok/s']:>9.1f}"
              f"{r['llama.cpp output tok/s']:>11.1f}{r['auto / off']:>10.2f}{r['auto / llama.cpp']:>12.2f}"
              f"{r['draft tokens'] or 0:>9.0f}{r['kept'] or 0:>8.0f}")
    if DRAFT:
        print("with --draft-model " + DRAFT + ": on / off " +
              ", ".join(f"{r['workload']} {r['on / off']:.2f}" for r in rows))
    if serve.LLAMA_FALLBACK:
        print(f"llama.cpp ran with --no-repack: {serve.LLAMA_FALLBACK[0]}")
    out = ROOT / "bench" / "results" / f"speculation-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "rounds": rounds, "llama_fallback": serve.LLAMA_FALLBACK,
                               "model": str(serve.MODEL), "draft_model": DRAFT}, indent=2))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
