"""Attacks on a cluster, each of which worked before the cluster had credentials, and
none of which works now (docs/security.md has the threat model).

`guarded`: a router, a decode and a prefill worker in this process, every internal
port behind a launch's credentials (cluster token, CURVE keys: launch/credentials.py,
what `pdserve up` gives its children), KV over ZeroMQ with CURVE, every prompt
crossing from the prefill to the decode worker. The attacker is this test with plain
gRPC and ZeroMQ sockets, or, for the KV channel, with a sender's stolen CURVE keys
but not the reservation's secret. `tenants`: a router with API keys that salts the
prefix cache by key. The public API's TLS, API keys and their SIGHUP reload run
through `pdserve up` itself; mTLS between services through a router and a worker
here. Last, a test reads every module that reads from a socket for pickle.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import msgpack
import pytest
import torch
import torch.distributed as dist
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from certs import CA
from cluster_helpers import REPO, UpProcess, child_env, wait_for
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.hashing import hash_blocks
from pdserve.kvtransfer.plan import TransferPlan
from pdserve.kvtransfer.transfer import Transfer
from pdserve.kvtransfer.transports.nccl import SignedStore, listening_store
from pdserve.kvtransfer.transports.zmq import ZmqConfig, ZmqReceiver, ZmqSender
from pdserve.kvtransfer.wire import VERSION, PageLayout, new_secret, prompt_digest
from pdserve.launch.credentials import LaunchCredentials, generate, pack, unpack
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.credentials import TOKEN_METADATA, ClusterAuth, ClusterCredentials
from pdserve.services.node import Worker
from pdserve.services.router.api_keys import key_id
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import WorkerConfig

pytestmark = pytest.mark.cluster(seconds=35)

ZMQ_CONNECTOR = "zmq"
OPTIONS = pb.SamplingOptions(max_tokens=6, temperature=0.0)
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def code(name: str, lines: int) -> str:
    """A distinct prompt of several blocks (its first block differs from every other's)."""
    return f"def {name}(data):\n" + "".join(f"    {name}_{k} = step({k})\n" for k in range(lines))


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(num_blocks=128)


def greedy(llm: LLM, prompt: list[int] | str, max_tokens: int = 6) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].outputs[0].token_ids


def tokens(llm: LLM, text: str) -> list[int]:
    return llm.engine.tokenizer.encode(text)


def refused(call) -> tuple[grpc.StatusCode, str]:
    """The status of a call that must fail (streams are read to the end)."""
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (pb.ReserveResponse, pb.PrefillResponse)):
            list(result)
    return info.value.code(), info.value.details()


# -- a guarded cluster ------------------------------------------------------------------


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> LaunchCredentials:
    return generate(tmp_path_factory.mktemp("launch") / "credentials")


@pytest.fixture(scope="module")
def guarded(launch):
    router = Router(RouterConfig(port=0, local_prefill_threshold=0, worker_timeout=5.0, stats_interval=0.5,
                                 credentials=launch.for_router()))
    address = router.start()
    workers = {}
    try:
        for role in ("decode", "prefill"):
            workers[role] = Worker(WorkerConfig(
                role=role, router=router.internal_address, worker_id=f"{role}-0", num_blocks=64, held_lease=5.0,
                kv_connector=ZMQ_CONNECTOR, credentials=launch.for_role(role),
            ))
            workers[role].start()
        auth = ClusterAuth(launch.for_client())
        with Client(address, timeout=60) as client:
            yield dict(router=router, client=client, auth=auth, **workers)
    finally:
        for worker in reversed(list(workers.values())):
            worker.stop()
        router.stop()


def worker_stub(address: str, auth: ClusterAuth | None = None) -> tuple[grpc.Channel, pb_grpc.WorkerStub]:
    channel = auth.channel(address) if auth is not None else grpc.insecure_channel(address)
    return channel, pb_grpc.WorkerStub(channel)


def worker_stats(cluster, role: str, hashes: bool = False) -> pb.StatsResponse:
    channel, stub = worker_stub(cluster[role].address, cluster["auth"])
    with channel:
        return stub.Stats(pb.StatsRequest(include_block_hashes=hashes), timeout=5)


def all_free(cluster, role: str) -> bool:
    s = worker_stats(cluster, role)
    return s.num_free_blocks == s.num_blocks and s.num_running + s.num_waiting + s.num_held + s.num_reserved == 0


def test_the_public_port_serves_no_internal_service(guarded):
    """Before: Registry shared the public port, so anyone could register or list workers."""
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(guarded["router"].address) as channel:
        registry = pb_grpc.RegistryStub(channel)
        assert refused(lambda: registry.ListWorkers(pb.ListWorkersRequest(), timeout=5))[0] == grpc.StatusCode.UNIMPLEMENTED
        assert refused(lambda: registry.Register(pb.RegisterRequest(), timeout=5))[0] == grpc.StatusCode.UNIMPLEMENTED
        published = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert "pdserve.v1.Generation" in published and not published & {"pdserve.v1.Registry", "pdserve.v1.Worker"}


