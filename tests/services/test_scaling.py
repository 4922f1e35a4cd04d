"""Pool targets (Registry.Scale) and draining (Worker.Drain, Registry.Leave) with an
in-process router and decode worker; the launchers acting on them are exercised by
tests/launch/test_ray_launcher.py."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from cluster_helpers import Stream, wait_for
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import Client
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.node import Worker


@pytest.fixture(scope="module")
def cluster():
    torch.set_num_threads(1)
    router = Router(RouterConfig(port=0, admission_timeout=0.0))  # UNAVAILABLE at once with no decode worker serving
    address = router.start()
    worker = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-t", num_blocks=128))
    worker.start()
    channel = grpc.insecure_channel(router.internal_address)
    yield address, pb_grpc.RegistryStub(channel), worker
    channel.close()
    worker.stop()
    router.stop()


def scale(registry, manager: str = "", **target: int) -> pb.ScaleResponse:
    return registry.Scale(pb.ScaleRequest(target=pb.PoolSizes(**target), manager=manager), timeout=5)


def error_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_targets_need_a_launcher_that_reads_them(cluster):
    _, registry, _ = cluster
    code, details = error_of(lambda: scale(registry, decode=2))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no launcher" in details
    reply = scale(registry)  # reading needs nobody
    assert not reply.target.HasField("decode") and reply.live.decode == 1 and reply.manager == ""
    reply = scale(registry, manager="test-launcher")
    assert reply.manager == "test-launcher"
    reply = scale(registry, decode=3)  # now an operator may set one
    assert reply.target.decode == 3 and not reply.target.HasField("prefill") and reply.live.decode == 1
    assert scale(registry, manager="test-launcher").target.decode == 3


@pytest.mark.parametrize("target, field", [
    (dict(decode=0, mixed=0), "target.decode"),
    (dict(prefill=257), "target.prefill"),
])
def test_bad_targets_name_the_field(cluster, target, field):
    _, registry, _ = cluster
    scale(registry, manager="test-launcher")
    code, details = error_of(lambda: scale(registry, **target))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details


def test_leave_of_an_unknown_worker_is_not_found(cluster):
    _, registry, _ = cluster
    code, _ = error_of(lambda: registry.Leave(pb.LeaveRequest(worker_id="nobody"), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND


def test_bad_drain_grace_is_invalid_argument(cluster):
    _, _, worker = cluster
    with grpc.insecure_channel(worker.address) as channel:
        code, details = error_of(lambda: pb_grpc.WorkerStub(channel).Drain(pb.DrainRequest(grace_seconds=-1), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("grace_seconds")


def test_a_draining_worker_finishes_its_stream_and_gets_nothing_new(cluster):
    """Run last in this module: the worker leaves the pools for good."""
    address, registry, worker = cluster
    with Client(address, timeout=60) as client:
        running = Stream(client, "def fib(n):\n", max_tokens=300, temperature=0.0, ignore_eos=True)
        wait_for(lambda: running.tokens, 30, "the stream to start")
        drained: list[pb.DrainResponse] = []
        with grpc.insecure_channel(worker.address) as channel:
            drain = threading.Thread(target=lambda: drained.append(
                pb_grpc.WorkerStub(channel).Drain(pb.DrainRequest(grace_seconds=60), timeout=90)))
            drain.start()
            wait_for(lambda: scale(registry).draining.decode == 1, 10, "the router to see the worker draining")
            assert scale(registry).live.decode == 0
            with pytest.raises(grpc.RpcError) as info:  # nothing new reaches it
                list(client.generate("import os", max_tokens=2))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert drain.is_alive()  # still finishing the running stream
            running.join(60)
            drain.join(30)
    assert running.error is None and len(running.tokens) == 300
    assert drained[0].drained and drained[0].remaining == 0
    assert worker.loop.stats(5).num_free_blocks == worker.engine.pool.num_blocks
