"""The client's own logic against an in-process fake daemon: step numbering and tracking,
client-side rejections, what goes on the wire, stream failures and timeouts."""

import socket
import struct

import grpc
import pytest

from fake_kvcached import FakeServer
from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import KvCacheClient, KvCacheError, Report, Scores, StepError


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture
def fake_client(fake):
    with KvCacheClient(fake.address, timeout=10) as client:
        yield client


def test_batch_numbers_steps_and_tracks_cache_and_score_needs(fake, fake_client):
    with fake_client.batch() as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        batch.open("b", prefill_len=5, budget_tokens=2, score_dtype="float16")
        assert batch.needs_scores("a") and batch.sequences["a"].tokens == 4
        first = batch.step({"a": [[0.1] * 4], "b": [[0.1] * 6, [0.2] * 6]})
        assert [(d.sequence_id, d.step, d.ok, d.cache_size) for d in first.values()] == [
            ("a", 1, True, 4), ("b", 1, True, 6)]
        assert not batch.needs_scores()  # the fake needs scores on even steps only
        second = batch.step({"a": None})  # b does not step this time
        assert second["a"].step == 2 and batch.sequences["b"].next_step == 2
        assert batch.needs_scores("a") and not batch.needs_scores("b")

    reports = [r for b in fake.service.batches for r in b.reports]
    a1, b1, a2 = reports
    assert (a1.step, a1.layers, a1.dtype, len(a1.scores)) == (1, 1, pb.SCORE_DTYPE_FLOAT32, 16)
    # Python floats follow the sequence's score dtype.
    assert (b1.layers, b1.dtype, len(b1.scores)) == (2, pb.SCORE_DTYPE_FLOAT16, 24)
    assert (a2.step, a2.layers, a2.scores) == (2, 0, b"")
    assert [b.batch_id for b in fake.service.batches] == [1, 2]


def test_flat_scores_split_into_layers_by_the_cache_size(fake, fake_client):
    with fake_client.batch() as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        batch.step({"a": [0.5] * 12}).get("a").raise_for_status()  # 3 layers of 4
    assert fake.service.batches[0].reports[0].layers == 3


def test_wrong_sizes_are_rejected_here_without_failing_the_others(fake, fake_client):
    with fake_client.batch() as batch:
        batch.open("good", prefill_len=3, budget_tokens=2)
        batch.open("bad", prefill_len=3, budget_tokens=2)
        decisions = batch.step({"good": [[0.1] * 4], "bad": [[0.1] * 3]})
        bad = decisions["bad"]
        assert decisions["good"].ok and not bad.ok
        assert bad.code == grpc.StatusCode.INVALID_ARGUMENT and bad.step == 1
        assert "'bad' step 1" in bad.message and "needs 4" in bad.message
        assert "not sent" in bad.message
        assert bad.cache_size == 3 and bad.next_needs_scores
        assert [r.sequence_id for r in fake.service.batches[0].reports] == ["good"]
        # Nothing changed for it: the same step goes through once right.
        assert batch.step({"bad": [[0.1] * 4]})["bad"].step == 1


def test_missing_scores_on_a_scoring_step_are_rejected_here(fake, fake_client):
    with fake_client.batch() as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        decision = batch.step({"a": None})["a"]
        assert decision.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs scores (4 per layer)" in decision.message
        assert fake.service.batches == []


def test_raise_on_error_raises_step_error_with_every_decision(fake_client):
    with fake_client.batch() as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        batch.open("b", prefill_len=3, budget_tokens=2)
        with pytest.raises(StepError) as caught:
            batch.step({"a": [[0.1] * 4], "b": [[0.1]]}, raise_on_error=True)
        error = caught.value
        assert (error.sequence_id, error.step) == ("b", 1)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert str(error).startswith("sequence 'b' step 1 rejected (INVALID_ARGUMENT): ")
        assert error.decisions["a"].ok
        assert batch.sequences["a"].last_step == 1 and batch.sequences["b"].last_step == 0


def test_raise_for_status_names_sequence_and_step(fake_client):
    decisions = fake_client.step([Report("ghost", 3)])
    with pytest.raises(StepError, match=r"sequence 'ghost' step 3 rejected \(NOT_FOUND\)"):
        decisions[0].raise_for_status()


