"""Synthetic long-context tasks in RULER's shapes, over a small vocabulary.

A prompt is a haystack of filler words with needles in it and a question at its end; the
answer is several tokens, ended by ``.``. Keys (and variable names) are letters, distinct
within a sample; values are four digits, drawn with replacement, so different needles share
digits and a value is found by its key; the filler is a disjoint set of 20 words:

    niah_single      # k 3 9 3 4 .                    ? k        -> 3 9 3 4 .
    niah_multikey    four needles with distinct keys  ? k        -> the value of k
    niah_multivalue  two needles with the SAME key    ? k        -> v1 , v2 .
    niah_multiquery  four needles                     ? k1 k2    -> v1 , v2 .
    vt               # 3 9 3 4 a .  # a b .  # b c .  (a = the value, b = a, c = b; and a
                     decoy chain from another value)  ? 3 9 3 4  -> a b c .

Training samples may ask several questions in turns (``? k1 v1 . ? k2 v2 .``, with filler
between turns sometimes): the relevance-shift task of the evaluation (the question changes
mid-generation) is such a second turn, fed to the model during decoding. Everything is
drawn from a ``random.Random``, so a seed fixes the task set.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

SPECIALS = ["<pad>", "<bos>"]
MARKS = ["#", "?", ",", "."]
CONTENT = [str(d) for d in range(10)] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
FILLER = [f"w{i}" for i in range(20)]
RESERVED = ["<r0>", "<r1>"]
VOCAB = SPECIALS + MARKS + CONTENT + FILLER + RESERVED
ID = {token: i for i, token in enumerate(VOCAB)}
PAD, BOS = ID["<pad>"], ID["<bos>"]
HASH, ASK, COMMA, DOT = (ID[m] for m in MARKS)
CONTENT_IDS = [ID[t] for t in CONTENT]
KEY_IDS = [ID[chr(c)] for c in range(ord("a"), ord("z") + 1)]   # keys, variable names
DIGIT_IDS = [ID[str(d)] for d in range(10)]                      # values
FILLER_IDS = [ID[t] for t in FILLER]

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")
VALUE_LEN = 4


def encode(text: str) -> List[int]:
    return [ID[t] for t in text.split()]


def decode(ids: Sequence[int]) -> str:
    return " ".join(VOCAB[i] for i in ids)


@dataclass
class Sample:
    """One prompt and its answer; ``turns`` are later (question, answer) pairs."""

    task: str
    prompt: List[int]
    answer: List[int]
    turns: List[Tuple[List[int], List[int]]] = field(default_factory=list)
    depth: float = 0.0  #: where the (first) needle sits, 0 = start, 1 = end

    @property
    def length(self) -> int:
        return len(self.prompt)


#: How values are drawn: "digits" (with replacement; the evaluation's), or "distinct"
#: (keys and values all distinct letters and digits: what training stages 1-2 of the
#: committed weights used; ``train --values distinct``).
VALUES = "digits"


class _Symbols:
    """Keys (letters, distinct within a sample) and values (digits, drawn with
    replacement: values share digits, so copying one needs its key, not just the digit
    before)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._distinct = VALUES == "distinct"
        self._pool = (rng.sample(CONTENT_IDS, len(CONTENT_IDS)) if self._distinct
                      else rng.sample(KEY_IDS, len(KEY_IDS)))

    def take(self, n: int) -> List[int]:
        out, self._pool = self._pool[:n], self._pool[n:]
        return out

    def value(self) -> List[int]:
        if self._distinct:
            return self.take(VALUE_LEN)
        return self._rng.choices(DIGIT_IDS, k=VALUE_LEN)


def _needle(key: int, value: List[int]) -> List[int]:
    return [HASH, key, *value, DOT]


