"""Resuming a sequence the daemon lost (docs/SPEC.md, "Resuming a sequence") through the
client's open_sequence(resume=(last_step, cached_positions))."""

import grpc
import pytest

from kvcache_client import KvCacheError


def test_a_resumed_sequence_steps_on_from_zero_momentum(client, seq_id):
    sid = seq_id()
    state = client.open_sequence(sid, 16, budget_tokens=4, policy="inertia",
                                 resume=(3, [0, 5, 9, 17]))
    assert (state.last_step, state.next_step, state.cache_size) == (3, 4, 4)
    cache = client.inspect(sid, include_cache=True)
    assert cache.positions == [0, 5, 9, 17] and cache.momentum == [0.0] * 4
    with client.batch() as batch:
        batch.add(sid)
        # Step 4 adds position 16 + 4 - 1 = 19; from zero momentum the lowest score goes.
        decision = batch.step({sid: [[0.4, 0.3, 0.05, 0.6, 0.2]]})[sid].raise_for_status()
        assert (decision.step, decision.evicted, decision.cache_size) == (4, [9], 4)


def test_a_resume_out_of_order_is_refused_and_opens_nothing(client, seq_id):
    sid = seq_id()
    with pytest.raises(KvCacheError) as caught:
        client.open_sequence(sid, 16, budget_tokens=4, resume=(3, [5, 0]))
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "strictly above" in caught.value.message
    with pytest.raises(KvCacheError) as missing:
        client.inspect(sid)
    assert missing.value.code == grpc.StatusCode.NOT_FOUND
