"""Rejections from a real kvcached: the right gRPC code, a message naming the sequence (and
the step), and neither the stream nor the other sequences of the batch disturbed."""

import concurrent.futures
import struct
import time

import grpc
import pytest

from golden import load
from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import KvCacheError, Policy, Report, StepError

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def pair(client, seq_id):
    """A batch with two sequences of the ema_every_step golden; yields (batch, a, b, trace)."""
    trace = load("ema_every_step")
    with client.batch() as batch:
        a, b = seq_id("a"), seq_id("b")
        for sid in (a, b):
            batch.open(sid, **trace.open_options())
        yield batch, a, b, trace


def first_layers(trace):
    return trace.steps[0]["layers"]


def assert_golden_step(decision, trace, index):
    want = trace.expected[index]
    assert (decision.step, decision.evicted, decision.cache_size,
            decision.next_needs_scores) == (want["step"], want["evicted"], want["cache_size"],
                                            want["next_needs_scores"])


@pytest.mark.parametrize("bad, code, words", [
    (lambda layers: [row[:-1] for row in layers], INVALID,
     ["scores cover 256 tokens per layer", "holds 257"]),
    (lambda layers: [[-1.0] + row[1:] for row in layers], INVALID,
     ["is -1", "finite and >= 0"]),
    (lambda layers: [[float("nan")] + row[1:] for row in layers], INVALID, ["nan"]),
    (lambda layers: None, INVALID, ["carries no layer scores"]),
], ids=["wrong_length", "negative", "nan", "missing"])
def test_bad_scores_fail_only_their_own_decision(client, pair, bad, code, words):
    batch, a, b, trace = pair
    stream = client.stream()  # the raw path: the daemon judges what the batch would refuse
    good_a = Report(a, 1, first_layers(trace))
    bad_b = Report(b, 1, bad(first_layers(trace)))
    decision_a, decision_b = stream.send([good_a, bad_b])
    assert decision_a.ok
    assert_golden_step(decision_a, trace, 0)
    assert decision_b.code == code
    assert f"sequence '{b}' step 1" in decision_b.message
    for word in words:
        assert word in decision_b.message
    # Nothing changed for b: the same step, right this time, on the same stream.
    assert_golden_step(stream.send([Report(b, 1, first_layers(trace))])[0].raise_for_status(),
                       trace, 0)
    stream.close()


def test_negative_scores_through_the_batch_raise_when_asked(pair):
    batch, a, b, trace = pair
    layers = first_layers(trace)
    with pytest.raises(StepError) as caught:
        batch.step({a: layers, b: [[-0.5] + row[1:] for row in layers]}, raise_on_error=True)
    error = caught.value
    assert (error.sequence_id, error.step, error.code) == (b, 1, INVALID)
    assert f"sequence {b!r} step 1 rejected (INVALID_ARGUMENT)" in str(error)
    assert error.decisions[a].ok and batch.sequences[a].last_step == 1
    assert batch.sequences[b].last_step == 0
    assert_golden_step(batch.step({b: layers})[b].raise_for_status(), trace, 0)
    assert_golden_step(batch.step({a: trace.steps[1]["layers"]})[a], trace, 1)


def test_wrong_sizes_through_the_batch_are_refused_before_sending(pair):
    batch, a, b, trace = pair
    layers = first_layers(trace)
    decisions = batch.step({a: layers, b: [row[:-1] for row in layers]})
    assert decisions[a].ok
    refused = decisions[b]
    assert refused.code == INVALID and f"sequence {b!r} step 1" in refused.message
    assert "256 per layer; the step needs 257" in refused.message
    assert_golden_step(batch.step({b: layers})[b], trace, 0)


