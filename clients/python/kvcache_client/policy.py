"""Eviction policies (SPEC.md "Policy"): a preset name or the fields one by one."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from ._proto import pb

__all__ = ["PRESETS", "SCORING_PRESETS", "Policy"]

#: The columns of presets.txt (its header comment says what each holds).
_PRESET_COLUMNS = ("name", "aggregation", "alpha", "refresh", "refresh_interval",
                   "protect_recent", "protect_sinks")
#: The aggregations that read attention scores (the daemon's Policy::UsesScores).
_SCORING_AGGREGATIONS = ("ema", "cumulative", "single_step")


def _read_presets() -> Dict[str, Dict[str, str]]:
    """{name: {column: text}} of presets.txt, in the file's order.

    The file ships inside this package; in the source tree it is a link to
    cache_manager/policy/presets.txt, the list the daemon's presets are generated from.
    """
    path = Path(__file__).with_name("presets.txt")
    rows: Dict[str, Dict[str, str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        columns = line.split("#", 1)[0].split()
        if not columns:
            continue
        if len(columns) != len(_PRESET_COLUMNS):
            raise ImportError(f"{path}:{number}: {len(columns)} columns, expected "
                              f"{len(_PRESET_COLUMNS)} ({' '.join(_PRESET_COLUMNS)})")
        rows[columns[0]] = dict(zip(_PRESET_COLUMNS, columns))
    return rows


_PRESET_ROWS = _read_presets()

#: Named presets, expanded by the daemon, in its order (cache_manager/policy/presets.txt).
PRESETS = tuple(_PRESET_ROWS)
#: The presets whose aggregation reads attention scores (a worker captures them; the others
#: never need scores).
SCORING_PRESETS = tuple(name for name, row in _PRESET_ROWS.items()
                        if row["aggregation"] in _SCORING_AGGREGATIONS)

_AGGREGATIONS = {
    "ema": pb.AGGREGATION_EMA,
    "cumulative": pb.AGGREGATION_CUMULATIVE,
    "single_step": pb.AGGREGATION_SINGLE_STEP,
    "recency": pb.AGGREGATION_RECENCY,
    "random": pb.AGGREGATION_RANDOM,
}
_REFRESHES = {
    "every_step": pb.REFRESH_EVERY_STEP,
    "lazy": pb.REFRESH_LAZY,
    "score_free": pb.REFRESH_SCORE_FREE,
}


@dataclass(frozen=True)
class Policy:
    """How scores become momentum and which steps need scores.

    ``Policy(aggregation="ema", alpha=0.8, refresh="lazy", refresh_interval=4)``, or a preset:
    ``Policy(preset="h2o")``: with a preset only it, ``seed`` and ``span_pool`` are sent
    (so a resolved policy from ``inspect()`` re-sends as its preset). ``alpha`` and
    ``refresh_interval`` left as None take the daemon's defaults (0.8 and 4). Values are
    checked by the daemon, which rejects a bad policy with INVALID_ARGUMENT.
    """

    aggregation: str = "ema"         #: ema, cumulative, single_step, recency, random
    alpha: Optional[float] = None    #: EMA coefficient, 0 <= alpha < 1
    refresh: str = "every_step"      #: every_step, lazy, score_free
    refresh_interval: Optional[int] = None  #: lazy only, >= 1
    protect_sinks: int = 0           #: positions below this are never evicted
    protect_recent: int = 0          #: the n newest cached tokens are never evicted
    seed: int = 0                    #: random only
    preset: Optional[str] = None     #: one of PRESETS; set alone (plus seed, span_pool)
    #: SPEC.md "Span pooling": max-pool each score row over this many positions before it
    #: becomes momentum; 0 or 1 off, else odd 3 to 255 (with a preset too)
    span_pool: int = 0

    @classmethod
    def from_preset(cls, name: str, *, seed: int = 0, span_pool: int = 0) -> "Policy":
        return cls(preset=name, seed=seed, span_pool=span_pool)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Policy":
        """From a mapping of field names, e.g. the ``policy`` object of a kvtrace/1 header."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown policy fields {unknown}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def coerce(cls, policy: Union["Policy", str, Mapping[str, Any], None]) -> "Policy":
        """A Policy from a Policy, a preset name, a mapping of fields, or None (inertia)."""
        if policy is None:
            return cls(preset="inertia")
        if isinstance(policy, Policy):
            return policy
        if isinstance(policy, str):
            return cls(preset=policy)
        if isinstance(policy, Mapping):
            return cls.from_dict(policy)
        raise TypeError(f"policy must be a Policy, a preset name or a mapping, "
                        f"not {type(policy).__name__}")

    def to_proto(self) -> pb.Policy:
        """The message; raises ValueError for an aggregation or refresh name that has none."""
        message = pb.Policy(seed=self.seed, span_pool=self.span_pool)
        if self.preset is not None:
            message.preset = self.preset
            return message
        message.aggregation = _enum(_AGGREGATIONS, "aggregation", self.aggregation)
        message.refresh = _enum(_REFRESHES, "refresh", self.refresh)
        message.protect_sinks = self.protect_sinks
        message.protect_recent = self.protect_recent
        if self.alpha is not None:
            message.alpha = self.alpha
        if self.refresh_interval is not None:
            message.refresh_interval = self.refresh_interval
        return message

    @classmethod
    def from_proto(cls, message: pb.Policy) -> "Policy":
        """A resolved policy as the daemon reports it (preset, if any, plus its fields)."""
        return cls(
            aggregation=_name(_AGGREGATIONS, message.aggregation, "ema"),
            alpha=message.alpha if message.HasField("alpha") else None,
            refresh=_name(_REFRESHES, message.refresh, "every_step"),
            refresh_interval=(message.refresh_interval
                              if message.HasField("refresh_interval") else None),
            protect_sinks=message.protect_sinks,
            protect_recent=message.protect_recent,
            seed=message.seed,
            preset=message.preset or None,
            span_pool=message.span_pool,
        )


def _enum(table: Mapping[str, int], field: str, name: str) -> int:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown policy {field} {name!r}; use one of {', '.join(table)}") \
            from None


def _name(table: Mapping[str, int], value: int, unspecified: str) -> str:
    if value == 0:
        return unspecified
    for name, number in table.items():
        if number == value:
            return name
    return str(value)
