"""The router's prefill/decode path through the KV seam, in one process.

The router's Reserve -> Prefill -> Decode flow and the workers' Reserve, Prefill and
Decode handlers run for real over gRPC, and the KV crosses between the two workers'
engines over the ZeroMQ transport (`--kv-connector zmq`), as in a cluster.
"""

from __future__ import annotations


import grpc
import pytest
import torch

from cluster_helpers import all_blocks_free, stats, wait_for
from pdserve.engine import LLM, SamplingParams
from pdserve.services.node import Worker
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import WorkerConfig

PROMPTS = ["import os\n\n\ndef " * 6, "class Stack:\n    def __init__(self):\n        " * 3, "for i in range("]
# Fresh long prompts: one the decode worker has already received is cached there,
# and prefills locally (its uncached part is below the threshold).
FIB = "def fib(n):\n    return n\n" * 5
SORT = "def sort(xs):\n    return sorted(xs)\n" * 4


def shipped(worker: Worker) -> int:
    """Transfers a prefill worker shipped and its receiver acknowledged."""
    return worker.connector.stats().kv_transfers


def cancels(worker: Worker) -> int:
    """Reservations a decode worker's receiver was told to stop filling."""
    return worker.connector.decode.stats["cancelled"]


def loopback_pair(router: Router, suffix: str, decode_blocks: int, prefill_blocks: int = 256):
    """decode-<suffix> and prefill-<suffix> (not started), registering with `router`,
    the KV crossing between them over ZeroMQ: (decode, prefill)."""
    decode = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id=f"decode-{suffix}",
                                 num_blocks=decode_blocks, kv_connector="zmq"))
    prefill = Worker(WorkerConfig(role="prefill", router=router.internal_address, worker_id=f"prefill-{suffix}",
                                  num_blocks=prefill_blocks, kv_connector="zmq"))
    return decode, prefill


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(num_blocks=256)


@pytest.fixture(scope="module")
def cluster():
    router = Router(RouterConfig(port=0, local_prefill_threshold=20, worker_timeout=3.0))
    address = router.start()
    decode, prefill = loopback_pair(router, "0", decode_blocks=256)
    decode.start()
    prefill.start()
    client = Client(address, timeout=60)
    yield dict(router=router, client=client, decode=decode, prefill=prefill)
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
    # the short prompt stayed on the decode worker
    wait_for(lambda: shipped(cluster["prefill"]) == 2, 10, "two transfers to be acknowledged")


def test_parallel_samples_prefill_once_and_fork_on_decode(cluster, llm):
    params = dict(max_tokens=8, temperature=0.7, seed=3, n=2)
    want = llm.generate([FIB], SamplingParams(**params))[0]
    before = shipped(cluster["prefill"])
    got = collect(cluster["client"].generate(FIB, **params))
    assert [list(got[i].token_ids) for i in (0, 1)] == [c.token_ids for c in want.outputs]
    wait_for(lambda: shipped(cluster["prefill"]) == before + 1, 10, "one transfer to be acknowledged")


def test_logprobs_of_the_first_token_come_from_prefill(cluster, llm):
    before = shipped(cluster["prefill"])
    want = llm.generate([SORT], SamplingParams(max_tokens=5, temperature=0.0, logprobs=1))[0].outputs[0]
    got = collect(cluster["client"].generate(SORT, max_tokens=5, temperature=0.0, logprobs=1))[0]
    wait_for(lambda: shipped(cluster["prefill"]) == before + 1, 10, "one transfer to be acknowledged")
    assert [lp.token_id for lp in got.logprobs] == want.token_ids
    assert got.logprobs[0].logprob == pytest.approx(want.logprobs[0][want.token_ids[0]], abs=1e-4)