def test_unknown_ids_are_key_errors(fake_client):
    with fake_client.batch() as batch, pytest.raises(KeyError, match="open\\(\\) or add\\(\\)"):
        batch.step({"nobody": None})


def test_add_adopts_an_open_sequence_with_its_state(fake_client):
    fake_client.open_sequence("tp", 4, budget_tokens=2, tp_world_size=2, score_dtype="bf16")
    with fake_client.batch(rank=1) as batch:
        with pytest.raises(ValueError, match="head_count"):
            batch.add("tp")
        tracked = batch.add("tp", head_count=4)
        assert (tracked.tp_world_size, tracked.score_dtype, tracked.next_step) == (2, "bfloat16", 1)
        with pytest.raises(KvCacheError) as caught:
            batch.add("missing")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_rank_and_head_count_go_in_every_report(fake, fake_client):
    fake_client.open_sequence("tp", 2, budget_tokens=2, tp_world_size=2)
    with fake_client.batch(rank=1, head_count=6) as batch:
        batch.add("tp")
        batch.step({"tp": Scores(struct.pack("<3e", 1, 2, 3), dtype="float16")})
    sent = fake.service.batches[0]
    assert sent.rank == 1 and sent.reports[0].head_count == 6
    assert sent.reports[0].dtype == pb.SCORE_DTYPE_FLOAT16 and sent.reports[0].layers == 1


def test_unary_step_takes_reports_and_raw_messages(fake, fake_client):
    fake_client.open_sequence("a", 3, budget_tokens=2)
    decisions = fake_client.step(
        [Report("a", 1, [[0.1] * 4]), pb.StepReport(sequence_id="a", step=3)], rank=0)
    assert [d.ok for d in decisions] == [True, False]
    assert decisions[1].code == grpc.StatusCode.FAILED_PRECONDITION


def test_stream_sends_exact_steps_and_survives_rejections(fake_client):
    fake_client.open_sequence("a", 3, budget_tokens=2)
    with fake_client.stream() as stream:
        assert stream.send([Report("a", 2)])[0].code == grpc.StatusCode.FAILED_PRECONDITION
        assert stream.send([Report("a", 1, [[0.1] * 4])])[0].ok
        assert stream.send([]) == []


def test_a_silent_daemon_times_out_and_fails_the_stream(fake, fake_client):
    fake_client.open_sequence("a", 3, budget_tokens=2)
    fake.service.silent.set()
    stream = fake_client.stream(timeout=0.3)
    with pytest.raises(KvCacheError) as caught:
        stream.send([Report("a", 1, [[0.1] * 4])])
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "batch 1" in caught.value.message
    with pytest.raises(KvCacheError):  # the stream stays failed: its state is unknown
        stream.send([Report("a", 2)])
    stream.close()


def test_a_reply_for_another_batch_fails_the_stream(fake, fake_client):
    fake_client.open_sequence("a", 3, budget_tokens=2)
    fake.service.wrong_batch_id = True
    with fake_client.stream() as stream, pytest.raises(KvCacheError) as caught:
        stream.send([Report("a", 1, [[0.1] * 4])])
    assert caught.value.code == grpc.StatusCode.INTERNAL


def test_a_stream_the_daemon_ends_fails_cleanly(fake, fake_client):
    fake.service.end_stream = True
    with fake_client.stream() as stream, pytest.raises(KvCacheError) as caught:
        stream.send([Report("a", 1)])
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_unary_failures_carry_code_and_call(fake_client):
    fake_client.open_sequence("a", 3, budget_tokens=2)
    with pytest.raises(KvCacheError) as caught:
        fake_client.open_sequence("a", 3, budget_tokens=2)
    assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert str(caught.value) == ("ALREADY_EXISTS: OpenSequence('a'): "
                                 "sequence 'a' is already open")


def test_no_daemon_is_unavailable():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with KvCacheClient(address, timeout=5) as client:
        with pytest.raises(KvCacheError) as caught:
            client.list_sequences()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(KvCacheError):
            client.wait_ready(0.2)
        with client.stream() as stream, pytest.raises(KvCacheError) as caught:
            stream.send([Report("a", 1)])
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_budget_is_one_or_the_other(fake_client):
    with pytest.raises(ValueError, match="not both"):
        fake_client.open_sequence("a", 3, budget_tokens=2, compression_ratio=0.5)
