#!/usr/bin/env python3
"""The GPU check's Python stage: a torch worker against real kvcached daemons.

    worker_check.py [--device cuda|cpu] [--quick] [--kvcached PATH] [--out FILE]
                    [--log-dir DIR] [--no-pytest]

1. pytest of the torch-helper tests (tests/python/test_device_region.py,
   test_torch_cuda_pool.py where present, test_torch*.py) with $KVCM_KVCACHED the daemon
   under test; with ``--device cuda`` a skip that names CUDA or a GPU is a failure (their
   CUDA tests must run there).
2. The short evaluation: the decoder of eval/kvcache_eval (its committed weights) on the
   device, a few samples of eval/kvcache_eval/tasks.py decoded through two daemons, engine
   A then engine B (``--device cuda``: ``--backend=cuda --engine_backend=cuda`` and
   ``--backend=host --engine_backend=cpu``; ``--device cpu``: the emulated device engine
   and the CPU engine). The scores are computed by the same model on the same device from
   the same caches, so equal decisions give identical generations: every step's cached
   positions and every generated token must be equal.
3. Decode tokens/s end to end with each engine (the same decodes, timed; a warm-up
   sample first).
4. The first step at a long prompt (128k tokens, 32 layers folded into one row, written
   into a daemon-created score region: device memory with the CUDA engine), engine A,
   the median of a few sequences.

Writes the figures to ``--out`` (JSON; tests/gpu/run.sh puts it into gpu-check.json
under "worker") and exits 1 when a check failed. ``--device cpu --quick`` runs it all on
the CPU in seconds (CTest python_worker_check_cpu, without pytest: those tests run in
CTest already).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "eval"))

import torch  # noqa: E402

from kvcache_client import KvCacheClient  # noqa: E402
from kvcache_eval import tasks  # noqa: E402
from kvcache_eval.daemon import Kvcached  # noqa: E402
from kvcache_eval.model import load  # noqa: E402
from kvcache_eval.runner import RunConfig, Runner, prefill  # noqa: E402

#: The engines compared, by device: (A, B); A also takes the long-prompt first step.
ENGINES = {"cuda": ("cuda", "cpu"), "cpu": ("emulated", "cpu")}
#: Where each engine's daemon keeps its KV pools.
POOL_BACKEND = {"cuda": "cuda", "emulated": "host", "cpu": "host"}
#: Not a hand-off check: no UCX sidecar (its transport modules are not in the carry).
COMMON_FLAGS = ["--kv_transfer=grpc", "--stream_idle_timeout=0"]


def log(line: str) -> None:
    print(line, flush=True)


# -- 1. the torch-helper tests -------------------------------------------------------------

def torch_tests() -> List[Path]:
    here = REPO_ROOT / "tests" / "python"
    files = [here / "test_device_region.py", here / "test_torch_cuda_pool.py",
             *sorted(here.glob("test_torch*.py"))]
    seen: List[Path] = []
    for f in files:
        if f.exists() and f not in seen:
            seen.append(f)
    return seen


def run_pytest(device: str, kvcached: str, log_dir: Path, timeout: float) -> Dict[str, Any]:
    files = torch_tests()
    junit = log_dir / "worker-pytest.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
               f"--junitxml={junit}", *map(str, files)]
    env = dict(os.environ, KVCM_KVCACHED=kvcached)
    started = time.perf_counter()
    with open(log_dir / "worker-pytest.log", "wb") as out:
        try:
            rc = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result: Dict[str, Any] = {"files": [f.name for f in files], "exit": rc,
                              "seconds": round(time.perf_counter() - started, 1),
                              "passed": 0, "failed": 0, "skipped": 0, "skipped_cuda": []}
    if junit.exists():
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            name = f'{case.get("classname", "")}.{case.get("name", "")}'
            if case.find("failure") is not None or case.find("error") is not None:
                result["failed"] += 1
            elif case.find("skipped") is not None:
                result["skipped"] += 1
                reason = case.find("skipped").get("message", "")
                if any(word in reason.lower() for word in ("cuda", "gpu")):
                    result["skipped_cuda"].append(f"{name}: {reason}")
            else:
                result["passed"] += 1
    # With a GPU every test must run; without one the CUDA tests skip (and say so).
    result["ok"] = (rc == 0 and result["failed"] == 0 and result["passed"] > 0
                    and (device != "cuda" or not result["skipped_cuda"]))
    return result


# -- 2, 3. the evaluation through two daemons ---------------------------------------------

def daemon_flags(engine: str, cfg: Any) -> List[str]:
    """A daemon of ``engine`` holding KV pools shaped like the decoder's cache (float32)."""
    backend = POOL_BACKEND[engine]
    flags = [f"--backend={backend}", f"--engine_backend={engine}",
             f"--pool_memory_bytes={64 << 20}", f"--kv_layers={cfg.layers}",
             f"--kv_heads={cfg.kv_heads}", f"--kv_head_dim={cfg.head_dim}",
             "--kv_tokens_per_block=16", "--kv_dtype=float32", *COMMON_FLAGS]
    if backend == "host":
        flags.append("--kv_shared_memory=true")
    return flags


