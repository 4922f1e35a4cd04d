"""The adaptive draft length: grows on full acceptance, follows partial acceptance,
pauses (with backoff) after repeated misses."""

from __future__ import annotations

from pdserve.engine.spec.adaptive import MAX_PAUSE, DraftLength


def test_starts_at_the_maximum_and_grows_back_to_it():
    d = DraftLength(5)
    assert d.next_k() == 5
    d.update(5, 2)
    assert d.next_k() == 3  # one more than it got right
    d.update(3, 3)
    assert d.next_k() == 4
    d.update(4, 4)
    d.update(5, 5)
    assert d.next_k() == 5  # never past the maximum


def test_misses_pause_with_backoff_and_a_hit_resets():
    d = DraftLength(4)
    d.update(4, 0)
    assert d.next_k() == 1  # one miss: a single-draft probe
    d.update(1, 0)
    assert [d.next_k() for _ in range(3)] == [0, 0, 1]  # two in a row: 2 steps off
    d.update(1, 0)
    assert [d.next_k() for _ in range(5)] == [0, 0, 0, 0, 1]  # then 4
    d.update(1, 1)
    assert d.misses == 0 and d.next_k() == 2


def test_pause_is_bounded_and_no_drafts_change_nothing():
    d = DraftLength(2)
    for _ in range(20):
        d.update(1, 0)
    assert d.paused == MAX_PAUSE
    before = (d.k, d.misses, d.paused)
    d.update(0, 0)
    assert (d.k, d.misses, d.paused) == before
