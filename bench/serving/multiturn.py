"""The multi-turn chat workload (`pdserve bench --workload multiturn`): conversations
whose every turn resends the whole history, so that a server which kept the earlier
turns' KV (a prefix cache, tiers below the device pool) answers from it.

One conversation, on a thread of its own:

    start at its arrival time (the arrival process draws one time per conversation)
    turn 1   prompt = user_1                                -> answer_1 (the server's tokens)
             think (exponential, mean --think-time seconds, seeded)
    turn 2   prompt = user_1 answer_1 user_2                -> answer_2
             ...
    turn T   prompt = user_1 answer_1 ... answer_{T-1} user_T

T is uniform in --turns MIN MAX (5-10 by default); each user message is random token
ids of a length uniform in --prompt-tokens, each answer --output-tokens long (greedy,
ignore_eos). Everything but the answers is drawn up front from the seed: the same
seed sends the same user messages and waits. A turn is sent only when the one before
it has finished (a conversation's requests are in order); a failed turn ends its
conversation, and its later turns are reported as failed, never sent. The answers are
the server's own tokens (gRPC: its token ids; the OpenAI backends: the streamed text,
tokenized with --tokenizer), so the history a server sees is what it produced.
`--concurrency` caps the conversations in flight (0: no limit).

Request indices: conversation c's turn t is request (turns of conversations 0..c-1) + t.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from pdserve.bench.serving.backend import Backend, InFlight, result_base
from pdserve.bench.serving.metrics import RequestResult, Slo, summarize
from pdserve.bench.serving.run import Measured, load_average, progress_bar
from pdserve.bench.serving.workloads import ArrivalConfig, BenchRequest, WorkloadConfig, random_ids, send_times

STOPPED = "not sent: an earlier turn of its conversation failed"


@dataclass(frozen=True)
class Conversation:
    """Everything about a conversation but the server's answers."""

    first_index: int  # request index of its first turn
    start: float  # seconds after the benchmark's start
    users: tuple[tuple[int, ...], ...]  # each turn's new user message
    output_tokens: tuple[int, ...]  # each turn's answer length
    think: tuple[float, ...]  # seconds waited after each turn's answer (the last one unused)

    @property
    def turns(self) -> int:
        return len(self.users)

    def longest(self) -> int:
        """Tokens of the last turn's prompt and answer: the most this conversation needs."""
        return sum(len(u) for u in self.users) + sum(self.output_tokens)


def make_conversations(cfg: WorkloadConfig, arrivals: ArrivalConfig, vocab_size: int,
                       max_model_len: int) -> list[Conversation]:
    """`cfg.num_requests` conversations (seeded); refused when one cannot fit max_model_len."""
    if cfg.kind != "multiturn":
        raise ValueError(f"make_conversations: a multiturn workload, got {cfg.kind!r}")
    rng = random.Random(f"prompts-multiturn-{cfg.seed}")
    think = random.Random(f"think-{cfg.seed}")
    starts = send_times(cfg.num_requests, arrivals, random.Random(f"arrivals-{cfg.seed}"))
    conversations: list[Conversation] = []
    index = 0
    for number, start in enumerate(starts):
        turns = rng.randint(*cfg.turns)
        users = tuple(random_ids(rng.randint(*cfg.prompt_tokens), vocab_size, rng) for _ in range(turns))
        outputs = tuple(rng.randint(*cfg.output_tokens) for _ in range(turns))
        waits = tuple(think.expovariate(1.0 / cfg.think_time) if cfg.think_time > 0 else 0.0 for _ in range(turns))
        conversation = Conversation(index, start, users, outputs, waits)
        if conversation.longest() > max_model_len:
            raise ValueError(f"conversation {number}: its last turn needs {conversation.longest()} tokens, more than "
                             f"the served max_model_len={max_model_len} (fewer --turns or shorter --prompt-tokens / "
                             "--output-tokens)")
        conversations.append(conversation)
        index += turns
    return conversations


def turn_request(conversation: Conversation, turn: int, answers: Sequence[tuple[int, ...]], send_at: float) -> BenchRequest:
    """Turn `turn`'s request: the whole history (user messages and the answers so far)
    then this turn's user message; `turns` keeps the segments apart for chat APIs."""
    segments: list[tuple[int, ...]] = []
    for user, answer in zip(conversation.users[:turn], answers):
        segments += [user, answer]
    segments.append(conversation.users[turn])
    prompt = tuple(token for segment in segments for token in segment)
    return BenchRequest(conversation.first_index + turn, prompt, conversation.output_tokens[turn], send_at,
                        turns=tuple(segments))


def _converse(backend: Backend, conversation: Conversation, start: float, timeout: float, inflight: InFlight,
              sent: list[BenchRequest], tick, stop: threading.Event) -> list[RequestResult]:
    """One conversation's turns, in order; the results of all its turns."""
    delay = start + conversation.start - time.perf_counter()
    if delay > 0 and stop.wait(delay):
        return []
    answers: list[tuple[int, ...]] = []
    results: list[RequestResult] = []
    for turn in range(conversation.turns):
        request = turn_request(conversation, turn, answers, time.perf_counter() - start)
        if results and not results[-1].ok:
            now = time.perf_counter()
            results.append(RequestResult(error=STOPPED, started=now, finished=now, **result_base(request)))
            tick(None)
            continue
        sent.append(request)
        result = backend.send(request, timeout, inflight)
        results.append(result)
        tick(None)
        answers.append(result.output_ids)
        if turn + 1 < conversation.turns and stop.wait(conversation.think[turn]):
            return results
    return results


def run_conversations(backend: Backend, conversations: Sequence[Conversation], concurrency: int, timeout: float,
                      progress: bool | None = None, desc: str = "turns",
                      ) -> tuple[float, list[BenchRequest], list[RequestResult]]:
    """Every conversation on its own thread (at most `concurrency` at once; 0: all);
    returns the start time, the requests sent and every turn's result, in request
    order. On an interrupt every call in flight is cancelled before it propagates."""
    inflight, stop = InFlight(), threading.Event()
    total = sum(c.turns for c in conversations)
    sent: list[BenchRequest] = []
    workers = concurrency or len(conversations)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="bench-conv") as pool, \
            progress_bar(total, progress, desc) as tick:
        try:
            start = time.perf_counter()
            futures = [pool.submit(_converse, backend, c, start, timeout, inflight, sent, tick, stop)
                       for c in conversations]
            results = sorted((r for f in futures for r in f.result()), key=lambda r: r.index)
        except BaseException:
            stop.set()
            inflight.close()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return start, sorted(sent, key=lambda r: r.index), results


def measure_conversations(backend: Backend, conversations: Sequence[Conversation], *, concurrency: int,
                          timeout: float, slo: Slo, label: str = "", progress: bool | None = None) -> Measured:
    """`run.measure` for conversations: the same Measured, its requests those sent."""
    load = load_average()
    start, sent, results = run_conversations(backend, conversations, concurrency, timeout, progress,
                                             desc=label or "turns")
    return Measured(label, backend.address, start, tuple(sent), tuple(results), summarize(start, results, slo), load)
