"""The draft-model proposer: a small model of the target's family drafts greedily.

It is run by the engine's own `ModelRunner`, over its own paged KV cache (its own
`BlockPool`, prefix caching off), one `DraftSeq` per sequence:

    target's tokens   t0 t1 ... t(n-1)                     (prompt + accepted output)
    draft's KV        <-- num_computed --><- catch up ->   computed up to the longest
                                                           common prefix with what it fed
    round 0           forward over the catch-up tokens      -> argmax: d0
    round j < k       forward over d(j-1) at position n+j-1 -> argmax: dj

After a verification the draft's KV stays valid exactly as far as its fed tokens agree
with the target's (`_sync` cuts `num_computed` back to that common prefix), so rejected
drafts are rolled back by being written over, and a preempted or forked sequence just
catches up on its next proposal. A sequence whose KV finds no room in the draft's pool
gets no drafts (never an error); its blocks are freed with `release` when it ends.

The draft's KV for a prompt is computed here, on the decode worker, not shipped from the
prefill worker: the draft is small (its catch-up over a prompt costs a fraction of the
target's prefill), and shipping it would tie the two workers' draft configs and the
wire format to each other for no measured gain (docs/benchmarks.md).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.model_runner import BatchItem, ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(eq=False)
class DraftSeq:
    """The draft model's view of one sequence: the tokens it fed, how many have KV."""

    request_id: str
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sampling_params: SamplingParams = _GREEDY

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def check_draft_model(target_dir: str | Path, target: ModelConfig, draft_dir: str | Path, draft: ModelConfig,
                      max_model_len: int) -> None:
    """Refuse a draft that cannot propose in the target's token space."""
    key = "speculative_config.model"
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{key}: the draft's vocab_size {draft.vocab_size} differs from the target's "
                         f"{target.vocab_size} ({draft_dir})")
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(f"{key}: the draft's max_position_embeddings {draft.max_position_embeddings} is below "
                         f"max_model_len {max_model_len} ({draft_dir})")
    mine, theirs = _vocabulary(Path(target_dir)), _vocabulary(Path(draft_dir))
    if (mine is None) != (theirs is None):
        which = "the target" if mine is not None else "the draft"
        raise ValueError(f"{key}: only {which} has a tokenizer.json, so the vocabularies cannot be compared "
                         f"({draft_dir})")
    if mine != theirs:
        raise ValueError(f"{key}: the draft's tokenizer vocabulary differs from the target's ({draft_dir})")


def _vocabulary(model_dir: Path) -> tuple[object, object] | None:
    """A tokenizer.json's token -> id map and added tokens, or None without one."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    model = data.get("model") or {}
    added = [(t.get("id"), t.get("content"), t.get("special")) for t in data.get("added_tokens") or []]
    return (model.get("type"), model.get("vocab")), added


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, num_blocks: int) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        runner.allocate_kv_cache(num_blocks)
        self.kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), runner.block_size)
        self._seqs: dict[str, DraftSeq] = {}

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, DraftSeq]] = []  # (index into requests, its draft view)
        for i, (request, k) in enumerate(zip(requests, ks)):
            seq = self._sync(request)
            if self.kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens + k - 1):
                live.append((i, seq))
        for step in range(max((ks[i] for i, _ in live), default=0)):
            live = [(i, seq) for i, seq in live if ks[i] > step]
            tokens = self._forward([seq for _, seq in live])
            for (i, seq), token in zip(live, tokens):
                drafts[i].append(token)
                seq.num_computed_tokens = seq.num_tokens
                seq.token_ids.append(token)
        return drafts

    def release(self, request_id: str) -> None:
        if self._seqs.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def _sync(self, request: Request) -> DraftSeq:
        """The draft's view of `request`, its KV cut back to what still matches."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            seq = self._seqs[request.request_id] = DraftSeq(request.request_id, request.num_prompt_tokens)
        target = request.token_ids
        same = 0
        for fed, token in zip(seq.token_ids[: seq.num_computed_tokens], target):
            if fed != token:
                break
            same += 1
        seq.num_computed_tokens = min(same, len(target) - 1)  # the last token is fed to get logits
        seq.token_ids = list(target)
        return seq

    @torch.inference_mode()
    def _forward(self, seqs: list[DraftSeq]) -> list[int]:
        """One pass computing each sequence's uncomputed tokens; its greedy next token."""
        batch = [BatchItem(s, s.num_tokens - s.num_computed_tokens, self.kv.block_ids(s.request_id)) for s in seqs]
        logits, _ = self.runner.execute(batch)
        return logits.argmax(dim=-1).tolist()

    def check_integrity(self, live: Collection[str]) -> None:
        """Its pool adds up, and it holds nothing for a sequence that has ended."""
        self.kv.check_integrity()
        if set(self.kv.req_blocks) - set(self._seqs):
            raise RuntimeError("draft model: blocks held for a sequence it does not know")
        if set(self._seqs) - set(live):
            raise RuntimeError("draft model: KV kept for an ended sequence")
