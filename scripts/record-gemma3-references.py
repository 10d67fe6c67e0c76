#!/usr/bin/env python3
"""Records llama.cpp's answers on Gemma 3 270M into tests/data/gemma3/references.json.

Builds llama-server with bench/build-llama-server.sh, fetches the model with
scripts/fetch-gemma3.sh, starts llama-server on it (one thread, one slot, the chat template
templates/gemma3.jinja, since the file has none) and asks it for: token ids of a few texts,
the greedy continuations of token-id prompts with the top 10 log-probabilities of each step
(`n_probs`, before sampling), the rendered chat prompt, and the greedy chat answer that the
end-to-end test expects. Only the Python standard library is used.
"""
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/data/gemma3/references.json"
MODEL = ROOT / "models/gemma-3-270m-q4_k_m.gguf"
TEMPLATE = ROOT / "templates/gemma3.jinja"

TEXTS = [
    "Hello world",
    " Hello  world\n\nfoo",
    "The capital of France is",
    "naïve café 東京 🚀",
    "<start_of_turn>user\nhi<end_of_turn>",
    "1234567 + 89 = ?",
    "\t tabs\tand   spaces  ",
    "don't you're I'll",
]
COMPLETIONS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "Question: What is the capital of France?\nAnswer:",
    # Longer than the 512-position sliding window: local layers must leave the oldest out.
    ", ".join(str(i) for i in range(1, 161)) + ",",
]
STEPS = 16
# The base model answers a bare question by repeating it; given one example turn it answers.
CHAT = [
    {"role": "user", "content": "What is the capital of Germany?"},
    {"role": "assistant", "content": "The capital of Germany is Berlin."},
    {"role": "user", "content": "What is the capital of France?"},
]
CHAT_TOKENS = 8


def post(base, path, body):
    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    server = subprocess.run(
        [str(ROOT / "bench/build-llama-server.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()
    subprocess.run([str(ROOT / "scripts/fetch-gemma3.sh")], check=True)
    port = free_port()
    # The arithmetic kvwarden reproduces, as scripts/record-llama-references.py explains:
    # micro-batches of 32 (one-row flash attention), no repacking, no tiled K-quant matmul.
    proc = subprocess.Popen(
        [server, "--model", str(MODEL), "--port", str(port), "-t", "1", "-np", "1",
         "-c", "4096", "-ub", "32", "-fa", "on", "--no-repack", "--no-warmup", "--jinja",
         "--chat-template-file", str(TEMPLATE)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, GGML_CPU_TILED_MM="0"),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            sys.exit("llama-server did not become healthy")
        tok = lambda t: post(base, "/tokenize", {
            "content": t, "add_special": False, "parse_special": True})["tokens"]
        out = {"llama_server": pathlib.Path(server).name, "model_sha256":
               "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
               "tokenize": [{"text": t, "ids": tok(t)} for t in TEXTS], "completions": []}
        for text in COMPLETIONS:
            prompt = [2] + tok(text)  # BOS, as the file asks (add_bos_token)
            r = post(base, "/completion", {
                "prompt": prompt, "n_predict": STEPS, "temperature": 0, "n_probs": 10,
                "post_sampling_probs": False, "cache_prompt": False})
            steps = r["completion_probabilities"]
            top = [[[x["id"], x["logprob"]] for x in s["top_logprobs"]] for s in steps]
            margins = [t[0][1] - t[1][1] for t in top]
            decisive = next((i for i, m in enumerate(margins) if m < 0.05), len(margins))
            out["completions"].append({
                "text": text, "prompt": prompt, "tokens": [s["id"] for s in steps],
                "content": r["content"],
                "top_logprobs": top, "decisive_prefix": decisive})
        out["chat"] = {
            "messages": CHAT,
            "prompt": post(base, "/apply-template", {"messages": CHAT})["prompt"],
            "answer": post(base, "/v1/chat/completions", {
                "messages": CHAT, "temperature": 0, "max_tokens": CHAT_TOKENS,
            })["choices"][0]["message"]["content"],
        }
    finally:
        proc.terminate()
        proc.wait()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
