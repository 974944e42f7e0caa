"""KV pools on a real kvcached, from Python: the pools are described, every decision says
where the new token's K/V goes, and the slot tables follow the cache."""

from kvcache_client import KvCacheClient


def test_pools_described_and_slots_follow_the_cache(start_daemon):
    daemon = start_daemon("--tp_ranks=2", "--pool_memory_bytes=65536", "--kv_layers=2",
                          "--kv_heads=1", "--kv_head_dim=8", "--kv_tokens_per_block=8",
                          "--kv_shared_memory=false")
    with KvCacheClient(daemon.address, timeout=30) as client:
        pools = client.describe_kv_pools()
        assert [p.rank for p in pools] == [0, 1]
        block = 8 * 2 * 2 * 1 * 8 * 2  # tokens x (K, V) x layers x heads x dim x 2 bytes
        assert all(p.backend == "host" and p.block_bytes == block for p in pools)
        assert all(p.capacity_blocks == 65536 // block and p.used_blocks == 0 for p in pools)

        with client.batch() as batch:
            batch.open("s", 64, budget_tokens=12, policy="tova")
            state = client.inspect("s", include_cache=True)
            assert sorted(state.kv_slots) == [0, 1]
            assert all(len(slots) == 64 for slots in state.kv_slots.values())
            cache = 64
            for step in range(1, 6):
                rows = [[float((i * 7 + step) % 13) for i in range(cache + 1)]] * 2
                decision = batch.step({"s": rows})["s"].raise_for_status()
                assert [k.rank for k in decision.kv_changes] == [0, 1]
                new_position = 64 + step - 1
                for change in decision.kv_changes:
                    assert (change.new_token_slot < 0) == (new_position in decision.evicted)
                cache = decision.cache_size
            # Step 1 evicted 53 of 65 tokens: compaction gave whole blocks back.
            state = client.inspect("s", include_cache=True)
            for rank, slots in state.kv_slots.items():
                assert len(slots) == len(state.positions) == 12
                assert len(set(slots)) == 12
            assert all(p.used_blocks <= 3 for p in client.describe_kv_pools())
