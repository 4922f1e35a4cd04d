"""KV transfer benchmark: our transports against raw ZeroMQ, and layer-wise overlap.

Run it with `python -m pdserve.bench.transfer.kvtransfer` (about 30 s on 2 CPU cores),
`python -m pdserve.bench.transfer.kvtransfer --quick` (a shorter prompt and fewer repetitions) or
`python -m pdserve.bench.transfer.kvtransfer --gpu` (both engines' KV on cuda: pages are staged
through host memory on both sides, the raw ceiling copies them to the host too; no
gloo; see bench/gpu_benchmarks.md).

Everything happens in one run, between two processes on this machine (one torch
thread each):

1. A seeded, random-initialised fp32 Llama is saved in Hugging Face format to a
   temporary directory (removed at the end). Its KV is large for its compute
   (multi-head attention: as many KV heads as query heads), so transfer time is not
   negligible next to prefill time even on a CPU.
2. A decode process (spawned) runs, per transport, what a decode worker's engine
   thread runs (an engine, a receiver on its KV cache, the worker's request table,
   services/worker/requests.py, stepped by hand): ZeroMQ over tcp://127.0.0.1, the
   same with CURVE (encrypted and authenticated, as the launchers always run it; keys
   made for this run), ZeroMQ over ipc://, and torch.distributed (gloo); plus two raw
   ZeroMQ ROUTER sockets (tcp and ipc) that receive without copying and do nothing
   else. Control messages (reserve, endpoints) go over a pipe; every KV byte goes
   over the transport being measured.
3. The prefill side (this process) prefills one prompt and keeps its blocks. Then,
   interleaved, each repetition sends the same pages:
   * raw ZeroMQ, the ceiling: one DEALER message per layer holding the same bytes,
     one frame per run of consecutive blocks (zero-copy from the same KV tensor),
     then an end marker; the receiver takes the frames without copying them; timed
     until its reply;
   * ours, per transport: the decode engine reserves blocks (untimed), then the pages
     go out through our sender (header + runs cut into frames of at most 1 MiB),
     land in the reserved blocks through our receiver (validation, `recv_into`
     straight into the KV tensor) and are acked; timed from the first send to the ack.
   GB/s is KV bytes / time (1 GB = 1e9 bytes), the median over repetitions; raw and
   ours alternate within each repetition (bench/common/repeat.py), so drifting load hits
   both alike, and ratios are taken per repetition: median with min-max.
4. Layer-wise streaming: fresh prompts are prefilled (a) as a prefill worker does
   (its request table: the connector's layer hook sends each layer's pages as soon as
   the layer is written), and (b) without, sending every page after the prefill
   (the connector's own calls: start, the layer hook once per layer over the whole
   prompt, finish). In both, `exposed` is the time from the end of the prefill step
   to the receiver's ack: the transfer time not hidden behind compute.
   overlap % = 100 * (1 - exposed(a) / exposed(b)).
   Prefill compute time with and without streaming is printed too (the cost of
   streaming on shared cores shows there).

The last line is machine-readable: `ratio_vs_raw_zmq=X curve_vs_plain=Y`: our ZeroMQ
tcp GB/s over raw ZeroMQ tcp GB/s, and ours with CURVE over ours without (each the
median of per-repetition ratios).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import zmq

from pdserve.bench.common.entry import overridden, parse
from pdserve.bench.common.repeat import interleaved
from pdserve.bench.common.stats import Ratio, median
from pdserve.bench.transfer.timing import WAIT_S, HeldPrompt, prefill_and_hold, time_ours
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.export import ExportSlice
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.kvtransfer.connector import KVConnector, Receiver, Sender, Transport, page_runs
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transports.nccl import TorchDistReceiver, TorchDistSender
from pdserve.kvtransfer.transports.zmq import CurveConfig, ZmqConfig, ZmqReceiver, ZmqSender
from pdserve.kvtransfer.wire import PageLayout
from pdserve.services.common.flags import flag
from pdserve.services.worker.events import FailedEvent, FinishedEvent, RequestStream
from pdserve.services.worker.requests import RequestTable

SPAWN = mp.get_context("spawn")
FIRST_REGULAR_TOKEN = 3


@dataclass(frozen=True)
class BenchConfig:
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 8  # = KV heads (MHA): head_dim 32, 2 KiB of fp32 KV per token per layer
    intermediate_size: int = 512
    vocab_size: int = 512
    block_size: int = 16
    prompt_len: int = 2048
    reps: int = 30
    overlap_reps: int = 5
    seed: int = 0
    device: str = "cpu"

    @property
    def num_blocks(self) -> int:
        return -(-self.prompt_len // self.block_size)


@dataclass(frozen=True)
class KvTransferFlags:
    quick: bool = flag(False, "shorter prompt (1024 tokens), fewer repetitions (10)")
    prompt_len: int | None = flag(None, "prompt tokens (2048; --quick 1024)")
    reps: int | None = flag(None, "timed transfers per transport (30; --quick 10)")
    gpu: bool = flag(False, "KV caches on cuda (no gloo)")


QUICK = BenchConfig(prompt_len=1024, reps=10, overlap_reps=2)


def config_from(flags: KvTransferFlags) -> BenchConfig:
    cfg = overridden(QUICK if flags.quick else BenchConfig(), flags)
    if flags.gpu:
        cfg = replace(cfg, device="cuda")
    if cfg.prompt_len < 2 * cfg.block_size or cfg.reps < 1:
        raise ValueError(f"--prompt-len must be >= 2 blocks ({2 * cfg.block_size}) and --reps >= 1")
    return cfg


def save_random_model(cfg: BenchConfig, path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.prompt_len + 64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    del model
    gc.collect()


def engine_config(model_dir: Path, cfg: BenchConfig, num_blocks: int) -> EngineConfig:
    # No prefix caching: every repetition must move (and compute) every block.
    return EngineConfig(
        model=str(model_dir), device=cfg.device,
        cache=CacheConfig(block_size=cfg.block_size, num_blocks=num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=cfg.prompt_len, max_model_len=cfg.prompt_len + 64),
    )


def make_prompt(rng: random.Random, cfg: BenchConfig) -> list[int]:
    return [rng.randrange(FIRST_REGULAR_TOKEN, cfg.vocab_size) for _ in range(cfg.prompt_len)]


def worker_table(engine: LLMEngine, sender: Sender | None = None, receiver: Receiver | None = None) -> RequestTable:
    """What a worker's engine thread runs over `engine` and these transport ends."""
    connector = KVConnector(Transport(sender, receiver), engine.runner.kv_cache, engine.model_config.vocab_size)
    return RequestTable(engine, connector)


