"""A user request and the sequences generated for it (1, n samples, or k beams)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.beam import BeamSearch, Hypothesis
from pdserve.engine.errors import FailureKind
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class SequenceGroup:
    """Invariants: every live sequence is in the scheduler; `finished` only holds
    sequences whose blocks are already freed; for beam search, `pending` holds the
    log-probs of beams that have stepped while their siblings have not."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    live: list[Request]
    finished: list[Request] = field(default_factory=list)
    beam: BeamSearch | None = None
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    fanned_out: bool = False
    next_child: int = 1
    # One entry per prompt token (None for the first), shared by every sequence of
    # the group (they have the same prompt), when prompt_logprobs is asked.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beam search cut short (aborted, failed): the n best of finished and running beams,
    # each with whether it had finished; taken before the beams are freed.
    beams_at_abort: list[tuple[Hypothesis, bool]] | None = None
    error: str | None = None  # why the request failed, when it did
    failure: FailureKind | None = None  # how (set with error)

    @property
    def needs_fan_out(self) -> bool:
        return self.params.n > 1 and self.beam is None and not self.fanned_out

    def child_id(self) -> str:
        rid = f"{self.request_id}#{self.next_child}"
        self.next_child += 1
        return rid

    @property
    def done(self) -> bool:
        return not self.live

    @property
    def num_seqs_left(self) -> int:
        """Sequences this group may still run at once: its hold on max_num_seqs."""
        if self.done:
            return 0
        if self.beam is not None or not self.fanned_out:
            return self.params.num_seqs
        return len(self.live)
