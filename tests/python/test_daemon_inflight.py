"""Steps in flight against a real kvcached: two micro-batches of golden sequences
alternating with two steps in flight decide exactly as the blocking path (inline and
through a score region, whose windows then alternate); many batches in flight keep their
order; a submit past max_inflight is held back; a daemon killed with batches in flight
fails every future; a sequence is in one step in flight at most. Tensor-parallel
sequences hold a rank's batch in flight for as long as the test wants: the daemon answers
it only once the other rank has reported the step."""

import time
from concurrent import futures
from typing import Any, Dict, List

import grpc
import pytest

from golden import NAMES, Trace, as_dict, load, replay
from kvcache_client import KvCacheClient, KvCacheError, SequenceInFlightError

REGION_BYTES = 1 << 18  # every golden's step together needs about 52 KiB; 1/2 per window


def open_traces(batch, seq_id, traces: List[Trace]) -> Dict[str, Trace]:
    by_id = {}
    for trace in traces:
        sid = seq_id(trace.name)
        batch.open(sid, **trace.open_options())
        by_id[sid] = trace
    return by_id


def step_scores(group: Dict[str, Trace], index: int) -> Dict[str, Any]:
    """The group's scores for its step ``index`` (those whose trace has ended drop out)."""
    return {sid: trace.steps[index].get("layers") for sid, trace in group.items()
            if index < len(trace.steps)}


def alternate(batch, groups: List[Dict[str, Trace]]) -> Dict[str, List[Dict[str, Any]]]:
    """Steps the groups in turn, each group's next step sent as soon as its previous
    decisions are in, so that the other group's step is in flight meanwhile."""
    got: Dict[str, List[Dict[str, Any]]] = {sid: [] for group in groups for sid in group}
    steps = max(len(t.steps) for group in groups for t in group.values())
    in_flight = [batch.submit_step(step_scores(group, 0)) for group in groups]
    for index in range(1, steps + 1):
        for number, group in enumerate(groups):
            for sid, decision in in_flight[number].result(timeout=60).items():
                got[sid].append(as_dict(decision.raise_for_status()))
            in_flight[number] = batch.submit_step(step_scores(group, index))
    for future in in_flight:
        assert future.result(timeout=60) == {}  # past every trace's end: nothing sent
    return got


@pytest.fixture(params=["inline", "shm"])
def transport(request):
    """(client, batch options): inline scores, or a score region of this process."""
    if request.param == "inline":
        return request.getfixturevalue("client"), {}
    return request.getfixturevalue("shm_client"), {"score_region_bytes": REGION_BYTES}


def test_two_micro_batches_in_flight_decide_as_the_blocking_path(transport, seq_id):
    client, options = transport
    traces = [load(name) for name in NAMES]
    with client.batch(**options) as blocking:
        by_id = open_traces(blocking, seq_id, traces)
        want = replay(blocking, by_id)
    with client.batch(max_inflight=2, **options) as batch:
        groups = [open_traces(batch, seq_id, traces[0::2]),
                  open_traces(batch, seq_id, traces[1::2])]
        got = alternate(batch, groups)
        if batch.score_region is not None:
            assert batch.score_region.inline_reports == 0
            assert batch.score_region.region_reports > 0
        assert batch.in_flight == frozenset()
    by_name = {by_id[sid].name: decisions for sid, decisions in want.items()}
    for group in groups:
        for sid, trace in group.items():
            assert got[sid] == trace.expected, trace.name
            assert got[sid] == by_name[trace.name], trace.name
            assert batch.sequences[sid].last_step == len(trace.steps)


def test_order_is_kept_with_eight_batches_in_flight(client, seq_id):
    trace = load("ema_every_step")
    with client.batch(max_inflight=8) as batch:
        ids = list(open_traces(batch, seq_id, [trace] * 8))
        got: Dict[str, List[Dict[str, Any]]] = {sid: [] for sid in ids}
        in_flight = {sid: batch.submit_step(step_scores({sid: trace}, 0)) for sid in ids}
        for index in range(1, len(trace.steps) + 1):
            for sid in ids:  # one sequence a batch, each sent while seven others travel
                (decision,) = in_flight[sid].result(timeout=60).values()
                assert decision.sequence_id == sid
                got[sid].append(as_dict(decision.raise_for_status()))
                in_flight[sid] = batch.submit_step(step_scores({sid: trace}, index))
    for sid in ids:
        assert got[sid] == trace.expected