# -- the decode process ---------------------------------------------------------------


def _raw_sink(sock: zmq.Socket, stop: threading.Event) -> None:
    """Raw ZeroMQ: take every message without copying it; answer an end marker."""
    while not stop.is_set():
        if not sock.poll(50):
            continue
        parts = sock.recv_multipart(copy=False)
        if len(parts) == 2 and parts[1].bytes == b"end":
            sock.send_multipart([parts[0].bytes, b"ack"])


def decode_process(conn, model_dir: str, cfg: BenchConfig, ipc_dir: str, curve: CurveConfig) -> None:
    torch.set_num_threads(1)
    receivers: dict[str, Callable[[torch.Tensor], Receiver]] = {
        "zmq_tcp": lambda kv: ZmqReceiver(kv, "tcp://127.0.0.1:0"),
        "zmq_curve": lambda kv: ZmqReceiver(kv, "tcp://127.0.0.1:0", ZmqConfig(curve=curve)),
        "zmq_ipc": lambda kv: ZmqReceiver(kv, f"ipc://{ipc_dir}/kv.sock"),
    }
    if cfg.device == "cpu":  # gloo moves host tensors only
        receivers["gloo"] = lambda kv: TorchDistReceiver(kv, "tcp://127.0.0.1:0")
    tables = {}  # one decode worker's engine and request table per transport
    for name, make in receivers.items():
        engine = LLMEngine(engine_config(Path(model_dir), cfg, 2 * cfg.num_blocks + 8))
        tables[name] = worker_table(engine, receiver=make(engine.runner.kv_cache))
    ctx = zmq.Context()
    stop = threading.Event()
    raw = {}
    for name, bind in (("raw_tcp", "tcp://127.0.0.1:*"), ("raw_ipc", f"ipc://{ipc_dir}/raw.sock")):
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(bind)
        raw[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        threading.Thread(target=_raw_sink, args=(sock, stop), daemon=True).start()
    for table in tables.values():
        table.connector.start()
    endpoints = {name: t.connector.endpoint for name, t in tables.items()} | raw
    conn.send(endpoints)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    streams: dict[str, RequestStream] = {}  # as the Decode calls would read them
    try:
        while True:
            for table in tables.values():
                table.advance()  # max_tokens=1: a commit finishes the request
            for rid, stream in list(streams.items()):
                ended = [e for e in stream.get(0) if isinstance(e, (FinishedEvent, FailedEvent))]
                if ended:
                    del streams[rid]
                if ended and isinstance(ended[-1], FailedEvent):
                    print(f"decode: transfer {rid} failed: {ended[-1].message}", file=sys.stderr, flush=True)
            if not conn.poll(0.005):  # the receivers ack on their own threads; commits can wait
                continue
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            transport, rid, prompt = args
            _, plan = tables[transport].reserve(rid, prompt, params, WAIT_S)
            streams[rid] = tables[transport].attach(rid)
            conn.send(plan)
    finally:
        stop.set()
        for table in tables.values():
            table.connector.close()


class DecodePeer:
    def __init__(self, model_dir: Path, cfg: BenchConfig, ipc_dir: str, curve: CurveConfig) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=decode_process, args=(child, str(model_dir), cfg, ipc_dir, curve), daemon=True)
        self.proc.start()
        if not self.conn.poll(WAIT_S):
            raise RuntimeError("decode process did not start")
        self.endpoints: dict[str, str] = self.conn.recv()

    def reserve(self, transport: str, rid: str, prompt: list[int]) -> TransferPlan:
        self.conn.send(("reserve", (transport, rid, prompt)))
        if not self.conn.poll(WAIT_S):
            raise RuntimeError("decode process did not answer")
        return TransferPlan.unpack(self.conn.recv())

    def stop(self) -> None:
        self.conn.send(("stop", ()))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


