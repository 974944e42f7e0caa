"""Disaggregated hand-off between two real kvcached processes on loopback
(docs/DISAGGREGATION.md): a sequence stepped once on a 'prefill' daemon A is imported by a
'decode' daemon B (ImportSequence) and decoded on there. B's decisions are those a single
daemon makes, its pool holds the K/V A held, A gives the sequence up only at the commit,
and a failed import leaves B holding nothing while A serves on."""

import concurrent.futures
import math
import time

import grpc
import pytest

from kvcache.v1 import kvcache_pb2 as pb
from kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvcache_client import KvCacheClient, KvCacheError, Report

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from kvcache_client.torch import DecodeLoop, KvPoolMapping, PooledKvCache  # noqa: E402

LAYERS, KV_HEADS, HEADS, DIM, TPB = 2, 2, 4, 8, 8
BLOCK_BYTES = TPB * 2 * LAYERS * KV_HEADS * DIM * 4  # float32
PROMPT = 64


def pool_flags(head_dim: int = DIM) -> list:
    return ["--backend=host", f"--pool_memory_bytes={1 << 20}", f"--kv_layers={LAYERS}",
            f"--kv_heads={KV_HEADS}", f"--kv_head_dim={head_dim}",
            f"--kv_tokens_per_block={TPB}", "--kv_dtype=float32"]


def fake_step(generator, cache, capture):
    """One 'model' step: random q/k/v per layer, attending over what the cache returns."""
    for layer in range(LAYERS):
        q = torch.randn(HEADS, DIM, generator=generator)
        k = torch.randn(KV_HEADS, DIM, generator=generator)
        v = torch.randn(KV_HEADS, DIM, generator=generator)
        keys, values = cache.extend(layer, k, v)
        if capture is not None:
            capture.add(q, keys, values)


def step_both(loops, caches, seed):
    """One step of each (loop, sequence id) with the same q/k/v: their decisions."""
    out = []
    for loop, sid in loops:
        captures = {sid: loop.begin()[sid]}
        fake_step(torch.Generator().manual_seed(seed), caches[sid], captures[sid])
        out.append(loop.finish(captures)[sid])
    return out


def used_blocks(client) -> int:
    return sum(p.used_blocks for p in client.describe_kv_pools())


