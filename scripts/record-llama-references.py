#!/usr/bin/env python3
"""Records llama.cpp's greedy tokens and top-n log-probabilities on the real test files.

For each model in MODELS, starts llama.cpp's own server (.peer/llama-server-0.3.36, built by
bench/build-llama-server.sh), turns each prompt of PROMPTS into token ids with the server's
own tokenizer (and, for chat prompts, the file's own template through /apply-template),
asks /completion for N_PREDICT greedy tokens with the top N_PROBS log-probabilities of every
step taken from the softmax of the raw logits (post_sampling_probs false), and writes
tests/data/llama-refs/<model>.json. crates/model/tests/llama_references.rs replays the same
token ids through kvwarden's model and compares.

Adding a file (another architecture, another quantization): one line in MODELS naming the
file under models/ and the script that fetches it, then one entry in the Rust test.

--lora records the same under LoRA adapters instead: for each (file, adapter type) of LORA,
a synthetic adapter written by `kvwarden synth-lora` (deterministic: LORA_SPEC's rank, alpha
and seed) into target/lora-refs/, loaded by llama-server with `--lora FILE` (scale 1), into
tests/data/llama-refs/lora/<model>.<type>.json, whose meta names the adapter (its synth-lora
arguments, bytes and sha256). The Rust test regenerates the adapter from those arguments
with the same generator (crates/model/src/lora/synth.rs), checks its bytes, and replays.

Usage: scripts/record-llama-references.py [--lora] [MODEL_NAME ...]   (default: every model)
Plain python3, standard library only.
"""

import collections
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.3.36"
N_PREDICT = 16
N_PROBS = 20

# (file name under models/ without .gguf, the script that makes it)
MODELS = [
    ("SmolLM2-135M-Instruct.Q4_1", "scripts/fetch-model.sh"),
    ("SmolLM2-135M-Instruct.Q8_0", "scripts/fetch-quant-models.sh"),
    ("SmolLM2-135M-Instruct.Q6_K", "scripts/fetch-quant-models.sh"),
    ("SmolLM2-135M-Instruct.Q5_K_M", "scripts/fetch-quant-models.sh"),
    ("SmolLM2-135M-Instruct.Q4_K_M", "scripts/fetch-quant-models.sh"),
    ("SmolLM2-135M-Instruct.Q3_K_M", "scripts/fetch-quant-models.sh"),
    ("SmolLM2-135M-Instruct.Q2_K", "scripts/fetch-quant-models.sh"),
    ("SmolLM2-135M-Instruct.Q2_K-pure", "scripts/fetch-quant-models.sh"),
    ("gemma-3-270m-q4_k_m", "scripts/fetch-gemma3.sh"),
    # Random weights, written by kvwarden: the architectures no small real file exists for.
    ("synth-qwen2-q4_k", "scripts/make-synthetic-models.sh"),
    ("synth-qwen3-q6_k", "scripts/make-synthetic-models.sh"),
    ("synth-llama3-q5_k", "scripts/make-synthetic-models.sh"),
]

# The LoRA references (--lora; scripts/eval-references.py --lora uses the same): the default
# model and a synthetic qwen2 file (QKV biases after the adapted products) under an f32
# adapter, whose products llama.cpp computes in f32 as kvwarden does, and the default model
# under the same adapter stored in f16 (llama.cpp rounds the activations to f16 for its
# products; kvwarden widens the adapter to f32 and keeps them f32).
LORA = [
    ("SmolLM2-135M-Instruct.Q4_1", "f32"),
    ("synth-qwen2-q4_k", "f32"),
    ("SmolLM2-135M-Instruct.Q4_1", "f16"),
]
# `kvwarden synth-lora`'s arguments (every layer weight adapted; both halves random, so the
# adapter moves the output from the first token).
LORA_SPEC = {"rank": 16, "alpha": 32, "seed": 23}

SYSTEM = "You are a helpful assistant."
# Plain text, or a list of chat messages rendered by the file's own template.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": "Write a haiku about the ocean."}],
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg, a goldsmith from Mainz, combined movable metal type, oil-based ink and a "
    "screw press adapted from wine making. Within fifty years printing shops had spread to "
    "more than two hundred cities across Europe, and the number of books in circulation grew "
    "from thousands to millions. Historians often argue that the most important consequence "
    "of this change was",
]

# Flash attention on and no weight repacking: ggml's plain CPU kernels, the settings of the
# goldens in tests/data/golden (kvwarden reproduces their arithmetic). Prompts go through in
# micro-batches of 32 (-ub 32): from 64 query rows on, this ggml switches flash attention to
# a tiled f32 kernel (GGML_FA_TILE_Q) whose results differ from its one-row kernel by up to
# 0.4 nats on the long prompt below, so llama.cpp's own output would depend on how its
# prompt was batched; kvwarden's does not (it reproduces the one-row arithmetic everywhere).
SERVER_FLAGS = ["-t", "2", "-np", "1", "-c", "2048", "-ub", "32", "-fa", "on", "--no-repack",
                "--no-webui"]
