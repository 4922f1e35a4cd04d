"""The retrying Client against real gRPC servers on loopback: routers that are
stopped, refuse (UNAVAILABLE, RESOURCE_EXHAUSTED with the router's retry hint in
trailing metadata) or cut a stream after some tokens; and the published service
config, given to a plain grpcio channel, retries the same way."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import SERVICE_CONFIG, Client, RetryPolicy, collect, lookup, resolve
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router

Reply = Callable[[grpc.ServicerContext], Iterator[pb.GenerateResponse]]


def serve(context: grpc.ServicerContext, tokens: int = 4) -> Iterator[pb.GenerateResponse]:
    for t in range(tokens):
        yield pb.GenerateResponse(request_id="r", token_ids=[t], text=f"<{t}>",
                                  finish_reason="length" if t == tokens - 1 else "")


def refuse(code: grpc.StatusCode, retry_after_ms: int | None = None) -> Reply:
    def reply(context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        if retry_after_ms is not None:  # as services/router/service.py's _abort does
            ms = str(retry_after_ms)
            context.set_trailing_metadata((("retry-after-ms", ms), ("grpc-retry-pushback-ms", ms)))
        context.abort(code, f"refused by the test ({code.name})")
        yield from ()
    return reply


def cut_after(messages: int, token: bytes = b"", code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> Reply:
    """`messages` of two tokens each, the first with the resume `token` (b"": a router
    that issues none), then `code`."""
    def reply(context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        for t in range(messages):
            state = pb.ResumeState(token=token if t == 0 else b"", logprob_sum=-1.0 * (t + 1))
            yield pb.GenerateResponse(request_id="r", token_ids=[2 * t, 2 * t + 1], resume_state=state)
        context.abort(code, "the router died")
    return reply


def resumed_from(start: int, tokens: int = 3) -> Reply:
    """What a router resuming the stream sends: tokens from `start`, then the final message."""
    def reply(context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        for t in range(start, start + tokens):
            yield pb.GenerateResponse(request_id="r", token_ids=[t], resume_state=pb.ResumeState(token=b"tok"),
                                      finish_reason="length" if t == start + tokens - 1 else "")
    return reply


class FakeRouter(pb_grpc.GenerationServicer):
    """A real gRPC server with the router's public service: each call takes the
    next scripted reply (then `serve`) and records when it arrived."""

    def __init__(self, *replies: Reply, host: str = "127.0.0.1", port: int = 0) -> None:
        self.replies = list(replies)
        self.arrivals: list[float] = []
        self.requests: list[pb.GenerateRequest] = []
        self.server = grpc.server(ThreadPoolExecutor(8))
        pb_grpc.add_GenerationServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"
        self.server.start()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        self.arrivals.append(time.monotonic())
        self.requests.append(request)
        reply = self.replies.pop(0) if self.replies else serve
        yield from reply(context)

    def ListModels(self, request, context):
        self.arrivals.append(time.monotonic())
        return pb.ListModelsResponse(models=[pb.ModelInfo(name="fake")])

    def stop(self) -> None:
        self.server.stop(None)


@pytest.fixture
def routers():
    made: list[FakeRouter] = []

    def make(*replies: Reply, **kwargs) -> FakeRouter:
        made.append(FakeRouter(*replies, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.stop()


def tokens_of(call) -> list[int]:
    return [t for seq in collect(call).values() for t in seq.token_ids]


QUICK = RetryPolicy(max_attempts=5, initial_backoff=0.05, max_backoff=0.2)


def test_a_stopped_router_is_passed_over_for_the_next(routers):
    dead, alive = routers(), routers()
    dead.stop()
    started = time.monotonic()
    with Client([dead.address, alive.address], timeout=10, retry=QUICK, seed=1) as client:
        for _ in range(6):
            assert tokens_of(client.generate("x", max_tokens=4)) == [0, 1, 2, 3]
        assert client.list_models()[0].name == "fake"
    assert len(alive.arrivals) == 7
    assert time.monotonic() - started < 3  # one backoff at most per call, none once the dead one is known


def test_a_real_router_without_workers_sends_the_call_to_another(routers):
    """A real router with no decode worker answers UNAVAILABLE at once: the call
    goes on to the router that can serve, and the caller sees only success."""
    empty = Router(RouterConfig(port=0, admission_timeout=0.0))
    address = empty.start()
    alive = routers()
    try:
        with Client(f"{address},{alive.address}", timeout=10, retry=QUICK, seed=2) as client:
            for _ in range(4):
                assert tokens_of(client.generate("x", max_tokens=4)) == [0, 1, 2, 3]
    finally:
        empty.stop()
    assert len(alive.arrivals) == 4


def test_the_retry_hint_is_honoured_by_the_router_that_gave_it(routers):
    full = routers(refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, 400), refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, 400))
    with Client(full.address, timeout=10, retry=QUICK) as client:
        assert tokens_of(client.generate("x")) == [0, 1, 2, 3]
    gaps = [b - a for a, b in zip(full.arrivals, full.arrivals[1:])]
    assert len(gaps) == 2 and min(gaps) >= 0.4, gaps


def test_another_router_is_tried_without_waiting_for_a_hint(routers):
    full, free = routers(refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, 5000)), routers()
    started = time.monotonic()
    with Client([full.address, free.address], timeout=10, retry=QUICK, seed=3) as client:
        assert tokens_of(client.generate("x")) == [0, 1, 2, 3]
    assert time.monotonic() - started < 2 and len(full.arrivals) == 1 and len(free.arrivals) == 1


def test_a_router_the_call_has_not_tried_is_asked_without_backing_off(routers):
    """A policy whose every backoff is 5 s: the call refused UNAVAILABLE by one router
    goes to the other at once (a backoff protects the router that failed, not
    another); a second refusal by the same router waits."""
    slow = RetryPolicy(max_attempts=5, initial_backoff=5.0, max_backoff=5.0, multiplier=1.0)
    down, free = routers(refuse(grpc.StatusCode.UNAVAILABLE)), routers()
    started = time.monotonic()
    with Client([down.address, free.address], timeout=30, retry=slow, seed=3) as client:
        assert tokens_of(client.generate("x")) == [0, 1, 2, 3]
    assert len(down.arrivals) == 1 and len(free.arrivals) == 1
    assert free.arrivals[0] - down.arrivals[0] < 2.0, "backed off before a router not tried yet"
    assert time.monotonic() - started < 10


def test_the_deadline_bounds_every_retry(routers):
    down = routers(*[refuse(grpc.StatusCode.UNAVAILABLE)] * 100)
    patient = RetryPolicy(max_attempts=100, initial_backoff=0.2, max_backoff=0.4)
    with Client(down.address, timeout=1.0, retry=patient) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate("x"))
        took = time.monotonic() - started
    assert took <= 1.05, took
    # Either the client gives up before a backoff that would outlast the deadline, or,
    # on a loaded machine, the deadline passes inside an attempt; both end by it.
    code, details = info.value.code(), info.value.details()
    if code == grpc.StatusCode.UNAVAILABLE:
        assert "gave up: the deadline" in details, details
    else:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, code
        assert "deadline passed during attempt" in details and "UNAVAILABLE x" in details, details
    assert len(down.arrivals) >= 2


def test_a_hint_past_the_deadline_fails_at_once_saying_so(routers):
    full = routers(refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, 5000))
    with Client(full.address, timeout=1.0, retry=QUICK) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate("x"))
    assert time.monotonic() - started < 0.5
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry after 5s" in info.value.details() and "deadline" in info.value.details()
    assert dict(info.value.trailing_metadata())["retry-after-ms"] == "5000"


def test_a_stream_that_received_tokens_is_never_replayed_and_without_a_resume_token_fails_saying_so(routers):
    cut, other = routers(cut_after(3)), routers()
    with Client([cut.address, other.address], timeout=10, retry=QUICK) as client:
        call = client.generate("x")
        received = []
        with pytest.raises(grpc.RpcError) as info:
            for message in call:
                received.extend(message.token_ids)
    assert received == [0, 1, 2, 3, 4, 5] and other.arrivals == []
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE == call.code()
    details = info.value.details()
    assert "the router died" in details and "6 tokens received (sequence 0: 6)" in details
    assert cut.address in details and "not resumed: the router issued no resume token" in details


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED])
def test_a_broken_stream_resumes_on_another_router_from_what_arrived(routers, code):
    cut, other = routers(cut_after(2, b"tok", code)), routers(resumed_from(4))
    with Client([cut.address, other.address], timeout=10, retry=QUICK) as client:
        call = client.generate("x", max_tokens=7, seed=1)
        received = [t for m in call for t in m.token_ids]
        assert client.resumptions == call.resumptions == 1
    assert received == list(range(7)) and call.code() == grpc.StatusCode.OK
    (first,), (resume,) = cut.requests, other.requests
    assert first.resumable and not first.HasField("resume")
    assert resume.request_id == "r" and resume.sampling == first.sampling and resume.text == "x"
    assert resume.resume.token == b"tok"
    assert [(s.index, list(s.token_ids), s.logprob_sum) for s in resume.resume.sequences] == [(0, [0, 1, 2, 3], -2.0)]


def test_resuming_stops_at_max_attempts_saying_where_the_stream_stopped(routers):
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.05)
    a, b = routers(cut_after(1, b"tok")), routers(cut_after(1, b"tok"))
    with Client([a.address, b.address], timeout=10, retry=policy) as client:
        call = client.generate("x")
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert call.resumptions == 1 and "maxAttempts" in info.value.details()
    assert "4 tokens received" in info.value.details()


def test_a_status_that_is_not_retried_reaches_the_caller_as_it_was(routers):
    bad = routers(refuse(grpc.StatusCode.INVALID_ARGUMENT))
    with Client(bad.address, timeout=10, retry=QUICK) as client, pytest.raises(grpc.RpcError) as info:
        list(client.generate("x"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(bad.arrivals) == 1
    assert info.value.details() == "refused by the test (INVALID_ARGUMENT)"


def test_cancel_while_waiting_to_retry_ends_the_call(routers):
    full = routers(refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, 5000))
    with Client(full.address, timeout=30, retry=QUICK) as client:
        call = client.generate("x")
        threading.Timer(0.3, call.cancel).start()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED and time.monotonic() - started < 2
    assert len(full.arrivals) == 1


def test_a_dns_name_stands_for_every_address_it_resolves_to(routers):
    """A name with two addresses (127.0.0.1 and 127.0.0.2, both loopback on Linux,
    one router each on the same port): calls spread over both, and go on to the
    other when one is stopped; the name is looked up again (resolve_every)."""
    one = routers()
    two = routers(host="127.0.0.2", port=one.port)
    names = {"routers.test": ["127.0.0.1", "127.0.0.2"]}
    with Client(f"routers.test:{one.port}", timeout=10, retry=QUICK, resolve_every=0.0,
                lookup=lambda host, port: names[host]) as client:
        assert client.addresses == [one.address, two.address]
        for _ in range(4):
            assert tokens_of(client.generate("x")) == [0, 1, 2, 3]
        assert len(one.arrivals) == len(two.arrivals) == 2
        one.stop()
        for _ in range(3):
            assert tokens_of(client.generate("x")) == [0, 1, 2, 3]
        assert len(two.arrivals) == 5
        names["routers.test"] = ["127.0.0.2"]  # the name moved: the next call sees it
        assert tokens_of(client.generate("x")) == [0, 1, 2, 3] and client.addresses == [two.address]


def test_localhost_is_looked_up_in_dns(routers):
    """The real resolver: 'localhost' is 127.0.0.1 (its A record first, as workers
    resolve --router), or ::1 where it has no A record."""
    v4 = routers()
    ips = lookup("localhost", v4.port)
    assert ips and set(resolve(f"localhost:{v4.port}")) == {f"[{ip}]:{v4.port}" if ":" in ip else
                                                            f"{ip}:{v4.port}" for ip in ips}
    if ips == ["127.0.0.1"]:
        with Client(f"localhost:{v4.port},127.0.0.1:{v4.port}", timeout=10, retry=QUICK) as client:
            assert client.addresses == [v4.address]  # one router, however often it is named
            assert tokens_of(client.generate("x")) == [0, 1, 2, 3]


def test_the_published_service_config_retries_in_a_plain_grpc_channel(routers):
    """What any gRPC client gets from proto/pdserve/v1/service_config.json: the
    same retries, by gRPC itself (grpc.service_config channel option)."""
    flaky = routers(refuse(grpc.StatusCode.UNAVAILABLE), refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, 50),
                    refuse(grpc.StatusCode.CANCELLED))
    options = [("grpc.service_config", SERVICE_CONFIG.read_text()), ("grpc.enable_retries", 1)]
    with grpc.insecure_channel(flaky.address, options=options) as channel:
        messages = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="x"), timeout=10))
    assert [t for m in messages for t in m.token_ids] == [0, 1, 2, 3] and len(flaky.arrivals) == 4
    assert RetryPolicy.from_service_config() == RetryPolicy()  # the client's defaults are the file's


def test_a_refusal_read_after_the_deadline_ends_deadline_exceeded(routers):
    """The router refuses at once, but the caller reads the refusal only after the
    call's deadline (a starved thread on a loaded machine): DEADLINE_EXCEEDED, the
    refusal named, no second attempt (before: UNAVAILABLE, "gave up")."""
    down = routers(*[refuse(grpc.StatusCode.UNAVAILABLE)] * 3)
    with Client(down.address, timeout=0.3, retry=QUICK) as client:
        call = client.generate("x")
        time.sleep(0.6)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
    assert len(down.arrivals) == 1


def test_a_retry_cut_by_the_deadline_fails_with_the_reason_it_was_retried(routers):
    """The second attempt runs past the deadline: DEADLINE_EXCEEDED (what ended it: a
    caller must not retry it as UNAVAILABLE), and the details say why the call was
    retried (the router's words), not only that time ran out."""
    def stall(context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        time.sleep(2)
        yield from ()

    slow = routers(refuse(grpc.StatusCode.UNAVAILABLE), stall)
    with Client(slow.address, timeout=0.8, retry=QUICK) as client, pytest.raises(grpc.RpcError) as info:
        list(client.generate("x"))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    details = info.value.details()
    assert "refused by the test" in details and "deadline passed during attempt 2" in details


def wait_then_serve(release: threading.Event) -> Reply:
    def reply(context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        release.wait(10)
        yield from serve(context)
    return reply


def test_a_cancelled_status_the_caller_did_not_cause_is_retried(routers):
    """CANCELLED before any message, the caller still there: gRPC's server shutdown
    cancels a call that arrived as it began (a router sends CANCELLED only to a
    caller that left). The call goes on to the other router."""
    stopping, other = routers(refuse(grpc.StatusCode.CANCELLED)), routers()
    with Client([stopping.address, other.address], timeout=10, retry=QUICK, seed=0) as client:
        call = client.generate("x")
        assert tokens_of(call) == [0, 1, 2, 3] and call.code() == grpc.StatusCode.OK
    assert len(stopping.arrivals) == 1 and len(other.arrivals) == 1


@pytest.mark.parametrize("ender", ["cancel", "close"])
def test_the_callers_own_cancel_or_close_is_never_retried(routers, ender):
    """The caller cancels an attempt in flight (no message yet), or closes the client
    under it: CANCELLED, no second attempt on either router."""
    release = threading.Event()
    slow, other = routers(wait_then_serve(release)), routers()
    client = Client([slow.address, other.address], timeout=10, retry=QUICK, seed=0)
    try:
        call = client.generate("x")
        threading.Timer(0.3, call.cancel if ender == "cancel" else client.close).start()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    finally:
        release.set()
        client.close()
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert len(slow.arrivals) + len(other.arrivals) == 1


def test_a_router_whose_grpc_server_stops_under_load_fails_no_call(routers):
    """A real gRPC server stopping (as a router does after its drain) while 8 threads
    keep calling: the calls that reach it as it shuts down end UNAVAILABLE or, for a
    call that arrived as the shutdown began, CANCELLED (rarely: a few times in 20
    stops). The client retries both on the other router: every call succeeds."""
    outcomes: Counter[str] = Counter()
    for trial in range(6):
        stopping, other = routers(), routers()
        done = threading.Event()
        with Client([stopping.address, other.address], timeout=10, retry=QUICK, seed=trial) as client:
            def hammer() -> None:
                while not done.is_set():
                    try:
                        outcomes["OK" if tokens_of(client.generate("x")) == [0, 1, 2, 3] else "wrong tokens"] += 1
                    except grpc.RpcError as e:
                        outcomes[f"{e.code().name}: {e.details()}"] += 1
            threads = [threading.Thread(target=hammer) for _ in range(8)]
            for t in threads:
                t.start()
            time.sleep(0.2)
            stopping.server.stop(2.0).wait(5)
            time.sleep(0.1)
            done.set()
            for t in threads:
                t.join(10)
    assert set(outcomes) == {"OK"}, outcomes
