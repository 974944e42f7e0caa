"""Sequences on a real kvcached: registration, snapshots, statistics, the unary step, and the
daemon's limits (--max_sequences, --idle_timeout, --max_message_bytes) and SIGTERM."""

import time

import grpc
import pytest

from golden import as_dict, load
from kvcache_client import KvCacheClient, KvCacheError, Policy, Report


def test_open_returns_the_resolved_state(client, seq_id):
    sid = seq_id()
    state = client.open_sequence(sid, 256, compression_ratio=0.9, policy="h2o",
                                 score_dtype="bfloat16")
    assert (state.sequence_id, state.prefill_len, state.budget) == (sid, 256, 25)
    assert (state.cache_size, state.last_step, state.next_step) == (256, 0, 1)
    assert state.next_needs_scores and state.score_dtype == "bfloat16"
    assert state.policy.preset == "h2o" and state.policy.aggregation == "cumulative"
    assert state.policy.protect_recent == 12  # B / 2
    assert state.stats.steps == 0 and state.tp_world_size == 1


def test_score_free_policy_needs_scores_only_at_step_one(client, seq_id):
    sid = seq_id()
    state = client.open_sequence(sid, 64, budget_tokens=8, policy=Policy(refresh="score_free"))
    assert state.next_needs_scores
    with client.batch() as batch:
        batch.add(sid)
        assert not batch.step({sid: [[1.0] * 65]})[sid].next_needs_scores
        for _ in range(3):
            assert not batch.needs_scores()
            assert batch.step({sid: None})[sid].raise_for_status().cache_size == 8


def test_inspect_list_and_close_follow_the_steps(client, seq_id):
    trace = load("ema_lazy4")
    sid = seq_id()
    with client.batch() as batch:
        batch.open(sid, **trace.open_options())
        evicted = set()
        for step in trace.steps:
            decision = batch.step({sid: step.get("layers")})[sid].raise_for_status()
            evicted.update(decision.evicted)
        state = client.inspect(sid, include_cache=True)
        assert state.last_step == len(trace.steps) and state.cache_size == 50
        assert len(state.positions) == len(state.momentum) == state.cache_size
        assert state.positions == sorted(state.positions)
        seen = set(range(trace.header["prefill_len"] + len(trace.steps)))
        assert set(state.positions) == seen - evicted
        assert client.inspect(sid).positions == []  # only when asked
        assert sid in {s.sequence_id for s in client.list_sequences()}
        stats = batch.close_sequence(sid)
    assert sid not in batch
    assert stats.steps == len(trace.steps) and stats.tokens_evicted == len(evicted)
    assert stats.scoring_steps == 12 and stats.skipped_scoring_steps == 36
    assert sid not in {s.sequence_id for s in client.list_sequences()}


def test_unary_step_replays_a_golden(client, seq_id):
    trace = load("cumulative_recent")
    sid = seq_id()
    client.open_sequence(sid, **trace.open_options())
    got = []
    for step in trace.steps:
        (decision,) = client.step([Report(sid, step["step"], step.get("layers"))])
        got.append(as_dict(decision.raise_for_status()))
    assert got == trace.expected


def test_a_new_batch_resumes_where_another_left(client, seq_id):
    trace = load("single_step")
    sid = seq_id()
    with client.batch() as first:
        first.open(sid, **trace.open_options())
        for step in trace.steps[:5]:
            first.step({sid: step["layers"]})[sid].raise_for_status()
    with client.batch() as second:
        assert second.add(sid).next_step == 6
        decision = second.step({sid: trace.steps[5]["layers"]})[sid]
        assert as_dict(decision) == trace.expected[5]


def test_wait_ready(kvcached):
    with KvCacheClient(kvcached.address) as client:
        client.wait_ready(10)


def test_max_sequences(start_daemon, seq_id):
    daemon = start_daemon("--max_sequences=2")
    with KvCacheClient(daemon.address, timeout=10) as client:
        ids = [seq_id(str(i)) for i in range(3)]
        for sid in ids[:2]:
            client.open_sequence(sid, 8, budget_tokens=4)
        with pytest.raises(KvCacheError) as caught:
            client.open_sequence(ids[2], 8, budget_tokens=4)
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ids[2] in caught.value.message and "2" in caught.value.message
        client.close_sequence(ids[0])
        client.open_sequence(ids[2], 8, budget_tokens=4)
    assert daemon.terminate() == 0


def test_idle_sequences_are_closed(start_daemon, seq_id):
    daemon = start_daemon("--idle_timeout=1s")
    with KvCacheClient(daemon.address, timeout=10) as client, client.batch() as batch:
        sid = seq_id()
        batch.open(sid, 8, budget_tokens=4, policy="streaming_llm")
        deadline = time.monotonic() + 15
        while sid in {s.sequence_id for s in client.list_sequences()}:
            assert time.monotonic() < deadline, "not reclaimed 15 s after a 1 s idle timeout"
            time.sleep(0.2)
        gone = batch.step({sid: None})[sid]
        assert gone.code == grpc.StatusCode.NOT_FOUND and sid in gone.message
    assert daemon.terminate() == 0


def test_oversized_batches_fail_the_stream_not_the_daemon(start_daemon, seq_id):
    daemon = start_daemon("--max_message_bytes=65536")
    sid = seq_id()
    big = [[0.5] * 4097] * 8  # 8 layers x 4097 float32: 131 KB
    with KvCacheClient(daemon.address, timeout=10) as client:
        client.open_sequence(sid, 4096, budget_tokens=64)
        with client.batch() as batch:
            batch.add(sid)
            with pytest.raises(KvCacheError) as caught:
                batch.step({sid: big})
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(KvCacheError):  # the stream stays failed
                batch.step({sid: big[:1]})
        with pytest.raises(KvCacheError) as caught:
            client.step([Report(sid, 1, big)])
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with client.batch() as fresh:  # a new stream, small enough, works
            fresh.add(sid)
            assert fresh.step({sid: big[:1]})[sid].ok
    assert daemon.terminate() == 0


def test_sigterm_drains_and_exits_zero(start_daemon, seq_id):
    daemon = start_daemon("--drain_deadline=2s")
    sid = seq_id()
    with KvCacheClient(daemon.address, timeout=10) as client, client.batch() as batch:
        batch.open(sid, 8, budget_tokens=4)
        assert batch.step({sid: [[0.1] * 9]})[sid].ok
        started = time.monotonic()
        assert daemon.terminate(timeout=20) == 0
        assert time.monotonic() - started < 15
        with pytest.raises(KvCacheError) as caught:
            batch.step({sid: [[0.1] * 5]})
        assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
