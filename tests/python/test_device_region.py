"""Device score regions: the Python path a torch worker takes with a GPU-engine kvcached,
run here on host memory (the emulated device engine and the CPU engine create their regions
in shared memory, and ``ScoreRegion.tensor`` is the same torch view either way).

Against real daemons (``--engine_backend=emulated`` and ``cpu``, ``--allow_shm_scores``):
writes through ``region.tensor`` are what the daemon reads (its decisions equal those of
inline reports of the same scores, random rows, several steps, per-layer and folded,
float32/float16/bfloat16); a torch tensor's scores land in the region as exactly the inline
bytes; a worker without torch still steps through the region. The CUDA side's logic with a
fake runtime (the GPU by bus id and UUID, the handle opened on the right device, errors,
the close order, one event wait per batch before its send), the fake "device memory" being
the daemon's own region so that the daemon's decisions check the writes. And the real path
against a ``--engine_backend=cuda`` daemon, which skips without a CUDA device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import weakref
import zlib
from typing import Any, Dict, List

import grpc
import pytest

import fake_cudart
from daemon import Daemon, flag_missing_reason
from fake_cudart import BUS, OTHER_UUID, UUID, FakeCudart, ShmAsDeviceMemory
from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import KvCacheClient, KvCacheError, Scores, encode_scores
from kvcache_client import cuda_runtime
from kvcache_client import region as region_module
from kvcache_client._proto import dtype_to_proto
from kvcache_client.cuda_runtime import CudaRuntime
from kvcache_client.scores import prepare_scores

try:
    import torch
except ImportError:  # pragma: no cover - scripts/install-deps.sh installs it
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

REGION_BYTES = 1 << 16
PREFILL, BUDGET, STEPS = 40, 24, 6
TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _start(tmp_path_factory, tag: str, *flags: str) -> Daemon:
    for flag in ("allow_shm_scores", "engine_backend"):
        reason = flag_missing_reason(flag)
        if reason:
            pytest.skip(reason)
    return Daemon(tmp_path_factory.mktemp(f"kvcached-{tag}"), *flags).start()


@pytest.fixture(scope="module", params=["emulated", "cpu"])
def engine_daemon(request, tmp_path_factory):
    """A daemon taking score regions, with the emulated device engine or the CPU engine."""
    daemon = _start(tmp_path_factory, request.param, "--allow_shm_scores",
                    f"--engine_backend={request.param}")
    yield daemon
    daemon.stop()


@pytest.fixture
def engine_client(engine_daemon):
    with KvCacheClient(engine_daemon.address, timeout=30) as client:
        yield client


def outcome(decision) -> tuple:
    decision.raise_for_status()
    return decision.step, sorted(decision.evicted), decision.cache_size, \
        decision.next_needs_scores


def open_options(layout: str, dtype: str, layers: int) -> Dict[str, Any]:
    options: Dict[str, Any] = {"prefill_len": PREFILL, "budget_tokens": BUDGET,
                               "score_dtype": dtype}
    if layout == "folded":
        options.update(score_layout="folded", layers=layers)
    return options


# -- real daemons: region.tensor is the daemon's memory -----------------------------------

@needs_torch
@pytest.mark.parametrize("layout", ["per_layer", "folded"])
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_writes_through_the_region_tensor_are_what_the_daemon_reads(engine_client, seq_id,
                                                                      layout, dtype):
    """Scores written straight into ``region.tensor`` and named by ScoreRefs decide as the
    same bytes sent inline do, step after step, for two sequences in one batch."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{layout}-{dtype}".encode()))
    layers = 3
    rows = 1 if layout == "folded" else layers
    wire = getattr(torch, dtype)
    element = torch.empty((), dtype=wire).element_size()
    ids = [seq_id("a"), seq_id("b")]
    inline = engine_client.batch()
    with engine_client.stream(score_region_bytes=REGION_BYTES,
                              daemon_score_region=True) as stream:
        region = stream.score_region
        assert not region.on_device and region.device == "cpu"
        view = region.tensor
        assert view.dtype == torch.uint8 and view.shape == (REGION_BYTES,)
        twins = {}
        for sid in ids:
            engine_client.open_sequence(sid, **open_options(layout, dtype, layers))
            twins[sid] = f"{sid}-inline"
            inline.open(twins[sid], **open_options(layout, dtype, layers))
        tokens = {sid: PREFILL + 1 for sid in ids}
        for step in range(1, STEPS + 1):
            reports, inline_scores, offset = [], {}, 0
            for sid in ids:
                values = torch.rand(rows, tokens[sid], generator=generator) + 0.01
                nbytes = values.numel() * element
                view[offset:offset + nbytes].view(wire).view(rows, tokens[sid]).copy_(values)
                raw = view[offset:offset + nbytes].numpy().tobytes()
                message = pb.StepReport(sequence_id=sid, step=step, layers=rows,
                                        dtype=dtype_to_proto(dtype))
                message.score_ref.region = region.region_id
                message.score_ref.offset = offset
                message.score_ref.byte_size = nbytes
                reports.append(message)
                inline_scores[twins[sid]] = Scores(raw, dtype=dtype, layers=rows)
                offset += -(-nbytes // 64) * 64
            got = stream.send(reports)
            want = inline.step(inline_scores)
            for sid, decision in zip(ids, got):
                assert outcome(decision) == outcome(want[twins[sid]]), (sid, step)
                tokens[sid] = decision.cache_size + 1
        assert got[0].cache_size == BUDGET and got[0].evicted, "nothing was decided"
    inline.close()


@needs_torch
@pytest.mark.parametrize("layout", ["per_layer", "folded"])
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_scores_go_into_the_region_as_their_inline_bytes(engine_client, seq_id,
                                                                layout, dtype):
    """A batch over a daemon-created region takes torch tensors (float64 and a transposed
    float32 here: converted by copy_ into the region) and decides as the inline batch;
    the region then holds exactly the inline packing of the last step."""
    generator = torch.Generator().manual_seed(7 + len(dtype) + len(layout))
    layers = 4
    rows = 1 if layout == "folded" else layers
    sid = seq_id()
    with engine_client.batch() as inline, \
            engine_client.batch(score_region_bytes=REGION_BYTES,
                                daemon_score_region=True) as through:
        inline.open(sid, **open_options(layout, dtype, layers))
        through.open(f"{sid}-r", **open_options(layout, dtype, layers))
        for step in range(STEPS):
            tokens = through.sequences[f"{sid}-r"].tokens
            if step % 2:
                scores = torch.rand(tokens, rows, generator=generator).t()  # not contiguous
            else:
                scores = torch.rand(rows, tokens, generator=generator,
                                    dtype=torch.float64) + 0.01
            got = through.step({f"{sid}-r": scores})[f"{sid}-r"]
            want = inline.step({sid: scores})[sid]
            assert outcome(got) == outcome(want), step
            packed = encode_scores(scores, dtype=dtype).data
            assert through.score_region.tensor[:len(packed)].numpy().tobytes() == packed
        assert (through.score_region.region_reports, through.score_region.inline_reports) \
            == (STEPS, 0)


@needs_torch
@pytest.mark.parametrize("source,wire", [
    (source, wire) for source in ("float64", "float32", "float16", "bfloat16", "raw16")
    for wire in TORCH_DTYPES if not (source == "raw16" and wire == "float32")])
def test_the_tensor_writer_packs_the_bytes_of_the_buffer_writer(source, wire):
    """write_into_tensor (copy_ into a uint8 tensor) and write_into (a memoryview, what
    inline reports carry) give the same bytes, for every source and wire dtype; for float32
    sources also the pure-Python packing's."""
    values = torch.rand(3, 37, generator=torch.Generator().manual_seed(3)) * 7
    values[0, :4] = torch.tensor([0.0, 1e-8, 65504.0, 1e5])  # tiny, largest half, overflow
    if source == "raw16":  # float16 or bfloat16 bits
        tensor = values.to(getattr(torch, wire)).view(torch.int16)
    else:
        tensor = values.to(getattr(torch, source))
    prepared = prepare_scores(tensor, dtype=wire)
    assert prepared.from_tensor
    target = torch.full((prepared.nbytes,), 0xAB, dtype=torch.uint8)
    prepared.write_into_tensor(target)
    assert target.numpy().tobytes() == prepared.to_bytes()
    if source == "float32":
        assert prepared.to_bytes() == encode_scores(values.tolist(), dtype=wire).data
    with pytest.raises(ValueError):
        prepared.write_into_tensor(torch.zeros(prepared.nbytes + 1, dtype=torch.uint8))


@needs_torch
def test_other_scores_reach_a_tensor_through_host_packing():
    """Lists (no tensor writer) go into a tensor target as their packed bytes."""
    rows = [[0.5, 0.25, 3.0], [1.0, 2.0, 0.125]]
    prepared = prepare_scores(rows, dtype="bfloat16")
    assert not prepared.from_tensor
    target = torch.zeros(prepared.nbytes, dtype=torch.uint8)
    prepared.write_into_tensor(target)
    assert target.numpy().tobytes() == encode_scores(rows, dtype="bfloat16").data


NO_TORCH_WORKER = """
import json, sys
sys.modules["torch"] = None  # this worker has no torch: importing it fails
from kvcache_client import KvCacheClient
address, sid, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = []
with KvCacheClient(address, timeout=30) as client:
    with client.batch(score_region_bytes=1 << 16, daemon_score_region=True) as batch:
        batch.open(sid, prefill_len=40, budget_tokens=24)
        for step in range(steps):
            tokens = batch.sequences[sid].tokens
            rows = [[((7 * i + 3 * l + step) % 11 + 1) / 16 for i in range(tokens)]
                    for l in range(2)]
            d = batch.step({sid: rows})[sid].raise_for_status()
            out.append([d.step, sorted(d.evicted), d.cache_size])
        region = batch.score_region
        try:
            region.tensor
            tensor = "made"
        except ImportError:
            tensor = "ImportError"
        print(json.dumps({"decisions": out, "region_reports": region.region_reports,
                          "tensor": tensor, "cuda": "kvcache_client.cuda_runtime" in sys.modules}))
"""


def test_a_worker_without_torch_still_steps_through_a_daemon_region(engine_daemon,
                                                                    engine_client, seq_id):
    sid = seq_id()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", NO_TORCH_WORKER, engine_daemon.address,
                           sid, str(STEPS)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["region_reports"] == STEPS and result["tensor"] == "ImportError"
    assert result["cuda"] is False  # a host region never loads the CUDA binding
    want = []
    with engine_client.batch() as inline:
        inline.open(f"{sid}-inline", prefill_len=40, budget_tokens=24)
        for step in range(STEPS):
            tokens = inline.sequences[f"{sid}-inline"].tokens
            rows = [[((7 * i + 3 * l + step) % 11 + 1) / 16 for i in range(tokens)]
                    for l in range(2)]
            d = inline.step({f"{sid}-inline": rows})[f"{sid}-inline"].raise_for_status()
            want.append([d.step, sorted(d.evicted), d.cache_size])
    assert result["decisions"] == want


def test_importing_the_client_loads_no_cuda():
    code = ("import sys, kvcache_client, kvcache_client.region, kvcache_client.stream\n"
            "maps = open('/proc/self/maps').read()\n"
            "print('libcudart' in maps, 'kvcache_client.cuda_runtime' in sys.modules)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


# -- the CUDA side's logic, with a fake runtime -------------------------------------------

def fake_created(handle: bytes = bytes(range(64)), **fields) -> Any:
    from kvcache_client import CreatedScoreRegion
    values = dict(region=5, backend="cuda", bytes=4096, shm_name="", cuda_ipc_handle=handle,
                  device=0, device_uuid=UUID, device_pci_bus_id=BUS)
    values.update(fields)
    return CreatedScoreRegion(**values)


def test_a_handle_is_opened_on_the_gpu_found_by_bus_id_and_uuid():
    fake = FakeCudart({BUS: 2})
    fake.current = 1
    cuda = CudaRuntime(fake, uuid_of=lambda device: UUID[4:].upper() if device == 2 else None)
    handle = b"\0\1" + bytes(range(2, 62)) + b"\0\0"  # NULs inside and at the end survive
    mapping = cuda_runtime.open_ipc_export(fake_created(handle, bytes=8192), cuda)
    assert (mapping.device, mapping.pointer, mapping.byte_size) == (2, 0x7F0000000000, 8192)
    assert fake.log == [("by_bus_id", BUS), ("set_device", 2), ("open", handle, 1, 2),
                        ("set_device", 1)]  # opened on ordinal 2, the current one restored
    assert mapping.__cuda_array_interface__ == {
        "shape": (8192,), "typestr": "|u1", "data": (0x7F0000000000, False),
        "strides": None, "version": 3}
    assert cuda.pci_bus_id(2) == BUS
    mapping.close()
    mapping.close()  # once
    assert fake.log[-1] == ("close", 0x7F0000000000)
    assert [c for c in fake.log if c[0] == "close"] == [("close", 0x7F0000000000)]
    with pytest.raises(ValueError):
        mapping.__cuda_array_interface__


def test_a_gpu_already_current_is_not_switched_and_an_unknown_uuid_is_not_refused():
    fake = FakeCudart({BUS: 0})
    cuda = CudaRuntime(fake, uuid_of=lambda device: None)  # torch without .uuid
    mapping = cuda_runtime.open_ipc_export(fake_created(), cuda)
    assert mapping.device == 0
    assert [c[0] for c in fake.log] == ["by_bus_id", "open"]


def test_another_gpu_at_that_bus_id_is_refused_naming_both_uuids():
    other = OTHER_UUID
    fake = FakeCudart({BUS: 1})
    cuda = CudaRuntime(fake, uuid_of=lambda device: other)
    with pytest.raises(KvCacheError) as caught:
        cuda_runtime.open_ipc_export(fake_created(), cuda)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert UUID.lower() in caught.value.message.lower() and other in caught.value.message
    assert not [c for c in fake.log if c[0] == "open"]


def test_a_bus_id_this_process_cannot_see_is_a_failed_precondition():
    fake = FakeCudart({"0000:01:00.0": 0})
    cuda = CudaRuntime(fake, uuid_of=lambda device: UUID)
    with pytest.raises(KvCacheError) as caught:
        cuda_runtime.open_ipc_export(fake_created(), cuda)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert BUS in caught.value.message and "invalid device ordinal" in caught.value.message
    with pytest.raises(KvCacheError) as caught:
        cuda_runtime.open_ipc_export(fake_created(device_pci_bus_id="", device_uuid=""),
                                     cuda)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_failed_open_is_internal_with_the_cuda_message_and_restores_the_device():
    fake = FakeCudart({BUS: 3})
    fake.current, fake.open_error = 1, 400
    cuda = CudaRuntime(fake, uuid_of=lambda device: UUID)
    with pytest.raises(KvCacheError) as caught:
        cuda_runtime.open_ipc_export(fake_created(), cuda)
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert "invalid resource handle" in caught.value.message
    assert "cudaIpcOpenMemHandle" in caught.value.message
    assert fake.current == 1
    with pytest.raises(KvCacheError) as caught:
        cuda.ipc_open(b"short", 3)
    assert caught.value.code == grpc.StatusCode.INTERNAL


def test_no_runtime_to_load_is_a_failed_precondition_naming_what_was_tried(monkeypatch):
    missing = "/nonexistent/libcudart.so.99"
    monkeypatch.setattr(cuda_runtime, "_candidates", lambda: [missing])
    with pytest.raises(KvCacheError) as caught:
        cuda_runtime._load()
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert missing in caught.value.message


def test_uuids_compare_with_or_without_the_prefix():
    assert cuda_runtime.normalize_uuid("8C1B2F1E-0A1B") == "GPU-8c1b2f1e-0a1b"
    assert cuda_runtime.normalize_uuid("GPU-8c1b2f1e-0a1b") == "GPU-8c1b2f1e-0a1b"


@needs_torch
def test_a_device_region_with_a_fake_runtime_writes_waits_per_batch_and_closes_in_order(
        engine_client, seq_id, monkeypatch):
    """The device branch of ScoreRegion, its CUDA calls faked and its memory the daemon's
    region: torch scores are copied into the mapped tensor and the daemon decides on them
    as on inline reports; each batch waits for its event once (two reports in it), after
    it is built and before it is sent; close drops the tensor, closes the handle, then
    unregisters (the daemon then frees the region)."""
    log: List[tuple] = []
    memory = ShmAsDeviceMemory()
    fake = FakeCudart({BUS: 2}, log)
    fake_cudart.install(monkeypatch, fake, memory)
    streams: list = []  # the batch's stream, once made: each wait logs its batches sent
    monkeypatch.setattr(region_module, "_wait_for_current_stream", lambda device, event: log.append(
        ("wait", device, streams[0]._sent if streams else None)) or "event")
    real_create = engine_client.create_score_region
    real_unregister = engine_client.unregister_score_region
    handles: List[bytes] = []

    def create_as_cuda(byte_size, **options):
        created = real_create(byte_size, **options)
        assert created.backend == "host"  # the emulated engine: host memory
        handles.append(memory.handle_for(created.shm_name))
        return dataclasses.replace(created, backend="cuda", shm_name="",
                                   cuda_ipc_handle=handles[-1],
                                   device=0, device_uuid=UUID, device_pci_bus_id=BUS)

    def unregister(region):
        log.append(("unregister", region))
        real_unregister(region)

    monkeypatch.setattr(engine_client, "create_score_region", create_as_cuda)
    monkeypatch.setattr(engine_client, "unregister_score_region", unregister)

    ids = [seq_id("a"), seq_id("b")]
    generator = torch.Generator().manual_seed(11)
    with engine_client.batch() as inline:
        through = engine_client.batch(score_region_bytes=REGION_BYTES,
                                        daemon_score_region=True)
        region = through.score_region
        assert region.on_device and region.device == "cuda:2"
        assert [c for c in log if c[0] == "open"] == [("open", handles[0], 1, 2)]
        for sid in ids:
            through.open(sid, prefill_len=PREFILL, budget_tokens=BUDGET, score_dtype="float16")
            inline.open(f"{sid}-i", prefill_len=PREFILL, budget_tokens=BUDGET,
                        score_dtype="float16")
        streams.append(through._stream)
        for step in range(STEPS):
            scores = {sid: torch.rand(3, through.sequences[sid].tokens, generator=generator)
                      for sid in ids}
            got = through.step(scores)
            want = inline.step({f"{sid}-i": s for sid, s in scores.items()})
            for sid in ids:
                assert outcome(got[sid]) == outcome(want[f"{sid}-i"]), (sid, step)
        assert region.region_reports == 2 * STEPS and region.inline_reports == 0
        waits = [c for c in log if c[0] == "wait"]
        # One wait per batch (of two reports), each before its batch was sent.
        assert waits == [("wait", 2, sent) for sent in range(STEPS)]
        assert through._stream._sent == STEPS

        tensor_ref = weakref.ref(region.tensor)
        region_id = region.region_id
        closed_with_tensor_alive = []
        fake.close_memory = lambda pointer: (closed_with_tensor_alive.append(
            tensor_ref() is not None), memory.unmap(pointer))
        del log[:]
        through.close()
        assert [c[0] for c in log] == ["close", "unregister"]
        assert closed_with_tensor_alive == [False]
        with pytest.raises(KvCacheError) as caught:
            real_unregister(region_id)  # the daemon freed it
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(KvCacheError):
            region.tensor


def test_a_region_can_be_placed_on_a_ranks_gpu(engine_client, monkeypatch):
    # The rank reaches CreateScoreRegion, and a daemon refuses one outside its world.
    asked: List[Dict[str, Any]] = []
    real_create = engine_client.create_score_region

    def recording(byte_size, **options):
        asked.append(options)
        return real_create(byte_size, **options)

    monkeypatch.setattr(engine_client, "create_score_region", recording)
    with engine_client.batch(score_region_bytes=REGION_BYTES, daemon_score_region=True,
                             score_region_rank=1, rank=1) as batch:
        assert batch.score_region.region_id
    with engine_client.batch(score_region_bytes=REGION_BYTES, daemon_score_region=True):
        pass
    assert asked == [{"rank": 1}, {}]
    with pytest.raises(KvCacheError) as caught:
        engine_client.batch(score_region_bytes=REGION_BYTES, daemon_score_region=True,
                            score_region_rank=1 << 20)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank is 1048576" in caught.value.message
    with pytest.raises(ValueError, match="needs score_region_bytes and daemon_score_region"):
        engine_client.batch(score_region_bytes=REGION_BYTES, score_region_rank=0)


def test_a_device_region_on_another_gpu_is_refused_and_freed(engine_client, monkeypatch):
    fake = FakeCudart({BUS: 0})
    monkeypatch.setattr(cuda_runtime, "runtime", lambda: CudaRuntime(
        fake, uuid_of=lambda device: OTHER_UUID))
    created_ids = []
    real_create = engine_client.create_score_region

    def create_as_cuda(byte_size, **options):
        created = real_create(byte_size, **options)
        created_ids.append(created.region)
        return dataclasses.replace(created, backend="cuda", shm_name="",
                                   cuda_ipc_handle=bytes(64), device_uuid=UUID,
                                   device_pci_bus_id=BUS)

    monkeypatch.setattr(engine_client, "create_score_region", create_as_cuda)
    with pytest.raises(KvCacheError) as caught:
        engine_client.batch(score_region_bytes=4096, daemon_score_region=True)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert UUID in caught.value.message
    with pytest.raises(KvCacheError) as freed:
        engine_client.unregister_score_region(created_ids[0])
    assert freed.value.code == grpc.StatusCode.NOT_FOUND


# -- a real GPU ------------------------------------------------------------------------------

def _cuda_available() -> bool:
    return torch is not None and torch.cuda.is_available()


@pytest.mark.skipif(not _cuda_available(), reason="no CUDA device")
def test_a_cuda_engine_region_is_written_on_the_gpu(tmp_path_factory, seq_id):
    """The real path: a --engine_backend=cuda daemon's region opened by IPC, CUDA tensors'
    scores copied into it on the GPU, decisions equal to inline reports'."""
    daemon = _start(tmp_path_factory, "cuda", "--allow_shm_scores", "--engine_backend=cuda")
    try:
        with KvCacheClient(daemon.address, timeout=30) as client:
            created = client.create_score_region(4096)
            assert created.backend == "cuda", created
            client.unregister_score_region(created.region)
            sid = seq_id()
            generator = torch.Generator(device="cuda").manual_seed(5)
            with client.batch() as inline, \
                    client.batch(score_region_bytes=REGION_BYTES,
                                 daemon_score_region=True) as through:
                region = through.score_region
                assert region.on_device and region.tensor.is_cuda
                inline.open(sid, prefill_len=PREFILL, budget_tokens=BUDGET,
                            score_dtype="bfloat16")
                through.open(f"{sid}-r", prefill_len=PREFILL, budget_tokens=BUDGET,
                             score_dtype="bfloat16")
                for step in range(STEPS):
                    tokens = through.sequences[f"{sid}-r"].tokens
                    scores = torch.rand(3, tokens, device="cuda", generator=generator)
                    got = through.step({f"{sid}-r": scores})[f"{sid}-r"]
                    want = inline.step({sid: scores})[sid]
                    assert outcome(got) == outcome(want), step
                    packed = encode_scores(scores, dtype="bfloat16").data
                    assert region.tensor[:len(packed)].cpu().numpy().tobytes() == packed
                assert region.region_reports == STEPS
    finally:
        daemon.stop()


@needs_torch
def test_the_device_region_example_of_the_docs_runs(engine_daemon):
    """docs/PYTHON.md's "Device score regions" example, on host memory here."""
    from test_docs import run_section
    assert run_section("## Device score regions", engine_daemon.address).split() == ["8", "0"]
