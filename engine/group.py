"""A user request and the sequences generated for it (1, n samples, or k beams)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.beam import BeamSearch
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
