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
streams merged back under their indices (fan_out.py).

Presence and frequency penalties count output tokens only: the continuation says
that its prompt's last k tokens are output (`resumed_tokens`), and they count them.

What cannot migrate (it fails as before, UNAVAILABLE naming the reason): beam
search (its beams are not one sequence; but beams stream nothing before the end,
so a beam search whose worker died is retried from the start, not migrated), and
a request past its deadline or past --max-migrations.

Stop strings: the new worker's text starts after its prompt, so it cannot see a
stop string that began in the tokens sent before: stops.py watches the whole output.

`Progress` records what the client has (from the router's events, events.py);
`continuation` builds the request that carries on from it; `rebase` makes the
continuation's final update read as the uninterrupted run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pdserve.engine.hashing import extended_block_hashes
from pdserve.services.router.events import Finished, Result, Update
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

    def record(self, update: Update, max_tokens: int) -> None:
        """Note the tokens of an update about to be forwarded to the client."""
        self.finished = self.finished or update.finished
        for tokens in update.tokens:
            sample = self.sample(tokens.index)
            sample.token_ids.extend(tokens.token_ids)
            sample.logprob_sum += sum(tokens.token_logprobs) if tokens.token_logprobs else sum(
                e.logprob for e in tokens.logprobs)
            if tokens.finish_reason:
                sample.finish_reason = tokens.finish_reason
            if sample.finish_reason is None and len(sample.token_ids) >= max_tokens:
                sample.finish_reason = "length"

    def bases(self) -> dict[int, float]:
        """Per sequence, what a continuation's worker does not count in its cumulative
        logprob: the logprobs of the tokens sent before the latest migration."""
        return {i: s.logprob_base for i, s in self.samples.items()}

    def final_message(self) -> Update:
        """The final update a worker died before sending, every sequence already ended."""
        return Update(end=Finished(results=tuple(
            Result(i, self.sample(i).finish_reason or "", self.sample(i).logprob_sum) for i in range(self.n))))


def resumed_progress(job: Job) -> Progress | None:
    """A resume's progress (resume.py): what the client has of each sequence, as after
    a migration; None for a request of its own, or a resume that received no token."""
    if not job.resumed or not any(s.token_ids or s.finish_reason for s in job.resumed):
        return None
    progress = Progress(n=job.params.n)
    for resumed in job.resumed:
        sample = progress.sample(resumed.index)
        sample.token_ids, sample.logprob_sum = list(resumed.token_ids), resumed.logprob_sum
        sample.finish_reason = resumed.finish_reason
        if sample.finish_reason is None and len(sample.token_ids) >= job.params.max_tokens:
            sample.finish_reason = "length"
    progress.migrated()
    return progress


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
    block hashes are the new prompt's, salted as the original's: the original's
    extended by the blocks `sent` fills (the prompt is not hashed again)."""
    k = len(sent)
    params = job.params
    if k >= params.max_tokens:
        raise ValueError(f"{k} tokens sent of max_tokens {params.max_tokens}: nothing to continue")
    prompt = job.prompt + tuple(sent)
    max_tokens = params.max_tokens - k
    min_tokens = max(0, params.min_tokens - k)
    return replace(
        job, prompt=prompt, params=replace(params, max_tokens=max_tokens, min_tokens=min_tokens, resumed_tokens=k),
        block_hashes=tuple(extended_block_hashes(job.block_hashes, prompt, block_size, params.cache_salt)),
    )


def rebase(update: Update, original: Job, progress: Progress) -> Update:
    """A continuation's update as the uninterrupted run's: on the final one, the
    cumulative logprob includes the tokens sent before, and cached tokens and prompt
    logprobs are the original prompt's. Any other update is the same."""
    if update.end is None:
        return update
    update = update.counting(progress.bases())
    end = update.end
    return replace(update, end=replace(end, num_cached_tokens=min(end.num_cached_tokens, len(original.prompt)),
                                       prompt_logprobs=end.prompt_logprobs[:len(original.prompt)]))
