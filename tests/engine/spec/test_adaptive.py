"""The adaptive draft length: grows on full acceptance, follows partial acceptance,
pauses (with backoff) after repeated misses."""

from __future__ import annotations

from pdserve.engine.spec.adaptive import MAX_PAUSE, MIN_PROBE_INTERVAL, PLAIN_PROBE_INTERVAL, DraftLength, Payoff


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


def test_payoff_drafts_until_both_modes_are_measured():
    p = Payoff()
    assert p.pays and p.should_draft()
    p.observe(drafted=True, step_seconds=1.0, verifications=4, accepted=8)
    assert p.pays  # no plain step timed yet


def test_payoff_compares_tokens_per_second_of_the_two_modes():
    p = Payoff()
    p.observe(drafted=False, step_seconds=1.0, verifications=0, accepted=0)
    p.observe(drafted=True, step_seconds=1.5, verifications=2, accepted=2)  # 2 tokens in 1.5 s against 1 in 1 s
    assert p.pays
    p = Payoff()
    p.observe(drafted=False, step_seconds=1.0, verifications=0, accepted=0)
    p.observe(drafted=True, step_seconds=2.5, verifications=2, accepted=2)  # 2 tokens in 2.5 s
    assert not p.pays


def test_payoff_probes_the_other_mode():
    p = Payoff()
    drafts = [p.should_draft() for _ in range(PLAIN_PROBE_INTERVAL)]
    assert drafts == [True] * (PLAIN_PROBE_INTERVAL - 1) + [False]  # a plain step to time
    p.observe(drafted=False, step_seconds=1.0, verifications=0, accepted=0)
    p.observe(drafted=True, step_seconds=3.0, verifications=1, accepted=0)
    assert not p.pays
    first = [p.should_draft() for _ in range(MIN_PROBE_INTERVAL)]
    assert first == [False] * (MIN_PROBE_INTERVAL - 1) + [True]  # one drafting probe
    second = [p.should_draft() for _ in range(2 * MIN_PROBE_INTERVAL)]
    assert second.count(True) == 1 and second[-1]  # the interval doubled
    for _ in range(20):  # drafting got cheap and right: it pays again
        p.observe(drafted=True, step_seconds=1.1, verifications=2, accepted=6)
    assert p.pays and p.should_draft()


def test_payoff_ignores_drafting_steps_without_verifications():
    p = Payoff()
    p.observe(drafted=True, step_seconds=1.0, verifications=0, accepted=0)
    assert p.tokens == 0.0 and p.spec == 0.0 and p.pays
