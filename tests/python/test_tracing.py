"""OpenTelemetry traces (`--otlp-endpoint`): one request through router + prefill + decode
is one trace, continuing the client's `traceparent`, with the spans of every stage in the
right parent-child order across the three processes, and nothing of the request's content
(prompt, completion, API key, tenant) in any span. The OTLP receiver is this test's own
HTTP server; the processes export when they stop (SIGTERM flushes the batch)."""

import secrets
import threading

import pytest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from conftest import MODEL_NAME, Cluster

CANARY = "zebra-canary-7731"
API_KEY = "sk-trace-secret-5519"
TENANT = "tenant-quokka"

# span name -> (the process that records it, its parent's name; None for the root)
EXPECTED = {
    "request": ("kvwarden-router", None),
    "validation": ("kvwarden-router", "request"),
    "admission": ("kvwarden-router", "request"),
    "call.admit": ("kvwarden-router", "request"),
    "call.decode": ("kvwarden-router", "request"),
    "call.prefill": ("kvwarden-router", "request"),
    "node.admit": ("kvwarden-prefill", "call.admit"),
    "node.prefill": ("kvwarden-prefill", "call.prefill"),
    "prefill": ("kvwarden-prefill", "node.prefill"),
    "transfer": ("kvwarden-prefill", "node.prefill"),
    "node.push_kv": ("kvwarden-decode", "transfer"),
    "node.decode": ("kvwarden-decode", "call.decode"),
    "queueing": ("kvwarden-decode", "node.decode"),
    "verification": ("kvwarden-decode", "node.decode"),
    "decode": ("kvwarden-decode", "node.decode"),
}


class Receiver:
    """An OTLP/HTTP traces endpoint: keeps every protobuf payload POSTed to it."""

    def __init__(self):
        self.payloads = []
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    outer.payloads.append((self.path, self.headers.get("Content-Type"), body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self):
        """(service name, span) for every span received."""
        out = []
        for path, content_type, body in self.payloads:
            assert path == "/v1/traces", path
            assert content_type == "application/x-protobuf", content_type
            req = ExportTraceServiceRequest()
            req.ParseFromString(body)
            for rs in req.resource_spans:
                service = next(
                    a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
                )
                for ss in rs.scope_spans:
                    out += [(service, s) for s in ss.spans]
        return out

    def close(self):
        self.server.shutdown()


def values(any_value):
    """Every string an attribute value holds, however nested."""
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [v for x in any_value.array_value.values for v in values(x)]
    if kind == "kvlist_value":
        return [v for kv in any_value.kvlist_value.values for v in [kv.key, *values(kv.value)]]
    if kind == "bytes_value":
        return [any_value.bytes_value.decode("latin-1")]
    return [str(getattr(any_value, kind))] if kind else []


@pytest.mark.parametrize("tenant_attribute", [False, True], ids=["default", "tenant-attribute"])
def test_one_request_is_one_trace_across_router_prefill_and_decode(tmp_path, tenant_attribute):
    receiver = Receiver()
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{API_KEY} {TENANT}\n")
    # The router gets the traces URL, the nodes its base (both forms are accepted).
    c = Cluster(
        ["--kv-pool-tokens", "4096", "--api-keys", keys, "--otlp-endpoint", receiver.url],
        tmp_path,
        api_key=API_KEY,
        router_args=["--otlp-endpoint", receiver.url + "/v1/traces"]
        + (["--otlp-tenant-attribute"] if tenant_attribute else []),
    )
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    try:
        r = requests.post(
            c.url + "/v1/completions",
            headers={
                "Authorization": f"Bearer {API_KEY}",
                "traceparent": f"00-{trace_id}-{client_span}-01",
            },
            json={
                "model": MODEL_NAME,
                "prompt": f"The secret word is {CANARY}. Repeat the secret word:",
                "max_tokens": 12,
                "temperature": 0,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        completion = r.json()["choices"][0]["text"]
    finally:
        c.stop()
        receiver.close()

    raw = b"".join(body for _, _, body in receiver.payloads)
    # The tenant's name is the operator's choice, on the request's span only.
    for secret in (CANARY, API_KEY) + (() if tenant_attribute else (TENANT,)):
        assert secret.encode() not in raw, f"{secret!r} was exported"

    spans = receiver.spans()
    assert spans, "no span was exported"
    # Nothing but this request was traced (health polls and node info are not), so every
    # span belongs to the client's trace.
    assert {s.trace_id.hex() for _, s in spans} == {trace_id}
    by_name = {}
    for service, s in spans:
        assert s.name not in by_name, f"two spans named {s.name!r}"
        by_name[s.name] = (service, s)
    assert set(by_name) == set(EXPECTED), sorted(by_name)
    for name, (service, parent) in EXPECTED.items():
        got_service, span = by_name[name]
        assert got_service == service, (name, got_service)
        want_parent = client_span if parent is None else by_name[parent][1].span_id.hex()
        assert span.parent_span_id.hex() == want_parent, (name, parent)
        assert span.start_time_unix_nano <= span.end_time_unix_nano

    # The stages in their order: admission on the router before the prefill node's, the
    # K/V verified before the decode node generates.
    start = {n: s.start_time_unix_nano for n, (_, s) in by_name.items()}
    end = {n: s.end_time_unix_nano for n, (_, s) in by_name.items()}
    assert end["validation"] <= start["admission"] <= start["call.admit"]
    assert end["prefill"] <= start["transfer"]
    assert end["queueing"] <= start["verification"] <= end["verification"] <= start["decode"]

    request_attributes = {a.key: values(a.value) for a in by_name["request"][1].attributes}
    assert request_attributes.get("tenant") == ([TENANT] if tenant_attribute else None)
    forbidden = [CANARY, API_KEY] + ([completion.strip()] if len(completion.strip()) >= 6 else [])
    for _, s in spans:
        strings = [s.name] + [v for a in s.attributes for v in [a.key, *values(a.value)]]
        strings += [v for e in s.events for a in e.attributes for v in [e.name, a.key, *values(a.value)]]
        tenant_allowed = tenant_attribute and s.name == "request"
        for text in strings:
            for secret in forbidden + ([] if tenant_allowed else [TENANT]):
                assert secret not in text, (s.name, text)
