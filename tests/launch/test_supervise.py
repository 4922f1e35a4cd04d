"""The launcher's restart policy (launch/supervise.py): exponential backoff, capped,
reset after a stable run; counted per child."""

from __future__ import annotations

from pdserve.launch.supervise import STABLE_AFTER, Backoff


def test_backoff_doubles_while_a_child_keeps_dying_and_is_capped():
    b = Backoff(first=0.5, cap=3.0)
    delays = []
    now = 100.0
    for _ in range(5):
        delays.append(b.died("decode-0", now))
        assert not b.due("decode-0", now) and b.due("decode-0", now + delays[-1])
        b.restarted("decode-0", now + delays[-1])
        now += delays[-1] + 1.0  # dies again soon after
    assert delays == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.restarts["decode-0"] == 5 and b.total == 5


def test_a_stable_run_resets_the_backoff_and_children_are_counted_apart():
    b = Backoff(first=0.5, cap=10.0)
    assert b.died("router", 0.0) == 0.5
    b.restarted("router", 0.5)
    assert b.died("router", 1.0) == 1.0  # died again at once
    b.restarted("router", 2.0)
    assert b.died("router", 2.0 + STABLE_AFTER) == 0.5  # ran long enough
    assert b.died("prefill-0", 0.0) == 0.5
    assert set(b.pending()) == {"router", "prefill-0"}


def test_a_child_stopped_on_purpose_is_not_restarted():
    b = Backoff(first=0.5, cap=10.0)
    b.died("decode-1", 0.0)
    b.forget("decode-1")
    assert not b.due("decode-1", 100.0) and b.pending() == []
