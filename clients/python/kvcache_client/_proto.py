"""The generated kvcache.v1 modules (built from proto/kvcache/v1/kvcache.proto) and the
conversions between their enums and the client's names."""

from __future__ import annotations

from typing import Optional

try:
    from kvcache.v1 import kvcache_pb2 as pb
    from kvcache.v1 import kvcache_pb2_grpc as pb_grpc
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvcache_client needs the generated modules kvcache.v1.kvcache_pb2 and "
        "kvcache_pb2_grpc: install the wheel the build makes (pip install "
        "build/python/dist/kvcache_client-*.whl), or build them (cmake --build build "
        "--target kvcm_python_stubs) and put build/python on PYTHONPATH next to "
        "clients/python (see docs/PYTHON.md, \"Install\")"
    ) from error

__all__ = ["pb", "pb_grpc", "dtype_to_proto", "dtype_from_proto", "layout_to_proto",
           "layout_from_proto", "encoding_to_proto", "encoding_from_proto"]

_DTYPES = {
    "float32": pb.SCORE_DTYPE_FLOAT32,
    "float16": pb.SCORE_DTYPE_FLOAT16,
    "bfloat16": pb.SCORE_DTYPE_BFLOAT16,
}
_DTYPE_NAMES = {value: name for name, value in _DTYPES.items()}


def dtype_to_proto(dtype: Optional[str]) -> int:
    """The ScoreDtype of a normalized dtype name; None is UNSPECIFIED."""
    return pb.SCORE_DTYPE_UNSPECIFIED if dtype is None else _DTYPES[dtype]


def dtype_from_proto(value: int) -> str:
    """The name of a ScoreDtype; UNSPECIFIED reads as float32 (the daemon's default)."""
    return _DTYPE_NAMES.get(value, "float32")


_LAYOUTS = {"per_layer": pb.SCORE_LAYOUT_PER_LAYER, "folded": pb.SCORE_LAYOUT_FOLDED}


def layout_to_proto(layout: str) -> int:
    """The ScoreLayout of ``"per_layer"`` (sent as UNSPECIFIED, which means it) or
    ``"folded"``; ValueError for another name."""
    name = str(layout).lower().replace("-", "_")
    if name not in _LAYOUTS:
        raise ValueError(f"unknown score layout {layout!r}; use per_layer or folded")
    return pb.SCORE_LAYOUT_UNSPECIFIED if name == "per_layer" else _LAYOUTS[name]


def layout_from_proto(value: int) -> str:
    """``"folded"`` or ``"per_layer"`` (UNSPECIFIED reads as per_layer)."""
    return "folded" if value == pb.SCORE_LAYOUT_FOLDED else "per_layer"


_ENCODINGS = {"positions": pb.DECISION_ENCODING_POSITIONS, "mask": pb.DECISION_ENCODING_MASK,
              "auto": pb.DECISION_ENCODING_AUTO}
_ENCODING_NAMES = {value: name for name, value in _ENCODINGS.items()}


def encoding_to_proto(encoding: str) -> int:
    """The DecisionEncoding of ``"positions"`` (sent as UNSPECIFIED, which means it),
    ``"mask"`` or ``"auto"``; ValueError for another name."""
    name = str(encoding).lower()
    if name not in _ENCODINGS:
        raise ValueError(f"unknown decision encoding {encoding!r}; use positions, mask or auto")
    return pb.DECISION_ENCODING_UNSPECIFIED if name == "positions" else _ENCODINGS[name]


def encoding_from_proto(value: int) -> str:
    """``"positions"``, ``"mask"`` or ``"auto"`` (UNSPECIFIED reads as positions)."""
    return _ENCODING_NAMES.get(value, "positions")
