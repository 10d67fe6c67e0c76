"""End-to-end fixtures: real `kvwarden serve` processes driven over HTTP.

Nothing is built here: the suite runs the binary at target/debug/kvwarden (or
$KVWARDEN_BIN) and fails loudly when it is missing.
"""

import json
import os
import re
import resource
import signal
import subprocess
import sys
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
# "serve" (default): every fixture is one `kvwarden serve`. "cluster": every fixture is a
# `kvwarden router` in front of one prefill and one decode node, started with the same
# flags, so the whole suite checks that the router answers exactly as `serve` does.
DEPLOYMENT = os.environ.get("KVWARDEN_DEPLOYMENT", "serve")


def require_binary():
    if not BIN.is_file():
        pytest.fail(
            f"kvwarden binary not found at {BIN}: build it with `cargo build -p kvwarden` "
            "(or point KVWARDEN_BIN at one)",
            pytrace=False,
        )
    if not MODEL.is_file():
        pytest.fail(f"model not found at {MODEL}: run scripts/fetch-model.sh", pytrace=False)


def synth_lora(out, seed):
    """A deterministic synthetic LoRA adapter for the default model (`kvwarden synth-lora`)."""
    require_binary()
    subprocess.run(
        [str(BIN), "synth-lora", "--base", str(MODEL), "--out", str(out), "--seed", str(seed)],
        check=True, capture_output=True, cwd=ROOT,
    )
    return out


class Server:
    """One `kvwarden serve` on a free port, its stderr in a log file."""

    # KV pools behind this URL (a cluster has one per node).
    pools = 1

    def __init__(
        self, args, log_path: Path, api_key="unused", nofile=None, binary=None, model=None,
        model_name=MODEL_NAME,
    ):
        require_binary()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [
            str(binary or BIN),
            "--threads",
            "2",
            "serve",
            "--model",
            str(model or MODEL),
            "--port",
            "0",
            "--served-model-name",
            model_name,
            *[str(a) for a in args],
        ]
        def limit_files():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT, preexec_fn=limit_files
        )
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
        h = {"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json"}
        h.update(headers or {})
        if body is not None:
            data = json.dumps(body)
        return requests.post(self.url + path, data=data, headers=h, timeout=120, **kw)

    def metrics(self) -> dict:
        """Prometheus samples as {'name{labels}': value}."""
        r = requests.get(
            self.url + "/metrics", headers={"Authorization": f"Bearer {self.api_key}"}, timeout=10
        )
        return parse_metrics(r.text)

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


_OWN_GREEDY = {}


def own_greedy(prompt_tokens, max_tokens: int, model: Path = MODEL) -> str:
    """kvwarden's greedy answer to token ids, from `kvwarden generate` in a process of its
    own: what every server and deployment must answer exactly (the arithmetic is the same
    in every process, CPU path, batch and split). The golden files hold llama.cpp's answers,
    which kvwarden's meet only over the prefix llama.cpp was sure of (its attention
    arithmetic is not kvwarden's; crates/model/tests/llama_references.rs)."""
    key = (tuple(prompt_tokens), max_tokens, str(model))
    if key not in _OWN_GREEDY:
        out = subprocess.run(
            [str(BIN), "--threads", "2", "generate", "--model", str(model), "--prompt-tokens",
             ",".join(map(str, prompt_tokens)), "--max-tokens", str(max_tokens),
             "--temperature", "0", "--json"],
            check=True, capture_output=True, text=True,
        ).stdout
        _OWN_GREEDY[key] = json.loads(out)["text"]
    return _OWN_GREEDY[key]


