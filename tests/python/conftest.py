"""End-to-end fixtures: real `kvwarden serve` processes driven over HTTP.

Nothing is built here: the suite runs the binary at target/debug/kvwarden (or
$KVWARDEN_BIN) and fails loudly when it is missing.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("KVWARDEN_BIN", ROOT / "target" / "debug" / "kvwarden"))
# Built by scripts/test.sh with --features fault-injection into its own target dir.
FAULT_BIN = Path(
    os.environ.get("KVWARDEN_FAULT_BIN", ROOT / "target" / "fault" / "debug" / "kvwarden")
)
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m"
SYSTEM = "You are a helpful assistant."
STARTUP_TIMEOUT = 90


def require_binary():
    if not BIN.is_file():
        pytest.fail(
            f"kvwarden binary not found at {BIN}: build it with `cargo build -p kvwarden` "
            "(or point KVWARDEN_BIN at one)",
            pytrace=False,
        )
    if not MODEL.is_file():
        pytest.fail(f"model not found at {MODEL}: run scripts/fetch-model.sh", pytrace=False)


class Server:
    """One `kvwarden serve` on a free port, its stderr in a log file."""

    def __init__(self, args, log_path: Path, api_key="unused", binary=None):
        require_binary()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [
            str(binary or BIN),
            "--threads",
            "2",
            "serve",
            "--model",
            str(MODEL),
            "--port",
            "0",
            "--served-model-name",
            MODEL_NAME,
            *[str(a) for a in args],
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)
        self.url = self._wait_for_address()
        self._wait_healthy()
        self.api_key = api_key
        self.client = self.client_for(api_key)

    def client_for(self, api_key):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stderr(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def _wait_for_address(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            m = re.search(r"listening on (http://[0-9.]+:\d+)", self.stderr())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                pytest.fail(f"kvwarden serve exited with {self.proc.returncode}:\n{self.stderr()}")
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"kvwarden serve did not start within {STARTUP_TIMEOUT}s:\n{self.stderr()}")

    def _wait_healthy(self):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        pytest.fail(f"/health never answered 200:\n{self.stderr()}")

    def post(self, path, body=None, *, data=None, headers=None, **kw):
        h = {"Authorization": f"Bearer {self.api_key}"}
        h.update(headers or {})
        if body is not None:
            data = json.dumps(body)
            h.setdefault("Content-Type", "application/json")
        return requests.post(self.url + path, data=data, headers=h, timeout=120, **kw)

    def metrics(self) -> dict:
        """Prometheus samples as {'name{labels}': value}."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def make_server(tmp_path_factory):
    started = []

    def make(*args, api_key="unused", name="server", binary=None):
        log = tmp_path_factory.mktemp(name) / "stderr.log"
        s = Server(args, log, api_key=api_key, binary=binary)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(make_server):
    """The default model with a modest pool (max context = pool = 4096 tokens)."""
    return make_server("--kv-pool-tokens", "4096", name="default")


@pytest.fixture(scope="session")
def small_server(make_server):
    """A 64-token context and a 64 KiB body limit, for limit tests."""
    return make_server(
        "--max-context", "64", "--kv-pool-tokens", "256", "--max-body-bytes", "65536", name="small"
    )


@pytest.fixture(scope="session")
def poison_server(make_server):
    """Freed KV pages are filled with NaN: any stale read would poison the output."""
    return make_server("--kv-pool-tokens", "4096", "--kv-scrub", "poison", name="poison")


TENANT_KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-9876543210"}


@pytest.fixture(scope="session")
def tenant_server(make_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys.txt"
    keys.write_text(
        "# test tenants\n\n" + "".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items())
    )
    return make_server(
        "--kv-pool-tokens", "2048", "--api-keys", keys, api_key=TENANT_KEYS["alice"], name="tenants"
    )


_token_cache = {}


def tokenize(text: str) -> list:
    """Token ids as the server's tokenizer gives them (control tokens parsed)."""
    if text not in _token_cache:
        require_binary()
        out = subprocess.run(
            [str(BIN), "tokenize", "--model", str(MODEL), "--text", text],
            check=True,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        _token_cache[text] = json.loads(out.stdout)["tokens"]
    return _token_cache[text]


def chatml(messages) -> str:
    """The default model's chat template, rendered by hand, with the generation prompt."""
    out = ""
    if messages[0]["role"] != "system":
        out += "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    for m in messages:
        out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"
