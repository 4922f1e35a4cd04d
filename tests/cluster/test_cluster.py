"""The gRPC cluster end to end: real processes started by `pdserve up`, on the
embedded default model, checked against the engine run in this process.

Two clusters, each started once, without prefill workers (every request prefills on
its decode worker; the prefill/decode path is tests/cluster/test_cluster_pd.py): `single`
(router + 1 decode worker) for results, validation, cancellation and reflection;
`pair` (router + 2 decode workers that run one sequence at a time) for killing a
worker mid-stream and joining a new one.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cluster_helpers import REPO, Stream, UpProcess, child_env, is_prefork_helper, pid_alive, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from forked_pdserve import spawn_pdserve
from pdserve.engine import LLM, SamplingParams
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=45)

PROMPTS = [
    "import os\n\n\ndef ",
    "class Stack:\n    def __init__(self):\n        ",
    "    def __repr__(self):\n        return ",
    "for i in range(",
    "def fib(n):\n",
    "        if not isinstance(key, str):\n            raise ",
]
MAX_N = 4


@pytest.fixture(scope="module")
def llm():
    return LLM(num_blocks=512)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    up = UpProcess(
        ["--prefill", "0", "--decode", "1", "--num-blocks", "512", "--max-n", str(MAX_N)],
        tmp_path_factory.mktemp("single") / "up.log",
    )
    yield up
    up.stop()


@pytest.fixture(scope="module")
def client(single):
    with Client(single.address, timeout=120) as c:
        yield c


def worker_address(up: UpProcess) -> str:
    (worker,) = up.list_workers()
    return worker.address


def run_all(client: Client, prompts, **sampling) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: collect(client.generate(p, **sampling)), prompts))


# -- results ------------------------------------------------------------------------------


def test_greedy_batch_matches_the_engine(client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    got = run_all(client, PROMPTS, max_tokens=24, temperature=0.0)
    for want, have in zip(expected, got):
        (seq,) = have.values()
        assert list(seq.token_ids) == want.outputs[0].token_ids
        assert seq.text == want.outputs[0].text
        assert seq.finish_reason == want.outputs[0].finish_reason
        assert seq.usage.prompt_tokens == len(want.prompt_token_ids)
        assert seq.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert 0 < seq.timing.ttft_seconds <= seq.timing.e2e_seconds
        assert seq.timing.tpot_seconds > 0


def test_streams_incrementally_with_usage_only_at_the_end(client, llm):
    messages = list(client.generate(PROMPTS[1], max_tokens=16, temperature=0.0, ignore_eos=True))
    assert len(messages) > 3
    assert all(not m.finish_reason and not m.HasField("usage") for m in messages[:-1])
    last = messages[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 16
    assert "".join(m.text for m in messages) == llm.generate([PROMPTS[1]], SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0].text


def test_token_id_prompt_and_request_id(client, llm):
    ids = llm.engine.tokenizer.encode(PROMPTS[0])
    want = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].token_ids
    messages = list(client.generate(ids, request_id="mine-1", max_tokens=8, temperature=0.0))
    assert {m.request_id for m in messages} == {"mine-1"}
    assert [t for m in messages for t in m.token_ids] == want


def test_parallel_sampling_n3_matches_the_engine(client, llm):
    params = dict(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, n=3)
    want = llm.generate([PROMPTS[4]], SamplingParams(**params))[0]
    got = collect(client.generate(PROMPTS[4], **params))
    assert sorted(got) == [0, 1, 2]
    for c in want.outputs:
        assert list(got[c.index].token_ids) == c.token_ids
        assert got[c.index].text == c.text
        assert got[c.index].cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-4)


def test_beam_search_matches_the_engine(client, llm):
    params = dict(max_tokens=10, temperature=0.0, beam_width=3, n=2)
    want = llm.generate([PROMPTS[2]], SamplingParams(**params))[0]
    got = collect(client.generate(PROMPTS[2], **params))
    assert sorted(got) == [0, 1]
    for c in want.outputs:
        assert list(got[c.index].token_ids) == c.token_ids
        assert got[c.index].cumulative_logprob == pytest.approx(c.cumulative_logprob, abs=1e-4)
        assert got[c.index].finish_reason == c.finish_reason


def test_logprobs_and_stop_strings(client, llm):
    want = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0.0, logprobs=2))[0].outputs[0]
    (got,) = collect(client.generate(PROMPTS[3], max_tokens=10, temperature=0.0, logprobs=2)).values()
    assert [lp.token_id for lp in got.logprobs] == want.token_ids
    for lp, entry in zip(got.logprobs, want.logprobs):
        assert lp.logprob == pytest.approx(entry[lp.token_id], abs=1e-4)
        assert len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob
    stop = want.text[2:4]
    stopped = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop]))[0].outputs[0]
    (got,) = collect(client.generate(PROMPTS[3], max_tokens=10, temperature=0.0, stop=[stop])).values()
    assert got.text == stopped.text and stop not in got.text
    assert list(got.token_ids) == stopped.token_ids and got.finish_reason == "stop"


def test_list_models_and_health(single, client):
    (model,) = client.list_models()
    assert model.name == "pdserve-tiny-code" and model.max_model_len == 1024 and model.max_n == MAX_N
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    # The worker's services are internal: its health answers anyone, its reflection only the cluster.
    servers = ((grpc.insecure_channel(single.address), "pdserve.v1.Generation"),
               (single.auth.channel(worker_address(single)), "pdserve.v1.Worker"))
    for channel, service in servers:
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            published = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(published)


# -- bad input ------------------------------------------------------------------------------

BAD = [
    ("empty text", dict(prompt=""), "prompt"),
    ("empty ids", dict(prompt=[]), "prompt"),
    ("prompt too long", dict(prompt=[5] * 1100), "prompt"),
    ("max_tokens 0", dict(max_tokens=0), "max_tokens"),
    ("max_tokens past the model", dict(max_tokens=2000), "max_tokens"),
    ("negative temperature", dict(temperature=-0.5), "temperature"),
    ("top_p 0", dict(top_p=0.0), "top_p"),
    ("top_p above 1", dict(top_p=1.5), "top_p"),
    ("n above --max-n", dict(n=MAX_N + 1), "n"),
    ("beam width above --max-n", dict(beam_width=MAX_N + 1), "beam_width"),
    ("unknown model", dict(model="gpt-17"), "model"),
    ("negative token id", dict(prompt=[3, -1, 4]), "token_ids"),
    ("token id past the vocabulary", dict(prompt=[3, 4096]), "token_ids"),
    ("early_stopping", dict(early_stopping="sometimes"), "early_stopping"),
    ("min_tokens above max_tokens", dict(min_tokens=9, max_tokens=4), "min_tokens"),
]


@pytest.mark.parametrize("case, kwargs, field", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument_naming_the_field(client, case, kwargs, field):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "def f():")
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(prompt, timeout=30, **kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:"), info.value.details()


def test_missing_prompt(single):
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
    from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(single.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("prompt:")


# -- cancellation and deadlines ---------------------------------------------------------------


def test_cancel_frees_the_blocks(single, client):
    worker = worker_address(single)
    call = client.generate(PROMPTS[0], max_tokens=900, temperature=0.0, ignore_eos=True)
    for _, _ in zip(range(3), call):
        pass
    assert single.stats(worker).num_running == 1
    call.cancel()
    wait_for(lambda: single.all_blocks_free(worker), 10, "the cancelled request's blocks to be freed")


def test_deadline_aborts_the_request(single, client):
    worker = worker_address(single)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate(PROMPTS[1], max_tokens=900, temperature=0.0, ignore_eos=True, timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    wait_for(lambda: single.all_blocks_free(worker), 10, "the expired request's blocks to be freed")


# -- a client that knows only what reflection publishes ----------------------------------------


def test_generate_through_reflection_alone(single):
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(single.address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = database.get_services()
        assert "pdserve.v1.Generation" in services and "grpc.health.v1.Health" in services
        pool = descriptor_pool.DescriptorPool(database)
        method = pool.FindServiceByName("pdserve.v1.Generation").methods_by_name["Generate"]
        assert method.server_streaming
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        request = request_class(text="def fib(n):\n")
        request.sampling.max_tokens = 6
        request.sampling.temperature = 0.0
        generate = channel.unary_stream(
            f"/{method.containing_service.full_name}/{method.name}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        replies = list(generate(request, timeout=60))
    assert sum(len(r.token_ids) for r in replies) == 6
    assert replies[-1].finish_reason == "length" and replies[-1].usage.completion_tokens == 6


def test_generate_cli_streams_json(single):
    import json

    run = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--addr", single.address, "--max-tokens", "5",
         "--n", "2", "--json", "def f(x):"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert {r["index"] for r in records} == {0, 1}
    finals = [r for r in records if r["finish_reason"]]
    assert len(finals) == 2 and all(r["usage"]["completion_tokens"] == 5 for r in finals)
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--addr", single.address, "--max-tokens", "0", "x"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=120,
    )
    assert bad.returncode == 1 and "INVALID_ARGUMENT: max_tokens:" in bad.stderr


def test_single_worker_has_every_block_free_afterwards(single):
    wait_for(lambda: single.all_blocks_free(worker_address(single)), 10, "every block to be free")


def test_up_prints_one_line_and_leaves_no_process_behind(single):
    children = single.children()
    worker_pids = [w.pid for w in single.list_workers()]
    # the router, the worker and the helper the worker was forked from (launch/prefork.py)
    helpers = [pid for pid in children if is_prefork_helper(pid)]
    assert len(children) == 3 and set(worker_pids) <= set(children) and len(helpers) == 1
    assert single.stop() == 0
    assert single.stdout_lines == [f"ready {single.address} internal {single.internal}"]
    assert not [pid for pid in children if pid_alive(pid)]


# -- faults: a pair of decode workers, one sequence at a time each -----------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    up = UpProcess(
        # --no-supervise: a killed worker stays dead here (tests/cluster/test_chaos.py has the restarts)
        ["--prefill", "0", "--decode", "2", "--num-blocks", "256", "--max-num-seqs", "1", "--worker-timeout", "3",
         "--no-supervise"],
        tmp_path_factory.mktemp("pair") / "up.log",
    )
    yield up
    up.stop()


def test_killed_worker_s_stream_migrates_and_the_queued_are_retried(pair, llm):
    """The stream the killed worker was decoding continues on the other worker
    (router stream migration, issue 21): every stream ends with the uninterrupted
    run's tokens, none duplicated, none missing."""
    params = dict(max_tokens=400, temperature=0.0, ignore_eos=True)
    want = llm.generate([PROMPTS[5]], SamplingParams(**params))[0].outputs[0].token_ids
    workers = pair.list_workers()
    assert len(workers) == 2
    with Client(pair.address, timeout=180) as client:
        streams = [Stream(client, PROMPTS[5], **params) for _ in range(4)]
        # Two run (one per worker), two wait behind them.
        wait_for(lambda: sum(bool(s.tokens) for s in streams) >= 2, 60, "both workers to stream")
        victim = workers[0]
        assert pair.stats(victim.address).num_running == 1
        cut = sorted(len(s.tokens) for s in streams)[-2:]  # the two running streams' progress
        subprocess.run(["kill", "-9", str(victim.pid)], check=True)
        for s in streams:
            s.join(180)
    assert [s.error for s in streams] == [None] * 4
    assert all(s.tokens == want for s in streams)  # including the migrated one and the one queued on the victim
    assert 0 < min(cut) < 400
    wait_for(lambda: [w.worker_id for w in pair.list_workers()] == [workers[1].worker_id], 10,
             "the router to drop the killed worker")
    wait_for(lambda: victim.pid not in pair.children(), 15, "the launcher to reap the killed worker")