def test_a_constrained_request_is_masked_on_both_workers(cluster, llm):
    """A JSON-schema request through the router: the prefill worker samples the first
    token under the constraint, the decode worker's matcher goes on after it; the tokens
    are the colocated engine's (greedy, seeded, n > 1), and a constraint the backend
    refuses is INVALID_ARGUMENT with its reason. (Built as a raw GenerateRequest: the
    client's keyword form does not take constraints yet.)"""
    from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
    from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
    from pdserve.services.common.convert import options_of

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"]}
    constraint = StructuredOutputs.json_schema(schema)
    prompt = "import json\n\n\ndef load(" * 5  # long: prefilled remotely
    with grpc.insecure_channel(cluster["router"].address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        def generate(params: SamplingParams) -> list:
            got = collect(stub.Generate(pb.GenerateRequest(text=prompt, sampling=options_of(params)), timeout=60))
            return [got[i] for i in sorted(got)]

        before = shipped(cluster["prefill"])
        for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=5), dict(temperature=1.0, seed=5, n=2)):
            params = SamplingParams(max_tokens=64, structured_outputs=constraint, **kw)
            want = llm.generate([prompt], params)[0].outputs
            got = generate(params)
            assert [list(g.token_ids) for g in got] == [w.token_ids for w in want]
            assert all(w.finish_reason == "stop" for w in want)
        wait_for(lambda: shipped(cluster["prefill"]) > before, 10, "the prompt's KV to cross")
        assert cluster["prefill"].engine.stats().structured_outputs.requests
        bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(ConstraintKind.REGEX, "(a"))
        with pytest.raises(grpc.RpcError) as err:
            generate(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex: xgrammar refused it" in err.value.details()


def test_cancel_during_disaggregated_stream_frees_both_sides(cluster):
    call = cluster["client"].generate("x = 1\n" * 40, max_tokens=500, temperature=0.0, ignore_eos=True)
    next(call)
    next(call)
    call.cancel()
    for worker in (cluster["decode"], cluster["prefill"]):
        wait_for(lambda: all_blocks_free(worker.address), 10, f"{worker.config.id}'s blocks to be free")
    assert shipped(cluster["prefill"]) > 0  # it did cross before it was cancelled


def test_a_reservation_cancelled_before_its_kv_arrived_tells_the_receiver_first(cluster):
    """Aborted while waiting for its KV: the receiver is told to stop filling the
    blocks before they are freed (the request table's one way out)."""
    decode = cluster["decode"]
    before = cancels(decode)
    rid = "abandoned-reservation"
    decode.loop.reserve(rid, list(range(3, 60)), SamplingParams(max_tokens=4), lease=30.0, timeout=5)
    decode.loop.abort(rid)
    wait_for(lambda: all_blocks_free(decode.address), 10, "the reservation's blocks to be free")
    assert cancels(decode) == before + 1 and rid not in decode.connector.decode.expecting()


def test_bad_input_reaches_no_worker(cluster):
    before = shipped(cluster["prefill"])
    reserved = cluster["decode"].connector.decode.stats["reserved"]
    with pytest.raises(grpc.RpcError) as info:
        list(cluster["client"].generate(PROMPTS[0], max_tokens=5, top_p=0.0))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert cluster["decode"].connector.decode.stats["reserved"] == reserved  # no reservation, no transfer
    assert shipped(cluster["prefill"]) == before


def test_without_a_prefill_worker_decode_prefills_itself(cluster, llm):
    cluster["prefill"].stop()
    cluster["router"].registry.probe_soon()
    wait_for(lambda: not cluster["router"].registry.has_remote_prefill(), 10, "the prefill worker to be dropped")
    want = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].token_ids
    reserved = cluster["decode"].connector.decode.stats["reserved"]
    got = collect(cluster["client"].generate(PROMPTS[0], max_tokens=6, temperature=0.0))[0]
    assert list(got.token_ids) == want and cluster["decode"].connector.decode.stats["reserved"] == reserved
    assert all_blocks_free(cluster["decode"].address)
    assert stats(cluster["decode"].address).num_reserved == 0


def assert_engine_tokens(address: str, llm) -> None:
    """The cluster at `address` gives `llm`'s greedy and seeded n = 2 tokens."""
    with Client(address, timeout=60) as client:
        for prompt, params in ((PROMPTS[1], dict(max_tokens=10, temperature=0.0)),
                               (FIB, dict(max_tokens=8, temperature=0.8, seed=5, n=2))):
            want = [c.token_ids for c in llm.generate([prompt], SamplingParams(**params))[0].outputs]
            got = collect(client.generate(prompt, **params))
            assert [list(got[i].token_ids) for i in range(len(want))] == want


def test_an_enforce_eager_pair_gives_the_fast_paths_tokens(llm):
    """--enforce-eager workers (plain linear layers) against the fast path's engine (the
    default model's MLPs and LM head prepacked): the same greedy and seeded tokens."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=0, worker_timeout=3.0))
    address = router.start()
    workers = [Worker(WorkerConfig(role=role, router=router.internal_address, worker_id=f"{role}-eager",
                                   num_blocks=64, kv_connector="zmq", enforce_eager=True))
               for role in ("decode", "prefill")]
    assert llm.engine.runner.prepacked > 0
    try:
        for worker in workers:
            worker.start()
            assert worker.engine.runner.prepacked == 0
        assert_engine_tokens(address, llm)
        wait_for(lambda: shipped(workers[1]) == 2, 10, "two transfers to be acknowledged")
    finally:
        for worker in workers:
            worker.stop()
        router.stop()


def test_a_captured_decode_worker_gives_the_eager_paths_tokens(llm):
    """A decode worker with --decode-capture-sizes 1,2 (its decode steps compiled) fed
    over ZeroMQ by a prefill worker: the engine's greedy and seeded n = 2 tokens."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=0, worker_timeout=3.0))
    address = router.start()
    decode = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-captured",
                                 num_blocks=64, kv_connector="zmq", decode_capture_sizes="1,2"))
    prefill = Worker(WorkerConfig(role="prefill", router=router.internal_address, worker_id="prefill-plain",
                                  num_blocks=64, kv_connector="zmq"))
    try:
        for worker in (decode, prefill):
            worker.start()
        graphs = decode.engine.runner.captured
        assert graphs is not None and sorted(graphs.buckets) == [1, 2]
        assert_engine_tokens(address, llm)
        assert graphs.steps > 0
        wait_for(lambda: shipped(prefill) == 2, 10, "two transfers to be acknowledged")
        assert all_blocks_free(decode.address)
    finally:
        for worker in (decode, prefill):
            worker.stop()
        router.stop()