def _haystack(rng: random.Random, length: int, needles: List[List[int]],
              ordered: bool = False) -> Tuple[List[int], List[float]]:
    """``length`` tokens: BOS, filler, the needles at random depths (in the given order when
    ``ordered``). Returns the tokens and each needle's depth."""
    room = length - 1 - sum(len(n) for n in needles)
    if room < len(needles):
        raise ValueError(f"length {length} is too short for {len(needles)} needles")
    cuts = sorted(rng.sample(range(room + 1), len(needles)))
    order = list(range(len(needles)))
    if not ordered:
        rng.shuffle(order)
    filler = rng.choices(FILLER_IDS, k=room)
    out, depths, prev = [BOS], [0.0] * len(needles), 0
    for cut, index in zip(cuts, order):
        out += filler[prev:cut]
        depths[index] = cut / max(room, 1)
        out += needles[index]
        prev = cut
    out += filler[prev:]
    return out, depths


def make_sample(task: str, rng: random.Random, length: int, *, turns: int = 1,
                gap: int = 0, needles: int = 4) -> Sample:
    """A sample of ``task`` whose prompt is ``length`` tokens (question included).
    ``turns`` > 1 adds follow-up questions (niah_multikey only: about other keys);
    ``gap`` filler tokens precede each follow-up; ``needles``: of multikey and
    multiquery."""
    sym = _Symbols(rng)
    if task in ("niah_single", "niah_multikey", "niah_multiquery"):
        count = 1 if task == "niah_single" else needles
        keys = sym.take(count)
        values = [sym.value() for _ in keys]
        value_of = dict(zip(keys, map(tuple, values)))
        if task == "niah_multiquery":
            asked = rng.sample(keys, 2)
            question = [ASK, *asked]
            answer = [*value_of[asked[0]], COMMA, *value_of[asked[1]], DOT]
        else:
            asked = [keys[0]] if task == "niah_single" else \
                rng.sample(keys, min(count, max(1, turns)))
            question = [ASK, asked[0]]
            answer = [*value_of[asked[0]], DOT]
        hay, depths = _haystack(rng, length - len(question),
                                [_needle(k, v) for k, v in zip(keys, values)])
        sample = Sample(task, hay + question, answer, depth=depths[keys.index(asked[0])])
        if task == "niah_multikey":
            for key in asked[1:turns]:
                filler = rng.choices(FILLER_IDS, k=gap)
                sample.turns.append((filler + [ASK, key], [*value_of[key], DOT]))
        return sample
    if task == "niah_multivalue":
        key = sym.take(1)[0]
        values = [sym.value() for _ in range(2)]
        question = [ASK, key]
        hay, depths = _haystack(rng, length - len(question),
                                [_needle(key, v) for v in values], ordered=True)
        return Sample(task, hay + question, [*values[0], COMMA, *values[1], DOT],
                      depth=depths[0])
    if task == "vt":
        value, other = sym.value(), sym.value()
        names = sym.take(5)
        chain, decoy = names[:3], names[3:]
        statements = [[HASH, *value, chain[0], DOT], [HASH, *other, decoy[0], DOT]]
        statements += [[HASH, chain[i - 1], chain[i], DOT] for i in (1, 2)]
        statements += [[HASH, decoy[0], decoy[1], DOT]]
        question = [ASK, *value]
        # The chain's statements appear in chain order; the decoy's anywhere.
        hay, depths = _vt_haystack(rng, length - len(question), statements)
        return Sample(task, hay + question, chain + [DOT], depth=depths[0])
    raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")


def _vt_haystack(rng: random.Random, length: int,
                 statements: List[List[int]]) -> Tuple[List[int], List[float]]:
    # statements: chain0, decoy0, chain1, chain2, decoy1. Chain (0, 2, 3) and decoy (1, 4)
    # each keep their own order; the two interleave at random.
    chain, decoy = [0, 2, 3], [1, 4]
    slots = sorted(rng.sample(range(5), 2))
    order, ci, di = [], 0, 0
    for i in range(5):
        if i in slots:
            order.append(decoy[di])
            di += 1
        else:
            order.append(chain[ci])
            ci += 1
    hay, depths = _haystack(rng, length, [statements[i] for i in order], ordered=True)
    by_statement = [0.0] * 5
    for position, index in enumerate(order):
        by_statement[index] = depths[position]
    return hay, by_statement


