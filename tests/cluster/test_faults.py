"""Degrading instead of failing (issue 13), with real gRPC services and real processes.

In one process (router + workers over gRPC, KV over ZeroMQ tcp):
  - a prompt meant for a prefill worker is prefilled on its decode worker when no
    prefill worker can take it (draining, all at --max-prefill-queue), counted by reason;
  - with no decode worker registered, a request waits (--admission-timeout) for one to
    join instead of failing; past that wait it fails UNAVAILABLE.
Real processes and SIGTERM:
  - a worker drains: it leaves the router's pools, finishes its stream, exits 0; past
    --drain-timeout it fails what is left with UNAVAILABLE;
  - a router drains: it admits nothing new (UNAVAILABLE) and, past --drain-timeout,
    fails what is left with UNAVAILABLE, then exits 0.
Real processes killed or frozen:
  - the router frozen (SIGSTOP) mid-stream, as in a partition: keepalive fails the
    client's call within seconds;
  - the router (SIGKILL) mid-stream: the worker frees the orphaned stream; a router
    started again on the same ports is re-joined and serves;
  - the prefill worker stopped (SIGSTOP) until the decode worker's reservation expired:
    the decode worker prefills, continuing from the first token the client already has,
    and the prefill worker, told the reservation ended, frees its blocks at once.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from cluster_helpers import all_blocks_free, list_workers, stats, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from forked_pdserve import ForkedProcess, spawn_pdserve
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import CacheConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import DEFAULT_KV_CONNECTOR, WorkerConfig
from pdserve.services.node import Worker

pytestmark = pytest.mark.cluster(seconds=60)


def long_prompt(name: str) -> str:
    """A prompt well above the local-prefill threshold, whose first block no other has
    (so no worker has any of it cached)."""
    return f"def {name}(data):\n" + "".join(f"    step_{k} = data[{k}] * {k}\n" for k in range(12))


LONG = long_prompt("compute")
FALLBACKS = "pdserve:router_local_prefill_fallbacks_total"


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=256)


def greedy(llm: LLM, prompt: str, max_tokens: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].outputs[0].token_ids


def fallbacks(router: Router, reason: str) -> float:
    labels = dict(model_name=router.config.model_name, role="router", worker="router", reason=reason)
    return router.metrics.registry.get_sample_value(FALLBACKS, labels) or 0.0


@pytest.fixture(scope="module")
def pd():
    """Router (at most 1 request queued per prefill worker) + 1 prefill + 1 decode worker."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=16, max_prefill_queue=1))
    address = router.start()
    workers = [Worker(WorkerConfig(role=role, router=router.internal_address, worker_id=f"{role}-0", num_blocks=256,
                                   kv_connector=DEFAULT_KV_CONNECTOR)) for role in ("prefill", "decode")]
    for w in workers:
        w.start()
    client = Client(address, timeout=60)
    yield dict(router=router, client=client, prefill=workers[0], decode=workers[1])
    client.close()
    for w in workers:
        w.stop()
    router.stop()


def test_a_busy_prefill_pool_prefills_on_the_decode_worker(pd, llm):
    router = pd["router"]
    remote = collect(pd["client"].generate(LONG, max_tokens=8, temperature=0.0))[0]
    assert list(remote.token_ids) == greedy(llm, LONG, 8) and fallbacks(router, "queue_full") == 0
    held = router.registry.acquire_prefill([], set())  # books the prefill worker's one slot
    try:
        prompt = long_prompt("busy")
        out = collect(pd["client"].generate(prompt, max_tokens=8, temperature=0.0))[0]
    finally:
        router.registry.release(held)
    assert list(out.token_ids) == greedy(llm, prompt, 8)
    assert fallbacks(router, "queue_full") == 1


def test_a_draining_prefill_pool_prefills_on_the_decode_worker(pd, llm):
    router, prefill = pd["router"], pd["prefill"]
    router.registry.leave(prefill.config.id)
    try:
        prompt = long_prompt("draining")
        out = collect(pd["client"].generate(prompt, max_tokens=8, temperature=0.0))[0]
        assert list(out.token_ids) == greedy(llm, prompt, 8)
        assert fallbacks(router, "draining") == 1
    finally:
        router.registry.register(prefill.info())  # serving again