# Likewise, from 8 prompt rows on, this ggml multiplies K-quant weights with a tiled kernel
# (ggml-cpu/tiled/) instead of its vec_dot one, which moves the logprobs by up to 0.4 nats per
# K-quant tensor on these files; its decode path, and kvwarden, use the vec_dot arithmetic.
SERVER_ENV = {"GGML_CPU_TILED_MM": "0"}

GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL",
              30: "BF16"}


def tensor_types(path: Path) -> dict:
    """Counts of tensor types in a GGUF file (header only)."""
    with open(path, "rb") as f:
        def u(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(u("Q"))

        def skip(ty):
            sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
            if ty == 8:
                string()
            elif ty == 9:
                inner, n = u("I"), u("Q")
                if inner in sizes:
                    f.seek(sizes[inner] * n, 1)
                else:
                    for _ in range(n):
                        skip(inner)
            else:
                f.seek(sizes[ty], 1)

        if f.read(4) != b"GGUF":
            sys.exit(f"{path}: not a GGUF file")
        u("I")
        n_tensors, n_kv = u("Q"), u("Q")
        for _ in range(n_kv):
            string()
            skip(u("I"))
        counts = collections.Counter()
        for _ in range(n_tensors):
            string()
            n_dims = u("I")
            f.seek(8 * n_dims, 1)
            ty = u("I")
            u("Q")
            counts[GGML_TYPES.get(ty, f"type{ty}")] += 1
    return dict(sorted(counts.items()))


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary, model, extra=()):
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           *SERVER_FLAGS, *extra]
    log = open(ROOT / "target" / "llama-references-server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **SERVER_ENV})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"llama-server exited with {proc.returncode}; see target/llama-references-server.log")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url, cmd
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("llama-server did not become healthy in 300 s")


def prompt_ids(url, prompt, bos):
    if isinstance(prompt, str):
        text = prompt
    else:
        text = post(url + "/apply-template", {"messages": prompt})["prompt"]
    ids = post(url + "/tokenize", {"content": text, "add_special": True,
                                   "parse_special": True})["tokens"]
    # A template that writes its own BOS gets no second one (llama.cpp warns about that).
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return text, ids


def compact_json(out):
    """Indented JSON with one line per step, so a diff of two recordings reads step by step."""
    meta = json.dumps(out["meta"], indent=1).replace("\n", "\n ")
    cases = []
    for c in out["cases"]:
        head = {k: v for k, v in c.items() if k != "steps"}
        steps = ",\n".join("   " + json.dumps(s, separators=(",", ":")) for s in c["steps"])
        cases.append("  " + json.dumps(head)[:-1] + ', "steps": [\n' + steps + "\n  ]}")
    return '{\n "meta": ' + meta + ',\n "cases": [\n' + ",\n".join(cases) + "\n ]\n}\n"


def kvwarden_binary():
    """KVWARDEN, or the checkout's debug binary (built here first, so it is the checkout's)."""
    if os.environ.get("KVWARDEN"):
        return os.environ["KVWARDEN"]
    subprocess.run(["cargo", "build", "-q", "-p", "kvwarden"], cwd=ROOT, check=True)
    return str(ROOT / "target" / "debug" / "kvwarden")


def lora_args(ty):
    """`kvwarden synth-lora`'s arguments for LORA_SPEC in tensor type `ty`."""
    return ["--rank", str(LORA_SPEC["rank"]), "--alpha", str(LORA_SPEC["alpha"]),
            "--seed", str(LORA_SPEC["seed"]), "--type", ty]


def make_adapter(kvwarden, model, out, ty):
    """Writes LORA_SPEC's adapter for `model` in type `ty` to `out`; returns its meta."""
    out.parent.mkdir(parents=True, exist_ok=True)
    args = lora_args(ty)
    p = subprocess.run([kvwarden, "synth-lora", "--base", str(model), "--out", str(out), *args],
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"kvwarden synth-lora failed for {model}:\n{p.stderr}")
    data = out.read_bytes()
    return {"synth_lora": " ".join(["kvwarden", "synth-lora", "--base",
                                     f"models/{model.name}", *args]),
            **LORA_SPEC, "type": ty, "scale": 1.0, "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def record(name, fetch, binary, lora=None):
    """Records one file's references (under the adapter `lora`, a (type, kvwarden binary)
    pair, when given)."""
    model = ROOT / "models" / f"{name}.gguf"
    if not model.is_file():
        subprocess.run(["bash", str(ROOT / fetch)], check=True)
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    extra, adapter = [], None
    if lora:
        ty, kvwarden = lora
        path = ROOT / "target" / "lora-refs" / f"{name}.{ty}.gguf"
        adapter = make_adapter(kvwarden, model, path, ty)
        extra = ["--lora", str(path)]
    proc, url, cmd = start_server(binary, model, extra)
    try:
        empty = post(url + "/tokenize", {"content": "", "add_special": True})["tokens"]
        bos = empty[0] if empty else None
        cases, left_out = [], []
        for prompt in PROMPTS:
            text, ids = prompt_ids(url, prompt, bos)
            r = post(url + "/completion", {
                "prompt": ids, "n_predict": N_PREDICT, "temperature": 0, "seed": 0,
                "n_probs": N_PROBS, "post_sampling_probs": False, "cache_prompt": False,
                "return_tokens": True,
            })
            steps = []
            for p in r.get("completion_probabilities", []):
                top = [[t["id"], round(t["logprob"], 6)] for t in p["top_logprobs"]]
                steps.append({"token": p["id"], "top": top})
            # The server leaves out the probabilities of tokens it has not emitted as text
            # yet (a byte-level vocabulary's incomplete UTF-8 at the end): keep the steps
            # it reported, which must be the first tokens.
            if [s["token"] for s in steps] != r["tokens"][:len(steps)]:
                sys.exit(f"{name}: completion_probabilities and tokens disagree")
            if not steps:
                # All of it held back (a synthetic file under an adapter can repeat one
                # byte of a multi-byte character 16 times): nothing to compare, said in
                # the meta; the Rust test requires enough steps over the other cases.
                if not lora:
                    sys.exit(f"{name}: no completion_probabilities for {text!r}")
                left_out.append({"prompt": text, "tokens": r["tokens"],
                                 "reason": "llama-server reported no probabilities (its "
                                           "output is incomplete UTF-8 throughout)"})
                continue
            cases.append({"prompt": text, "prompt_tokens": ids, "stop_type": r["stop_type"],
                          "steps": steps})
    finally:
        proc.terminate()
        proc.wait()
    out = {
        "meta": {
            "model": f"models/{name}.gguf, made by {fetch}",
            "sha256": sha,
            "bytes": model.stat().st_size,
            "tensor_types": tensor_types(model),
            "reference": f"llama.cpp llama-server from the llama-cpp-python=={VERSION} sdist "
                         "(bench/build-llama-server.sh)",
            "server": " ".join([*(f"{k}={v}" for k, v in SERVER_ENV.items()), "llama-server", "-m",
                                f"models/{name}.gguf", *SERVER_FLAGS,
                                *extra]).replace(str(ROOT) + "/", ""),
            "request": {"n_predict": N_PREDICT, "temperature": 0, "n_probs": N_PROBS,
                        "post_sampling_probs": False, "cache_prompt": False},
            "recorded_by": "scripts/record-llama-references.py",
            "format": "cases[].steps[i]: the greedy token of step i and llama.cpp's top "
                      "log-probabilities [[id, logprob], ...] (log of the softmax of the raw "
                      "logits), best first",
        },
        "cases": cases,
    }
    dest = ROOT / "tests" / "data" / "llama-refs" / f"{name}.json"
    if adapter:
        out["meta"]["adapter"] = adapter
        out["meta"]["left_out"] = left_out
        dest = ROOT / "tests" / "data" / "llama-refs" / "lora" / f"{name}.{adapter['type']}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(compact_json(out))
    print(f"record-llama-references: wrote {dest.relative_to(ROOT)}", file=sys.stderr)


def main():
    wanted = [a for a in sys.argv[1:] if a != "--lora"]
    lora = "--lora" in sys.argv[1:]
    known = [n for n, _ in MODELS] if not lora else sorted({n for n, _ in LORA})
    unknown = [w for w in wanted if w not in known]
    if unknown:
        sys.exit(f"unknown model(s) {unknown}; known: {known}")
    binary = subprocess.run(["bash", str(ROOT / "bench" / "build-llama-server.sh")],
                            check=True, capture_output=True, text=True).stdout.strip()
    (ROOT / "target").mkdir(exist_ok=True)
    if lora:
        kvwarden = kvwarden_binary()
        fetches = dict(MODELS)
        for name, ty in LORA:
            if not wanted or name in wanted:
                record(name, fetches[name], binary, (ty, kvwarden))
        return
    for name, fetch in MODELS:
        if not wanted or name in wanted:
            record(name, fetch, binary)


if __name__ == "__main__":
    main()
