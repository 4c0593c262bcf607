"""The overlap policy: launch first while the mask fill is shorter than the forward."""

from __future__ import annotations

from server.engine.overlap_policy import OverlapPolicy


def test_launches_first_until_the_forward_is_measured():
    policy = OverlapPolicy(enabled=True)
    policy.record_fill(50.0)
    assert policy.launch_first  # nothing to compare with yet
    policy.record_forward(5.0)
    assert not policy.launch_first


def test_follows_the_moving_averages_both_ways():
    policy = OverlapPolicy(enabled=True)
    policy.record_forward(5.0)
    for _ in range(10):
        policy.record_fill(8.0)  # a slow fill: read first, the fill runs beside the device
    assert not policy.launch_first
    for _ in range(10):
        policy.record_fill(0.0)  # steps without host masks
    assert policy.launch_first
    policy.record_forward(None)  # an untimed pass changes nothing
    assert policy.forward_ms == 5.0


def test_a_disabled_policy_never_launches_first():
    policy = OverlapPolicy(enabled=False)
    policy.record_forward(100.0)
    assert not policy.launch_first
