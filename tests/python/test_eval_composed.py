"""The first step composed with prefill-time selection (docs/EVALUATION.md), short: on a
fixed seed, the observation window with span pooling keeps more of the answer's evidence
through step 1 at rho 0.9 than plain inertia; with the window off, nothing changes."""

import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from daemon import REPO_ROOT, Daemon, flag_missing_reason  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "eval"))

from kvcache_client import KvCacheClient  # noqa: E402
from kvcache_client.torch import DenseKvCache, ObservationWindow, StepScores  # noqa: E402
from kvcache_eval import tasks  # noqa: E402
from kvcache_eval.daemon import pool_flags  # noqa: E402
from kvcache_eval.evaluate import (DEFAULT_WEIGHTS, SPAN_POOL, WINDOW,  # noqa: E402
                                   span_pool_supported)
from kvcache_eval.first_step import first_step_gain  # noqa: E402
from kvcache_eval.model import load  # noqa: E402
from kvcache_eval.runner import RunConfig, Runner, prefill  # noqa: E402

PER_TASK, LENGTHS, SEED = 4, (256, 512), 20241


@pytest.fixture(scope="module")
def model():
    if not DEFAULT_WEIGHTS.exists():
        pytest.skip(f"no trained weights at {DEFAULT_WEIGHTS}")
    torch.set_num_threads(2)
    decoder, _ = load(str(DEFAULT_WEIGHTS))
    return decoder


@pytest.fixture(scope="module")
def runner(model, tmp_path_factory):
    reason = flag_missing_reason("pool_memory_bytes") or flag_missing_reason("allow_shm_scores")
    if reason:
        pytest.skip(reason)
    cfg = model.cfg
    daemon = Daemon(tmp_path_factory.mktemp("kvcached-composed"), "--allow_shm_scores",
                    *pool_flags(cfg.layers, cfg.kv_heads, cfg.head_dim)).start()
    client = KvCacheClient(daemon.address, timeout=60)
    run = Runner(model, client, None, seed=SEED)
    yield run
    run.close()
    client.close()
    assert daemon.terminate() == 0, daemon.log()


def test_the_composed_first_step_keeps_more_evidence_at_ninety_percent(model, runner):
    # Span pooling where the daemon does it (else the window alone, which must still win).
    span = SPAN_POOL if span_pool_supported(runner.client) else 0
    result = first_step_gain(runner, model, SEED, PER_TASK, LENGTHS, 0.9, WINDOW, span)
    assert len(result.plain) == len(result.composed) == PER_TASK * len(tasks.TASKS)
    assert result.gain.low > 0, (span, result.gain, result.plain, result.composed)
    assert "evidence kept after step 1 at rho = 0.9" in result.describe()


def test_with_the_window_off_nothing_changes(model, runner):
    # Filling windows during the prefill leaves the prefill as it was; runs without a
    # window decide and generate as before; and a window of size 0 is the plain row.
    sample = tasks.eval_set(SEED + 1, 1, (384,))[1]
    before, with_windows = prefill(model, sample), prefill(model, sample, [0, WINDOW])
    assert before.first_token == with_windows.first_token
    for a, b in zip(before.keys + before.values, with_windows.keys + with_windows.values):
        assert torch.equal(a, b)
    config = RunConfig("inertia-off@0.9", "inertia", 0.9, pooled=False, track_sets=True)
    old, new = runner.run(config, before, 0), runner.run(config, with_windows, 0)
    assert (old.sets, old.generated) == (new.sets, new.generated)
    empty = ObservationWindow(0)
    prefill_with(model, sample, empty)
    rows = []
    for window in (None, empty):
        scores = StepScores(window=window)
        model.decode(before.first_token, sample.length,
                     DenseKvCache(before.keys, before.values), scores)
        rows.append(scores.rows())
    assert torch.equal(rows[0], rows[1])


def prefill_with(model, sample, window):
    with torch.no_grad():
        model.prefill(torch.tensor([sample.prompt]), [window])
