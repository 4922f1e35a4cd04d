"""KV transfer over real sockets and processes, through the API a worker runs.

Each side is what a worker's engine thread runs, stepped by hand: a RequestTable
(services/worker/requests.py) over an engine and a KVConnector, which calls the
connector's planning side exactly as in production (expect / poll / cancel on the
decode side; start / the layer hook / finish / poll / cancel on the prefill side).
A decode worker runs in a spawned process (engines, receivers and request tables,
driven by a small command pipe — control only: every KV byte crosses our
transports). The prefill side runs in the test process. Checks: pages arrive
bit-identical over ZeroMQ tcp and ipc and over torch.distributed (gloo), for several
model shapes and dtypes, and decoding continues with the tokens the prefill engine
would produce; only blocks the decoder lacks cross the wire; a sender dying
mid-transfer, malformed frames and silent receivers end in freed blocks, never
hangs. Deadlines in this process run on a ManualClock. (CURVE and the transports
alone: tests/kvtransfer/transports/; the connector alone over an in-process
transport: tests/kvtransfer/test_kv_connector.py.)
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass

import msgpack
import pytest
import torch
import zmq

from manual_clock import ManualClock
from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.hashing import hash_blocks
from hf_models import build_model
from pdserve.kvtransfer.connector import KVConnector, Transport
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transports.nccl import TorchDistReceiver, TorchDistSender
from pdserve.kvtransfer.transports.zmq import ZmqReceiver, ZmqSender
from pdserve.kvtransfer.wire import (
    VERSION,
    PageLayout,
    PagesHeader,
    encode,
    new_secret,
    sign,
)
from pdserve.services.worker.events import FailedEvent, FinishedEvent
from pdserve.services.worker.requests import AWAITING_KV, RequestTable, State

pytestmark = pytest.mark.cluster(seconds=10)

SPAWN = mp.get_context("spawn")
WAIT_S = 60.0  # upper bound on any single wait; tests finish far sooner


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    dtype: str
    block_size: int
    overrides: tuple[tuple[str, int], ...] = ()


MODELS = {
    # 2 layers, 2 KV heads x 16
    "llama-f32": ModelSpec("llama", "float32", 16),
    # 3 layers, 1 KV head x 16, fp16, small blocks
    "qwen2-f16": ModelSpec("qwen2", "float16", 8, (("num_hidden_layers", 3), ("num_key_value_heads", 1))),
    # 1 layer, 4 KV heads x 32, bf16, large blocks
    "mistral-bf16": ModelSpec("mistral", "bfloat16", 32, (("num_hidden_layers", 1), ("hidden_size", 128), ("num_key_value_heads", 4))),
}
TRANSPORTS = ("tcp", "ipc", "gloo")


def engine_config(model_dir: str, spec: ModelSpec, num_blocks: int = 96, chunk: int = 2048) -> EngineConfig:
    return EngineConfig(
        model=model_dir, dtype=spec.dtype,
        cache=CacheConfig(block_size=spec.block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    )


def kv_digest(kv: torch.Tensor, block_ids: list[int], num_tokens: int) -> str:
    """sha256 of the K/V of tokens [0, num_tokens) in these blocks, every layer."""
    layers, _, _, bs, heads, dim = kv.shape
    pages = kv[:, block_ids].transpose(1, 2).reshape(layers, 2, len(block_ids) * bs, heads, dim)
    return hashlib.sha256(pages[:, :, :num_tokens].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


def worker_table(engine: LLMEngine, sender=None, receiver=None, clock=time.monotonic, on_received=None,
                 held_lease: float = 30.0) -> RequestTable:
    """A worker's request table over `engine` and a connector on these transport ends
    (the receiver started)."""
    kv = engine.runner.kv_cache
    connector = KVConnector(Transport(sender, receiver), kv, engine.model_config.vocab_size, clock, on_received)
    connector.start()
    return RequestTable(engine, connector, clock=clock, held_lease=held_lease)


def outcome(stream) -> dict | None:
    """A request's end as seen on its stream: its tokens per sequence, or why it failed."""
    for event in stream.get(0):
        if isinstance(event, FinishedEvent):
            return {"tokens": [c.token_ids for c in event.output.outputs]}
        if isinstance(event, FailedEvent):
            return {"failed": event.message, "failure": event.failure.value}
    return None


# -- the decode worker process ------------------------------------------------------


