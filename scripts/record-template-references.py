#!/usr/bin/env python3
"""Records how llama.cpp's server renders each template of its own chat-template corpus.

For every `models/llama-vocabs/templates/*.jinja` (llama.cpp's corpus, from the PyPI sdist
llama-cpp-python==0.3.36; scripts/fetch-llama-vocabs.sh extracts it), this starts
`llama-server` (built by bench/build-llama-server.sh from the same sdist) on the default
model with `--jinja --chat-template-file TEMPLATE`, asks `POST /apply-template` for one
standard conversation, and writes what it answered (the prompt, or that it refused the
template) to tests/data/llama-templates.json, with the time of the recording: templates
that print today's date print that one. `crates/tokenizer/tests/template_corpus.rs` renders
the same conversation with kvwarden's renderer and compares. Plain python3, stdlib only.
"""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "tests" / "data" / "llama-templates.json"

# The conversation every template renders (the test's `conversation()` is the same).
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render(server, template):
    port = free_port()
    proc = subprocess.Popen(
        [server, "-m", str(MODEL), "--port", str(port), "-c", "512", "-np", "1", "-t", "1",
         "--no-warmup", "--jinja", "--chat-template-file", str(template)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                lines = [l for l in proc.stderr.read().splitlines() if l.strip()]
                return {"refused": lines[-1] if lines else f"exit {proc.returncode}"}
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.25)
        else:
            return {"refused": "did not become healthy"}
        req = urllib.request.Request(
            base + "/apply-template",
            data=json.dumps({"messages": MESSAGES}).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return {"prompt": json.loads(r.read())["prompt"]}
        except urllib.error.HTTPError as e:
            return {"refused": e.read().decode(errors="replace")[:300]}
    finally:
        proc.kill()
        proc.wait()


def main():
    server = subprocess.run([str(ROOT / "bench/build-llama-server.sh")], check=True,
                            capture_output=True, text=True).stdout.strip()
    subprocess.run([str(ROOT / "scripts/fetch-model.sh")], check=True)
    corpus = Path(subprocess.run([str(ROOT / "scripts/fetch-llama-vocabs.sh")], check=True,
                                 capture_output=True, text=True).stdout.strip()) / "templates"
    templates = sorted(corpus.glob("*.jinja"))
    if not templates:
        sys.exit(f"record-template-references: no templates in {corpus}")
    now = time.time()
    results = {}
    for t in templates:
        results[t.name] = render(server, t)
        kind = "prompt" if "prompt" in results[t.name] else "refused"
        print(f"{t.name}: {kind}", file=sys.stderr)
    OUT.write_text(json.dumps({
        "meta": {
            "llama_cpp": "llama-cpp-python==0.3.36 (vendored ggml-org/llama.cpp@0c1e57098), "
                         "llama-server --jinja --chat-template-file, POST /apply-template",
            "model": MODEL.name,
            "recorded_at_unix": int(now),
            "messages": MESSAGES,
            "command": "scripts/record-template-references.py",
        },
        "templates": results,
    }, indent=1, ensure_ascii=False) + "\n")
    print(f"record-template-references: wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