class FakeWorker(pb_grpc.WorkerServicer):
    """An attacker's 'decode worker': idle in Stats, so a router would favour it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def Stats(self, request, context):
        return pb.StatsResponse(worker_id="decode-0", role=pb.ROLE_DECODE, block_size=16, num_blocks=10_000,
                                num_free_blocks=10_000)

    def Decode(self, request, context):
        self.calls.append(request.request_id)
        yield pb.DecodeResponse(finished=True)


def test_registering_without_cluster_credentials_is_refused(guarded, llm):
    fake = FakeWorker()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    info = pb.WorkerInfo(worker_id="decode-0", role=pb.ROLE_DECODE, address=f"127.0.0.1:{port}",
                         model="pdserve-tiny-code", block_size=16, max_model_len=1024, num_blocks=10_000)
    internal = guarded["router"].internal_address
    try:
        for metadata in (None, ((TOKEN_METADATA, "not-the-cluster-token-at-all"),)):
            with grpc.insecure_channel(internal) as channel:
                registry = pb_grpc.RegistryStub(channel)
                for call in (lambda: registry.Register(pb.RegisterRequest(worker=info), timeout=5, metadata=metadata),
                             lambda: registry.ListWorkers(pb.ListWorkersRequest(), timeout=5, metadata=metadata),
                             lambda: registry.Heartbeat(pb.HeartbeatRequest(worker_id="decode-0"), timeout=5,
                                                        metadata=metadata)):
                    status, details = refused(call)
                    assert status == UNAUTHENTICATED and "cluster credentials" in details
        # The real decode worker was not replaced, and requests never reach the fake.
        with guarded["auth"].channel(internal) as channel:
            live = pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).workers
        assert {(w.worker_id, w.address) for w in live} == {
            ("decode-0", guarded["decode"].address), ("prefill-0", guarded["prefill"].address)}
        prompt = code("registered", 3)
        (seq,) = collect(guarded["client"].generate(prompt, max_tokens=4, temperature=0.0)).values()
        assert list(seq.token_ids) == greedy(llm, prompt, 4) and fake.calls == []
    finally:
        server.stop(0)


def test_worker_rpcs_without_cluster_credentials_are_refused(guarded):
    """Before: anyone could run prompts on a worker past the router's checks, reserve its
    blocks, or point a prefill worker's KV at any endpoint."""
    prompt = list(range(3, 60))
    before = worker_stats(guarded, "decode").prefix_cache_queries
    calls = {
        "decode": {
            "Reserve": lambda s, m: s.Reserve(pb.ReserveRequest(request_id="r", token_ids=prompt, sampling=OPTIONS),
                                              timeout=5, metadata=m),
            "Decode": lambda s, m: s.Decode(pb.DecodeRequest(request_id="d", local_prefill=True, token_ids=prompt,
                                                             sampling=OPTIONS), timeout=5, metadata=m),
            "Abort": lambda s, m: s.Abort(pb.AbortRequest(request_id="d"), timeout=5, metadata=m),
            "Stats": lambda s, m: s.Stats(pb.StatsRequest(include_block_hashes=True), timeout=5, metadata=m),
            "Drain": lambda s, m: s.Drain(pb.DrainRequest(grace_seconds=0), timeout=5, metadata=m),
            "KvEvents": lambda s, m: s.KvEvents(pb.KvEventsRequest(), timeout=5, metadata=m),
        },
        "prefill": {
            "Prefill": lambda s, m: s.Prefill(pb.PrefillRequest(request_id="p", token_ids=prompt, sampling=OPTIONS,
                                                                transfer_plan=b"a plan to tcp://127.0.0.1:9"),
                                              timeout=5, metadata=m),
        },
    }
    # Every Worker RPC is tried: one added later is refused here too, or this fails.
    tried = {name for role_calls in calls.values() for name in role_calls}
    assert tried == set(pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name)
    for role, role_calls in calls.items():
        channel, stub = worker_stub(guarded[role].address)
        with channel:
            for call in role_calls.values():
                for metadata in (None, ((TOKEN_METADATA, "x" * 64),)):
                    status, details = refused(lambda: call(stub, metadata))
                    assert status == UNAUTHENTICATED and "cluster credentials" in details, (role, details)
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no credentials
    assert worker_stats(guarded, "decode").prefix_cache_queries == before  # nothing ran
    assert all_free(guarded, "decode") and all_free(guarded, "prefill")


def test_the_router_follows_kv_events_with_the_cluster_credentials(guarded):
    """KvEvents is internal like every Worker RPC: the router's subscription presents
    the cluster's credentials, and its view of what the decode worker caches follows."""
    prompt = code("followed", 4)
    collect(guarded["client"].generate(prompt, max_tokens=4, temperature=0.0))

    def router_view() -> set[bytes]:
        (handle,) = [h for h in guarded["router"].registry.live() if h.worker_id == "decode-0"]
        return set(handle.cached)

    wait_for(lambda: worker_stats(guarded, "decode", hashes=True).cached_block_hashes, 10,
             "the decode worker to cache the prompt")
    wait_for(lambda: router_view() == set(worker_stats(guarded, "decode", hashes=True).cached_block_hashes), 10,
             "the router's view of the decode worker's cache")
    assert router_view()  # not empty: the subscription was admitted