class _DecodeNode:
    def __init__(self, model_dir: str, spec: ModelSpec, transport: str, bind: str, results: dict) -> None:
        self.engine = LLMEngine(engine_config(model_dir, spec))
        kv = self.engine.runner.kv_cache
        self.receiver = TorchDistReceiver(kv, bind) if transport == "gloo" else ZmqReceiver(kv, bind)
        self.results = results

        def received(reservation) -> None:
            self.results[reservation.request_id] = {"digest": kv_digest(kv, reservation.block_ids, self.tokens[reservation.request_id])}

        self.tokens: dict[str, int] = {}
        self.streams: dict[str, object] = {}
        self.table = worker_table(self.engine, receiver=self.receiver, on_received=received)

    def reserve(self, rid: str, prompt: list[int], params: SamplingParams, lease: float) -> bytes:
        _, plan = self.table.reserve(rid, prompt, params, lease)
        self.streams[rid] = self.table.attach(rid)  # the Decode call
        return plan

    def step(self) -> bool:
        outputs = self.table.advance()
        ended = False
        for rid, stream in list(self.streams.items()):
            result = outcome(stream)
            if result is not None:
                self.results.setdefault(rid, {}).update(result)
                del self.streams[rid]
                ended = True
        return bool(outputs) or ended

    def waiting(self) -> list[str]:
        """Requests whose KV is still expected or waited for."""
        return [*self.table.connector.decode.expecting(),
                *(rid for rid in self.table.live() if self.table.get(rid).state in AWAITING_KV)]


def decode_worker(conn) -> None:
    """Serve commands (open / reserve / result / stats / stop) while stepping every node."""
    torch.set_num_threads(1)
    nodes: dict[str, _DecodeNode] = {}
    results: dict[str, dict] = {}

    def open_node(name, model_dir, spec, transport, bind):
        nodes[name] = _DecodeNode(model_dir, ModelSpec(*spec), transport, bind, results)
        return nodes[name].receiver.endpoint

    def reserve(name, rid, prompt, max_tokens, n=1, lease=30.0):
        node = nodes[name]
        node.tokens[rid] = len(prompt)
        return node.reserve(rid, prompt, greedy(max_tokens, n), lease)

    def result(rid):
        r = results.get(rid, {})
        return r if ("tokens" in r or "failed" in r) else None

    def stats(name):
        node = nodes[name]
        node.engine.check_integrity()
        return {**vars(node.engine.stats()), **{f"rx_{k}": v for k, v in node.receiver.stats().items()},
                "waiting": node.waiting()}

    handlers = {"open": open_node, "reserve": reserve, "result": result, "stats": stats}
    try:
        while True:
            busy = any([node.step() for node in nodes.values()])
            if not conn.poll(0 if busy else 0.002):
                continue
            cmd, args = conn.recv()
            if cmd == "stop":
                break
            try:
                conn.send(("ok", handlers[cmd](*args)))
            except Exception as exc:  # reported to the test
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
    finally:
        for node in nodes.values():
            node.receiver.close()


class DecodePeer:
    """The test's handle on the decode worker process."""

    def __init__(self) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=decode_worker, args=(child,), daemon=True)
        self.proc.start()

    def call(self, cmd: str, *args):
        self.conn.send((cmd, args))
        if not self.conn.poll(WAIT_S):
            raise TimeoutError(f"decode worker: no answer to {cmd}")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def wait_result(self, rid: str, while_waiting=lambda: None) -> dict:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            while_waiting()
            r = self.call("result", rid)
            if r is not None:
                return r
            time.sleep(0.002)
        raise TimeoutError(f"no result for {rid}")

    def stop(self) -> None:
        try:
            self.conn.send(("stop", ()))
        finally:
            self.proc.join(20)
            if self.proc.is_alive():
                self.proc.kill()


# -- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name, spec in MODELS.items():
        path = tmp_path_factory.mktemp(name)
        build_model(path, spec.arch, seed=7, **dict(spec.overrides))
        dirs[name] = str(path)
    return dirs


@pytest.fixture(scope="module")
def decoder():
    peer = DecodePeer()
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def ipc_dir():
    with tempfile.TemporaryDirectory(prefix="kv") as d:  # short: ipc paths are length-limited
        yield d


def open_node(decoder, model_dirs, ipc_dir, model: str, transport: str, tag: str = "") -> tuple[str, str]:
    name = f"{model}-{transport}{tag}"
    bind = f"ipc://{ipc_dir}/{name}.sock" if transport == "ipc" else "tcp://127.0.0.1:0"
    spec = MODELS[model]
    endpoint = decoder.call("open", name, model_dirs[model], tuple(spec.__dict__.values()), transport, bind)
    return name, endpoint