# -- measurements ----------------------------------------------------------------------


def time_raw(sock: zmq.Socket, kv: torch.Tensor, held: HeldPrompt, header_bytes: int) -> float:
    """The same frames as ours, raw: one message per layer, then an end marker."""
    runs = [[run for _, run in page_runs(kv, layer, 0, len(held.block_ids), held.block_ids)] for layer in range(kv.shape[0])]
    header = b"h" * header_bytes
    start = time.perf_counter()
    for layer in runs:  # a GPU cache's pages are copied to the host first, inside the timing (as ours must)
        frames = [run.cpu().view(torch.uint8).reshape(-1).numpy() for run in layer]
        sock.send_multipart([header, *frames], copy=False)
    sock.send(b"end")
    if not sock.poll(int(WAIT_S * 1000)):
        raise RuntimeError("raw receiver did not answer")
    sock.recv()
    return time.perf_counter() - start


@dataclass
class OverlapRun:
    compute_s: float  # submit -> the prefill step that finished the request returned
    exposed_s: float  # that moment -> the receiver's ack


def stream_once(table: RequestTable, decode: DecodePeer, rid: str, prompt: list[int]) -> OverlapRun:
    """As a prefill worker: its request table ships each layer's pages as the layer is written."""
    plan = decode.reserve("zmq_tcp", rid, prompt)
    start = time.perf_counter()
    table.submit(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), plan=plan)
    while not any(o.request_id == rid for o in table.advance()):
        pass
    computed = time.perf_counter()
    give_up = computed + WAIT_S
    while table.get(rid) is not None:  # HELD until the ack (a later poll)
        if time.perf_counter() > give_up:
            raise RuntimeError(f"{rid}: never acked")
        table.advance()
    return OverlapRun(computed - start, time.perf_counter() - computed)


