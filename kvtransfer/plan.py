"""The transfer plan: the one description of one request's KV transfer.

    decode worker                      router                       prefill worker
    DecodeConnector.expect -> plan --ReserveResponse.transfer_plan--> PrefillRequest
                                       (bytes, carried unread)        PrefillConnector.start

The decode worker makes it when it reserves blocks, the router carries its bytes
(`pack`, msgpack: no pickle) to the prefill worker it chose without reading them,
and the prefill worker follows it. Everything either side must agree on is here:
where the pages go, which blocks the decode worker already has, the page layout
(shape, dtype and what the bytes mean: the weights' quantization and an FP8 cache's
K/V scales, `PageLayout.kv_format`; a prefill worker whose own layout differs
refuses the plan, wire.LayoutMismatch), whether the prefill worker's first token is
used (engine.sampling_params `continues_from_first_token`), and the reservation's
one-time secret.

What is not here, on purpose: speculative decoding (--speculative-config). Only
decode workers speculate, and the pages a prefill worker ships are the target
model's prompt KV, the same with speculation on or off on either side (drafts and
rejected tokens never reach a prompt block). A draft model's KV is computed on the
decode worker from the prompt's tokens (engine/spec/draft_model.py), never shipped,
and n-gram drafting needs no KV. So a prefill and a decode worker with different
speculative configs (a prefill worker ignores its own) make the same KV, and the
pair is not checked for it; a shipped draft KV would have to join the layout here.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from pdserve.kvtransfer.wire import PageLayout, check_secret


@dataclass(frozen=True)
class TransferPlan:
    """Where a prefill worker ships one request's KV, and how.

    `skip_blocks` leading prompt blocks are already on the decode worker (its prefix
    cache; `cached_block_hashes` are their chained hashes, which the prefill side
    checks against its own); only blocks from there on cross the wire. `block_ids`
    are the decode worker's reserved blocks, a hint that lets the sender make runs
    contiguous on both ends (the receiver never trusts them).

    `sample_first_token`: the prefill worker's first token is sent with the final
    message and used (True), or the decode worker recomputes the last prompt token
    and samples itself (False).

    `secret` is the reservation's one-time secret (wire.py): whoever holds the plan
    can fill the reservation, so it travels only over the cluster's authenticated
    channels, from the decode worker through the router to the one prefill worker the
    router chose.
    """

    request_id: str
    endpoint: str
    transport: str  # "zmq" or "torch": the sender must speak it
    layout: PageLayout
    num_tokens: int
    skip_blocks: int
    cached_block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    secret: bytes  # proves the sender to the receiver; required (see validate)
    server_key: bytes | None = None  # the receiver's CURVE public key
    sample_first_token: bool = True

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)

    def pack(self) -> bytes:
        return msgpack.packb({
            "rid": self.request_id, "endpoint": self.endpoint, "transport": self.transport,
            "layout": self.layout.to_wire(), "num_tokens": self.num_tokens, "skip": self.skip_blocks,
            "hashes": list(self.cached_block_hashes), "block_ids": list(self.block_ids),
            "server_key": self.server_key, "sample_first": self.sample_first_token, "secret": self.secret,
        }, use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> "TransferPlan":
        """The plan `pack` made; ValueError (naming the plan) when malformed."""
        try:
            d = msgpack.unpackb(raw, raw=False)
            plan = cls(
                d["rid"], d["endpoint"], d["transport"], PageLayout.from_wire(d["layout"]), d["num_tokens"],
                d["skip"], tuple(d["hashes"]), tuple(d["block_ids"]), d["secret"], d["server_key"], d["sample_first"],
            )
        except Exception as exc:
            raise ValueError(f"transfer_plan: malformed ({exc})") from None
        plan.validate()
        return plan

    def validate(self) -> None:
        if not isinstance(self.request_id, str) or not isinstance(self.endpoint, str) or not self.endpoint:
            raise ValueError("transfer_plan: request_id and endpoint must be strings, endpoint not empty")
        ints = [self.num_tokens, self.skip_blocks, *self.block_ids]
        if any(isinstance(v, bool) or not isinstance(v, int) for v in ints) or self.num_tokens < 1:
            raise ValueError("transfer_plan: num_tokens, skip_blocks, block_ids must be ints")
        if not isinstance(self.sample_first_token, bool):
            raise ValueError("transfer_plan: sample_first_token must be a bool")
        if not 0 <= self.skip_blocks < self.num_blocks or len(self.cached_block_hashes) != self.skip_blocks:
            raise ValueError(f"skip_blocks: {self.skip_blocks} with {len(self.cached_block_hashes)} hashes for "
                             f"{self.num_blocks} blocks")
        if self.block_ids and len(self.block_ids) != self.num_blocks:
            raise ValueError(f"block_ids: {len(self.block_ids)} ids for {self.num_blocks} blocks")
        check_secret(self.secret, "transfer_plan: secret")
