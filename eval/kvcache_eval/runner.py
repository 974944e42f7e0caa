"""Running the decoder through a real kvcached: one sample under one configuration.

A configuration is a policy at a compression ratio (or the full cache, no daemon), a
scorer, and the worker's transport choices (KV in the daemon's shared-memory pool or in
the worker's own tensors; scores folded or per layer). The prompt is prefilled once per
sample (compression is decode-time only, so every configuration starts from the same
cache); each configuration then decodes from a copy of it:

    the first answer token comes from the prefill's logits; decode step t feeds the token
    at position L0 + t - 1, attends over the cache plus itself, captures scores when the
    daemon's previous decision said the step needs them, sends the step, and applies the
    decision (evictions, pool slot changes) before the next.

Forced tokens (a follow-up question) are fed as decode steps like generated ones.

A hand-off run (``RunConfig.handoff``, disaggregated serving: docs/DISAGGREGATION.md)
decides step 1 on the runner's daemon (the prefill node's), then has a second daemon (the
decode node's, ``Runner(peer=...)``) import the sequence and decides the remaining steps
there, the pooled cache adopting the slot table the import returns; its ``Outcome.handoff``
says what moved.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from kvcache_client import ImportedSequence, KvCacheClient, Policy
from kvcache_client.torch import (DecodeLoop, DenseKvCache, KvPoolMapping,
                                  ObservationWindow, PooledKvCache)

from . import diagnostics, tasks
from .model import Decoder

PolicyLike = Union[str, Policy]


@dataclass(frozen=True)
class RunConfig:
    """What one evaluation column runs."""

    name: str
    policy: Optional[PolicyLike]     #: None: the full cache (no daemon)
    compression: float = 0.0
    scorer: str = "attention"
    folded: bool = True               #: one folded row per step (else [layers, tokens])
    pooled: bool = True               #: KV in the daemon's shared-memory pool
    shm_scores: bool = True           #: scores through a shared-memory score region
    capture_from: str = "query"       #: recompute from q and K, or pool the model's weights
    track_sets: bool = False          #: record the cached positions after every step
    trace: bool = False               #: record a diagnostics.SequenceTrace (folded only)
    handoff: bool = False             #: step 1 here, the rest on the peer daemon (imported)
    window: int = 0                   #: observation window: step 1 pools the last w queries
    first_step_only: bool = False     #: stop after step 1 (what it kept is all that counts)


@dataclass
class Prefilled:
    """A sample's prompt run once: every layer's K/V and the first answer token."""

    sample: tasks.Sample
    keys: List[torch.Tensor]     # per layer [kv_heads, L0, head_dim]
    values: List[torch.Tensor]
    first_token: int
    seconds: float
    #: observation windows filled during the prefill, by size (RunConfig.window)
    windows: Dict[int, ObservationWindow] = field(default_factory=dict)


@dataclass
class Outcome:
    """One sample under one configuration."""

    task: str
    length: int
    correct: bool                 #: every answer (the last turn's too) exactly right
    last_correct: bool            #: the last turn's answer right (relevance shift)
    generated: List[int]
    retained: int                 #: tokens cached after the last step
    steps: int
    decode_s: float               #: the whole decode loop
    capture_s: float              #: inside the score captures
    step_s: float                 #: sending the steps and waiting for the decisions
    apply_s: float                #: applying decisions to the cache (pool writes included)
    scoring_steps: int = 0
    evidence_kept: float = 1.0    #: share of the answer's source tokens cached after step 1
    first_token_kept: bool = True  #: step 1's new token (position L0) survived its step
    sets: List[Set[int]] = field(default_factory=list)
    trace: Optional[diagnostics.SequenceTrace] = None
    handoff: Optional[ImportedSequence] = None  #: a hand-off run: what the import moved


def prefill(model: Decoder, sample: tasks.Sample, windows: Sequence[int] = ()) -> Prefilled:
    """The prompt run once, on the model's device (its K/V stay there); ``windows``: the
    observation window sizes to fill as it runs (those of the configurations that will
    decode from it)."""
    start = time.perf_counter()
    filled = {size: ObservationWindow(size) for size in sorted(set(windows)) if size}
    with torch.no_grad():
        logits, keys, values = model.prefill(
            torch.tensor([sample.prompt], device=model.embed.weight.device),
            list(filled.values()))
    return Prefilled(sample, [k[0].contiguous() for k in keys],
                     [v[0].contiguous() for v in values],
                     int(logits[0, -1].argmax()), time.perf_counter() - start, filled)


class _KeepAll:
    """The full cache's 'decision': nothing evicted."""

    ok, evicted, kv_changes = True, (), ()

    def __init__(self, step: int, cache_size: int) -> None:
        self.step, self.cache_size = step, cache_size


