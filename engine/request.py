"""The one data type that flows through the engine: a request and its tokens."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.hashing import ROOT_HASH, BlockHash, block_extra_keys, hash_block
from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Decode role: blocks reserved, pages arriving from a prefill worker.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    """A sequence being generated.

    Invariant: `num_computed_tokens <= num_tokens`; the KV of tokens
    [0, num_computed_tokens) is in this request's blocks. `block_hashes[i]` is the
    chained hash of full block i of `token_ids` (kept up to date as tokens append).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_size: int
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # When (time.monotonic) it was first scheduled, sampled its first token, and had
    # its prompt's KV committed from a prefill worker (decode role); forks inherit them.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    kv_committed_time: float | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Prefill role: keep the blocks after finishing, until the KV has been shipped.
    export_kv: bool = False
    # Which of a request's parallel samples this sequence is (seeds its noise).
    sample_index: int = 0
    # The request this sequence belongs to (its own id unless it is a fork).
    group_id: str = ""
    # Scheduling order, lowest first: (its group's arrival number, its own number).
    priority: tuple[int, int] = (0, 0)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    # Speculative decoding: this step's draft tokens, scored after `token_ids` in one
    # pass (never part of `token_ids`, never hashed: only what verification accepts is
    # appended), and this sequence's drafted / accepted counts so far.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        self.token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._extend_hashes()

    def fork(self, request_id: str, sample_index: int) -> "Request":
        """A copy sharing this sequence's history (its blocks are forked separately)."""
        child = Request(
            request_id, self.prompt_token_ids, self.sampling_params, self.block_size,
            eos_token_ids=self.eos_token_ids, arrival_time=self.arrival_time,
            sample_index=sample_index, group_id=self.group_id, priority=self.priority,
        )
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        child.text = self.text
        child.first_scheduled_time = self.first_scheduled_time
        child.first_token_time = self.first_token_time
        child.kv_committed_time = self.kv_committed_time
        return child

    def check_stop(self) -> RequestStatus | None:
        """The finished status this request has reached, if any."""
        params = self.sampling_params
        last = self.token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _extend_hashes(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            salt = block_extra_keys(i, self.sampling_params.cache_salt)
            self.block_hashes.append(hash_block(parent, self.token_ids[i * bs : (i + 1) * bs], salt))
