"""The quick start of docs/PYTHON.md runs as written against a real kvcached."""

import contextlib
import io
import re

from daemon import REPO_ROOT


def test_quick_start_runs(kvcached):
    text = (REPO_ROOT / "docs" / "PYTHON.md").read_text()
    section = text[text.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = re.sub(r'^ADDRESS = .*$', f'ADDRESS = "{kvcached.address}"', code, flags=re.M)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/PYTHON.md", "exec"), {})
    assert "SequenceStats(steps=20" in out.getvalue()
