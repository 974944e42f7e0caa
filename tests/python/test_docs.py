"""The examples of docs/PYTHON.md that need only a daemon run as written against a real
kvcached: the quick start, both transports, and the folded layout."""

import contextlib
import io
import re

import pytest

from daemon import REPO_ROOT, flag_missing_reason


def run_section(heading: str, address: str) -> str:
    """Runs the first python block under ``heading`` with ADDRESS pointed at ``address``;
    returns what it printed."""
    text = (REPO_ROOT / "docs" / "PYTHON.md").read_text()
    section = text[text.index(heading):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = re.sub(r'^ADDRESS = .*$', f'ADDRESS = "{address}"', code, flags=re.M)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"docs/PYTHON.md ({heading})", "exec"), {})
    return out.getvalue()


def test_quick_start_runs(kvcached):
    assert "SequenceStats(steps=20" in run_section("## Quick start", kvcached.address)


def test_both_transports_run(shm_kvcached):
    assert run_section("## Two transports", shm_kvcached.address).split() == ["8", "0"]


def test_the_folded_example_runs(shm_kvcached):
    run_section("## Folded reports", shm_kvcached.address)


def test_the_decision_encodings_example_runs(kvcached):
    assert run_section("## Decision encodings", kvcached.address).splitlines() == [
        "mask 3601 4001", "positions 1 401", "positions 1 401"]


def test_the_torch_worker_example_runs(start_daemon):
    pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")
    reason = flag_missing_reason("pool_memory_bytes")
    if reason:
        pytest.skip(reason)
    daemon = start_daemon("--allow_shm_scores", "--pool_memory_bytes=1048576",
                          "--kv_layers=2", "--kv_heads=2", "--kv_head_dim=8",
                          "--kv_dtype=float32")
    out = run_section("## The torch worker side", daemon.address)
    assert out.split() == ["6", "71", "2"]


def test_every_kvcached_flag_is_documented():
    """Each flag kvcached_main.cc defines is named in README.md (or, for the KV pool
    geometry, docs/GPU.md): a new flag without a word for the operator fails here."""
    import subprocess

    from daemon import kvcached_binary, missing_reason
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    done = subprocess.run([str(kvcached_binary()), "--help"], capture_output=True, text=True,
                          timeout=30)
    help_text = done.stdout + done.stderr
    ours = re.split(r"^\s*Flags from ", help_text, flags=re.M)
    section = next(s for s in ours if s.split(":", 1)[0].endswith("kvcached_main.cc"))
    flags = set(re.findall(r"^\s{4}--([a-z0-9_]+)", section, flags=re.M))
    assert len(flags) > 20, help_text
    docs = (REPO_ROOT / "README.md").read_text() + (REPO_ROOT / "docs" / "GPU.md").read_text()
    undocumented = sorted(f for f in flags if f"--{f}" not in docs)
    assert not undocumented, f"flags named in neither README.md nor docs/GPU.md: {undocumented}"


def test_every_public_name_is_in_the_pieces_table():
    """docs/PYTHON.md's "The pieces" names everything kvcache_client exports, and nothing
    it no longer does."""
    import kvcache_client
    text = (REPO_ROOT / "docs" / "PYTHON.md").read_text()
    section = text[text.index("## The pieces"):]
    rows = [line for line in section[:section.index("| what | signature |")].splitlines()
            if line.startswith("|")]
    named = set(re.findall(r"`([A-Za-z_]+)`", "\n".join(rows)))
    assert set(kvcache_client.__all__) <= named, set(kvcache_client.__all__) - named
    assert named <= set(kvcache_client.__all__), named - set(kvcache_client.__all__)
