"""Between the front end's records (records.py) and pdserve.v1 messages.

    pb.GenerateRequest        -> Request           request_of     (the gRPC adapter)
    SequenceOutput            -> pb.GenerateResponse response_of  (the gRPC adapter)
    pb.TokenLogprob (workers) -> TokenLogprob        logprob_of   (response building)

Sampling crosses in services/common/convert.py (pb.SamplingOptions <-> the engine's
SamplingParams, the one sampling type inside the router). No policy here: the
validator checks what the engine's SamplingParams does not.
"""

from __future__ import annotations

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import params_from_options
from pdserve.services.common.deadline import Deadline
from pdserve.services.router.records import Request, Resume, ResumedSequence, SequenceOutput, TokenLogprob


def request_of(request: pb.GenerateRequest, authorization: str = "", deadline: Deadline | None = None) -> Request:
    """A Generate call's request, as the front end takes it. Raises ValueError naming
    a sampling field the engine's SamplingParams refuses (the adapter hands it to
    FrontEnd.refuse)."""
    which = request.WhichOneof("prompt")
    return Request(
        text=request.text if which == "text" else None,
        token_ids=tuple(request.token_ids.ids) if which == "token_ids" else None,
        sampling=params_from_options(request.sampling), model=request.model, request_id=request.request_id,
        cache_salt=request.cache_salt, authorization=authorization, deadline=deadline,
        resumable=request.resumable, resume=resume_of(request.resume) if request.HasField("resume") else None,
    )


def resume_of(resume: pb.Resume) -> Resume:
    return Resume(resume.token, tuple(
        ResumedSequence(s.index, tuple(s.token_ids), s.logprob_sum, s.finish_reason or None)
        for s in resume.sequences))


def logprob_of(entry: pb.TokenLogprob | pb.PromptTokenLogprob) -> TokenLogprob:
    """A worker's logprob entry (generated or prompt token)."""
    present = not isinstance(entry, pb.PromptTokenLogprob) or entry.HasField("logprob")
    return TokenLogprob(entry.token_id, entry.logprob if present else None,
                        tuple((t.token_id, t.logprob) for t in entry.top))


def _top(entry: TokenLogprob) -> list[pb.TopLogprob]:
    return [pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top]


def response_of(output: SequenceOutput, request_id: str) -> pb.GenerateResponse:
    """A Generate message (a None logprob leaves its field unset: a prompt's first token)."""
    message = pb.GenerateResponse(
        request_id=request_id, index=output.index, text=output.text, token_ids=output.token_ids,
        logprobs=[pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob, top=_top(e)) for e in output.logprobs],
        finish_reason=output.finish_reason or "",
        prompt_logprobs=[pb.PromptTokenLogprob(token_id=e.token_id, logprob=e.logprob, top=_top(e))
                         for e in output.prompt_logprobs],
    )
    if output.usage is not None:
        u = output.usage
        message.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                        cached_tokens=u.cached_tokens, num_draft_tokens=u.num_draft_tokens,
                                        num_accepted_tokens=u.num_accepted_tokens))
    if output.timing is not None:
        t = output.timing
        message.timing.CopyFrom(pb.Timing(ttft_seconds=t.ttft_seconds, tpot_seconds=t.tpot_seconds,
                                          e2e_seconds=t.e2e_seconds))
    if output.cumulative_logprob is not None:
        message.cumulative_logprob = output.cumulative_logprob
    state = output.resume_state
    if state is not None:
        message.resume_state.CopyFrom(pb.ResumeState(token=state.token, logprob_sum=state.logprob_sum,
                                                     finish_reason=state.finish_reason or ""))
    return message
