"""The router's prefill/decode path through the KV seam, in one process.

The transfer here is a test double (`LoopbackConnector`): it copies pages between
two engines in this process, standing in for kvtransfer's connector, so the
router's Reserve -> Prefill -> Decode flow and the workers' Reserve/Prefill
handlers run for real over gRPC.
"""

from __future__ import annotations


import grpc
import pytest
import torch

from cluster_helpers import all_blocks_free, stats, wait_for
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.engine import Reservation
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.worker.engine_loop import EngineLoop
from pdserve.services.worker.kv_seam import Connector, TransferTarget
from pdserve.services.worker.main import Worker

PROMPTS = ["import os\n\n\ndef " * 6, "class Stack:\n    def __init__(self):\n        " * 3, "for i in range("]
# Fresh long prompts: one the decode worker has already received is cached there,
# and prefills locally (its uncached part is below the threshold).
FIB = "def fib(n):\n    return n\n" * 5
SORT = "def sort(xs):\n    return sorted(xs)\n" * 4


class LoopbackReceiver:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.loop: EngineLoop | None = None
        self.expected: dict[str, Reservation] = {}
        self.cancelled: list[str] = []

    def bind(self, loop: EngineLoop) -> None:
        self.loop = loop

    def expect(self, reservation: Reservation, prompt, params, deadline: float) -> bytes:
        self.expected[reservation.request_id] = reservation
        return f"plan:{reservation.request_id}".encode()

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.expected.pop(request_id, None)

    def close(self) -> None:
        pass


class LoopbackSender:
    """Copies a finished prefill's held blocks into the receiver's reserved ones."""

    def __init__(self, receivers: dict[str, LoopbackReceiver]) -> None:
        self.endpoint = "loopback-sender"
        self.receivers = receivers
        self.loop: EngineLoop | None = None
        self.targets: dict[str, TransferTarget] = {}
        self.shipped: list[str] = []

    def bind(self, loop: EngineLoop) -> None:
        self.loop = loop

    def start(self, target: TransferTarget) -> None:
        self.targets[target.request_id] = target

    def finish(self, request_id: str, first_token: int | None) -> None:
        target = self.targets.pop(request_id)
        assert target.plan == f"plan:{request_id}".encode()  # the router passed it through
        receiver = self.receivers[target.kv_endpoint]
        src = self.loop.call(lambda e: e.held_block_ids(request_id), timeout=5)
        skip = target.num_cached_tokens // receiver.loop.engine.config.cache.block_size
        dst_cache = receiver.loop.engine.runner.kv_cache
        src_cache = self.loop.engine.runner.kv_cache
        for i in range(skip, len(target.block_ids)):
            dst_cache[:, target.block_ids[i]] = src_cache[:, src[i]]
        receiver.loop.commit_remote(request_id, first_token)
        self.loop.release(request_id)
        self.shipped.append(request_id)

    def cancel(self, request_id: str) -> None:
        self.targets.pop(request_id, None)

    def close(self) -> None:
        pass


def loopback_pair(router: Router, suffix: str, decode_blocks: int, prefill_blocks: int = 256):
    """decode-<suffix> and prefill-<suffix> (not started), registering with `router`,
    the KV crossing through the loopback double: (receiver, sender, decode, prefill)."""
    receiver = LoopbackReceiver(f"loopback://decode-{suffix}")
    sender = LoopbackSender({receiver.endpoint: receiver})
    decode = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id=f"decode-{suffix}",
                                 num_blocks=decode_blocks), Connector(receiver=receiver))
    prefill = Worker(WorkerConfig(role="prefill", router=router.internal_address, worker_id=f"prefill-{suffix}",
                                  num_blocks=prefill_blocks), Connector(sender=sender))
    return receiver, sender, decode, prefill


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(num_blocks=256)


