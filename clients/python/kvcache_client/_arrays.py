"""The numpy and torch paths of score packing: the shape and element type come from the
array, and the scores are converted and copied in ONE pass into the destination buffer (a
score region's range, or the bytes of an inline report). A torch tensor can also go into a
destination tensor (a score region exposed as one, host or CUDA memory): converted and
copied by ``copy_`` on the current stream, device to device when both are on the GPU.

Neither library is imported here: an input is an array of one only if the caller has
imported it already (``sys.modules``). Inline reports and score regions share these
writers, so both carry the same bytes. Numpy results are also byte for byte what the
pure-Python packing of scores.py makes of the same values (round to nearest even; float64
reaches bfloat16 through float32, as there); torch converts with its own casts (round to
nearest even; float64 reaches float16 and bfloat16 through float32).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

from .errors import ScoreShapeError

#: (rows of a 2-D input or None, elements, wire dtype, writer of exactly the packed bytes,
#: writer into a uint8 torch tensor of exactly that size, or None for numpy input)
Plan = Tuple[Optional[int], int, str, Callable[[memoryview], None],
             Optional[Callable[[Any], None]]]

_NUMPY_WIRE = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def plan(values: Any, dtype: Optional[str], default_dtype: Optional[str]) -> Optional[Plan]:
    """The plan for a numpy array or torch tensor of a kind handled here, else None (the
    caller then packs ``values`` the generic way)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(values, numpy.ndarray):
        return _numpy_plan(numpy, values, dtype, default_dtype)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        return _torch_plan(torch, values, dtype, default_dtype)
    return None


def _check_rank(ndim: int) -> None:
    if ndim not in (1, 2):
        raise ScoreShapeError(f"a score buffer must be 1-D or 2-D [layers, tokens], "
                              f"this one has {ndim} dimensions")


def _raw_wire(dtype: Optional[str], default_dtype: Optional[str]) -> str:
    wire = dtype or default_dtype
    if wire not in ("float16", "bfloat16"):
        raise ScoreShapeError("16-bit integer score buffers hold float16 or bfloat16 "
                              f"bits, not {wire or 'unknown'}: say which with dtype=")
    return wire


# -- numpy ---------------------------------------------------------------------------------

def _numpy_plan(np: Any, a: Any, dtype: Optional[str],
                default_dtype: Optional[str]) -> Optional[Plan]:
    kind, size = a.dtype.kind, a.dtype.itemsize
    if kind == "f" and size in (2, 4, 8):
        _check_rank(a.ndim)
        natural = {2: "float16", 4: "float32", 8: None}[size]
        wire = dtype or natural or default_dtype or "float32"

        def write(target: memoryview) -> None:
            dst = np.frombuffer(target, dtype=_NUMPY_WIRE[wire])
            with np.errstate(over="ignore", invalid="ignore"):  # beyond range: inf, as there
                if wire == "bfloat16":
                    np.copyto(dst, _bfloat16_bits(np, a).reshape(-1))
                else:
                    np.copyto(dst.reshape(a.shape), a, casting="unsafe")
    elif kind in "iu" and size == 2:
        _check_rank(a.ndim)
        wire = _raw_wire(dtype, default_dtype)

        def write(target: memoryview) -> None:  # the bits as they are, little-endian
            dst = np.frombuffer(target, dtype=a.dtype.newbyteorder("<"))
            np.copyto(dst.reshape(a.shape), a)
    else:
        return None  # raw bytes and the rest: the buffer path
    return (a.shape[0] if a.ndim == 2 else None), int(a.size), wire, write, None


def _bfloat16_bits(np: Any, a: Any) -> Any:
    """uint16 bfloat16 bits of ``a`` (via float32, round to nearest even; NaN stays NaN)."""
    bits = np.asarray(a, dtype="<f4").view("<u4")
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))))
    out = (rounded >> np.uint32(16)).astype("<u2")
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype("<u2")
    return out


# -- torch ---------------------------------------------------------------------------------

def _torch_plan(torch: Any, t: Any, dtype: Optional[str],
                default_dtype: Optional[str]) -> Optional[Plan]:
    if sys.byteorder != "little":
        return None  # torch.frombuffer reads native order; the wire is little-endian
    wire_types = {"float32": torch.float32, "float16": torch.float16,
                  "bfloat16": torch.bfloat16}
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        _check_rank(t.dim())
        wire = dtype or default_dtype or "float32"
        target_type = wire_types[wire]
    elif t.dtype == torch.int16 or t.dtype == getattr(torch, "uint16", None):
        _check_rank(t.dim())
        wire = _raw_wire(dtype, default_dtype)
        target_type = t.dtype
    else:
        return None  # through tolist(), as before

    def write(target: memoryview) -> None:
        src = t.detach()
        if src.dtype != target_type:
            src = src.to(target_type)  # on the tensor's device: fewer bytes to move
        dst = torch.frombuffer(target, dtype=target_type)
        dst.view(src.shape).copy_(src)  # CUDA: the one device-to-host copy, into target

    def write_tensor(target: Any) -> None:  # target: [nbytes] uint8, CPU or CUDA
        src = t.detach()
        if src.dtype != target_type and src.device != target.device:
            src = src.to(target_type)  # convert where the scores are: fewer bytes to move
        # On one device copy_ converts as it copies (the same casts as .to()): one pass.
        target.view(target_type).view(src.shape).copy_(src)

    return (t.shape[0] if t.dim() == 2 else None), int(t.numel()), wire, write, write_tensor
