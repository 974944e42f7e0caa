"""Fixtures of the Python client tests.

The generated stubs come from PYTHONPATH (CTest sets it), else from build/python when they
are not older than the proto, else are generated into a temporary folder when protoc and
grpc_python_plugin are on PATH. The daemon
tests start a real kvcached ($KVCM_KVCACHED, default build/bin/kvcached) and skip, saying
why, when it is not built.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon import REPO_ROOT, Daemon, flag_missing_reason, missing_reason  # noqa: E402


def _make_importable() -> None:
    if importlib.util.find_spec("kvcache_client") is None:
        sys.path.insert(0, str(REPO_ROOT / "clients" / "python"))
    try:
        if importlib.util.find_spec("kvcache.v1.kvcache_pb2") is not None:
            return
    except ModuleNotFoundError:
        pass
    built = REPO_ROOT / "build" / "python"
    stub = built / "kvcache" / "v1" / "kvcache_pb2.py"
    proto = REPO_ROOT / "proto" / "kvcache" / "v1" / "kvcache.proto"
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    fresh = stub.exists() and stub.stat().st_mtime >= proto.stat().st_mtime
    if stub.exists() and (fresh or not (protoc and plugin)):
        sys.path.insert(0, str(built))
        return
    if protoc and plugin:  # none built, or built from an older proto
        out = tempfile.mkdtemp(prefix="kvcache-stubs-")
        subprocess.run([protoc, f"--proto_path={REPO_ROOT / 'proto'}", f"--python_out={out}",
                        f"--grpc_out={out}", f"--plugin=protoc-gen-grpc={plugin}",
                        str(REPO_ROOT / "proto" / "kvcache" / "v1" / "kvcache.proto")],
                       check=True)
        sys.path.insert(0, out)


_make_importable()

from kvcache_client import KvCacheClient  # noqa: E402

_ids = itertools.count(1)


@pytest.fixture(scope="session")
def kvcached(tmp_path_factory):
    """One daemon for the session (default flags); yields the Daemon."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    daemon = Daemon(tmp_path_factory.mktemp("kvcached")).start()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
def shm_kvcached(tmp_path_factory):
    """One daemon for the session that takes shared-memory score regions
    (--allow_shm_scores); skips when kvcached is not built or has no such flag."""
    reason = flag_missing_reason("allow_shm_scores")
    if reason:
        pytest.skip(reason)
    daemon = Daemon(tmp_path_factory.mktemp("kvcached-shm"), "--allow_shm_scores").start()
    yield daemon
    daemon.stop()


@pytest.fixture
def shm_client(shm_kvcached):
    """A client of the --allow_shm_scores daemon."""
    with KvCacheClient(shm_kvcached.address, timeout=30) as c:
        yield c


@pytest.fixture
def start_daemon(tmp_path):
    """Starts a daemon of its own with extra flags: ``start_daemon("--max_sequences=2")``."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    started = []

    def start(*flags: str) -> Daemon:
        daemon = Daemon(tmp_path / f"kvcached{len(started)}", *flags)
        daemon.workdir.mkdir()
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture
def client(kvcached):
    """A client of the session daemon, with a generous per-call timeout."""
    with KvCacheClient(kvcached.address, timeout=30) as c:
        yield c


@pytest.fixture
def seq_id(request):
    """A maker of sequence ids unique in the session: ``seq_id("a")``."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:120]
    return lambda tag="": f"{stem}-{tag}-{next(_ids)}"
