"""The multi-turn workload (bench/serving/multiturn.py) without a server: a fake
backend that answers at once records what was sent and when, so the workload's shape
is pinned: turns per conversation, the history resent and grown by each answer, the
think time between turns, a conversation's requests in order, a failure ending its
conversation; the chat form of a turn; the flags of `pdserve bench`."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import pytest

from pdserve.bench.common.entry import parse
from pdserve.bench.serving.backend import InFlight, ServedModel, result_base
from pdserve.bench.serving.command import ServingFlags, config_from
from pdserve.bench.serving.metrics import RequestResult, Slo
from pdserve.bench.serving.multiturn import STOPPED, make_conversations, measure_conversations
from pdserve.bench.serving.openai_backend import OpenAiBackend
from pdserve.bench.serving.workloads import ArrivalConfig, BenchRequest, WorkloadConfig, make_workload

VOCAB, MAX_LEN = 500, 4096


def multiturn(**kw) -> WorkloadConfig:
    base = dict(kind="multiturn", num_requests=6, turns=(3, 5), prompt_tokens=(4, 9), output_tokens=(2, 4),
                think_time=0.02, seed=1)
    return WorkloadConfig(**{**base, **kw})


@dataclass
class Sent:
    request: BenchRequest
    started: float
    finished: float


@dataclass
class FakeBackend:
    """Answers every request after `delay` seconds with tokens derived from its index."""

    delay: float = 0.002
    fail: set[int] = field(default_factory=set)  # request indices answered with an error
    name: str = "fake"
    address: str = "fake:0"
    sent: list[Sent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def served(self) -> ServedModel:
        return ServedModel("fake", VOCAB, MAX_LEN)

    @staticmethod
    def answer(request: BenchRequest) -> tuple[int, ...]:
        return tuple(3 + (request.index * 11 + k) % 97 for k in range(request.max_tokens))

    def send(self, request: BenchRequest, timeout: float, inflight: InFlight) -> RequestResult:
        started = time.perf_counter()
        time.sleep(self.delay)
        finished = time.perf_counter()
        with self.lock:
            self.sent.append(Sent(request, started, finished))
        if request.index in self.fail:
            return RequestResult(error="INTERNAL: injected", started=started, finished=finished, **result_base(request))
        ids = self.answer(request)
        return RequestResult(error="", started=started, finished=finished, prompt_tokens=len(request.prompt),
                             output_tokens=len(ids), token_times=(finished,), output_ids=ids, **result_base(request))


def test_conversations_are_seeded_and_within_their_ranges() -> None:
    cfg = multiturn(num_requests=40)
    a = make_conversations(cfg, ArrivalConfig(request_rate=5.0), VOCAB, MAX_LEN)
    assert a == make_conversations(cfg, ArrivalConfig(request_rate=5.0), VOCAB, MAX_LEN)
    assert len(a) == 40 and {c.turns for c in a} == {3, 4, 5}
    assert all(4 <= len(u) <= 9 for c in a for u in c.users)
    assert all(3 <= t < VOCAB for c in a for u in c.users for t in u)
    assert all(2 <= n <= 4 for c in a for n in c.output_tokens)
    # request indices: each conversation's turns follow the ones before
    assert [c.first_index for c in a] == [sum(c.turns for c in a[:i]) for i in range(40)]
    starts = [c.start for c in a]
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] > 0
    waits = [w for c in make_conversations(multiturn(num_requests=400, think_time=0.5), ArrivalConfig(), VOCAB,
                                           MAX_LEN) for w in c.think]
    assert statistics.mean(waits) == pytest.approx(0.5, rel=0.1)  # exponential, mean --think-time
    assert all(w == 0 for c in make_conversations(multiturn(think_time=0), ArrivalConfig(), VOCAB, MAX_LEN)
               for w in c.think)


def test_conversations_that_cannot_fit_are_refused_and_make_workload_refuses_multiturn() -> None:
    with pytest.raises(ValueError, match="max_model_len=20"):  # 3 turns of 4 + 2 tokens at least: 18
        make_conversations(multiturn(turns=(4, 5)), ArrivalConfig(), VOCAB, 20)
    with pytest.raises(ValueError, match="multiturn"):
        make_workload(multiturn(), ArrivalConfig(), VOCAB, MAX_LEN)
    with pytest.raises(ValueError, match="--turns"):
        multiturn(turns=(0, 3))
    with pytest.raises(ValueError, match="--think-time"):
        multiturn(think_time=-1)


def test_each_turn_resends_the_history_with_the_answers_in_order_after_the_think_time() -> None:
    cfg = multiturn(num_requests=5, think_time=0.03)
    conversations = make_conversations(cfg, ArrivalConfig(request_rate=50.0), VOCAB, MAX_LEN)
    backend = FakeBackend()
    run = measure_conversations(backend, conversations, concurrency=0, timeout=10, slo=Slo())
    total = sum(c.turns for c in conversations)
    assert run.summary.completed == run.summary.num_requests == total and run.problems() == []
    assert sorted(s.request.index for s in backend.sent) == list(range(total))
    assert [r.index for r in run.requests] == list(range(total))
    by_index = {s.request.index: s for s in backend.sent}
    for c in conversations:
        turns = [by_index[c.first_index + t] for t in range(c.turns)]
        history: tuple[int, ...] = ()
        for t, sent in enumerate(turns):
            request = sent.request
            # the whole history, then this turn's user message; the segments alternate user / answer
            assert request.prompt == history + c.users[t]
            assert len(request.turns) == 2 * t + 1 and sum(request.turns, ()) == request.prompt
            assert request.turns[0::2] == c.users[: t + 1]
            assert request.turns[1::2] == tuple(FakeBackend.answer(s.request) for s in turns[:t])
            assert request.max_tokens == c.output_tokens[t]
            history = request.prompt + FakeBackend.answer(request)
            if t:  # sent only after the turn before it ended and its think time passed
                assert sent.started >= turns[t - 1].finished + c.think[t - 1] - 1e-3
        assert len(turns[-1].request.prompt) + c.output_tokens[-1] == c.longest()
    # conversations ran side by side, not one after the other: their spans add up to more than the run
    spans = [by_index[c.first_index + c.turns - 1].finished - by_index[c.first_index].started for c in conversations]
    assert sum(spans) > run.summary.duration_s


def test_concurrency_caps_the_conversations_in_flight() -> None:
    conversations = make_conversations(multiturn(num_requests=6, think_time=0.0), ArrivalConfig(), VOCAB, MAX_LEN)
    backend = FakeBackend(delay=0.005)
    measure_conversations(backend, conversations, concurrency=2, timeout=10, slo=Slo())
    owner = {c.first_index + t: i for i, c in enumerate(conversations) for t in range(c.turns)}
    spans: dict[int, list[float]] = {}
    for s in backend.sent:
        span = spans.setdefault(owner[s.request.index], [s.started, s.finished])
        span[0], span[1] = min(span[0], s.started), max(span[1], s.finished)
    for moment in sorted(t for span in spans.values() for t in span):
        assert sum(a <= moment < b for a, b in spans.values()) <= 2


def test_a_failed_turn_ends_its_conversation_and_the_rest_count_as_failed() -> None:
    conversations = make_conversations(multiturn(num_requests=3), ArrivalConfig(), VOCAB, MAX_LEN)
    first = conversations[0]
    backend = FakeBackend(fail={first.first_index + 1})
    run = measure_conversations(backend, conversations, concurrency=0, timeout=10, slo=Slo())
    sent = {s.request.index for s in backend.sent}
    later = range(first.first_index + 2, first.first_index + first.turns)
    assert not sent & set(later)
    errors = {r.index: r.error for r in run.results}
    assert errors[first.first_index + 1] == "INTERNAL: injected"
    assert all(errors[i] == STOPPED for i in later)
    assert run.summary.failed == first.turns - 1
    assert run.summary.num_requests == sum(c.turns for c in conversations) and run.problems() == []


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_chat_backend_sends_a_turn_as_alternating_user_and_assistant_messages() -> None:
    backend = object.__new__(OpenAiBackend)
    backend.tokenizer = _Tokenizer()
    request = BenchRequest(0, (5, 6, 7, 8, 9), 4, 0.0, turns=((5, 6), (7,), (8, 9)))
    assert OpenAiBackend.messages(backend, request) == [
        {"role": "user", "content": "5 6"}, {"role": "assistant", "content": "7"},
        {"role": "user", "content": "8 9"}]
    assert OpenAiBackend.messages(backend, BenchRequest(1, (5, 6), 4, 0.0)) == [{"role": "user", "content": "5 6"}]


def test_bench_flags_select_the_multiturn_workload() -> None:
    cfg = parse(ServingFlags, ["--workload", "multiturn", "--num-requests", "7", "--turns", "2", "4",
                               "--think-time", "0.25", "--prompt-tokens", "8", "16", "--addr", "127.0.0.1:1"],
                "pdserve bench", None, config_from)
    w = cfg.workload
    assert (w.kind, w.num_requests, w.turns, w.think_time, w.prompt_tokens) == ("multiturn", 7, (2, 4), 0.25, (8, 16))
    assert WorkloadConfig().turns == (5, 10)  # the 5-10 turns by default