def test_bad_byte_counts_and_dtypes(client, pair):
    batch, a, b, trace = pair
    stream = client.stream()
    reports = [
        pb.StepReport(sequence_id=b, step=1, scores=bytes(7), layers=1,
                      dtype=pb.SCORE_DTYPE_FLOAT32),
        pb.StepReport(sequence_id=b, step=1, scores=bytes(257 * 2 * 4 + 2), layers=4,
                      dtype=pb.SCORE_DTYPE_FLOAT16),
        pb.StepReport(sequence_id=b, step=1, scores=bytes(257 * 4), layers=1, dtype=7),
        pb.StepReport(sequence_id=b, step=1, scores=bytes(257 * 4), layers=0),
    ]
    messages = ["7 bytes", "float16", "unknown score dtype 7", "layers is 0"]
    for report, words in zip(reports, messages):
        decision = stream.send([report])[0]
        assert decision.code == INVALID and f"sequence '{b}' step 1" in decision.message
        assert words in decision.message
    # The client refuses the same before sending.
    refused = batch.step({b: bytes(7)})[b]
    assert refused.code == INVALID and "not a whole number of 4-byte" in refused.message
    assert stream.send([Report(a, 1, first_layers(trace))])[0].ok
    stream.close()


def test_unknown_sequence(client, pair, seq_id):
    batch, a, b, trace = pair
    ghost = seq_id("ghost")
    with client.stream() as stream:
        unknown, known = stream.send([Report(ghost, 1), Report(a, 1, first_layers(trace))])
        assert unknown.code == grpc.StatusCode.NOT_FOUND and ghost in unknown.message
        assert (unknown.sequence_id, unknown.step) == (ghost, 1)
        assert known.ok
    assert client.step([Report(ghost, 4)])[0].code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(KvCacheError) as caught:
        client.inspect(ghost)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND and ghost in caught.value.message
    with pytest.raises(KvCacheError) as caught:
        client.close_sequence(ghost)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_a_sequence_closed_elsewhere_fails_only_its_own_step(client, pair):
    batch, a, b, trace = pair
    client.close_sequence(b)
    decisions = batch.step({a: first_layers(trace), b: first_layers(trace)})
    assert decisions[a].ok
    gone = decisions[b]
    assert gone.code == grpc.StatusCode.NOT_FOUND and b in gone.message and gone.step == 1
    with pytest.raises(StepError, match=f"sequence {b!r} step 1 rejected \\(NOT_FOUND\\)"):
        gone.raise_for_status()
    batch.remove(b)
    assert batch.step({a: trace.steps[1]["layers"]})[a].ok


def test_out_of_order_steps(client, pair):
    batch, a, b, trace = pair
    with client.stream() as stream:
        for step in (0, 2, 5):
            late = stream.send([Report(a, step, first_layers(trace))])[0]
            assert late.code == grpc.StatusCode.FAILED_PRECONDITION
            assert f"'{a}'" in late.message and f"step {step} is out of order" in late.message
            assert "expected step 1" in late.message
        assert stream.send([Report(a, 1, first_layers(trace))])[0].ok
        again = stream.send([Report(a, 1, first_layers(trace))])[0]
        assert again.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "expected step 2" in again.message


def test_duplicate_open(client, seq_id):
    sid = seq_id()
    client.open_sequence(sid, 16, budget_tokens=8)
    with pytest.raises(KvCacheError) as caught:
        client.open_sequence(sid, 16, budget_tokens=8)
    assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert f"'{sid}' is already open" in caught.value.message
    client.close_sequence(sid)
    client.open_sequence(sid, 16, budget_tokens=8)  # closed ids may be opened again


@pytest.mark.parametrize("options, words", [
    ({"budget_tokens": 8, "policy": Policy(alpha=1.0)}, "alpha"),
    ({"budget_tokens": 8, "policy": Policy(refresh="lazy", refresh_interval=0)},
     "refresh_interval"),
    ({"budget_tokens": 8, "policy": "no_such_preset"}, "unknown policy preset 'no_such_preset'"),
    ({"budget_tokens": 4, "policy": Policy(protect_sinks=3, protect_recent=2)}, "budget"),
    ({"budget_tokens": 0}, "budget_tokens"),
    ({"compression_ratio": 1.0}, "compression_ratio"),
    ({}, "exactly one of budget_tokens and compression_ratio"),
    ({"budget_tokens": 8, "tp_world_size": 100000}, "tp_world_size"),
], ids=["alpha", "interval", "preset", "protection", "budget", "ratio", "no_budget", "world"])
def test_invalid_registrations(client, seq_id, options, words):
    sid = seq_id()
    with pytest.raises(KvCacheError) as caught:
        client.open_sequence(sid, 16, **options)
    assert caught.value.code == INVALID
    assert sid in caught.value.message and words in caught.value.message
    assert sid not in {s.sequence_id for s in client.list_sequences()}


