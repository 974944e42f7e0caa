"""The token budget of a sequence opened with a compression ratio (SPEC.md "Terms").

The daemon resolves the budget itself (cache_manager/policy/token_budget.cc); this is the
same rule for a worker or a tool that needs ``B`` before it opens the sequence, e.g. to
size its caches or to write a trace.
"""

from __future__ import annotations

import math

__all__ = ["budget_tokens"]


def budget_tokens(prefill_len: int, compression_ratio: float) -> int:
    """``B = max(1, floor((1 - ratio) * prefill_len + 1e-9))``, computed in double, as the
    daemon does: the most tokens the cache holds after a step. 0.9 keeps 10%.

    Raises ValueError, as the daemon's INVALID_ARGUMENT, for ``prefill_len < 1`` or a ratio
    outside ``0 <= ratio < 1``.
    """
    if prefill_len < 1:
        raise ValueError(f"prefill_len is {prefill_len}; it must be >= 1")
    if not 0.0 <= compression_ratio < 1.0:
        raise ValueError(f"compression_ratio is {compression_ratio}; it must satisfy "
                         "0 <= compression_ratio < 1")
    kept = math.floor((1.0 - compression_ratio) * float(prefill_len) + 1e-9)
    return max(1, min(kept, prefill_len))
