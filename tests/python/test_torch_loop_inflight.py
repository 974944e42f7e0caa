"""DecodeLoop.submit/complete and MicroBatchedDecode against a real kvcached that holds two
step batches per stream in flight (--max_inflight_batches=2): two micro-batches
alternating, each computed while the other's step travels, decide and hold exactly what
the blocking begin()/finish() loop does on the same sequences and random inputs (eager,
lazy and folded sequences, budgets that evict, an observation window); a rejected step
applies the decisions of the sequences it did not reject; a sequence in flight cannot be stepped again; the replies keep their
order. No timing is asserted: only what the overlap must not change."""

import time
from typing import Any, Dict, List, Tuple

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from kvcache_client import KvCacheClient, SequenceInFlightError, StepError  # noqa: E402
from kvcache_client.torch import (DecodeLoop, DenseKvCache,  # noqa: E402
                                  MicroBatchedDecode)

LAYERS, KV_HEADS, HEADS, DIM, WINDOW, STEPS = 2, 2, 4, 8, 3, 12

#: (policy, prefill, budget, score layout): lazy ones skip the scores on most steps,
#: every budget is far under the prefill (step 1 evicts most of it, later steps one each).
SEQUENCES = [("inertia", 24, 6, "per_layer"), ("inertia_lazy4", 30, 5, "per_layer"),
             ("tova", 20, 7, "folded"), ("inertia", 28, 5, "folded"),
             ("h2o", 18, 6, "per_layer"), ("inertia_lazy4", 22, 4, "folded"),
             ("score_free", 16, 5, "per_layer")]


@pytest.fixture(scope="module")
def inflight_daemon(tmp_path_factory):
    from daemon import Daemon, flag_missing_reason
    reason = flag_missing_reason("max_inflight_batches")
    if reason:
        pytest.skip(reason)
    daemon = Daemon(tmp_path_factory.mktemp("kvcached-inflight2"),
                    "--max_inflight_batches=2").start()
    yield daemon
    daemon.kill()


@pytest.fixture
def client(inflight_daemon):
    with KvCacheClient(inflight_daemon.address, timeout=30) as c:
        yield c


def generator(*seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(seed) & 0x7FFFFFFF)


