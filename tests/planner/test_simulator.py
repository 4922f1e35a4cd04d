"""The cluster simulator (planner/simulator.py) on a profile whose costs are known:
single requests take exactly the profile's step times, a prompt crosses when it
should, blocks bound the batch (preemption, and every request still ends), shared
prefixes are not prefilled twice, and bad traffic is refused by name."""

from __future__ import annotations

import pytest

from pdserve.planner.profile import Profile
from pdserve.planner.simulator import Limits, Shape, SimRequest, Simulation, Traffic, figures
from pdserve.services.common.quantiles import percentile

# prefill: 1 ms + 0.1 ms a new token (cached tokens cost nothing); decode: 2 ms + 0.5 ms a
# sequence (context-free); a block crosses in 0.2 ms after 1 ms of latency
PROFILE = Profile(
    {"flags": {}, "num_blocks": 1024, "block_size": 16},
    prefill=[{"tokens": t, "cached": c, "seconds": 0.001 + 0.0001 * t} for t in (16, 4096) for c in (0, 4096)],
    decode=[{"batch": b, "context": x, "seconds": 0.002 + 0.0005 * b} for b in (1, 256) for x in (64, 4096)],
    transfer={"latency_seconds": 0.001, "seconds_per_block": 0.0002, "bytes_per_block": 1},
)


def one(shape: Shape, request: SimRequest, limits: Limits = Limits()):
    (outcome,) = Simulation(PROFILE, shape, limits).run([request])
    return outcome


def test_a_request_alone_on_a_mixed_worker_takes_the_profiles_step_times():
    o = one(Shape(mixed=1), SimRequest(arrival=1.0, prompt=100, output=5))
    assert o.ttft == pytest.approx(0.001 + 0.0001 * 100)
    assert o.itls == pytest.approx([0.0025] * 4) and o.tpot == pytest.approx(0.0025)
    assert o.path == "local" and o.done and o.preemptions == 0


def test_a_long_prompt_crosses_from_the_prefill_worker_and_a_short_one_stays():
    o = one(Shape(prefill=1, decode=1, mixed=0, local_prefill_threshold=64), SimRequest(0.0, 100, 3))
    assert o.path == "remote"
    prefill = 0.001 + 0.01
    transfer = 0.001 + (7 - 1) * 0.0002  # 100 tokens: 7 blocks
    assert o.token_times == pytest.approx([prefill, prefill + transfer + 0.0025, prefill + transfer + 0.005])
    short = one(Shape(prefill=1, decode=1, mixed=0, local_prefill_threshold=64), SimRequest(0.0, 40, 3))
    assert short.path == "local" and short.ttft == pytest.approx(0.001 + 0.004)


def test_a_decode_worker_without_room_to_reserve_prefills_itself():
    o = one(Shape(prefill=1, decode=1, mixed=0), SimRequest(0.0, 100, 2), Limits(num_blocks=4))
    assert o.path == "fallback"


def test_blocks_bound_the_batch_preempting_the_youngest_and_every_request_ends():
    requests = [SimRequest(0.001 * i, 30, 40) for i in range(8)]
    outcomes = Simulation(PROFILE, Shape(mixed=1), Limits(num_blocks=12)).run(requests)
    assert all(o.done and len(o.token_times) == 40 for o in outcomes)
    assert sum(o.preemptions for o in outcomes) > 0
    roomy = Simulation(PROFILE, Shape(mixed=1), Limits(num_blocks=1024)).run(requests)
    assert sum(o.preemptions for o in roomy) == 0


def test_a_token_budget_chunks_a_long_prompt():
    o = one(Shape(mixed=1), SimRequest(0.0, 1000, 1), Limits(max_num_batched_tokens=256))
    assert o.ttft == pytest.approx(3 * (0.001 + 0.0256) + (0.001 + 0.0001 * 232))


def test_a_shared_prefix_is_prefilled_once_per_worker():
    first = SimRequest(0.0, 200, 1, hash_ids=(1, 2, 3), block_tokens=64)
    again = SimRequest(1.0, 200, 1, hash_ids=(1, 2, 9), block_tokens=64)
    a, b = Simulation(PROFILE, Shape(mixed=1)).run([first, again])
    assert a.ttft == pytest.approx(0.001 + 0.02)
    assert b.ttft == pytest.approx(0.001 + 0.0001 * (200 - 128))  # two blocks of 64 cached


def test_figures_and_slos():
    outcomes = Simulation(PROFILE, Shape(mixed=1)).run(Traffic(50, 200, (20, 60), (4, 8), seed=3).draw())
    f = figures(outcomes, slo_ttft=1.0, slo_tpot=1.0)
    assert f.met == 1.0 and f.goodput == pytest.approx(200 / f.duration)
    assert figures(outcomes, slo_ttft=0.0).met == 0.0
    assert percentile([1, 2, 3, 4], 50) == 2.5


@pytest.mark.parametrize("kwargs, field", [
    (dict(rate=0), "rate"), (dict(rate=float("inf")), "rate"), (dict(requests=0), "requests"),
    (dict(input_len=(0, 5)), "input_len"), (dict(output_len=(9, 5)), "output_len"), (dict(burstiness=0), "burstiness"),
])
def test_bad_traffic_is_refused_by_name(kwargs, field):
    base = dict(rate=1.0, requests=10, input_len=(10, 20), output_len=(5, 10))
    with pytest.raises(ValueError, match=f"^{field}:"):
        Traffic(**{**base, **kwargs})
    with pytest.raises(ValueError, match="shape"):
        Shape(prefill=1, decode=0, mixed=0)
