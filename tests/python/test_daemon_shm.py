"""Score regions against a real kvcached: references the daemon cannot honour fail only
their own decision, with INVALID_ARGUMENT naming the region, the offset and the sizes; a
daemon without --allow_shm_scores refuses regions; registration and unregistration."""

from pathlib import Path

import grpc
import pytest

from golden import load
from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import KvCacheError, Report

INVALID = grpc.StatusCode.INVALID_ARGUMENT
SHM = Path("/dev/shm")


def our_objects():
    return {p.name for p in SHM.glob("kvcm-*")} if SHM.is_dir() else set()


@pytest.fixture
def opened(shm_client, seq_id):
    """Two sequences of the ema_every_step golden; yields (a, b, trace, first layers)."""
    trace = load("ema_every_step")
    a, b = seq_id("a"), seq_id("b")
    for sid in (a, b):
        shm_client.open_sequence(sid, **trace.open_options())
    yield a, b, trace, trace.steps[0]["layers"]


def golden_step(decision, trace, index):
    want = trace.expected[index]
    return (decision.step, decision.evicted, decision.cache_size) == (
        want["step"], want["evicted"], want["cache_size"])


def ref_report(sid, layers, region, offset, byte_size):
    return pb.StepReport(sequence_id=sid, step=1, layers=layers, dtype=pb.SCORE_DTYPE_FLOAT32,
                         score_ref=pb.ScoreRef(region=region, offset=offset,
                                               byte_size=byte_size))


def test_an_unknown_region_fails_only_its_decision(shm_client, opened):
    a, b, trace, layers = opened
    size = len(layers) * len(layers[0]) * 4
    with shm_client.stream(score_region_bytes=1 << 16) as stream:
        unknown = stream.score_region.region_id ^ 0x5A5A  # registered by nobody
        bad, good = stream.send([ref_report(b, len(layers), unknown, 128, size),
                                 Report(a, 1, layers)])
        assert good.ok and golden_step(good, trace, 0)
        assert bad.code == INVALID and f"sequence '{b}' step 1" in bad.message
        for word in (f"region {unknown}", "offset 128", f"byte_size {size}"):
            assert word in bad.message, bad.message
        # Nothing changed for b: the same step through the region goes through.
        assert golden_step(stream.send([Report(b, 1, layers)])[0].raise_for_status(),
                           trace, 0)
        assert stream.score_region.region_reports == 2


def test_a_range_past_the_region_end_fails_naming_the_sizes(shm_client, opened):
    a, b, trace, layers = opened
    size = len(layers) * len(layers[0]) * 4
    with shm_client.stream(score_region_bytes=8192) as stream:
        region = stream.score_region.region_id
        for offset in (8192 - 64, 1 << 40):
            decision = stream.send([ref_report(b, len(layers), region, offset, size)])[0]
            assert decision.code == INVALID, decision
            for word in (f"region {region}", f"offset {offset}", f"byte_size {size}",
                         "8192"):
                assert word in decision.message, decision.message
        # A reference that fits is read in place (the region holds the stream's last
        # batch, written by this client, at offset 0).
        assert stream.send([Report(a, 1, layers)])[0].ok
        fits = stream.send([ref_report(b, len(layers), region, 0, size)])[0]
        assert fits.ok and golden_step(fits, trace, 0)


def test_a_daemon_without_allow_shm_scores_refuses_regions(client):
    before = our_objects()
    with pytest.raises(KvCacheError) as caught:
        client.batch(score_region_bytes=4096)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--allow_shm_scores" in caught.value.message
    assert our_objects() == before  # the object is unlinked again
    with pytest.raises(KvCacheError) as caught:
        client.register_score_region("/kvcm-anything", 64)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_registration_checks_the_object(shm_client):
    with pytest.raises(KvCacheError) as caught:
        shm_client.register_score_region("/kvcm-no-such-object-here", 4096)
    assert caught.value.code == INVALID and "kvcm-no-such-object-here" in caught.value.message
    with shm_client.batch(score_region_bytes=4096) as batch:  # an object of 4096 bytes
        name = batch.score_region.name
        with pytest.raises(KvCacheError) as caught:
            shm_client.register_score_region(name, 8192)
        assert caught.value.code == INVALID
        second = shm_client.register_score_region(name, 1024)  # a prefix may be mapped
        assert second != batch.score_region.region_id
        shm_client.unregister_score_region(second)


def test_closing_a_batch_unregisters_and_unlinks_its_region(shm_client, seq_id):
    trace = load("single_step")
    sid = seq_id()
    with shm_client.batch(score_region_bytes=1 << 16) as batch:
        batch.open(sid, **trace.open_options())
        assert batch.step({sid: trace.steps[0]["layers"]})[sid].ok
        region = batch.score_region
        path = SHM / region.name.lstrip("/")
        assert path.exists() and path.stat().st_mode & 0o777 == 0o600
    assert not path.exists()
    with pytest.raises(KvCacheError) as caught:
        shm_client.unregister_score_region(region.region_id)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_a_daemon_created_region_is_the_daemons_and_goes_when_the_batch_closes(
        shm_client, seq_id):
    """CreateScoreRegion on a CPU daemon: its own shared memory, named for its pid, mode
    0600; this process maps it (without the resource tracker, which would unlink it at
    exit), the steps through it match the golden, and closing the batch has the daemon
    free it."""
    created = shm_client.create_score_region(4096)
    assert (created.backend, created.bytes, created.cuda_ipc_handle) == ("host", 4096, b"")
    assert created.shm_name.startswith("/kvcached-")
    path = SHM / created.shm_name.lstrip("/")
    assert path.exists() and path.stat().st_mode & 0o777 == 0o600
    shm_client.unregister_score_region(created.region)
    assert not path.exists()

    trace = load("ema_every_step")
    sid = seq_id()
    with shm_client.batch(score_region_bytes=1 << 16, daemon_score_region=True) as batch:
        batch.open(sid, **trace.open_options())
        region = batch.score_region
        path = SHM / region.name.lstrip("/")
        assert region.name.startswith("/kvcached-") and path.exists()
        for index, step in enumerate(trace.steps):
            decision = batch.step({sid: step.get("layers")})[sid].raise_for_status()
            want = trace.expected[index]
            assert (decision.evicted, decision.cache_size) == (want["evicted"],
                                                               want["cache_size"])
        assert region.region_reports > 0 and region.inline_reports == 0
    assert not path.exists()


def test_created_regions_have_a_byte_limit(start_daemon):
    daemon = start_daemon("--allow_shm_scores", "--max_created_score_region_bytes=8192")
    from kvcache_client import KvCacheClient
    with KvCacheClient(daemon.address, timeout=30) as c:
        first = c.create_score_region(8192)
        with pytest.raises(KvCacheError) as caught:
            c.create_score_region(1)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max_created_score_region_bytes" in caught.value.message
        c.unregister_score_region(first.region)
        c.unregister_score_region(c.create_score_region(8192).region)


def test_a_region_rank_outside_the_world_is_refused(shm_client):
    with pytest.raises(KvCacheError) as caught:
        shm_client.create_score_region(4096, rank=10_000)
    assert caught.value.code == INVALID and "rank is 10000" in caught.value.message
    placed = shm_client.create_score_region(4096, rank=1)  # a host daemon: ignored
    assert placed.backend == "host"
    shm_client.unregister_score_region(placed.region)
