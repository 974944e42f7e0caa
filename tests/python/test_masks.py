"""Eviction masks without a daemon: the bit layout, Decision.keep_mask / with_cache from
either encoding, and the tracked cache positions, with numpy and without."""

import grpc
import pytest

from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import Decision, masks
from kvcache_client._proto import encoding_from_proto, encoding_to_proto

try:
    import numpy as np
except ImportError:  # pragma: no cover - scripts/install-deps.sh installs it
    np = None


@pytest.fixture(params=["numpy", "lists"])
def backend(request, monkeypatch):
    """Runs a test with numpy (when installed) and with the plain-list fallback."""
    if request.param == "numpy":
        if np is None:
            pytest.skip("numpy is not installed")
        monkeypatch.setattr(masks, "_numpy", np)
    else:
        monkeypatch.setattr(masks, "_numpy", None)
    return request.param


def as_list(values):
    return [bool(v) for v in values] if values is not None else None


def mask_decision(indices, cache_before, step=1):
    tokens = cache_before + 1
    return Decision.from_proto(pb.Decision(
        sequence_id="s", step=step, cache_size=tokens - len(indices),
        evicted_mask=masks.pack_mask(indices, tokens), mask_tokens=tokens))


def positions_decision(positions, cache_size, step=1):
    return Decision.from_proto(pb.Decision(sequence_id="s", step=step, evicted=positions,
                                           cache_size=cache_size))


def test_the_bit_layout_is_lsb_first_one_bit_per_token(backend):
    assert masks.pack_mask([1, 4, 8, 9], 10) == bytes([0b00010010, 0b00000011])
    assert as_list(masks.evicted_bits(bytes([0b00010010, 0b11111111]), 10)) == [
        False, True, False, False, True, False, False, False, True, True]
    with pytest.raises(ValueError, match="outside a mask of 10"):
        masks.pack_mask([10], 10)


def test_encoding_names():
    assert encoding_to_proto("positions") == pb.DECISION_ENCODING_UNSPECIFIED
    assert encoding_to_proto("MASK") == pb.DECISION_ENCODING_MASK
    assert encoding_to_proto("auto") == pb.DECISION_ENCODING_AUTO
    assert encoding_from_proto(pb.DECISION_ENCODING_UNSPECIFIED) == "positions"
    assert encoding_from_proto(pb.DECISION_ENCODING_AUTO) == "auto"
    with pytest.raises(ValueError, match="unknown decision encoding 'bits'"):
        encoding_to_proto("bits")


def test_a_mask_decision_gives_its_keep_mask_alone_and_its_positions_with_the_cache(backend):
    cache = [0, 3, 5, 6, 9, 12]  # 5 cached + the new token 12
    d = mask_decision([1, 5], 5)
    assert d.encoding == "mask" and d.evicted is None and d.tokens_before == 6
    assert as_list(d.keep_mask()) == [True, False, True, True, True, False]
    resolved = d.with_cache(cache)
    assert resolved.evicted == [3, 12]
    assert as_list(resolved.keep_mask()) == as_list(d.keep_mask())


def test_a_positions_decision_needs_the_cache_for_its_keep_mask(backend):
    cache = [0, 3, 5, 6, 9, 12]
    d = positions_decision([5, 9], 4)
    with pytest.raises(ValueError, match="with_cache"):
        d.keep_mask()
    assert as_list(d.with_cache(cache).keep_mask()) == [True, True, False, True, False, True]
    none = positions_decision([], 6)
    assert as_list(none.keep_mask()) == [True] * 6  # nothing evicted: no cache needed


def test_a_decision_that_does_not_fit_the_cache_is_refused(backend):
    cache = [0, 3, 5, 6, 9, 12]
    with pytest.raises(ValueError, match="not in the tracked cache"):
        positions_decision([4], 5).with_cache(cache)
    with pytest.raises(ValueError, match="tracked cache holds 6"):
        mask_decision([1], 6).with_cache(cache)
    with pytest.raises(ValueError, match="the daemon's cache holds 2"):
        positions_decision([5], 2).with_cache(cache)


def test_a_rejected_decision_raises_on_keep_mask():
    rejected = Decision.rejected("s", 3, grpc.StatusCode.INVALID_ARGUMENT, "bad", 4, True)
    assert rejected.with_cache([1, 2]) is rejected
    with pytest.raises(Exception, match="bad"):
        rejected.keep_mask()


@pytest.mark.parametrize("evictions", [[], [0], [7], [2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
def test_cache_positions_keep_what_each_step_kept(backend, evictions):
    cache = masks.CachePositions(range(100, 108))
    before = list(cache.before(108))
    assert before == list(range(100, 109))
    cache.keep(evictions)
    assert cache.tolist() == [p for i, p in enumerate(before) if i not in evictions]
    assert len(cache) == 9 - len(evictions)


def test_cache_positions_grow_past_their_buffer(backend):
    cache = masks.CachePositions([])
    for p in range(100):
        cache.before(p)
        cache.keep([])
    assert cache.tolist() == list(range(100))
    cache.before(100)
    cache.cancel()
    cache.before(100)  # the undone step is taken again
    cache.keep([0])
    assert cache.tolist() == list(range(1, 101))


def test_keep_mask_like_a_tensor_is_a_bool_tensor_on_its_device():
    torch = pytest.importorskip("torch")
    d = mask_decision([0], 2)
    keep = d.keep_mask(like=torch.zeros(1))
    assert keep.dtype == torch.bool and keep.device == torch.zeros(1).device
    assert keep.tolist() == [False, True, True]
    with pytest.raises(TypeError, match="torch tensor or a numpy array"):
        d.keep_mask(like=[1])