def pool_mapping(client: KvCacheClient, device: torch.device) -> Any:
    """The daemon's rank-0 KV pool mapped on ``device``, or None with why."""
    from kvcache_client.torch import KvPoolMapping
    try:
        mapping = KvPoolMapping.for_rank(client, 0)
    except Exception as error:  # no pool, or none this client maps (a reason, not a failure)
        return None, f"{type(error).__name__}: {error}"
    if mapping.blocks is None or mapping.blocks.device.type != device.type:
        where = None if mapping.blocks is None else mapping.blocks.device
        mapping.close()
        return None, f"the pool is mapped on {where}, the model runs on {device}"
    return mapping, ""


def decode_all(engine: str, model: Any, samples: List[tasks.Sample], kvcached: str,
               config_kw: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """Every sample through a fresh daemon of ``engine``; the first sample twice (the
    first run warms the device up and is not timed)."""
    cfg = model.cfg
    outcomes, mappings_why = [], ""
    with Kvcached(daemon_flags(engine, cfg), binary=kvcached) as daemon, \
            KvCacheClient(daemon.address, timeout=60) as client:
        mapping, mappings_why = pool_mapping(client, device)
        pooled = config_kw.pop("pooled") and mapping is not None
        config = RunConfig(f"check-{engine}", pooled=pooled, track_sets=True, **config_kw)
        runner = Runner(model, client, mapping, daemon_score_region=True)
        try:
            for index, sample in enumerate([samples[0], *samples]):
                outcome = runner.run(config, prefill(model, sample), index)
                if index:
                    outcomes.append(outcome)
        finally:
            runner.close()
            if mapping is not None:
                mapping.close()
    steps = sum(o.steps for o in outcomes)
    decode_s = sum(o.decode_s for o in outcomes)
    return {"outcomes": outcomes, "pooled": pooled, "pool_note": mappings_why,
            "timing": {"steps": steps, "decode_s": round(decode_s, 4),
                       "tokens_per_s": round(steps / decode_s, 1) if decode_s else None,
                       "step_ms_per_token": round(1000 * sum(o.step_s for o in outcomes)
                                                  / max(steps, 1), 3),
                       "capture_ms_per_token": round(1000 * sum(o.capture_s for o in outcomes)
                                                     / max(steps, 1), 3)}}


def compare(a: List[Any], b: List[Any], samples: List[tasks.Sample]) -> List[str]:
    """Where run B's decisions or generations differ from run A's."""
    out = []
    for i, (x, y, sample) in enumerate(zip(a, b, samples)):
        where = f"sample {i} ({sample.task}, {sample.length} tokens)"
        if x.steps != y.steps:
            out.append(f"{where}: {x.steps} steps vs {y.steps}")
        step = next((s for s, (p, q) in enumerate(zip(x.sets, y.sets)) if p != q), None)
        if step is not None:
            out.append(f"{where}: step {step + 1} keeps different positions "
                       f"({sorted(x.sets[step] ^ y.sets[step])[:8]} in one only)")
        if x.generated != y.generated:
            out.append(f"{where}: generations differ ({tasks.decode(x.generated)!r} vs "
                       f"{tasks.decode(y.generated)!r})")
    return out


def evaluation(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    model, _ = load(str(REPO_ROOT / "eval" / "weights" / "decoder.pt"))
    model = model.to(device)
    per_task, lengths = (1, [256]) if args.quick else (2, [256, 512])
    samples = tasks.eval_set(args.seed, per_task, lengths)
    engines = ENGINES[args.device]
    # Compared pooled only where both daemons' pools map on the model's device (host pools
    # on the CPU); else both runs keep K/V in the worker's own tensors on the device, and a
    # run through a pool on the GPU (the CUDA engine's) is kept as a figure of its own: its
    # gathers need not round like the dense cache's, so its generations are not compared.
    runs: Dict[str, Dict[str, Any]] = {}
    for engine in engines:
        kw = dict(policy="inertia", compression=0.5, pooled=True)
        runs[engine] = decode_all(engine, model, samples, args.kvcached, kw, device)
        log(f"decode: {engine} engine: {runs[engine]['timing']['tokens_per_s']} tokens/s "
            f"({runs[engine]['timing']['steps']} steps; "
            f"{'pooled' if runs[engine]['pooled'] else 'dense'} KV)")
    a, b = (runs[e] for e in engines)
    pooled_runs: Dict[str, Any] = {}
    if a["pooled"] != b["pooled"]:  # compare like with like: both dense
        for engine in engines:
            if runs[engine]["pooled"]:
                pooled = runs[engine]
                kw = dict(policy="inertia", compression=0.5, pooled=False)
                runs[engine] = decode_all(engine, model, samples, args.kvcached, kw, device)
                runs[engine]["pool_note"] = "dense, like the other engine's run"
                pooled_runs[engine] = {
                    "decode": pooled["timing"],
                    "same_generations_as_dense": [o.generated for o in pooled["outcomes"]]
                    == [o.generated for o in runs[engine]["outcomes"]]}
                log(f"decode: {engine} engine, KV in its pool on the device: "
                    f"{pooled['timing']['tokens_per_s']} tokens/s")
        a, b = (runs[e] for e in engines)
    mismatches = compare(a["outcomes"], b["outcomes"], samples)
    identical = not mismatches
    log(f"eval: {len(samples)} samples, {a['timing']['steps']} steps per engine: "
        f"{'identical' if identical else 'DIFFERENT'} generations and decisions "
        f"({engines[0]} vs {engines[1]} engine)")
    for line in mismatches[:10]:
        log(f"FAIL: {line}")
    return {
        "engines": list(engines),
        "daemons": {e: " ".join(daemon_flags(e, model.cfg)) for e in engines},
        "model_device": str(device), "samples": len(samples), "lengths": lengths,
        "policy": "inertia@0.5", "score_region": "daemon-created",
        "kv": {e: ("pooled" if runs[e]["pooled"] else "dense") for e in engines},
        "kv_notes": {e: runs[e]["pool_note"] for e in engines if runs[e]["pool_note"]},
        "correct": {e: sum(o.correct for o in runs[e]["outcomes"]) for e in engines},
        "identical": identical, "mismatches": mismatches,
        "decode": {e: runs[e]["timing"] for e in engines},
        "pooled_on_device": pooled_runs,
    }


# -- 4. the first step at a long prompt ---------------------------------------------------

def first_step(args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    engine = ENGINES[args.device][0]
    prompt, layers = (4096, 4) if args.quick else (131072, 32)
    repeats = 3 if args.quick else 5
    tokens = prompt + 1
    flags = [f"--engine_backend={engine}", *COMMON_FLAGS]
    generator = torch.Generator(device=device.type).manual_seed(args.seed)
    times = []
    with Kvcached(flags, binary=args.kvcached) as daemon, \
            KvCacheClient(daemon.address, timeout=120) as client, \
            client.batch(score_region_bytes=4 * tokens + (1 << 16),
                         daemon_score_region=True) as batch:
        region = batch.score_region
        on_device = bool(region.on_device)
        for i in range(repeats + 1):  # the first one warms the engine up
            sid = f"first-step-{i}"
            batch.open(sid, prompt, compression_ratio=0.5, policy="inertia",
                       score_layout="folded", layers=layers)
            # The worker's folded row of this step (layers summed), on its device.
            row = torch.rand(1, tokens, device=device, generator=generator)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            decision = batch.step({sid: row})[sid].raise_for_status()
            elapsed = time.perf_counter() - start
            if decision.cache_size != prompt // 2:
                raise RuntimeError(f"the first step kept {decision.cache_size} tokens, "
                                   f"want {prompt // 2}")
            batch.close_sequence(sid)
            if i:
                times.append(elapsed * 1000)
    median = statistics.median(times)
    log(f"first step: {prompt}-token prompt x {layers} layers folded, {engine} engine: "
        f"median {median:.3f} ms of {repeats} (score region on "
        f"{'the device' if on_device else 'the host'})")
    return {"prompt": prompt, "layers": layers, "engine": engine, "repeats": repeats,
            "ms": [round(t, 4) for t in times], "median_ms": round(median, 4),
            "score_region_on_device": on_device, "what": "batch.step() of the folded row, "
            "to the decision (gRPC round trip included)"}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(ENGINES), default="cuda")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI, the CPU)")
    parser.add_argument("--kvcached", default=os.environ.get("KVCM_KVCACHED")
                        or str(REPO_ROOT / "build" / "bin" / "kvcached"))
    parser.add_argument("--out", default="", help="the JSON of the figures")
    parser.add_argument("--log-dir", default="", help="pytest's log and XML (default: "
                        "the folder of --out, else the current one)")
    parser.add_argument("--no-pytest", action="store_true")
    parser.add_argument("--pytest-timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    args.kvcached = str(Path(args.kvcached).resolve())
    log_dir = Path(args.log_dir or (Path(args.out).parent if args.out else "."))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("worker: no GPU (torch sees no CUDA device): nothing ran")
        return 77
    device = torch.device(args.device)
    result: Dict[str, Any] = {
        "device": args.device, "quick": args.quick, "kvcached": args.kvcached,
        "python": platform.python_version(), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "failures": []}
    log(f"worker: torch {torch.__version__} on {result['gpu'] or 'the CPU'}, "
        f"kvcached {args.kvcached}")
    if not args.no_pytest:
        result["pytest"] = p = run_pytest(args.device, args.kvcached, log_dir,
                                          args.pytest_timeout)
        log(f"pytest: {p['passed']} passed, {p['failed']} failed, {p['skipped']} skipped "
            f"({len(p['skipped_cuda'])} CUDA skips) in {p['seconds']} s, exit {p['exit']}")
        if not p["ok"]:
            result["failures"].append("torch-helper tests (log: worker-pytest.log)")
    for name, stage in (("eval", evaluation), ("first_step", first_step)):
        try:
            result[name] = stage(args, device)
        except Exception as error:  # recorded, and the other stages still run
            result[name] = {"error": f"{type(error).__name__}: {error}"}
            result["failures"].append(f"{name}: {type(error).__name__}: {error}")
            log(f"FAIL: {name}: {type(error).__name__}: {error}")
    if "eval" in result and result["eval"].get("identical") is False:
        result["failures"].append("eval: the engines' decisions differ")
    result["verdict"] = "fail" if result["failures"] else "pass"
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    log(f"worker: {result['verdict'].upper()}"
        + "".join(f"\nFAIL: {f}" for f in result["failures"]))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
