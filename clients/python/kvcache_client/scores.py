"""Packing layer scores into the wire format: [layers, tokens], little-endian, layer-major.

Pure Python (no gRPC; numpy and torch are used only when the caller passes their arrays).
What :func:`encode_scores` accepts:

* a list (or tuple) of per-layer rows, each a sequence of floats or a 1-D buffer;
* a flat sequence of floats, with ``layers=`` (or ``tokens=``) saying how it splits;
* any object with the buffer protocol: ``array.array('f')``, a ``memoryview``, a numpy
  array, ``tensor.numpy()``. Its format decides the element type: ``'f'`` float32, ``'e'``
  float16, ``'d'`` float64 (converted; to the sequence's dtype unless ``dtype`` says);
  1-D is flat, 2-D is ``[layers, tokens]``;
* raw bits: ``bytes``/``bytearray``/``'B'`` buffers hold elements of ``dtype`` (the
  sequence's score dtype when not given), and 16-bit integer buffers (``'H'``/``'h'``,
  e.g. ``bf16_tensor.view(torch.int16).numpy()``) hold float16 or bfloat16 bits;
* a torch tensor (CPU or CUDA), 1-D or 2-D: floats of any width go as ``dtype`` or else
  the sequence's dtype (converted on the tensor's device, then copied to the host once;
  into a device score region, copied on the GPU instead),
  16-bit integers (``t.view(torch.int16)``) as float16/bfloat16 bits;
* anything else with a ``tolist()`` method, converted through Python floats.

Numpy arrays and torch tensors are converted and copied in one pass into the destination
(bytes for the wire, or a score region's range): see :class:`PreparedScores`.

``dtype`` is what goes on the wire: ``"float32"``, ``"float16"`` or ``"bfloat16"``. Float
buffers of another type and Python floats are converted to it; raw bits are sent as they
are. Sizes are checked here (:class:`ScoreShapeError`); values are not, the daemon judges
them (negative or non-finite scores reject the step there).
"""

from __future__ import annotations

import math
import numbers
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from . import _arrays
from .errors import ScoreShapeError

__all__ = ["EncodedScores", "PreparedScores", "Scores", "ScoreShapeError", "ScoresLike",
           "decode_scores", "encode_scores", "prepare_scores"]

#: Wire dtypes and their element sizes in bytes.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

