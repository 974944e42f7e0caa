"""Packing scores for the wire (no daemon): every input kind, dtypes, shapes, size errors."""

import ctypes
import struct
from array import array

import pytest

from kvcache_client import Scores, ScoreShapeError, decode_scores, encode_scores

ROWS = [[0.5, 0.25, 1.0], [2.0, 0.0, 0.125]]
F32 = struct.pack("<6f", *ROWS[0], *ROWS[1])
F16 = struct.pack("<6e", *ROWS[0], *ROWS[1])


def f32_array(values):
    return array("f", values)


def half_format_supported() -> bool:
    try:
        memoryview(b"\0\0").cast("e")
        return True
    except (ValueError, TypeError):
        return False


@pytest.mark.parametrize("scores", [
    ROWS,
    tuple(tuple(r) for r in ROWS),
    [f32_array(r) for r in ROWS],                          # rows as buffers
    [memoryview(f32_array(r)) for r in ROWS],
], ids=["lists", "tuples", "array_rows", "memoryview_rows"])
def test_per_layer_rows_pack_little_endian_float32(scores):
    encoded = encode_scores(scores)
    assert (encoded.data, encoded.layers, encoded.tokens, encoded.dtype) == (F32, 2, 3,
                                                                             "float32")


def test_flat_input_splits_by_layers_or_by_tokens():
    flat = f32_array(ROWS[0] + ROWS[1])
    assert encode_scores(flat, layers=2).tokens == 3
    assert encode_scores(flat, tokens=3).layers == 2
    assert encode_scores(ROWS[0] + ROWS[1], tokens=3).layers == 2
    assert encode_scores(flat).layers == 1  # nothing says otherwise: one layer


def test_two_dimensional_buffer_gives_layers_and_tokens():
    view = memoryview(f32_array(ROWS[0] + ROWS[1])).cast("B").cast("f", (2, 3))
    encoded = encode_scores(view)
    assert (encoded.data, encoded.layers, encoded.tokens) == (F32, 2, 3)


def test_non_contiguous_buffer_is_packed_in_row_order():
    view = memoryview(f32_array(ROWS[0] + ROWS[1])).cast("B").cast("f", (2, 3))[::-1]
    assert encode_scores(view).data == struct.pack("<6f", *ROWS[1], *ROWS[0])


def test_bytes_take_the_dtype_or_the_sequence_default():
    assert encode_scores(F32).dtype == "float32"
    assert encode_scores(bytearray(F32), tokens=3).layers == 2
    encoded = encode_scores(F16, default_dtype="float16", tokens=3)
    assert (encoded.data, encoded.layers, encoded.dtype) == (F16, 2, "float16")
    encoded = encode_scores(memoryview(F16), dtype="float16", layers=2)
    assert (encoded.tokens, encoded.dtype) == (3, "float16")


def test_two_dimensional_byte_buffer_of_float16():
    view = memoryview(F16).cast("B", (2, 6))
    encoded = encode_scores(view, dtype="fp16")
    assert (encoded.layers, encoded.tokens, encoded.data) == (2, 3, F16)


def test_raw_bytes_without_any_dtype_go_unspecified():
    encoded = encode_scores(F32, default_dtype=None, layers=2)
    assert (encoded.dtype, encoded.tokens, encoded.layers, encoded.data) == (None, None, 2, F32)


def test_sixteen_bit_integer_buffers_carry_half_bits():
    bits = array("H", struct.unpack("<6H", F16))
    encoded = encode_scores(bits, dtype="float16", layers=2)
    assert (encoded.data, encoded.tokens) == (F16, 3)
    with pytest.raises(ScoreShapeError, match="dtype"):
        encode_scores(bits)
    with pytest.raises(ScoreShapeError, match="not float32"):
        encode_scores(bits, dtype="float32")
    assert encode_scores(bits, default_dtype="bfloat16").dtype == "bfloat16"


def test_float_buffers_convert_to_another_wire_dtype():
    assert encode_scores(f32_array(ROWS[0]), dtype="float16").data == struct.pack("<3e", *ROWS[0])
    doubles = array("d", ROWS[0])
    assert encode_scores(doubles).data == struct.pack("<3f", *ROWS[0])
    assert encode_scores(doubles, dtype="float16").dtype == "float16"


@pytest.mark.skipif(not half_format_supported(), reason="memoryview 'e' needs Python 3.12+")
def test_float16_formatted_buffer_is_float16():
    encoded = encode_scores(memoryview(F16).cast("e").cast("B").cast("e", (2, 3)))
    assert (encoded.data, encoded.dtype, encoded.layers) == (F16, "float16", 2)


