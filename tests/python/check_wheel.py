"""The client's wheel installs as Python users expect (CTest: python_wheel).

pip installs build/python/dist/kvcache_client-*.whl ($KVCM_WHEEL) offline into a fresh
virtual environment that sees the system's packages (grpcio, protobuf: the wheel's
dependencies must be met by them, since pip may not download), then the quick start of
docs/PYTHON.md runs against a real kvcached from a folder outside the repository with that
environment's python and no PYTHONPATH: the client and the generated stubs must come from
the wheel. Not named test_*.py, so that the client suite (python_client) does not run it
a second time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from daemon import REPO_ROOT

QUICK_START_ADDRESS = 'ADDRESS = "127.0.0.1:50051"'

#: Run by the environment's python: where each module was imported from, as JSON.
ORIGINS = """
import json, sys, sysconfig
import kvcache_client, kvcache_client.policy, kvcache.v1.kvcache_pb2, kvcache.v1.kvcache_pb2_grpc
print(json.dumps({
    "purelib": sysconfig.get_paths()["purelib"],
    "kvcache_client": kvcache_client.__file__,
    "kvcache_pb2": kvcache.v1.kvcache_pb2.__file__,
    "kvcache_pb2_grpc": kvcache.v1.kvcache_pb2_grpc.__file__,
    "presets": sorted(kvcache_client.policy.PRESETS),
}))
"""


def _wheel() -> Path:
    named = os.environ.get("KVCM_WHEEL")
    if named:
        return Path(named)
    built = sorted((REPO_ROOT / "build" / "python" / "dist").glob("kvcache_client-*.whl"))
    if not built:
        pytest.skip("no wheel (build it: cmake --build build --target kvcm_python_wheel)")
    return built[-1]


def _clean_env() -> dict:
    """The environment of a user's shell: no PYTHONPATH, no pip index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    env["PIP_NO_INDEX"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(command: list, cwd: Path, timeout: float = 120) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=_clean_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(map(str, command))} exited with "
                                  f"{done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _preset_names() -> list:
    lines = (REPO_ROOT / "cache_manager" / "policy" / "presets.txt").read_text().splitlines()
    return sorted(line.split()[0] for line in lines if line.strip() and line[0] != "#")


def _quick_start(address: str) -> str:
    """The first python block under "## Quick start" of docs/PYTHON.md, aimed at address."""
    text = (REPO_ROOT / "docs" / "PYTHON.md").read_text(encoding="utf-8")
    section = text.split("\n## Quick start", 1)
    assert len(section) == 2, "docs/PYTHON.md has no '## Quick start' section"
    block = re.search(r"```python\n(.*?)```", section[1], re.DOTALL)
    assert block, "docs/PYTHON.md: no python block under '## Quick start'"
    code = block.group(1)
    assert QUICK_START_ADDRESS in code, f"the quick start no longer sets {QUICK_START_ADDRESS}"
    return code.replace(QUICK_START_ADDRESS, f"ADDRESS = {address!r}")


def test_wheel_holds_both_packages_and_presets_as_a_file():
    with zipfile.ZipFile(_wheel()) as archive:
        infos = {info.filename: info for info in archive.infolist()}
        for name in ("kvcache_client/torch/__init__.py", "kvcache_client/py.typed",
                     "kvcache/v1/kvcache_pb2.py", "kvcache/v1/kvcache_pb2_grpc.py"):
            assert name in infos, f"the wheel lacks {name}"
        presets = infos["kvcache_client/presets.txt"]
        assert (presets.external_attr >> 16) & 0o170000 != 0o120000, "presets.txt is a link"
        source = REPO_ROOT / "cache_manager" / "policy" / "presets.txt"
        assert archive.read(presets) == source.read_bytes()
        records = [n for n in infos if n.endswith(".dist-info/RECORD")]
        assert len(records) == 1, f"RECORD files: {records}"
        assert "kvcache_client/client.py,sha256=" in archive.read(records[0]).decode()


def test_quick_start_runs_from_the_installed_wheel(tmp_path, kvcached):
    venv, outside = tmp_path / "venv", tmp_path / "work"
    outside.mkdir()
    assert REPO_ROOT not in outside.parents
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], outside)
    python = venv / "bin" / "python"
    # No --no-deps: pip must find grpcio and protobuf within the declared ranges installed.
    _run([python, "-m", "pip", "install", "--no-index", "--no-input", _wheel()], outside)

    origins = json.loads(_run([python, "-c", ORIGINS], outside))
    purelib = Path(origins["purelib"]).resolve()
    assert purelib.is_relative_to(venv.resolve())
    for module in ("kvcache_client", "kvcache_pb2", "kvcache_pb2_grpc"):
        assert Path(origins[module]).resolve().is_relative_to(purelib), origins
    assert origins["presets"] == _preset_names(), "presets.txt of the wheel is not the source's"

    script = outside / "quick_start.py"
    script.write_text(_quick_start(kvcached.address), encoding="utf-8")
    printed = _run([python, script], outside, timeout=60)
    assert re.search(r"steps=20\b", printed), f"quick start printed {printed!r}"
    assert re.search(r"tokens_evicted=[1-9]", printed), f"quick start printed {printed!r}"