# -- the KV channel ------------------------------------------------------------------------


def curve_socket(ctx: zmq.Context, endpoint: str, server_key: bytes | None, keys: tuple[bytes, bytes] | None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    return sock


def handshake(ctx: zmq.Context, endpoint: str, server_key: bytes | None, keys: tuple[bytes, bytes] | None) -> str:
    """How a connection to `endpoint` with these CURVE keys (None: plaintext) ends:
    'ok', or the handshake failure ZeroMQ reports (or 'none' within 3 s)."""
    sock = curve_socket(ctx, endpoint, server_key, keys)
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    names = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
             zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol", zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
             zmq.EVENT_DISCONNECTED: "disconnected"}
    outcome = "none"
    give_up = time.monotonic() + 3.0
    while outcome == "none" and time.monotonic() < give_up:
        if monitor.poll(100):
            outcome = names.get(recv_monitor_message(monitor)["event"], "none")
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)
    return outcome


def test_a_curve_stranger_cannot_connect_to_the_kv_channel(guarded, launch):
    """Before: `pdserve up` gave no CURVE keys; any process could open the KV port."""
    endpoint = guarded["decode"].connector.endpoint
    server_key, _ = zmq.auth.load_certificate(launch.directory / "kv" / "decode.key")
    sender_keys = zmq.auth.load_certificate(launch.directory / "kv" / "prefill.key_secret")
    decode_keys = zmq.auth.load_certificate(launch.directory / "kv" / "decode.key_secret")
    ctx = zmq.Context()
    try:
        assert handshake(ctx, endpoint, server_key, zmq.curve_keypair()) in ("auth", "disconnected", "none")
        assert handshake(ctx, endpoint, None, None) != "ok"  # plaintext
        assert handshake(ctx, endpoint, server_key, decode_keys) != "ok"  # a receiver's keys may not send
        assert handshake(ctx, endpoint, server_key, sender_keys) == "ok"  # the launch's senders may
    finally:
        ctx.term()
    refused_peers = guarded["decode"].connector.transport.receiver.stats()["refused_peers"]
    assert refused_peers >= 2


def cluster_key_file(path, key: bytes) -> str:
    path.write_text(base64.b64encode(key).decode() + "\n")
    os.chmod(path, 0o600)
    return str(path)


def test_workers_sharing_a_cluster_curve_key_exchange_kv_and_no_other_key_gets_in(tmp_path):
    """The Helm chart's CURVE design (--kv-curve-cluster-key: one secret key for the
    cluster, 32 random bytes from a Secret): two workers given the same key exchange KV;
    a sender with any other key is refused at the handshake, even knowing the
    receiver's public key (a transfer plan carries it)."""
    shared = os.urandom(32)
    decode = ClusterAuth(ClusterCredentials(kv_curve_cluster_key=cluster_key_file(tmp_path / "decode", shared))).kv_curve()
    prefill = ClusterAuth(ClusterCredentials(kv_curve_cluster_key=cluster_key_file(tmp_path / "prefill", shared))).kv_curve()
    other = ClusterAuth(ClusterCredentials(kv_curve_cluster_key=cluster_key_file(tmp_path / "other", os.urandom(32))))
    assert prefill == decode and decode.authorized_keys == {decode.public_key}
    kv = torch.zeros((2, 8, 2, 4, 1, 8), dtype=torch.float16)
    src = torch.randn((2, 2, 2, 4, 1, 8)).half()
    layout, prompt = PageLayout.of(kv), list(range(8))
    receiver = ZmqReceiver(kv, "tcp://127.0.0.1:0", ZmqConfig(curve=decode))
    senders = {"member": ZmqSender(ZmqConfig(curve=prefill)), "stranger": ZmqSender(ZmqConfig(curve=other.kv_curve()))}
    try:
        endpoint = receiver.start()
        for i, (who, sender) in enumerate(senders.items()):
            secret = new_secret()
            receiver.expect(Transfer(who, [2 * i, 2 * i + 1], 0, len(prompt), prompt_digest(prompt), secret))
            out = sender.open(who, endpoint, receiver.server_key, secret=secret)
            for layer in range(layout.num_layers):
                sender.send_pages(out, layer, [(0, src[layer])], layout)
            sender.send_final(out, len(prompt), prompt_digest(prompt), [5])
        events = {}

        def ended(count: int) -> bool:
            events.update({e.request_id: e for e in receiver.events()})
            return len(events) == count

        wait_for(lambda: ended(1), 30, "the member's transfer to end", step=0.01)
        assert events["member"].ok and torch.equal(kv[:, 0:2], src)
        wait_for(lambda: receiver.stats().get("refused_peers", 0) >= 1, 30, "the stranger's handshake to be refused")
        # Nothing of the stranger's got in: its reservation waits, untouched, until its
        # owner gives up on it (at the owner's deadline).
        assert receiver.inbox.pending() == ["stranger"] and receiver.cancel("stranger", "deadline exceeded")
        wait_for(lambda: ended(2), 30, "the stranger's reservation to end", step=0.01)
        assert not events["stranger"].ok and torch.count_nonzero(kv[:, 2:]) == 0
        assert receiver.stats()["refused_peers"] >= 1  # at the handshake: not one frame got in
    finally:
        receiver.close()
        for sender in senders.values():
            sender.close()
    # The Ray launcher carries the file like the others; bad keys and mixed settings fail naming the flag.
    carried = unpack(pack(ClusterCredentials(kv_curve_cluster_key=str(tmp_path / "decode"))), tmp_path / "actor")
    assert ClusterAuth(carried).kv_curve() == decode
    (tmp_path / "short").write_text(base64.b64encode(os.urandom(16)).decode())
    with pytest.raises(ValueError, match="kv_curve_cluster_key: must hold 32 bytes"):
        ClusterAuth(ClusterCredentials(kv_curve_cluster_key=str(tmp_path / "short"))).kv_curve()
    with pytest.raises(ValueError, match="kv_curve_cluster_key: replaces --kv-curve-cert"):
        ClusterCredentials(kv_curve_cluster_key=str(tmp_path / "decode"), kv_curve_authorized=str(tmp_path))
    with pytest.raises(ValueError, match="kv_curve_cluster_key"):
        generate(tmp_path / "launch", ClusterCredentials(kv_curve_cluster_key=str(tmp_path / "decode")))


