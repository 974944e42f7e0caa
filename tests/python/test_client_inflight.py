"""Steps in flight (StepStream.submit, SequenceBatch.submit_step) against an in-process fake
whose replies the test holds back, releases, or swaps: each future gets its own batch's
decisions, in order; more than max_inflight batches are held back, not queued; a reply out
of order, a silent daemon or close() fails every batch in flight; a sequence is in one step
in flight at most; score-region windows do not overlap."""

import asyncio
import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from fake_kvcached import FakeKvCache
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvcache_client import (KvCacheClient, KvCacheError, Report, SequenceInFlightError,
                            StepFuture)
from kvcache_client.region import ALIGNMENT

SCORES = [[0.1] * 4]  # one layer over a 3-token prefill plus the new token


class GatedFake(FakeKvCache):
    """Decides each batch as it arrives (FakeKvCache's rules) but writes the replies only
    while ``gate`` is set; with ``swap``, each two replies in reverse order; with
    ``silent``, none."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.swap = False

    def StepStream(self, request_iterator, context):
        decided: "queue.SimpleQueue" = queue.SimpleQueue()

        def read() -> None:
            try:
                for batch in request_iterator:
                    reply = self._decide(batch)
                    if not self.silent.is_set():
                        decided.put(reply)
            except grpc.RpcError:
                pass  # the client cancelled
            finally:
                decided.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            replies = [decided.get()]
            if self.swap and replies[0] is not None:
                replies.insert(0, decided.get())
            self.gate.wait()
            for reply in replies:
                if reply is None:
                    return
                yield reply


@pytest.fixture
def fake():
    service = GatedFake()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_KvCacheServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service.address = f"127.0.0.1:{port}"
    yield service
    service.gate.set()  # no handler left waiting
    server.stop(grace=None)


@pytest.fixture
def fake_client(fake):
    with KvCacheClient(fake.address, timeout=10) as client:
        yield client


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def open_many(client, count: int):
    ids = [f"s{i}" for i in range(count)]
    for sid in ids:
        client.open_sequence(sid, 3, budget_tokens=2)
    return ids


def test_each_future_gets_its_own_batch_with_every_slot_in_flight(fake, fake_client):
    ids = open_many(fake_client, 8)
    fake.gate.clear()
    with fake_client.stream(max_inflight=8) as stream:
        sent = [stream.submit([Report(sid, 1, SCORES)]) for sid in ids]
        wait_until(lambda: len(fake.batches) == 8, "the fake to receive 8 batches")
        assert stream.unanswered == 8 and not any(f.done() for f in sent)
        assert [f.batch_id for f in sent] == list(range(1, 9))
        fake.gate.set()
        for sid, future in zip(ids, sent):
            (decision,) = future.result(timeout=10)
            assert (decision.sequence_id, decision.step, decision.ok) == (sid, 1, True)
        assert stream.unanswered == 0


def test_order_is_kept_over_many_batches_in_flight(fake, fake_client):
    ids = open_many(fake_client, 6)
    steps = dict.fromkeys(ids, 0)
    with fake_client.stream(max_inflight=4) as stream:
        sent = []
        for round_ in range(20):  # batches of two or three sequences, many in flight
            members = ids[round_ % 3::3] if round_ % 2 else ids[round_ % 2::2]
            for sid in members:
                steps[sid] += 1
            sent.append(([(sid, steps[sid]) for sid in members],
                         stream.submit([Report(sid, steps[sid], SCORES) for sid in members])))
        for want, future in sent:
            got = [(d.sequence_id, d.step) for d in future.result(timeout=10)]
            assert got == want
            assert all(d.ok for d in future.result())


def test_submits_past_max_inflight_are_held_back_not_queued(fake, fake_client):
    ids = open_many(fake_client, 3)
    fake.gate.clear()
    with fake_client.stream(max_inflight=2) as stream, \
            futures.ThreadPoolExecutor(1) as pool:
        first = [stream.submit([Report(sid, 1, SCORES)]) for sid in ids[:2]]
        third = pool.submit(stream.submit, [Report(ids[2], 1, SCORES)])
        time.sleep(0.3)
        assert not third.done(), "a third batch went out past max_inflight=2"
        assert len(fake.batches) == 2 and stream.unanswered == 2
        fake.gate.set()
        decisions = [f.result(timeout=10)[0] for f in first + [third.result(timeout=10)]]
        assert [d.sequence_id for d in decisions] == ids and all(d.ok for d in decisions)


def test_a_reply_out_of_order_fails_every_batch_in_flight(fake, fake_client):
    ids = open_many(fake_client, 2)
    fake.swap = True
    with fake_client.stream(max_inflight=2) as stream:
        sent = [stream.submit([Report(sid, 1, SCORES)]) for sid in ids]
        errors = [f.exception(timeout=10) for f in sent]
        assert all(isinstance(e, KvCacheError) for e in errors)
        assert errors[0] is errors[1] is stream.failed
        assert errors[0].code == grpc.StatusCode.INTERNAL
        assert "reply for batch 2 while batch 1 waited" in errors[0].message
        with pytest.raises(KvCacheError) as caught:  # the stream stays failed
            stream.submit([Report(ids[0], 2)])
        assert caught.value is errors[0]


def test_a_silent_daemon_fails_every_batch_in_flight_at_the_oldest_deadline(fake, fake_client):
    ids = open_many(fake_client, 3)
    fake.silent.set()
    with fake_client.stream(timeout=0.3, max_inflight=3) as stream:
        sent = [stream.submit([Report(sid, 1, SCORES)]) for sid in ids]
        # Nobody waits on the futures: the stream's own watch fails them.
        done, _ = futures.wait(sent, timeout=10)
        assert len(done) == 3
        errors = {id(f.exception()) for f in sent}
        assert errors == {id(stream.failed)}
        assert stream.failed.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "no reply to batch 1 within 0.3 s" in stream.failed.message


def test_close_fails_the_batches_still_in_flight_with_cancelled(fake, fake_client):
    ids = open_many(fake_client, 2)
    fake.gate.clear()
    stream = fake_client.stream(max_inflight=2)
    sent = [stream.submit([Report(sid, 1, SCORES)]) for sid in ids]
    stream.close(timeout=0.2)
    for future in sent:
        error = future.exception(timeout=10)
        assert isinstance(error, KvCacheError) and error.code == grpc.StatusCode.CANCELLED
        assert "closed before this batch was answered" in error.message
    with pytest.raises(KvCacheError, match="closed"):
        stream.submit([Report(ids[0], 2)])


def test_close_lets_the_daemon_answer_what_is_in_flight(fake, fake_client):
    ids = open_many(fake_client, 2)
    stream = fake_client.stream(max_inflight=2)
    sent = [stream.submit([Report(sid, 1, SCORES)]) for sid in ids]
    stream.close()
    assert [f.result(timeout=10)[0].sequence_id for f in sent] == ids


def test_a_sent_batch_cannot_be_cancelled(fake, fake_client):
    (sid,) = open_many(fake_client, 1)
    with fake_client.stream() as stream:
        future = stream.submit([Report(sid, 1, SCORES)])
        assert isinstance(future, StepFuture) and not future.cancel()
        assert future.result(timeout=10)[0].ok
        empty = stream.submit([])
        assert empty.done() and empty.result() == [] and empty.batch_id is None


@pytest.mark.parametrize("bad", [0, -1, 1025, 2.0, "2", True, None])
def test_max_inflight_out_of_range_is_refused_naming_it(fake_client, bad):
    with pytest.raises(ValueError, match="max_inflight must be an int from 1 to 1024"):
        fake_client.stream(max_inflight=bad)
    with pytest.raises(ValueError, match="max_inflight"):
        fake_client.batch(max_inflight=bad)


# -- SequenceBatch -------------------------------------------------------------------------

def test_a_sequence_in_a_step_in_flight_is_refused_without_sending(fake, fake_client):
    fake.gate.clear()
    with fake_client.batch(max_inflight=2) as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        batch.open("b", prefill_len=3, budget_tokens=2)
        first = batch.submit_step({"a": SCORES})
        wait_until(lambda: len(fake.batches) == 1, "the first step to arrive")
        assert batch.in_flight == {"a"}
        with pytest.raises(SequenceInFlightError, match=r"sequence 'a' is in a step still in "
                                                        r"flight \(step 1 was sent"):
            batch.submit_step({"b": SCORES, "a": SCORES})
        with pytest.raises(SequenceInFlightError):
            batch.needs_scores("a")
        with pytest.raises(SequenceInFlightError):
            batch.add("a")
        assert len(fake.batches) == 1 and batch.in_flight == {"a"}  # nothing sent, b free
        assert batch.needs_scores() is True  # b's; a's is not known yet
        second = batch.submit_step({"b": SCORES})
        fake.gate.set()
        assert first.result(timeout=10)["a"].step == 1
        assert second.result(timeout=10)["b"].step == 1
        assert batch.in_flight == frozenset()
        # The fake's rule: odd steps are followed by one that needs no scores.
        assert batch.sequences["a"].last_step == 1 and not batch.needs_scores("a")
        assert batch.step({"a": None})["a"].step == 2


def test_two_micro_batches_alternate_with_their_tracking_right(fake, fake_client):
    with fake_client.batch(max_inflight=2) as batch:
        groups = [["a0", "a1"], ["b0", "b1", "b2"]]
        for sid in groups[0] + groups[1]:
            batch.open(sid, prefill_len=3, budget_tokens=2)

        def submit(group):
            # Sized from the tracking: wrong sizes would be refused by the client.
            return batch.submit_step(
                {sid: [[0.1] * batch.sequences[sid].tokens] if batch.needs_scores(sid) else None
                 for sid in group}, raise_on_error=True)

        in_flight = [submit(group) for group in groups]
        for round_ in range(1, 8):
            for index, group in enumerate(groups):
                decisions = in_flight[index].result(timeout=10)
                assert [d.step for d in decisions.values()] == [round_] * len(group)
                in_flight[index] = submit(group)
        for future in in_flight:
            future.result(timeout=10)
    assert {s.last_step for s in batch.sequences.values()} == {8}
    # Every step carried scores exactly when the previous decision asked for them.
    for report in (r for b in fake.batches for r in b.reports):
        assert bool(report.scores) == (report.step % 2 == 1), (report.sequence_id, report.step)


def test_a_failed_stream_fails_the_step_and_frees_its_sequences(fake, fake_client):
    fake.silent.set()
    with fake_client.batch(timeout=0.3, max_inflight=2) as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        future = batch.submit_step({"a": SCORES})
        with pytest.raises(KvCacheError) as caught:
            future.result(timeout=10)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: not batch.in_flight, "the sequence to be freed")
        with pytest.raises(KvCacheError) as again:  # the stream's error, not "in flight"
            batch.submit_step({"a": SCORES})
        assert again.value is caught.value


def test_a_step_can_be_awaited_with_asyncio(fake_client):
    async def two_steps(batch):
        first = await asyncio.wrap_future(batch.submit_step({"a": SCORES}))
        second = await asyncio.wrap_future(batch.submit_step({"a": None}))
        return first["a"].step, second["a"].step

    with fake_client.batch() as batch:
        batch.open("a", prefill_len=3, budget_tokens=2)
        assert asyncio.run(two_steps(batch)) == (1, 2)


def test_score_region_windows_do_not_overlap_in_flight(fake, fake_client):
    region_bytes = 4 * ALIGNMENT * 2
    ids = open_many(fake_client, 3)
    fake.gate.clear()
    with fake_client.stream(max_inflight=2, score_region_bytes=region_bytes) as stream:
        window = region_bytes // 2
        one = stream.submit([Report(ids[0], 1, [[0.25] * 4])])
        two = stream.submit([Report(ids[1], 1, [[0.5] * 4])])
        fake.gate.set()
        assert one.result(timeout=10)[0].ok and two.result(timeout=10)[0].ok
        three = stream.submit([Report(ids[2], 1, [[0.75] * 4])])  # window 0 again
        assert three.result(timeout=10)[0].ok
    refs = [b.reports[0].score_ref for b in fake.batches]
    assert [r.offset for r in refs] == [0, window, 0]
    # What the fake read when it decided each batch: its own scores, not a neighbour's.
    assert [r.data for r in fake.resolved] == [
        Report("x", 1, [[v] * 4]).to_proto().scores for v in (0.25, 0.5, 0.75)]
