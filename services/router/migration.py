"""Stream migration: a request whose decode worker failed after tokens reached the
client continues on another decode worker.

    prompt P, sent S = s1..sk (what the client has), max_tokens M, min_tokens m
    continuation:  prompt P + S, max_tokens M - k, min_tokens max(0, m - k)
    the new worker's first token is output token k + 1 of the request

    |<------- P ------->|<-- S (sent) -->|<-- continuation -->|
    |   original prompt | the new prompt's tail   | streamed on |

Why the continuation equals the uninterrupted run: greedy picks by logits alone;
seeded sampling draws the uniform keyed by (seed, sample index, number of tokens
the sequence holds) (engine/sampler.py `position_key`), and P + S holds as many
tokens as the dead worker's sequence did; repetition penalty counts prompt and
output alike; EOS is masked while output < min_tokens, and the output limit is
counted from the new prompt, so both shift by k. Usage stays the request's: the
front end counts prompt_tokens from P and every token it forwarded once.

n > 1: the workers fork n samples from one prompt, so each sample that had not
ended continues as a request of its own (`one_sample`: n == 1, prompt P + its own
S, `sample_index` i so its seeded draws are sample i's), all at once, their
streams merged back under their indices (dispatch.py).

Presence and frequency penalties count output tokens only: the continuation says
that its prompt's last k tokens are output (`resumed_tokens`), and they count them.

What cannot migrate (it fails as before, UNAVAILABLE naming the reason): beam
search (its beams are not one sequence; but beams stream nothing before the end,
so a beam search whose worker died is retried from the start, not migrated), and
a request past its deadline or past --max-migrations.

Stop strings: the new worker's text starts after its prompt, so it cannot see a
stop string that began in the tokens sent before. `StopWatch` runs the engine's
`SequenceText` over the whole output on the router and ends the sequence where the
uninterrupted run would have (the new worker's call is then cancelled).

`Progress` records what the client has; `continuation` builds the request that
carries on from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.engine.detokenizer import Decoder
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.text import SequenceText
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.validate import Job


@dataclass
class Sample:
    """What of one sequence reached the client."""

    token_ids: list[int] = field(default_factory=list)
    logprob_sum: float = 0.0  # of the tokens sent (their deltas' token_logprobs)
    finish_reason: str | None = None  # it ended (its delta said so) before the final message
    # logprob_sum at the latest migration: what the worker serving the continuation
    # does not count in its cumulative logprob (it counts from its own first token)
    logprob_base: float = 0.0


@dataclass
class Progress:
    """What of each of a request's `n` sequences reached the client (no beams: they
    stream nothing before the end)."""

    n: int = 1
    samples: dict[int, Sample] = field(default_factory=dict)
    migrations: int = 0
    # the worker's final message (finished) was forwarded: the request is served, and a
    # failure after it (the worker killed before its stream closed) fails nothing
    finished: bool = False

    def sample(self, index: int) -> Sample:
        return self.samples.setdefault(index, Sample())

    @property
    def token_ids(self) -> list[int]:
        """Sequence 0's tokens sent (n == 1: the request's)."""
        return self.sample(0).token_ids

    @property
    def sent(self) -> int:
        """Tokens sent over every sequence."""
        return sum(len(s.token_ids) for s in self.samples.values())

    @property
    def done(self) -> bool:
        """Every sequence ended: only the final message is missing."""
        return all(self.sample(i).finish_reason is not None for i in range(self.n))

    def migrated(self) -> None:
        """A migration: from here on, workers count logprobs after what was sent."""
        self.migrations += 1
        for sample in self.samples.values():
            sample.logprob_base = sample.logprob_sum

    def unfinished(self) -> list[int]:
        return [i for i in range(self.n) if self.sample(i).finish_reason is None]

    def record(self, message: pb.DecodeResponse, max_tokens: int) -> None:
        """Note the tokens of a message about to be forwarded to the client."""
        self.finished = self.finished or message.finished
        for delta in message.deltas:
            sample = self.sample(delta.index)
            sample.token_ids.extend(delta.token_ids)
            sample.logprob_sum += sum(delta.token_logprobs) if delta.token_logprobs else sum(e.logprob for e in delta.logprobs)
            if delta.finish_reason:
                sample.finish_reason = delta.finish_reason
            if sample.finish_reason is None and len(sample.token_ids) >= max_tokens:
                sample.finish_reason = "length"

    def final_message(self) -> pb.DecodeResponse:
        """The final message a worker died before sending, every sequence already ended."""
        results = [pb.SequenceResult(index=i, finish_reason=self.sample(i).finish_reason or "",
                                     cumulative_logprob=self.sample(i).logprob_sum) for i in range(self.n)]
        return pb.DecodeResponse(finished=True, results=results)


def unmigratable(job: Job) -> str | None:
    """Why `job` cannot continue on another worker once tokens were sent; None if it can."""
    params = job.params
    if params.use_beam_search:
        return "beam search cannot be resumed from one sequence"
    return None


def one_sample(job: Job, index: int) -> Job:
    """Sample `index` of `job` (n > 1) as a request of its own: n == 1, its seeded draws
    keyed as that sample's (SamplingParams.sample_index), its own worker request ids."""
    return replace(job, worker_request_id=f"{job.worker_request_id}-s{index}",
                   params=replace(job.params, n=1, sample_index=index))


