"""The real requantized files (scripts/fetch-quant-models.sh) served end to end: one chat
request each, through the file's own template, with the official client.

Every file must load and answer; those that keep the model's quality must answer "Paris" to
a question the default model answers decisively (top-2 margins of at least 0.8 nats on the way
to "Paris" on every file but Q2_K-pure, measured with kvwarden's arithmetic; see
test_content.py's FRANCE). Q2_K-pure, every tensor at 2 bits, loses it ("Bear with that for a
more detailed one ..."). The references' own chat (case 4 of tests/data/llama-refs/<file>.json,
"What is the capital of France?") is a near tie at its first token, which a change of
arithmetic below f16's precision flips; it stays in crates/model/tests/llama_references.rs.
"""

import pytest

from conftest import ROOT, SYSTEM, Server

QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Name the capital of France."},
]

# file name under models/ -> whether the answer keeps "Paris"
FILES = {
    "SmolLM2-135M-Instruct.Q8_0": True,
    "SmolLM2-135M-Instruct.Q6_K": True,
    "SmolLM2-135M-Instruct.Q5_K_M": True,
    "SmolLM2-135M-Instruct.Q4_K_M": True,
    "SmolLM2-135M-Instruct.Q3_K_M": True,
    "SmolLM2-135M-Instruct.Q2_K": True,
    "SmolLM2-135M-Instruct.Q2_K-pure": False,
}


@pytest.mark.parametrize("name", FILES)
def test_requantized_file_answers_through_its_template(name, tmp_path):
    path = ROOT / "models" / f"{name}.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run scripts/fetch-quant-models.sh", pytrace=False)
    server = Server(["--kv-pool-tokens", "512"], tmp_path / "stderr.log", model=path)
    try:
        r = server.client.chat.completions.create(
            model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=16
        )
    finally:
        rc = server.stop()
    assert rc == 0, (tmp_path / "stderr.log").read_text(errors="replace")
    answer = r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert answer.strip(), f"{name}: empty answer"
    if FILES[name]:
        assert "Paris" in answer, f"{name}: {answer!r}"
    else:
        assert "Paris" not in answer, f"{name} now answers Paris: mark it as keeping quality"
