"""FP8 KV pages between workers (--kv-cache-dtype fp8*): a prefill and a decode worker
whose pages differ in dtype, shape, weights' quantization or KV scales refuse to pair,
naming what differs, before a page leaves; and a prompt's FP8 KV moves between two
engines through the real ZeroMQ connector (the request tables a worker runs, in one
process) byte for byte: the decode engine's pages equal the prefill engine's. The
wire-level checks (page sizes, landings, the dtype on arrival) are in tests/kvtransfer/test_kv_inbox.py."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import DEFAULT_MODEL, CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.kvtransfer.connector import KVConnector, PrefillConnector, Transport
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transports.zmq import ZmqReceiver, ZmqSender
from pdserve.kvtransfer.wire import LayoutMismatch, PageLayout, new_secret
from pdserve.services.worker.events import FailedEvent, FinishedEvent
from pdserve.services.worker.requests import RequestTable

pytestmark = pytest.mark.cluster(seconds=2)

FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}  # --kv-cache-dtype -> the pages' dtype
WAIT_S = 60.0


# -- pairing ---------------------------------------------------------------------------

F32 = "weights=float32"
FP8_FORMAT = "weights=float32;kv_scales=08c6774f2ddef713"


@pytest.mark.parametrize("theirs, ours, differ", [
    (("float8_e4m3fn", FP8_FORMAT), ("float32", F32), "dtype and kv_format"),
    (("float8_e4m3fn", FP8_FORMAT), ("float8_e5m2", FP8_FORMAT), "dtype"),
    (("float32", "weights=int8/online"), ("float32", F32), "kv_format"),  # --quantization differs
    (("float8_e4m3fn", FP8_FORMAT), ("float8_e4m3fn", "weights=float32;kv_scales=ffffffffffffffff"), "kv_format"),
])
def test_a_plan_for_other_pages_is_refused_naming_what_differs(theirs, ours, differ):
    kv = torch.zeros((2, 4, 2, 4, 1, 8), dtype=getattr(torch, ours[0]))
    connector = PrefillConnector(ZmqSender(), kv, kv_format=ours[1])
    prompt = list(range(10))
    plan = TransferPlan("r", "tcp://127.0.0.1:1", "zmq", PageLayout(2, 4, 1, 8, *theirs), len(prompt), 0, (), (),
                        new_secret())
    try:
        with pytest.raises(LayoutMismatch) as err:
            connector.start("r", prompt, TransferPlan.unpack(plan.pack()))
        message = str(err.value)
        assert message.startswith(f"transfer_plan.layout: {differ} differ: the decode worker holds {theirs[0]} pages")
        assert f"({theirs[1]})" in message and f"the prefill worker {ours[0]} pages" in message and f"({ours[1]})" in message
        assert isinstance(err.value, ValueError) and connector.exporting() == []
    finally:
        connector.sender.close()


# -- an engine pair through the real ZeroMQ connector ---------------------------------


def engine(kv_cache_dtype: str, quantization: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(DEFAULT_MODEL, cache=CacheConfig(block_size=16, num_blocks=64), kv_cache_dtype=kv_cache_dtype,
                                  quantization=quantization))


def table(e: LLMEngine, sender=None, receiver=None, on_received=None) -> RequestTable:
    """A worker's request table, its connector built as a worker builds it: over the
    engine's KV cache, with the engine's kv_format."""
    connector = KVConnector(Transport(sender, receiver), e.runner.kv_cache, e.model_config.vocab_size,
                            on_received=on_received, kv_format=e.runner.kv_format)
    connector.start()
    return RequestTable(e, connector)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def alone(kv_cache_dtype: str, prompt: list[int], max_tokens: int) -> list[int]:
    e = engine(kv_cache_dtype)
    e.add_request("alone", prompt, greedy(max_tokens))
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                return o.outputs[0].token_ids
    raise AssertionError("no output")


def page_bytes_of(kv: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return kv[:, block_ids].clone().view(torch.uint8)


@pytest.mark.parametrize("kv_cache_dtype", FP8)
def test_fp8_kv_moves_byte_exactly_between_engines(kv_cache_dtype):
    """The decode engine's pages of the prompt equal the prefill engine's, byte for
    byte, and it continues with the tokens the engine alone produces with an FP8 cache."""
    prefill_engine, decode_engine = engine(kv_cache_dtype), engine(kv_cache_dtype)
    assert decode_engine.runner.kv_cache.dtype == getattr(torch, FP8[kv_cache_dtype])
    landed: dict[str, torch.Tensor] = {}
    decode = table(decode_engine, receiver=ZmqReceiver(decode_engine.runner.kv_cache, "tcp://127.0.0.1:0"),
                   on_received=lambda r: landed.setdefault(r.request_id, page_bytes_of(decode_engine.runner.kv_cache,
                                                                                       r.block_ids)))
    prefill = table(prefill_engine, sender=ZmqSender())
    prompt = [3 + (7 * i) % 250 for i in range(45)]  # 3 blocks, the last one partial
    try:
        _, plan = decode.reserve("q", prompt, greedy(12), 30.0)
        stream = decode.attach("q")
        prefill.submit("q", prompt, greedy(1), plan=TransferPlan.unpack(plan))
        shipped = None
        deadline = time.monotonic() + WAIT_S
        while ("q" not in landed or prefill.live() or decode.live()) and time.monotonic() < deadline:
            prefill.advance()
            if shipped is None and "q" in prefill_engine.held:  # its pages, before the ack frees them
                shipped = page_bytes_of(prefill_engine.runner.kv_cache, prefill_engine.held_block_ids("q"))
            decode.advance()
        events = stream.get(0)
        finished = [e for e in events if isinstance(e, FinishedEvent)]
        assert finished and not [e for e in events if isinstance(e, FailedEvent)]
        assert shipped is not None and torch.equal(landed["q"], shipped)
        assert finished[0].output.outputs[0].token_ids == alone(kv_cache_dtype, prompt, 12)
        layout = decode.connector.decode.layout
        assert layout.kv_format == decode_engine.runner.kv_format and "kv_scales=" in layout.kv_format
        assert decode.connector.stats().kv_transfer_bytes == prefill.connector.stats().kv_transfer_bytes == 3 * 4 * layout.page_bytes
        for e in (prefill_engine, decode_engine):
            e.check_integrity()
            assert e.stats().num_free_blocks == e.stats().num_blocks
    finally:
        prefill.connector.close()
        decode.connector.close()


@pytest.mark.parametrize("decode_kv, prefill_kv, prefill_quant, differ", [
    ("fp8_e4m3", "auto", None, "dtype and kv_format"),
    ("fp8_e4m3", "fp8_e5m2", None, "dtype"),
    ("auto", "auto", "int8", "kv_format"),  # the same dtype, other weights: other K and V
])
def test_engines_with_other_pages_refuse_to_pair_and_free_the_reservation(decode_kv, prefill_kv, prefill_quant, differ):
    decode_engine, prefill_engine = engine(decode_kv), engine(prefill_kv, prefill_quant)
    dtype = str(decode_engine.runner.kv_cache.dtype).removeprefix("torch.")
    decode = table(decode_engine, receiver=ZmqReceiver(decode_engine.runner.kv_cache, "tcp://127.0.0.1:0"))
    prefill = table(prefill_engine, sender=ZmqSender())
    prompt = list(range(3, 40))
    try:
        _, plan = decode.reserve("m", prompt, greedy(4), 30.0)
        with pytest.raises(LayoutMismatch, match=f"transfer_plan.layout: {differ} differ: the decode worker holds "
                                                 f"{dtype} pages"):
            prefill.submit("m", prompt, greedy(1), plan=TransferPlan.unpack(plan))
        assert not prefill.live() and not prefill_engine.has_unfinished()
        decode.abort("m")  # what the router does when the prefill worker refuses
        decode.advance()
        assert decode.connector.decode.expecting() == [] and decode.connector.stats().kv_transfer_bytes == 0
        decode_engine.check_integrity()
        assert decode_engine.stats().num_free_blocks == decode_engine.stats().num_blocks
    finally:
        prefill.connector.close()
        decode.connector.close()
