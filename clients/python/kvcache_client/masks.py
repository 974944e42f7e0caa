"""Eviction masks: the two forms of a decision's evicted tokens, and the cache positions a
:class:`~kvcache_client.batch.SequenceBatch` tracks to give both from either.

A sequence opened with ``decision_encoding="mask"`` (or ``"auto"``, when the mask is the
smaller) gets its decisions as a bit mask over the cache before eviction: one bit per token
in ascending position order, then the step's new token; bit i is byte i // 8, bit i % 8
(LSB first); set = evicted (``Decision.mask_tokens`` bits). Positions and masks convert
into each other only with those cache positions, which a batch tracks step by step
(:class:`CachePositions`). numpy is used when it is installed (imported on first use),
plain lists otherwise.
"""

from __future__ import annotations

import bisect
import importlib
import sys
from typing import Any, Iterable, List, Optional, Sequence, Tuple

__all__ = ["CachePositions"]

_numpy: Any = False  # not looked up yet


def numpy_or_none() -> Any:
    """numpy if it is installed, else None (looked up once)."""
    global _numpy
    if _numpy is False:
        try:
            _numpy = importlib.import_module("numpy")
        except ImportError:  # pragma: no cover - scripts/install-deps.sh installs it
            _numpy = None
    return _numpy


def mask_bytes(tokens: int) -> int:
    """Bytes of a mask of ``tokens`` bits."""
    return (tokens + 7) // 8


def evicted_bits(mask: bytes, tokens: int) -> Any:
    """The ``tokens`` bits of ``mask`` (True = evicted): a numpy bool array, or a list."""
    np = numpy_or_none()
    if np is not None:
        return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), count=tokens,
                             bitorder="little").view(np.bool_)
    return [bool((mask[i >> 3] >> (i & 7)) & 1) for i in range(tokens)]


def pack_mask(evicted_indices: Iterable[int], tokens: int) -> bytes:
    """The mask of ``tokens`` bits with ``evicted_indices`` set (what the daemon sends)."""
    out = bytearray(mask_bytes(tokens))
    for i in evicted_indices:
        if not 0 <= i < tokens:
            raise ValueError(f"index {i} is outside a mask of {tokens} tokens")
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def keep_from_indices(tokens: int, evicted_indices: Optional[Sequence[int]]) -> Any:
    """A keep mask of ``tokens`` entries, False at ``evicted_indices``."""
    np = numpy_or_none()
    if np is not None:
        keep = np.ones(tokens, dtype=np.bool_)
        if evicted_indices is not None and len(evicted_indices):
            keep[np.asarray(evicted_indices, dtype=np.int64)] = False
        return keep
    keep_list = [True] * tokens
    for i in evicted_indices or ():
        keep_list[i] = False
    return keep_list


def keep_from_mask(mask: bytes, tokens: int) -> Any:
    """The keep mask (True = kept) of an evicted-bit mask."""
    bits = evicted_bits(mask, tokens)
    np = numpy_or_none()
    if np is not None:
        return ~bits
    return [not b for b in bits]


def as_tensor_like(keep: Any, like: Any) -> Any:
    """``keep`` as what ``like`` is: a torch tensor gives a torch.bool tensor on its device,
    a numpy array (or None) gives numpy (a list without numpy)."""
    if like is None:
        return keep
    torch = sys.modules.get("torch")  # a tensor means torch is imported already
    if torch is not None and isinstance(like, torch.Tensor):
        if numpy_or_none() is not None:
            return torch.from_numpy(keep).to(device=like.device)
        return torch.tensor(keep, dtype=torch.bool, device=like.device)
    np = numpy_or_none()
    if np is not None and isinstance(like, np.ndarray):
        return np.asarray(keep, dtype=np.bool_)
    raise TypeError(f"keep_mask(like=...) takes a torch tensor or a numpy array, not "
                    f"{type(like).__name__}")


