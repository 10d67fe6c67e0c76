"""`kvwarden audit` against kvwarden itself: it passes against a normal build and names the
leak against the fault-injection build, which re-enacts the incident's bug."""

import json
import subprocess

import pytest
import requests

from conftest import BIN, FAULT_BIN, ROOT, TENANT_KEYS


def audit(url, tmp_path, *args, timeout=900):
    """Runs `kvwarden audit`; returns (exit code, stdout, JSON report)."""
    report = tmp_path / "report.json"
    html = tmp_path / "report.html"
    out = subprocess.run(
        [str(BIN), "audit", "--endpoint", url, "--no-progress", "--json", str(report),
         "--html", str(html), *[str(a) for a in args]],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert report.is_file(), f"no JSON report (exit {out.returncode}):\n{out.stdout}\n{out.stderr}"
    assert html.read_text().startswith("<!DOCTYPE html>")
    return out.returncode, out.stdout + out.stderr, json.loads(report.read_text())


@pytest.fixture(scope="module")
def audited_server(make_server, tmp_path_factory):
    """Two tenants and a pool equal to a 1,024-token context, so near-limit prompts fill it."""
    keys = tmp_path_factory.mktemp("audit-keys") / "api-keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in TENANT_KEYS.items()))
    return make_server(
        "--kv-pool-tokens", "1024", "--api-keys", keys, api_key=TENANT_KEYS["alice"],
        name="audited",
    )


def test_audit_passes_against_kvwarden(audited_server, tmp_path):
    code, out, rep = audit(
        audited_server.url, tmp_path,
        "--api-key", TENANT_KEYS["alice"], "--api-key", TENANT_KEYS["bob"],
        "--batch-invariant", "--requests", "8", "--max-tokens", "8", "--seed", "7",
        "--side-channel-tokens", "256", "--side-channel-trials", "1",
    )
    assert code == 0, out
    assert rep["passed"] and rep["leaks"] == [], out
    assert rep["real_tenants"] and rep["max_context"] == 1024
    assert [c["status"] for c in rep["capacity"]] == [200, 400, 400, 400], rep["capacity"]
    verdicts = {c["check"]: c["verdict"] for c in rep["checks"]}
    assert verdicts["capacity"] == verdicts["canaries"] == verdicts["status"] == "pass", out
    # Structured outputs: the schema enforced, streamed and whole the same.
    assert verdicts["structured"] == verdicts["stream_equality"] == "pass", out
    # Tool calling: a required call names a declared function, its arguments validate.
    assert verdicts["tool_calls"] == "pass", out
    # kvwarden is batch-invariant: every greedy answer is the same alone.
    d = rep["differential"]
    assert d["compared"] >= 3 and d["identical"] == d["compared"], d
    # Distinct API keys are distinct cache domains: no cached token crosses them.
    assert rep["side_channel"]["reported_cross_hit"] is False
    assert "verdict: PASS" in out
    # Over-length prompts were sent and refused, canaries and all.
    over = [r for r in rep["requests"] if r["kind"] == "over_length"]
    assert over and all(r["status"] == 400 for r in over)


def test_audit_names_the_leak_in_the_fault_injection_build(make_server, tmp_path):
    if not FAULT_BIN.is_file():
        pytest.fail(
            f"fault-injection build not found at {FAULT_BIN}: scripts/test.sh builds it "
            "(cargo build -p kvwarden --features fault-injection, moved there)",
            pytrace=False,
        )
    s = make_server(
        "--kv-pool-tokens", "1024", "--no-prefix-cache", "--inject-fault", "incident",
        binary=FAULT_BIN, name="fault",
    )
    assert "FAULT-INJECTION BUILD" in s.stderr()
    assert requests.get(s.url + "/health", timeout=10).json() == {
        "status": "ok", "fault_injection": True, "fault": "incident"}
    # The incident's pattern, sequentially and seeded, so the run is the same every time:
    # one tenant fills the pool with a repeated canary, another sends an over-length prompt.
    code, out, rep = audit(
        s.url, tmp_path, "--checks", "capacity,canaries,status", "--requests", "0",
        "--pressure-pairs", "6", "--max-tokens", "12", "--seed", "11",
    )
    assert code != 0 and not rep["passed"], out
    assert rep["health"]["fault_injection"] is True
    # The over-length prompt got a 200...
    one_over = rep["capacity"][1]
    assert one_over["status"] == 200 and one_over["verdict"] == "fail", one_over
    # ...and the audit names the leak: whose canary, found where, in which request.
    assert rep["leaks"], out
    leak = rep["leaks"][0]
    assert leak["cross_tenant"] and leak["status"] == 200 and leak["location"] == "content"
    owner = next(r for r in rep["requests"] if r["id"] == leak["canary_of"])
    victim = next(r for r in rep["requests"] if r["id"] == leak["found_in"])
    assert owner["kind"] == "pressure_fill" and victim["kind"] == "over_length"
    assert leak["canary"] in (owner["canary"]["word"], owner["canary"]["digits"])
    assert "LEAK: request #" in out and "verdict: FAIL" in out


def test_default_build_has_no_fault_injection(server):
    assert requests.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    help_text = subprocess.run(
        [str(BIN), "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--inject-fault" not in help_text
    assert "FAULT-INJECTION" not in server.stderr()


def test_side_channel_reports_a_cache_shared_across_identities(server, tmp_path):
    """Without API keys kvwarden has one tenant, so its prefix cache is shared by every
    requester: the audit must classify that (a warning: the server cannot tell them apart)."""
    code, out, rep = audit(
        server.url, tmp_path, "--checks", "side-channel", "--side-channel-tokens", "256",
        "--side-channel-trials", "1",
    )
    assert code == 0, out
    sc = rep["side_channel"]
    assert sc["reported_cross_hit"] is True and sc["real_tenants"] is False, sc
    assert sc["trials"][0]["b_same_prefix_cached"] >= 256 - 16
    check = next(c for c in rep["checks"] if c["check"] == "side_channel")
    assert check["verdict"] == "warn", check
