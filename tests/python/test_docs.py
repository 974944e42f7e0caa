"""The examples of docs/PYTHON.md that need only a daemon run as written against a real
kvcached: the quick start, both transports, and the folded layout."""

import contextlib
import io
import re

from daemon import REPO_ROOT


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