def resolve(sequence_id: str, step: int, evicted: Optional[List[int]], mask: bytes,
            mask_tokens: int, cache_size: int,
            cache: Sequence[int]) -> Tuple[List[int], List[int]]:
    """(evicted positions, ascending; their indices into ``cache``) of a decision, from its
    positions (``mask_tokens`` 0) or its mask. ``cache``: the positions before eviction,
    ascending, then the new token (a numpy int64 array or a list). ValueError when the
    decision does not fit ``cache`` (the tracking is out of step)."""
    def where() -> str:  # only for the errors
        return f"sequence {sequence_id!r} step {step}"

    np = numpy_or_none()
    n = len(cache)
    if mask_tokens:
        if mask_tokens != n or len(mask) != mask_bytes(n):
            raise ValueError(f"{where()}: the mask covers {mask_tokens} tokens in {len(mask)} "
                             f"bytes, the tracked cache holds {n} (cached + the new token)")
        bits = evicted_bits(mask, n)
        if np is not None:
            found_at = np.flatnonzero(bits)
            positions = np.asarray(cache)[found_at].tolist()
            indices = found_at.tolist()
        else:
            indices = [i for i, b in enumerate(bits) if b]
            positions = [cache[i] for i in indices]
    else:
        positions = list(evicted or ())
        if np is not None and len(positions) > 16:
            array = np.asarray(cache)
            wanted = np.asarray(positions, dtype=np.int64)
            found_at = np.searchsorted(array, wanted)
            inside = found_at < n
            found = bool(inside.all()) and bool((array[found_at[inside]] == wanted).all())
            indices = found_at.tolist()
        elif np is not None:  # a steady step evicts a few: scalar searches are cheaper
            array = np.asarray(cache)
            indices = [int(array.searchsorted(p)) for p in positions]
            found = all(i < n and array[i] == p for i, p in zip(indices, positions))
        else:
            indices = [bisect.bisect_left(cache, p) for p in positions]
            found = all(i < n and cache[i] == p for i, p in zip(indices, positions))
        if not found:
            raise ValueError(f"{where()}: an evicted position is not in the tracked cache")
    if cache_size != n - len(positions):
        raise ValueError(f"{where()}: the daemon's cache holds {cache_size} tokens, the tracked "
                         f"one {n - len(positions)} after eviction")
    return positions, indices


class CachePositions:
    """One sequence's cached positions, ascending, as its batch tracks them.

    ``before(new_position)`` gives the cache before the step's eviction with the new token
    last (a view, valid until the next call), and ``keep(indices)`` drops the evicted ones.
    With numpy: an int64 buffer with room to grow (a steady step moves at most the tail of
    the cache, nothing is allocated); without: a list.
    """

    def __init__(self, positions: Iterable[int]) -> None:
        np = numpy_or_none()
        if np is not None:
            if isinstance(positions, range):
                initial = np.arange(positions.start, positions.stop, positions.step,
                                    dtype=np.int64)
            else:
                initial = np.asarray(list(positions), dtype=np.int64)
            self._buffer = np.empty(max(16, 2 * len(initial) + 1), dtype=np.int64)
            self._buffer[:len(initial)] = initial
            self._list: Optional[List[int]] = None
            self._size = len(initial)
        else:
            self._list = list(positions)
            self._size = len(self._list)

    def __len__(self) -> int:
        return self._size

    def tolist(self) -> List[int]:
        if self._list is not None:
            return list(self._list)
        return self._buffer[:self._size].tolist()

    def before(self, new_position: int) -> Sequence[int]:
        """The cache before a step's eviction: the cached positions, then ``new_position``."""
        if self._list is not None:
            self._list.append(new_position)
            return self._list
        if self._size + 1 > len(self._buffer):
            grown = numpy_or_none().empty(2 * len(self._buffer), dtype=self._buffer.dtype)
            grown[:self._size] = self._buffer[:self._size]
            self._buffer = grown
        self._buffer[self._size] = new_position
        return self._buffer[:self._size + 1]

    def cancel(self) -> None:
        """Undoes ``before`` (the step's decision did not fit)."""
        if self._list is not None:
            self._list.pop()

    def keep(self, evicted_indices: Sequence[int]) -> None:
        """Completes the step ``before`` began: drops the entries at ``evicted_indices``
        (ascending) of the cache it returned."""
        n = self._size + 1
        k = len(evicted_indices)
        if self._list is not None:
            if k * 8 < n:
                for i in reversed(evicted_indices):
                    del self._list[i]
            else:
                drop = set(evicted_indices)
                self._list = [p for i, p in enumerate(self._list) if i not in drop]
            self._size = len(self._list)
            return
        buffer = self._buffer
        if k == 1:
            i = int(evicted_indices[0])
            buffer[i:n - 1] = buffer[i + 1:n]  # numpy copies overlapping ranges safely
        elif k:
            np = numpy_or_none()
            keep = np.ones(n, dtype=np.bool_)
            keep[np.asarray(evicted_indices, dtype=np.int64)] = False
            buffer[:n - k] = buffer[:n][keep]
        self._size = n - k
