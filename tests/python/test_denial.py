"""No client or tenant can deny service to the others (issue 26): stop strings bounded and
matched incrementally, header hygiene, and running slots shared between tenants with no
limit configured. Each runs against `serve` and, with KVWARDEN_DEPLOYMENT=cluster, against
the router in front of a prefill and a decode node. The timing bounds are generous (a
loaded 2-core machine must pass them); the figures print for the closing note."""

import json
import socket
import threading
import time
from urllib.parse import urlparse

import requests

from conftest import MODEL_NAME, TENANT_KEYS

ALICE, BOB = TENANT_KEYS["alice"], TENANT_KEYS["bob"]
MAX_STOP_BYTES = 1024


def health_times(url, stop_event, out):
    """Seconds each /health probe took (a probe that failed counts as 99 s)."""
    while not stop_event.is_set():
        t = time.monotonic()
        try:
            ok = requests.get(url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            ok = False
        out.append(time.monotonic() - t if ok else 99.0)
        stop_event.wait(0.1)


def test_a_stop_string_over_the_limit_is_400(server):
    for stop in ["a" * (MAX_STOP_BYTES + 1), ["x", "é" * (MAX_STOP_BYTES // 2 + 1)]]:
        r = server.post(
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1, "stop": stop},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "stop" and err["code"] == "invalid_value", err
        assert str(MAX_STOP_BYTES) in err["message"]


def test_maximal_stop_sets_leave_health_fast(server):
    """16 concurrent streams, each with four stop strings of the longest legal size that
    the text keeps almost matching (runs of spaces and of the commonest letters)."""
    stops = [" " * (MAX_STOP_BYTES - 1) + "\x01", "e" * MAX_STOP_BYTES,
             "the " * (MAX_STOP_BYTES // 4), "\n" * (MAX_STOP_BYTES - 1) + "\x02"]
    results = []

    def one(i):
        r = server.post(
            "/v1/completions",
            {"model": MODEL_NAME, "prompt": f"Story {i}: once upon a time", "max_tokens": 48,
             "temperature": 0, "stop": stops, "stream": True},
            stream=True,
        )
        body = r.content.decode()
        results.append((r.status_code, body))

    stop_event = threading.Event()
    probes = []
    prober = threading.Thread(target=health_times, args=(server.url, stop_event, probes))
    prober.start()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    stop_event.set()
    prober.join()
    assert len(results) == 16 and all(s == 200 and "[DONE]" in b for s, b in results), results[:2]
    print(f"/health under 16 maximal stop sets: {len(probes)} probes, worst {max(probes):.3f} s")
    assert probes and max(probes) < 1.0, probes


def raw_request(url, head: bytes, body: bytes = b"") -> bytes:
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_two_authorization_headers_are_400(tenant_server):
    body = b'{"model":"%s","prompt":"Hi","max_tokens":1}' % MODEL_NAME.encode()
    for first, second in [(BOB, ALICE), ("wrong", ALICE), (ALICE, ALICE)]:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n"
            % (first.encode(), second.encode(), len(body))
        )
        resp = raw_request(tenant_server.url, head, body)
        assert status_of(resp) == 400, resp[:300]
        assert b"duplicate_header" in resp or b"Authorization" in resp


def test_transfer_codings_other_than_chunked_are_501(server):
    payload = b'{"model":"%s","prompt":"Hi","max_tokens":1}' % MODEL_NAME.encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    for coding in [b"gzip, chunked", b"identity, chunked"]:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer unused\r\nTransfer-Encoding: %s\r\nConnection: close\r\n\r\n"
            % coding
        )
        resp = raw_request(server.url, head, chunked)
        assert status_of(resp) == 501, resp[:300]
        assert b"unsupported_transfer_encoding" in resp
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer unused\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    assert status_of(raw_request(server.url, head, chunked)) == 200


def first_token_seconds(server, key, prompt):
    t = time.monotonic()
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
              "stream": True},
        headers={"Authorization": f"Bearer {key}"}, stream=True, timeout=120,
    )
    assert r.status_code == 200, r.text
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            elapsed = time.monotonic() - t
            r.close()
            return elapsed
    raise AssertionError("no token")


def test_a_tenants_flood_does_not_queue_another_by_default(make_server, tmp_path_factory):
    """No tenant limit configured: Alice keeps 48 long requests in flight (more than the 32
    running slots), Bob's time to first token stays near its unloaded value. Under a single
    first-come queue Bob waited for 16 of Alice's requests to finish (issue 26: 297x)."""
    keys = tmp_path_factory.mktemp("denial-keys") / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    s = make_server("--kv-pool-tokens", "12288", "--api-keys", keys, api_key=ALICE, name="denial")
    unloaded = min(first_token_seconds(s, BOB, f"Bob asks question {i}.") for i in range(3))

    stop_event = threading.Event()
    started = threading.Semaphore(0)
    failures = []

    def alice(i):
        try:
            r = requests.post(
                s.url + "/v1/completions",
                json={"model": MODEL_NAME, "prompt": f"Alice's essay number {i} begins:",
                      "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True},
                headers={"Authorization": f"Bearer {ALICE}"}, stream=True, timeout=300,
            )
            if r.status_code != 200:
                failures.append(r.text)
                return
            released = False
            for _ in r.iter_lines():
                if not released:
                    started.release()
                    released = True
                if stop_event.is_set():
                    break
            r.close()
        except requests.RequestException as e:
            failures.append(repr(e))

    flood = [threading.Thread(target=alice, args=(i,)) for i in range(48)]
    for t in flood:
        t.start()
    try:
        # At least the 32 running slots are streaming: the rest wait behind them.
        for _ in range(32):
            assert started.acquire(timeout=120), failures
        loaded = [first_token_seconds(s, BOB, f"Bob asks question {i} again.") for i in range(3)]
    finally:
        stop_event.set()
        for t in flood:
            t.join(timeout=120)
    assert not failures, failures[:3]
    worst = max(loaded)
    print(f"Bob's TTFT: unloaded {unloaded:.3f} s, under Alice's 48 in flight "
          f"{[round(x, 3) for x in loaded]} s ({worst / unloaded:.1f}x)")
    # Generous for a loaded CI machine (three processes share 2 cores in the cluster form):
    # the first-come queue this replaces cost Bob 10+ s here.
    assert worst < max(15 * unloaded, 4.0), (unloaded, loaded)


def test_a_flood_cannot_take_every_place_in_the_queue(make_server, tmp_path_factory):
    """No tenant limit configured, 32 places in the engine (4 running + 28 waiting): Alice's
    40 concurrent streams get at most the 30 places outside the kept sixteenth and 429
    `queue_full` beyond; Bob, holding none, still gets a place and his answer (with a
    first-come queue he got 429 until Alice's drained)."""
    keys = tmp_path_factory.mktemp("places-keys") / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    s = make_server("--kv-pool-tokens", "12288", "--max-running", "4", "--max-waiting", "28",
                    "--api-keys", keys, api_key=ALICE, name="places")
    responses, lock = [], threading.Lock()

    def alice(i):
        r = requests.post(
            s.url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": f"Alice's essay number {i} begins:",
                  "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True},
            headers={"Authorization": f"Bearer {ALICE}"}, stream=True, timeout=120,
        )
        with lock:
            responses.append(r)

    flood = [threading.Thread(target=alice, args=(i,)) for i in range(40)]
    for t in flood:
        t.start()
    for t in flood:
        t.join(timeout=120)
    try:
        assert len(responses) == 40
        ok = [r for r in responses if r.status_code == 200]
        refused = [r for r in responses if r.status_code != 200]
        for r in refused:
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "queue_full", err
            assert r.headers["Retry-After"] == "1"
        assert len(ok) <= 30 and len(refused) >= 10, (len(ok), len(refused))
        bob = requests.post(
            s.url + "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "Bob asks a question.", "max_tokens": 2,
                  "temperature": 0},
            headers={"Authorization": f"Bearer {BOB}"}, timeout=120,
        )
        assert bob.status_code == 200, bob.text
        print(f"Alice: {len(ok)} streams admitted, {len(refused)} refused; Bob answered")
    finally:
        for r in responses:
            r.close()


def timed_completion(server, key, prompt, max_tokens=1):
    t = time.monotonic()
    r = requests.post(
        server.url + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        headers={"Authorization": f"Bearer {key}"}, timeout=120,
    )
    return r, time.monotonic() - t


def test_a_text_that_cannot_fit_is_refused_before_it_is_tokenized(server):
    """4 MB of spaces is at least 4,000,000 / (the vocabulary's longest token) tokens, past
    the context whatever BPE makes of it: refused without tokenizing (tokenizing it took
    about 3.5 CPU s)."""
    r, took = timed_completion(server, "unused", " " * 4_000_000)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert "4000000 bytes" in err["message"], err
    chat = server.post(
        "/v1/chat/completions",
        {"model": MODEL_NAME, "max_tokens": 1,
         "messages": [{"role": "user", "content": " " * 4_000_000}]},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
    print(f"4 MB text refused in {took:.3f} s")
    assert took < 2.0


def test_a_tokenizer_flood_does_not_delay_another_tenant(make_server, tmp_path_factory):
    """Alice, three threads sending the longest texts the byte bound lets through (each
    ends 400 after tokenization: too many tokens), with --tenant-max-requests 8. Bob's
    one-token request keeps close to its unloaded time: Alice's texts take at most one of
    the prompt workers, and her places are taken before her tokenization."""
    keys = tmp_path_factory.mktemp("flood-keys") / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    s = make_server(
        "--kv-pool-tokens", "2048", "--api-keys", keys, "--tenant-max-requests", "8",
        api_key=ALICE, name="flood",
    )
    unloaded = min(timed_completion(s, BOB, f"Bob's question {i}.")[1] for i in range(5))
    # Just under 2048 tokens of at most 81 bytes (SmolLM2's longest token).
    text = "  " * (2048 * 81 // 2 - 100)
    stop_event = threading.Event()
    statuses = []

    def alice():
        while not stop_event.is_set():
            r, _ = timed_completion(s, ALICE, text)
            statuses.append(r.status_code)

    flood = [threading.Thread(target=alice) for _ in range(3)]
    for t in flood:
        t.start()
    try:
        time.sleep(1.0)
        loaded = []
        for i in range(5):
            r, took = timed_completion(s, BOB, f"Bob's question {i} again.")
            assert r.status_code == 200, r.text
            loaded.append(took)
    finally:
        stop_event.set()
        for t in flood:
            t.join(timeout=60)
    assert statuses and set(statuses) <= {400, 429}, set(statuses)
    assert 400 in statuses
    worst = max(loaded)
    print(f"Bob under Alice's tokenizer flood: unloaded {unloaded:.3f} s, loaded "
          f"{[round(x, 3) for x in loaded]} s ({worst / unloaded:.1f}x); Alice sent {len(statuses)}")
    assert worst < max(4 * unloaded, 0.75), (unloaded, loaded)


def connect_from(url, source_ip, timeout=10):
    u = urlparse(url)
    return socket.create_connection((u.hostname, u.port), timeout=timeout,
                                    source_address=(source_ip, 0))


def test_hostile_sockets_from_one_address_leave_another_served(make_server):
    """256 sockets from 127.0.0.1 that send partial headers and hold them: that address gets
    its share of the 256 places (half) and 503s beyond; 127.0.0.2 (another loopback address)
    is answered, /health and a completion, within a second each."""
    s = make_server("--kv-pool-tokens", "1024", "--max-connections", "256", nofile=4096,
                    name="slots")
    hostile = []
    try:
        for _ in range(256):
            sock = connect_from(s.url, "127.0.0.1")
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            hostile.append(sock)
        def timed_get(path):
            with connect_from(s.url, "127.0.0.2") as c:
                t = time.monotonic()
                c.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
                reply = c.recv(65536)
                return reply, time.monotonic() - t

        reply, took = timed_get("/health")
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
        body = b'{"model":"%s","prompt":"The capital of France is","max_tokens":3}' % (
            MODEL_NAME.encode())
        with connect_from(s.url, "127.0.0.2") as c:
            t = time.monotonic()
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer unused\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                      % len(body) + body)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = c.recv(65536)
                if not chunk:
                    break
                answer += chunk
            completion_took = time.monotonic() - t
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        # The flooded address itself is refused with the per-address answer.
        with connect_from(s.url, "127.0.0.1") as c:
            c.settimeout(5)
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            own = c.recv(65536)
        assert own.startswith(b"HTTP/1.1 503") and b"too_many_connections" in own, own[:300]
        assert b"Your address" in own
        # What the server made of them: those past the share were answered 503 at once
        # (read now, before the header timeout closes the others).
        refused = 0
        for sock in hostile:
            sock.settimeout(0.01)
            try:
                if sock.recv(64).startswith(b"HTTP/1.1 503"):
                    refused += 1
            except socket.timeout:
                pass
        assert refused >= 128, refused
        print(f"127.0.0.2 beside 256 hostile sockets: /health {took:.3f} s, "
              f"completion {completion_took:.3f} s; {refused} of 256 refused")
        assert took < 1.0 and completion_took < 1.0, (took, completion_took)
    finally:
        for sock in hostile:
            sock.close()


def test_a_slow_reader_is_ended_within_the_send_timeout(make_server):
    """A client with a 4 KB receive buffer that reads an eighth as fast as its stream comes
    (the stream's pace measured first, on the same server, so a loaded machine slows both):
    it always makes some progress, yet its connection is reset within the send timeout plus
    the time the socket buffers take to fill, and its pages are back, while its generation
    had far from finished."""
    send_timeout = 3
    s = make_server("--kv-pool-tokens", "4096", "--send-timeout", str(send_timeout),
                    name="slow-stream")
    leased = lambda: s.metrics().get('kvwarden_kv_pages{state="leased"}', 0)
    body = json.dumps({
        "model": MODEL_NAME, "prompt": "Tell me a very long story about", "max_tokens": 3000,
        "stream": True, "ignore_eos": True,
    })

    # The pace of this stream when its client keeps up: bytes per second after the first.
    paced = dict(json.loads(body), max_tokens=160)
    t0 = time.monotonic()
    r = s.post("/v1/completions", paced, stream=True)
    first, fast_bytes = None, 0
    for chunk in r.iter_content(chunk_size=None):
        first = first or time.monotonic()
        fast_bytes += len(chunk)
    fast_rate = fast_bytes / (time.monotonic() - first)
    first_byte = first - t0
    read_rate = fast_rate / 8
    pause = 1024 / read_rate

    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    u = urlparse(s.url)
    reader.connect((u.hostname, u.port))
    reader.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    started = time.monotonic()
    received = 0
    ended = None
    try:
        reader.settimeout(1)
        while time.monotonic() - started < 120:
            try:
                chunk = reader.recv(1024)
            except socket.timeout:
                continue
            except ConnectionResetError:
                ended = time.monotonic() - started
                break
            if not chunk:
                ended = time.monotonic() - started
                break
            received += len(chunk)
            time.sleep(pause)
        assert ended is not None, f"still open after 120 s ({received} bytes read)"
        deadline = time.monotonic() + 10
        while leased() != 0:
            assert time.monotonic() < deadline, f"pages still leased: {leased()}"
            time.sleep(0.1)
        # What sits between the generation and the reader before the server sees a backlog:
        # the reader's receive buffer (the kernel doubles 4 KB), 4 KB unsent in the server's
        # socket (TCP_NOTSENT_LOWAT), and the 16 KiB in hyper's buffer (or 8 events) that
        # count as behind; 64 KiB is twice that. They fill at the difference of the two
        # paces. (Before the server counted hyper's buffer, a reader at this pace was never
        # reset: hyper took the whole 117 KB stream into its 400 KiB buffer.)
        fill = 64 * 1024 / (fast_rate - read_rate)
        bound = 2 * first_byte + fill + send_timeout + 4
        whole = 3000 / 160 * fast_bytes / fast_rate
        print(f"slow reader ended after {ended:.1f} s (bound {bound:.1f} s; the whole stream "
              f"takes {whole:.0f} s), having read {received} bytes at {read_rate:.0f} B/s "
              f"against a stream of {fast_rate:.0f} B/s")
        assert ended < bound, (ended, bound)
        assert ended < whole / 2, (ended, whole)
    finally:
        reader.close()


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


RSS_BOUND_MIB = 100


def test_resident_memory_returns_after_a_hostile_phase(make_server):
    """Oversized and over-long bodies, malformed ones, floods and hang-ups, at once, then
    quiet: the resident memory of the process clients reach (the server, or the router)
    comes back to within RSS_BOUND_MIB of where it was after warm-up."""
    s = make_server("--kv-pool-tokens", "4096", name="rss")
    pid = s.proc.pid
    for i in range(8):
        r, _ = timed_completion(s, "unused", f"Warm-up {i}: the weather today is", max_tokens=16)
        assert r.status_code == 200
    baseline = rss_mib(pid)
    peak = baseline

    def post_raw(data, content_type="application/json"):
        try:
            return requests.post(s.url + "/v1/completions", data=data, timeout=60,
                                 headers={"Content-Type": content_type,
                                          "Authorization": "Bearer unused"}).status_code
        except requests.RequestException:
            return None

    big_text = json.dumps({"model": MODEL_NAME, "prompt": " x" * 1_990_000, "max_tokens": 1})
    attacks = (
        [lambda: post_raw(big_text)] * 12  # a 4 MB text: refused by its length
        + [lambda: post_raw(b"{" * 4_000_000)] * 6  # malformed JSON at the body limit
        + [lambda: post_raw(b"x" * 5_000_000)] * 6  # over the body limit: 413
    )

    def hang_up():
        r = requests.post(s.url + "/v1/completions", stream=True, timeout=60,
                          json={"model": MODEL_NAME, "prompt": "Hang up on me", "max_tokens": 200,
                                "stream": True})
        next(r.iter_lines())
        r.close()
        return 200

    attacks += [hang_up] * 24
    statuses = []
    for _round in range(3):
        threads = [threading.Thread(target=lambda a=a: statuses.append(a())) for a in attacks]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, rss_mib(pid))
            time.sleep(0.05)
    assert set(statuses) <= {200, 400, 413, None}, set(statuses)
    assert 400 in statuses and 413 in statuses
    leased = lambda: s.metrics().get('kvwarden_kv_pages{state="leased"}', 0)
    deadline = time.monotonic() + 30
    while leased() != 0:
        assert time.monotonic() < deadline, f"pages still leased: {leased()}"
        time.sleep(0.1)
    time.sleep(2)
    after = rss_mib(pid)
    print(f"RSS: {baseline:.0f} MiB after warm-up, peak {peak:.0f} MiB under the hostile phase, "
          f"{after:.0f} MiB after quiet")
    assert after - baseline < RSS_BOUND_MIB, (baseline, peak, after)
    # And it still serves.
    r, _ = timed_completion(s, "unused", "Still there?", max_tokens=4)
    assert r.status_code == 200
