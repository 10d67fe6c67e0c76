"""The HTTP edge against hostile clients: a cap on connections that is answered, not hung;
timeouts for headers, bodies and idle connections; errors of the HTTP layer itself in
OpenAI's shape; /metrics kept from those who should not read every tenant's totals."""

import json
import re
import socket
import threading
import time

import pytest
import requests

from conftest import MODEL_NAME, TENANT_KEYS

CAP = 16
HOSTILE = 3 * CAP


def address(server):
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_all(sock, timeout):
    """Everything the server sends until it closes; None if it is still open at `timeout`."""
    sock.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except socket.timeout:
        return None
    except OSError:
        return data


def exchange(server, raw, timeout=30):
    with socket.create_connection(address(server), timeout=timeout) as s:
        s.sendall(raw)
        return read_all(s, timeout)


def parse(reply):
    head, _, body = reply.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, head.decode("latin-1").lower(), body


def openai_error(reply, status, code):
    got, head, body = parse(reply)
    assert got == status, reply[:300]
    assert "content-type: application/json" in head, head
    err = json.loads(body)["error"]
    assert err["code"] == code, err
    assert err["message"] and err["type"], err
    return head


def test_more_hostile_connections_than_the_cap_cannot_starve_a_client(make_server):
    # A low descriptor limit, as in the attack: without a cap under it, 80 idle sockets
    # made accept fail with "Too many open files" and /health time out.
    s = make_server(
        "--kv-pool-tokens", "1024", "--max-connections", CAP, "--header-timeout", "2",
        "--body-timeout", "2", "--send-timeout", "2", nofile=64, name="edge",
    )
    kinds = [
        b"",  # connects, sends nothing
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers never end
        # A Content-Length larger than the body that follows.
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n{\"model\"",
        # A body trickled a byte at a time (see below).
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n",
        # One request, then an idle keep-alive connection.
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    socks = []
    for i in range(HOSTILE):
        sock = socket.create_connection(address(s), timeout=10)
        sock.sendall(kinds[i % len(kinds)])
        socks.append((i % len(kinds), sock))
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            for kind, sock in socks:
                if kind in (1, 3):
                    try:
                        sock.sendall(b" " if kind == 3 else b"X")
                    except OSError:
                        pass
            stop.wait(0.5)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        # A normal client gets its answers: at once when a place is free, else after a
        # 503 with Retry-After, once the timeouts have closed the hostile connections.
        deadline = time.monotonic() + 60
        answer = None
        while time.monotonic() < deadline:
            try:
                r = s.post(
                    "/v1/completions",
                    {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 3,
                     "temperature": 0},
                )
            except requests.ConnectionError:
                time.sleep(0.2)
                continue
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "too_many_connections"
                time.sleep(0.2)
                continue
            answer = r
            break
        assert answer is not None and answer.status_code == 200, answer and answer.text
        assert answer.json()["choices"][0]["text"]
        assert requests.get(s.url + "/health", timeout=10).status_code == 200

        # Every hostile connection was answered or closed by the server: none hangs on.
        refused = timed_out = 0
        for kind, sock in socks:
            reply = read_all(sock, 30)
            assert reply is not None, f"connection of kind {kind} is still open"
            if reply.startswith(b"HTTP/1.1 503"):
                openai_error(reply, 503, "too_many_connections")
                refused += 1
            elif reply.startswith(b"HTTP/1.1 408"):
                openai_error(reply, 408, "request_timeout")
                timed_out += 1
        assert refused >= HOSTILE - CAP, (refused, timed_out)
        assert "Too many open files" not in s.stderr()
    finally:
        stop.set()
        for _, sock in socks:
            sock.close()


def test_a_connection_that_sends_no_request_gives_its_place_back_soon(make_server):
    """A new connection has --first-header-timeout for its first request's headers, a
    keep-alive one --header-timeout to idle between requests."""
    s = make_server("--kv-pool-tokens", "1024", "--first-header-timeout", "1",
                    "--header-timeout", "6", name="first-headers")
    t = time.monotonic()
    silent = socket.create_connection(address(s), timeout=10)
    partial = socket.create_connection(address(s), timeout=10)
    partial.sendall(b"GET /health HTTP/1.1\r\nHo")
    kept = socket.create_connection(address(s), timeout=10)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        head += kept.recv(65536)
    assert head.startswith(b"HTTP/1.1 200"), head
    try:
        for sock in (silent, partial):
            assert read_all(sock, 5) is not None, "a connection with no request stayed open"
        closed = time.monotonic() - t
        assert closed < 3.0, closed
        # Past the first request's deadline, the keep-alive connection idles on.
        kept.settimeout(max(0.1, 2.5 - (time.monotonic() - t)))
        with pytest.raises(socket.timeout):
            kept.recv(65536)
        assert read_all(kept, 10) is not None, "the keep-alive connection outlived --header-timeout"
        idled = time.monotonic() - t
        assert 5.0 < idled < 9.0, idled
        print(f"no request: closed after {closed:.2f} s; keep-alive idle: closed after {idled:.2f} s")
    finally:
        for sock in (silent, partial, kept):
            sock.close()


def test_a_short_body_times_out_with_408(make_server):
    s = make_server("--kv-pool-tokens", "1024", "--body-timeout", "1", name="body-timeout")
    reply = exchange(
        s,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{\"model\":",
    )
    assert reply is not None
    openai_error(reply, 408, "request_timeout")


@pytest.mark.parametrize(
    "raw,status,code",
    [
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
            431,
            "request_header_fields_too_large",
        ),
        (b"GET /" + b"a" * 66_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
            400,
            "invalid_http_request",
        ),
        (b"GARBAGE\x01\r\n\r\n", 400, "invalid_http_request"),
    ],
)
def test_errors_of_the_http_layer_have_openai_bodies(server, raw, status, code):
    reply = exchange(server, raw)
    assert reply is not None
    openai_error(reply, status, code)


def test_metrics_need_an_api_key_when_keys_are_configured(tenant_server):
    r = requests.get(tenant_server.url + "/metrics", timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = requests.get(
        tenant_server.url + "/metrics",
        headers={"Authorization": f"Bearer {TENANT_KEYS['bob']}"},
        timeout=10,
    )
    assert r.status_code == 200
    assert "kvwarden_requests_total" in r.text


def test_metrics_on_a_listener_of_their_own(make_server):
    s = make_server("--kv-pool-tokens", "1024", "--metrics-listen", "127.0.0.1:0", name="metrics")
    m = re.search(r"metrics on (http://[0-9.]+:\d+)/metrics", s.stderr())
    assert m, s.stderr()
    r = requests.get(m.group(1) + "/metrics", timeout=10)
    assert r.status_code == 200 and "kvwarden_kv_pages" in r.text
    # Not on the API address, and nothing but /metrics on the metrics one.
    assert requests.get(s.url + "/metrics", timeout=10).status_code == 404
    assert requests.get(m.group(1) + "/v1/models", timeout=10).status_code == 404


def test_a_client_that_stops_reading_holds_pages_no_longer_than_its_generation(make_server):
    """A client that never reads its stream (a tiny receive buffer, nothing read): the
    response is absorbed by socket buffers, so the send timeout never fires, and the
    request costs what any request of its length costs. Its pages are leased while it
    generates and released when its generation ends, though the client never read a byte;
    other clients are served meanwhile."""
    s = make_server("--kv-pool-tokens", "4096", "--send-timeout", "2", name="slow-reader")
    leased = lambda: s.metrics().get('kvwarden_kv_pages{state="leased"}', 0)
    body = json.dumps({
        "model": MODEL_NAME, "prompt": "Tell me a long story about", "max_tokens": 300,
        "stream": True, "ignore_eos": True,
    })
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    reader.connect(address(s))
    reader.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    try:
        deadline = time.time() + 30
        while leased() == 0:
            assert time.time() < deadline, "the unread request never leased a page"
            time.sleep(0.05)
        # Another client is answered while the unread one generates.
        r = s.post("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4,
                                       "temperature": 0})
        assert r.status_code == 200, r.text
        deadline = time.time() + 120
        while leased() != 0:
            assert time.time() < deadline, f"pages still leased: {leased()}"
            time.sleep(0.2)
    finally:
        reader.close()
