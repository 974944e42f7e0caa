"""The golden vectors replayed through the client against a real kvcached. float32 must
match exactly; float16 and bfloat16 must decide exactly as float32 does on the rounded
values (and, the goldens being far from ties, still match them); two tensor-parallel ranks
(threads, a stream each) must match exactly too; and every input kind must give the same
decisions. Both transports: scores inline in the StepBatch, and through a shared-memory
score region (a daemon run with --allow_shm_scores)."""

import struct
import threading
from array import array
from typing import Any, Dict, List, NamedTuple

import pytest

from kvcache_client import KvCacheClient, Scores, encode_scores
from golden import (NAMES, SPAN_POOL_DIR, SPAN_POOL_NAMES, Trace, load, quantize, replay,
                    scale)

try:
    import numpy as np
except ImportError:  # pragma: no cover - scripts/install-deps.sh installs it
    np = None

REGION_BYTES = 1 << 18  # every golden's step together needs about 52 KiB


class Transport(NamedTuple):
    name: str
    client: KvCacheClient
    options: Dict[str, Any]  # for client.batch()

    def batch(self, **options):
        return self.client.batch(**self.options, **options)

    def check(self, batch) -> None:
        """Through a region, every report that carried scores went through it."""
        region = batch.score_region
        if self.name == "inline":
            assert region is None
        else:
            assert region is not None and region.inline_reports == 0
            assert region.region_reports > 0


@pytest.fixture(params=["inline", "shm", "created"])
def transport(request):
    """inline scores; a region this process made (shm); one the daemon made (created)."""
    if request.param == "inline":
        return Transport("inline", request.getfixturevalue("client"), {})
    options = {"score_region_bytes": REGION_BYTES}
    if request.param == "created":
        options["daemon_score_region"] = True
    return Transport(request.param, request.getfixturevalue("shm_client"), options)


def open_all(batch, seq_id, traces: List[Trace], **options) -> Dict[str, Trace]:
    by_id = {}
    for trace in traces:
        sid = seq_id(trace.name)
        batch.open(sid, **trace.open_options(), **options)
        by_id[sid] = trace
    return by_id


def assert_matches(got: Dict[str, List[Dict[str, Any]]], by_id: Dict[str, Trace]) -> None:
    for sid, trace in by_id.items():
        for want, have in zip(trace.expected, got[sid]):
            assert have == want, f"{trace.name} step {want['step']}"
        assert len(got[sid]) == len(trace.expected), trace.name


@pytest.mark.parametrize("name", NAMES)
def test_golden_float32(transport, seq_id, name):
    with transport.batch() as batch:
        by_id = open_all(batch, seq_id, [load(name)])
        assert_matches(replay(batch, by_id), by_id)
        for sid in by_id:
            stats = batch.close_sequence(sid)
            assert stats.steps == len(by_id[sid].steps)
        scored = sum("layers" in step for step in load(name).steps)
        if transport.name != "inline":
            assert (batch.score_region.region_reports, batch.score_region.inline_reports) == (
                scored, 0)


def test_span_pool_goldens_in_one_batch(transport, seq_id):
    """SPEC.md "Span pooling": the policy's span_pool crosses the client and the wire, and
    the daemon decides as the float64 model did."""
    traces = [load(n, SPAN_POOL_DIR) for n in SPAN_POOL_NAMES]
    assert len(traces) >= 6 and all(t.header["policy"]["span_pool"] > 1 for t in traces)
    with transport.batch() as batch:
        by_id = open_all(batch, seq_id, traces)
        for sid, trace in by_id.items():
            assert transport.client.inspect(sid).policy.span_pool == trace.header["policy"][
                "span_pool"]
        assert_matches(replay(batch, by_id), by_id)


def test_all_goldens_in_one_batch(transport, seq_id):
    with transport.batch() as batch:
        by_id = open_all(batch, seq_id, [load(n) for n in NAMES])
        assert_matches(replay(batch, by_id), by_id)
        transport.check(batch)


def test_a_region_too_small_for_a_step_sends_the_rest_inline_and_still_matches(shm_client,
                                                                               seq_id):
    with shm_client.batch(score_region_bytes=12 << 10) as batch:
        by_id = open_all(batch, seq_id, [load(n) for n in NAMES])
        assert_matches(replay(batch, by_id), by_id)
        region = batch.score_region
        assert region.region_reports > 0 and region.inline_reports > 0
        assert region.high_water_bytes <= 12 << 10


# The same values, exactly representable in the narrow dtype, sent three ways.
def _rounded(dtype):
    return lambda layers, index: quantize(layers, dtype)


