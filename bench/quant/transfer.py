"""The transport alone, the second KV transfer table of the quantization benchmark
(bench/quant/schemes.py; the first, through a 1P+1D cluster, is bench/quant/cluster.py): what
one prompt's KV costs to ship from a prefill engine to a decode engine, per KV dtype.

    per KV dtype (auto = the base dtype, fp8_e4m3, fp8_e5m2), in this process:
      prefill engine --prefill_and_hold--> the prompt's pages, held for the whole run
      decode engine + its worker request table, a ZmqReceiver (tcp://127.0.0.1) on its
        KV cache, as a decode worker runs them (services/worker/requests.py)
    each repetition, every dtype in turn (bench/common/repeat.py), `transfer_reps` times:
      the decode table reserves blocks for the prompt (untimed); then bench.transfer.kvtransfer's
      `time_ours`: every layer's pages through our ZmqSender, the final message, until
      the receiver's ack (timed); the decode table commits and finishes the request

Bytes are what the decode side's connector counted as received (page bytes only: the
prompt's blocks, every layer's K and V); per prompt token they are the MemoryPlan's KV
bytes per token, rounded up to whole blocks. The pages move as stored: an FP8 cache
ships a quarter of float32's bytes, half of bfloat16's. The router, gRPC and the
layer-wise overlap with the prefill (bench/transfer/kvtransfer.py measures that) are left out on
purpose: every page is sent after the prefill, so the time is the whole transport's,
every byte of it, with receiver and sender sharing one process (and its GIL) here. In
a cluster most pages leave while the prefill's later layers compute, and the workers
time only what is left after it (bench/quant/cluster.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench.transfer.timing import HeldPrompt, prefill_and_hold, time_ours
from pdserve.bench.common.random_model import FIRST_REGULAR_TOKEN
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, median
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.kvtransfer.connector import KVConnector, Transport
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transports.zmq import ZmqReceiver, ZmqSender
from pdserve.services.worker.events import FailedEvent, FinishedEvent
from pdserve.services.worker.requests import RequestTable

if TYPE_CHECKING:
    from pdserve.bench.quant.config import QuantBenchConfig

KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
WAIT_S = 120.0


@dataclass
class TransferReport:
    bytes: dict[str, int] = field(default_factory=dict)  # KV dtype -> page bytes of one prompt
    seconds: dict[str, list[float]] = field(default_factory=dict)  # KV dtype -> per repetition, the median


class Pair:
    """A prefill engine holding the prompt's pages and a decode worker's table receiving them."""

    def __init__(self, model_dir: Path, kv_cache_dtype: str, prompt: list[int], cfg: QuantBenchConfig) -> None:
        blocks = -(-len(prompt) // cfg.block_size)
        self.kv_cache_dtype = kv_cache_dtype
        self.prefill = LLMEngine(self._config(model_dir, kv_cache_dtype, blocks + 4, cfg))
        self.decode = LLMEngine(self._config(model_dir, kv_cache_dtype, blocks + 4, cfg))
        kv = self.decode.runner.kv_cache
        connector = KVConnector(Transport(None, ZmqReceiver(kv, "tcp://127.0.0.1:0")), kv,
                                self.decode.model_config.vocab_size, kv_format=self.decode.runner.kv_format)
        connector.start()
        self.table = RequestTable(self.decode, connector)
        self.sender = ZmqSender()
        self.held: HeldPrompt = prefill_and_hold(self.prefill, prompt)
        self.count = 0

    @staticmethod
    def _config(model_dir: Path, kv_cache_dtype: str, num_blocks: int, cfg: QuantBenchConfig) -> EngineConfig:
        return EngineConfig(
            model=str(model_dir), dtype=cfg.dtype, device=cfg.device, kv_cache_dtype=kv_cache_dtype,
            cache=CacheConfig(block_size=cfg.block_size, num_blocks=num_blocks, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.transfer_prompt)),
        )

    def transfer(self) -> tuple[float, int]:
        """One transfer of the held pages into a fresh reservation: (seconds, bytes received)."""
        rid = f"{self.kv_cache_dtype}-{self.count}"
        self.count += 1
        before = self.table.connector.stats().kv_transfer_bytes
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        _, packed = self.table.reserve(rid, self.held.prompt, params, WAIT_S)
        stream = self.table.attach(rid)
        seconds = time_ours(self.sender, self.prefill.runner.kv_cache, self.held, TransferPlan.unpack(packed))
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # the arrival commits; max_tokens=1: that finishes it
            self.table.advance()
            ended = [e for e in stream.get(0) if isinstance(e, (FinishedEvent, FailedEvent))]
            if ended and isinstance(ended[-1], FailedEvent):
                raise RuntimeError(f"transfer {rid} failed on the decode side: {ended[-1].message}")
            if ended:
                return seconds, self.table.connector.stats().kv_transfer_bytes - before
            time.sleep(0.001)
        raise RuntimeError(f"transfer {rid}: the decode side never finished")

    def close(self) -> None:
        self.sender.close()
        self.table.connector.close()


def make_prompt(cfg: QuantBenchConfig) -> list[int]:
    span = cfg.model.vocab_size - FIRST_REGULAR_TOKEN
    return [FIRST_REGULAR_TOKEN + (31 * i + 7) % span for i in range(cfg.transfer_prompt)]


def run(model_dir: Path, cfg: QuantBenchConfig, log: Callable[[str], None]) -> TransferReport:
    prompt = make_prompt(cfg)
    pairs: dict[str, Pair] = {}
    report = TransferReport()
    try:
        for kv in KV_DTYPES:
            pairs[kv] = Pair(model_dir, kv, prompt, cfg)
            pairs[kv].transfer()  # warm-up: connections, first landing

        def repetition(kv: str) -> Callable[[int], float]:
            def once(rep: int) -> float:
                runs = [pairs[kv].transfer() for _ in range(cfg.transfer_reps)]
                report.bytes[kv] = runs[-1][1]
                if {b for _, b in runs} != {pairs[kv].held.nbytes}:
                    raise RuntimeError(f"{kv}: received {sorted({b for _, b in runs})} bytes, held "
                                       f"{pairs[kv].held.nbytes}")
                return median(s for s, _ in runs)
            return once

        report.seconds = interleaved({kv: repetition(kv) for kv in KV_DTYPES}, cfg.repeats, log)
    finally:
        for pair in pairs.values():
            pair.close()
    print_report(report, pairs, len(prompt), cfg, log)
    return report


def print_report(report: TransferReport, pairs: dict[str, Pair], tokens: int, cfg: QuantBenchConfig,
                 log: Callable[[str], None]) -> None:
    log(f"\nKV transfer of one {tokens}-token prompt, prefill engine -> decode engine over ZeroMQ tcp "
        f"(median of {cfg.transfer_reps} per repetition; {cfg.repeats} repetitions [min, max])")
    base = report.bytes["auto"]
    for kv in KV_DTYPES:
        dtype = str(pairs[kv].decode.runner.kv_cache.dtype).removeprefix("torch.")
        ms = Ratio.of([1e3 * s for s in report.seconds[kv]])
        gbps = report.bytes[kv] / median(report.seconds[kv]) / 1e9
        log(f"{kv:<9} {dtype:<14} {report.bytes[kv]:>11} bytes  {report.bytes[kv] / tokens:>9.1f} bytes/prompt token  "
            f"(auto / this {base / report.bytes[kv]:.3f})  {ms} ms  {gbps:.2f} GB/s")
        if kv != "auto":
            log(f"{'':<9} time auto / this {Ratio.paired(report.seconds['auto'], report.seconds[kv])}")