def open_sequence(batch, loop, sid: str, index: int) -> DenseKvCache:
    """Opens SEQUENCES[index] as ``sid``, its prefill K/V and observation window from its
    own random inputs (the same whichever loop, batch or order)."""
    policy, prefill, budget, layout = SEQUENCES[index]
    options = {"score_layout": "folded", "layers": LAYERS} if layout == "folded" else {}
    batch.open(sid, prefill, budget_tokens=budget, policy=policy, **options)
    g = generator(index)
    keys = [torch.randn(KV_HEADS, prefill, DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(KV_HEADS, prefill, DIM, generator=g) for _ in range(LAYERS)]
    cache = DenseKvCache(keys, values)
    loop.add(sid, cache)
    for layer in range(LAYERS):  # the prefill's last queries fill the window, if any
        if loop.window(sid) is not None:
            loop.window(sid).add(torch.randn(HEADS, WINDOW, DIM, generator=g),
                                 keys[layer])
    return cache


def decode(loop, index_of: Dict[str, int], captures) -> None:
    """The 'model': per sequence and layer a random q/k/v drawn from (sequence, position),
    the cache extended, the capture fed where the step needs one."""
    for sid, capture in captures.items():
        cache = loop.caches[sid]
        g = generator(index_of[sid], cache.next_position)
        for layer in range(LAYERS):
            q = torch.randn(HEADS, DIM, generator=g)
            keys, values = cache.extend(layer, torch.randn(KV_HEADS, DIM, generator=g),
                                        torch.randn(KV_HEADS, DIM, generator=g))
            if capture is not None:
                capture.add(q, keys, values)


def record(got: Dict[int, List[Tuple]], index_of: Dict[str, int], decisions) -> None:
    for sid, d in decisions.items():
        got[index_of[sid]].append((d.step, tuple(d.evicted), d.cache_size, d.next_needs_scores))


def final(caches: Dict[int, DenseKvCache]) -> Dict[int, Tuple]:
    return {i: (c.positions, c.next_position, [c.keys(l) for l in range(LAYERS)],
                [c.values(l) for l in range(LAYERS)]) for i, c in caches.items()}


def blocking_run(client, seq_id):
    """Every sequence in one loop, stepped with begin()/finish()."""
    got: Dict[int, List[Tuple]] = {i: [] for i in range(len(SEQUENCES))}
    with client.batch() as batch:
        loop = DecodeLoop(batch, observation_window=WINDOW)
        index_of = {seq_id(f"plain{i}"): i for i in range(len(SEQUENCES))}
        caches = {i: open_sequence(batch, loop, sid, i) for sid, i in index_of.items()}
        for _ in range(STEPS):
            captures = loop.begin()
            decode(loop, index_of, captures)
            record(got, index_of, loop.finish(captures))
    return got, final(caches)


@pytest.mark.parametrize("shared", [True, False], ids=["one-batch", "two-batches"])
def test_two_micro_batches_decide_and_hold_what_the_blocking_loop_does(client, seq_id,
                                                                      shared):
    want, want_caches = blocking_run(client, seq_id)

    got: Dict[int, List[Tuple]] = {i: [] for i in range(len(SEQUENCES))}
    batches = ([client.batch(max_inflight=2)] if shared
               else [client.batch(), client.batch()])
    try:
        loops = [DecodeLoop(batches[k % len(batches)], observation_window=WINDOW)
                 for k in range(2)]
        index_of = {seq_id(f"micro{i}"): i for i in range(len(SEQUENCES))}
        caches = {i: open_sequence(loops[i % 2].batch, loops[i % 2], sid, i)
                  for sid, i in index_of.items()}
        micro = MicroBatchedDecode(loops)
        sent = [None, None]
        skipped = folded = 0
        for _ in range(2 * STEPS):
            turn = micro.begin()
            other = sent[1 - turn.index]
            # The other micro-batch's step was sent and is not applied while this one
            # computes (whether its reply has arrived is the daemon's timing).
            assert other is None or not other.completed
            assert turn.loop is loops[turn.index]
            if turn.decisions is not None:
                record(got, index_of, turn.decisions)
            skipped += sum(c is None for c in turn.captures.values())
            folded += sum(c is not None and c.folded for c in turn.captures.values())
            decode(turn.loop, index_of, turn.captures)
            sent[turn.index] = micro.submit(turn.captures)
        for decisions in micro.drain():
            record(got, index_of, decisions)
        assert all(s.completed for s in sent)
        assert all(not b.in_flight for b in batches)
    finally:
        for batch in batches:
            batch.close()

    assert skipped > 0 and folded > 0  # lazy steps sent no scores; folded rows went
    assert any(len(step[1]) > 0 for steps in want.values() for step in steps[1:])
    assert all(len(steps) == STEPS for steps in want.values())
    assert got == want
    got_caches = final(caches)
    for i in range(len(SEQUENCES)):
        positions, next_position, keys, values = got_caches[i]
        assert (positions, next_position) == want_caches[i][:2], SEQUENCES[i]
        for layer in range(LAYERS):
            assert torch.equal(keys[layer], want_caches[i][2][layer])
            assert torch.equal(values[layer], want_caches[i][3][layer])
    assert [loop.stats["steps"] for loop in loops] == [STEPS, STEPS]
    assert not any(loop.windows for loop in loops)  # step 1 decided: every window dropped
    assert micro.stats["turns"] == 2 * STEPS
    assert 0 <= micro.stats["wait_s"] <= micro.stats["total_s"]


def stepped_alone(client, seq_id, index: int, steps: int) -> Tuple:
    """SEQUENCES[index] alone in a blocking loop for ``steps`` steps: its final cache."""
    with client.batch() as batch:
        loop = DecodeLoop(batch, observation_window=WINDOW)
        index_of = {seq_id("alone"): index}
        cache = open_sequence(batch, loop, next(iter(index_of)), index)
        for _ in range(steps):
            captures = loop.begin()
            decode(loop, index_of, captures)
            loop.finish(captures)
        return final({index: cache})[index]


@pytest.mark.parametrize("in_flight", [False, True], ids=["finish", "submit-complete"])
def test_a_rejected_step_applies_the_accepted_decisions_and_decoding_goes_on(
        client, seq_id, in_flight):
    """The daemon decided the other sequences of a step it rejected for one: their caches
    take those decisions (else they would lag the daemon's, whose next step they can no
    longer match), the rejected one's cache and window stay as they were."""
    want = stepped_alone(client, seq_id, 0, 3)
    with client.batch(max_inflight=2) as batch:
        loop = DecodeLoop(batch, observation_window=WINDOW)
        index_of = {seq_id("kept"): 0, seq_id("closed"): 1}
        caches = {sid: open_sequence(batch, loop, sid, i) for sid, i in index_of.items()}
        kept, closed = list(index_of)
        client.close_sequence(closed)  # the batch still steps it: the daemon rejects it
        captures = loop.begin()
        decode(loop, index_of, captures)
        closed_before = (list(caches[closed].positions), caches[closed].next_position)
        with pytest.raises(StepError) as caught:
            if in_flight:
                pending = loop.submit(captures)
                loop.complete(pending)
            else:
                loop.finish(captures)
        assert caught.value.sequence_id == closed
        assert (list(caches[closed].positions), caches[closed].next_position) == closed_before
        assert loop.window(closed) is not None  # not spent: step 1 is to be redone
        assert loop.window(kept) is None        # spent: step 1 was decided
        assert loop.stats["steps"] == 1
        if in_flight:
            with pytest.raises(ValueError, match="completed already"):
                loop.complete(pending)
        assert loop.begin().keys() == caches.keys()  # the step is over, nothing in flight
        loop.remove(closed)
        for _ in range(2):
            captures = loop.begin()
            decode(loop, index_of, captures)
            loop.finish(captures)
        got = final({0: caches[kept]})[0]
        assert got[:2] == want[:2]
        for layer in range(LAYERS):
            assert torch.equal(got[2][layer], want[2][layer])
            assert torch.equal(got[3][layer], want[3][layer])


class HeldStep:
    """A tensor-parallel sequence whose rank-0 step stays in flight until rank 1 reports:
    the daemon cannot answer it (nor, in order, anything sent after it) before."""

    def __init__(self, client, seq_id, rank0) -> None:
        self.client = client
        self.sid = seq_id("tp")
        prefill = 12
        rank0.open(self.sid, prefill, budget_tokens=4, tp_world_size=2, head_count=HEADS // 2)
        self.rank1 = client.batch(rank=1, head_count=HEADS // 2)
        self.rank1.add(self.sid)
        g = generator(99)
        self.keys = [torch.randn(KV_HEADS, prefill, DIM, generator=g) for _ in range(LAYERS)]

    def cache(self, kv_slice) -> DenseKvCache:
        return DenseKvCache([k[kv_slice] for k in self.keys], [k[kv_slice] for k in self.keys])

    def wait_until_rank0_sent(self) -> None:
        deadline = time.monotonic() + 10
        while self.client.inspect(self.sid).ranks_reported < 1:
            assert time.monotonic() < deadline, "rank 0's step never arrived"
            time.sleep(0.01)

    def report_rank1(self) -> None:
        loop = DecodeLoop(self.rank1)
        cache = self.cache(slice(1, 2))
        loop.add(self.sid, cache)
        captures = loop.begin()
        decode_half(cache, captures[self.sid], slice(2, 4), slice(1, 2))
        loop.finish(captures)

    def close(self) -> None:
        self.rank1.close()


def decode_half(cache, capture, heads, kv_heads) -> None:
    """One rank's share of a tensor-parallel step: its query heads over its KV heads."""
    g = generator(7, cache.next_position)
    for layer in range(LAYERS):
        q = torch.randn(HEADS, DIM, generator=g)
        k, v = torch.randn(KV_HEADS, DIM, generator=g), torch.randn(KV_HEADS, DIM, generator=g)
        keys, values = cache.extend(layer, k[kv_heads], v[kv_heads])
        capture.add(q[heads], keys, values)


def test_a_sequence_in_flight_is_refused_and_replies_keep_their_order(client, seq_id):
    with client.batch(max_inflight=2) as batch:
        held = HeldStep(client, seq_id, batch)
        try:
            first, second = DecodeLoop(batch), DecodeLoop(batch)
            tp_cache = held.cache(slice(0, 1))
            first.add(held.sid, tp_cache)
            index_of = {seq_id("solo"): 0}
            solo = open_sequence(batch, second, list(index_of)[0], 0)
            micro = MicroBatchedDecode([first, second])

            turn = micro.begin()
            decode_half(tp_cache, turn.captures[held.sid], slice(0, 2), slice(0, 1))
            with pytest.raises(RuntimeError, match="submit"):
                micro.begin()
            held_step = micro.submit(turn.captures)
            held.wait_until_rank0_sent()
            # Stepped again while in flight: the loop refuses to begin it, and the batch to
            # send it (sending nothing).
            with pytest.raises(SequenceInFlightError, match="complete"):
                first.begin()
            with pytest.raises(SequenceInFlightError, match="in flight"):
                first.submit({held.sid: None})
            assert client.inspect(held.sid).ranks_reported == 1
            with pytest.raises(ValueError, match="another DecodeLoop"):
                second.complete(held_step)

            turn = micro.begin()  # the other micro-batch computes while the first travels
            assert turn.index == 1 and turn.decisions is None
            decode(second, index_of, turn.captures)
            solo_step = micro.submit(turn.captures)
            with pytest.raises(RuntimeError, match="begin"):
                micro.submit(turn.captures)
            time.sleep(0.2)  # room for a reply out of order to show (none may)
            assert not held_step.future.done() and not solo_step.future.done()

            held.report_rank1()
            solo_step.future.result(timeout=30)
            assert held_step.future.done()  # answered in order: the held one first
            turn = micro.begin()  # completes the held step, applies it, begins the next
            assert turn.index == 0 and turn.decisions[held.sid].step == 1
            assert len(tp_cache.positions) == 4 and held.sid in turn.captures
            decode_half(tp_cache, turn.captures[held.sid], slice(0, 2), slice(0, 1))
            micro.submit(turn.captures)
            turn = micro.begin()
            assert turn.index == 1 and turn.decisions[list(index_of)[0]].step == 1
            assert len(solo.positions) == SEQUENCES[0][2]
        finally:
            held.close()


def test_micro_batches_refuse_a_batch_too_small_to_hold_their_steps(client):
    with client.batch() as batch:
        with pytest.raises(ValueError, match="max_inflight=2"):
            MicroBatchedDecode([DecodeLoop(batch), DecodeLoop(batch)])
        with pytest.raises(ValueError, match="at least two"):
            MicroBatchedDecode([DecodeLoop(batch)])
