"""The engine's streaming hook: every token of a plain or parallel-sampled request is
told once, in order, and the deltas add up to exactly the finished output."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine, TokenDelta
from pdserve.engine.llm import DEFAULT_MODEL


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(num_blocks: int = 256, max_num_seqs: int = 256) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
    ))


def run_streaming(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    deltas: list[TokenDelta] = []
    engine.token_hook = deltas.append
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    engine.check_integrity()
    return deltas, outputs


def by_sequence(deltas: list[TokenDelta]) -> dict[tuple[str, int], list[TokenDelta]]:
    seqs: dict[tuple[str, int], list[TokenDelta]] = defaultdict(list)
    for d in deltas:
        seqs[(d.request_id, d.index)].append(d)
    return seqs


def test_deltas_add_up_to_the_outputs():
    engine = make_engine()
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(3)]
    requests = {
        "greedy": (prompts[0], SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)),
        "sampled": (prompts[1], SamplingParams(max_tokens=9, temperature=0.9, seed=7, n=3)),
        "short": (prompts[2], SamplingParams(max_tokens=1, temperature=0.0)),
    }
    deltas, outputs = run_streaming(engine, requests)
    seqs = by_sequence(deltas)
    assert set(seqs) == {("greedy", 0), ("sampled", 0), ("sampled", 1), ("sampled", 2), ("short", 0)}
    for (rid, index), told in seqs.items():
        completion = outputs[rid].outputs[index]
        assert [d.token_id for d in told] == completion.token_ids
        assert [d.finish_reason for d in told[:-1]] == [None] * (len(told) - 1)
        assert told[-1].finish_reason == completion.finish_reason
        assert all(d.logprob is not None for d in told)
    greedy = seqs[("greedy", 0)]
    assert [{**d.top_logprobs, d.token_id: d.logprob} for d in greedy] == outputs["greedy"].outputs[0].logprobs
    assert all(d.top_logprobs is None for d in seqs[("short", 0)])


def test_preemption_never_re_emits():
    engine = make_engine(num_blocks=12)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    requests = {f"r{i}": (list(range(5 + i, 45 + i)), params) for i in range(4)}
    deltas, outputs = run_streaming(engine, requests)
    assert engine.stats().num_preemptions > 0
    for (rid, index), told in by_sequence(deltas).items():
        assert [d.token_id for d in told] == outputs[rid].outputs[index].token_ids
    assert engine.stats().num_free_blocks == 12


def test_stop_strings_report_stop_and_beams_emit_nothing():
    engine = make_engine()
    prompt = engine.tokenizer.encode("def fib(n):\n")
    free = run_streaming(engine, {"free": (prompt, SamplingParams(max_tokens=16, temperature=0.0))})[1]
    text = free["free"].outputs[0].text
    stop = text[3:5]
    deltas, outputs = run_streaming(engine, {
        "stop": (prompt, SamplingParams(max_tokens=16, temperature=0.0, stop=(stop,))),
        "beam": (prompt, SamplingParams(max_tokens=6, temperature=0.0, beam_width=3, n=2)),
    })
    seqs = by_sequence(deltas)
    assert set(seqs) == {("stop", 0)}
    assert seqs[("stop", 0)][-1].finish_reason == "stop" == outputs["stop"].outputs[0].finish_reason
    assert [d.token_id for d in seqs[("stop", 0)]] == outputs["stop"].outputs[0].token_ids
    assert len(outputs["beam"].outputs) == 2


def test_has_scheduled_work_ignores_reservations():
    engine = make_engine()
    engine.reserve_remote("remote", list(range(3, 40)), SamplingParams(max_tokens=2))
    assert engine.has_unfinished() and not engine.has_scheduled_work()
    engine.abort("remote")
    assert engine.stats().num_free_blocks == 256 and engine.cached_block_hashes() == []
    engine.add_request("local", list(range(3, 40)), SamplingParams(max_tokens=2, temperature=0.0))
    assert engine.has_scheduled_work()
    while engine.has_unfinished():
        engine.step()
    assert len(engine.cached_block_hashes()) == 2  # 38 tokens computed: two full blocks