def serial_once(table: RequestTable, decode: DecodePeer, rid: str, prompt: list[int]) -> OverlapRun:
    """Prefill first (no layer hook), then send every page: the planning side's own
    calls (start, the layer hook once per layer over the whole prompt, finish)."""
    engine, prefill = table.engine, table.connector.prefill
    plan = decode.reserve("zmq_tcp", rid, prompt)
    hook, engine.layer_hook = engine.layer_hook, None
    try:
        start = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), export_kv=True)
        first = None
        while first is None:
            for o in engine.step():
                first = o.outputs[0].token_ids[0]
        computed = time.perf_counter()
    finally:
        engine.layer_hook = hook
    prefill.start(rid, prompt, plan)
    whole = [ExportSlice(rid, 0, len(prompt), engine.held_block_ids(rid))]
    for layer in range(PageLayout.of(engine.runner.kv_cache).num_layers):
        prefill.on_layer(layer, whole)
    prefill.finish(rid, first)
    while time.perf_counter() < computed + WAIT_S:
        update = prefill.poll(timeout_s=0.05)
        if rid in update.failed:
            raise RuntimeError(f"{rid}: {update.failed[rid]}")
        if rid in update.done:
            acked = time.perf_counter()
            engine.release(rid)
            return OverlapRun(computed - start, acked - computed)
    raise RuntimeError(f"{rid}: never acked")


