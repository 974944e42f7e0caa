"""kvcache_client.torch score capture against a plain reference on random tensors: GQA
pooling (every query head once), tensor-parallel head sums that join to the pooled row,
batches of different lengths, the VNorm and entropy scorers, and folded rows."""

import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from kvcache_client import FoldWeights, fold_scores  # noqa: E402
from kvcache_client.torch import (SCORERS, StepScores, attention_row,  # noqa: E402
                                  attention_weights, pool_weights)

from daemon import REPO_ROOT  # noqa: E402


def reference_row(q, keys, values=None, scorer="attention"):
    """[n] float64: plain loops over query heads, head h reading KV head h // group."""
    heads, d = q.shape
    kv_heads, n, _ = keys.shape
    group = heads // kv_heads
    q, keys = q.double(), keys.double()
    total = [0.0] * n
    for h in range(heads):
        kv = h // group
        logits = [sum(q[h, e].item() * keys[kv, j, e].item() for e in range(d)) / math.sqrt(d)
                  for j in range(n)]
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        z = sum(exps)
        weights = [x / z for x in exps]
        if scorer == "vnorm":
            norms = [math.sqrt(sum(values[kv, j, e].item() ** 2 for e in range(d)))
                     for j in range(n)]
            mean = sum(norms) / n
            weights = [w * nj / mean for w, nj in zip(weights, norms)]
        for j in range(n):
            total[j] += weights[j]
    row = [x / heads for x in total]
    if scorer == "entropy":
        s = sum(row)
        entropy = -sum((x / s) * math.log(x / s) for x in row if x > 0)
        row = [x * entropy / math.log(n) for x in row] if n > 1 else row
    return torch.tensor(row, dtype=torch.float64)