def poison(endpoint: str, server_key: bytes, keys: tuple[bytes, bytes], rid: str, prompt: list[int],
           layout: PageLayout, pages: bool = True) -> None:
    """The attack, as raw frames: junk pages for every block of every layer, then a
    final message whose digest is just the (public) prompt's; no reservation secret."""
    ctx = zmq.Context()
    sock = curve_socket(ctx, endpoint, server_key, keys)
    sock.connect(endpoint)
    num_blocks = -(-len(prompt) // layout.block_size)
    guess = os.urandom(32)
    try:
        seq = 0
        for layer in range(layout.num_layers if pages else 0):
            header = {"v": VERSION, "kind": "pages", "rid": rid, "seq": seq, "layer": layer, "runs": [[0, num_blocks]],
                      "nbytes": [num_blocks * layout.page_bytes], "dtype": layout.dtype, "page": list(layout.wire_page),
                      "via": "frames", "mac": guess}
            sock.send_multipart([msgpack.packb(header, use_bin_type=True), b"\x7f" * (num_blocks * layout.page_bytes)])
            seq += 1
        final = {"v": VERSION, "kind": "final", "rid": rid, "seq": seq, "num_tokens": len(prompt),
                 "digest": prompt_digest(prompt), "first": [7], "draft": None, "mac": guess}
        sock.send_multipart([msgpack.packb(final, use_bin_type=True)])
        time.sleep(0.5)  # let ZeroMQ deliver before the socket goes
    finally:
        sock.close(0)
        ctx.term()


def test_kv_poisoning_is_refused_and_the_prefix_stays_clean(guarded, launch, llm):
    """Before: Reserve a prompt on a decode worker, send junk pages and a final message
    whose digest is the prompt's, and the junk entered its prefix cache; a later user's
    request with that prefix was served from it."""
    prompt = tokens(llm, code("poisoned", 6))
    channel, stub = worker_stub(guarded["decode"].address)
    with channel:
        status, _ = refused(lambda: stub.Reserve(pb.ReserveRequest(request_id="evil", token_ids=prompt, sampling=OPTIONS),
                                                timeout=5))
    assert status == UNAUTHENTICATED
    # Even with a reservation the router made (in flight for a user) and a CURVE key
    # the receiver admits (a sender the router did not choose), the pages are refused.
    layout = PageLayout.of(llm.engine.runner.kv_cache)
    server_key, _ = zmq.auth.load_certificate(launch.directory / "kv" / "decode.key")
    keys = zmq.auth.load_certificate(launch.directory / "kv" / "prefill.key_secret")
    endpoint = guarded["decode"].connector.endpoint
    receiver = guarded["decode"].connector.transport.receiver
    for rid, with_pages in (("victim", True), ("victim-final-only", False)):
        channel, stub = worker_stub(guarded["decode"].address, guarded["auth"])
        with channel:
            stub.Reserve(pb.ReserveRequest(request_id=rid, token_ids=prompt, sampling=OPTIONS, timeout_seconds=30),
                         timeout=5)
            stream = stub.Decode(pb.DecodeRequest(request_id=rid), timeout=30)
            rejected = receiver.stats().get("rejected_bad_mac", 0)
            poison(endpoint, server_key, keys, rid, prompt, layout, with_pages)
            status, details = refused(lambda: stream)
        assert status == grpc.StatusCode.UNAVAILABLE and "secret" in details
        assert receiver.stats()["rejected_bad_mac"] == rejected + 1  # the first message failed it: the rest find nothing
    wait_for(lambda: all_free(guarded, "decode"), 10, "the reservations' blocks to be freed")
    cached = set(worker_stats(guarded, "decode", hashes=True).cached_block_hashes)
    assert not cached & set(hash_blocks(prompt, layout.block_size))
    # A user's request with that prompt: exactly the clean engine's tokens, nothing cached.
    (seq,) = collect(guarded["client"].generate(prompt, max_tokens=8, temperature=0.0)).values()
    assert list(seq.token_ids) == greedy(llm, prompt, 8) and seq.usage.cached_tokens == 0
    assert worker_stats(guarded, "decode").kv_transfers >= 1  # it crossed from the prefill worker, proven


def test_a_wrong_or_replayed_reservation_secret_is_dropped_and_its_blocks_freed(guarded, llm):
    """The chosen sender's own transfer goes through; the same sender with a secret
    from another reservation, or a made-up one, is refused and the blocks come back."""
    auth = guarded["auth"]
    d_channel, decode = worker_stub(guarded["decode"].address, auth)
    p_channel, prefill = worker_stub(guarded["prefill"].address, auth)
    secrets: dict[str, bytes] = {}
    firsts: dict[str, int] = {}  # the prefill worker's first token (the decode worker does not stream it again)

    def transfer(rid: str, prompt: list[int], secret_of=None):
        reserved = decode.Reserve(pb.ReserveRequest(request_id=rid, token_ids=prompt, sampling=OPTIONS,
                                                    timeout_seconds=20), timeout=5)
        plan = TransferPlan.unpack(reserved.transfer_plan)
        secrets[rid] = plan.secret
        if secret_of is not None:
            plan = dataclasses.replace(plan, secret=secret_of(plan))
        stream = decode.Decode(pb.DecodeRequest(request_id=rid), timeout=30)
        try:
            prefilled = prefill.Prefill(pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=OPTIONS,
                                                          transfer_plan=plan.pack()), timeout=20)
            firsts[rid] = prefilled.first_token.token_id
        except grpc.RpcError as e:  # the refusal may reach the prefill worker first
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return stream

    with d_channel, p_channel:
        first = tokens(llm, code("first", 4))
        messages = list(transfer("first", first))  # the tokens after the prefill worker's first
        assert [firsts["first"]] + [t for m in messages for d in m.deltas for t in d.token_ids] == greedy(llm, first, 6)
        for rid, secret_of in (("replayed", lambda plan: secrets["first"]), ("made-up", lambda plan: os.urandom(32))):
            prompt = tokens(llm, code(rid.replace("-", "_"), 4))
            status, details = refused(lambda: transfer(rid, prompt, secret_of))
            assert status == grpc.StatusCode.UNAVAILABLE and "secret" in details, details
            cached = set(worker_stats(guarded, "decode", hashes=True).cached_block_hashes)
            assert not cached & set(hash_blocks(prompt, 16))
    wait_for(lambda: all_free(guarded, "decode") and all_free(guarded, "prefill"), 15, "every block to be free")