class PrefillSide:
    """A prefill worker's request table in the test process, stepped by hand so the
    test can fingerprint the KV of a finished request before its blocks are released."""

    def __init__(self, model_dir: str, spec: ModelSpec, transport: str, chunk: int = 2048,
                 clock=time.monotonic, held_lease: float = 30.0) -> None:
        self.engine = LLMEngine(engine_config(model_dir, spec, chunk=chunk))
        self.sender = TorchDistSender() if transport == "gloo" else ZmqSender()
        self.table = worker_table(self.engine, sender=self.sender, clock=clock, held_lease=held_lease)
        self.connector = self.table.connector.prefill
        self.digests: dict[str, str] = {}

    def submit(self, rid: str, prompt: list[int], plan: TransferPlan):
        return self.table.submit(rid, prompt, greedy(1), plan=plan)

    def step(self) -> None:
        self.table.advance()
        for rid in self.engine.held:  # finished and held until the receiver's ack (a later poll)
            if rid not in self.digests:
                prompt_len = self.engine.held[rid].num_prompt_tokens
                self.digests[rid] = kv_digest(self.engine.runner.kv_cache, self.engine.held_block_ids(rid), prompt_len)

    def transfer(self, decoder: DecodePeer, node: str, rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> dict:
        self.submit(rid, prompt, TransferPlan.unpack(decoder.call("reserve", node, rid, prompt, max_tokens, n)))
        result = decoder.wait_result(rid, self.step)
        self.settle()
        return result

    def settle(self) -> None:
        """Step until every request has ended (its export acked and released)."""
        deadline = time.monotonic() + WAIT_S
        while self.table.live() and time.monotonic() < deadline:
            self.step()
            time.sleep(0.001)
        self.engine.check_integrity()
        stats = self.engine.stats()
        assert stats.num_free_blocks == stats.num_blocks, "prefill side leaked blocks"

    def close(self) -> None:
        self.table.connector.close()


def local_tokens(model_dir: str, spec: ModelSpec, prompt: list[int], max_tokens: int, chunk: int, n: int = 1) -> list[list[int]]:
    """What the prefill engine itself would generate."""
    engine = LLMEngine(engine_config(model_dir, spec, chunk=chunk))
    engine.add_request("local", prompt, greedy(max_tokens, n))
    while engine.has_unfinished():
        for o in engine.step():
            return [c.token_ids for c in o.outputs]
    raise AssertionError("no output")


def prompt_of(length: int, salt: int) -> list[int]:
    return [3 + (salt * 31 + 7 * i) % 250 for i in range(length)]


# -- round trips --------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("model", list(MODELS))
def test_pages_arrive_bit_identical_and_decoding_continues(decoder, model_dirs, ipc_dir, model, transport):
    spec, model_dir = MODELS[model], model_dirs[model]
    node, _ = open_node(decoder, model_dirs, ipc_dir, model, transport)
    chunk = 3 * spec.block_size - 5  # chunked prefill: partial blocks are sent again
    prefill = PrefillSide(model_dir, spec, transport, chunk=chunk)
    try:
        for i, length in enumerate((4 * spec.block_size + 3, 5)):
            prompt = prompt_of(length, salt=i + len(model))
            rid = f"{node}-{i}"
            result = prefill.transfer(decoder, node, rid, prompt, max_tokens=6)
            assert "failed" not in result, result
            assert result["digest"] == prefill.digests[rid], "received KV differs from the exported KV"
            assert result["tokens"] == local_tokens(model_dir, spec, prompt, 6, chunk)
    finally:
        prefill.close()
    stats = decoder.call("stats", node)
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["rx_rejected"] == 0


def test_only_blocks_the_decoder_lacks_cross_the_wire(decoder, model_dirs, ipc_dir):
    model, spec = "llama-f32", MODELS["llama-f32"]
    node, _ = open_node(decoder, model_dirs, ipc_dir, model, "tcp", tag="-dedup")
    fresh, _ = open_node(decoder, model_dirs, ipc_dir, model, "tcp", tag="-fresh")
    prefill = PrefillSide(model_dirs[model], spec, "tcp")
    layout = prefill.connector.layout
    per_block = layout.num_layers * layout.page_bytes  # one block, every layer
    a = prompt_of(70, salt=1)  # 4 full blocks + 6 tokens
    b = a[:64] + prompt_of(6, salt=2)  # same first 4 blocks
    c = a[:64] + prompt_of(9, salt=3)
    try:
        def sent(name: str) -> tuple[int, int]:
            return decoder.call("stats", name).get("rx_bytes", 0), prefill.sender.counters["bytes"]

        rx0, tx0 = sent(node)
        assert "tokens" in prefill.transfer(decoder, node, "dd-a", a, 4)
        rx1, tx1 = sent(node)
        assert rx1 - rx0 == tx1 - tx0 == 5 * per_block
        # The decoder holds blocks 0-3 of b: one block crosses the wire.
        result = prefill.transfer(decoder, node, "dd-b", b, 4)
        rx2, tx2 = sent(node)
        assert rx2 - rx1 == tx2 - tx1 == 1 * per_block
        assert result["digest"] == prefill.digests["dd-b"]
        assert result["tokens"] == local_tokens(model_dirs[model], spec, b, 4, 2048)
        # A decoder without them gets all five, including the ones the prefill engine
        # itself took from its own prefix cache (never recomputed, still sent).
        result = prefill.transfer(decoder, fresh, "dd-c", c, 4)
        assert prefill.engine.stats().prefix_cache_hits >= 128
        assert decoder.call("stats", fresh)["rx_bytes"] == 5 * per_block
        assert result["digest"] == prefill.digests["dd-c"]
        assert result["tokens"] == local_tokens(model_dirs[model], spec, c, 4, 2048)
    finally:
        prefill.close()


def test_parallel_samples_recompute_the_first_token_on_the_decoder(decoder, model_dirs, ipc_dir):
    model, spec = "qwen2-f16", MODELS["qwen2-f16"]
    node, _ = open_node(decoder, model_dirs, ipc_dir, model, "tcp", tag="-n")
    prefill = PrefillSide(model_dirs[model], spec, "tcp")
    try:
        prompt = prompt_of(21, salt=5)
        result = prefill.transfer(decoder, node, "n3", prompt, 5, n=3)
        assert result["tokens"] == local_tokens(model_dirs[model], spec, prompt, 5, 2048, n=3)
    finally:
        prefill.close()


# -- faults -------------------------------------------------------------------------


def dying_prefill(conn, model_dir: str, spec: tuple, prompt: list[int], transport: str) -> None:
    """Prefill that sends layer 0's pages, then dies without a word."""
    torch.set_num_threads(1)
    engine = LLMEngine(engine_config(model_dir, ModelSpec(*spec)))
    table = worker_table(engine, sender=TorchDistSender() if transport == "gloo" else ZmqSender())
    conn.send("ready")
    plan = conn.recv()
    hook = engine.layer_hook

    def die_after_layer_0(layer, slices):
        hook(layer, slices)
        if layer == 0:
            # zmq: let the pages reach the wire; gloo: die with the send in flight
            time.sleep(0.3 if transport == "tcp" else 0.0)
            os._exit(3)

    engine.layer_hook = die_after_layer_0
    plan = TransferPlan.unpack(plan)
    table.submit(plan.request_id, prompt, greedy(1), plan=plan)
    table.advance()


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_sender_dies_mid_transfer_reservation_fails_and_frees(decoder, model_dirs, ipc_dir, transport):
    model, spec = "qwen2-f16", MODELS["qwen2-f16"]
    node, _ = open_node(decoder, model_dirs, ipc_dir, model, transport, tag="-die")
    prompt = prompt_of(50, salt=9)
    conn, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=dying_prefill, args=(child, model_dirs[model], tuple(spec.__dict__.values()), prompt, transport))
    proc.start()
    assert conn.poll(WAIT_S) and conn.recv() == "ready"
    rid = f"dying-{transport}"
    conn.send(decoder.call("reserve", node, rid, prompt, 4, 1, 2.0))
    stats = decoder.call("stats", node)
    assert stats["num_free_blocks"] < stats["num_blocks"]
    proc.join(WAIT_S)
    assert proc.exitcode == 3
    result = decoder.wait_result(rid)
    # zmq: pages arrived, then silence until the reservation's deadline. gloo: either
    # that, or the broken connection fails the transfer at once.
    assert "deadline" in result["failed"] or (transport == "gloo" and "connection lost" in result["failed"])
    stats = decoder.call("stats", node)
    if transport == "tcp":
        assert stats["rx_messages"] >= 1  # it did die mid-transfer
    assert stats["num_free_blocks"] == stats["num_blocks"] and not stats["waiting"]
    # The worker goes on serving.
    prefill = PrefillSide(model_dirs[model], spec, transport)
    try:
        assert "tokens" in prefill.transfer(decoder, node, f"after-death-{transport}", prompt, 4)
    finally:
        prefill.close()