@pytest.mark.parametrize("ctype", [ctypes.c_float.__ctype_be__, ctypes.c_float.__ctype_le__],
                         ids=["big_endian", "little_endian"])
def test_buffers_with_an_explicit_byte_order_are_little_endian_on_the_wire(ctype):
    rows = ((ctype * 3) * 2)(*[(ctype * 3)(*r) for r in ROWS])  # format '>f' or '<f'
    encoded = encode_scores(rows)
    assert (encoded.data, encoded.layers, encoded.tokens) == (F32, 2, 3)
    assert encode_scores(rows, dtype="float16").data == F16


def test_python_floats_follow_the_sequence_dtype():
    assert encode_scores(ROWS, default_dtype="float16").data == F16
    assert encode_scores(ROWS, dtype="half").dtype == "float16"


def test_float16_overflow_becomes_infinity_for_the_daemon_to_judge():
    data = encode_scores([[1e6, -1e6, 1.0]], dtype="float16").data
    assert decode_scores(data, "float16")[:2] == [float("inf"), float("-inf")]


def test_values_are_not_judged_here():
    data = encode_scores([[-1.0, float("nan"), float("inf")]]).data
    values = decode_scores(data, "float32")
    assert values[0] == -1.0 and values[1] != values[1] and values[2] == float("inf")


@pytest.mark.parametrize("value, bits", [
    (1.0, 0x3F80), (-2.0, 0xC000), (3.140625, 0x4049),
    (1.0 + 2 ** -8, 0x3F80),                 # a tie: to even (down)
    (1.0 + 3 * 2 ** -8, 0x3F82),             # a tie: to even (up)
    (1.0 + 2 ** -8 + 2 ** -20, 0x3F81),      # just above the tie: up
    (float("inf"), 0x7F80), (3.4e38, 0x7F80),  # rounds to infinity
])
def test_bfloat16_rounds_to_nearest_even(value, bits):
    assert encode_scores([[value]], dtype="bf16").data == struct.pack("<H", bits)


def test_bfloat16_keeps_nan_a_nan():
    value = decode_scores(encode_scores([[float("nan")]], dtype="bfloat16").data, "bfloat16")[0]
    assert value != value


def test_raw_bfloat16_bytes_pass_unchanged():
    raw = struct.pack("<4H", 0x3F80, 0x4000, 0x3E80, 0x0000)
    encoded = encode_scores(raw, dtype="bfloat16", layers=2)
    assert (encoded.data, encoded.tokens) == (raw, 2)
    assert decode_scores(raw, "bfloat16") == [1.0, 2.0, 0.25, 0.0]


def test_scores_wrapper_overrides_layers_and_dtype():
    encoded = encode_scores(Scores(F16, layers=2, dtype="float16"), default_dtype="float32")
    assert (encoded.layers, encoded.tokens, encoded.dtype) == (2, 3, "float16")


def test_objects_with_tolist_are_converted():
    class FakeTensor:
        def tolist(self):
            return [list(r) for r in ROWS]

    assert encode_scores(FakeTensor()).data == F32


def test_none_means_no_scores():
    assert encode_scores(None) is None


@pytest.mark.parametrize("scores, options, message", [
    ([[1.0, 2.0], [1.0]], {}, "layer 1 has 1 scores, layer 0 has 2"),
    (ROWS, {"tokens": 4}, "3 per layer; the step needs 4"),
    (ROWS, {"layers": 3}, "2 layers, layers=3"),
    (ROWS[0] + ROWS[1], {"tokens": 4}, "no whole number of layers"),
    (ROWS[0] + ROWS[1], {"layers": 4}, "do not split into 4"),
    (bytes(7), {"dtype": "float32"}, "not a whole number of 4-byte"),
    (bytes(6), {"dtype": "float32", "layers": 2}, "not a whole number"),
    (memoryview(bytes(6)).cast("B", (2, 3)), {"dtype": "float16"}, "rows of 3 bytes"),
    ([], {}, "empty"),
    (b"", {}, "empty"),
    (memoryview(bytes(8)).cast("B", (2, 2, 2)), {}, "3 dimensions"),
    ([memoryview(bytes(8)).cast("f", (1, 2))], {}, "layer 0 is 2-D"),
])
def test_size_errors_say_what_is_wrong(scores, options, message):
    with pytest.raises(ScoreShapeError, match=message.replace("(", r"\(")):
        encode_scores(scores, **options)


@pytest.mark.parametrize("scores", [{"a": 1.0}, "0.5", [["a", "b"]], [[[1.0]]],
                                    array("i", [1, 2])])
def test_unsupported_inputs_are_type_errors(scores):
    with pytest.raises(TypeError):
        encode_scores(scores)


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float64"):
        encode_scores(ROWS, dtype="float64")