def repeat_sequence(rng: random.Random, length: int) -> Tuple[List[int], List[int]]:
    """A warm-up sample: a random string of content symbols and filler, then the string
    again; the loss is on the second copy (what an induction head predicts)."""
    half = max(4, (length - 1) // 2)
    pool = CONTENT_IDS + FILLER_IDS
    first = [rng.choice(pool) for _ in range(half)]
    return [BOS, *first, *first], [0] * (1 + half) + [0] + [1] * (half - 1)


def training_sequence(rng: random.Random, length: int, task: Optional[str] = None,
                      repeat_share: float = 0.0) -> Tuple[List[int], List[int]]:
    """(tokens, loss mask) of one training sample: prompt, answer and follow-up turns; the
    mask is 1 on the tokens to predict (answers). ``repeat_share``: the chance of a
    warm-up sample (``repeat_sequence``) instead."""
    if repeat_share and rng.random() < repeat_share:
        return repeat_sequence(rng, length)
    task = task or rng.choice(TASKS)
    needles = rng.randint(2, max(2, min(6, (length - 8) // 12))) if task == "niah_multikey" else 4
    turns = rng.randint(1, min(needles, 4)) if task == "niah_multikey" else 1
    gap = rng.choice((0, 0, 8, 32)) if turns > 1 else 0
    sample = make_sample(task, rng, length, turns=turns, gap=gap, needles=needles)
    tokens = list(sample.prompt)
    mask = [0] * len(tokens)
    for question, answer in [([], sample.answer)] + sample.turns:
        tokens += question
        mask += [0] * len(question)
        tokens += answer
        mask += [1] * len(answer)
    return tokens, mask


def eval_set(seed: int, per_task: int, lengths: Sequence[int],
             tasks: Sequence[str] = TASKS) -> List[Sample]:
    """``per_task`` samples of each task, spread evenly over ``lengths``."""
    rng = random.Random(seed)
    out = []
    for task in tasks:
        for i in range(per_task):
            out.append(make_sample(task, rng, lengths[i % len(lengths)]))
    return out


def shift_set(seed: int, count: int, lengths: Sequence[int], gap: int) -> List[Sample]:
    """The relevance-shift task: a multi-key prompt asks about one key; after its answer
    (and ``gap`` filler tokens) the question changes to another key."""
    rng = random.Random(seed)
    return [make_sample("niah_multikey", rng, lengths[i % len(lengths)], turns=2, gap=gap)
            for i in range(count)]


def counts(samples: Sequence[Sample]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for s in samples:
        out[s.task] = out.get(s.task, 0) + 1
    return out


def evidence(sample: Sample) -> List[int]:
    """Prompt positions of the tokens the answer copies: the asked needles' values (vt: the
    chain's variable names). For the eviction diagnostics: what must survive."""
    p = sample.prompt
    if sample.task == "vt":
        value = p[-VALUE_LEN:]
        out, current = [], None
        for i in range(len(p) - VALUE_LEN - 1):
            if p[i] == HASH and p[i + 1:i + 1 + VALUE_LEN] == value:
                out.append(i + 1 + VALUE_LEN)
                current = p[i + 1 + VALUE_LEN]
        for _ in range(2):
            for i in range(len(p) - 3):
                if p[i] == HASH and p[i + 1] == current and p[i + 3] == DOT:
                    out.append(i + 2)
                    current = p[i + 2]
                    break
        return sorted(out)
    keys = p[-2:] if sample.task == "niah_multiquery" else p[-1:]
    out = []
    for i in range(len(p) - VALUE_LEN - 2):
        if p[i] == HASH and p[i + 1] in keys:
            out += range(i + 2, i + 2 + VALUE_LEN)
    return out
