"""Timing one prompt's KV through our transport, what bench.transfer.kvtransfer and the
quantization benchmark's engine pair (bench.quant.transfer) share.

    prefill engine --prefill_and_hold--> HeldPrompt (its blocks kept for the whole run)
    time_ours(sender, kv, held, plan): every layer's pages through a ZmqSender to a
        fresh reservation (`plan`), the final message, until the receiver's ack
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pdserve.engine import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.kvtransfer.connector import page_runs
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.wire import PageLayout, prompt_digest
from pdserve.kvtransfer.transports.zmq import ZmqSender

WAIT_S = 120.0  # for an ack, a raw receiver's answer


@dataclass
class HeldPrompt:
    """A prefilled prompt whose blocks the prefill engine keeps for the whole run."""

    prompt: list[int]
    block_ids: list[int]
    first_token: int
    nbytes: int


def prefill_and_hold(engine: LLMEngine, prompt: list[int]) -> HeldPrompt:
    engine.add_request("held", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), export_kv=True)
    first = None
    while engine.has_unfinished():
        for o in engine.step():
            first = o.outputs[0].token_ids[0]
    layout = PageLayout.of(engine.runner.kv_cache)
    blocks = engine.held_block_ids("held")
    return HeldPrompt(prompt, blocks, first, layout.num_layers * len(blocks) * layout.page_bytes)


def time_ours(sender: ZmqSender, kv: torch.Tensor, held: HeldPrompt, plan: TransferPlan) -> float:
    """Our transfer (the byte side alone) of the held pages to a fresh reservation, until the ack."""
    layout = PageLayout.of(kv)
    digest = prompt_digest(held.prompt)
    start = time.perf_counter()
    out = sender.open(plan.request_id, plan.endpoint, plan.server_key, secret=plan.secret)
    for layer in range(layout.num_layers):
        runs = page_runs(kv, layer, plan.skip_blocks, plan.num_blocks, held.block_ids, plan.block_ids)
        sender.send_pages(out, layer, runs, layout)
    sender.send_final(out, len(held.prompt), digest, [held.first_token])
    return _until_ack(sender, plan.request_id, start)


def _until_ack(sender: ZmqSender, rid: str, start: float) -> float:
    deadline = start + WAIT_S
    while time.perf_counter() < deadline:
        for ack in sender.poll(0.05):
            if ack.request_id == rid:
                if not ack.ok:
                    raise RuntimeError(f"transfer {rid} failed: {ack.reason}")
                return time.perf_counter() - start
    raise RuntimeError(f"no ack for {rid}")