def continuation(job: Job, sent: list[int], block_size: int) -> Job:
    """The request that continues `job` after `sent` reached the client: the prompt
    plus `sent`, the output limits reduced by len(sent) (the diagram above). Its
    block hashes are the new prompt's, salted as the original's."""
    k = len(sent)
    params = job.params
    if k >= params.max_tokens:
        raise ValueError(f"{k} tokens sent of max_tokens {params.max_tokens}: nothing to continue")
    prompt = job.prompt + tuple(sent)
    max_tokens = params.max_tokens - k
    min_tokens = max(0, params.min_tokens - k)
    return replace(
        job, prompt=prompt, params=replace(params, max_tokens=max_tokens, min_tokens=min_tokens, resumed_tokens=k),
        block_hashes=tuple(hash_blocks(prompt, block_size, cache_salt=params.cache_salt)),
    )


def rebase(message: pb.DecodeResponse, original: Job, progress: Progress) -> None:
    """Make a continuation's final message read as the uninterrupted run's: the
    cumulative logprob includes the tokens sent before, cached tokens and prompt
    logprobs are the original prompt's."""
    if not message.finished:
        return
    for result in message.results:
        result.cumulative_logprob += progress.sample(result.index).logprob_base
    message.num_cached_tokens = min(message.num_cached_tokens, len(original.prompt))
    if len(message.prompt_logprobs) > len(original.prompt):
        del message.prompt_logprobs[len(original.prompt):]


class StopWatch:
    """Stop strings over the whole output of a migrated sequence (engine/text.py, as
    the engine matches them): what a continuation's worker cannot see."""

    def __init__(self, tokenizer: Decoder, job: Job, sent: list[int]) -> None:
        self._text = SequenceText(tokenizer, job.prompt, job.params.stop, job.params.min_tokens)
        for token in sent:
            self._text.append(token)

    def cut(self, message: pb.DecodeResponse) -> bool:
        """True when `message` completes a stop string its worker did not end at: the
        message is cut after the token that completes it, which ends the sequence
        ("stop"), and is no longer the worker's final one."""
        for delta in message.deltas:
            if delta.index != 0:
                continue
            for i, token in enumerate(delta.token_ids):
                if not self._text.append(token):
                    continue
                if i == len(delta.token_ids) - 1 and delta.finish_reason:
                    return False  # the worker ended there too
                del delta.token_ids[i + 1:]
                del delta.logprobs[i + 1:]
                del delta.token_logprobs[i + 1:]
                delta.finish_reason = "stop"
                message.finished = False
                del message.results[:]
                return True
        return False