def script(sample: tasks.Sample) -> List[Tuple[str, Any]]:
    """The segments after the prompt: ("gen", n) answer tokens, ("force", tokens)."""
    out: List[Tuple[str, Any]] = [("gen", len(sample.answer))]
    for question, answer in sample.turns:
        out += [("force", question), ("gen", len(answer))]
    return out


class Runner:
    """Runs configurations against one kvcached (and one KV pool mapping)."""

    _ids = itertools.count(1)

    def __init__(self, model: Decoder, client: Optional[KvCacheClient],
                 mapping: Optional[KvPoolMapping], *, score_region_bytes: int = 1 << 20,
                 seed: int = 0,
                 peer: Optional[Tuple[KvCacheClient, Optional[KvPoolMapping]]] = None,
                 daemon_score_region: bool = False) -> None:
        """``peer``: the decode node's daemon of hand-off runs (its client, and the mapping
        of its KV pool for pooled runs); its pools must be shaped like ``client``'s.
        ``daemon_score_region``: the score region is the daemon's (device memory with a
        CUDA engine, which a model on the GPU writes in place), not one of this process."""
        self.model = model
        self.client = client
        self.mapping = mapping
        self.seed = seed
        self.batch, self.inline_batch = self._batches(client, score_region_bytes,
                                                      daemon_score_region)
        self.peer_client, self.peer_mapping = peer if peer is not None else (None, None)
        self.peer_batch, self.peer_inline_batch = self._batches(
            self.peer_client, score_region_bytes, daemon_score_region)

    @staticmethod
    def _batches(client: Optional[KvCacheClient], score_region_bytes: int,
                 daemon_score_region: bool = False) -> Tuple[Any, Any]:
        """(the batch whose scores go through a score region, the inline one)."""
        if client is None:
            return None, None
        if not score_region_bytes:
            shm = client.batch()
        elif daemon_score_region:
            shm = client.batch(score_region_bytes=score_region_bytes, daemon_score_region=True)
        else:
            shm = client.batch(score_region_bytes=score_region_bytes)
        return shm, client.batch()

    def close(self) -> None:
        for batch in (self.batch, self.inline_batch, self.peer_batch,
                      self.peer_inline_batch):
            if batch is not None:
                batch.close()

    def _hand_off(self, sid: str, config: RunConfig, loop: DecodeLoop,
                  cache: Any) -> Tuple[DecodeLoop, Any, ImportedSequence]:
        """The decode node takes ``sid`` over: its daemon imports it from ours, its batch
        tracks it, and a pooled cache adopts the slot table of its pool (a dense cache, the
        worker's own memory, goes on as it is). Returns the loop and cache to go on with."""
        if self.peer_client is None:
            raise ValueError(f"{config.name}: a hand-off run needs Runner(peer=...)")
        batch = self.peer_batch if config.shm_scores else self.peer_inline_batch
        imported = batch.import_sequence(sid, self.client.address)
        loop.remove(sid)
        loop.batch.remove(sid)  # the source closed it at the commit
        if config.pooled:
            if self.peer_mapping is None:
                raise ValueError(f"{config.name}: pooled hand-off runs need the peer's mapping")
            cache = PooledKvCache.adopt(self.peer_mapping, imported)
        moved = DecodeLoop(batch, scorer=config.scorer)
        moved.add(sid, cache)
        return moved, cache, imported

    def run(self, config: RunConfig, pre: Prefilled, index: int = 0) -> Outcome:
        sample = pre.sample
        cfg = self.model.cfg
        L0 = sample.length
        sid = None
        loop = None
        if config.policy is None:
            cache: Any = DenseKvCache(pre.keys, pre.values, capacity=L0 + 64)
        else:
            if self.client is None:
                raise ValueError(f"{config.name} needs a daemon")
            batch = self.batch if config.shm_scores else self.inline_batch
            policy = config.policy
            if isinstance(policy, str) and policy == "random":
                policy = Policy(preset="random", seed=self.seed * 100003 + index)
            sid = f"{config.name}-{next(self._ids)}"
            batch.open(sid, L0, compression_ratio=config.compression, policy=policy,
                       score_layout="folded" if config.folded else "per_layer",
                       layers=cfg.layers if config.folded else None)
            if config.pooled:
                if self.mapping is None:
                    raise ValueError("pooled runs need a daemon holding KV pools")
                cache = PooledKvCache.open(self.client, self.mapping, sid)
                cache.load_prefill(pre.keys, pre.values)
            else:
                cache = DenseKvCache(pre.keys, pre.values, capacity=L0 + 64)
            loop = DecodeLoop(batch, scorer=config.scorer)
            loop.add(sid, cache, window=self._window(config, pre))

        stream: List[int] = []
        generated: List[int] = []
        answers: List[List[int]] = [sample.answer] + [a for _, a in sample.turns]
        answers_out: List[List[int]] = []
        segments = script(sample)
        total = sum(n if kind == "gen" else len(n) for kind, n in segments)
        next_pred = pre.first_token
        sets: List[Set[int]] = []
        evidence = tasks.evidence(sample)
        evidence_kept = 1.0
        first_token_kept = True
        steps = 0
        trace = None
        loops: List[DecodeLoop] = []  # a hand-off run's first loop (its steps on the source)
        imported: Optional[ImportedSequence] = None
        if config.handoff and (loop is None or config.trace):
            raise ValueError(f"{config.name}: hand-off runs go through a daemon, untraced")
        if config.trace:
            if loop is None or not config.folded:
                raise ValueError(f"{config.name}: traces are of folded runs through a daemon")
            state = self.client.inspect(sid)
            trace = diagnostics.SequenceTrace(str(config.policy), state.budget,
                                              state.score_dtype)
        start = time.perf_counter()
        for kind, what in segments:
            fed = [None] * what if kind == "gen" else list(what)
            if kind == "gen":
                answers_out.append([])
            for forced in fed:
                token = next_pred if forced is None else forced
                stream.append(token)
                if forced is None:
                    generated.append(token)
                    answers_out[-1].append(token)
                if len(stream) == total:
                    break
                position = L0 + len(stream) - 1
                steps += 1
                if loop is None:
                    logits = self.model.decode(token, position, cache, None,
                                               capture_from=config.capture_from)
                    cache.apply(_KeepAll(steps, len(cache) + 1))
                else:
                    candidates = [*cache.positions, position]
                    captures = loop.begin()
                    logits = self.model.decode(token, position, cache, captures[sid],
                                               capture_from=config.capture_from)
                    decision = loop.finish(captures)[sid]
                    if trace is not None:
                        trace.steps.append(self._trace_step(
                            sid, steps, candidates, captures[sid], decision))
                if config.track_sets:
                    sets.append(set(cache.positions))
                if steps == 1:
                    cached = set(cache.positions)
                    first_token_kept = L0 in cached
                    if evidence:
                        evidence_kept = sum(p in cached for p in evidence) / len(evidence)
                    if config.first_step_only:
                        break
                next_pred = int(logits.argmax())
                if config.handoff and steps == 1:
                    loops.append(loop)
                    loop, cache, imported = self._hand_off(sid, config, loop, cache)
            if config.first_step_only and steps:
                break  # the answer is not generated: correct is False
        decode_s = time.perf_counter() - start
        if loop is not None:
            loops.append(loop)
        stats = {key: sum((lp.stats[key] for lp in loops), 0.0)
                 for key in ("capture_s", "step_s", "apply_s", "scoring_steps")}
        outcome = Outcome(
            task=sample.task, length=L0,
            correct=all(a == b for a, b in zip(answers, answers_out)),
            last_correct=answers[-1] == answers_out[-1], generated=generated,
            retained=len(cache), steps=steps, decode_s=decode_s,
            capture_s=stats["capture_s"], step_s=stats["step_s"], apply_s=stats["apply_s"],
            scoring_steps=int(stats["scoring_steps"]),
            evidence_kept=evidence_kept, first_token_kept=first_token_kept, sets=sets,
            trace=trace, handoff=imported)
        if sid is not None:
            loop.batch.close_sequence(sid)
        return outcome

    @staticmethod
    def _window(config: RunConfig, pre: Prefilled) -> Optional[ObservationWindow]:
        """The observation window step 1 of ``config`` pools (None: off)."""
        if not config.window:
            return None
        if config.window not in pre.windows:
            raise ValueError(f"{config.name}: the prefill filled no observation window of "
                             f"{config.window} (prefill(..., windows=...))")
        return pre.windows[config.window]

    def _trace_step(self, sid: str, step: int, candidates: List[int], capture: Any,
                    decision: Any) -> diagnostics.StepTrace:
        after = self.client.inspect(sid, include_cache=True)  # traced runs are not timed
        return diagnostics.StepTrace(
            step, candidates, None if capture is None else capture.folded_row().tolist(),
            list(decision.evicted), after.positions, after.momentum)


def jaccard(a: Sequence[Set[int]], b: Sequence[Set[int]]) -> float:
    """Mean over steps of |A ∩ B| / |A ∪ B| of two runs' cached-position sets."""
    values = [len(x & y) / len(x | y) for x, y in zip(a, b) if x or y]
    return sum(values) / len(values) if values else 1.0
