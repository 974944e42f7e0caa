"""The client side of ImportSequence without a daemon: what goes on the wire, how the
answer is read (state, slot tables, bytes, transport), how failures come back, how a batch
tracks an imported sequence, and how PooledKvCache adopts the imported slot table."""

import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from fake_kvcached import FakeKvCache
from kvcache.v1 import kvcache_pb2 as pb
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvcache_client import ImportedSequence, KvCacheClient, KvCacheError


class ImportingFake(FakeKvCache):
    """The fake daemon, plus ImportSequence: answers from ``offers`` (id -> response),
    or fails with ``failure`` (code, message), after ``delay`` seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.offers = {}
        self.requests = []
        self.failure = None
        self.delay = 0.0

    def ImportSequence(self, request, context):
        self.requests.append(request)
        if self.delay:
            time.sleep(self.delay)
        if self.failure is not None:
            context.abort(*self.failure)
        response = self.offers.get(request.sequence_id)
        if response is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"{request.source} has no sequence '{request.sequence_id}'")
        with self._lock:
            self.states[request.sequence_id] = pb.SequenceState()
            self.states[request.sequence_id].CopyFrom(response.state)
        return response


@pytest.fixture
def fake():
    service = ImportingFake()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KvCacheServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service.address = f"127.0.0.1:{port}"
    yield service
    server.stop(grace=None)


def imported_response(sequence_id="s", last_step=1, positions=(0, 1, 5, 9, 40),
                      ranks=2) -> pb.ImportSequenceResponse:
    state = pb.SequenceState(
        sequence_id=sequence_id, prefill_len=40, budget=len(positions),
        policy=pb.Policy(aggregation=pb.AGGREGATION_EMA, alpha=0.8),
        tp_world_size=1, score_dtype=pb.SCORE_DTYPE_FLOAT16, last_step=last_step,
        cache_size=len(positions), next_needs_scores=True,
        stats=pb.SequenceStats(steps=last_step, scoring_steps=last_step,
                               tokens_evicted=40 + last_step - len(positions)),
        positions=list(positions), momentum=[0.5] * len(positions),
        score_layout=pb.SCORE_LAYOUT_PER_LAYER,
        decision_encoding=pb.DECISION_ENCODING_POSITIONS)
    for rank in range(ranks):
        state.kv_slots.add(rank=rank, slots=[100 * rank + 3 * i for i in range(len(positions))])
    return pb.ImportSequenceResponse(state=state, kv_bytes=4 * 8192 * ranks,
                                     record_bytes=211, transport="ucx", seconds=0.0125)


def test_an_import_answer_is_read_with_its_slot_tables():
    result = ImportedSequence.from_proto(imported_response())
    assert result.sequence_id == "s"
    assert (result.kv_bytes, result.record_bytes, result.transport) == (65536, 211, "ucx")
    assert result.seconds == pytest.approx(0.0125)
    assert result.bytes_moved == 65536 + 211
    state = result.state
    assert (state.last_step, state.next_step, state.cache_size) == (1, 2, 5)
    assert state.positions == [0, 1, 5, 9, 40]
    assert state.kv_slots == {0: [0, 3, 6, 9, 12], 1: [100, 103, 106, 109, 112]}
    assert state.score_dtype == "float16" and state.stats.tokens_evicted == 36


def test_an_import_without_pools_has_no_slot_tables():
    response = imported_response(ranks=0)
    response.kv_bytes, response.transport = 0, "none"
    result = ImportedSequence.from_proto(response)
    assert result.state.kv_slots == {} and result.transport == "none"
    assert result.bytes_moved == 211


def test_import_sends_the_id_and_source_and_returns_the_state(fake):
    fake.offers["req-7"] = imported_response("req-7", last_step=3)
    with KvCacheClient(fake.address, timeout=10) as client:
        result = client.import_sequence("req-7", "10.0.0.2:50051")
    assert [(r.sequence_id, r.source) for r in fake.requests] == [("req-7", "10.0.0.2:50051")]
    assert isinstance(result, ImportedSequence)
    assert result.state.sequence_id == "req-7" and result.state.last_step == 3
    assert result.state.kv_slots[1][0] == 100


def test_import_failures_keep_the_daemons_code_and_name_the_call(fake):
    with KvCacheClient(fake.address, timeout=10) as client:
        with pytest.raises(KvCacheError) as error:
            client.import_sequence("nope", "unix:/run/kvcached-prefill.sock")
        assert error.value.code == grpc.StatusCode.NOT_FOUND
        assert "ImportSequence('nope' from unix:/run/kvcached-prefill.sock)" in str(error.value)
        assert "has no sequence 'nope'" in error.value.message
        for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS):
            fake.failure = (code, f"the daemon said {code.name}")
            with pytest.raises(KvCacheError) as error:
                client.import_sequence("x", "127.0.0.1:1")
            assert error.value.code == code
            assert f"the daemon said {code.name}" in error.value.message


def test_import_timeout_overrides_the_clients(fake):
    fake.offers["slow"] = imported_response("slow")
    fake.delay = 1.0
    with KvCacheClient(fake.address, timeout=30) as client:
        started = time.monotonic()
        with pytest.raises(KvCacheError) as error:
            client.import_sequence("slow", "127.0.0.1:1", timeout=0.2)
        assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 0.9


def test_a_batch_tracks_an_imported_sequence_from_its_next_step(fake):
    fake.offers["h"] = imported_response("h", last_step=1, ranks=0)
    with KvCacheClient(fake.address, timeout=10) as client, client.batch() as batch:
        result = batch.import_sequence("h", "127.0.0.1:9")
        tracked = batch.sequences["h"]
        assert result.state.last_step == 1
        assert (tracked.next_step, tracked.cache_size) == (2, 5)
        assert tracked.positions == [0, 1, 5, 9, 40] and tracked.score_dtype == "float16"
        decision = batch.step({"h": [[0.25] * 6]})["h"].raise_for_status()
        assert decision.step == 2
    assert fake.batches[-1].reports[0].step == 2


def test_a_failed_import_tracks_nothing(fake):
    with KvCacheClient(fake.address, timeout=10) as client, client.batch() as batch:
        with pytest.raises(KvCacheError):
            batch.import_sequence("missing", "127.0.0.1:9")
        assert "missing" not in batch


class _FakeMapping:
    """What PooledKvCache reads of a KvPoolMapping: one rank's blocks in a tensor."""

    def __init__(self, torch, rank=0, blocks=4, layers=2, tpb=4, heads=1, dim=3):
        self.rank = rank
        self.tokens_per_block = tpb
        self.pool = SimpleNamespace(layers=layers, capacity_blocks=blocks, rank=rank)
        self.blocks = torch.arange(blocks * layers * 2 * tpb * heads * dim,
                                   dtype=torch.float32).view(blocks, layers, 2, tpb, heads, dim)