@pytest.mark.parametrize("kv_transfer", ["grpc", "ucx"])
@pytest.mark.parametrize("policy", ["inertia", "score_free"])
def test_a_sequence_imported_after_step_one_decodes_as_on_one_daemon(start_daemon, kv_transfer,
                                                                     policy):
    a = start_daemon(*pool_flags(), f"--kv_transfer={kv_transfer}")
    b = start_daemon(*pool_flags(), f"--kv_transfer={kv_transfer}")
    g = torch.Generator().manual_seed(5)
    keys = [torch.randn(KV_HEADS, PROMPT, DIM, generator=g) for _ in range(LAYERS)]
    values = [torch.randn(KV_HEADS, PROMPT, DIM, generator=g) for _ in range(LAYERS)]
    with KvCacheClient(a.address, timeout=30) as ca, KvCacheClient(b.address, timeout=30) as cb, \
            KvPoolMapping.for_rank(ca, 0) as map_a, KvPoolMapping.for_rank(cb, 0) as map_b, \
            ca.batch() as batch_a, cb.batch() as batch_b:
        caches = {}
        for sid in ("ref", "moved"):  # "ref" stays on A throughout: the single-daemon run
            batch_a.open(sid, PROMPT, compression_ratio=0.9, policy=policy)
            caches[sid] = PooledKvCache.open(ca, map_a, sid)
            caches[sid].load_prefill(keys, values)
        loop_a = DecodeLoop(batch_a)
        for sid in caches:
            loop_a.add(sid, caches[sid])
        first = step_both([(loop_a, "ref"), (loop_a, "moved")], caches, seed=1)
        assert first[0].evicted == first[1].evicted and first[0].cache_size == 6  # B = 6
        before = ca.inspect("moved", include_cache=True)
        held_k = [caches["moved"].keys(layer) for layer in range(LAYERS)]
        held_v = [caches["moved"].values(layer) for layer in range(LAYERS)]
        a_blocks, b_blocks = used_blocks(ca), used_blocks(cb)

        imported = cb.import_sequence("moved", a.address)

        state = imported.state
        assert (state.sequence_id, state.last_step, state.prefill_len) == ("moved", 1, PROMPT)
        assert state.positions == before.positions and state.momentum == before.momentum
        assert (state.budget, state.cache_size) == (before.budget, before.cache_size)
        assert state.policy == before.policy and state.next_needs_scores == (policy == "inertia")
        assert imported.transport == kv_transfer
        leased = used_blocks(cb) - b_blocks
        assert leased >= math.ceil(state.cache_size / TPB)
        assert imported.kv_bytes == leased * BLOCK_BYTES
        assert imported.kv_bytes < math.ceil(PROMPT / TPB) * BLOCK_BYTES  # B tokens, not L0
        assert imported.record_bytes > 0 and imported.seconds > 0
        # The source closed it at the commit and gave its blocks back.
        with pytest.raises(KvCacheError) as gone:
            ca.inspect("moved")
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        assert used_blocks(ca) < a_blocks
        assert cb.inspect("moved", include_cache=True).kv_slots == state.kv_slots

        # The decode worker: B's pool holds what A's did, at B's slots.
        loop_a.remove("moved")
        batch_a.remove("moved")
        batch_b.add("moved", state=state)
        caches["moved"] = PooledKvCache.adopt(map_b, imported)
        assert caches["moved"].next_position == PROMPT + 1
        for layer in range(LAYERS):
            assert torch.equal(caches["moved"].keys(layer), held_k[layer])
            assert torch.equal(caches["moved"].values(layer), held_v[layer])
        loop_b = DecodeLoop(batch_b)
        loop_b.add("moved", caches["moved"])
        for step in range(2, 14):
            ref, moved = step_both([(loop_a, "ref"), (loop_b, "moved")], caches, seed=step)
            assert (moved.step, moved.evicted, moved.cache_size, moved.next_needs_scores) == \
                (ref.step, ref.evicted, ref.cache_size, ref.next_needs_scores), step
            assert caches["moved"].positions == caches["ref"].positions
            for layer in range(LAYERS):
                assert torch.equal(caches["moved"].keys(layer), caches["ref"].keys(layer))
        after_b = cb.inspect("moved", include_cache=True)
        after_a = ca.inspect("ref", include_cache=True)
        assert after_b.positions == after_a.positions and after_b.momentum == after_a.momentum
        if policy == "score_free":  # scored once, at step 1 on A; B never asked for scores
            assert loop_b.stats["scoring_steps"] == 0
        del caches, held_k, held_v


def test_an_import_without_kv_pools_moves_only_the_engine_state(start_daemon):
    a, b = start_daemon(), start_daemon()
    rows = lambda step, n: [[float((i * 5 + step) % 11) for i in range(n)]]  # noqa: E731
    with KvCacheClient(a.address, timeout=30) as ca, KvCacheClient(b.address, timeout=30) as cb:
        for sid in ("ref", "moved"):
            ca.open_sequence(sid, 40, budget_tokens=5, policy="tova")
        decisions = ca.step([Report(sid, 1, rows(1, 41)) for sid in ("ref", "moved")])
        assert decisions[0].evicted == decisions[1].evicted
        with cb.batch() as batch_b, ca.batch() as batch_a:
            batch_a.add("ref")
            imported = batch_b.import_sequence("moved", a.address)
            assert (imported.transport, imported.kv_bytes) == ("none", 0)
            assert imported.state.kv_slots == {} and len(imported.state.positions) == 5
            for step in range(2, 8):
                ref = batch_a.step({"ref": rows(step, 6)})["ref"].raise_for_status()
                moved = batch_b.step({"moved": rows(step, 6)})["moved"].raise_for_status()
                assert (moved.step, moved.evicted) == (ref.step, ref.evicted)
        assert [s.sequence_id for s in ca.list_sequences()] == ["ref"]