def test_an_oversized_frame_never_reaches_the_receiver():
    """Before: no ZMQ_MAXMSGSIZE, so a peer could make a receiver buffer any frame."""
    receiver = ZmqReceiver(torch.zeros((2, 8, 2, 4, 1, 8)), "tcp://127.0.0.1:0")
    endpoint = receiver.start()
    ctx = zmq.Context()
    try:
        big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (big, small):
            sock.linger = 0
            sock.connect(endpoint)
        big.send(b"\xc1" * (receiver.max_message_bytes + 1))  # had it arrived: counted as an oversized header
        time.sleep(1.0)
        small.send(b"\xc1")  # the receiver reads on: a bad header, counted
        wait_for(lambda: receiver.stats().get("rejected", 0) >= 1, 10, "the small message to be read")
        time.sleep(0.2)
        assert receiver.stats()["rejected"] == receiver.stats()["rejected_bad_header"] == 1
    finally:
        receiver.close()
        ctx.destroy(0)


# -- the torch.distributed rendezvous -------------------------------------------------------


def test_the_rendezvous_store_listens_on_the_kv_host_only_and_values_need_the_token():
    timeout = datetime.timedelta(seconds=5)
    store = listening_store("127.0.0.1", timeout)
    with pytest.raises(OSError):  # before: TCPStore listened on every interface
        socket.create_connection(("127.0.0.2", store.port), timeout=2).close()
    token = b"t" * 32
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=timeout)
    ours, theirs = SignedStore(client, token), SignedStore(client, b"u" * 32)
    ours.set("pdserve-kv/pair/0", b"10.0.0.1:1234")
    assert ours.get("pdserve-kv/pair/0") == b"10.0.0.1:1234"
    client.set("pdserve-kv/pair/1", b"attacker:6666")  # a stranger writes a rank's address
    with pytest.raises(RuntimeError, match="not signed"):
        ours.get("pdserve-kv/pair/1")
    theirs.set("pdserve-kv/pair/2", b"attacker:6666")  # signed with another token
    with pytest.raises(RuntimeError, match="not signed"):
        ours.get("pdserve-kv/pair/2")
    signed = client.get("pdserve-kv/pair/0")
    client.set("pdserve-kv/other/0", signed)  # a genuine value, replayed under another key
    with pytest.raises(RuntimeError, match="not signed"):
        ours.get("pdserve-kv/other/0")
    # What else a process group may ask of its store (NCCL: compare_set, counters, clones).
    assert ours.compare_set("pdserve-kv/pair/3", b"", b"id") == b"id" == ours.clone().get("pdserve-kv/pair/3")
    assert ours.add("pdserve-kv/pair/seq", 2) == 2 and ours.check(["pdserve-kv/pair/0"])