def failed(router: Router, code: str) -> float:
    labels = dict(model_name=router.config.model_name, role="router", worker="router", code=code)
    return router.metrics.registry.get_sample_value("pdserve:request_failure_total", labels) or 0.0


def test_a_client_gone_during_its_prefill_is_counted_cancelled_and_frees_both_workers(pd):
    """The client leaves while its Prefill waits on the prefill worker (whose engine
    thread is held here): the router cancels the Prefill, aborts the reservation on
    the decode worker and counts the request CANCELLED (not UNKNOWN)."""
    router, prefill, decode = pd["router"], pd["prefill"], pd["decode"]
    cancelled, unknown = failed(router, "CANCELLED"), failed(router, "UNKNOWN")
    gate = threading.Event()
    stall = threading.Thread(target=lambda: prefill.loop.call(lambda _: gate.wait(60), timeout=60), daemon=True)
    stall.start()
    try:
        call = pd["client"].generate(long_prompt("gone"), max_tokens=8, temperature=0.0)
        wait_for(lambda: stats(decode.address).num_reserved == 1, 30, "the reservation on the decode worker")
        call.cancel()
        wait_for(lambda: failed(router, "CANCELLED") == cancelled + 1, 30, "the router to count the cancel")
    finally:
        gate.set()
        stall.join(60)
    assert failed(router, "UNKNOWN") == unknown
    wait_for(lambda: all_blocks_free(prefill.address) and all_blocks_free(decode.address), 30, "every block free")


def test_without_a_decode_worker_a_request_waits_for_one_to_join(llm):
    router = Router(RouterConfig(port=0, admission_timeout=60.0))
    quick = Router(RouterConfig(port=0, admission_timeout=0.2))
    address, quick_address = router.start(), quick.start()
    worker = Worker(WorkerConfig(role="mixed", router=router.internal_address, worker_id="late", num_blocks=128))
    try:
        with Client(quick_address, timeout=30) as client:
            with pytest.raises(grpc.RpcError) as failed:
                collect(client.generate("def f(x):", max_tokens=4))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        with Client(address, timeout=60) as client:
            result: dict = {}
            thread = threading.Thread(target=lambda: result.update(collect(client.generate(
                "def f(x):", max_tokens=6, temperature=0.0))))
            thread.start()
            time.sleep(0.5)  # the request is waiting now; then a decode worker joins
            worker.start()
            thread.join(60)
            assert list(result[0].token_ids) == greedy(llm, "def f(x):", 6)
    finally:
        worker.stop()
        router.stop()
        quick.stop()


# -- SIGTERM --------------------------------------------------------------------------


def spawn(args: list[str], log: Path) -> ForkedProcess:
    """`pdserve ARGS` as a process of its own (forked: tests/forked_pdserve.py)."""
    return spawn_pdserve(args, log)


def test_sigterm_on_a_worker_finishes_its_stream_and_leaves_the_pools(tmp_path, llm):
    router = Router(RouterConfig(port=0, admission_timeout=0.0))
    address = router.start()
    proc = spawn(["mixed", "--router", router.internal_address, "--worker-id", "term-0", "--num-blocks", "128",
                  "--drain-timeout", "60"], tmp_path / "worker.log")
    try:
        wait_for(lambda: router.registry.live(), 120, "the worker to register")
        with Client(address, timeout=120) as client:
            call = client.generate("class Stack:", max_tokens=300, ignore_eos=True, temperature=0.0)
            stream = iter(call)
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: all(h.draining for h in router.registry.live()), 30, "the worker to leave the pools")
            with pytest.raises(grpc.RpcError) as refused:  # nobody else to serve it
                collect(client.generate("def f(x):", max_tokens=2))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            tokens = list(first.token_ids) + [t for m in stream for t in m.token_ids]
        assert tokens == greedy(llm, "class Stack:", 300)[:len(tokens)] and len(tokens) == 300
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        router.stop()


def test_a_worker_whose_drain_runs_out_fails_the_rest_unavailable(tmp_path):
    router = Router(RouterConfig(port=0, admission_timeout=0.0))
    address = router.start()
    proc = spawn(["mixed", "--router", router.internal_address, "--worker-id", "cut-0", "--num-blocks", "128",
                  "--drain-timeout", "0.5"], tmp_path / "worker.log")
    try:
        wait_for(lambda: router.registry.live(), 120, "the worker to register")
        with Client(address, timeout=120) as client:
            stream = iter(client.generate("class Stack:", max_tokens=900, ignore_eos=True))
            next(stream)
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as cut:
                for _ in stream:
                    pass
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        router.stop()


