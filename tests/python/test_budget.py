"""kvcache_client.budget_tokens: SPEC.md's budget rule, by hand and as the daemon resolves it."""

import pytest

from kvcache_client import budget_tokens

# (prefill_len, compression_ratio, B): worked by hand from B = max(1, floor((1 - r) L0 + 1e-9)).
CASES = [
    (512, 0.9, 51),     # 51.2
    (256, 0.9, 25),     # 25.6
    (10, 0.9, 1),       # (1 - 0.9) * 10 is 0.9999999999999998 in double: the 1e-9 makes it 1
    (100, 0.7, 30),     # 30.000000000000004
    (1000, 0.8, 200),   # 199.99999999999994 in double
    (3, 0.9, 1),        # 0.3: at least 1
    (7, 0.0, 7),        # nothing compressed
    (1, 0.5, 1),
]


@pytest.mark.parametrize("prefill_len,ratio,budget", CASES)
def test_budget_by_hand(prefill_len, ratio, budget):
    assert budget_tokens(prefill_len, ratio) == budget


@pytest.mark.parametrize("prefill_len,ratio", [(0, 0.5), (10, 1.0), (10, -0.1)])
def test_refuses_what_the_daemon_refuses(prefill_len, ratio):
    with pytest.raises(ValueError):
        budget_tokens(prefill_len, ratio)


def test_equals_the_daemons_resolved_budget(client, seq_id):
    cases = [(p, r) for p, r, _ in CASES] + [(64001, 0.9), (4000, 0.9), (999, 0.33)]
    for prefill_len, ratio in cases:
        state = client.open_sequence(seq_id(), prefill_len, compression_ratio=ratio,
                                     policy="random")
        try:
            assert state.budget == budget_tokens(prefill_len, ratio), (prefill_len, ratio)
        finally:
            client.close_sequence(state.sequence_id)
