"""Policies, snapshots and decisions to and from their messages (no daemon)."""

import grpc
import pytest

from kvcache.v1 import kvcache_pb2 as pb
from kvcache_client import Decision, Policy, SequenceState, StepError
from kvcache_client.errors import status_code


def test_policy_fields_to_proto():
    message = Policy(aggregation="cumulative", refresh="lazy", refresh_interval=2,
                     protect_sinks=4, protect_recent=8).to_proto()
    assert message.aggregation == pb.AGGREGATION_CUMULATIVE
    assert message.refresh == pb.REFRESH_LAZY
    assert (message.refresh_interval, message.protect_sinks, message.protect_recent) == (2, 4, 8)
    assert not message.HasField("alpha") and message.preset == ""


def test_policy_alpha_zero_is_sent():
    assert Policy(alpha=0.0).to_proto().HasField("alpha")


def test_presets_send_only_name_and_seed():
    message = Policy.coerce("random").to_proto()
    assert (message.preset, message.aggregation) == ("random", pb.AGGREGATION_UNSPECIFIED)
    assert Policy.from_preset("random", seed=7).to_proto().seed == 7
    assert Policy.coerce(None).preset == "inertia"


def test_span_pool_is_sent_with_fields_and_with_a_preset():
    assert Policy(span_pool=7).to_proto().span_pool == 7
    message = Policy.from_preset("inertia", span_pool=9).to_proto()
    assert (message.preset, message.span_pool) == ("inertia", 9)
    assert Policy.coerce({"preset": "tova", "span_pool": 3}).to_proto().span_pool == 3
    assert Policy().to_proto().span_pool == 0
    assert Policy.from_proto(pb.Policy(preset="inertia", span_pool=5)).span_pool == 5


def test_policy_from_a_trace_header():
    policy = Policy.coerce({"aggregation": "ema", "alpha": 0.8, "refresh": "lazy",
                            "refresh_interval": 4})
    assert policy == Policy(alpha=0.8, refresh="lazy", refresh_interval=4)
    with pytest.raises(ValueError, match="unknown policy fields \\['beta'\\]"):
        Policy.coerce({"beta": 1})


@pytest.mark.parametrize("policy, message", [
    (Policy(aggregation="lru"), "aggregation 'lru'"),
    (Policy(refresh="sometimes"), "refresh 'sometimes'"),
])
def test_unknown_enum_names_are_refused_here(policy, message):
    with pytest.raises(ValueError, match=message):
        policy.to_proto()


def test_resolved_policy_round_trips():
    message = pb.Policy(preset="h2o", aggregation=pb.AGGREGATION_CUMULATIVE,
                        refresh=pb.REFRESH_EVERY_STEP, protect_recent=12)
    policy = Policy.from_proto(message)
    assert (policy.preset, policy.aggregation, policy.protect_recent) == ("h2o", "cumulative", 12)
    assert policy.alpha is None and policy.refresh_interval is None


def test_sequence_state_from_proto():
    state = SequenceState.from_proto(pb.SequenceState(
        sequence_id="s", prefill_len=10, budget=3, last_step=2, cache_size=3,
        score_dtype=pb.SCORE_DTYPE_BFLOAT16, positions=[0, 5, 11], momentum=[0.5, 0.25, 0.0],
        stats=pb.SequenceStats(steps=2, tokens_evicted=9)))
    assert (state.score_dtype, state.tp_world_size, state.next_step) == ("bfloat16", 1, 3)
    assert state.positions == [0, 5, 11] and state.stats.tokens_evicted == 9
    assert state.policy == Policy()


def test_decision_status():
    ok = Decision.from_proto(pb.Decision(sequence_id="s", step=4, evicted=[3, 9], cache_size=7,
                                         next_needs_scores=True))
    assert ok.ok and ok.raise_for_status() is ok and ok.evicted == [3, 9]
    bad = Decision.from_proto(pb.Decision(sequence_id="s", step=4, code=9, message="late"))
    assert bad.code == grpc.StatusCode.FAILED_PRECONDITION and not bad.ok
    with pytest.raises(StepError) as caught:
        bad.raise_for_status()
    assert (caught.value.sequence_id, caught.value.step, caught.value.message) == ("s", 4, "late")


def test_unknown_status_numbers_read_as_unknown():
    assert status_code(99) == grpc.StatusCode.UNKNOWN
    assert status_code(5) == grpc.StatusCode.NOT_FOUND
