"""The model file as `serve` holds it: mapped by default (the weights stored as in the
file used where they lie), read into memory with --no-mmap; both answer bit for bit alike,
and a file replaced by renaming a new one over it, as the README says to, leaves a
serving process answering as before."""

import shutil

import pytest

from conftest import ROOT, SYSTEM, Server

QUESTION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
]


def answer(server):
    r = server.client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, temperature=0, max_tokens=12, logprobs=True
    )
    return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]


def test_mapped_and_read_files_answer_alike_and_a_rename_over_the_file_is_safe(tmp_path):
    # Q6_K: every layer matrix is used in place from the mapping.
    source = ROOT / "models" / "SmolLM2-135M-Instruct.Q6_K.gguf"
    if not source.is_file():
        pytest.fail(f"{source} is missing: run scripts/fetch-quant-models.sh", pytrace=False)
    path = tmp_path / "served.gguf"
    shutil.copyfile(source, path)
    mapped = Server(["--kv-pool-tokens", "512"], tmp_path / "mapped.log", model=path)
    read = Server(["--kv-pool-tokens", "512", "--no-mmap"], tmp_path / "read.log", model=path)
    try:
        want = answer(read)
        assert answer(mapped) == want
        # Another file renamed over the served path: the mapping keeps the old inode.
        other = tmp_path / "other.gguf"
        other.write_bytes(b"\0" * 4096)
        other.replace(path)
        assert answer(mapped) == want
        assert answer(read) == want
    finally:
        rcs = (mapped.stop(), read.stop())
    assert rcs == (0, 0), (tmp_path / "mapped.log").read_text(errors="replace")