def plain_prefill_s(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# -- the run ---------------------------------------------------------------------------


def run(cfg: BenchConfig, log: Callable[[str], None] = print) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="kvbench"))
    decode = None
    senders: dict[str, ZmqSender] = {}
    ctx = zmq.Context()
    try:
        save_random_model(cfg, tmp / "model")
        (server_public, server_secret), (client_public, client_secret) = zmq.curve_keypair(), zmq.curve_keypair()
        server = CurveConfig(server_public, server_secret, authorized_keys=frozenset({client_public}))
        decode = DecodePeer(tmp / "model", cfg, str(tmp), server)
        torch.set_num_threads(1)  # one core each side: the decode process has the other
        engine = LLMEngine(engine_config(tmp / "model", cfg, 4 * cfg.num_blocks + 8))
        kv = engine.runner.kv_cache
        layout = PageLayout.of(kv)
        rng = random.Random(cfg.seed)
        held = prefill_and_hold(engine, make_prompt(rng, cfg))
        runs = len(page_runs(kv, 0, 0, len(held.block_ids), held.block_ids))
        log(f"kvtransfer bench: llama {cfg.num_layers} layers, {cfg.num_heads} KV heads x {layout.head_dim}, "
            f"{layout.dtype}, block {cfg.block_size}; prompt {cfg.prompt_len} tokens = {cfg.num_blocks} blocks; "
            f"{held.nbytes / 2**20:.1f} MiB of KV per transfer: one message per layer of {runs} run(s) of "
            f"{held.nbytes / cfg.num_layers / runs / 2**20:.2f} MiB (raw: a frame per run; ours: frames of at most "
            f"{ZmqConfig().max_frame_bytes / 2**20:g} MiB); {cfg.reps} repetitions, medians")

        senders = {"zmq_tcp": ZmqSender(), "zmq_ipc": ZmqSender(),
                   "zmq_curve": ZmqSender(ZmqConfig(curve=CurveConfig(client_public, client_secret)))}
        if cfg.device == "cpu":
            senders["gloo"] = TorchDistSender()
        raw_socks = {}
        for name in ("raw_tcp", "raw_ipc"):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(decode.endpoints[name])
            raw_socks[name] = sock
        header_bytes = 160  # about our pages header
        counter = 0

        def timing(name: str) -> Callable[[int], float]:
            def once(_rep: int) -> float:
                nonlocal counter
                if name.startswith("raw"):
                    return time_raw(raw_socks[name], kv, held, header_bytes)
                counter += 1
                plan = decode.reserve(name, f"tput-{counter}", held.prompt)
                return time_ours(senders[name], kv, held, plan)

            return once

        systems = {name: timing(name) for name in ("raw_tcp", "zmq_tcp", "zmq_curve", "raw_ipc", "zmq_ipc", "gloo")
                   if name.startswith("raw") or name in senders}
        interleaved(systems, 1)  # warm-up: connections, gloo pairing
        times = interleaved(systems, cfg.reps)
        rates = {name: gbps(held.nbytes, median(ts)) for name, ts in times.items()}
        notes = {
            "raw_tcp": "ceiling: same bytes, a frame per run, raw DEALER->ROUTER, no parsing, no copy on receive",
            "zmq_tcp": "ours: header checks, recv_into the reserved blocks, ack",
            "zmq_curve": "ours with CURVE: every byte encrypted and authenticated (the launchers' setting)",
            "raw_ipc": "same as raw_tcp over ipc://",
            "zmq_ipc": "ours over ipc://",
            "gloo": "ours: headers over ZeroMQ, pages by torch.distributed gloo send/recv",
        }
        for name, rate in rates.items():
            spread = f"{gbps(held.nbytes, max(times[name])):.2f}-{gbps(held.nbytes, min(times[name])):.2f}"
            log(f"  {name:8s} {rate:6.2f} GB/s  (range {spread}, {median(times[name]) * 1e3:7.1f} ms)  {notes[name]}")
        # Raw and ours run back to back in each repetition: the ratio per repetition
        # cancels load that drifts over the run (other processes on the machine).
        # Rates are bytes / time, so ours / raw GB/s is raw time / ours time.
        tcp = Ratio.paired(times["raw_tcp"], times["zmq_tcp"])
        ipc = Ratio.paired(times["raw_ipc"], times["zmq_ipc"])
        curve = Ratio.paired(times["zmq_tcp"], times["zmq_curve"])
        log(f"  zmq_tcp / raw_tcp GB/s per repetition: {tcp}; zmq_ipc / raw_ipc: {ipc}; zmq_curve / zmq_tcp: {curve}")

        table = worker_table(engine, sender=senders["zmq_tcp"])
        plain, stream, serial = [], [], []
        for rep in range(cfg.overlap_reps + 1):  # repetition 0 warms up
            p = plain_prefill_s(engine, f"plain-{rep}", make_prompt(rng, cfg))
            s = stream_once(table, decode, f"stream-{rep}", make_prompt(rng, cfg))
            c = serial_once(table, decode, f"serial-{rep}", make_prompt(rng, cfg))
            if rep:
                plain.append(p)
                stream.append(s)
                serial.append(c)
        exposed_stream = median([r.exposed_s for r in stream])
        exposed_serial = median([r.exposed_s for r in serial])
        overlap = 100.0 * max(0.0, min(1.0, 1.0 - exposed_stream / exposed_serial))
        log(f"  layer-wise streaming (zmq tcp): prefill compute {median(plain) * 1e3:.0f} ms plain, "
            f"{median([r.compute_s for r in stream]) * 1e3:.0f} ms while streaming; transfer after compute "
            f"{exposed_serial * 1e3:.1f} ms, exposed with streaming {exposed_stream * 1e3:.1f} ms "
            f"-> overlap {overlap:.1f} %")
        engine.release("held")
        engine.check_integrity()
        return f"ratio_vs_raw_zmq={tcp.median:.3f} curve_vs_plain={curve.median:.3f}"
    finally:
        for sender in senders.values():
            sender.close()
        ctx.destroy(0)
        if decode is not None:
            decode.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse(KvTransferFlags, argv, "python -m pdserve.bench.transfer.kvtransfer", __doc__, config_from)
    print(run(cfg), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