def test_a_failed_import_leaves_nothing_here_and_the_source_serving(start_daemon):
    a, b = start_daemon(), start_daemon()
    with KvCacheClient(a.address, timeout=30) as ca, KvCacheClient(b.address, timeout=30) as cb:
        ca.open_sequence("s", 20, budget_tokens=4, policy="tova")
        cases = [("unknown", a.address, grpc.StatusCode.NOT_FOUND, "unknown"),
                 ("s", "127.0.0.1:1", grpc.StatusCode.UNAVAILABLE, "127.0.0.1:1")]
        for sid, source, code, words in cases:
            with pytest.raises(KvCacheError) as error:
                cb.import_sequence(sid, source, timeout=20)
            assert error.value.code == code, error.value
            daemon_said = error.value.message.split(": ", 1)[1]  # past the client's prefix
            assert words in daemon_said
            assert cb.list_sequences() == []
        cb.open_sequence("s", 20, budget_tokens=4, policy="tova")  # the id is taken at B
        with pytest.raises(KvCacheError) as error:
            cb.import_sequence("s", a.address)
        assert error.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert cb.inspect("s").last_step == 0
        # A serves it on, unchanged.
        decision = ca.step([Report("s", 1, [[0.5] * 21])])[0]
        assert decision.ok and decision.cache_size == 4


def test_daemons_with_different_pools_refuse_the_hand_off(start_daemon):
    a = start_daemon(*pool_flags())
    b = start_daemon(*pool_flags(head_dim=2 * DIM))
    c = start_daemon()  # no pools at all
    with KvCacheClient(a.address, timeout=30) as ca:
        ca.open_sequence("s", 20, budget_tokens=4, policy="tova")
        for target in (b, c):
            with KvCacheClient(target.address, timeout=30) as ct:
                with pytest.raises(KvCacheError) as error:
                    ct.import_sequence("s", a.address)
                assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION, error.value
                assert ct.list_sequences() == []
        assert ca.step([Report("s", 1, [[0.5] * 21])])[0].ok


def test_the_source_freezes_a_sequence_while_it_is_exported(start_daemon):
    """KvPeer directly: between ExportSequence and FinishExport the source refuses the
    sequence's steps and a second hand-off; an abort gives it back unchanged."""
    a, b = start_daemon(), start_daemon()
    with KvCacheClient(a.address, timeout=30) as ca, KvCacheClient(b.address, timeout=30) as cb, \
            grpc.insecure_channel(a.address) as channel:
        peer = pb_grpc.KvPeerStub(channel)
        ca.open_sequence("s", 20, budget_tokens=4, policy="tova")
        export = peer.ExportSequence(pb.ExportSequenceRequest(sequence_id="s"), timeout=30)
        assert export.export_id != 0 and export.record and export.pool_ranks == 0
        refused = ca.step([Report("s", 1, [[0.5] * 21])])[0]
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "being handed off" in refused.message
        with pytest.raises(KvCacheError) as error:
            cb.import_sequence("s", a.address)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "handed off" in error.value.message
        assert cb.list_sequences() == []
        done = peer.FinishExport(pb.FinishExportRequest(export_id=export.export_id,
                                                        commit=False), timeout=30)
        assert not done.committed
        again = peer.FinishExport(pb.FinishExportRequest(export_id=export.export_id,
                                                         commit=False), timeout=30)
        assert not again.committed  # idempotent
        assert ca.step([Report("s", 1, [[0.5] * 21])])[0].ok
        assert cb.import_sequence("s", a.address).state.last_step == 1


def test_a_pending_tensor_parallel_step_is_not_handed_off(start_daemon):
    a, b = start_daemon(), start_daemon()
    rows = [[0.25] * 9]
    with KvCacheClient(a.address, timeout=30) as ca, KvCacheClient(b.address, timeout=30) as cb, \
            concurrent.futures.ThreadPoolExecutor(1) as pool, \
            ca.stream(rank=0, timeout=30) as rank0, ca.stream(rank=1, timeout=30) as rank1:
        ca.open_sequence("tp", 8, budget_tokens=3, tp_world_size=2)
        waiting = pool.submit(rank0.send, [Report("tp", 1, rows, head_count=1)])
        deadline = time.monotonic() + 10
        while ca.inspect("tp").ranks_reported < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(KvCacheError) as error:
            cb.import_sequence("tp", a.address)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert cb.list_sequences() == []
        decided = rank1.send([Report("tp", 1, rows, head_count=1)])[0]
        assert decided.ok and waiting.result(timeout=10)[0].evicted == decided.evicted
        imported = cb.import_sequence("tp", a.address)
        assert (imported.state.tp_world_size, imported.state.last_step) == (2, 1)


