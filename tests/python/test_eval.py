"""A short evaluation of the decoder trained here (eval/, weights committed) through
a real kvcached with host shared-memory KV pools and score regions: what must hold
whatever the model. The full table is a benchmark (eval/kvcache-eval), not this."""

import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from daemon import REPO_ROOT, Daemon, flag_missing_reason  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "eval"))

from kvcache_client import SCORING_PRESETS, KvCacheClient  # noqa: E402
from kvcache_client.torch import KvPoolMapping  # noqa: E402
from kvcache_eval import tasks  # noqa: E402
from kvcache_eval.daemon import pool_flags  # noqa: E402
from kvcache_eval.evaluate import DEFAULT_WEIGHTS  # noqa: E402
from kvcache_eval.model import load  # noqa: E402
from kvcache_eval.runner import RunConfig, Runner, prefill  # noqa: E402

PER_TASK, LENGTHS, SEED = 12, (256, 512), 20240


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
    daemon = Daemon(tmp_path_factory.mktemp("kvcached-eval"), "--allow_shm_scores",
                    *pool_flags(cfg.layers, cfg.kv_heads, cfg.head_dim)).start()
    client = KvCacheClient(daemon.address, timeout=60)
    mapping = KvPoolMapping.for_rank(client, 0)
    run = Runner(model, client, mapping, seed=SEED)
    yield run
    run.close()
    mapping.close()
    client.close()
    assert daemon.terminate() == 0, daemon.log()


@pytest.fixture(scope="module")
def short_eval(model, runner):
    """{configuration: [Outcome per sample]} of a short evaluation."""
    samples = tasks.eval_set(SEED, PER_TASK, LENGTHS)
    configs = [RunConfig("full", None)]
    configs += [RunConfig(f"{p}@0.5", p, 0.5) for p in SCORING_PRESETS]
    configs += [RunConfig(f"{p}@0.9", p, 0.9) for p in ("inertia", "random", "streaming_llm")]
    outcomes = {config.name: [] for config in configs}
    for index, sample in enumerate(samples):
        pre = prefill(model, sample)
        for config in configs:
            outcomes[config.name].append(runner.run(config, pre, index))
    return outcomes


def accuracy(outcomes):
    return sum(o.correct for o in outcomes) / len(outcomes)


def test_full_cache_solves_the_tasks_it_was_trained_for(short_eval):
    assert accuracy(short_eval["full"]) >= 0.8


@pytest.mark.xfail(strict=True, reason=(
    "measured, docs/EVALUATION.md: this decoder's step-1 attention is concentrated on the "
    "one token it copies next, so the step-1 eviction (L0 + 1 - B tokens at once, before "
    "any momentum) drops evidence it needs later even at rho 0.5; strict, so a model "
    "that keeps it turns this into a failure to update"))
def test_at_half_compression_every_scoring_preset_stays_near_full(short_eval):
    full = accuracy(short_eval["full"])
    gaps = {p: full - accuracy(short_eval[f"{p}@0.5"]) for p in SCORING_PRESETS}
    assert max(abs(g) for g in gaps.values()) <= 0.1, gaps


@pytest.mark.parametrize("preset", SCORING_PRESETS)
def test_what_survives_step_one_is_answered_as_with_the_full_cache(short_eval, preset):
    # The mechanism behind the gap above: evicting the rest (filler) does not hurt; losing
    # evidence at step 1 does.
    kept = [o.correct for o, f in zip(short_eval[f"{preset}@0.5"], short_eval["full"])
            if f.correct and o.evidence_kept == 1.0]
    assert len(kept) >= 5 and sum(kept) / len(kept) >= 0.9, kept


@pytest.mark.parametrize("baseline", ["random", "streaming_llm"])
def test_at_ninety_percent_unscored_eviction_falls_below_inertia(short_eval, baseline):
    assert accuracy(short_eval[f"{baseline}@0.9"]) < accuracy(short_eval["inertia@0.9"])


@pytest.mark.parametrize("policy", ["inertia", "inertia_lazy4", "tova"])
def test_dense_and_pooled_caches_generate_alike(model, runner, policy):
    # The same decisions must give the same generations: the daemon decides from the scores,
    # which come from the K/V either cache returns; both must hold the same bits.
    samples = tasks.eval_set(SEED + 1, 1, (384,))
    for index, sample in enumerate(samples):
        pre = prefill(model, sample)
        pooled, dense = (runner.run(RunConfig(f"{policy}-{kind}", policy, 0.9,
                                              pooled=kind == "pooled", track_sets=True),
                                    pre, index)
                         for kind in ("pooled", "dense"))
        assert pooled.sets == dense.sets, sample.task      # the same decisions, step by step
        assert pooled.generated == dense.generated, sample.task