def wait_for_line(proc, log_path: Path, pattern: str, what: str) -> str:
    """The first group of `pattern` in a process's stderr log, once it appears."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        m = re.search(pattern, log_path.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"{what} did not start within {STARTUP_TIMEOUT}s:\n{log_path.read_text(errors='replace')}")


def parse_metrics(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


class Node:
    """One `kvwarden serve --role prefill|decode`: internal API address and metrics URL."""

    def __init__(self, role, args, certs: Path, name: str, log_path: Path, threads=1, port=0, model=None):
        require_binary()
        self.role = role
        self.log_path = log_path
        self.log = open(log_path, "wb")
        cmd = [
            str(BIN), "--threads", str(threads), "serve", "--role", role,
            "--model", str(model or MODEL), "--port", str(port), "--metrics-port", "0",
            "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / f"{name}.pem"),
            "--tls-key", str(certs / f"{name}.key"),
            *[str(a) for a in args],
        ]
        self.cmd = cmd
        self.starts = 0
        self._start(cmd, log_path)
        self.addr = wait_for_line(self.proc, log_path, r"internal API on ([0-9.]+:\d+)", f"{role} node")

    def _start(self, cmd, log_path: Path):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT)
        self.metrics_url = wait_for_line(self.proc, log_path, r"node metrics on (http://[0-9.]+:\d+)", f"{self.role} node")

    def restart(self):
        """Starts the node again, after it died, on the same internal address (the router
        knows nodes by address), with a log of its own."""
        assert self.proc.poll() is not None, "restart() needs a node that has exited"
        self.log.close()
        self.starts += 1
        cmd = list(self.cmd)
        cmd[cmd.index("--port") + 1] = self.addr.rsplit(":", 1)[1]
        self.log_path = self.log_path.with_name(f"{self.log_path.stem}.restart{self.starts}.log")
        self.log = open(self.log_path, "wb")
        self._start(cmd, self.log_path)
        wait_for_line(self.proc, self.log_path, r"internal API on ([0-9.]+:\d+)", f"{self.role} node")

    def metrics(self) -> dict:
        return parse_metrics(requests.get(self.metrics_url + "/metrics", timeout=10).text)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# Flags that belong to the router; every other flag configures the nodes.
ROUTER_FLAGS = {
    "--api-keys", "--max-body-bytes", "--max-context", "--max-connections", "--header-timeout",
    "--first-header-timeout",
    "--body-timeout", "--send-timeout", "--metrics-listen", "--tenant-max-requests",
    "--tenant-max-tokens", "--max-connections-per-address", "--chat-template", "--tool-format",
    "--reasoning-format",
}
ROUTER_AND_NODE_FLAGS = {"--max-context"}


def make_certs(dir: Path, names) -> Path:
    require_binary()
    subprocess.run(
        [str(BIN), "certs", "--out", str(dir), *[a for n in names for a in ("--name", n)]],
        check=True, capture_output=True, cwd=ROOT,
    )
    return dir


class Cluster(Server):
    """`kvwarden router` over prefill and decode nodes, with `Server`'s interface. Its
    metrics() adds up the nodes' samples under the router's, so page accounting and engine
    counters read as one server's."""

    def __init__(
        self, args, dir: Path, api_key="unused", prefill=1, decode=1, router_args=(),
        prefill_args=(), decode_args=(), nofile=None, model=None,
    ):
        require_binary()
        names = ["router"] + [f"prefill{i}" for i in range(prefill)] + [f"decode{i}" for i in range(decode)]
        self.certs = make_certs(dir / "certs", names)
        router, node = [], []
        it = iter([str(a) for a in args])
        for a in it:
            if a in ROUTER_FLAGS:
                value = next(it)
                router += [a, value]
                if a in ROUTER_AND_NODE_FLAGS:
                    node += [a, value]
            else:
                node.append(a)
        self.nodes = [
            Node("prefill", node + list(prefill_args), self.certs, f"prefill{i}", dir / f"prefill{i}.log",
                 model=model)
            for i in range(prefill)
        ]
        self.nodes += [
            Node("decode", node + list(decode_args), self.certs, f"decode{i}", dir / f"decode{i}.log",
                 model=model)
            for i in range(decode)
        ]
        self.log_path = dir / "router.log"
        self.log = open(self.log_path, "wb")
        cmd = [
            str(BIN), "router", "--model", str(model or MODEL), "--port", "0", "--served-model-name", MODEL_NAME,
            "--tls-ca", str(self.certs / "ca.pem"), "--tls-cert", str(self.certs / "router.pem"),
            "--tls-key", str(self.certs / "router.key"),
            *[a for n in self.nodes for a in (f"--{n.role}", n.addr)],
            *router, *[str(a) for a in router_args],
        ]
        def limit_files():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.cmd, self.limit_files, self.starts = cmd, limit_files, 0
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT, preexec_fn=limit_files
        )
        self.url = wait_for_line(self.proc, self.log_path, r"listening on (http://[0-9.]+:\d+)", "kvwarden router")
        self._wait_healthy()
        self.api_key = api_key
        self.client = self.client_for(api_key)

    def restart_router(self):
        """Starts the router again, after it died, on the same address, with a log of its
        own; the nodes are the same processes."""
        assert self.proc.poll() is not None, "restart_router() needs a router that has exited"
        self.log.close()
        self.starts += 1
        cmd = list(self.cmd)
        cmd[cmd.index("--port") + 1] = self.url.rsplit(":", 1)[1]
        self.log_path = self.log_path.with_name(f"router.restart{self.starts}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=self.log, cwd=ROOT, preexec_fn=self.limit_files
        )
        url = wait_for_line(self.proc, self.log_path, r"listening on (http://[0-9.]+:\d+)", "kvwarden router")
        assert url == self.url, (url, self.url)
        self._wait_healthy()

    @property
    def pools(self):
        return len(self.nodes)

    def prefill_nodes(self):
        return [n for n in self.nodes if n.role == "prefill"]

    def decode_nodes(self):
        return [n for n in self.nodes if n.role == "decode"]

    def metrics(self) -> dict:
        out = super().metrics()
        nodes = {}
        for n in self.nodes:
            if n.proc.poll() is not None:
                continue
            for k, v in n.metrics().items():
                nodes[k] = nodes.get(k, 0) + v
        for k, v in nodes.items():
            if k.startswith("kvwarden_requests_total") and k in out:
                continue  # the router counts what its clients saw
            out[k] = v  # fresh from the nodes (the router's page gauges are a poll old)
        return out

    def stop(self) -> int:
        rc = super().stop()
        for n in self.nodes:
            # A node that died before the test ended: its log's tail, which pytest shows
            # with a failing test's output (a test's own SIGKILL shows as -9).
            if n.proc.poll() is not None:
                n.log.flush()
                tail = n.log_path.read_text(errors="replace").splitlines()[-30:]
                print(f"{n.role} node {n.addr} exited early ({n.proc.returncode}):", *tail, sep="\n",
                      file=sys.stderr)
            n.stop()
        return rc


@pytest.fixture(scope="session")
def make_server(tmp_path_factory):
    started = []

    def make(*args, api_key="unused", name="server", nofile=None, binary=None, model=None):
        if DEPLOYMENT == "cluster" and binary is None:
            s = Cluster(args, tmp_path_factory.mktemp(name), api_key=api_key, nofile=nofile, model=model)
        else:
            log = tmp_path_factory.mktemp(name) / "stderr.log"
            s = Server(args, log, api_key=api_key, nofile=nofile, binary=binary, model=model)
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