_DTYPE_ALIASES = {
    "float32": "float32", "f32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "f16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
_FLOAT_FORMATS = {"f": "float32", "e": "float16", "d": None}  # natural wire dtype
_RAW_FORMATS = {"B": 1, "b": 1, "c": 1, "H": 2, "h": 2}        # raw bits, element size
_U32 = "I" if array("I").itemsize == 4 else "L"

#: What a step may carry for one sequence (None: no scores).
ScoresLike = Any


@dataclass(frozen=True)
class EncodedScores:
    """Scores packed for a StepReport."""

    data: bytes            #: [layers, tokens] little-endian, layer-major
    layers: int            #: rows in ``data``
    tokens: Optional[int]  #: scores per layer; None for raw bytes of unknown dtype
    dtype: Optional[str]   #: wire dtype; None: raw bytes in the sequence's dtype


@dataclass(frozen=True)
class Scores:
    """Scores with their own ``layers``/``dtype``, for one entry of a batch step.

    ``batch.step({"req-1": Scores(raw_bf16_bytes, dtype="bfloat16", layers=32)})``
    """

    data: ScoresLike
    layers: Optional[int] = None
    dtype: Optional[str] = None


def normalize_dtype(dtype: Optional[str]) -> Optional[str]:
    """``"float32"``, ``"float16"`` or ``"bfloat16"`` for a dtype name or alias (None passes)."""
    if dtype is None:
        return None
    name = _DTYPE_ALIASES.get(str(dtype).lower().replace("torch.", ""))
    if name is None:
        raise ValueError(f"unknown score dtype {dtype!r}; use float32, float16 or bfloat16")
    return name


@dataclass(frozen=True)
class PreparedScores:
    """Scores checked and sized for a StepReport, not yet packed: ``write_into`` packs them
    into a buffer of exactly ``nbytes`` (a score region's range), ``to_bytes`` into bytes
    for the wire. Both give the same bytes. Numpy arrays and torch tensors are converted
    and copied once, straight into the target; other inputs are packed here first."""

    layers: int            #: rows
    tokens: Optional[int]  #: scores per layer; None for raw bytes of unknown dtype
    dtype: Optional[str]   #: wire dtype; None: raw bytes in the sequence's dtype
    nbytes: int            #: layers * tokens * the dtype's size
    _data: Optional[bytes] = None
    _write: Optional[Callable[[memoryview], None]] = None
    _write_tensor: Optional[Callable[[Any], None]] = None

    @property
    def from_tensor(self) -> bool:
        """Whether the scores are a torch tensor (:meth:`write_into_tensor` then copies
        them with ``copy_``, on the tensors' devices)."""
        return self._write_tensor is not None

    def write_into(self, target: memoryview) -> None:
        """Packs the scores into ``target`` (writable, ``nbytes`` long)."""
        if len(target) != self.nbytes:
            raise ValueError(f"target holds {len(target)} bytes, the scores {self.nbytes}")
        if self._write is not None:
            self._write(target)
        else:
            target[:] = self._data  # type: ignore[index]

    def write_into_tensor(self, target: Any) -> None:
        """Packs the scores into ``target``: a flat uint8 torch tensor of ``nbytes``, in
        host or CUDA memory, with the bytes :meth:`write_into` would write. A torch tensor
        is converted and copied by ``target.copy_`` on the current stream (device to device
        when both are on the GPU: no host copy); other scores are packed on the host, then
        copied in."""
        if target.numel() != self.nbytes:
            raise ValueError(f"target holds {target.numel()} bytes, the scores {self.nbytes}")
        if self._write_tensor is not None:
            self._write_tensor(target)
            return
        torch = sys.modules["torch"]  # target is a tensor: torch is imported
        packed = bytearray(self.nbytes)
        self.write_into(memoryview(packed))
        target.copy_(torch.frombuffer(packed, dtype=torch.uint8))

    def to_bytes(self) -> bytes:
        if self._data is not None:
            return self._data
        out = bytearray(self.nbytes)
        self.write_into(memoryview(out))
        return bytes(out)

    def encoded(self) -> EncodedScores:
        return EncodedScores(self.to_bytes(), self.layers, self.tokens, self.dtype)


def encode_scores(scores: ScoresLike, *, dtype: Optional[str] = None,
                  layers: Optional[int] = None, tokens: Optional[int] = None,
                  default_dtype: Optional[str] = "float32") -> Optional[EncodedScores]:
    """Packs ``scores`` (see the module docstring) for the wire; None stays None.

    Args:
      dtype: the wire dtype; None: the input's own (float32 for a ``'f'`` buffer, float16
        for ``'e'``), else ``default_dtype``.
      layers: rows; required for flat input unless ``tokens`` is given.
      tokens: the scores per layer the step needs (cache + the new token); checked when
        given, and used to split flat input into layers.
      default_dtype: the sequence's score dtype, for Python floats and raw bytes; None
        leaves raw bytes' dtype to the daemon (sizes then go unchecked).
    Raises:
      ScoreShapeError: the size or shape does not fit (ragged rows, a partial element,
        a layer count or token count that does not match).
      TypeError: an input of a kind listed nowhere above.
    """
    prepared = prepare_scores(scores, dtype=dtype, layers=layers, tokens=tokens,
                              default_dtype=default_dtype)
    return None if prepared is None else prepared.encoded()


def prepare_scores(scores: ScoresLike, *, dtype: Optional[str] = None,
                   layers: Optional[int] = None, tokens: Optional[int] = None,
                   default_dtype: Optional[str] = "float32") -> Optional[PreparedScores]:
    """Like :func:`encode_scores` (same arguments, same checks), without packing yet."""
    if isinstance(scores, Scores):
        return prepare_scores(scores.data, dtype=scores.dtype or dtype,
                              layers=scores.layers if scores.layers is not None else layers,
                              tokens=tokens, default_dtype=default_dtype)
    if scores is None:
        return None
    dtype = normalize_dtype(dtype)
    default_dtype = normalize_dtype(default_dtype)
    plan = _arrays.plan(scores, dtype, default_dtype)
    if plan is not None:
        rows_2d, count, wire, write, write_tensor = plan
        shape_layers, width = _shape(count, rows_2d, layers, tokens)
        prepared = PreparedScores(shape_layers, width, wire, count * DTYPE_SIZES[wire],
                                  _write=write, _write_tensor=write_tensor)
    elif isinstance(scores, (list, tuple)) and scores and not _is_number(scores[0]):
        encoded = _encode_rows(scores, dtype, default_dtype)
        if layers is not None and layers != encoded.layers:
            raise ScoreShapeError(f"scores have {encoded.layers} layers, layers={layers}")
        prepared = PreparedScores(encoded.layers, encoded.tokens, encoded.dtype,
                                  len(encoded.data), _data=encoded.data)
    else:
        data, count, rows, wire = _encode_flat(scores, dtype, default_dtype)
        shape_layers, width = _shape(count, rows, layers, tokens)
        prepared = PreparedScores(shape_layers, width, wire, len(data), _data=data)
    if tokens is not None and prepared.tokens is not None and prepared.tokens != tokens:
        raise ScoreShapeError(
            f"scores have {prepared.tokens} per layer; the step needs {tokens} "
            f"({tokens - 1} cached + the new token)")
    return prepared


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _encode_rows(rows: Sequence[Any], dtype: Optional[str],
                 default_dtype: Optional[str]) -> EncodedScores:
    """Per-layer rows, each a flat sequence or a 1-D buffer, all of one length."""
    parts: List[bytes] = []
    width: Optional[int] = None
    wire = dtype
    for index, row in enumerate(rows):
        data, count, shape_rows, row_dtype = _encode_flat(row, wire, default_dtype)
        if shape_rows is not None:
            raise ScoreShapeError(f"layer {index} is 2-D; each layer must be one row")
        if wire is None:
            wire = row_dtype  # the first row's dtype: later rows are converted to it
        if width is not None and count != width:
            raise ScoreShapeError(f"layer {index} has {count} scores, layer 0 has {width}")
        width = count
        parts.append(data)
    if wire is None:
        raise ScoreShapeError("raw score bytes need a dtype (float32, float16 or bfloat16)")
    return EncodedScores(b"".join(parts), len(rows), width, wire)


def _encode_flat(values: Any, dtype: Optional[str], default_dtype: Optional[str]
                 ) -> Tuple[bytes, Optional[int], Optional[int], Optional[str]]:
    """(data, elements or None when unknown, rows for a 2-D buffer else None, wire dtype)."""
    if isinstance(values, (list, tuple)):
        if values and not all(_is_number(v) for v in values):
            raise TypeError("a score row must hold only real numbers")
        wire = dtype or default_dtype or "float32"
        return _pack_floats(values, wire), len(values), None, wire
    try:
        view = memoryview(values)
    except TypeError:
        if hasattr(values, "tolist") and not isinstance(values, str):
            listed = values.tolist()
            if listed and isinstance(listed[0], list):
                encoded = _encode_rows(listed, dtype, default_dtype)
                return encoded.data, encoded.layers * (encoded.tokens or 0), encoded.layers, \
                    encoded.dtype
            return _encode_flat(listed if isinstance(listed, list) else [listed], dtype,
                                default_dtype)
        raise TypeError(
            f"scores of type {type(values).__name__} are not supported: pass per-layer lists "
            "of floats, array('f'), bytes, or a buffer (memoryview, numpy array)") from None
    return _encode_buffer(view, dtype, default_dtype)


def _encode_buffer(view: memoryview, dtype: Optional[str], default_dtype: Optional[str]
                   ) -> Tuple[bytes, Optional[int], Optional[int], Optional[str]]:
    if view.ndim > 2 or view.ndim == 0:
        raise ScoreShapeError(f"a score buffer must be 1-D or 2-D [layers, tokens], "
                              f"this one has {view.ndim} dimensions")
    big_endian, code = _split_format(view.format)
    raw = view.tobytes()  # C order, whatever the strides
    rows = view.shape[0] if view.ndim == 2 else None
    if code in _FLOAT_FORMATS:
        natural = _FLOAT_FORMATS[code]
        wire = dtype or natural or default_dtype or "float32"
        count = len(raw) // view.itemsize
        if wire == natural:
            return (_byteswap(raw, view.itemsize) if big_endian else raw), count, rows, wire
        values = struct.unpack(f"{'>' if big_endian else '<'}{count}{code}", raw)
        return _pack_floats(values, wire), count, rows, wire
    if code in _RAW_FORMATS:
        size = _RAW_FORMATS[code]
        wire = dtype or default_dtype
        if size == 2:
            if wire not in ("float16", "bfloat16"):
                raise ScoreShapeError("16-bit integer score buffers hold float16 or bfloat16 "
                                      f"bits, not {wire or 'unknown'}: say which with dtype=")
            raw = _byteswap(raw, 2) if big_endian else raw
        if wire is None:
            return raw, None, rows, None
        element = DTYPE_SIZES[wire]
        if len(raw) % element:
            raise ScoreShapeError(f"{len(raw)} bytes of {wire} scores: not a whole number of "
                                  f"{element}-byte elements")
        if rows is not None and (view.shape[1] * size) % element:
            raise ScoreShapeError(f"rows of {view.shape[1] * size} bytes hold no whole number "
                                  f"of {wire} scores")
        return raw, len(raw) // element, rows, wire
    raise TypeError(f"score buffers of format {view.format!r} are not supported; use float32 "
                    "('f'), float16 ('e'), float64 ('d') or raw bytes with a dtype")


def _shape(count: Optional[int], rows: Optional[int], layers: Optional[int],
           tokens: Optional[int]) -> Tuple[int, Optional[int]]:
    """(layers, scores per layer or None when unknown) of flat or 2-D data."""
    if count == 0:
        raise ScoreShapeError("scores are empty; pass None to send no scores")
    if rows is not None:
        if layers is not None and layers != rows:
            raise ScoreShapeError(f"scores have {rows} layers, layers={layers}")
        layers = rows
    elif layers is None:
        if tokens is not None and count is not None:
            if count % tokens:
                raise ScoreShapeError(
                    f"{count} scores are no whole number of layers of {tokens} "
                    f"({tokens - 1} cached + the new token)")
            layers = count // tokens
        else:
            layers = 1
    if layers < 1:
        raise ScoreShapeError(f"layers must be >= 1, got {layers}")
    if count is None:
        return layers, None
    if count % layers:
        raise ScoreShapeError(f"{count} scores do not split into {layers} equal layers")
    return layers, count // layers


def _split_format(fmt: str) -> Tuple[bool, str]:
    """(big-endian?, the struct code) of a buffer format such as 'f', '<e' or '>f'."""
    prefix, code = (fmt[0], fmt[1:]) if fmt[:1] in "@=<>!" else ("@", fmt)
    big = prefix in ">!" or (prefix in "@=" and sys.byteorder == "big")
    return big, code


def _byteswap(data: bytes, size: int) -> bytes:
    out = bytearray(len(data))
    for i in range(size):
        out[i::size] = data[size - 1 - i::size]
    return bytes(out)


def _pack_floats(values: Sequence[float], dtype: str) -> bytes:
    """Little-endian ``dtype`` elements (round to nearest even; overflow becomes inf)."""
    if dtype == "float16":
        try:
            return struct.pack(f"<{len(values)}e", *values)
        except OverflowError:
            return b"".join(_pack_half(v) for v in values)
    single = array("f", values)  # values beyond float32 range become inf
    if dtype == "float32":
        if sys.byteorder == "big":
            single.byteswap()
        return single.tobytes()
    bits = array(_U32, single.tobytes())
    half = array("H", (_bfloat16_bits(b) for b in bits))
    if sys.byteorder == "big":
        half.byteswap()
    return half.tobytes()


def _pack_half(value: float) -> bytes:
    try:
        return struct.pack("<e", value)
    except OverflowError:
        return struct.pack("<e", math.copysign(math.inf, value))


def _bfloat16_bits(bits: int) -> int:
    """The bfloat16 nearest (ties to even) to the float32 with these bits."""
    if bits & 0x7FFFFFFF > 0x7F800000:  # NaN: keep it a (quiet) NaN
        return (bits >> 16) | 0x0040
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


def decode_scores(data: Union[bytes, bytearray, memoryview], dtype: str) -> List[float]:
    """The floats of packed little-endian scores (a helper for tests and debugging)."""
    dtype = normalize_dtype(dtype)
    raw = bytes(data)
    if dtype == "float32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if dtype == "float16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    halves = struct.unpack(f"<{len(raw) // 2}H", raw)
    return list(struct.unpack(f"<{len(halves)}f", struct.pack(f"<{len(halves)}I",
                                                               *(h << 16 for h in halves))))
