"""Folded reports against a real kvcached: every golden trace whose policy uses scores,
its K layer rows folded here (fold_scores, float64) with the weights the daemon gives, one
row per step, inline and through a score region, from one rank and from two.

What is checked (the folded rule is the per-layer one with other float32 rounding, so not
bit for bit): the daemon's fold weights are SPEC.md's; every step's cache size and score
need are the golden's; and the float64 property: at every step each evicted token's
momentum under the per-layer rule, computed here in float64 on the daemon's cache, is not
above any kept unprotected token's, within a relative 2e-4. Where every step so far had a
wide margin (1e-3), the evictions must also be the golden's."""

import threading
from typing import Any, Dict, List

import pytest

from golden import NAMES, load, scale
from kvcache_client import FoldWeights, Policy, Report, fold_scores
from momentum64 import SCORING, PerLayerMomentum

FOLDED = [n for n in NAMES if Policy.from_dict(load(n).header["policy"]).aggregation in SCORING]
REGION_BYTES = 1 << 16
WIDE = 1e-3


@pytest.fixture(params=["inline", "shm"])
def transport(request):
    if request.param == "inline":
        return request.getfixturevalue("shm_client"), {}
    return request.getfixturevalue("shm_client"), {"score_region_bytes": REGION_BYTES}


def expected_weights(policy: Dict[str, Any], k: int) -> FoldWeights:
    aggregation = policy.get("aggregation", "ema")
    if aggregation == "ema":
        a = policy.get("alpha", 0.8)
        return FoldWeights(tuple((1 - a) * a ** (k - 1 - l) for l in range(k)), a ** k)
    if aggregation == "cumulative":
        return FoldWeights((1.0,) * k, 1.0)
    return FoldWeights((1.0 / k,) * k, 0.0)


def assert_close_weights(got: FoldWeights, want: FoldWeights) -> None:
    assert got.layers == want.layers
    for g, w in zip(got.layer_weights + (got.decay,), want.layer_weights + (want.decay,)):
        assert abs(g - w) <= 1e-12 * max(1.0, abs(w)), (got, want)


def replay_folded(batch, sid: str, trace, weights: FoldWeights, heads: int) -> List[Any]:
    decisions = []
    for step in trace.steps:
        layers = step.get("layers")
        row = None
        if layers is not None:
            row = fold_scores(scale(layers, heads) if heads > 1 else layers, weights)
        decisions.append(batch.step({sid: row})[sid].raise_for_status())
    return decisions


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("name", FOLDED)
def test_folded_goldens_keep_the_float64_order(transport, seq_id, name, ranks):
    client, options = transport
    trace = load(name)
    k = len(next(s["layers"] for s in trace.steps if "layers" in s))
    sid = seq_id(name)
    state = client.open_sequence(sid, **trace.open_options(), score_layout="folded", layers=k,
                                 tp_world_size=ranks)
    assert (state.score_layout, state.layers) == ("folded", k)
    assert_close_weights(state.fold_weights, expected_weights(trace.header["policy"], k))

    results: Dict[int, List[Any]] = {}
    errors: List[BaseException] = []

    def run_rank(rank: int) -> None:
        heads = 1 + rank % 2 if ranks > 1 else 0  # rank p sums h_p heads (tensor parallel)
        try:
            with client.batch(rank=rank, head_count=heads or None, timeout=60,
                              **options) as batch:
                tracked = batch.add(sid)
                assert tracked.folded and tracked.fold_weights == state.fold_weights
                results[rank] = replay_folded(batch, sid, trace, tracked.fold_weights,
                                              max(heads, 1))
                if options:
                    region = batch.score_region
                    assert region.inline_reports == 0 and region.region_reports > 0
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run_rank, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    decisions = results[0]
    for rank in range(1, ranks):
        assert [vars(d) for d in results[rank]] == [vars(d) for d in decisions]

    reference = PerLayerMomentum(trace)
    same_as_golden = True
    for step, decision, want in zip(trace.steps, decisions, trace.expected):
        assert (decision.step, decision.cache_size, decision.next_needs_scores) == (
            want["step"], want["cache_size"], want["next_needs_scores"])
        margin = reference.step(decision.step, step.get("layers"),
                                {"evicted": decision.evicted,
                                 "cache_size": decision.cache_size})
        if same_as_golden and margin > WIDE:
            assert decision.evicted == want["evicted"], f"{name} step {decision.step}"
        same_as_golden = same_as_golden and decision.evicted == want["evicted"]
    assert len(decisions) == len(trace.expected)
    stats = client.close_sequence(sid)
    assert stats.steps == len(trace.steps)


def test_a_folded_sequence_refuses_layer_rows(shm_client, seq_id):
    trace = load("ema_every_step")
    layers = trace.steps[0]["layers"]
    sid = seq_id()
    with shm_client.batch() as batch:
        batch.open(sid, **trace.open_options(), score_layout="folded", layers=len(layers))
        refused = batch.step({sid: layers})[sid]
        assert not refused.ok and "fold_scores" in refused.message
        with shm_client.stream() as stream:  # the daemon judges what the batch refuses
            rejected = stream.send([Report(sid, 1, layers)])[0]
        assert not rejected.ok and f"sequence '{sid}' step 1" in rejected.message
        assert batch.step({sid: fold_scores(layers, batch.sequences[sid].fold_weights)})[
            sid].ok