def _float16_inputs(layers, index):  # rotate through the kinds that carry float16
    rows = quantize(layers, "float16")
    raw = b"".join(struct.pack(f"<{len(r)}e", *r) for r in rows)
    kind = index % 4
    if kind == 0:
        return Scores(rows, dtype="float16")                       # Python floats
    if kind == 1:
        return Scores(memoryview(raw), dtype="float16", layers=len(rows))
    if kind == 2:                                                          # 2-D byte view
        return Scores(memoryview(raw).cast("B", (len(rows), len(raw) // len(rows))),
                             dtype="float16")
    return Scores(array("H", raw), dtype="float16", layers=len(rows))  # 16-bit bits


def _bfloat16_inputs(layers, index):
    raw = encode_scores(layers, dtype="bfloat16").data
    if index % 2:
        return Scores(raw, dtype="bfloat16", layers=len(layers))     # raw bytes
    return Scores(layers, dtype="bfloat16")                          # converted here


@pytest.mark.parametrize("dtype, inputs", [("float16", _float16_inputs),
                                           ("bfloat16", _bfloat16_inputs)])
def test_narrow_dtypes_decide_as_float32_on_the_rounded_scores(client, seq_id, dtype, inputs):
    traces = [load(n) for n in NAMES]
    with client.batch() as batch:
        reference = open_all(batch, seq_id, traces)
        narrow = open_all(batch, seq_id, traces)
        want = replay(batch, reference, _rounded(dtype))
        got = replay(batch, narrow, inputs)
    for (ref_id, trace), narrow_id in zip(reference.items(), narrow):
        assert got[narrow_id] == want[ref_id], f"{trace.name} through {dtype}"


def test_float16_as_the_sequence_dtype(client, seq_id):
    trace = load("ema_every_step")
    with client.batch() as batch:
        reference = open_all(batch, seq_id, [trace])
        narrow = open_all(batch, seq_id, [trace], score_dtype="float16")
        assert batch.sequences[next(iter(narrow))].score_dtype == "float16"
        want = replay(batch, reference, _rounded("float16"))
        # Python floats and raw bytes without a dtype take the sequence's float16.
        got = replay(batch, narrow, lambda layers, i: layers if i % 2 else b"".join(
            struct.pack(f"<{len(r)}e", *r) for r in layers))
    assert list(got.values()) == list(want.values())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_dtypes_still_match_the_goldens(transport, seq_id, dtype):
    """Rounding moves scores by up to 2^-11 (float16) or 2^-8 (bfloat16) relative; the
    goldens' eviction boundaries are far enough from ties that every golden still matches."""
    with transport.batch() as batch:
        by_id = open_all(batch, seq_id, [load(n) for n in NAMES])
        assert_matches(replay(batch, by_id, dtype=dtype), by_id)
        transport.check(batch)


# Every input kind of float32, rotating step by step, must match the golden exactly.
def _float32_inputs(layers, index):
    flat = [v for row in layers for v in row]
    packed = array("f", flat)
    raw = packed.tobytes()
    kinds = [
        lambda: layers,                                                      # nested lists
        lambda: tuple(tuple(r) for r in layers),
        lambda: packed,                                # flat array('f'): layers from the cache
        lambda: Scores(packed, layers=len(layers)),
        lambda: [array("f", r) for r in layers],                             # rows of arrays
        lambda: memoryview(raw).cast("f", (len(layers), len(layers[0]))),    # 2-D view
        lambda: raw,                                           # bytes: the sequence's float32
        lambda: bytearray(raw),
        lambda: Scores(memoryview(raw), dtype="float32", layers=len(layers)),
        lambda: flat,                                         # flat list: layers from the cache
        lambda: array("d", flat),                             # float64, converted
    ]
    if np is not None:
        kinds += [
            lambda: np.array(layers, dtype=np.float32),                      # [layers, tokens]
            lambda: np.array(layers, dtype=np.float64),                      # converted
            lambda: np.asfortranarray(np.array(layers, dtype=np.float32)),   # strided
            lambda: np.array(flat, dtype=np.float32),          # flat: layers from the cache
        ]
    return kinds[index % len(kinds)]()


@pytest.mark.parametrize("name", ["ema_every_step", "shift_protected", "ema_lazy4"])
def test_every_float32_input_kind_matches_the_golden(transport, seq_id, name):
    with transport.batch() as batch:
        by_id = open_all(batch, seq_id, [load(name)])
        assert_matches(replay(batch, by_id, _float32_inputs), by_id)
        transport.check(batch)


def test_tensor_parallel_ranks_match_the_goldens(transport, seq_id):
    """Two ranks, a thread and a stream each (and a score region each, for shm); rank p
    holds h_p = 1 + p % 2 heads and sends its rows times h_p (its heads' sum), so the joined
    scores are the golden's."""
    client = transport.client
    traces = [load(n) for n in NAMES]
    world = 2
    by_id = {}
    for trace in traces:
        sid = seq_id(trace.name)
        client.open_sequence(sid, **trace.open_options(), tp_world_size=world)
        by_id[sid] = trace
    results: Dict[int, Dict[str, List[Dict[str, Any]]]] = {}
    errors: List[BaseException] = []

    def run_rank(rank: int) -> None:
        heads = 1 + rank % 2
        try:
            with transport.batch(rank=rank, head_count=heads, timeout=60) as batch:
                for sid in by_id:
                    batch.add(sid)
                results[rank] = replay(batch, by_id, lambda layers, i: scale(layers, heads))
                transport.check(batch)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run_rank, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    for rank in range(world):
        assert_matches(results[rank], by_id)
    for sid, trace in by_id.items():
        state = client.inspect(sid)
        assert (state.tp_world_size, state.last_step) == (world, len(trace.steps))
