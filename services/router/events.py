"""The router's own record of what a decode worker said: typed, frozen events.

    worker (gRPC)                    router
    -------------                    ------
    pb.DecodeResponse  --update_of-->  Update(tokens=(Tokens, ...), end=Finished | None)
    pb.PrefillResponse --first_of--->  Update(tokens=(Tokens(0, (first,)),))
                                         |  dispatch: forwarded as they come      (dispatch.py)
                                         |  migration: Progress.record, rebase   (migration.py)
                                         |  stop strings: StopWatch.cut          (stops.py)
                                         |  n > 1 migrated: Update.as_sample    (fan_out.py)
                                         v
                                       ResponseBuilder.messages (responses.py) -> SequenceOutput

A worker's message is converted once, where it arrives; nothing after that edge
touches a protobuf message. An operation that changes what the client is told (a
continuation's cumulative logprob, a stop string the worker could not see) builds a
new event: events are never mutated.

One `Update` is one worker message: per sequence, the tokens since the last one,
and on the last, `end` (every sequence's result and the request's counts). The
decode worker streams only tokens it sampled: a first token it was given (the
prefill worker's, which the router forwarded at once) is neither streamed again nor
counted in the cumulative logprob it reports (services/decode/stream.py), so the
router adds that token's logprob (`Update.counting`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.pb_records import logprob_of
from pdserve.services.router.records import TokenLogprob


@dataclass(frozen=True)
class Tokens:
    """Sequence `index`'s tokens since its previous event."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when asked
    # each token's logprob as its worker counts it in the cumulative logprob (0 for a
    # token it did not sample), asked or not: what a migration adds to a continuation's
    token_logprobs: tuple[float, ...] = ()
    finish_reason: str | None = None  # these tokens ended the sequence

    def cut_after(self, i: int) -> Tokens:
        """The first i + 1 tokens, ending the sequence there ("stop")."""
        return replace(self, token_ids=self.token_ids[:i + 1], logprobs=self.logprobs[:i + 1],
                       token_logprobs=self.token_logprobs[:i + 1], finish_reason="stop")


@dataclass(frozen=True)
class Result:
    """How sequence `index` ended: its tokens not already streamed (all of a beam's:
    beams stream nothing), its reason, its cumulative logprob."""

    index: int
    finish_reason: str
    cumulative_logprob: float = 0.0
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Finished:
    """The request's end: every sequence's result (by index) and the request's counts."""

    results: tuple[Result, ...] = ()
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    num_draft_tokens: int = 0  # speculative decoding over every sequence
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class Update:
    """What one worker message said (or one the router says in its place)."""

    tokens: tuple[Tokens, ...] = ()
    end: Finished | None = None

    @property
    def finished(self) -> bool:
        return self.end is not None

    @property
    def has_tokens(self) -> bool:
        return any(t.token_ids for t in self.tokens) or (
            self.end is not None and any(r.token_ids for r in self.end.results))

    def counting(self, before: Mapping[int, float]) -> Update:
        """The final update with each sequence's cumulative logprob counting `before[i]`,
        the logprobs of its tokens that its worker did not sample (added after the
        worker's own sum, in the order the numbers arrived)."""
        if self.end is None or not any(before.get(r.index) for r in self.end.results):
            return self
        results = tuple(replace(r, cumulative_logprob=r.cumulative_logprob + before[r.index])
                        if before.get(r.index) else r for r in self.end.results)
        return replace(self, end=replace(self.end, results=results))

    def as_sample(self, index: int) -> Update:
        """A migrated sample's update (its sequence is 0) as sequence `index`'s."""
        tokens = tuple(replace(t, index=index) for t in self.tokens)
        end = None if self.end is None else replace(
            self.end, results=tuple(replace(r, index=index) for r in self.end.results if r.index == 0))
        return Update(tokens, end)


def update_of(message: pb.DecodeResponse) -> Update:
    """A decode worker's message, as the router's event (the one conversion)."""
    tokens = tuple(Tokens(d.index, tuple(d.token_ids), tuple(logprob_of(e) for e in d.logprobs),
                          tuple(d.token_logprobs), d.finish_reason or None) for d in message.deltas)
    if not message.finished:
        return Update(tokens)
    return Update(tokens, Finished(
        results=tuple(Result(r.index, r.finish_reason, r.cumulative_logprob, tuple(r.token_ids))
                      for r in message.results),
        num_cached_tokens=message.num_cached_tokens,
        prompt_logprobs=tuple(logprob_of(e) for e in message.prompt_logprobs),
        num_draft_tokens=message.num_draft_tokens, num_accepted_tokens=message.num_accepted_tokens,
    ))


def first_of(first: pb.TokenLogprob, with_logprobs: bool) -> Update:
    """The prefill worker's first token as sequence 0's first update (its top logprobs
    when the request asked for logprobs)."""
    logprobs = (logprob_of(first),) if with_logprobs else ()
    return Update((Tokens(0, (first.token_id,), logprobs, (first.logprob,)),))