def test_a_worker_joins_while_serving(pair, tmp_path):
    late = spawn_pdserve(
        ["decode", "--router", pair.internal, "--worker-id", "late-0", "--num-blocks", "256", "--max-num-seqs", "1",
         "--cluster-token-file", str(pair.secrets / "cluster-token")],
        tmp_path / "late.log", stdout_to_log=True,
    )
    try:
        wait_for(lambda: "late-0" in {w.worker_id for w in pair.list_workers()}, 120, "late-0 to register")
        late_address = next(w.address for w in pair.list_workers() if w.worker_id == "late-0")
        with Client(pair.address, timeout=120) as client:
            # distinct prompts at once: no cached prefix draws them all to the worker that
            # served one before (two copies of one prompt could both go there)
            results = run_all(client, PROMPTS[:4], max_tokens=30, temperature=0.0, ignore_eos=True)
        assert all(len(r[0].token_ids) == 30 for r in results)
        assert pair.stats(late_address).prefix_cache_queries > 0  # it got some of them
        assert pair.all_blocks_free(late_address)
    finally:
        late.send_signal(signal.SIGTERM)
        late.wait(30)
    wait_for(lambda: "late-0" not in {w.worker_id for w in pair.list_workers()}, 10, "late-0 to be dropped")


def test_surviving_workers_have_every_block_free(pair):
    survivors = pair.list_workers()
    assert survivors
    for w in survivors:
        wait_for(lambda: pair.all_blocks_free(w.address), 10, f"{w.worker_id}'s blocks to be free")


def test_a_killed_launcher_leaves_no_process_behind(pair):
    children = pair.children()
    assert len(children) == 3  # the router, decode-1 (decode-0 was killed) and the helper they fork from
    pair.proc.kill()
    pair.proc.wait(10)
    wait_for(lambda: not [pid for pid in children if pid_alive(pid)], 15, "the orphaned children to exit")
