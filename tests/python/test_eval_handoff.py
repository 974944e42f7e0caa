"""The evaluation's hand-off mode (eval/kvcache-eval --handoff) on the decoder trained here:
step 1 on one kvcached, ImportSequence into a second, the rest there. Every generation is
the one a single daemon produces, and the import moves the blocks of the B tokens step 1
kept, not the prefill's L0."""

import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from daemon import REPO_ROOT, Daemon  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "eval"))

from kvcache_client import KvCacheClient  # noqa: E402
from kvcache_client.torch import KvPoolMapping  # noqa: E402
from kvcache_eval import tasks  # noqa: E402
from kvcache_eval.daemon import pool_flags  # noqa: E402
from kvcache_eval.evaluate import DEFAULT_WEIGHTS, handoff_configs, main  # noqa: E402
from kvcache_eval.model import load  # noqa: E402
from kvcache_eval.runner import Runner, prefill  # noqa: E402

SEED, RATIO = 20240, 0.9


@pytest.fixture(scope="module")
def model():
    if not DEFAULT_WEIGHTS.exists():
        pytest.skip(f"no trained weights at {DEFAULT_WEIGHTS}")
    torch.set_num_threads(2)
    decoder, _ = load(str(DEFAULT_WEIGHTS))
    return decoder


def test_handed_off_generations_are_those_of_one_daemon(model, tmp_path):
    cfg = model.cfg
    flags = ["--allow_shm_scores", *pool_flags(cfg.layers, cfg.kv_heads, cfg.head_dim)]
    a = Daemon(tmp_path / "a", *flags)
    b = Daemon(tmp_path / "b", *flags)
    for daemon in (a, b):
        daemon.workdir.mkdir()
        daemon.start()
    try:
        with KvCacheClient(a.address, timeout=60) as ca, \
                KvCacheClient(b.address, timeout=60) as cb, \
                KvPoolMapping.for_rank(ca, 0) as map_a, KvPoolMapping.for_rank(cb, 0) as map_b:
            runner = Runner(model, ca, map_a, seed=SEED, peer=(cb, map_b))
            pairs = [p for p in handoff_configs(RATIO)
                     if p[0].policy in ("inertia", "score_free") or not p[0].pooled]
            samples = tasks.eval_set(SEED, 1, (256,), tasks=("niah_multikey", "vt"))
            try:
                for index, sample in enumerate(samples):
                    pre = prefill(model, sample)
                    for single, moved in pairs:
                        one = runner.run(single, pre, index)
                        two = runner.run(moved, pre, index)
                        assert two.generated == one.generated, (single.name, index)
                        assert two.sets == one.sets and len(one.sets) == one.steps
                        assert (two.steps, two.retained) == (one.steps, one.retained)
                        assert one.handoff is None and two.handoff is not None
                        kept_blocks = -(-two.retained // map_a.pool.tokens_per_block)
                        if moved.pooled:
                            assert two.handoff.kv_bytes >= kept_blocks * map_a.pool.block_bytes
                            assert two.handoff.kv_bytes < (sample.length // 2
                                                           * map_a.pool.block_bytes
                                                           // map_a.pool.tokens_per_block)
                        assert two.handoff.record_bytes > 0
                        assert two.handoff.state.last_step == 1
                # Nothing left behind on either daemon.
                assert ca.list_sequences() == [] and cb.list_sequences() == []
            finally:
                runner.close()
    finally:
        for daemon in (a, b):
            daemon.kill()


def test_the_handoff_flag_adds_its_part_and_nothing_else_by_default(model, tmp_path):
    """eval/kvcache-eval --handoff with every other part skipped: a page with the hand-off
    table, exit 0 (every generation identical)."""
    out = tmp_path / "EVALUATION.md"
    code = main(["--per_task=1", "--lengths=256", "--handoff", "--handoff_per_task=1",
                 "--skip=main,ablations,shift,diagnostics,throughput",
                 f"--out={out}", f"--img={tmp_path}", f"--json={tmp_path / 'r.json'}"])
    assert code == 0
    page = out.read_text()
    assert "## Disaggregated hand-off" in page
    assert "inertia@0.9-dense" in page and "score_free@0.9" in page
