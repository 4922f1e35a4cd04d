"""Poison pills (issue 13): while one long greedy request streams through a real local
cluster (`pdserve up`: 1 prefill + 1 decode worker, the embedded model), hostile
requests arrive one after another: out-of-range and non-finite numbers, huge counts
and strings, ids out of the vocabulary, an unknown model, oversized prompts, bad stop
strings, absurd logprob counts; some at the router, some straight at the decode
worker's internal service (a peer that skips the router). Each gets a client-error
status whose message names the field; the long request streams exactly the tokens
of its solo run, and every block is free at the end.
"""

from __future__ import annotations

import grpc
import pytest

from cluster_helpers import Stream, UpProcess, wait_for
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import Client, options_from_kwargs

pytestmark = pytest.mark.cluster(seconds=25)

INF, NAN = float("inf"), float("nan")
INVALID = grpc.StatusCode.INVALID_ARGUMENT
MAX_PROMPT_TOKENS = 600
MAX_PROMPT_BYTES = 1 << 20
# Long enough to prefill on the prefill worker (KV over ZeroMQ), then a long decode.
LONG_PROMPT = "def long_function(data):\n" + "".join(f"    v{k} = process(data, {k})\n" for k in range(12))
LONG = dict(max_tokens=600, temperature=0.0, ignore_eos=True)

# (name, prompt, request fields, sampling) -> the field its status must name.
# prompt: str (text), list (token ids) or None (neither).
HOSTILE: list[tuple[str, object, dict, dict, str]] = [
    ("infinite temperature", "x", {}, dict(temperature=INF), "temperature"),
    ("NaN temperature", "x", {}, dict(temperature=NAN), "temperature"),
    ("negative temperature", "x", {}, dict(temperature=-1.0), "temperature"),
    ("top_p zero", "x", {}, dict(top_p=0.0), "top_p"),
    ("NaN top_p", "x", {}, dict(top_p=NAN), "top_p"),
    ("min_p above one", "x", {}, dict(min_p=2.0), "min_p"),
    ("negative top_k", "x", {}, dict(top_k=-5), "top_k"),
    ("zero repetition penalty", "x", {}, dict(repetition_penalty=0.0), "repetition_penalty"),
    ("subnormal repetition penalty", "x", {}, dict(repetition_penalty=5e-324), "repetition_penalty"),
    ("huge presence penalty", "x", {}, dict(presence_penalty=1e308), "presence_penalty"),
    ("-inf frequency penalty", "x", {}, dict(frequency_penalty=-INF), "frequency_penalty"),
    ("NaN length penalty", "x", {}, dict(length_penalty=NAN), "length_penalty"),
    ("a million logprobs", "x", {}, dict(logprobs=1_000_000), "logprobs"),
    ("a million prompt logprobs", "x", {}, dict(prompt_logprobs=1_000_000), "prompt_logprobs"),
    ("a million samples", "x", {}, dict(n=1_000_000), "n"),
    ("a million beams", "x", {}, dict(beam_width=1_000_000), "beam_width"),
    ("logprobs with beams", "x", {}, dict(beam_width=2, logprobs=1), "logprobs"),
    ("max_tokens 2**31-1", "x", {}, dict(max_tokens=2**31 - 1), "max_tokens"),
    ("max_tokens zero", "x", {}, dict(max_tokens=0), "max_tokens"),
    ("negative min_tokens", "x", {}, dict(min_tokens=-1), "min_tokens"),
    ("ten thousand stop strings", "x", {}, dict(stop=["a"] * 10_000), "stop"),
    ("a 100 kB stop string", "x", {}, dict(stop=["x" * 100_000]), "stop"),
    ("an empty stop string", "x", {}, dict(stop=[""]), "stop"),
    ("stop id 10**12", "x", {}, dict(stop_token_ids=[10**12]), "stop_token_ids"),
    ("100k stop ids", "x", {}, dict(stop_token_ids=list(range(100_000))), "stop_token_ids"),
    ("bad early_stopping", "x", {}, dict(early_stopping="maybe"), "early_stopping"),
    ("token id = vocab size", [5, 4096, 6], {}, {}, "token_ids"),
    ("negative token id", [5, -1], {}, {}, "token_ids"),
    ("token id 2**62", [2**62], {}, {}, "token_ids"),
    ("100k-token prompt", [7] * 100_000, {}, {}, "prompt"),
    ("2 MB text prompt", "y" * (2 << 20), {}, {}, "text"),
    ("no prompt", None, {}, {}, "prompt"),
    ("empty text", "", {}, {}, "prompt"),
    ("unknown model", "x", dict(model="gpt-17"), {}, "model"),
    ("100 kB model name", "x", dict(model="m" * 100_000), {}, "model"),
    ("10 kB request id", "x", dict(request_id="r" * 10_000), {}, "request_id"),
    ("10 kB cache salt", "x", dict(cache_salt="s" * 10_000), {}, "cache_salt"),
    ("prompt + max_tokens past max_model_len", [7] * 500, {}, dict(max_tokens=1000), "max_tokens"),
]
# Straight at the decode worker (Decode with local_prefill): the engine's own
# admission refuses them, with the same messages.
HOSTILE_TO_WORKER: list[tuple[str, list[int], dict, str]] = [
    ("a million logprobs", [5, 6, 7], dict(logprobs=1_000_000), "logprobs"),
    ("NaN temperature", [5, 6, 7], dict(temperature=NAN), "temperature"),
    ("token id out of the vocabulary", [5, 99_999], {}, "prompt_token_ids"),
    ("a million beams", [5, 6, 7], dict(beam_width=1_000_000), "beam_width"),
]


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    up = UpProcess(["--num-blocks", "256", "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
                    "--max-prompt-bytes", str(MAX_PROMPT_BYTES)], tmp_path_factory.mktemp("poison") / "up.log")
    yield up
    up.stop()


