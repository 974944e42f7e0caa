"""fold_scores against a plain float64 loop (lists, numpy, and torch where it is installed),
and the folded layout through the batch against the fake daemon."""

import random
from array import array

import pytest

from fake_kvcached import FakeServer
from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import FoldWeights, KvCacheClient, Policy, SequenceState, fold_scores

try:
    import numpy as np
except ImportError:  # pragma: no cover - scripts/install-deps.sh installs it
    np = None
needs_numpy = pytest.mark.skipif(np is None, reason="numpy is not installed "
                                 "(Debian: python3-numpy, in scripts/install-deps.sh)")


def reference(rows, weights):
    """The fold, one token at a time, in float64, in layer order; then float32."""
    tokens = len(rows[0])
    out = []
    for i in range(tokens):
        acc = 0.0
        for w, row in zip(weights, rows):
            acc += w * float(row[i])
        out.append(acc)
    return array("f", out).tolist()


def ema_weights(alpha, k):
    return FoldWeights(tuple((1 - alpha) * alpha ** (k - 1 - l) for l in range(k)), alpha ** k)


def random_rows(k, tokens, seed):
    rng = random.Random(seed)
    return [[rng.random() ** 3 for _ in range(tokens)] for _ in range(k)]


CASES = [(1, 1), (3, 7), (8, 111), (32, 513)]


@pytest.mark.parametrize("k, tokens", CASES)
def test_lists_fold_exactly_as_the_float64_loop(k, tokens):
    rows = random_rows(k, tokens, k * tokens)
    weights = ema_weights(0.8, k)
    folded = fold_scores(rows, weights)
    assert isinstance(folded, list) and folded == reference(rows, weights.layer_weights)
    # Tuples, rows that are buffers, and plain weights do the same.
    assert fold_scores(tuple(array("d", r) for r in rows),
                       list(weights.layer_weights)) == folded


@needs_numpy
@pytest.mark.parametrize("k, tokens", CASES)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_numpy_folds_exactly_as_the_float64_loop(k, tokens, dtype):
    rows = np.array(random_rows(k, tokens, tokens), dtype=dtype)
    weights = [1.0 / k] * k  # single_step
    folded = fold_scores(rows, weights)
    assert folded.dtype == np.float32 and folded.shape == (tokens,)
    assert folded.tolist() == reference(rows.tolist(), weights)
    # K separate rows stack into the same result.
    assert fold_scores(list(rows), weights).tolist() == folded.tolist()
    # Non-contiguous input is fine.
    wide = np.repeat(rows, 2, axis=1)[:, ::2]
    assert fold_scores(wide, weights).tolist() == folded.tolist()


def test_the_weights_must_cover_the_layers():
    with pytest.raises(ValueError, match="rows have 2 layers, the fold weights cover 3"):
        fold_scores([[1.0], [2.0]], [1.0, 1.0, 1.0])
    if np is not None:
        with pytest.raises(ValueError, match="2-D"):
            fold_scores(np.ones(4), [1.0])
    with pytest.raises(ValueError, match="differ in length"):
        fold_scores([[1.0, 2.0], [1.0]], [1.0, 1.0])


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed: torch fold paths "
                                               "untested here")


def _within_one_float32_ulp(got, want):
    for g, w in zip(got, want):
        assert abs(g - w) <= abs(w) * 2 ** -23 + 1e-45, (g, w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_torch_cpu_folds_as_the_float64_loop(dtype):
    torch = _torch()
    rows = torch.tensor(random_rows(6, 111, 3), dtype=getattr(torch, dtype))
    weights = ema_weights(0.9, 6)
    folded = fold_scores(rows, weights)
    assert folded.dtype == torch.float32 and folded.shape == (111,)
    _within_one_float32_ulp(folded.tolist(), reference(rows.double().tolist(),
                                                       weights.layer_weights))
    assert fold_scores(list(rows), weights).tolist() == folded.tolist()


def test_torch_cuda_folds_on_the_device():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rows = torch.tensor(random_rows(32, 513, 5), dtype=torch.float16, device="cuda")
    weights = ema_weights(0.8, 32)
    folded = fold_scores(rows, weights)
    assert folded.device == rows.device and folded.dtype == torch.float32
    _within_one_float32_ulp(folded.cpu().tolist(),
                            reference(rows.double().cpu().tolist(), weights.layer_weights))


def test_fold_weights_come_with_the_state():
    message = pb.SequenceState(sequence_id="f", score_layout=pb.SCORE_LAYOUT_FOLDED, layers=2,
                               fold_weights=pb.FoldWeights(layer_weights=[0.16, 0.2],
                                                           decay=0.64))
    state = SequenceState.from_proto(message)
    assert (state.score_layout, state.layers) == ("folded", 2)
    assert state.fold_weights == FoldWeights((0.16, 0.2), 0.64)
    assert state.fold_weights.layers == 2
    plain = SequenceState.from_proto(pb.SequenceState(sequence_id="p"))
    assert (plain.score_layout, plain.layers, plain.fold_weights) == ("per_layer", 0, None)


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()


def test_a_folded_sequence_takes_one_row_per_step(fake):
    k = 3
    with KvCacheClient(fake.address, timeout=10) as client, client.batch() as batch:
        state = batch.open("f", prefill_len=3, budget_tokens=2, score_layout="folded",
                           layers=k, policy=Policy(alpha=0.5))
        assert state.score_layout == "folded" and state.layers == k
        assert state.fold_weights == FoldWeights((0.125, 0.25, 0.5), 0.125)
        tracked = batch.sequences["f"]
        assert tracked.folded and tracked.fold_weights == state.fold_weights
        rows = random_rows(k, tracked.tokens, 1)
        refused = batch.step({"f": rows})["f"]
        assert not refused.ok and "folded" in refused.message
        assert "fold_scores" in refused.message and "not sent" in refused.message
        row = fold_scores(rows, tracked.fold_weights)
        assert batch.step({"f": [row]})["f"].ok
        assert batch.step({"f": None})["f"].ok  # the fake needs no scores on step 2
        rows = random_rows(k, batch.sequences["f"].tokens, 2)
        if np is not None:
            rows = np.array(rows, dtype=np.float32)
        assert batch.step({"f": fold_scores(rows, tracked.fold_weights)})["f"].ok
        # Another rank's batch reads the layout and weights from the daemon.
        with client.batch() as other:
            assert other.add("f").fold_weights == state.fold_weights
    sent = [b.reports[0] for b in fake.service.batches]
    assert [r.layers for r in sent] == [1, 0, 1]
    assert sent[0].scores == array("f", row).tobytes()


def test_layout_names_are_checked_here():
    with KvCacheClient("127.0.0.1:1") as client, pytest.raises(ValueError, match="layout"):
        client.open_sequence("x", 4, budget_tokens=2, score_layout="diagonal")
