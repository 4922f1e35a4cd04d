"""The disaggregation hooks: where a prefill worker and a decode worker meet the engine.

    prefill side                                decode side
    add_request(export_kv=True)                 reserve_remote -> Reservation (blocks)
    layer_hook(layer, [ExportSlice]) per layer    ... pages land in the blocks ...
      (engine/export.py)
    finished: blocks held until release()       commit_remote -> decoding starts
      held_draft: an EAGLE head's DraftState      (with the DraftState: the head goes on
      (shipped with the final message)             where the prefill worker's stopped)

Held blocks (prefill) and reservations (decode) only change through calls: their
owner (services/worker) keeps the deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.errors import NoCapacityError
from pdserve.engine.spec.draft_state import DraftState
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.request import RequestStatus
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.core import EngineCore


@dataclass(frozen=True)
class Reservation:
    """Decode side: where a prompt's KV must land, and how much of it is already here."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int  # prompt tokens whose KV this worker already holds (whole blocks)
    block_hashes: tuple[bytes, ...] = ()  # the prompt's full blocks' (engine/hashing.py), computed once


class RemoteKV:
    """The engine's calls for KV computed elsewhere (decode) or shipped elsewhere (prefill)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_hashes: Sequence[bytes] = (),
    ) -> Reservation:
        core = self.core
        request = core.new_group(request_id, prompt_token_ids, params, block_hashes)
        hits, num_hit = core.kv.get_computed_blocks(request)
        if not core.kv.allocate_slots(request, request.num_tokens - num_hit, hits):
            core.drop_group(request_id)
            raise NoCapacityError(f"kv cache: no room for {request.num_tokens} tokens of {request_id!r}")
        core.kv.record_lookup(request, num_hit)
        request.num_cached_tokens = num_hit
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        return Reservation(request_id, core.kv.block_ids(request_id), num_hit, tuple(request.block_hashes))

    def commit(self, request_id: str, first_token: int | None, draft: DraftState | None = None) -> list[RequestOutput]:
        core = self.core
        group = core.groups.get(request_id)
        if group is None or group.live[0].status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise ValueError(f"request_id: {request_id!r} has no reservation waiting for KV")
        request = group.live[0]
        request.kv_committed_time = request.first_scheduled_time = time.monotonic()

        def start(finished: list[RequestOutput]) -> None:
            request.num_computed_tokens = request.num_prompt_tokens - (first_token is None)
            if draft is not None and core.speculator is not None:
                core.speculator.adopt(request, draft)  # before the first token: a fork copies it
            core.kv.cache_full_blocks(request)
            core.scheduler.adopt(request)
            if first_token is not None:
                core.apply_token(group, request, first_token, None, None, finished)

        finished: list[RequestOutput] = []
        # A constrained request whose grammar is still compiling starts once it has: the
        # first token enters its matcher first (the KV stays in its reserved blocks).
        core.when_ready(group, start, finished)
        return finished

    def release(self, request_id: str) -> None:
        self.core.held_drafts.pop(request_id, None)
        if self.core.held.pop(request_id, None) is not None:
            self.core.kv.free(request_id)

    def held_block_ids(self, request_id: str) -> list[int]:
        if request_id not in self.core.held:
            raise ValueError(f"request_id: {request_id!r} holds no exported blocks")
        return self.core.kv.block_ids(request_id)

    def held_draft(self, request_id: str) -> DraftState | None:
        """Prefill side: the EAGLE head's state at the end of a held prompt (None: no
        head, or it has none to give); shipped with the final message."""
        return self.core.held_drafts.get(request_id)