def test_gloo_transfers_run_with_a_signed_rendezvous_and_curve(launch, llm):
    router = Router(RouterConfig(port=0, local_prefill_threshold=0, credentials=launch.for_router()))
    router.start()
    started = []
    try:
        for role in ("decode", "prefill"):
            worker = Worker(WorkerConfig(role=role, router=router.internal_address, worker_id=f"{role}-gloo",
                                         num_blocks=64, kv_connector="gloo",
                                         credentials=launch.for_role(role)))
            worker.start()
            started.append(worker)
        assert started[0].connector.transport.receiver.dist_config.token is not None
        prompt = code("gloo", 4)
        with Client(router.address, timeout=60) as client:
            (seq,) = collect(client.generate(prompt, max_tokens=6, temperature=0.0)).values()
        assert list(seq.token_ids) == greedy(llm, prompt)
        auth = ClusterAuth(launch.for_client())
        channel, stub = worker_stub(started[0].address, auth)
        with channel:
            assert stub.Stats(pb.StatsRequest(), timeout=5).kv_transfers == 1
    finally:
        for worker in reversed(started):
            worker.stop()
        router.stop()


# -- mTLS between services --------------------------------------------------------------------


def test_mtls_admits_only_certificates_the_cluster_ca_signed(tmp_path, llm):
    ca, other = CA(tmp_path / "ca"), CA(tmp_path / "other", "someone else's CA")
    router_cert, worker_cert, client_cert = ca.issue("router"), ca.issue("worker"), ca.issue("operator")
    stranger = other.issue("stranger")

    def creds(issued) -> ClusterCredentials:
        return ClusterCredentials(cluster_ca=str(ca.pem), cluster_cert=str(issued.cert), cluster_key=str(issued.key))

    router = Router(RouterConfig(port=0, credentials=creds(router_cert)))
    router.start()
    worker = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-tls", num_blocks=32,
                                 credentials=creds(worker_cert)))
    try:
        worker.start()  # registered over mTLS, and the router dials it over mTLS
        with Client(router.address, timeout=60) as client:
            (seq,) = collect(client.generate("def f(x):", max_tokens=4, temperature=0.0)).values()
        assert list(seq.token_ids) == greedy(llm, "def f(x):", 4)
        for address, probe in ((router.internal_address, lambda c: pb_grpc.RegistryStub(c).ListWorkers(
                pb.ListWorkersRequest(), timeout=5)),
                               (worker.address, lambda c: pb_grpc.WorkerStub(c).Stats(pb.StatsRequest(), timeout=5))):
            with ClusterAuth(creds(client_cert)).channel(address) as channel:
                probe(channel)  # the operator's certificate works
            attempts = {
                "plaintext": grpc.insecure_channel(address),
                "no client certificate": grpc.secure_channel(
                    address, grpc.ssl_channel_credentials(root_certificates=ca.pem.read_bytes())),
                "another CA's certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(
                    root_certificates=ca.pem.read_bytes(), private_key=stranger.key.read_bytes(),
                    certificate_chain=stranger.cert.read_bytes())),
            }
            for what, channel in attempts.items():
                with channel:
                    status, _ = refused(lambda: probe(channel))
                    assert status == grpc.StatusCode.UNAVAILABLE, (address, what)
    finally:
        worker.stop()
        router.stop()


# -- the public API through `pdserve up`: TLS, API keys, SIGHUP --------------------------------