@pytest.fixture(scope="module")
def cluster():
    router = Router(RouterConfig(port=0, local_prefill_threshold=20, worker_timeout=3.0))
    address = router.start()
    receiver, sender, decode, prefill = loopback_pair(router, "0", decode_blocks=256)
    decode.start()
    prefill.start()
    client = Client(address, timeout=60)
    yield dict(router=router, client=client, decode=decode, prefill=prefill, sender=sender, receiver=receiver)
    client.close()
    prefill.stop()
    decode.stop()
    router.stop()


def test_long_prompts_prefill_remotely_short_ones_locally(cluster, llm):
    params = dict(max_tokens=12, temperature=0.0)
    want = llm.generate(PROMPTS, SamplingParams(**params))
    got = [collect(cluster["client"].generate(p, **params))[0] for p in PROMPTS]
    for w, g in zip(want, got):
        assert list(g.token_ids) == w.outputs[0].token_ids and g.text == w.outputs[0].text
        assert g.usage.completion_tokens == 12 and g.timing.ttft_seconds > 0
    assert len(cluster["sender"].shipped) == 2  # the short prompt stayed on the decode worker


def test_parallel_samples_prefill_once_and_fork_on_decode(cluster, llm):
    params = dict(max_tokens=8, temperature=0.7, seed=3, n=2)
    want = llm.generate([FIB], SamplingParams(**params))[0]
    shipped = len(cluster["sender"].shipped)
    got = collect(cluster["client"].generate(FIB, **params))
    assert [list(got[i].token_ids) for i in (0, 1)] == [c.token_ids for c in want.outputs]
    assert len(cluster["sender"].shipped) == shipped + 1


def test_logprobs_of_the_first_token_come_from_prefill(cluster, llm):
    shipped = len(cluster["sender"].shipped)
    want = llm.generate([SORT], SamplingParams(max_tokens=5, temperature=0.0, logprobs=1))[0].outputs[0]
    got = collect(cluster["client"].generate(SORT, max_tokens=5, temperature=0.0, logprobs=1))[0]
    assert len(cluster["sender"].shipped) == shipped + 1
    assert [lp.token_id for lp in got.logprobs] == want.token_ids
    assert got.logprobs[0].logprob == pytest.approx(want.logprobs[0][want.token_ids[0]], abs=1e-4)


def test_cancel_during_disaggregated_stream_frees_both_sides(cluster):
    call = cluster["client"].generate("x = 1\n" * 40, max_tokens=500, temperature=0.0, ignore_eos=True)
    next(call)
    next(call)
    call.cancel()
    for worker in (cluster["decode"], cluster["prefill"]):
        wait_for(lambda: all_blocks_free(worker.address), 10, f"{worker.config.id}'s blocks to be free")
    assert cluster["receiver"].cancelled  # told before its blocks were freed


