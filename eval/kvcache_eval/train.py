"""Trains the evaluation decoder on the synthetic tasks and writes its weights.

    PYTHONPATH=eval python3 -m kvcache_eval.train \
        --out eval/weights/decoder.pt

A curriculum of context lengths (short first: the tasks are learned there, then carried to
1,024 tokens), AdamW with warm-up and cosine decay, loss on the answer tokens only. Every
``--log_every`` steps it prints the loss and the exact-match rate per task on a held-out
set (greedy decoding is exact exactly when every answer token is the argmax given the
correct prefix, so this is one forward pass). CPU; ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import tasks
from .model import Config, Decoder, save

#: (share of the steps, context lengths drawn from, batch size, share of warm-up samples).
#: Induction (copying what followed an earlier occurrence) forms fast only on short
#: sequences: the warm-up is short repeats, then the tasks at growing lengths.
CURRICULUM = ((0.12, (16, 48), 64, 1.0), (0.38, (48, 128), 32, 0.2),
              (0.30, (128, 384), 16, 0.05), (0.20, (384, 1024), 8, 0.0))
#: --stage long: from --init weights that learned the tasks on short contexts, on to 1,024
#: tokens (the harder multi-value and multi-query tasks drawn twice as often).
LONG_CURRICULUM = ((0.30, (48, 128), 32, 0.1), (0.40, (128, 384), 16, 0.05),
                   (0.30, (384, 1024), 8, 0.0))
#: --stage extend: again from short to long contexts (after a change of the task data),
#: multi-query drawn three times as often.
EXTEND_CURRICULUM = ((0.35, (48, 128), 32, 0.0), (0.35, (128, 384), 16, 0.0),
                     (0.30, (384, 1024), 8, 0.0))
EXTEND_TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 1.5, "niah_multivalue": 1.5,
                       "niah_multiquery": 3.0, "vt": 1.0}
#: --stage polish: the middle and long contexts again, the multi-key tasks more often.
POLISH_CURRICULUM = ((0.4, (128, 384), 16, 0.0), (0.6, (384, 1024), 8, 0.0))
POLISH_TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 2.0, "niah_multivalue": 2.0,
                       "niah_multiquery": 3.0, "vt": 1.0}
#: --stage focus: middle contexts, multi-query (the task it is worst at) half the samples.
FOCUS_CURRICULUM = ((0.7, (128, 512), 16, 0.0), (0.3, (512, 1024), 8, 0.0))
FOCUS_TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 1.0, "niah_multivalue": 1.0,
                      "niah_multiquery": 4.0, "vt": 1.0}
LONG_TASK_WEIGHTS = {"niah_single": 1.0, "niah_multikey": 1.0, "niah_multivalue": 2.0,
                     "niah_multiquery": 2.0, "vt": 1.0}


def batch_tensors(seqs: Sequence[Tuple[List[int], List[int]]]
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(t) for t, _ in seqs)
    tokens = torch.full((len(seqs), width), tasks.PAD, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (t, m) in enumerate(seqs):
        tokens[i, :len(t)] = torch.tensor(t)
        mask[i, :len(m)] = torch.tensor(m, dtype=torch.bool)
    return tokens[:, :-1], tokens[:, 1:], mask[:, 1:]


def exact_match(model: Decoder, seqs: Sequence[Tuple[List[int], List[int]]]) -> float:
    with torch.no_grad():
        inputs, targets, mask = batch_tensors(seqs)
        pred = model(inputs).argmax(-1)
        right = (pred == targets) | ~mask
        return right.all(-1).float().mean().item()


def held_out(seed: int, per_task: int, lengths: Sequence[int]
             ) -> Dict[str, List[Tuple[List[int], List[int]]]]:
    rng = random.Random(seed)
    return {task: [tasks.training_sequence(rng, lengths[i % len(lengths)], task)
                   for i in range(per_task)] for task in tasks.TASKS}


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where to write the weights (.pt)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=384)
    parser.add_argument("--rope_base", type=float, default=10000.0)
    parser.add_argument("--min_length", type=int, default=0,
                        help="raise the curriculum's shortest context lengths to this")
    parser.add_argument("--scale_batch", type=float, default=1.0,
                        help="multiply the curriculum's batch sizes")
    parser.add_argument("--check_per_task", type=int, default=12,
                        help="held-out samples per task for the exact-match log")
    parser.add_argument("--stage", choices=("full", "long", "extend", "polish", "focus"), default="full",
                        help="full: the whole curriculum from scratch; long: from --init on "
                        "to long contexts; extend: short to long again; polish: middle and long; focus: "
                        "multi-query")
    parser.add_argument("--init", default=None, help="weights to start from (.pt)")
    parser.add_argument("--values", choices=("digits", "distinct"), default="digits",
                        help="how the tasks draw values (tasks.VALUES)")
    parser.add_argument("--max_length", type=int, default=1024,
                        help="cap the curriculum's context lengths (quick checks)")
    args = parser.parse_args(list(argv) or None)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tasks.VALUES = args.values
    rng = random.Random(args.seed)
    cfg = Config(d_model=args.d_model, layers=args.layers, ffn=args.ffn,
                 head_dim=args.d_model // 4, rope_base=args.rope_base)
    model = Decoder(cfg)
    init_meta = None
    if args.init:
        from .model import load
        model, init_meta = load(args.init)
        model.train()
        cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())
    print(f"decoder: {params} parameters, {cfg}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 30)
    checks: Dict[int, Dict[str, List[Tuple[List[int], List[int]]]]] = {}

    def check_at(length: int) -> Dict[str, float]:
        if length not in checks:
            checks[length] = held_out(args.seed + 1000 + length, args.check_per_task,
                                      (length,))
        return {t: exact_match(model, s) for t, s in checks[length].items()}

    phases, start_step = [], 0
    curriculum = {"full": CURRICULUM, "long": LONG_CURRICULUM,
                  "extend": EXTEND_CURRICULUM, "polish": POLISH_CURRICULUM,
                  "focus": FOCUS_CURRICULUM}[args.stage]
    task_weights = {"long": LONG_TASK_WEIGHTS, "extend": EXTEND_TASK_WEIGHTS,
                    "polish": POLISH_TASK_WEIGHTS, "focus": FOCUS_TASK_WEIGHTS}.get(args.stage)
    weights = None if task_weights is None else [task_weights[t] for t in tasks.TASKS]
    for share, (lo, hi), size, warm in curriculum:
        steps = round(share * args.steps)
        phases.append((start_step, start_step + steps, (min(lo, args.max_length),
                                                        min(hi, args.max_length)),
                       max(1, round(size * args.scale_batch)), warm))
        start_step += steps

    started = time.perf_counter()
    smooth = None
    for step in range(args.steps):
        phase = next((p for p in phases if p[0] <= step < p[1]), phases[-1])
        (lo, hi), size, warm = phase[2], phase[3], phase[4]
        length = rng.randint(lo, hi)
        seqs = [tasks.training_sequence(
            rng, length, None if weights is None else rng.choices(tasks.TASKS, weights)[0],
            repeat_share=warm) for _ in range(size)]
        inputs, targets, mask = batch_tensors(seqs)
        lr = args.lr * min(1.0, (step + 1) / warmup) * \
            (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(inputs)
        loss = F.cross_entropy(logits[mask], targets[mask])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            model.eval()
            at = max(hi, 64)
            scores = check_at(at)
            model.train()
            elapsed = time.perf_counter() - started
            print(f"step {step + 1:5d}  len {lo}-{hi} x{size}  loss {smooth:.3f}  @{at}: "
                  + "  ".join(f"{t} {v:.2f}" for t, v in scores.items())
                  + f"  mean {sum(scores.values()) / len(scores):.2f}  {elapsed:.0f} s",
                  flush=True)
    wall = time.perf_counter() - started
    model.eval()
    scores = {f"{t}@{n}": v for n in sorted({256, 512, args.max_length})
              for t, v in check_at(n).items()}
    meta = {"command": "python3 -m kvcache_eval.train " + " ".join(sys.argv[1:] or argv),
            "steps": args.steps, "seed": args.seed, "wall_seconds": round(wall, 1),
            "threads": args.threads, "held_out_exact_match": scores, "parameters": params,
            "init": None if init_meta is None else {"path": args.init, **init_meta}}
    save(model, args.out, meta)
    print(f"wrote {args.out} after {wall:.0f} s: {scores}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