def test_api_keys_and_tls_through_pdserve_up(tmp_path, llm):
    ca = CA(tmp_path / "ca")
    server = ca.issue("router")
    old_key, new_key = "k-old-" + "a" * 20, "k-new-" + "b" * 20
    keys = tmp_path / "api-keys"
    keys.write_text(f"# operators' keys\n{old_key}\n\n")
    up = UpProcess(["--prefill", "0", "--decode", "1", "--num-blocks", "128", "--api-keys-file", str(keys),
                    "--tls-cert", str(server.cert), "--tls-key", str(server.key)], tmp_path / "up.log")
    try:
        # The launch's own credentials: private, and what the internal surface wants.
        assert (up.secrets.stat().st_mode & 0o777) == 0o700
        assert all((p.stat().st_mode & 0o777) == 0o600 for p in up.secrets.rglob("*") if p.is_file())
        (worker,) = up.list_workers()
        with grpc.insecure_channel(up.internal) as channel:
            assert refused(lambda: pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5))[0] \
                == UNAUTHENTICATED
        # TLS: a plaintext client gets nowhere, one with the CA does.
        with Client(up.address, timeout=30, api_key=old_key) as plain:
            assert refused(lambda: plain.list_models())[0] == grpc.StatusCode.UNAVAILABLE
        want = greedy(llm, "def fib(n):\n", 5)
        for key in (None, "k-wrong-" + "c" * 20):
            with Client(up.address, timeout=30, api_key=key, tls_ca=str(ca.pem)) as client:
                assert refused(lambda: client.list_models())[0] == UNAUTHENTICATED
                # checked before anything else: a bad request without a key is not even validated
                status, _ = refused(lambda: client.generate("x", max_tokens=0))
                assert status == UNAUTHENTICATED
        with Client(up.address, timeout=60, api_key=old_key, tls_ca=str(ca.pem)) as client:
            (seq,) = collect(client.generate("def fib(n):\n", max_tokens=5, temperature=0.0)).values()
            assert list(seq.token_ids) == want
            text = seq.text
            assert refused(lambda: client.generate("x", max_tokens=0))[0] == grpc.StatusCode.INVALID_ARGUMENT
        # SIGHUP (to the launcher, which passes it on): the new file is in force.
        keys.write_text(f"{new_key}\n")
        up.proc.send_signal(signal.SIGHUP)

        def key_works(key: str) -> bool:
            with Client(up.address, timeout=10, api_key=key, tls_ca=str(ca.pem)) as client:
                try:
                    return bool(client.list_models())
                except grpc.RpcError as e:
                    assert e.code() == UNAUTHENTICATED
                    return False

        wait_for(lambda: key_works(new_key), 20, "the new key to be accepted")
        assert not key_works(old_key)
        # The CLI takes the key and the CA.
        cli = [sys.executable, "-m", "pdserve", "generate", "--addr", up.address, "--tls-ca", str(ca.pem),
               "--max-tokens", "5", "def fib(n):\n"]
        run = subprocess.run([*cli, "--api-key", new_key], cwd=REPO, env=child_env(), capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout == text + "\n"
        run = subprocess.run(cli, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and "UNAUTHENTICATED" in run.stderr
        assert up.all_blocks_free(worker.address)
    finally:
        assert up.stop() == 0


# -- tenants: the prefix cache salted by request and by API key -------------------------------


def cached_tokens(client: Client, prompt: str, **kwargs) -> int:
    (seq,) = collect(client.generate(prompt, max_tokens=2, temperature=0.0, **kwargs)).values()
    return seq.usage.cached_tokens


def test_cache_salts_keep_prefix_caches_apart_across_prefill_and_decode(guarded, llm):
    """Each salt's first run computes everything and its second hits its own cache; the
    router, the prefill and the decode worker hash the salted blocks alike (every prompt
    crosses here, and the prefill worker checks the decode worker's cached hashes)."""
    client = guarded["client"]
    prompt = code("salted", 6)
    assert len(tokens(llm, prompt)) > 3 * 16
    for salt in ("tenant-a", "tenant-b"):
        assert cached_tokens(client, prompt, cache_salt=salt) == 0
        assert cached_tokens(client, prompt, cache_salt=salt) >= 3 * 16
    assert cached_tokens(client, prompt) == 0  # no salt: yet another cache
    (seq,) = collect(client.generate(prompt, max_tokens=6, temperature=0.0, cache_salt="tenant-a")).values()
    assert list(seq.token_ids) == greedy(llm, prompt)
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(prompt, max_tokens=2, cache_salt="x" * 300))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("cache_salt:")


def test_salting_by_api_key_keeps_tenants_apart(tmp_path, llm):
    keys = {"a": "key-a-" + "a" * 20, "b": "key-b-" + "b" * 20}
    path = tmp_path / "keys"
    path.write_text("\n".join(keys.values()))
    router = Router(RouterConfig(port=0, api_keys_file=str(path), salt_cache_by_key=True))
    router.start()
    worker = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-k", num_blocks=64))
    try:
        worker.start()
        clients = {name: Client(router.address, timeout=60, api_key=key) for name, key in keys.items()}
        prompt = code("tenant", 6)
        assert cached_tokens(clients["a"], prompt) == 0
        assert cached_tokens(clients["a"], prompt) > 0
        assert cached_tokens(clients["b"], prompt) == 0  # the same prompt, another key: nothing to learn
        # B cannot name its way into A's cache either: its salt always follows its own key's id.
        assert cached_tokens(clients["b"], prompt, cache_salt=f"{key_id(keys['a'])}/") == 0
        assert cached_tokens(clients["b"], prompt) > 0
        for client in clients.values():
            client.close()
    finally:
        worker.stop()
        router.stop()


# -- no pickle where bytes come from a socket --------------------------------------------------

# Bytes from a socket reach a module that imports a network library, the gRPC messages
# (pdserve.proto) or the KV transfer (pdserve.kvtransfer).
NETWORK_MODULES = {"zmq", "grpc", "socket", "socketserver", "http", "urllib", "torch.distributed", "requests",
                   "multiprocessing.connection", "asyncio", "pdserve.proto", "pdserve.kvtransfer"}
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle", "joblib"}


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def unsafe_uses(source: str) -> list[str]:
    """Deserializers that can run code: pickle and kin, torch.load without
    weights_only=True, numpy loads with allow_pickle=True, pyzmq's *_pyobj."""
    tree = ast.parse(source)
    found = [f"import {name}" for name in _imports(tree) if name.split(".")[0] in UNSAFE_MODULES]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        if name.endswith(("torch.load", "serialization.load")) or name == "load" and "weights_only" in keywords:
            safe = keywords.get("weights_only")
            if not (isinstance(safe, ast.Constant) and safe.value is True):
                found.append(f"{name}() without weights_only=True (line {node.lineno})")
        if name.endswith(("np.load", "numpy.load")):
            allow = keywords.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value is not False or allow is not None and not isinstance(allow, ast.Constant):
                found.append(f"{name}(allow_pickle=...) (line {node.lineno})")
        if name.endswith(("recv_pyobj", "send_pyobj", "recv_serialized", "loads")) and "pickle" in name:
            found.append(f"{name}() (line {node.lineno})")
        if name.endswith(("recv_pyobj", "send_pyobj")):
            found.append(f"{name}() (line {node.lineno})")
    return found


def test_the_unsafe_use_finder_finds_them():
    bad = ("import pickle\nimport torch\nimport numpy as np\nimport zmq\n"
           "torch.load(f)\ntorch.load(f, weights_only=False)\nnp.load(f, allow_pickle=True)\ns.recv_pyobj()\n")
    assert len(unsafe_uses(bad)) == 5
    assert unsafe_uses("import torch\ntorch.load(f, weights_only=True)\nimport numpy\nnumpy.load(f)\n") == []


def test_no_module_that_reads_from_a_socket_unpickles():
    sources = [p for p in REPO.rglob("*.py") if not {".venv", "tests", "build"} & set(p.relative_to(REPO).parts)]
    readers = {}
    for path in sources:
        tree = ast.parse(path.read_text())
        if any(name == m or name.startswith(m + ".") for name in _imports(tree) for m in NETWORK_MODULES):
            readers[path.relative_to(REPO).as_posix()] = path
    # The finder must see the network paths it is meant to guard.
    assert {"kvtransfer/transports/zmq.py", "kvtransfer/transports/nccl.py", "services/router/main.py", "services/node.py",
            "services/router/registry.py", "launch/cluster.py"} <= set(readers)
    problems = {name: unsafe_uses(path.read_text()) for name, path in readers.items()}
    assert {name: found for name, found in problems.items() if found} == {}


# -- the credentials a launch makes ------------------------------------------------------------


def test_each_launch_makes_fresh_private_credentials(tmp_path):
    one, two = generate(tmp_path / "one"), generate(tmp_path / "two")
    assert one.token_file.read_text() != two.token_file.read_text() and len(one.token_file.read_text()) == 64
    assert (one.directory / "kv" / "decode.key_secret").read_bytes() != (two.directory / "kv" / "decode.key_secret").read_bytes()
    for path in [one.directory, *one.directory.rglob("*")]:
        assert (path.stat().st_mode & 0o777) == (0o700 if path.is_dir() else 0o600), path
    decode = ClusterAuth(one.for_role("decode"))
    curve = decode.kv_curve()
    senders = {zmq.auth.load_certificate(one.directory / "kv" / f"{r}.key")[0] for r in ("prefill", "mixed")}
    assert curve is not None and curve.authorized_keys == senders and decode.token == one.token_file.read_text()
    again = generate(tmp_path / "one")  # a relaunch into the same directory: new secrets
    assert again.token_file.read_text() != two.token_file.read_text()
    with pytest.raises(ValueError, match="cluster_token_file"):
        generate(tmp_path / "three", one.for_router())


def test_credentials_travel_as_contents_to_a_private_directory(tmp_path):
    """What the Ray launcher hands an actor on another node: the files' contents,
    written back privately there, giving the same token and CURVE keys."""
    launch = generate(tmp_path / "launch")
    carried = unpack(pack(launch.for_role("decode")), tmp_path / "actor")
    for path in [tmp_path / "actor", *(tmp_path / "actor").rglob("*")]:
        assert (path.stat().st_mode & 0o777) == (0o700 if path.is_dir() else 0o600), path
    here, there = ClusterAuth(launch.for_role("decode")), ClusterAuth(carried)
    assert there.token == here.token
    assert there.kv_curve() == here.kv_curve()
    for bad in ({"cluster_token_file": {"../escape": "x"}}, {"python_path": {"x": "y"}}):
        with pytest.raises(ValueError, match="credentials"):
            unpack(bad, tmp_path / "bad")
