"""The first step composed with prefill-time selection, short (``kvcache-eval
--first_step_only``, the demo's last screen): of the answer's evidence, how much is still
cached after decode step 1, plain inertia against inertia with the observation window and
span pooling, at one compression ratio, with the paired bootstrap interval of the gain.
Step 1 only (what it kept is all that counts), so a few dozen samples take seconds; the
full comparison, with accuracy, is docs/EVALUATION.md's section of the same name."""

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

from kvcache_client import Policy

from . import tasks
from .bootstrap import Interval, paired_difference
from .runner import RunConfig, Runner, prefill


@dataclass
class FirstStepGain:
    """Evidence kept after step 1 per sample, plain and composed, and the paired gain."""

    ratio: float
    window: int
    span: int
    plain: List[float]
    composed: List[float]
    gain: Interval

    def describe(self) -> str:
        n = len(self.plain)
        mean = lambda xs: 100.0 * sum(xs) / len(xs)  # noqa: E731
        what = " + ".join(filter(None, (f"window {self.window}" if self.window else "",
                                        f"span pooling {self.span}" if self.span > 1 else "")))
        return (f"evidence kept after step 1 at rho = {self.ratio}, {n} samples: "
                f"inertia {mean(self.plain):.1f}%, inertia + {what} {mean(self.composed):.1f}% "
                f"({100 * self.gain.estimate:+.1f} points, paired bootstrap 95% interval "
                f"[{100 * self.gain.low:+.1f}, {100 * self.gain.high:+.1f}])")


def composed_policy(preset: str, span: int) -> Any:
    """``preset``, with the daemon span-pooling its rows over ``span`` positions."""
    return Policy(preset=preset, span_pool=span) if span > 1 else preset


def first_step_gain(runner: Runner, model: Any, seed: int, per_task: int,
                    lengths: Sequence[int], ratio: float, window: int,
                    span: int) -> FirstStepGain:
    """Runs step 1 of every sample of ``tasks.eval_set(seed, per_task, lengths)`` plain and
    composed (window ``window``, span pooling ``span``) and pairs them."""
    plain = RunConfig(f"inertia@{ratio}", "inertia", ratio, pooled=False, first_step_only=True)
    composed = RunConfig(f"inertia+composed@{ratio}", composed_policy("inertia", span), ratio,
                         pooled=False, first_step_only=True, window=window)
    kept: Dict[str, List[float]] = {plain.name: [], composed.name: []}
    for index, sample in enumerate(tasks.eval_set(seed, per_task, lengths)):
        pre = prefill(model, sample, [window])
        for config in (plain, composed):
            kept[config.name].append(runner.run(config, pre, index).evidence_kept)
    return FirstStepGain(ratio, window, span, kept[plain.name], kept[composed.name],
                         paired_difference(kept[composed.name], kept[plain.name]))
