"""kvcache_client.torch's observation window against a plain float64 reference on random
tensors: step 1's row is the mean over the window's prompt queries and the first decode
query of their head-pooled causal rows (zeros where a prompt query cannot see); size 0 is
the plain row bit for bit; GQA, tensor-parallel head sums, the fold; the decode loop hands
the window to step 1 only."""

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")

from kvcache_client import FoldWeights  # noqa: E402
from kvcache_client.torch import (DecodeLoop, DenseKvCache, ObservationWindow,  # noqa: E402
                                  StepScores)


def reference_query_row(q_head, keys_kv, visible, n):
    """[n] float64 list: one query head's softmax over keys 0 .. visible-1, 0 beyond."""
    d = len(q_head)
    logits = [sum(q_head[e] * keys_kv[j][e] for e in range(d)) / math.sqrt(d)
              for j in range(visible)]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    z = sum(exps)
    return [exps[j] / z if j < visible else 0.0 for j in range(n)]


def reference_step1_row(prompt_q, decode_q, keys, size):
    """[L0 + 1] float64: mean over the m + 1 queries (prompt positions L0 - m .. L0 - 1,
    then the decode query at L0) of their rows pooled over query heads (head h reads KV
    head h // group), each prompt query seeing positions up to its own."""
    heads, prompt_len, _ = prompt_q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    n = prompt_len + 1
    m = min(size, prompt_len)
    k = keys.double().tolist()
    queries = [(prompt_q[:, p].double().tolist(), p + 1) for p in range(prompt_len - m,
                                                                        prompt_len)]
    queries.append((decode_q.double().tolist(), n))
    total = [0.0] * n
    for qs, visible in queries:
        for h in range(heads):
            row = reference_query_row(qs[h], k[h // group], visible, n)
            for j in range(n):
                total[j] += row[j] / heads
    return torch.tensor([x / (m + 1) for x in total], dtype=torch.float64)


def random_prompt(generator, heads, kv_heads, prompt_len, d=8, layers=2, dtype=torch.float32):
    """Per layer: the prompt's queries [heads, L0, d], the decode query [heads, d], the keys
    of the prompt and the new token [kv_heads, L0 + 1, d], and values like the keys."""
    out = []
    for _ in range(layers):
        out.append((torch.randn(heads, prompt_len, d, generator=generator, dtype=dtype),
                    torch.randn(heads, d, generator=generator, dtype=dtype),
                    torch.randn(kv_heads, prompt_len + 1, d, generator=generator, dtype=dtype),
                    torch.randn(kv_heads, prompt_len + 1, d, generator=generator, dtype=dtype)))
    return out


def filled_window(size, layers):
    window = ObservationWindow(size)
    for prompt_q, _, keys, _ in layers:  # the prefill: the prompt's keys only
        window.add(prompt_q, keys[:, :-1])
    return window


def step1_rows(layers, window=None, **capture):
    scores = StepScores(window=window, **capture)
    for _, decode_q, keys, values in layers:
        scores.add(decode_q, keys, values)
    return scores


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("size", [1, 3, 9, 40])
def test_step_one_row_is_the_mean_of_the_window_and_decode_rows(heads, kv_heads, size):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + size)
    for prompt_len in (1, 2, 9, 23):
        layers = random_prompt(g, heads, kv_heads, prompt_len)
        window = filled_window(size, layers)
        assert window.queries == min(size, prompt_len) and window.layers == 2
        rows = step1_rows(layers, window).rows()
        assert rows.dtype == torch.float32 and rows.shape == (2, prompt_len + 1)
        for layer, (prompt_q, decode_q, keys, _) in enumerate(layers):
            expected = reference_step1_row(prompt_q, decode_q, keys, size)
            torch.testing.assert_close(rows[layer].double(), expected, rtol=1e-5, atol=1e-7)
        # Every query's row sums to 1, so their mean does: a later step's scale.
        torch.testing.assert_close(rows.sum(-1), torch.ones(2), rtol=1e-5, atol=1e-5)
        assert bool(torch.isfinite(rows).all()) and bool((rows >= 0).all())


def test_float64_inputs_are_pooled_in_float64():
    g = torch.Generator().manual_seed(7)
    layers = random_prompt(g, 4, 2, 17, dtype=torch.float64)
    window = filled_window(5, layers)
    scores = step1_rows(layers, window, fold_weights=[1.0, 0.0])
    expected = reference_step1_row(layers[0][0], layers[0][1], layers[0][2], 5)
    torch.testing.assert_close(scores.folded_row().double(), expected.float().double(),
                               rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(window._sums[0].sum(-1),
                               torch.full((4,), 5.0, dtype=torch.float64))


@pytest.mark.parametrize("scorer", ["attention", "vnorm", "entropy"])
def test_size_zero_is_the_plain_row_bit_for_bit(scorer):
    g = torch.Generator().manual_seed(11)
    layers = random_prompt(g, 4, 2, 31)
    plain = step1_rows(layers, scorer=scorer).rows()
    windowed = step1_rows(layers, filled_window(0, layers), scorer=scorer).rows()
    assert torch.equal(plain, windowed)


def test_only_the_last_queries_are_read():
    # The whole prompt's queries, or only the last m: the same window.
    g = torch.Generator().manual_seed(5)
    layers = random_prompt(g, 4, 2, 20)
    whole = filled_window(6, layers)
    last = ObservationWindow(6)
    for prompt_q, _, keys, _ in layers:
        last.add(prompt_q[:, -6:], keys[:, :-1])
    for a, b in zip(whole._sums, last._sums):
        assert torch.equal(a, b)


def test_folded_row_folds_the_window_rows():
    g = torch.Generator().manual_seed(13)
    layers = random_prompt(g, 4, 2, 15, layers=3)
    weights = FoldWeights(layer_weights=(0.032, 0.16, 0.2), decay=0.512)
    window = filled_window(4, layers)
    folded = step1_rows(layers, window, fold_weights=weights).folded_row()
    expected = sum(w * reference_step1_row(q, dq, k, 4)
                   for w, (q, dq, k, _) in zip(weights.layer_weights, layers))
    torch.testing.assert_close(folded.double(), expected, rtol=1e-5, atol=1e-8)


def test_tensor_parallel_head_sums_join_to_the_pooled_row():
    # Two ranks of 2 query heads and 1 KV head each: their head sums over the window and
    # the decode query, joined sum / heads, give the whole model's row.
    g = torch.Generator().manual_seed(17)
    layers = random_prompt(g, 4, 2, 12, layers=1)
    whole = step1_rows(layers, filled_window(3, layers)).rows()[0]
    sums, count = torch.zeros(13), 0
    for rank in range(2):
        heads, kv = slice(2 * rank, 2 * rank + 2), slice(rank, rank + 1)
        part = [(q[heads], dq[heads], k[kv], v[kv]) for q, dq, k, v in layers]
        scores = step1_rows(part, filled_window(3, part), head_sum=True)
        sums += scores.rows()[0]
        count += scores.heads
    torch.testing.assert_close(sums / count, whole, rtol=1e-6, atol=1e-7)


def test_the_window_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="integer >= 0"):
        ObservationWindow(-1)
    with pytest.raises(ValueError, match="integer >= 0"):
        ObservationWindow(True)
    window = ObservationWindow(4)
    with pytest.raises(ValueError, match="do not group"):
        window.add(torch.randn(3, 10, 8), torch.randn(2, 10, 8))
    with pytest.raises(ValueError, match="needs the last 4"):
        window.add(torch.randn(4, 3, 8), torch.randn(2, 10, 8))
    window.add(torch.randn(4, 10, 8), torch.randn(2, 10, 8))
    with pytest.raises(ValueError, match="layer 1 has 11 prompt keys"):
        window.add(torch.randn(4, 11, 8), torch.randn(2, 11, 8))
    # Step 1 only: a later step's weights (a cache of another size) are refused.
    with pytest.raises(ValueError, match="pools step 1 of a 10-token prompt"):
        StepScores(window=window).add(torch.randn(4, 8), torch.randn(2, 9, 8))
    scores = StepScores(window=window)
    scores.add(torch.randn(4, 8), torch.randn(2, 11, 8))
    with pytest.raises(ValueError, match="has 1 layers"):
        scores.add(torch.randn(4, 8), torch.randn(2, 11, 8))
    with pytest.raises(ValueError, match="batched step"):
        StepScores(window=window).add(torch.randn(2, 4, 8), torch.randn(2, 2, 11, 8))
    with pytest.raises(ValueError, match="must be an ObservationWindow"):
        StepScores(window=4)


class FakeBatch:
    """What DecodeLoop reads of a SequenceBatch: per-layer sequences, keeping everything."""

    def __init__(self):
        self.sequences = {}
        self.sent = []

    def __contains__(self, sequence_id):
        return sequence_id in self.sequences

    def open(self, sequence_id, tokens):
        self.sequences[sequence_id] = SimpleNamespace(
            next_needs_scores=True, head_count=0, folded=False, fold_weights=None,
            last_step=0, next_step=1, cache_size=tokens)

    def step(self, reports, dtype=None, raise_on_error=True):
        self.sent.append(reports)
        out = {}
        for sequence_id in reports:
            tracked = self.sequences[sequence_id]
            tracked.last_step += 1
            tracked.next_step = tracked.last_step + 1
            out[sequence_id] = SimpleNamespace(ok=True, step=tracked.last_step, evicted=(),
                                               kv_changes=(), cache_size=tracked.cache_size + 1)
            tracked.cache_size += 1
        return out


def test_the_loop_pools_the_window_into_step_one_only():
    g = torch.Generator().manual_seed(19)
    layers = random_prompt(g, 4, 2, 12)
    batch = FakeBatch()
    batch.open("s", 12)
    loop = DecodeLoop(batch, observation_window=3)
    cache = DenseKvCache([k[:, :-1] for _, _, k, _ in layers],
                         [v[:, :-1] for _, _, _, v in layers], capacity=16)
    loop.add("s", cache)
    window = loop.window("s")
    assert isinstance(window, ObservationWindow) and window.size == 3
    for prompt_q, _, keys, _ in layers:   # the model's prefill fills it
        window.add(prompt_q, keys[:, :-1])
    for step in (1, 2):
        captures = loop.begin()
        assert (captures["s"].window is window) == (step == 1)
        for layer, (_, decode_q, keys, values) in enumerate(layers):
            k, v = cache.extend(layer, keys[:, -1], values[:, -1])
            captures["s"].add(decode_q, k, v)
        loop.finish(captures)
        if step == 1:
            expected = reference_step1_row(layers[0][0], layers[0][1], layers[0][2], 3)
            torch.testing.assert_close(batch.sent[0]["s"][0].double(), expected,
                                       rtol=1e-5, atol=1e-7)
            assert loop.window("s") is None   # spent
    assert DecodeLoop(batch).window("s") is None


def test_the_loop_refuses_a_bad_window():
    batch = FakeBatch()
    batch.open("s", 4)
    batch.sequences["s"].next_step = 2
    with pytest.raises(ValueError, match="integer >= 0"):
        DecodeLoop(batch, observation_window=-2)
    cache = DenseKvCache([torch.zeros(1, 4, 2)], [torch.zeros(1, 4, 2)])
    with pytest.raises(ValueError, match="past step 1"):
        DecodeLoop(batch).add("s", cache, window=ObservationWindow(2))
    loop = DecodeLoop(batch, observation_window=2)
    loop.add("s", cache)      # past step 1: no window to fill
    assert loop.window("s") is None
