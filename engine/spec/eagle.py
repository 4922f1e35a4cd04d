"""The EAGLE proposer: a draft head (eagle_head.py) over the target's own hidden states.

The target's forward pass keeps, for every sequence that may speculate, each computed
position's feature (model FeatureCapture: the same pass that scores the tokens, no
second one); `observe` hands them here. The head keeps its own small paged KV cache,
one `HeadSeq` per sequence:

    target tokens   t0 t1 ... t(N-1)                     (N tokens: prompt + output)
    features        f0 f1 ... f(N-2)                     (t(N-1) was just sampled)
    head KV         base ............ base+fed-1          rows fed the target's features
    catch-up        rows p = base+fed .. N-2: (t[p+1], f[p]) -> the head's KV; the last
                    row's output drafts d0 (the guess of t[N])
    draft j >= 1    row N-2+j: (d[j-1], the head's own output of the row before) -> dj

The draft rows' KV is never kept: `fed` stops at N-2, so a rejected draft is rolled
back by being written over. A feature at position p is the target's only while every
token up to p is the sequence's own: features at p >= N-1 (a rejected draft's) are
never read, and a position computed again (preemption, a verification) replaces its
feature. A sequence whose features do not reach back to where the head's KV ends
starts a fresh head KV at its first contiguous feature: its early drafts see less
context (they guess worse), its tokens do not change. The head's position p sits at
its KV's row p - base; RoPE turns on p itself, so attention is as with the full
context shifted, which RoPE does not see.

A prompt (P tokens) is taken in as its features arrive, chunk by chunk (`prime`):
rows p <= P-2, whose next token the prompt already holds, so the target's features
are not kept for long prompts. What is left at the prompt's end is the DraftState
(draft_state.py): the head's KV of rows base .. P-2 and the feature at P-1. A
prefill worker ships it with the prompt's KV (`export`); the decode worker takes it
in (`adopt`) and drafts from the first decoded token exactly as a local prefill
would (the same rows, computed in the same passes). A sample forked off a prompt
(n > 1) gets a copy of its parent's head KV (`fork`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention.base import AttentionBackend
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.spec.draft_state import DraftLayout, DraftState
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.model.llama import FeatureCapture
from pdserve.engine.model_runner import attention_metadata
from pdserve.engine.request import Request
from pdserve.engine.spec.eagle_head import EagleHead


@dataclass(eq=False)
class HeadSeq:
    """The head's view of one sequence."""

    request_id: str
    base: int  # the first position in the head's KV
    fed: int = 0  # positions base .. base + fed - 1 hold KV from the target's features
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> the target's feature

    @property
    def num_computed_tokens(self) -> int:  # what KVCacheManager counts
        return self.fed