def test_bad_input_reaches_no_worker(cluster):
    shipped = len(cluster["sender"].shipped)
    with pytest.raises(grpc.RpcError) as info:
        list(cluster["client"].generate(PROMPTS[0], max_tokens=5, top_p=0.0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(cluster["sender"].shipped) == shipped


def test_without_a_prefill_worker_decode_prefills_itself(cluster, llm):
    cluster["prefill"].stop()
    cluster["router"].registry.probe_soon()
    wait_for(lambda: not cluster["router"].registry.has_remote_prefill(), 10, "the prefill worker to be dropped")
    want = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].token_ids
    shipped = len(cluster["sender"].shipped)
    got = collect(cluster["client"].generate(PROMPTS[0], max_tokens=6, temperature=0.0))[0]
    assert list(got.token_ids) == want and len(cluster["sender"].shipped) == shipped
    assert all_blocks_free(cluster["decode"].address)
    assert stats(cluster["decode"].address).num_reserved == 0


def test_a_dead_prefill_worker_is_skipped_for_the_next(llm, caplog):
    """The router still lists prefill-b (no poll yet) but it is gone: prefill-a serves."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=0, stats_interval=60.0, worker_timeout=60.0,
                                 heartbeat_interval=30.0))
    address = router.start()
    receiver = LoopbackReceiver("loopback://decode-x")
    senders = {name: LoopbackSender({receiver.endpoint: receiver}) for name in ("prefill-a", "prefill-b")}
    decode = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-x", num_blocks=64),
                    Connector(receiver=receiver))
    prefills = {name: Worker(WorkerConfig(role="prefill", router=router.internal_address, worker_id=name, num_blocks=64),
                             Connector(sender=sender)) for name, sender in senders.items()}
    try:
        for worker in (decode, *prefills.values()):
            worker.start()
        prefills["prefill-b"].stop()  # the router would pick it first (ties go to the larger id)
        want = llm.generate([SORT], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].token_ids
        with Client(address, timeout=60) as client:
            got = collect(client.generate(SORT, max_tokens=6, temperature=0.0))[0]
        assert list(got.token_ids) == want
        assert (len(senders["prefill-a"].shipped), len(senders["prefill-b"].shipped)) == (1, 0)
        assert "prefill on prefill-b failed" in caplog.text
        wait_for(lambda: all_blocks_free(decode.address) and all_blocks_free(prefills["prefill-a"].address), 10,
                 "every block to be free")
    finally:
        for worker in (decode, prefills["prefill-a"]):
            worker.stop()
        router.stop()


def test_a_reservation_without_room_prefills_on_the_decode_worker(llm):
    """The decode worker's cache is busy with one request: a second one's Reserve finds
    no room (RESOURCE_EXHAUSTED, a transient state). The router prefills it on the
    decode worker instead, whose scheduler queues it until room frees, rather than
    failing it with UNAVAILABLE (found by tests/test_load.py with a small cache)."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=0))
    address = router.start()
    _, sender, decode, prefill = loopback_pair(router, "r", decode_blocks=16)
    busy, queued = list(range(100, 260)), list(range(300, 400))  # 10 and 7 of the decode worker's 16 blocks
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = llm.generate([queued], SamplingParams(**params))[0].outputs[0].token_ids
    try:
        decode.start()
        prefill.start()
        with Client(address, timeout=60) as client:
            first = client.generate(busy, **params)
            next(first)  # running on the decode worker, its blocks held
            got = collect(client.generate(queued, **params))[0]
            assert len(collect(first)[0].token_ids) == params["max_tokens"] - 1
        assert list(got.token_ids) == want
        assert len(sender.shipped) == 1  # only the first request's KV crossed
        wait_for(lambda: all_blocks_free(decode.address) and all_blocks_free(prefill.address), 10,
                 "every block to be free")
    finally:
        prefill.stop()
        decode.stop()
        router.stop()


def test_a_call_whose_deadline_passed_counts_as_deadline_exceeded(cluster):
    """The router's failure counter tells a passed deadline from a client's cancel
    (both leave the call inactive; the load test saw every deadline counted as a cancel)."""
    metrics = cluster["router"].metrics
    before = {code: metrics.registry.get_sample_value("pdserve:request_failure_total", {
        "model_name": "pdserve-tiny-code", "role": "router", "worker": "router", "code": code}) or 0.0
        for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
    call = cluster["client"].generate("x = 2\n" * 40, max_tokens=700, temperature=0.0, ignore_eos=True, timeout=1.0)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def counted(code: str) -> float:
        return (metrics.registry.get_sample_value("pdserve:request_failure_total", {
            "model_name": "pdserve-tiny-code", "role": "router", "worker": "router", "code": code}) or 0.0) - before[code]

    wait_for(lambda: counted("DEADLINE_EXCEEDED") == 1, 10, "the router to count the deadline")
    assert counted("CANCELLED") == 0
    wait_for(lambda: all_blocks_free(cluster["decode"].address), 10, "the decode worker's blocks to be free")