def _raw_pages(rid: str, seq: int, runs, page_bytes: int, spec: ModelSpec, heads: int, dim: int, secret: bytes,
               **fields) -> bytes:
    header = PagesHeader(rid, seq, 0, tuple(runs), tuple(c * page_bytes for _, c in runs), spec.dtype, (spec.block_size, heads, dim))
    return encode(sign(PagesHeader(**{**header.__dict__, **fields}), secret))


def test_malformed_frames_are_counted_and_the_decoder_keeps_serving(decoder, model_dirs, ipc_dir):
    model, spec = "llama-f32", MODELS["llama-f32"]
    node, endpoint = open_node(decoder, model_dirs, ipc_dir, model, "tcp", tag="-junk")
    prefill = PrefillSide(model_dirs[model], spec, "tcp")
    page, heads, dim = prefill.connector.layout.page_bytes, prefill.connector.layout.num_kv_heads, prefill.connector.layout.head_dim
    prompt = prompt_of(40, salt=11)  # 3 blocks
    plan = TransferPlan.unpack(decoder.call("reserve", node, "victim", prompt, 3))
    # A sender gone wrong: it holds the reservation's secret, so each of these gets
    # as far as the check it breaks (strangers without the secret: test_security.py).
    secret = plan.secret
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.linger = 0
    rogue.connect(endpoint)
    ok_frame = b"\x01" * page
    junk = {
        "bad_version": [msgpack.packb({"v": VERSION - 1, "kind": "pages"})],
        "bad_header": [b"\x93\x01\x02"],
        "unknown_request": [_raw_pages("nobody", 0, [(0, 1)], page, spec, heads, dim, secret), ok_frame],
        "out_of_range": [_raw_pages("victim", 0, [(2, 5)], page, spec, heads, dim, secret), ok_frame * 5],
        "truncated": [_raw_pages("victim", 0, [(0, 2)], page, spec, heads, dim, secret), ok_frame],
        "oversized": [_raw_pages("victim", 0, [(0, 1)], page, spec, heads, dim, secret), ok_frame + b"\x00"],
        "bad_layout": [_raw_pages("victim", 0, [(0, 1)], page, spec, heads, dim, secret, dtype="bfloat16"), ok_frame],
        "extra_frames": [_raw_pages("victim", 0, [(0, 1)], page, spec, heads, dim, secret), ok_frame, ok_frame],
        "bad_kind": [msgpack.packb({"v": VERSION, "kind": "welcome", "pair": "x", "host": "h", "port": 1, "rank": 0})],
    }
    for frames in junk.values():
        rogue.send_multipart(frames)
    deadline = time.monotonic() + WAIT_S
    while decoder.call("stats", node)["rx_rejected"] < len(junk) and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = decoder.call("stats", node)
    assert {reason: stats.get(f"rx_rejected_{reason}") for reason in junk} == {reason: 1 for reason in junk}
    rogue.close()
    ctx.term()
    # None of it touched the reservation: the real transfer completes.
    try:
        prefill.submit("victim", prompt, plan)
        result = decoder.wait_result("victim", prefill.step)
        prefill.settle()
        assert result["digest"] == prefill.digests["victim"]
        assert result["tokens"] == local_tokens(model_dirs[model], spec, prompt, 3, 2048)
    finally:
        prefill.close()
    stats = decoder.call("stats", node)
    assert stats["num_free_blocks"] == stats["num_blocks"]


