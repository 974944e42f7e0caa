"""DenseKvCache, PooledKvCache and DecodeLoop of kvcache_client.torch against a real
kvcached holding host shared-memory KV pools: both caches hold exactly the K/V of the
positions the daemon kept, the pooled one where the daemon's slot table says (compaction
moves included), and the loop captures scores only on the steps that need them."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from kvcache_client import KvCacheClient  # noqa: E402
from kvcache_client.torch import (DecodeLoop, DenseKvCache, KvPoolMapping,  # noqa: E402
                                  PooledKvCache)

LAYERS, KV_HEADS, HEADS, DIM, TPB = 2, 2, 4, 8, 8


@pytest.fixture(scope="module")
def pool_daemon(tmp_path_factory):
    from daemon import Daemon, flag_missing_reason
    reason = flag_missing_reason("pool_memory_bytes")
    if reason:
        pytest.skip(reason)
    daemon = Daemon(tmp_path_factory.mktemp("kvcached-pools"), "--backend=host",
                    f"--pool_memory_bytes={1 << 20}", f"--kv_layers={LAYERS}",
                    f"--kv_heads={KV_HEADS}", f"--kv_head_dim={DIM}",
                    f"--kv_tokens_per_block={TPB}", "--kv_dtype=float32").start()
    yield daemon
    daemon.kill()


def fake_step(generator, cache, capture):
    """One 'model' step: random q/k/v per layer; attends over what the cache returns."""
    out = []
    for layer in range(LAYERS):
        q = torch.randn(HEADS, DIM, generator=generator)
        k = torch.randn(KV_HEADS, DIM, generator=generator)
        v = torch.randn(KV_HEADS, DIM, generator=generator)
        keys, values = cache.extend(layer, k, v)
        if capture is not None:
            capture.add(q, keys, values)
        out.append(keys.sum() + values.sum())
    return out


@pytest.mark.parametrize("policy,prefill,budget", [("inertia", 40, 6), ("tova", 30, 12),
                                                   ("inertia_lazy4", 50, 5)])
def test_dense_and_pooled_caches_hold_what_the_daemon_kept(pool_daemon, seq_id, policy,
                                                           prefill, budget):
    g = torch.Generator().manual_seed(prefill)
    keys = [torch.randn(KV_HEADS, prefill, DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(KV_HEADS, prefill, DIM, generator=g) for _ in range(LAYERS)]
    every_k = {(l, p): keys[l][:, p] for l in range(LAYERS) for p in range(prefill)}
    with KvCacheClient(pool_daemon.address, timeout=30) as client, \
            KvPoolMapping.for_rank(client, 0) as mapping, client.batch() as batch:
        dense_id, pooled_id = seq_id("dense"), seq_id("pooled")
        for sid in (dense_id, pooled_id):
            batch.open(sid, prefill, budget_tokens=budget, policy=policy)
        dense = DenseKvCache(keys, values, capacity=4)  # grows as it goes
        pooled = PooledKvCache.open(client, mapping, pooled_id)
        assert pooled.positions == list(range(prefill)) and len(pooled.slots) == prefill
        pooled.load_prefill(keys, values)
        loop = DecodeLoop(batch)
        loop.add(dense_id, dense)
        loop.add(pooled_id, pooled)
        moves = 0
        for step in range(1, 13):
            captures = loop.begin()
            assert (captures[dense_id] is None) == (policy == "inertia_lazy4"
                                                    and (step - 1) % 4 != 0)
            seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
            before = {}
            for sid, cache in ((dense_id, dense), (pooled_id, pooled)):
                gen = torch.Generator().manual_seed(seed)
                before[sid] = fake_step(gen, cache, captures[sid])
            torch.testing.assert_close(before[dense_id], before[pooled_id], rtol=0, atol=0)
            gen = torch.Generator().manual_seed(seed)
            for layer in range(LAYERS):  # what this step appended, for the check below
                torch.randn(HEADS, DIM, generator=gen)
                every_k[(layer, prefill + step - 1)] = torch.randn(KV_HEADS, DIM, generator=gen)
                torch.randn(KV_HEADS, DIM, generator=gen)
            decisions = loop.finish(captures)
            assert decisions[dense_id].evicted == decisions[pooled_id].evicted
            moves += sum(len(c.moves) for c in decisions[pooled_id].kv_changes)
            state = client.inspect(pooled_id, include_cache=True)
            assert dense.positions == pooled.positions == state.positions
            assert pooled.slots == state.kv_slots[0]
            for layer in range(LAYERS):
                want = torch.stack([every_k[(layer, p)] for p in state.positions], dim=1)
                assert torch.equal(dense.keys(layer), want)
                assert torch.equal(pooled.keys(layer), want)
                assert torch.equal(dense.values(layer), pooled.values(layer))
        assert moves > 0  # the large first eviction compacted the pool
        assert loop.stats["steps"] == 12 and loop.stats["step_s"] > 0
        expected_scoring = 12 if policy != "inertia_lazy4" else 3
        assert loop.stats["scoring_steps"] == expected_scoring
        del dense, pooled


def test_the_caches_refuse_decisions_that_do_not_fit():
    keys = [torch.zeros(KV_HEADS, 3, DIM) for _ in range(LAYERS)]
    cache = DenseKvCache(keys, keys)

    class Fake:
        ok, step, message, cache_size = True, 1, "", 3
        evicted = [7]
    with pytest.raises(ValueError, match="extend every layer"):
        cache.apply(Fake())
    for layer in range(LAYERS):
        cache.extend(layer, torch.ones(KV_HEADS, DIM), torch.ones(KV_HEADS, DIM))
    with pytest.raises(ValueError, match="does not hold"):
        cache.apply(Fake())
    Fake.evicted = [1, 3]  # 3 is the new token (next_position)
    Fake.cache_size = 2
    cache.apply(Fake())
    assert cache.positions == [0, 2] and cache.next_position == 4
    assert cache.keys(0).shape == (KV_HEADS, 2, DIM)
    with pytest.raises(ValueError, match="extended twice"):
        cache.extend(0, torch.ones(KV_HEADS, DIM), torch.ones(KV_HEADS, DIM))
        cache.extend(0, torch.ones(KV_HEADS, DIM), torch.ones(KV_HEADS, DIM))


def test_two_tensor_parallel_ranks_decide_like_one(kvcached, seq_id):
    # Each rank holds half the query heads and their KV heads, captures its head sums with
    # its own DecodeLoop (the batch's head_count makes them sums); the daemon joins them.
    # A single-rank sequence fed the mean over all heads must be evicted alike.
    import threading

    prefill, budget, steps, heads, kv_heads = 30, 8, 10, 4, 2
    g = torch.Generator().manual_seed(42)
    keys = [torch.randn(kv_heads, prefill, DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(kv_heads, prefill, DIM, generator=g) for _ in range(LAYERS)]
    plan = [[(torch.randn(heads, DIM, generator=g), torch.randn(kv_heads, DIM, generator=g),
              torch.randn(kv_heads, DIM, generator=g)) for _ in range(LAYERS)]
            for _ in range(steps)]
    tp_id, one_id = seq_id("tp"), seq_id("one")
    evicted = {0: [], 1: [], "one": []}

    def run(rank, sid, head_slice, kv_slice, batch, key):
        cache = DenseKvCache([k[kv_slice] for k in keys], [v[kv_slice] for v in values])
        loop = DecodeLoop(batch)
        loop.add(sid, cache)
        for step in range(steps):
            captures = loop.begin()
            for layer, (q, k, v) in enumerate(plan[step]):
                ks, vs = cache.extend(layer, k[kv_slice], v[kv_slice])
                captures[sid].add(q[head_slice], ks, vs)
            evicted[key].append(loop.finish(captures)[sid].evicted)

    with KvCacheClient(kvcached.address, timeout=30) as client:
        b0, b1 = client.batch(rank=0, head_count=2), client.batch(rank=1, head_count=2)
        one = client.batch()
        b0.open(tp_id, prefill, budget_tokens=budget, policy="inertia", tp_world_size=2)
        b1.add(tp_id)
        one.open(one_id, prefill, budget_tokens=budget, policy="inertia")
        threads = [threading.Thread(target=run, args=(0, tp_id, slice(0, 2), slice(0, 1),
                                                      b0, 0)),
                   threading.Thread(target=run, args=(1, tp_id, slice(2, 4), slice(1, 2),
                                                      b1, 1))]
        for t in threads:
            t.start()
        run(0, one_id, slice(0, 4), slice(0, 2), one, "one")
        for t in threads:
            t.join(60)
        for batch in (b0, b1, one):
            batch.close()
    assert len(evicted["one"]) == steps
    assert evicted[0] == evicted[1] == evicted["one"]