def test_sigterm_on_the_router_stops_admitting_then_fails_the_rest_unavailable(tmp_path):
    address_file = tmp_path / "router.address"
    proc = spawn(["router", "--port", "0", "--address-file", str(address_file), "--drain-timeout", "1"],
                 tmp_path / "router.log")
    worker = None
    try:
        wait_for(address_file.is_file, 120, "the router to serve")
        address, internal = address_file.read_text().split()
        worker = Worker(WorkerConfig(role="mixed", router=internal, worker_id="under-router", num_blocks=128))
        worker.start()
        with Client(address, timeout=120) as client:
            stream = iter(client.generate("class Stack:", max_tokens=900, ignore_eos=True))
            next(stream)
            proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    collect(client.generate("def f(x):", max_tokens=1))
                    return False
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                    return True

            wait_for(refused, 30, "the router to refuse new requests")
            with pytest.raises(grpc.RpcError) as cut:
                for _ in stream:
                    pass
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
        assert proc.wait(30) == 0
        wait_for(lambda: worker.loop.snapshot().num_requests_running == 0, 20, "the worker to free the stream")
    finally:
        if proc.poll() is None:
            proc.kill()
        if worker is not None:
            worker.stop()


# -- the router killed and restarted on its ports --------------------------------------


def test_a_killed_router_frees_the_streams_blocks_and_its_restart_serves_again(tmp_path, llm):
    """SIGKILL the router mid-stream: the client's call fails UNAVAILABLE, the decode
    worker sees its caller gone and frees every block within seconds; a router started
    again on the same ports is re-joined by the worker (heartbeat NOT_FOUND -> Register)
    and serves new requests."""
    address_file = tmp_path / "router.address"
    procs = [spawn(["router", "--port", "0", "--address-file", str(address_file)], tmp_path / "router.log")]
    worker = None
    try:
        wait_for(address_file.is_file, 120, "the router to serve")
        address, internal = address_file.read_text().split()
        worker = Worker(WorkerConfig(role="mixed", router=internal, worker_id="survivor", num_blocks=128))
        worker.start()
        with Client(address, timeout=120) as client:
            stream = iter(client.generate("class Stack:", max_tokens=900, ignore_eos=True))
            next(stream)
            procs[0].kill()
            with pytest.raises(grpc.RpcError) as cut:
                for _ in stream:
                    pass
            assert cut.value.code() == grpc.StatusCode.UNAVAILABLE, cut.value
        wait_for(lambda: (s := worker.loop.snapshot()).num_free_blocks == s.num_blocks
                 and s.num_requests_running == 0, 10, "the worker to free the orphaned stream's blocks")
        procs[0].wait(10)
        address_file.unlink()
        port, internal_port = address.rpartition(":")[2], internal.rpartition(":")[2]
        procs.append(spawn(["router", "--port", port, "--internal-port", internal_port, "--address-file",
                            str(address_file)], tmp_path / "router2.log"))
        wait_for(address_file.is_file, 120, "the restarted router to serve")
        assert address_file.read_text().split() == [address, internal]
        wait_for(lambda: _registered(internal), 20, "the worker to register again")
        with Client(address, timeout=60) as client:
            out = collect(client.generate("def f(x):", max_tokens=6, temperature=0.0))[0]
        assert list(out.token_ids) == greedy(llm, "def f(x):", 6)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if worker is not None:
            worker.stop()