# -- deadlines and leases, in one process -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(model_dirs):
    return model_dirs["llama-f32"], MODELS["llama-f32"]


def test_prefill_lease_frees_blocks_when_the_receiver_never_acks(tiny_model):
    model_dir, spec = tiny_model
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes everything, answers nothing
    silent.linger = 0
    silent.bind("tcp://127.0.0.1:*")
    endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
    clock = ManualClock()
    prefill = PrefillSide(model_dir, spec, "tcp", clock=clock, held_lease=0.5)
    prompt = prompt_of(40, salt=3)
    layout = PageLayout.of(prefill.engine.runner.kv_cache)
    plan = TransferPlan("lease", endpoint, "zmq", layout, len(prompt), 0, (), (), secret=new_secret())
    try:
        prefill.submit("lease", prompt, plan)
        prefill.step()
        assert prefill.engine.stats().num_requests_held == 1
        assert prefill.table.get("lease").state is State.HELD
        clock.advance(0.49)
        prefill.step()
        assert prefill.engine.stats().num_requests_held == 1  # within the lease
        clock.advance(0.01)
        prefill.settle()  # asserts every block is free again
        assert prefill.connector.stats["failed"] == 1
        assert silent.poll(1000)  # the pages did go out
    finally:
        prefill.close()
        silent.close()
        ctx.term()


