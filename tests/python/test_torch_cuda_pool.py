"""KvPoolMapping and PooledKvCache on a CUDA KV pool (``kvcached --backend=cuda``).

Without a GPU the CUDA branch runs with the fake runtime of fake_cudart, whose "device
memory" is the daemon's own host pool: the pool described to the client as a CUDA pool
(IPC handle, UUID, bus id) is opened through cuda_runtime, and everything the cache writes
lands where a real daemon reads and compacts it. A decode of several sequences with
evictions then holds, gathers and attends exactly as DenseKvCache twins on the same
inputs, and the daemon's own (host) view of its pool holds what the cache wrote. Also:
close drops the tensor before it closes the handle; another GPU at the bus id is refused;
inputs on another device are a ValueError. The real path against ``--backend=cuda`` skips
without a CUDA device.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, List

import grpc
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

import fake_cudart  # noqa: E402
from daemon import Daemon, flag_missing_reason  # noqa: E402
from fake_cudart import BUS, OTHER_UUID, UUID, FakeCudart, ShmAsDeviceMemory  # noqa: E402
from kvcache_client import KvCacheClient, KvCacheError  # noqa: E402
from kvcache_client.torch import (DecodeLoop, DenseKvCache, KvPoolMapping,  # noqa: E402
                                  PooledKvCache)

LAYERS, KV_HEADS, HEADS, DIM, TPB = 2, 2, 4, 8, 8
#: (policy, prefill, budget): large first evictions (compaction), a lazy policy's steps
#: without scores, and a budget that keeps evicting every step
SEQUENCES = [("inertia", 40, 6), ("tova", 30, 12), ("inertia_lazy4", 50, 5)]
STEPS = 12
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _pool_flags(backend: str, pool_bytes: int, dtype: str) -> List[str]:
    return [f"--backend={backend}", f"--pool_memory_bytes={pool_bytes}",
            f"--kv_layers={LAYERS}", f"--kv_heads={KV_HEADS}", f"--kv_head_dim={DIM}",
            f"--kv_tokens_per_block={TPB}", f"--kv_dtype={dtype}"]


@pytest.fixture(scope="module", params=list(DTYPES))
def pool_daemon(request, tmp_path_factory):
    """A daemon holding host shared-memory KV pools of dtype ``request.param``."""
    reason = flag_missing_reason("pool_memory_bytes")
    if reason:
        pytest.skip(reason)
    daemon = Daemon(tmp_path_factory.mktemp(f"kvcached-pool-{request.param}"),
                    *_pool_flags("host", 1 << 20, request.param)).start()
    daemon.dtype = request.param
    yield daemon
    daemon.stop()


@pytest.fixture
def client(pool_daemon):
    with KvCacheClient(pool_daemon.address, timeout=30) as c:
        yield c


def as_cuda_pool(pool, memory: ShmAsDeviceMemory, **fields):
    """``pool`` (a host pool) as a --backend=cuda daemon describes its pool, the handle
    naming the shared-memory object the fake runtime maps in its place."""
    values = dict(backend="cuda", shm_name="", cuda_ipc_handle=memory.handle_for(pool.shm_name),
                  device=0, device_uuid=UUID, device_pci_bus_id=BUS)
    values.update(fields)
    return dataclasses.replace(pool, **values)


def attend(q, keys, values):
    """Softmax attention of one token's queries ``[heads, d]`` over ``[kv_heads, n, d]``
    (GQA: query head h reads KV head h // group), in float32."""
    group = q.shape[0] // keys.shape[0]
    k = keys.float().repeat_interleave(group, dim=0)
    v = values.float().repeat_interleave(group, dim=0)
    weights = torch.softmax(torch.einsum("hd,hnd->hn", q.float(), k) / DIM ** 0.5, dim=-1)
    return torch.einsum("hn,hnd->hd", weights, v)


def model_step(seed: int, cache, capture, dtype, device="cpu"):
    """One 'model' step of one sequence: random q/k/v per layer from ``seed``; appends to
    the cache and attends over what it returns. Returns the attention outputs."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(LAYERS):
        q = torch.randn(HEADS, DIM, generator=generator).to(device)
        k = torch.randn(KV_HEADS, DIM, generator=generator).to(dtype).to(device)
        v = torch.randn(KV_HEADS, DIM, generator=generator).to(dtype).to(device)
        keys, values = cache.extend(layer, k, v)
        if capture is not None:
            capture.add(q, keys, values)
        out.append(attend(q, keys, values))
    return out


def decode_against_dense(client, mapping, seq_id, dtype, device="cpu") -> int:
    """Decodes SEQUENCES twice in one batch, pooled in ``mapping`` and dense; checks at
    every step that both attend alike, hold the same K/V, and that the pooled slots are the
    daemon's. Returns the number of compaction moves the daemon made."""
    generator = torch.Generator().manual_seed(7)
    with client.batch() as batch:
        loop = DecodeLoop(batch)
        pairs: Dict[str, tuple] = {}
        for index, (policy, prefill, budget) in enumerate(SEQUENCES):
            dense_id, pooled_id = seq_id(f"dense{index}"), seq_id(f"pooled{index}")
            for sid in (dense_id, pooled_id):
                batch.open(sid, prefill, budget_tokens=budget, policy=policy)
            keys = [torch.randn(KV_HEADS, prefill, DIM, generator=generator).to(dtype)
                    .to(device) for _ in range(LAYERS)]
            values = [torch.randn(KV_HEADS, prefill, DIM, generator=generator).to(dtype)
                      .to(device) for _ in range(LAYERS)]
            dense = DenseKvCache(keys, values)
            pooled = PooledKvCache.open(client, mapping, pooled_id)
            assert len(pooled.slots) == prefill
            pooled.load_prefill(keys, values)
            for layer in range(LAYERS):
                assert torch.equal(pooled.keys(layer), dense.keys(layer))
            loop.add(dense_id, dense)
            loop.add(pooled_id, pooled)
            pairs[pooled_id] = (dense_id, dense, pooled)
        moves = evictions = 0
        for step in range(1, STEPS + 1):
            captures = loop.begin()
            for pooled_id, (dense_id, dense, pooled) in pairs.items():
                seed = int(torch.randint(0, 1 << 30, (1,), generator=generator))
                want = model_step(seed, dense, captures[dense_id], dtype, device)
                got = model_step(seed, pooled, captures[pooled_id], dtype, device)
                for layer in range(LAYERS):
                    torch.testing.assert_close(got[layer], want[layer], rtol=0, atol=0)
            decisions = loop.finish(captures)
            for pooled_id, (dense_id, dense, pooled) in pairs.items():
                assert decisions[pooled_id].evicted == decisions[dense_id].evicted, step
                evictions += len(decisions[pooled_id].evicted)
                moves += sum(len(c.moves) for c in decisions[pooled_id].kv_changes)
                state = client.inspect(pooled_id, include_cache=True)
                assert pooled.positions == dense.positions == state.positions
                assert pooled.slots == state.kv_slots[0]
                for layer in range(LAYERS):
                    assert torch.equal(pooled.keys(layer), dense.keys(layer)), (step, layer)
                    assert torch.equal(pooled.values(layer), dense.values(layer))
        assert evictions > 0
        return moves


def test_a_cuda_pool_decodes_like_dense_caches_and_writes_the_daemons_memory(
        client, pool_daemon, seq_id, monkeypatch):
    log: List[tuple] = []
    memory = ShmAsDeviceMemory()
    fake = FakeCudart({BUS: 2}, log)
    fake_cudart.install(monkeypatch, fake, memory)
    host_pool = next(p for p in client.describe_kv_pools() if p.rank == 0)
    cuda_pool = as_cuda_pool(host_pool, memory)
    dtype = DTYPES[pool_daemon.dtype]
    with KvPoolMapping(cuda_pool) as mapping:
        # Opened through the CUDA runtime on this process's ordinal of the GPU at BUS.
        assert log == [("by_bus_id", BUS), ("set_device", 2),
                       ("open", cuda_pool.cuda_ipc_handle, 1, 2), ("set_device", 0)]
        assert mapping.blocks.dtype == dtype
        assert mapping.blocks.shape == (host_pool.capacity_blocks, LAYERS, 2, TPB, KV_HEADS,
                                        DIM)
        moves = decode_against_dense(client, mapping, seq_id, dtype)
        # The daemon moved tokens the cache had written through the "device" tensor, in
        # its own memory; the gathers after the moves found them where its table says.
        assert moves > 0
    assert [c[0] for c in log[-1:]] == ["close"] and not memory.open


def test_closing_a_cuda_pool_drops_the_tensor_then_closes_the_handle(client, seq_id,
                                                                    monkeypatch):
    memory = ShmAsDeviceMemory()
    fake = FakeCudart({BUS: 0})
    fake_cudart.install(monkeypatch, fake, memory)
    pool = as_cuda_pool(next(p for p in client.describe_kv_pools() if p.rank == 0), memory)
    mapping = KvPoolMapping(pool)
    sid = seq_id()
    client.open_sequence(sid, 20, budget_tokens=8)
    cache = PooledKvCache.open(client, mapping, sid)
    blocks = weakref.ref(mapping.blocks)
    tensor_alive_at_close: List[bool] = []
    fake.close_memory = lambda pointer: (tensor_alive_at_close.append(blocks() is not None),
                                         memory.unmap(pointer))
    mapping.close()
    assert tensor_alive_at_close == [False]
    assert [c[0] for c in fake.log].count("close") == 1 and not memory.open
    mapping.close()  # once
    assert [c[0] for c in fake.log].count("close") == 1
    assert mapping.blocks is None
    with pytest.raises(ValueError, match="mapping is closed"):
        cache.keys(0)


def test_a_cuda_pool_on_another_gpu_at_that_bus_id_is_refused(client, monkeypatch):
    memory = ShmAsDeviceMemory()
    fake = FakeCudart({BUS: 1})
    fake_cudart.install(monkeypatch, fake, memory, uuid_of=lambda device: OTHER_UUID)
    pool = as_cuda_pool(next(p for p in client.describe_kv_pools() if p.rank == 0), memory)
    with pytest.raises(KvCacheError) as caught:
        KvPoolMapping(pool)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    message = caught.value.message
    assert "rank 0's KV pool" in message and UUID in message and OTHER_UUID in message
    assert not [c for c in fake.log if c[0] == "open"] and not memory.open
    fake.devices = {}  # no GPU at that bus id at all
    with pytest.raises(KvCacheError) as caught:
        KvPoolMapping(pool)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert BUS in caught.value.message


def test_a_cuda_pool_the_gpu_could_not_export_is_refused_with_the_daemons_reason(
        client, monkeypatch):
    memory = ShmAsDeviceMemory()
    fake = FakeCudart({BUS: 0})
    fake_cudart.install(monkeypatch, fake, memory)
    why = "GPU 0 is in exclusive-process compute mode: only kvcached may hold a context"
    pool = as_cuda_pool(next(p for p in client.describe_kv_pools() if p.rank == 0), memory,
                        cuda_ipc_handle=b"", export_unavailable=why)
    with pytest.raises(ValueError, match="rank 0's CUDA KV pool cannot be mapped") as caught:
        KvPoolMapping(pool)
    assert why in str(caught.value) and "DenseKvCache" in str(caught.value)
    assert not fake.log, "nothing was opened"
    # A host daemon's pools are exported: the field is there and empty.
    assert all(p.export_unavailable == "" for p in client.describe_kv_pools())


def test_k_and_v_on_another_device_than_the_pool_are_refused(client, seq_id):
    with KvPoolMapping.for_rank(client, 0) as mapping:
        sid = seq_id()
        client.open_sequence(sid, 10, budget_tokens=4)
        cache = PooledKvCache.open(client, mapping, sid)
        elsewhere = torch.empty(KV_HEADS, DIM, device="meta")
        with pytest.raises(ValueError, match="layer 0's new K/V is on meta.*on cpu"):
            cache.extend(0, elsewhere, elsewhere)
        prefill = [torch.empty(KV_HEADS, 10, DIM, device="meta")] * LAYERS
        with pytest.raises(ValueError, match="prefill's K/V is on meta"):
            cache.load_prefill(prefill, prefill)
        k = torch.zeros(KV_HEADS, DIM, dtype=mapping.blocks.dtype)
        cache.extend(0, k, k)  # the refused call pended nothing: layer 0 is free


# -- a real GPU ------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_pool_of_a_cuda_daemon_decodes_like_dense_caches_on_the_gpu(tmp_path_factory,
                                                                           seq_id):
    """The real path: a --backend=cuda daemon's pool opened by IPC, K/V written and
    gathered on the GPU, the daemon compacting it on the GPU."""
    reason = flag_missing_reason("backend")
    if reason:
        pytest.skip(reason)
    daemon = Daemon(tmp_path_factory.mktemp("kvcached-cuda-pool"),
                    *_pool_flags("cuda", 4 << 20, "float32")).start()
    try:
        with KvCacheClient(daemon.address, timeout=30) as client:
            pool = next(p for p in client.describe_kv_pools() if p.rank == 0)
            assert pool.backend == "cuda" and pool.cuda_ipc_handle, pool
            with KvPoolMapping(pool) as mapping:
                assert mapping.device.type == "cuda" and mapping.blocks.is_cuda
                moves = decode_against_dense(client, mapping, seq_id, torch.float32,
                                             device=mapping.device)
                assert moves > 0
    finally:
        daemon.stop()