def test_policy_names_the_api_has_no_value_for_are_refused_here(client, seq_id):
    with pytest.raises(ValueError, match="aggregation 'lfu'"):
        client.open_sequence(seq_id(), 16, budget_tokens=8, policy={"aggregation": "lfu"})


def test_tensor_parallel_report_errors(client, seq_id):
    scores = [[0.1] * 5]
    cases = [
        (0, lambda sid: Report(sid, 1, scores, head_count=0), "head_count is 0"),
        (2, lambda sid: Report(sid, 1, scores, head_count=1), "outside the tensor-parallel world"),
        (1, lambda sid: Report(sid, 1, None, head_count=1), "carries no partial sums"),
    ]
    for rank, report, words in cases:
        sid = seq_id("tp")  # a rejected step stays rejected for the other ranks: fresh each
        client.open_sequence(sid, 4, budget_tokens=2, tp_world_size=2)
        with client.stream(rank=rank, timeout=10) as stream:
            decision = stream.send([report(sid)])[0]
        assert decision.code == INVALID, words
        assert f"sequence '{sid}' step 1 rank {rank}" in decision.message
        assert words in decision.message
        assert client.inspect(sid).ranks_reported == 0


def test_a_rejected_rank_rejects_the_step_on_every_rank(client, seq_id):
    sid = seq_id("tp")
    client.open_sequence(sid, 4, budget_tokens=2, tp_world_size=2)
    good = [[0.1] * 5]

    def rank0_waits(stream):
        future = pool.submit(stream.send, [Report(sid, 1, good, head_count=1)])
        deadline = time.monotonic() + 10
        while client.inspect(sid).ranks_reported < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.inspect(sid).ranks_reported == 1
        return future

    with concurrent.futures.ThreadPoolExecutor(1) as pool, \
            client.stream(rank=0, timeout=10) as rank0, client.stream(rank=1, timeout=10) as rank1:
        waiting = rank0_waits(rank0)
        refused = rank1.send([Report(sid, 1, [[-1.0] * 5], head_count=1)])[0]
        waited = waiting.result(timeout=10)[0]
        # The waiting rank is told at once, with the same code and message.
        assert refused.code == INVALID and "partial sum" in refused.message
        assert (waited.code, waited.message) == (refused.code, refused.message)
        assert client.inspect(sid).ranks_reported == 0
        # Nothing changed: both ranks send the step again and it is decided.
        waiting = rank0_waits(rank0)
        decided = rank1.send([Report(sid, 1, good, head_count=1)])[0]
        assert decided.ok and waiting.result(timeout=10)[0].evicted == decided.evicted
    assert client.inspect(sid).last_step == 1


def test_scores_on_a_step_that_needs_none_are_ignored_and_counted(client, seq_id):
    trace = load("score_free")
    sid = seq_id()
    with client.batch() as batch:
        batch.open(sid, **trace.open_options())
        batch.step({sid: first_layers(trace)})[sid].raise_for_status()
        assert not batch.needs_scores(sid)
        tokens = batch.sequences[sid].tokens
        decision = batch.step({sid: [[0.5] * tokens] * 2})[sid]  # nobody needs them
        assert decision.ok
        assert_golden_step(decision, trace, 1)
        stats = batch.close_sequence(sid)
    assert (stats.steps, stats.scoring_steps, stats.ignored_score_reports) == (2, 1, 1)
    assert stats.skipped_scoring_steps == 1


def test_float16_bytes_of_the_wrong_size_name_the_dtype(client, seq_id):
    sid = seq_id()
    with client.batch() as batch:
        batch.open(sid, 4, budget_tokens=2, score_dtype="float16")
        raw = struct.pack("<4e", 0.1, 0.1, 0.1, 0.1)  # 4 scores; the step needs 5
        refused = batch.step({sid: raw})[sid]
        assert refused.code == INVALID and "no whole number of layers of 5" in refused.message
        assert batch.step({sid: raw + struct.pack("<e", 0.1)})[sid].ok