def random_layer(generator, heads=4, kv_heads=2, n=9, d=8):
    q = torch.randn(heads, d, generator=generator)
    keys = torch.randn(kv_heads, n, d, generator=generator)
    values = torch.randn(kv_heads, n, d, generator=generator)
    return q, keys, values


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_row_matches_the_reference(scorer, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    for n in (1, 2, 7, 33):
        q, keys, values = random_layer(g, heads, kv_heads, n)
        row = attention_row(q, keys, values=values, scorer=scorer)
        assert row.dtype == torch.float32 and row.shape == (n,)
        torch.testing.assert_close(row.double(), reference_row(q, keys, values, scorer),
                                   rtol=1e-5, atol=1e-7)
        if scorer == "attention":
            assert abs(row.sum().item() - 1.0) < 1e-5


def test_gqa_counts_every_query_head_once():
    # 4 query heads over 2 KV heads: the row is the mean of the 4 query heads' rows, as if
    # the KV heads were expanded by Llama's repeat_kv (query head h reads KV head h // 2).
    g = torch.Generator().manual_seed(3)
    q, keys, _ = random_layer(g, 4, 2, 11)
    expanded = keys.repeat_interleave(2, dim=0)       # [4, n, d]
    rows = torch.stack([torch.softmax(expanded[h] @ q[h] / math.sqrt(8), -1) for h in range(4)])
    torch.testing.assert_close(attention_row(q, keys), rows.mean(0))
    with pytest.raises(ValueError, match="do not group"):
        attention_row(torch.randn(3, 8), keys)


@pytest.mark.parametrize("scorer", ["attention", "vnorm"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_tensor_parallel_head_sums_join_to_the_pooled_row(scorer, ranks):
    g = torch.Generator().manual_seed(ranks)
    q, keys, values = random_layer(g, heads=8, kv_heads=4, n=17)
    pooled = attention_row(q, keys, values=values, scorer=scorer)
    sums, counts = [], []
    per_q, per_kv = 8 // ranks, 4 // ranks
    for p in range(ranks):  # rank p holds query heads [p*per_q, ...) and their KV heads
        part, heads = attention_row(q[p * per_q:(p + 1) * per_q],
                                    keys[p * per_kv:(p + 1) * per_kv],
                                    values=values[p * per_kv:(p + 1) * per_kv],
                                    scorer=scorer, head_sum=True)
        sums.append(part)
        counts.append(heads)
    assert counts == [per_q] * ranks
    joined = torch.stack(sums).double().sum(0) / sum(counts)  # SPEC.md: sum_p sums / sum_p h
    torch.testing.assert_close(joined.float(), pooled, rtol=1e-6, atol=1e-7)


def test_entropy_refuses_a_rank_head_sum():
    g = torch.Generator().manual_seed(1)
    q, keys, _ = random_layer(g)
    with pytest.raises(ValueError, match="entropy"):
        attention_row(q, keys, scorer="entropy", head_sum=True)
    with pytest.raises(ValueError, match="entropy"):
        StepScores(scorer="entropy", head_sum=True)


@pytest.mark.parametrize("scorer", SCORERS)
def test_a_batch_of_different_lengths_gives_each_sequence_its_own_row(scorer):
    g = torch.Generator().manual_seed(7)
    lengths = [5, 12, 1, 9]
    n = max(lengths)
    q = torch.randn(4, 4, 8, generator=g)
    keys = torch.randn(4, 2, n, 8, generator=g)
    values = torch.randn(4, 2, n, 8, generator=g)
    rows = attention_row(q, keys, values=values, scorer=scorer, lengths=lengths)
    assert rows.shape == (4, n)
    for b, length in enumerate(lengths):
        alone = attention_row(q[b], keys[b, :, :length], values=values[b, :, :length],
                              scorer=scorer)
        torch.testing.assert_close(rows[b, :length], alone, rtol=1e-6, atol=1e-7)
        assert torch.all(rows[b, length:] == 0)
    sums, heads = attention_row(q, keys, lengths=torch.tensor(lengths), head_sum=True)
    assert heads == 4
    torch.testing.assert_close(sums / heads, attention_row(q, keys, lengths=lengths))
    with pytest.raises(ValueError, match="lengths"):
        attention_row(q, keys, lengths=[5, 12, 0, 9])


def test_pooling_weights_the_model_has_equals_recomputing_them():
    g = torch.Generator().manual_seed(11)
    q, keys, values = random_layer(g, 8, 2, 20)
    weights = attention_weights(q, keys)
    assert weights.shape == (8, 20)
    for scorer in SCORERS:
        torch.testing.assert_close(pool_weights(weights, values=values, scorer=scorer),
                                   attention_row(q, keys, values=values, scorer=scorer))


def test_vnorm_and_entropy_keep_equal_value_norms_and_order():
    # Equal value norms: VNorm is plain attention. Entropy: a positive scalar per layer.
    g = torch.Generator().manual_seed(5)
    q, keys, _ = random_layer(g, 4, 2, 15)
    values = torch.ones(2, 15, 8)
    plain = attention_row(q, keys)
    torch.testing.assert_close(attention_row(q, keys, values=values, scorer="vnorm"), plain)
    entropy = attention_row(q, keys, scorer="entropy")
    ratio = entropy / plain
    assert torch.allclose(ratio, ratio[0].expand_as(ratio)) and 0 < ratio[0] <= 1
    assert torch.equal(torch.argsort(entropy), torch.argsort(plain))


@pytest.mark.parametrize("alpha,layers", [(0.8, 4), (0.0, 3), (0.95, 1)])
def test_a_folded_capture_is_the_fold_of_the_per_layer_rows(alpha, layers):
    g = torch.Generator().manual_seed(layers)
    weights = FoldWeights(tuple((1 - alpha) * alpha ** (layers - 1 - l) for l in range(layers)),
                          alpha ** layers)
    per_layer = StepScores()
    folded = StepScores(fold_weights=weights)
    for _ in range(layers):
        q, keys, values = random_layer(g, 4, 2, 23)
        per_layer.add(q, keys, values)
        folded.add(q, keys, values)
    rows = per_layer.report()
    assert rows.shape == (layers, 23) and rows.dtype == torch.float32
    row = folded.report()
    assert row.shape == (23,) and row.dtype == torch.float32
    torch.testing.assert_close(row, fold_scores(rows, weights), rtol=1e-6, atol=1e-9)
    expected = sum(w * r.double() for w, r in zip(weights.layer_weights, rows))
    torch.testing.assert_close(row.double(), expected, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="per-layer rows"):
        folded.rows()
    assert per_layer.seconds > 0 and folded.seconds > 0


def test_a_folded_capture_checks_its_layer_count():
    g = torch.Generator().manual_seed(2)
    folded = StepScores(fold_weights=[0.5, 0.5])
    q, keys, _ = random_layer(g)
    folded.add(q, keys)
    with pytest.raises(ValueError, match="1 layers were added"):
        folded.report()
    folded.add(q, keys)
    with pytest.raises(ValueError, match="cover 2 layers"):
        folded.add(q, keys)


def test_a_batched_capture_reports_each_sequence_trimmed():
    g = torch.Generator().manual_seed(9)
    lengths = [3, 6]
    capture = StepScores(fold_weights=[0.25, 0.75])
    plain = StepScores()
    for _ in range(2):
        q = torch.randn(2, 4, 8, generator=g)
        keys = torch.randn(2, 2, 6, 8, generator=g)
        capture.add(q, keys, lengths=lengths)
        plain.add(q, keys, lengths=lengths)
    assert capture.report(0).shape == (3,) and capture.report(1).shape == (6,)
    assert plain.report(0).shape == (2, 3) and plain.report(1).shape == (2, 6)
    torch.testing.assert_close(capture.report(1), fold_scores(plain.report(1), [0.25, 0.75]))
    with pytest.raises(ValueError, match="report\\(index\\)"):
        capture.report()


def test_the_package_imports_without_torch():
    # The rest of kvcache_client must not need torch: import it with torch made unimportable.
    code = ("import sys; sys.modules['torch'] = None\n"
            "import kvcache_client\n"
            "try:\n    import kvcache_client.torch\nexcept ImportError as e:\n"
            "    print('ImportError', 'python3-torch' in str(e))\n")
    env_path = ":".join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO_ROOT, env={"PYTHONPATH": env_path}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ImportError", "True"]