def test_a_dead_prefill_worker_is_skipped_for_the_next(llm, caplog):
    """The router still lists prefill-b (no poll yet) but it is gone: prefill-a serves."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=0, stats_interval=60.0, worker_timeout=60.0,
                                 heartbeat_interval=30.0))
    address = router.start()
    decode = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-x", num_blocks=64,
                                 kv_connector="zmq"))
    prefills = {name: Worker(WorkerConfig(role="prefill", router=router.internal_address, worker_id=name, num_blocks=64,
                                          kv_connector="zmq")) for name in ("prefill-a", "prefill-b")}
    try:
        for worker in (decode, *prefills.values()):
            worker.start()
        prefills["prefill-b"].stop()  # the router would pick it first (ties go to the larger id)
        want = llm.generate([SORT], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].token_ids
        with Client(address, timeout=60) as client:
            got = collect(client.generate(SORT, max_tokens=6, temperature=0.0))[0]
        assert list(got.token_ids) == want
        wait_for(lambda: shipped(prefills["prefill-a"]) == 1, 10, "prefill-a's transfer to be acknowledged")
        assert (shipped(prefills["prefill-a"]), shipped(prefills["prefill-b"])) == (1, 0)
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
    failing it with UNAVAILABLE (found by tests/cluster/test_load.py with a small cache)."""
    router = Router(RouterConfig(port=0, local_prefill_threshold=0))
    address = router.start()
    decode, prefill = loopback_pair(router, "r", decode_blocks=16)
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
        wait_for(lambda: shipped(prefill) == 1, 10, "the first request's transfer to be acknowledged")
        assert decode.connector.decode.stats["reserved"] == 1  # only the first request's KV crossed
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


def test_an_eagle3_pair_drafts_as_a_local_prefill_would(tmp_path):
    """Issue 22: the prefill worker runs the EAGLE-3 head (the embedded model's) over each
    prompt and ships its state with the KV; the decode worker's acceptance counters equal
    an engine's that prefilled the same prompts itself (vLLM's P/D acceptance test), and
    its tokens are that engine's. A prefill worker with another head, or none, is refused
    at registration: its state would not be this head's."""
    import json

    from eagle_heads import build_eagle_head
    from pdserve.engine.config import DEFAULT_EAGLE3_HEAD, DEFAULT_MODEL

    config = {"method": "eagle3", "num_speculative_tokens": 4, "model": DEFAULT_EAGLE3_HEAD, "measure_payoff": False}
    spec = json.dumps(config)
    router = Router(RouterConfig(port=0, local_prefill_threshold=20, worker_timeout=3.0))
    address = router.start()
    decode = Worker(WorkerConfig(role="decode", router=router.internal_address, worker_id="decode-eagle",
                                 num_blocks=256, kv_connector="zmq", speculative_config=spec))
    prefill = Worker(WorkerConfig(role="prefill", router=router.internal_address, worker_id="prefill-eagle",
                                  num_blocks=256, kv_connector="zmq", speculative_config=spec))
    local = LLM(num_blocks=256, speculative_config=config)
    prompts = [FIB, SORT, PROMPTS[1]]
    try:
        decode.start()
        prefill.start()
        assert prefill.engine.kv_layout == decode.engine.kv_layout and "eagle_head=" in decode.engine.kv_layout
        with Client(address, timeout=60) as client:
            for prompt in prompts:  # one at a time: the same passes on both sides
                out = collect(client.generate(prompt, max_tokens=32, temperature=0.0, ignore_eos=True))[0]
                want = local.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
                assert list(out.token_ids) == want[0].outputs[0].token_ids
        assert shipped(prefill) == len(prompts)  # every prompt crossed
        got, expected = stats(decode.address), local.stats().spec_decode
        assert (got.spec_decode_num_drafts, got.spec_decode_num_draft_tokens, got.spec_decode_num_accepted_tokens,
                tuple(got.spec_decode_num_accepted_tokens_per_pos)) == (
            expected.num_drafts, expected.num_draft_tokens, expected.num_accepted_tokens,
            expected.num_accepted_tokens_per_pos)
        assert expected.num_accepted_tokens > 0
        wait_for(lambda: all_blocks_free(decode.address) and all_blocks_free(prefill.address), 15, "every block free")

        other = tmp_path / "other-head"
        build_eagle_head(other, DEFAULT_MODEL, "eagle3", draft_vocab=1024, aux_layers=[1, 2, 3])
        for worker_id, extra in (("prefill-other-head", {"speculative_config": json.dumps({**config, "model": str(other)})}),
                                 ("prefill-no-head", {})):
            stranger = Worker(WorkerConfig(role="prefill", router=router.internal_address, worker_id=worker_id,
                                           num_blocks=64, kv_connector="zmq", register_timeout=10.0, **extra))
            try:
                with pytest.raises(Exception, match="kv_layout"):
                    stranger.start()
            finally:
                stranger.stop()
    finally:
        prefill.stop()
        decode.stop()
        router.stop()

