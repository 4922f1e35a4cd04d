"""KV tiers across P/D (issue 36): a decode worker's reservation counts blocks found in
any of its tiers as already present, so only the rest crosses the wire; a prefill
worker's lookups find its own host tier too. Both sides are what a worker's engine
thread runs (a RequestTable over an engine and a KVConnector on ZeroMQ tcp), in this
process, stepped by hand; tokens equal a tiers-off engine's and every block of every
tier is free at the end."""

from __future__ import annotations

import time

import pytest
import torch

from engine_helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from hf_models import build_model
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.kvtransfer.connector import KVConnector, Transport
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transports.zmq import ZmqReceiver, ZmqSender
from pdserve.services.worker.events import FailedEvent, FinishedEvent
from pdserve.services.worker.requests import RequestTable

BLOCK = 16
DEVICE_BLOCKS = 12  # holds about two of the prompts below: later ones evict the first
HOST_BYTES = 1 << 22
WAIT_S = 60.0


def engine(model_dir: str, tiers: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir, cache=CacheConfig(block_size=BLOCK, num_blocks=DEVICE_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512),
        kv_offload_host_bytes=HOST_BYTES if tiers else 0))


def table(eng: LLMEngine, sender=None, receiver=None) -> RequestTable:
    connector = KVConnector(Transport(sender, receiver), eng.runner.kv_cache, eng.model_config.vocab_size,
                            time.monotonic, None)
    connector.start()
    return RequestTable(eng, connector, clock=time.monotonic)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_of(length: int, salt: int) -> list[int]:
    return [3 + (salt * 31 + 7 * i) % 250 for i in range(length)]


class PD:
    """A prefill and a decode worker's tables, KV over ZeroMQ tcp."""

    def __init__(self, model_dir: str, prefill_tiers: bool, decode_tiers: bool) -> None:
        self.p_engine, self.d_engine = engine(model_dir, prefill_tiers), engine(model_dir, decode_tiers)
        self.receiver = ZmqReceiver(self.d_engine.runner.kv_cache, "tcp://127.0.0.1:0")
        self.sender = ZmqSender()
        self.prefill = table(self.p_engine, sender=self.sender)
        self.decode = table(self.d_engine, receiver=self.receiver)
        layout = self.prefill.connector.prefill.layout
        self.per_block = layout.num_layers * layout.page_bytes

    def run(self, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], TransferPlan, int]:
        """One request through P then D: its tokens, its plan, the KV bytes that crossed."""
        sent = self.sender.counters["bytes"]
        _, packed = self.decode.reserve(rid, prompt, greedy(max_tokens), lease=30.0)
        stream = self.decode.attach(rid)
        plan = TransferPlan.unpack(packed)
        self.prefill.submit(rid, prompt, greedy(1), plan=plan)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.prefill.advance()
            self.decode.advance()
            for event in stream.get(0):
                if isinstance(event, FailedEvent):
                    raise AssertionError(f"{rid} failed: {event.message}")
                if isinstance(event, FinishedEvent):
                    self.settle()
                    return list(event.output.outputs[0].token_ids), plan, self.sender.counters["bytes"] - sent
            time.sleep(0.001)
        raise TimeoutError(rid)

    def settle(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while (self.prefill.live() or self.decode.live()) and time.monotonic() < deadline:
            self.prefill.advance()
            self.decode.advance()
            time.sleep(0.001)
        for eng in (self.p_engine, self.d_engine):
            if eng.offload is not None:
                assert eng.offload.flush(30)  # the copies down are done: what is evicted next is in the host tier

    def check_free(self) -> None:
        for eng in (self.p_engine, self.d_engine):
            eng.check_integrity()
            stats = eng.stats()
            assert stats.num_free_blocks == stats.num_blocks
            if eng.offload is not None:
                eng.offload.check_integrity(idle=True)

    def close(self) -> None:
        for t in (self.prefill, self.decode):
            t.close()
            t.connector.close()
        self.p_engine.close()
        self.d_engine.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiers-pd")
    build_model(path, "llama", seed=7)
    return str(path)


A = prompt_of(70, salt=1)  # 4 full blocks + 6 tokens
OTHERS = [prompt_of(70, salt=s) for s in (2, 3, 5)]  # evict all of A's blocks from a 12-block pool
A2 = A[:64] + prompt_of(6, salt=4)  # A's first 4 blocks, another tail


def reference(model_dir: str) -> dict[str, list[int]]:
    """Every prompt's tokens from one engine without tiers and with a pool that never evicts."""
    eng = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(block_size=BLOCK, num_blocks=64)))
    out = {}
    for rid, prompt in (("a", A), *zip(("b", "c", "d"), OTHERS), ("a2", A2)):
        eng.add_request(rid, prompt, greedy(5))
        while eng.has_unfinished():
            for o in eng.step():
                out[rid] = list(o.outputs[0].token_ids)
    return out


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_blocks_in_a_host_tier_are_not_shipped_or_not_recomputed(model_dir: str, side: str):
    """decode: D's reservation finds A's first 4 blocks in its host tier (evicted from
    its pool by three other prompts): only the fifth crosses the wire. prefill: P finds
    them in its host tier: it copies them up instead of computing them, and ships all
    five (D has no tiers). Tokens equal a tiers-off engine's either way."""
    expected = reference(model_dir)
    pd = PD(model_dir, prefill_tiers=side == "prefill", decode_tiers=side == "decode")
    try:
        tokens, plan, sent = pd.run("a", A, 5)
        assert tokens == expected["a"] and plan.skip_blocks == 0 and sent == 5 * pd.per_block
        for rid, prompt in zip(("b", "c", "d"), OTHERS):
            assert pd.run(rid, prompt, 5)[0] == expected[rid]
        tiered = pd.d_engine if side == "decode" else pd.p_engine
        assert tiered.prefix_tiers(A2) == ["host"] * 4  # evicted from the pool, kept below it
        hits_before = tiered.stats().kv_offload.host.hits
        tokens, plan, sent = pd.run("a2", A2, 5)
        assert tokens == expected["a2"]
        assert tiered.stats().kv_offload.host.hits - hits_before == 4
        if side == "decode":
            assert plan.skip_blocks == 4 and sent == 1 * pd.per_block  # only the rest was shipped
        else:
            assert plan.skip_blocks == 0 and sent == 5 * pd.per_block
            assert pd.p_engine.stats().prefix_cache_hits >= 64  # its lookup found them (in its host tier)
        pd.check_free()
    finally:
        pd.close()
    assert torch.get_num_threads() == 1
