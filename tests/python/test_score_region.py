"""Shared-memory score regions against the in-process fake: the object (random name, mode
0600, untracked, unlinked and unregistered on close), what goes in it (the inline bytes,
each report at a 64-byte boundary, every batch from the start), overflow to inline, and a
daemon that refuses regions."""

import subprocess
import sys
import textwrap
from array import array
from pathlib import Path

import grpc
import pytest

from fake_kvcached import FakeServer
from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import KvCacheClient, KvCacheError, Report, Scores, encode_scores
from kvcache_client.region import ALIGNMENT

SHM = Path("/dev/shm")


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture
def fake_client(fake):
    with KvCacheClient(fake.address, timeout=10) as client:
        yield client


def shm_path(region) -> Path:
    return SHM / region.name.lstrip("/")


def our_objects():
    return {p.name for p in SHM.glob("kvcm-*")} if SHM.is_dir() else set()


def rows(layers, tokens, base=0.0):
    return [[base + (l * tokens + i) / 64 for i in range(tokens)] for l in range(layers)]


def align(n):
    return -(-n // ALIGNMENT) * ALIGNMENT


def test_a_region_is_created_registered_used_and_removed(fake, fake_client):
    with fake_client.batch(score_region_bytes=4096) as batch:
        region = batch.score_region
        assert region.name.startswith("/kvcm-") and len(region.name) > 20
        assert fake.service.registered == [(region.region_id, region.name, 4096)]
        path = shm_path(region)
        assert path.exists() and path.stat().st_mode & 0o777 == 0o600
        assert path.stat().st_size == 4096
        batch.open("a", prefill_len=3, budget_tokens=2)                       # 4 tokens
        batch.open("b", prefill_len=5, budget_tokens=2, score_dtype="float16")  # 6 tokens
        sent = {"a": rows(3, 4), "b": rows(2, 6, 1.0)}
        decisions = batch.step(sent)
        assert all(d.ok for d in decisions.values())
    assert not path.exists()
    assert fake.service.unregistered == [region.region_id]

    a, b = fake.service.batches[0].reports
    assert a.WhichOneof("score_source") == "score_ref" and a.scores == b""
    assert (a.score_ref.region, a.score_ref.offset, a.score_ref.byte_size) == (
        region.region_id, 0, 3 * 4 * 4)
    assert (a.layers, a.dtype) == (3, pb.SCORE_DTYPE_FLOAT32)
    assert b.score_ref.offset == align(48) == 64 and b.score_ref.byte_size == 2 * 6 * 2
    assert (b.layers, b.dtype) == (2, pb.SCORE_DTYPE_FLOAT16)
    # The daemon read exactly what the inline report would have carried.
    want = {"a": encode_scores(sent["a"]).data,
            "b": encode_scores(sent["b"], default_dtype="float16").data}
    assert {r.sequence_id: r.data for r in fake.service.resolved} == want
    assert (region.region_reports, region.inline_reports) == (2, 0)
    assert region.closed


def test_every_range_is_aligned_and_every_batch_starts_at_zero(fake, fake_client):
    prefills = [1, 3, 16, 17, 5]  # one float32 layer of prefill + 1 tokens each
    with fake_client.batch(score_region_bytes=1 << 16) as batch:
        for i, prefill in enumerate(prefills):
            batch.open(f"s{i}", prefill_len=prefill, budget_tokens=1)
        for _ in range(2):
            batch.step({sid: [[0.5] * t.tokens] for sid, t in batch.sequences.items()})
            reports = fake.service.batches[-1].reports
            assert reports[0].score_ref.offset == 0, "each batch reuses the region"
            cursor = 0
            for report in reports:
                assert report.score_ref.offset == align(cursor)
                assert report.score_ref.offset % ALIGNMENT == 0
                cursor = report.score_ref.offset + report.score_ref.byte_size
            assert batch.score_region.high_water_bytes == cursor


def test_what_does_not_fit_goes_inline_and_is_counted(fake, fake_client):
    # 160 bytes: a (4 tokens x 4 layers f32 = 64 B) fits at 0, b (33 x 1 = 132 B) does not
    # fit at 64, c (8 x 1 = 32 B) does, at 64.
    with fake_client.batch(score_region_bytes=160) as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        batch.open("b", prefill_len=32, budget_tokens=2)
        batch.open("c", prefill_len=7, budget_tokens=2)
        sent = {"a": rows(4, 4), "b": rows(1, 33), "c": rows(1, 8)}
        assert all(d.ok for d in batch.step(sent).values())
        region = batch.score_region
        assert (region.region_reports, region.inline_reports) == (2, 1)
    a, b, c = fake.service.batches[0].reports
    assert a.score_ref.offset == 0 and c.score_ref.offset == 64
    assert b.WhichOneof("score_source") == "scores" and b.layers == 1
    assert [r.ref is None for r in fake.service.resolved] == [False, True, False]
    assert [r.data for r in fake.service.resolved] == [encode_scores(v).data
                                                       for v in sent.values()]


def test_every_input_kind_lands_in_the_region_as_its_inline_bytes(fake, fake_client):
    layers = rows(2, 4)
    flat = [v for r in layers for v in r]
    raw = array("f", flat).tobytes()
    kinds = [layers, array("f", flat), raw, memoryview(raw).cast("f", (2, 4)),
             Scores(raw, layers=2), [array("f", r) for r in layers], array("d", flat),
             Scores(layers, dtype="bfloat16"), Scores(layers, dtype="float16")]
    with fake_client.batch(score_region_bytes=4096) as batch:
        for i in range(len(kinds)):
            batch.open(f"k{i}", prefill_len=3, budget_tokens=2)
        batch.step({f"k{i}": kind for i, kind in enumerate(kinds)})
    want = [encode_scores(kind, tokens=4).data for kind in kinds]
    assert [r.data for r in fake.service.resolved] == want
    assert all(r.ref is not None for r in fake.service.resolved)


def test_a_daemon_without_shm_scores_refuses_clearly_and_nothing_is_left(fake, fake_client):
    fake.service.allow_shm = False
    before = our_objects()
    with pytest.raises(KvCacheError) as caught:
        fake_client.batch(score_region_bytes=4096)
    error = caught.value
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "--allow_shm_scores" in error.message and fake.address in error.message
    assert our_objects() == before
    with pytest.raises(KvCacheError):
        fake_client.stream(score_region_bytes=4096)
    assert our_objects() == before


def test_a_raw_stream_writes_reports_into_its_region(fake, fake_client):
    fake_client.open_sequence("a", 3, budget_tokens=2)
    with fake_client.stream(score_region_bytes=1024) as stream:
        region = stream.score_region
        assert stream.send([Report("a", 1, rows(2, 4))])[0].ok
        # A StepReport message passes as it is.
        assert stream.send([pb.StepReport(sequence_id="a", step=2,
                                          scores=encode_scores(rows(1, 5)).data,
                                          layers=1)])[0].ok
    first, second = (b.reports[0] for b in fake.service.batches)
    assert first.score_ref.region == region.region_id and first.score_ref.byte_size == 32
    assert second.WhichOneof("score_source") == "scores"
    assert not shm_path(region).exists()


def test_closing_when_the_daemon_is_gone_still_unlinks(fake, fake_client):
    batch = fake_client.batch(score_region_bytes=256)
    path = shm_path(batch.score_region)
    fake.stop()
    batch.close()
    assert not path.exists() and batch.score_region.closed
    batch.close()  # twice is fine


def test_sizes_below_one_are_refused():
    with KvCacheClient("127.0.0.1:1") as client, pytest.raises(ValueError):
        client.batch(score_region_bytes=-5)


_TRACKER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path[:0] = {paths!r}
    from kvcache_client.region import ScoreRegion

    class Client:  # what ScoreRegion needs of a KvCacheClient
        address = "test"
        def register_score_region(self, name, size):
            return 7
        def unregister_score_region(self, region):
            pass

    closed = ScoreRegion(Client(), 4096)
    closed.close()
    left = ScoreRegion(Client(), 4096)   # never closed: unlinked at exit
    print(closed.name, left.name)
""")


def test_regions_stay_off_the_resource_tracker():
    """Unlinked once, by us: no 'leaked shared_memory' warning, no KeyError from a second
    unregister, and nothing left in /dev/shm, also for a region never closed."""
    import kvcache.v1.kvcache_pb2 as stubs
    import kvcache_client
    paths = [str(Path(kvcache_client.__file__).parents[1]),
             str(Path(stubs.__file__).parents[2])]
    result = subprocess.run([sys.executable, "-c", _TRACKER_SCRIPT.format(paths=paths)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for name in result.stdout.split():
        assert not (SHM / name.lstrip("/")).exists()