def request_of(prompt: object, fields: dict, sampling: dict) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling=options_from_kwargs(**sampling), **fields)
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, list):
        request.token_ids.ids.extend(prompt)
    return request


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    return info.value


def assert_names(error: grpc.RpcError, field: str, what: str) -> None:
    assert error.code() == INVALID, f"{what}: {error.code()} {error.details()}"
    assert (error.details() or "").startswith(f"{field}:"), \
        f"{what}: the message does not name {field}: {error.details()[:300]}"
    assert len(error.details()) < 1024, f"{what}: a {len(error.details())}-character status message"


def test_hostile_requests_fail_alone_naming_the_field(pd):
    decode = next(w for w in pd.list_workers() if w.role == pb.ROLE_DECODE)
    with Client(pd.address, timeout=120) as client:
        solo = Stream(client, LONG_PROMPT, **LONG)
        solo.join(180)
        assert solo.error is None and len(solo.tokens) == LONG["max_tokens"], solo.error

        long = Stream(client, LONG_PROMPT, **LONG)
        wait_for(lambda: len(long.tokens) >= 3 or long.error, 120, "the long request to stream")
        stub = pb_grpc.GenerationStub(client._channel)
        outcomes = {}
        for what, prompt, fields, sampling, field in HOSTILE:
            error = refusal(stub.Generate(request_of(prompt, fields, sampling), timeout=60))
            outcomes[what] = (error.code(), field, error.details())
            assert_names(error, field, what)
        raw = client._channel.unary_stream("/pdserve.v1.Generation/Generate")  # bytes as they come
        for what, garbage in (("garbage bytes", b"\xff\xff\xff"), ("a truncated field", b"\x1a\xff\xff\xff\xff\x0f"),
                              ("invalid UTF-8 text", b"\x1a\x03\xff\xfe\xfd")):
            error = refusal(raw(garbage, timeout=60))
            outcomes[what] = (error.code(), "request", error.details())
            assert_names(error, "request", what)
        with pd.auth.channel(decode.address) as channel:
            worker = pb_grpc.WorkerStub(channel)
            for what, ids, sampling, field in HOSTILE_TO_WORKER:
                call = worker.Decode(pb.DecodeRequest(request_id=f"hostile-{len(outcomes)}", local_prefill=True,
                                                      token_ids=ids, sampling=options_from_kwargs(**sampling)),
                                     timeout=60)
                error = refusal(call)
                outcomes[f"worker: {what}"] = (error.code(), field, error.details())
                assert_names(error, field, f"worker: {what}")
            error = refusal(worker.Decode(pb.DecodeRequest(request_id="r" * 10_000, local_prefill=True,
                                                           token_ids=[5, 6]), timeout=60))
            outcomes["worker: 10 kB request id"] = (error.code(), "request_id", error.details())
            assert_names(error, "request_id", "worker: 10 kB request id")
            for timeout in (NAN, INF, -1.0):  # a reservation that would never expire, or be born expired
                with pytest.raises(grpc.RpcError) as info:
                    worker.Reserve(pb.ReserveRequest(request_id=f"reserve-{timeout}", token_ids=[5, 6, 7],
                                                     timeout_seconds=timeout), timeout=60)
                outcomes[f"worker: Reserve timeout {timeout}"] = (info.value.code(), "timeout_seconds",
                                                                  info.value.details())
                assert_names(info.value, "timeout_seconds", f"worker: Reserve timeout {timeout}")
        during = len(long.tokens)  # tokens streamed by the time the last refusal came back
        long.join(180)
    print(f"poison pill: {len(outcomes)} hostile requests refused while the long request streamed "
          f"(token {during} of {len(long.tokens)} when the last refusal came back)")
    for what, (code, field, details) in outcomes.items():
        print(f"  {what}: {code.name} {field} {details[:100]}")
    assert long.error is None, long.error
    assert long.tokens == solo.tokens
    assert len(outcomes) >= 25
    wait_for(lambda: all(pd.all_blocks_free(w.address) for w in pd.list_workers()), 30, "every block to be free")


def test_a_message_past_the_grpc_limit_is_refused_by_grpc(pd):
    """Above gRPC's 4 MiB message limit the server refuses before any of our code
    runs: RESOURCE_EXHAUSTED (a client error), not a field name we could add."""
    with Client(pd.address, timeout=60) as client:
        error = refusal(pb_grpc.GenerationStub(client._channel).Generate(request_of("z" * (5 << 20), {}, {}),
                                                                           timeout=60))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "larger than max" in error.details()