def test_peers_present_a_peer_token_and_tenants_stay_apart(start_daemon, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# token tenant [peer]\ntoken-a team-a\ntoken-b team-b\n"
                      "node-secret nodes peer\n")
    peer_token = tmp_path / "peer-token"
    peer_token.write_text("node-secret\n")
    auth = f"--auth_tokens_file={tokens}"
    a = start_daemon(auth)
    b = start_daemon(auth, f"--peer_token_file={peer_token}")
    b_without = start_daemon(auth)
    with KvCacheClient(a.address, timeout=30, token="token-a") as ca:
        ca.open_sequence("s", 20, budget_tokens=4, policy="tova")
        # A worker's token is no peer credential: KvPeer refuses it.
        with grpc.insecure_channel(a.address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.KvPeerStub(channel).ExportSequence(
                    pb.ExportSequenceRequest(sequence_id="s", tenant="team-a"), timeout=30,
                    metadata=[("authorization", "Bearer token-a")])
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
        # A daemon without the peer token cannot take it.
        with KvCacheClient(b_without.address, timeout=30, token="token-a") as cw:
            with pytest.raises(KvCacheError) as error:
                cw.import_sequence("s", a.address)
            assert error.value.code == grpc.StatusCode.UNAUTHENTICATED, error.value
            assert "peer" in error.value.message
            assert cw.list_sequences() == []
        # Another tenant at the target does not see team-a's sequence.
        with KvCacheClient(b.address, timeout=30, token="token-b") as cb:
            with pytest.raises(KvCacheError) as error:
                cb.import_sequence("s", a.address)
            assert error.value.code == grpc.StatusCode.NOT_FOUND
        assert ca.inspect("s").last_step == 0  # still A's
        with KvCacheClient(b.address, timeout=30, token="token-a") as cb:
            imported = cb.import_sequence("s", a.address)
            assert imported.state.sequence_id == "s"
            assert [s.sequence_id for s in cb.list_sequences()] == ["s"]
        with KvCacheClient(b.address, timeout=30, token="token-b") as other:
            assert other.list_sequences() == []  # opened under team-a, as at the source


def test_the_peer_port_serves_the_hand_off(start_daemon, tmp_path):
    """--peer_listen on a unix socket: the target reaches the source there ("unix:/path")."""
    socket = tmp_path / "peer.sock"
    a = start_daemon(f"--peer_listen=unix:{socket}")
    b = start_daemon()
    with KvCacheClient(a.address, timeout=30) as ca, KvCacheClient(b.address, timeout=30) as cb:
        ca.open_sequence("s", 20, budget_tokens=4, policy="tova")
        assert ca.step([Report("s", 1, [[0.5] * 21])])[0].ok
        imported = cb.import_sequence("s", f"unix:{socket}")
        assert imported.state.last_step == 1 and ca.list_sequences() == []


def test_the_python_md_handoff_example_runs(start_daemon):
    """docs/PYTHON.md "Disaggregated serving": its example, against two daemons."""
    import contextlib
    import io
    import re

    from daemon import REPO_ROOT
    flags = ["--pool_memory_bytes=1048576", "--kv_layers=2", "--kv_heads=2", "--kv_head_dim=8",
             "--kv_dtype=float32"]
    prefill, decode = start_daemon(*flags), start_daemon(*flags)
    text = (REPO_ROOT / "docs" / "PYTHON.md").read_text()
    section = text[text.index("## Disaggregated serving"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = re.sub(r'^PREFILL = .*$', f'PREFILL = "{prefill.address}"', code, flags=re.M)
    code = re.sub(r'^DECODE = .*$', f'DECODE = "{decode.address}"', code, flags=re.M)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/PYTHON.md (Disaggregated serving)", "exec"), {})
    assert out.getvalue().split() == ["4096", "6", "69", "0"]
