"""A request's engine events as DecodeResponse messages.

Each message carries every event available at that moment (one engine step's worth,
usually): per sequence, the tokens since the last message. The last message has
`finished` and one result per sequence; a result's token_ids are that sequence's
tokens not already sent as deltas (all of them for beam search, which streams
nothing, since beams reorder until the end).

A token given to the request rather than sampled here (the engine's TokenDelta with
no logprob: the prefill worker's first token, which arrived with the KV's final
frame, or the router's `first_token` after a lost transfer) is not streamed: the
router forwarded it from the prefill worker at once (TTFT) and adds its logprob to
the sequence's cumulative logprob, which counts only tokens sampled here. It counts
as sent, so no result repeats it.

    engine events:  t1 (given, logprob None)  t2  t3 ... tn  Finished
    messages:       deltas [t2 t3 ...] ... [... tn]  results (tail after tn: none)
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from pdserve.engine.outputs import RequestOutput
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import delta_logprob, prompt_logprobs
from pdserve.services.common.deadline import Deadline
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.events import FailedEvent, FinishedEvent, RequestStream, TokenEvent
from pdserve.services.worker.rpc import POLL, abort_failed


class DecodeStream:
    """Turns one request's events into messages; `sent[i]` tokens of sequence i so far."""

    def __init__(self, stream: RequestStream) -> None:
        self.stream = stream
        self.sent: dict[int, int] = {}
        self.finished = False  # the last message has been yielded

    def messages(
        self, loop: EngineLoop, context: grpc.ServicerContext, deadline: Deadline
    ) -> Iterator[pb.DecodeResponse]:
        """Yield messages until the request ends; abort it on the engine when the
        caller goes away or the deadline passes (its blocks are freed either way)."""
        rid = self.stream.request_id
        while True:
            if not context.is_active():
                loop.abort(rid)
                return
            if deadline.expired():
                loop.abort(rid)
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid!r}: deadline passed")
            events = self.stream.get(deadline.wait_step(POLL))
            if not events:
                continue
            message, failed = self._pack(events)
            self.finished = message.finished
            if message.deltas or message.finished:
                yield message
            if failed is not None:
                abort_failed(context, rid, failed.failure, failed.message)
            if message.finished:
                return

    def _pack(self, events: list) -> tuple[pb.DecodeResponse, FailedEvent | None]:
        message = pb.DecodeResponse()
        deltas: dict[int, pb.SequenceDelta] = {}
        for event in events:
            if isinstance(event, TokenEvent):
                d = event.delta
                self.sent[d.index] = self.sent.get(d.index, 0) + 1
                given = d.logprob is None  # not sampled here: the router has it (module docstring)
                if given and not d.finish_reason:
                    continue
                seq = deltas.get(d.index)
                if seq is None:
                    seq = deltas[d.index] = message.deltas.add(index=d.index)
                if d.finish_reason:
                    seq.finish_reason = d.finish_reason
                if given:
                    continue
                seq.token_ids.append(d.token_id)
                seq.token_logprobs.append(d.logprob)
                logprob = delta_logprob(d)
                if logprob is not None:
                    seq.logprobs.append(logprob)
            elif isinstance(event, FinishedEvent):
                self._finish(message, event.output)
            elif isinstance(event, FailedEvent):
                return message, event
        return message, None

    def _finish(self, message: pb.DecodeResponse, output: RequestOutput) -> None:
        message.finished = True
        message.num_cached_tokens = output.num_cached_tokens
        message.num_draft_tokens = output.num_draft_tokens
        message.num_accepted_tokens = output.num_accepted_tokens
        for completion in output.outputs:
            tail = completion.token_ids[self.sent.get(completion.index, 0):]
            message.results.add(
                index=completion.index, token_ids=tail, finish_reason=completion.finish_reason or "",
                cumulative_logprob=completion.cumulative_logprob or 0.0,
            )
        if output.prompt_logprobs is not None:
            message.prompt_logprobs.extend(prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs))
