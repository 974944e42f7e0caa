"""Decision encodings on a real kvcached: every golden vector decided with MASK and AUTO
gives exactly the golden evicted sets; at every step the keep mask and the evicted
positions agree, whichever form travelled; AUTO sends the mask on the first step of a long
prefill and positions on a steady step (the raw messages say so); the encoding is reported
and an unknown one refused."""

import grpc
import pytest

from golden import NAMES, as_dict, load
from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import KvCacheError

ENCODINGS = ["positions", "mask", "auto"]


def dropped(cache_before, keep):
    return [p for p, k in zip(cache_before, keep) if not k]


def test_every_golden_decides_the_same_with_every_encoding(client, seq_id):
    traces = [load(n) for n in NAMES]
    with client.batch() as batch:
        opened = {}  # id -> (trace, encoding)
        for trace in traces:
            for encoding in ENCODINGS:
                sid = seq_id(f"{trace.name}-{encoding}")
                state = batch.open(sid, **trace.open_options(), decision_encoding=encoding)
                assert state.decision_encoding == encoding
                assert batch.sequences[sid].decision_encoding == encoding
                opened[sid] = (trace, encoding)
        travelled = {encoding: set() for encoding in ENCODINGS}
        for index in range(max(len(t.steps) for t in traces)):
            scores, before = {}, {}
            for sid, (trace, _) in opened.items():
                if index < len(trace.steps):
                    scores[sid] = trace.steps[index].get("layers")
                    tracked = batch.sequences[sid]
                    before[sid] = tracked.positions + [tracked.prefill_len + index]
            for sid, decision in batch.step(scores).items():
                trace, encoding = opened[sid]
                decision.raise_for_status()
                assert as_dict(decision) == trace.expected[index], (
                    f"{trace.name} with {encoding}, step {index + 1}")
                keep = decision.keep_mask()
                assert len(keep) == decision.tokens_before == len(before[sid])
                assert dropped(before[sid], keep) == decision.evicted
                travelled[encoding].add(decision.encoding)
        assert travelled == {"positions": {"positions"}, "mask": {"mask"},
                             "auto": {"positions", "mask"}}
        for sid in opened:  # the tracked cache is the daemon's
            assert batch.sequences[sid].positions == client.inspect(
                sid, include_cache=True).positions


def raw_step(client, sid, step):
    """One step through the unary Step RPC: the Decision message as it travelled."""
    reply = client._stub.Step(pb.StepBatch(reports=[pb.StepReport(sequence_id=sid, step=step)]),
                              timeout=30)
    (decision,) = reply.decisions
    assert decision.code == 0, decision.message
    return decision


def test_auto_sends_a_mask_for_a_long_prefill_and_positions_when_steady(client, seq_id):
    prefill = 64000
    auto, positions = seq_id("auto"), seq_id("positions")
    for sid, encoding in ((auto, "auto"), (positions, "positions")):
        client.open_sequence(sid, prefill, compression_ratio=0.9, policy="streaming_llm",
                             decision_encoding=encoding)
    first = raw_step(client, auto, 1)
    assert first.mask_tokens == prefill + 1 and len(first.evicted_mask) == 8001
    assert len(first.evicted) == 0 and first.cache_size == 6400
    reference = raw_step(client, positions, 1)
    assert len(reference.evicted) == prefill + 1 - 6400 and reference.mask_tokens == 0
    assert first.ByteSize() * 15 < reference.ByteSize()
    steady = raw_step(client, auto, 2)
    assert steady.mask_tokens == 0 and not steady.evicted_mask
    assert list(steady.evicted) == list(raw_step(client, positions, 2).evicted)
    assert len(steady.evicted) == 1


@pytest.mark.parametrize("encoding", ["mask", "auto"])
def test_a_long_prefill_gives_both_forms_through_the_batch(client, seq_id, encoding):
    prefill = 20000
    with client.batch() as batch:
        sid, twin = seq_id(encoding), seq_id("positions")
        for s, e in ((sid, encoding), (twin, "positions")):
            batch.open(s, prefill, compression_ratio=0.9, policy="streaming_llm",
                       decision_encoding=e)
        for step in range(1, 4):
            before = batch.sequences[sid].positions + [prefill + step - 1]
            got = batch.step({sid: None, twin: None})
            decision = got[sid].raise_for_status()
            assert decision.evicted == got[twin].evicted
            assert decision.encoding == ("mask" if step == 1 or encoding == "mask"
                                         else "positions")
            assert dropped(before, decision.keep_mask()) == decision.evicted
            assert dropped(before, got[twin].keep_mask()) == decision.evicted


def test_a_raw_stream_mask_decision_has_its_keep_mask_and_positions_with_the_cache(
        client, seq_id):
    sid = seq_id()
    client.open_sequence(sid, 10, budget_tokens=4, policy="streaming_llm",
                         decision_encoding="mask")
    (decision,) = client.step([pb.StepReport(sequence_id=sid, step=1)])
    assert decision.encoding == "mask" and decision.evicted is None
    keep = decision.keep_mask()
    cache = list(range(11))
    assert decision.with_cache(cache).evicted == dropped(cache, keep)


def test_add_resynchronizes_the_tracked_cache_mid_run(client, seq_id):
    trace = load("ema_every_step")
    sid = seq_id()
    with client.batch() as first:
        first.open(sid, **trace.open_options(), decision_encoding="mask")
        for index in range(3):
            first.step({sid: trace.steps[index].get("layers")})[sid].raise_for_status()
    with client.batch() as second:
        tracked = second.add(sid)  # a state past step 0: its positions come from inspect
        assert tracked.positions == client.inspect(sid, include_cache=True).positions
        for index in range(3, len(trace.steps)):
            decision = second.step({sid: trace.steps[index].get("layers")})[sid]
            assert as_dict(decision.raise_for_status()) == trace.expected[index]


def test_an_unknown_encoding_is_refused_naming_the_field(client, seq_id):
    sid = seq_id()
    with pytest.raises(grpc.RpcError) as error:
        client._stub.OpenSequence(pb.OpenSequenceRequest(
            sequence_id=sid, prefill_len=10, budget_tokens=4, decision_encoding=9), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "decision_encoding 9" in error.value.details()
    with pytest.raises(ValueError, match="unknown decision encoding"):
        client.open_sequence(sid, 10, budget_tokens=4, decision_encoding="bitmap")
    with pytest.raises(KvCacheError):
        client.inspect(sid)  # nothing was opened
    assert client.open_sequence(sid, 10, budget_tokens=4).decision_encoding == "positions"
    assert client.inspect(sid).decision_encoding == "positions"
