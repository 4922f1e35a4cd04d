"""The worker registry (services/router/registry.py) and its gRPC face
(services/router/registry_service.py), driven with registration messages.

    WorkerInfo -> register  -> a live handle (its load from one Stats call)
    Load       -> heartbeat -> last_seen, load; an unknown worker: False (NOT_FOUND)
    leave      -> draining: no new request picks it; registering again serves again
    no word for worker_timeout, or Stats unreachable -> dropped: watchers called

No process is started: the workers' Stats is one in-process gRPC server (a fake
Worker servicer) that every registered worker's address points at; KvEvents answers
UNIMPLEMENTED, so each worker's KV subscription ends at once.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.registry import WorkerRegistry
from pdserve.services.router.registry_service import RegistryServicer

MODEL = "tiny"
MAX_MODEL_LEN = 128


class FakeWorker(pb_grpc.WorkerServicer):
    """Answers Stats with `stats`, or UNAVAILABLE while `down`; counts the calls."""

    def __init__(self) -> None:
        self.stats = pb.StatsResponse(num_free_blocks=40, num_running=2, num_waiting=1)
        self.down = False
        self.calls = 0

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        self.calls += 1
        if self.down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker: down")
        return self.stats

    def KvEvents(self, request: pb.KvEventsRequest, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake worker: no KV events")  # the subscription ends


@pytest.fixture
def worker():
    servicer = FakeWorker()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    server.stop(None)


def new_registry(**config) -> WorkerRegistry:
    settings = dict(port=0, worker_timeout=2.0, heartbeat_interval=0.1, stats_interval=60.0)
    return WorkerRegistry(RouterConfig(**{**settings, **config}), MODEL, MAX_MODEL_LEN)


@pytest.fixture
def registry():
    registry = new_registry()
    yield registry
    registry.stop()


def info(worker: FakeWorker, worker_id: str = "d0", role: int = pb.ROLE_DECODE, **fields) -> pb.WorkerInfo:
    values = dict(worker_id=worker_id, role=role, address=worker.address, model=MODEL, block_size=16,
                  max_model_len=MAX_MODEL_LEN, num_blocks=64, pid=1000)
    return pb.WorkerInfo(**{**values, **fields})


def wait_until(condition, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# -- joining ------------------------------------------------------------------------------


def test_a_worker_joins_with_the_load_its_stats_report(registry, worker):
    registry.register(info(worker, kv_endpoint="tcp://d0:1"))
    [handle] = registry.live()
    assert (handle.worker_id, handle.role, handle.can_decode, handle.can_prefill_remote) == ("d0", "decode", True, False)
    assert (handle.free_blocks, handle.running, handle.waiting, handle.inflight) == (40, 2, 1, 0)
    assert handle.info == info(worker, kv_endpoint="tcp://d0:1") and not handle.dropped and not handle.draining
    assert worker.calls == 1  # it was asked before it joined


def test_roles_decide_what_a_worker_is_picked_for(registry, worker):
    registry.register(info(worker, "p0", pb.ROLE_PREFILL, kv_endpoint="tcp://p0:1"))
    registry.register(info(worker, "p1", pb.ROLE_PREFILL))  # no KV endpoint: it cannot send KV
    registry.register(info(worker, "m0", pb.ROLE_MIXED, kv_endpoint="tcp://m0:1"))
    roles = {h.worker_id: (h.role, h.can_decode, h.can_prefill_remote) for h in registry.live()}
    assert roles == {"p0": ("prefill", False, True), "p1": ("prefill", False, False), "m0": ("mixed", True, True)}
    assert registry.acquire_decode((), exclude=()).worker_id == "m0"
    assert registry.acquire_prefill((), exclude={"m0"}).worker_id == "p0"
    assert registry.acquire_prefill((), exclude={"m0", "p0"}) is None


@pytest.mark.parametrize("fields, field", [
    (dict(worker_id=""), "worker_id"),
    (dict(role=pb.ROLE_UNSPECIFIED), "role"),
    (dict(role=77), "role"),
    (dict(address=""), "address"),
    (dict(model="other"), "model"),
    (dict(model="x" * 100_000), "model"),
    (dict(block_size=32), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=MAX_MODEL_LEN - 1), "max_model_len"),
])
def test_a_registration_that_does_not_fit_is_refused_naming_the_field(registry, worker, fields, field):
    with pytest.raises(ValueError, match=rf"^worker\.{field}: "):
        registry.register(info(worker, **fields))
    assert registry.live() == [] and worker.calls == 0  # refused before the worker is called


def test_a_worker_whose_kv_pages_differ_from_the_registered_ones_is_refused(registry, worker):
    registry.register(info(worker, "d0", kv_layout="bfloat16;plain"))
    with pytest.raises(ValueError, match=r"^worker\.kv_layout: 'float8;fp8'.*'bfloat16;plain'"):
        registry.register(info(worker, "d1", kv_layout="float8;fp8"))
    registry.register(info(worker, "d2", kv_layout="bfloat16;plain"))
    registry.register(info(worker, "d3"))  # one that does not say: not compared
    with pytest.raises(ValueError, match=r"^worker\.kv_layout: "):  # d0 restarted with other pages: d2 holds them
        registry.register(info(worker, "d0", kv_layout="float8;fp8", pid=1001))
    assert sorted(h.worker_id for h in registry.live()) == ["d0", "d2", "d3"]
    assert registry.live()[0].info.pid == 1000  # the old d0 still serves
    registry.drop(next(h for h in registry.live() if h.worker_id == "d2"), "test")
    registry.register(info(worker, "d0", kv_layout="float8;fp8", pid=1001))  # alone with a layout: it may change
    assert {h.worker_id: h.info.kv_layout for h in registry.live()} == {"d0": "float8;fp8", "d3": ""}


def test_a_worker_that_does_not_answer_is_refused_naming_its_address():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    registry = new_registry(worker_timeout=1.0)
    try:
        with pytest.raises(ConnectionError, match=f"^address: {address} does not answer Stats"):
            registry.register(pb.WorkerInfo(worker_id="d0", role=pb.ROLE_DECODE, address=address, model=MODEL,
                                             block_size=16, max_model_len=MAX_MODEL_LEN))
        assert registry.live() == []
    finally:
        registry.stop()


# -- heartbeats, re-registration, leaving --------------------------------------------------


def test_a_heartbeat_updates_a_known_worker_and_tells_an_unknown_one_to_register(registry, worker):
    assert not registry.heartbeat("d0", pb.Load(num_free_blocks=1))
    registry.register(info(worker))
    [handle] = registry.live()
    before = handle.last_seen
    assert registry.heartbeat("d0", pb.Load(num_free_blocks=7, num_running=3, num_waiting=5))
    assert (handle.free_blocks, handle.running, handle.waiting) == (7, 3, 5) and handle.last_seen >= before
    assert not registry.heartbeat("d1", pb.Load())


def test_the_same_process_registering_again_keeps_its_handle_and_serves_again(registry, worker):
    registry.register(info(worker))
    [handle] = registry.live()
    dropped = []
    registry.watch(handle, lambda: dropped.append("d0"))
    assert registry.leave("d0") and handle.draining
    assert registry.acquire_decode((), exclude=()) is None  # draining: no new request picks it
    registry.register(info(worker))
    assert registry.live() == [handle] and not handle.draining and not handle.dropped and dropped == []
    assert registry.acquire_decode((), exclude=()) is handle
    assert worker.calls == 1  # kept: not asked again


def test_a_new_process_under_the_same_id_replaces_the_old_handle(registry, worker):
    registry.register(info(worker, pid=1000))
    [old] = registry.live()
    dropped = []
    registry.watch(old, lambda: dropped.append("old"))
    registry.register(info(worker, pid=2000))  # the worker restarted
    [new] = registry.live()
    assert new is not old and new.info.pid == 2000
    assert old.dropped and dropped == ["old"]  # its calls in flight learn it is gone
    with pytest.raises(ValueError):  # its channel is closed
        old.stub.Stats(pb.StatsRequest(), timeout=1)


def test_leaving_is_draining_and_an_unknown_worker_cannot_leave(registry, worker):
    assert not registry.leave("d0")
    registry.register(info(worker, "d0"))
    registry.register(info(worker, "d1"))
    assert registry.leave("d0")
    picks = {registry.acquire_decode((), exclude=()).worker_id for _ in range(3)}
    assert picks == {"d1"}
    assert {h.worker_id: h.draining for h in registry.live()} == {"d0": True, "d1": False}  # still listed


def test_why_no_prefill_worker_can_take_a_request(worker):
    registry = new_registry(max_prefill_queue=1)
    try:
        assert registry.no_remote_prefill() == "no_prefill_worker" and not registry.has_remote_prefill()
        worker.stats = pb.StatsResponse(num_waiting=0)
        registry.register(info(worker, "p0", pb.ROLE_PREFILL, kv_endpoint="tcp://p0:1"))
        assert registry.no_remote_prefill() is None and registry.has_remote_prefill()
        handle = registry.acquire_prefill((), exclude=set())
        assert handle.inflight == 1 and registry.no_remote_prefill() == "queue_full"
        assert registry.acquire_prefill((), exclude=set()) is None
        registry.release(handle)
        assert handle.inflight == 0 and registry.no_remote_prefill() is None
        registry.leave("p0")
        assert registry.no_remote_prefill() == "draining"
    finally:
        registry.stop()


# -- choosing -----------------------------------------------------------------------------


def test_bookings_spread_concurrent_picks_and_exclusion_is_by_handle(registry, worker):
    registry.register(info(worker, "d0"))
    registry.register(info(worker, "d1"))
    first = registry.acquire_decode((), exclude=())
    second = registry.acquire_decode((), exclude=())
    assert {first.worker_id, second.worker_id} == {"d0", "d1"} and first.inflight == second.inflight == 1
    assert registry.acquire_decode((), exclude=(first, second)) is None
    registry.release(first)
    assert registry.acquire_decode((), exclude=()) is first  # the less loaded
    stale = first
    registry.register(info(worker, first.worker_id, pid=3000))  # the same id, a new handle
    assert registry.acquire_decode((), exclude=(stale, second)).worker_id == first.worker_id


def test_the_decode_worker_with_the_longest_cached_prefix_wins_a_tie(registry, worker):
    registry.register(info(worker, "d0"))
    registry.register(info(worker, "d1"))
    hashes = (b"a" * 16, b"b" * 16)
    cached = next(h for h in registry.live() if h.worker_id == "d1")
    cached.kv.hashes.update(hashes)
    assert registry.acquire_decode(hashes, exclude=()).worker_id == "d1"


def test_waiting_for_a_decode_worker_ends_when_one_joins(registry, worker):
    assert not registry.wait_for_decode((), timeout=0.05)
    joiner = threading.Timer(0.1, lambda: registry.register(info(worker)))
    joiner.start()
    try:
        assert registry.wait_for_decode((), timeout=10.0)
    finally:
        joiner.join()
    [handle] = registry.live()
    assert not registry.wait_for_decode((handle,), timeout=0.05)


def test_watching_a_dropped_worker_calls_at_once_and_unwatching_stops_the_call(registry, worker):
    registry.register(info(worker))
    [handle] = registry.live()
    calls = []
    unwatch = registry.watch(handle, lambda: calls.append("unwatched"))
    registry.watch(handle, lambda: calls.append("watched"))
    unwatch()
    registry.drop(handle, "test")
    assert calls == ["watched"] and handle.dropped and registry.live() == []
    registry.watch(handle, lambda: calls.append("late"))
    assert calls == ["watched", "late"]
    registry.drop(handle, "again")  # a second drop changes nothing
    assert calls == ["watched", "late"]


# -- expiry (the monitor thread) ----------------------------------------------------------


def test_a_worker_that_stops_heartbeating_expires_and_must_register_again(worker):
    registry = new_registry(worker_timeout=0.5)
    try:
        registry.register(info(worker))
        [handle] = registry.live()
        dropped = threading.Event()
        registry.watch(handle, dropped.set)
        registry.start()
        for _ in range(10):  # 1 s of heartbeats: twice the timeout, still live
            assert registry.heartbeat("d0", pb.Load(num_free_blocks=9))
            time.sleep(0.1)
        assert registry.live() == [handle] and not dropped.is_set()
        assert dropped.wait(10.0) and handle.dropped and registry.live() == []
        assert not registry.heartbeat("d0", pb.Load())  # NOT_FOUND: it registers anew
        registry.register(info(worker))
        assert [h.worker_id for h in registry.live()] == ["d0"] and registry.live()[0] is not handle
    finally:
        registry.stop()


def test_a_worker_whose_stats_are_unreachable_is_dropped_at_the_next_probe(worker):
    registry = new_registry(worker_timeout=5.0)
    try:
        registry.register(info(worker))
        [handle] = registry.live()
        registry.start()
        assert wait_until(lambda: worker.calls >= 2)  # the first poll: reachable, kept
        assert registry.live() == [handle]
        worker.down = True
        registry.probe_soon()
        assert wait_until(lambda: handle.dropped) and registry.live() == []
    finally:
        registry.stop()


def test_a_stats_poll_refreshes_the_load(worker):
    registry = new_registry(worker_timeout=5.0, stats_interval=0.1)
    try:
        registry.register(info(worker))
        [handle] = registry.live()
        worker.stats = pb.StatsResponse(num_free_blocks=3, num_running=4, num_waiting=6)
        registry.start()
        assert wait_until(lambda: (handle.free_blocks, handle.running, handle.waiting) == (3, 4, 6))
    finally:
        registry.stop()


# -- the Registry service -----------------------------------------------------------------


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class FakeContext:
    def abort(self, code: grpc.StatusCode, details: str):
        raise Aborted(code, details)


@pytest.fixture
def service(registry):
    return RegistryServicer(registry, registry.config)


def call(method, request) -> Aborted:
    with pytest.raises(Aborted) as info:
        method(request, FakeContext())
    return info.value


def test_the_service_registers_and_says_how_often_to_heartbeat(service, worker):
    reply = service.Register(pb.RegisterRequest(worker=info(worker)), FakeContext())
    assert (reply.heartbeat_interval_seconds, reply.timeout_seconds) == (0.1, 2.0)
    listed = service.ListWorkers(pb.ListWorkersRequest(), FakeContext())
    assert [w.worker_id for w in listed.workers] == ["d0"] and listed.workers[0] == info(worker)


def test_the_service_answers_a_bad_registration_invalid_argument_and_a_silent_worker_unavailable(service, worker):
    refused = call(service.Register, pb.RegisterRequest(worker=info(worker, model="other")))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and refused.details.startswith("worker.model: ")
    refused = call(service.Register, pb.RegisterRequest())  # no worker at all
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and refused.details.startswith("worker.worker_id: ")
    worker.down = True
    refused = call(service.Register, pb.RegisterRequest(worker=info(worker)))
    assert refused.code == grpc.StatusCode.UNAVAILABLE and refused.details.startswith(f"address: {worker.address}")
    assert service.ListWorkers(pb.ListWorkersRequest(), FakeContext()).workers == []


def test_the_service_tells_an_unknown_worker_not_found_on_heartbeat_and_leave(service, worker):
    for method, request in ((service.Heartbeat, pb.HeartbeatRequest(worker_id="ghost")),
                            (service.Leave, pb.LeaveRequest(worker_id="ghost"))):
        refused = call(method, request)
        assert refused.code == grpc.StatusCode.NOT_FOUND and refused.details == "worker_id: 'ghost' is not registered"
    service.Register(pb.RegisterRequest(worker=info(worker)), FakeContext())
    service.Heartbeat(pb.HeartbeatRequest(worker_id="d0", load=pb.Load(num_free_blocks=11)), FakeContext())
    assert service.registry.live()[0].free_blocks == 11
    service.Leave(pb.LeaveRequest(worker_id="d0"), FakeContext())
    assert service.registry.live()[0].draining


def test_the_service_counts_live_and_draining_workers_by_pool(service, worker):
    for worker_id, role in (("p0", pb.ROLE_PREFILL), ("d0", pb.ROLE_DECODE), ("d1", pb.ROLE_DECODE)):
        service.Register(pb.RegisterRequest(worker=info(worker, worker_id, role)), FakeContext())
    service.Leave(pb.LeaveRequest(worker_id="d1"), FakeContext())
    reply = service.Scale(pb.ScaleRequest(), FakeContext())
    assert (reply.live.prefill, reply.live.decode, reply.draining.decode, reply.draining.prefill) == (1, 1, 1, 0)