class EagleProposer:
    def __init__(self, head: EagleHead, backend: AttentionBackend, target_embed: Callable[[torch.Tensor], torch.Tensor],
                 target_logits: Callable[[torch.Tensor], torch.Tensor], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        cfg = head.spec.cfg
        self.head = head
        self.backend = backend
        self.embed = head.embed_tokens if head.embed_tokens is not None else target_embed
        self.target_logits = target_logits
        self.block_size = block_size
        self.device = device
        self.kv_cache = torch.zeros((num_blocks, 2, block_size, cfg.num_kv_heads, cfg.head_dim), dtype=dtype,
                                    device=device)
        self.kv = KVCacheManager(BlockPool(num_blocks, enable_caching=False), block_size)
        self._seqs: dict[str, HeadSeq] = {}
        self._features: dict[str, dict[int, torch.Tensor]] = {}  # of sequences the head has not started

    def capture(self) -> FeatureCapture:
        """What the target's forward pass keeps for the head."""
        spec = self.head.spec
        return FeatureCapture(layers=spec.aux_layers) if spec.kind == "eagle3" else FeatureCapture(final=True)

    def observe(self, request_id: str, start: int, features: torch.Tensor) -> None:
        """The target computed positions start .. start + len(features) - 1 of a sequence."""
        seq = self._seqs.get(request_id)
        kept = seq.features if seq is not None else self._features.setdefault(request_id, {})
        for position in [p for p in kept if p >= start]:
            del kept[position]  # computed again (or a rejected draft's): the new one holds
        for i in range(features.shape[0]):
            kept[start + i] = features[i]

    @property
    def layout(self) -> DraftLayout:
        """What a DraftState of this head holds."""
        cfg = self.head.spec.cfg
        return DraftLayout(self.kv_cache.dtype, cfg.num_kv_heads, cfg.head_dim, self.head.spec.feature_size)

    def fork(self, parent_id: str, child_id: str) -> None:
        """A sample forked off the parent's prompt (the engine forks right after the
        prompt's prefill, before any proposal): a copy of the parent's head KV and the
        same features (shared tensors); without room for the copy, the features alone
        (its head starts at the first of them)."""
        seq = self._seqs.get(parent_id)
        if seq is None:
            self._features[child_id] = dict(self._features.get(parent_id, {}))
            return
        child = HeadSeq(child_id, seq.base, 0, dict(seq.features))
        if seq.fed and self.kv.allocate_slots(child, seq.fed):
            n = -(-seq.fed // self.block_size)
            src = torch.tensor(self.kv.block_ids(parent_id)[:n], device=self.device)
            dst = torch.tensor(self.kv.block_ids(child_id)[:n], device=self.device)
            self.kv_cache[dst] = self.kv_cache[src]
            child.fed = seq.fed
            self._seqs[child_id] = child
        else:
            self._features[child_id] = child.features

    def prime(self, requests: Sequence[Request]) -> None:
        """Feed the head the prompt rows whose features just arrived (rows p <= P-2:
        their next token is the prompt's), in one pass for all of `requests`."""
        rows: list[tuple[int, HeadSeq, list[int]]] = []
        for i, request in enumerate(requests):
            rid = request.request_id
            seq = self._seqs.get(rid)
            features = seq.features if seq is not None else self._features.get(rid, {})
            last = min(request.num_prompt_tokens - 2, max(features, default=-1))
            if last < 0 or last not in features or (seq is not None and seq.base + seq.fed > last):
                continue  # nothing of the prompt's is new (a decoding step, or a recomputation)
            seq = self._sync(request, last)
            if seq is None:
                continue
            need = seq.base + seq.fed
            if need <= last and self.kv.allocate_slots(seq, last - need + 1):
                rows.append((i, seq, list(range(need, last + 1))))
        if rows:
            self._catch_up(requests, rows)
            for _, seq, _ in rows:
                self._trim(seq)

    def export(self, request: Request) -> DraftState | None:
        """The head's state at the end of `request`'s prompt, to ship (None without the
        target's feature at its last position)."""
        rid, last = request.request_id, request.num_prompt_tokens - 1
        seq = self._seqs.get(rid)
        features = seq.features if seq is not None else self._features.get(rid, {})
        feature = features.get(last)
        if feature is None:
            return None
        layout = self.layout
        if seq is None or seq.base + seq.fed != last:  # no head KV for the prompt: start at its end
            empty = torch.empty((0, 2, layout.num_kv_heads, layout.head_dim), dtype=layout.dtype)
            return DraftState(last, empty, feature.to("cpu", copy=True))
        n = -(-seq.fed // self.block_size)
        blocks = torch.tensor(self.kv.block_ids(rid)[:n], device=self.device)
        pages = self.kv_cache[blocks].transpose(1, 2)  # [n, block_size, 2, heads, dim]
        kv = pages.reshape(n * self.block_size, *pages.shape[2:])[: seq.fed]
        return DraftState(seq.base, kv.to("cpu").contiguous(), feature.to("cpu", copy=True))

    def adopt(self, request: Request, state: DraftState) -> None:
        """Take in a prompt's DraftState from the worker that prefilled it (ValueError
        if it does not fit this head); without room for its KV, start at the prompt's end."""
        rid, last = request.request_id, request.num_prompt_tokens - 1
        state.check(self.layout, request.num_prompt_tokens)
        self.release(rid)
        feature = state.feature.to(self.device)
        rows = state.kv.shape[0]
        seq = HeadSeq(rid, state.base, 0, {last: feature})
        if rows and self.kv.allocate_slots(seq, rows):
            n = -(-rows // self.block_size)
            pages = torch.zeros((n * self.block_size, *state.kv.shape[1:]), dtype=self.kv_cache.dtype,
                                device=self.device)
            pages[:rows] = state.kv.to(self.device)
            blocks = torch.tensor(self.kv.block_ids(rid)[:n], device=self.device)
            self.kv_cache[blocks] = pages.view(n, self.block_size, *pages.shape[1:]).transpose(1, 2)
            seq.fed = rows
        elif rows:
            seq = HeadSeq(rid, last, 0, {last: feature})
        self._seqs[rid] = seq

    def propose(self, requests: Sequence[Request], ks: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[tuple[int, HeadSeq, list[int]]] = []  # (index, seq, the positions its catch-up feeds)
        for i, (request, k) in enumerate(zip(requests, ks)):
            seq = self._sync(request)
            if seq is None:
                continue
            last = request.num_tokens - 2
            need = seq.base + seq.fed
            if need > last:  # nothing new since the last proposal: feed the last row again
                seq.fed -= 1
                need -= 1
            if self.kv.allocate_slots(seq, (last - seq.base + 1) + (k - 1) - seq.fed):
                rows.append((i, seq, list(range(need, last + 1))))
        if not rows:
            return drafts
        outs = self._catch_up(requests, rows)
        live = [(i, seq, out) for (i, seq, _), out in zip(rows, outs)]
        for step in range(max(ks[i] for i, _, _ in live)):
            live = [(i, seq, out) for i, seq, out in live if ks[i] > step]
            if step:
                outs = self._draft_step(requests, live, step, [drafts[i][-1] for i, _, _ in live])
                live = [(i, seq, out) for (i, seq, _), out in zip(live, outs)]
            tokens = self.head.draft_tokens(torch.stack([out for _, _, out in live]), self.target_logits).tolist()
            for (i, _, _), token in zip(live, tokens):
                drafts[i].append(int(token))
        for _, seq, _ in rows:
            self._trim(seq)
        return drafts

    @staticmethod
    def _trim(seq: HeadSeq) -> None:
        """Drop the features the head's KV has taken in."""
        for position in [p for p in seq.features if p < seq.base + seq.fed - 1]:
            del seq.features[position]  # the last one stays: a proposal may feed it again
        for position, feature in seq.features.items():  # a row of a whole step's features
            if feature._base is not None:  # must not keep them all alive (once: a clone has none)
                seq.features[position] = feature.clone()

    def _sync(self, request: Request, last: int | None = None) -> HeadSeq | None:
        """The head's view of `request` up to row `last` (default N-2): its KV kept while
        the features reach back to it, else started afresh at the first of the
        contiguous features ending at `last`."""
        rid = request.request_id
        last = request.num_tokens - 2 if last is None else last
        seq = self._seqs.get(rid)
        features = seq.features if seq is not None else self._features.get(rid, {})
        if last < 0 or last not in features:
            return None
        first = last
        while first - 1 in features:
            first -= 1
        if seq is not None and first <= seq.base + seq.fed:  # the features reach back to its KV
            seq.fed = min(seq.fed, last + 1 - seq.base)
            return seq
        if seq is not None:
            self.kv.free(rid)
        seq = self._seqs[rid] = HeadSeq(rid, first, 0, features)
        self._features.pop(rid, None)
        return seq

    @torch.inference_mode()
    def _catch_up(self, requests: Sequence[Request], rows: list[tuple[int, HeadSeq, list[int]]]) -> list[torch.Tensor]:
        """Feed each sequence's new rows (the target's features); each one's last output."""
        tokens, features, positions, items = [], [], [], []
        for i, seq, fed in rows:
            ids = requests[i].token_ids
            tokens += [ids[p + 1] for p in fed]
            features += [seq.features[p] for p in fed]
            positions += fed
            items.append((seq, fed[0] - seq.base, len(fed)))
        out = self._forward(tokens, torch.stack(features), True, positions, items)
        ends = torch.tensor([len(fed) for _, _, fed in rows]).cumsum(0) - 1
        for _, seq, fed in rows:
            seq.fed = fed[-1] + 1 - seq.base
        return list(out[ends.to(out.device)])

    @torch.inference_mode()
    def _draft_step(self, requests: Sequence[Request], live: list[tuple[int, HeadSeq, torch.Tensor]], step: int,
                    tokens: list[int]) -> list[torch.Tensor]:
        """One row per sequence: the draft before, the head's own output before."""
        positions = [requests[i].num_tokens - 2 + step for i, _, _ in live]
        items = [(seq, p - seq.base, 1) for (_, seq, _), p in zip(live, positions)]
        out = self._forward(tokens, torch.stack([o for _, _, o in live]), False, positions, items)
        return list(out)

    def _forward(self, tokens: list[int], hidden: torch.Tensor, from_target: bool, positions: list[int],
                 items: list[tuple[HeadSeq, int, int]]) -> torch.Tensor:
        """The head over rows grouped by sequence: (seq, first local row, rows) each."""
        bs = self.block_size
        slots, q_lens, seq_lens, tables = [], [], [], []
        for seq, first, n in items:
            blocks = self.kv.block_ids(seq.request_id)
            slots += [blocks[r // bs] * bs + r % bs for r in range(first, first + n)]
            q_lens.append(n)
            seq_lens.append(first + n)
            tables.append(blocks)
        meta = attention_metadata(tables, slots, q_lens, seq_lens, bs, self.device)
        ids = torch.tensor(tokens, device=self.device)
        pos = torch.tensor(positions, device=self.device)
        embeds = self.embed(ids).to(hidden.dtype)
        return self.head(embeds, hidden, from_target, pos, self.kv_cache, meta, self.backend)

    def release(self, request_id: str) -> None:
        self._features.pop(request_id, None)
        if self._seqs.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def check_integrity(self, live: Collection[str]) -> None:
        """Its pool adds up, and it holds nothing for a sequence that has ended."""
        self.kv.check_integrity()
        if set(self.kv.req_blocks) - set(self._seqs):
            raise RuntimeError("eagle: blocks held for a sequence it does not know")
        stale = (set(self._seqs) | set(self._features)) - set(live)
        if stale:
            raise RuntimeError(f"eagle: state kept for ended sequences {sorted(stale)[:3]}")
