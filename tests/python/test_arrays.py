"""Numpy arrays and torch tensors are packed in one conversion-and-copy, to the same bytes
as the pure-Python path makes of the same values; sizes and shapes are checked the same."""

import random
import struct

import pytest

from kvcache_client import Scores, ScoreShapeError, encode_scores, prepare_scores

try:
    import numpy as np
except ImportError:  # pragma: no cover - scripts/install-deps.sh installs it
    np = None
pytestmark = pytest.mark.skipif(np is None, reason="numpy is not installed "
                                "(Debian: python3-numpy, in scripts/install-deps.sh)")


def awkward_values(count, seed):
    """Random magnitudes over many binades, plus values that round in every way: float16
    subnormals and overflow, bfloat16 ties, zeros."""
    rng = random.Random(seed)
    values = [rng.random() * 2.0 ** rng.randint(-30, 20) for _ in range(count)]
    specials = [0.0, -0.0, 1e-8, 6e-8, 3e-5, 65504.0, 65520.0, 1e6, 1.00390625, 1.01171875,
                struct.unpack("<f", struct.pack("<I", 0x3F808000))[0],  # a bfloat16 tie
                struct.unpack("<f", struct.pack("<I", 0x3F818000))[0]]
    return specials + values


@pytest.mark.parametrize("source", ["float64", "float32", "float16"])
@pytest.mark.parametrize("wire", [None, "float32", "float16", "bfloat16"])
def test_numpy_floats_pack_as_the_pure_python_path(source, wire):
    values = awkward_values(300, hash((source, wire)) & 0xFFFF)
    with np.errstate(over="ignore"):
        array = np.array(values, dtype=source).reshape(4, -1)
    natural = {"float64": None, "float32": "float32", "float16": "float16"}[source]
    for sequence_dtype in ("float32", "float16", "bfloat16"):
        got = encode_scores(array, dtype=wire, default_dtype=sequence_dtype)
        # The same values as Python floats (exact), to the dtype the buffer rule picks.
        want = encode_scores(array.tolist(), dtype=wire or natural or sequence_dtype)
        assert got == want, (source, wire, sequence_dtype)
        if source != "float16":  # and the buffer path (memoryview 'e' needs Python 3.12)
            view = memoryview(array.tobytes()).cast(array.dtype.char, array.shape)
            assert encode_scores(view, dtype=wire, default_dtype=sequence_dtype) == got


def test_numpy_layouts_strides_and_byte_order():
    base = np.arange(24, dtype=np.float32).reshape(4, 6) / 8
    want = encode_scores(base.tolist())
    assert encode_scores(base) == want
    assert encode_scores(base.astype(">f4")) == want                    # big-endian
    assert encode_scores(np.asfortranarray(base)) == want               # column-major
    assert encode_scores(np.repeat(base, 2, axis=1)[:, ::2]) == want    # strided
    assert encode_scores(base.T.copy().T) == want
    flat = encode_scores(base.reshape(-1), tokens=6)
    assert (flat.layers, flat.tokens, flat.data) == (4, 6, want.data)
    assert encode_scores(Scores(base.reshape(-1), layers=2)).tokens == 12


def test_numpy_16_bit_integers_are_bits():
    halves = np.array([0x3C00, 0x4000, 0x3800], dtype=np.uint16)  # float16 1, 2, 0.5
    encoded = encode_scores(halves, dtype="float16")
    assert encoded.data == struct.pack("<3e", 1.0, 2.0, 0.5) and encoded.dtype == "float16"
    assert encode_scores(halves.astype(">u2"), dtype="float16").data == encoded.data
    assert encode_scores(halves.view(np.int16), default_dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ScoreShapeError, match="16-bit integer"):
        encode_scores(halves)


def test_numpy_shapes_are_checked():
    with pytest.raises(ScoreShapeError, match="1-D or 2-D"):
        encode_scores(np.zeros((2, 2, 2), dtype=np.float32))
    with pytest.raises(ScoreShapeError, match="empty"):
        encode_scores(np.zeros((0,), dtype=np.float32))
    with pytest.raises(ScoreShapeError, match="layers=3"):
        encode_scores(np.zeros((2, 4), dtype=np.float32), layers=3)
    with pytest.raises(ScoreShapeError, match="the step needs 5"):
        encode_scores(np.zeros((2, 4), dtype=np.float32), tokens=5)
    # Other element types keep the buffer path (raw bytes) or tolist().
    assert encode_scores(np.zeros(8, dtype=np.uint8), dtype="float32").tokens == 2


def test_prepared_scores_write_into_a_target_once():
    array = np.linspace(0, 1, 12, dtype=np.float64).reshape(3, 4)
    prepared = prepare_scores(array, default_dtype="float16")
    assert (prepared.layers, prepared.tokens, prepared.dtype, prepared.nbytes) == (
        3, 4, "float16", 24)
    target = bytearray(prepared.nbytes + 8)
    prepared.write_into(memoryview(target)[4:4 + prepared.nbytes])
    assert bytes(target[4:-4]) == encode_scores(array.tolist(), dtype="float16").data
    with pytest.raises(ValueError, match="holds 25 bytes"):
        prepared.write_into(memoryview(bytearray(25)))


# -- torch (where installed) ----------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch", reason="torch is not installed: torch packing paths "
                                               "untested here")


@pytest.mark.parametrize("source", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("wire", ["float32", "float16", "bfloat16"])
def test_torch_tensors_pack_to_the_sequence_dtype(source, wire):
    torch = _torch()
    values = awkward_values(200, 7)
    tensor = torch.tensor(values, dtype=getattr(torch, source)).reshape(4, -1)
    got = encode_scores(tensor, default_dtype=wire)
    assert (got.layers, got.tokens, got.dtype) == (4, tensor.shape[1], wire)
    # What torch's own cast makes of the values, as little-endian bytes.
    cast = tensor.to(getattr(torch, wire)).contiguous()
    assert got.data == cast.view(torch.uint8).numpy().tobytes()  # little-endian hosts
    if source in ("float32", "float64"):
        # Where single rounding applies, it is the pure-Python packing too.
        single = encode_scores(tensor.to(torch.float32).tolist(), dtype=wire)
        if wire != "float16" or source == "float32":
            assert got.data == single.data


def test_torch_bits_and_shapes():
    torch = _torch()
    bf16 = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.bfloat16)
    encoded = encode_scores(bf16.view(torch.int16), dtype="bfloat16")
    assert encoded.data == encode_scores(bf16, default_dtype="bfloat16").data
    with pytest.raises(ScoreShapeError, match="1-D or 2-D"):
        encode_scores(torch.zeros(2, 2, 2))
    with pytest.raises(ScoreShapeError, match="the step needs 4"):
        encode_scores(torch.zeros(2, 3), tokens=4)
    grad = torch.ones(1, 4, requires_grad=True)
    assert encode_scores(grad).data == struct.pack("<4f", 1, 1, 1, 1)


def test_torch_cuda_tensors_are_copied_to_the_target():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rows = torch.rand(8, 301, device="cuda")
    prepared = prepare_scores(rows, default_dtype="float16")
    target = bytearray(prepared.nbytes)
    prepared.write_into(memoryview(target))
    assert bytes(target) == encode_scores(rows.cpu(), default_dtype="float16").data