class TensorParallelPair:
    """Sequences of two ranks: rank 0's batch submits, rank 1's decides when to report."""

    SCORES = [[0.25, 0.5, 0.125, 1.0, 0.75]]  # one layer, a 4-token prefill + the new one

    def __init__(self, client: KvCacheClient, seq_id, count: int, max_inflight: int) -> None:
        self.client = client
        self.rank0 = client.batch(rank=0, head_count=1, max_inflight=max_inflight)
        self.rank1 = client.batch(rank=1, head_count=1)
        self.ids = [seq_id(f"tp{i}") for i in range(count)]
        for sid in self.ids:
            self.rank0.open(sid, 4, budget_tokens=2, tp_world_size=2)
            self.rank1.add(sid)

    def submit(self, sid: str):
        """Rank 0's step 1 of ``sid``, which stays in flight until rank 1 reports it."""
        future = self.rank0.submit_step({sid: self.SCORES})
        deadline = time.monotonic() + 10
        while self.client.inspect(sid).ranks_reported < 1:
            assert time.monotonic() < deadline, f"rank 0's step of {sid} never arrived"
            time.sleep(0.01)
        return future

    def close(self) -> None:
        self.rank0.close()
        self.rank1.close()


def test_a_submit_past_max_inflight_waits_for_the_oldest_reply(client, seq_id):
    pair = TensorParallelPair(client, seq_id, 3, max_inflight=2)
    try:
        first, second = pair.submit(pair.ids[0]), pair.submit(pair.ids[1])
        with futures.ThreadPoolExecutor(1) as pool:
            third = pool.submit(pair.rank0.submit_step, {pair.ids[2]: pair.SCORES})
            time.sleep(0.3)
            assert not third.done(), "a third step went out past max_inflight=2"
            assert client.inspect(pair.ids[2]).ranks_reported == 0
            assert not first.done() and not second.done()
            pair.rank1.step({pair.ids[0]: pair.SCORES}, raise_on_error=True)
            third_future = third.result(timeout=10)  # the first reply freed a slot
        assert first.result(timeout=10)[pair.ids[0]].ok and not second.done()
        pair.rank1.step({sid: pair.SCORES for sid in pair.ids[1:]}, raise_on_error=True)
        assert second.result(timeout=10)[pair.ids[1]].ok
        assert third_future.result(timeout=10)[pair.ids[2]].ok
    finally:
        pair.close()


def test_a_sequence_in_flight_is_refused_and_its_next_step_waits_for_it(client, seq_id):
    pair = TensorParallelPair(client, seq_id, 2, max_inflight=2)
    try:
        first = pair.submit(pair.ids[0])
        with pytest.raises(SequenceInFlightError, match="wait for that step's result"):
            pair.rank0.submit_step({pair.ids[1]: pair.SCORES, pair.ids[0]: pair.SCORES})
        # Refused whole: the other sequence's step was not sent either.
        assert client.inspect(pair.ids[1]).ranks_reported == 0
        assert pair.rank0.in_flight == {pair.ids[0]}
        pair.rank1.step({pair.ids[0]: pair.SCORES}, raise_on_error=True)
        assert first.result(timeout=10)[pair.ids[0]].step == 1
        assert pair.rank0.sequences[pair.ids[0]].last_step == 1
    finally:
        pair.close()


def test_a_daemon_killed_with_batches_in_flight_fails_every_future(start_daemon, seq_id):
    daemon = start_daemon()
    with KvCacheClient(daemon.address, timeout=30) as client:
        pair = TensorParallelPair(client, seq_id, 3, max_inflight=3)
        try:
            sent = [pair.submit(sid) for sid in pair.ids]
            daemon.kill()
            errors = [future.exception(timeout=30) for future in sent]
            assert all(type(error) is KvCacheError for error in errors), errors
            assert errors[0] is errors[1] is errors[2]
            assert errors[0].code == grpc.StatusCode.UNAVAILABLE, errors[0]
            deadline = time.monotonic() + 10  # freed by the futures' done-callbacks
            while pair.rank0.in_flight:
                assert time.monotonic() < deadline, pair.rank0.in_flight
                time.sleep(0.01)
            with pytest.raises(KvCacheError) as caught:  # the blocking path: the same error
                pair.rank0.step({pair.ids[0]: pair.SCORES})
            assert caught.value is errors[0]
        finally:
            pair.close()
