"""The daemon's live eviction-quality diagnostics (/metrics, --diagnostics_every 1 and
--diagnostics_sample 1) against the same figures computed offline from the evaluation
harness's step traces (eval/kvcache_eval/diagnostics.py): the decoder trained
here, driven through a real kvcached."""

import sys
import urllib.request

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from daemon import REPO_ROOT, Daemon, flag_missing_reason  # noqa: E402

sys.path.insert(0, str(REPO_ROOT / "eval"))

from kvcache_client import KvCacheClient  # noqa: E402
from kvcache_client.torch import KvPoolMapping  # noqa: E402
from kvcache_eval import diagnostics, tasks  # noqa: E402
from kvcache_eval.daemon import pool_flags  # noqa: E402
from kvcache_eval.evaluate import DEFAULT_WEIGHTS  # noqa: E402
from kvcache_eval.model import load  # noqa: E402
from kvcache_eval.runner import RunConfig, Runner, prefill  # noqa: E402

POLICIES = ("inertia", "inertia_lazy4", "h2o", "tova")
SEED = 777


@pytest.fixture(scope="module")
def live_and_offline(tmp_path_factory):
    if not DEFAULT_WEIGHTS.exists():
        pytest.skip(f"no trained weights at {DEFAULT_WEIGHTS}")
    reason = (flag_missing_reason("diagnostics_every") or flag_missing_reason("allow_shm_scores")
              or flag_missing_reason("pool_memory_bytes"))
    if reason:
        pytest.skip(reason)
    torch.set_num_threads(2)
    model, _ = load(str(DEFAULT_WEIGHTS))
    cfg = model.cfg
    daemon = Daemon(tmp_path_factory.mktemp("kvcached-diag"), "--allow_shm_scores",
                    "--diagnostics_every=1", "--diagnostics_sample=1",
                    *pool_flags(cfg.layers, cfg.kv_heads, cfg.head_dim)).start()
    client = KvCacheClient(daemon.address, timeout=60)
    mapping = KvPoolMapping.for_rank(client, 0)
    runner = Runner(model, client, mapping, seed=SEED)
    traces = []
    # A second question after the first answer makes the generations long enough for the
    # lazy policy's scoring steps to pair up.
    samples = tasks.shift_set(SEED, 6, (256, 384), gap=16)
    for index, sample in enumerate(samples):
        pre = prefill(model, sample)
        for policy in POLICIES:
            outcome = runner.run(RunConfig(f"{policy}-diag", policy, 0.8, trace=True),
                                 pre, index)
            traces.append(outcome.trace)
    with urllib.request.urlopen(f"http://{daemon.metrics_address}/metrics", timeout=10) as r:
        live = diagnostics.live_figures(r.read().decode())
    runner.close()
    mapping.close()
    client.close()
    assert daemon.terminate() == 0, daemon.log()
    return live, diagnostics.offline_figures(traces)


@pytest.mark.parametrize("policy", POLICIES)
def test_live_diagnostics_match_the_offline_figures(live_and_offline, policy):
    live, offline = live_and_offline
    assert offline[policy]["steps"] >= 10, offline[policy]  # not vacuous
    for name in ("steps", "small_change", "evicted", "evicted_relevant"):
        assert live[policy][name] == offline[policy][name], (name, live[policy], offline[policy])
    for name in ("raw_churn_sum", "momentum_churn_sum", "jaccard_sum"):
        assert live[policy][name] == pytest.approx(offline[policy][name], rel=1e-9, abs=1e-9), \
            (name, live[policy], offline[policy])


def test_the_figures_are_not_degenerate(live_and_offline):
    # Something to compare: churn and evictions happen on this model at 0.8.
    _, offline = live_and_offline
    assert sum(f["raw_churn_sum"] for f in offline.values()) > 0
    assert sum(f["evicted"] for f in offline.values()) > 0