def test_pooled_cache_adopts_the_imported_slot_table():
    torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")
    from kvcache_client.torch import PooledKvCache
    mapping = _FakeMapping(torch, rank=1)
    response = imported_response(positions=(0, 2, 41), last_step=2, ranks=2)
    response.state.kv_slots[1].slots[:] = [13, 2, 7]
    result = ImportedSequence.from_proto(response)
    cache = PooledKvCache.adopt(mapping, result)
    assert cache.positions == [0, 2, 41] and cache.slots == [13, 2, 7]
    assert cache.next_position == 40 + 2  # the token of step 3
    want = torch.stack([mapping.blocks[s // 4, 1, 0, s % 4] for s in (13, 2, 7)], dim=1)
    assert torch.equal(cache.keys(1), want)
    # the state alone works too
    assert PooledKvCache.adopt(mapping, result.state).slots == [13, 2, 7]
    # the next step goes on from there: the new token lands where the decision says
    for layer in range(2):
        cache.extend(layer, torch.full((1, 3), -1.0), torch.full((1, 3), -2.0))
    change = SimpleNamespace(rank=1, new_token_slot=5, moves=[(13, 3)], released_blocks=[])
    cache.apply(SimpleNamespace(ok=True, step=3, evicted=[2], cache_size=3,
                                kv_changes=[change]))
    assert cache.positions == [0, 41, 42] and cache.slots == [3, 7, 5]
    assert torch.equal(mapping.blocks[1, 0, 0, 1], torch.full((1, 3), -1.0))


def test_pooled_cache_refuses_an_import_it_cannot_hold():
    torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")
    from kvcache_client.torch import PooledKvCache
    mapping = _FakeMapping(torch, rank=0, blocks=2, tpb=4)  # 8 slots
    with pytest.raises(ValueError, match="outside"):
        PooledKvCache.adopt(mapping, ImportedSequence.from_proto(imported_response(ranks=1)))
    with pytest.raises(ValueError, match="no slots on rank 0"):
        PooledKvCache.adopt(mapping, ImportedSequence.from_proto(imported_response(ranks=0)))
