"""A decode worker's messages (services/decode/stream.py), without a server: a first
token given to the request (the prefill worker's) is counted, never streamed again."""

from __future__ import annotations

from pdserve.engine.engine import TokenDelta
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.services.decode.stream import DecodeStream
from pdserve.services.worker.events import FinishedEvent, RequestStream, TokenEvent


def token(token_id: int, logprob: float | None, finish: str | None = None, top: dict | None = None) -> TokenEvent:
    return TokenEvent(TokenDelta("r", 0, token_id, logprob, top, finish))


def finished(token_ids: list[int], cumulative: float, reason: str = "length") -> FinishedEvent:
    return FinishedEvent(RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, token_ids, "", reason, cumulative)],
                                       finished=True))


def test_a_given_first_token_is_counted_not_streamed():
    """The engine tells the applied first token with no logprob (not sampled here):
    the messages carry only the tokens sampled here, and no result repeats it."""
    stream = DecodeStream(RequestStream("r"))
    first, _ = stream._pack([token(7, None), token(8, -0.5, top={8: -0.5, 9: -1.0})])
    assert [list(d.token_ids) for d in first.deltas] == [[8]]
    assert list(first.deltas[0].token_logprobs) == [-0.5] and [e.token_id for e in first.deltas[0].logprobs] == [8]
    last, _ = stream._pack([token(9, -0.25, "length"), finished([7, 8, 9], -0.75)])
    assert [list(d.token_ids) for d in last.deltas] == [[9]] and last.deltas[0].finish_reason == "length"
    (result,) = last.results
    assert list(result.token_ids) == [] and result.cumulative_logprob == -0.75  # the engine's: 8 and 9 only


def test_a_given_first_token_that_ends_the_request_sends_only_the_end():
    stream = DecodeStream(RequestStream("r"))
    message, _ = stream._pack([token(7, None, "length"), finished([7], 0.0)])
    assert [(list(d.token_ids), d.finish_reason) for d in message.deltas] == [([], "length")]
    assert message.finished and list(message.results[0].token_ids) == []


def test_a_given_token_alone_makes_no_delta():
    message, _ = DecodeStream(RequestStream("r"))._pack([token(7, None)])
    assert not message.deltas and not message.finished


def test_sampled_tokens_stream_as_before():
    stream = DecodeStream(RequestStream("r"))
    message, _ = stream._pack([token(5, -0.1), token(6, -0.2, "stop"), finished([5, 6], -0.3, "stop")])
    assert list(message.deltas[0].token_ids) == [5, 6] and list(message.deltas[0].token_logprobs) == [-0.1, -0.2]
    assert not message.deltas[0].logprobs  # not asked
    assert message.finished and list(message.results[0].token_ids) == []