def test_a_frozen_router_is_noticed_by_keepalive(tmp_path):
    """SIGSTOP the router mid-stream: no socket closes (as in a partition), yet the
    client's keepalive pings go unanswered, and its call fails UNAVAILABLE within
    seconds instead of hanging until its 120 s deadline; the worker's stream ends and
    its blocks are freed."""
    address_file = tmp_path / "router.address"
    proc = spawn(["router", "--port", "0", "--address-file", str(address_file)], tmp_path / "router.log")
    worker = None
    try:
        wait_for(address_file.is_file, 120, "the router to serve")
        address, internal = address_file.read_text().split()
        worker = Worker(WorkerConfig(role="mixed", router=internal, worker_id="partitioned", num_blocks=128))
        worker.start()
        with Client(address, timeout=120) as client:
            stream = iter(client.generate("class Stack:", max_tokens=900, ignore_eos=True, logprobs=20))
            next(stream)
            proc.send_signal(signal.SIGSTOP)
            frozen = time.monotonic()
            with pytest.raises(grpc.RpcError) as lost:
                for _ in stream:
                    pass
            noticed = time.monotonic() - frozen
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE, lost.value
        assert noticed < 30, f"the frozen router went unnoticed for {noticed:.0f}s"  # 65 s without ping_timeout_ms
        print(f"the client noticed the frozen router after {noticed:.1f}s")
        wait_for(lambda: (s := worker.loop.snapshot()).num_free_blocks == s.num_blocks
                 and s.num_requests_running == 0, 30, "the worker to end the orphaned stream")
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        if worker is not None:
            worker.stop()


def _registered(internal: str) -> bool:
    try:
        return any(w.worker_id == "survivor" for w in list_workers(internal))
    except grpc.RpcError:
        return False


# -- a KV transfer lost after the first token reached the client -----------------------


def test_a_forced_first_token_continues_as_the_colocated_run(llm):
    """The decode worker's fallback: the prompt computed with the first token another
    worker sampled, then sampling from there: greedy and seeded runs go on unchanged."""
    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=64)))
    for params in (SamplingParams(max_tokens=12, temperature=0.0),
                   SamplingParams(max_tokens=12, temperature=0.9, seed=7)):
        whole = llm.generate([LONG], params)[0].outputs[0].token_ids
        assert engine.add_request("forced", llm.tokenizer.encode(LONG), params, first_token=whole[0]) == []
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        assert outputs[0].outputs[0].token_ids == whole
    with pytest.raises(ValueError, match="first_token"):
        engine.add_request("two", [5, 6, 7], SamplingParams(n=2, max_tokens=2), first_token=1)
    engine.check_integrity()


def test_a_reservation_that_expires_after_the_first_token_is_prefilled_on_the_decode_worker(tmp_path, llm):
    """The prefill worker is stopped (SIGSTOP) while the request waits on it, so the
    decode worker's reservation (1.5 s) expires; let go (SIGCONT), it prefills and sends
    the first token, which reaches the client; its KV finds no reservation. The decode
    worker prefills the prompt itself from that token: the client sees no error, and
    the tokens of a colocated greedy run. The prefill worker, told by the decode
    worker's receiver that the reservation had ended (a failed ack to its first late
    message), frees its held blocks at once, not when its 60 s lease ends."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=16))
    address = router.start()
    decode = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-x", num_blocks=256,
                                 kv_connector=DEFAULT_KV_CONNECTOR, reservation_timeout=1.5))
    decode.start()
    prefill = spawn(["prefill", "--router", router.internal_address, "--worker-id", "prefill-x", "--num-blocks", "256",
                     "--kv-connector", DEFAULT_KV_CONNECTOR, "--held-lease", "60"], tmp_path / "prefill.log")
    try:
        wait_for(lambda: len(router.registry.live()) == 2, 120, "the prefill worker to register")
        prefill.send_signal(signal.SIGSTOP)
        with Client(address, timeout=60) as client:
            call = client.generate(LONG, max_tokens=10, temperature=0.0)
            time.sleep(2.5)  # the reservation expires meanwhile
            prefill.send_signal(signal.SIGCONT)
            out = collect(call)[0]
        assert list(out.token_ids) == greedy(llm, LONG, 10)
        assert fallbacks(router, "kv_transfer") + fallbacks(router, "prefill_failed") == 1
        print(f"fallbacks: kv_transfer {fallbacks(router, 'kv_transfer')}, "
              f"prefill_failed {fallbacks(router, 'prefill_failed')}")
        wait_for(lambda: (s := decode.loop.snapshot()).num_free_blocks == s.num_blocks, 10,
                 "the decode worker to free every block")
        (sender,) = [h for h in router.registry.live() if h.worker_id == "prefill-x"]
        wait_for(lambda: all_blocks_free(sender.info.address), 10, "the prefill worker to free its held blocks")
    finally:
        prefill.send_signal(signal.SIGCONT)
        prefill.kill()
        decode.stop()
        router.stop()