def test_decoder_deadline_and_cancel_free_blocks_and_tell_the_sender(tiny_model):
    model_dir, spec = tiny_model
    decode = LLMEngine(engine_config(model_dir, spec, num_blocks=32))
    receiver = ZmqReceiver(decode.runner.kv_cache, "tcp://127.0.0.1:0")
    clock = ManualClock()
    table = worker_table(decode, receiver=receiver, clock=clock)
    prefill = PrefillSide(model_dir, spec, "tcp", chunk=20)  # 3 steps for 50 tokens
    try:
        # Nobody sends: the reservation expires and its blocks come back.
        table.reserve("lonely", prompt_of(30, salt=1), greedy(2), lease=0.3)
        lonely = table.attach("lonely")
        assert decode.stats().num_free_blocks == 30
        clock.advance(0.3)
        table.advance()
        result = outcome(lonely)
        assert result["failure"] == "expired" and "deadline" in result["failed"]
        assert decode.stats().num_free_blocks == 32
        # Cancelled mid-transfer: the sender hears it, stops, and releases its blocks.
        prompt = prompt_of(50, salt=2)
        _, plan = table.reserve("cancelled", prompt, greedy(2), lease=30.0)
        cancelled = table.attach("cancelled")
        prefill.submit("cancelled", prompt, TransferPlan.unpack(plan))
        prefill.step()  # first chunk's pages go out
        deadline = time.monotonic() + WAIT_S
        while receiver.stats().get("messages", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        table.abort("cancelled")
        while table.connector.decode.expecting() and time.monotonic() < deadline:  # a write may have been landing
            table.advance()
            time.sleep(0.01)
        assert table.get("cancelled") is None and outcome(cancelled)["failure"] == "aborted"  # ended and freed
        prefill.settle()
        assert prefill.connector.stats["failed"] == 1
        decode.check_integrity()
        assert decode.stats().num_free_blocks == 32 and not decode.has_unfinished()
    finally:
        table.connector.close()
        prefill.close()


def test_transfer_plan_round_trips_and_is_checked(tiny_model):
    model_dir, spec = tiny_model
    engine = LLMEngine(engine_config(model_dir, spec))
    layout = PageLayout.of(engine.runner.kv_cache)
    prompt = prompt_of(40, salt=4)
    plan = TransferPlan("t", "tcp://127.0.0.1:1", "zmq", layout, 40, 2, tuple(hash_blocks(prompt, 16)[:2]),
                        (9, 10, 11), new_secret(), None, True)
    assert TransferPlan.unpack(plan.pack()) == plan
    with pytest.raises(ValueError, match="secret"):
        TransferPlan(**{**plan.__dict__, "secret": b""}).validate()
    with pytest.raises(ValueError, match="malformed"):
        TransferPlan.unpack(b"\x81\xa1x\x01")
    with pytest.raises(ValueError, match="skip_blocks"):  # would skip the last block
        TransferPlan("t", "e", "zmq", layout, 40, 3, (b"x",) * 3, (), new_secret()).validate()
    table = worker_table(engine, sender=ZmqSender())
    try:
        with pytest.raises(ValueError, match="cached_block_hashes"):
            table.submit("t", prompt_of(40, salt=5), greedy(1), plan=plan)
        with pytest.raises(ValueError, match="layout"):
            other = PageLayout(layout.num_layers, 16, layout.num_kv_heads, layout.head_dim, "bfloat16")
            table.submit("t", prompt, greedy(1), plan=TransferPlan(**{**plan.__dict__, "layout": other}))
        with pytest.raises(ValueError, match="transport"):
            table.submit("t", prompt, greedy(1), plan=TransferPlan(**{**plan.__dict__, "transport": "torch"}))
        assert not engine.has_unfinished() and not table.live()  # nothing was queued
    finally:
        table.connector.close()
