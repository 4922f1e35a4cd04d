"""Router pieces without processes: validation, response building, routing policy,
flags; and the client's option mapping."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common import flags
from pdserve.services.common.convert import params_from_options
from pdserve.services.router import policy
from pdserve.services.router.client import options_from_kwargs
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.pb_records import request_of
from pdserve.services.router.records import SequenceOutput, Usage
from pdserve.services.router.responses import ResponseBuilder
from pdserve.services.router.validate import Limits, Validator

LIMITS = Limits("tiny", vocab_size=4096, max_model_len=128, max_n=4, block_size=16)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def validator(tokenizer):
    return Validator(LIMITS, tokenizer)


def request(prompt: str | list[int] = "def f():", model: str = "", **sampling) -> pb.GenerateRequest:
    r = pb.GenerateRequest(model=model, sampling=options_from_kwargs(**sampling))
    if isinstance(prompt, str):
        r.text = prompt
    else:
        r.token_ids.ids.extend(prompt)
    return r


def validate(validator: Validator, r: pb.GenerateRequest):
    """What the gRPC adapter hands the validator."""
    return validator.validate(request_of(r))


# -- validation --------------------------------------------------------------------------------


def test_a_valid_request_becomes_a_job(validator, tokenizer):
    job = validate(validator, request([7] * 40, temperature=0.5, n=2))
    assert job.prompt == (7,) * 40 and job.params == SamplingParams(temperature=0.5, n=2)
    assert list(job.block_hashes) == hash_blocks([7] * 40, 16) and len(job.block_hashes) == 2
    assert job.request_id == job.worker_request_id
    text_job = validate(validator, request("def f():"))
    assert list(text_job.prompt) == tokenizer.encode("def f():")
    assert validate(validator, pb.GenerateRequest(request_id="mine", text="a")).request_id == "mine"
    assert text_job.params == SamplingParams()  # unset fields: the engine's defaults


@pytest.mark.parametrize("req, field", [
    (request(""), "prompt"),
    (pb.GenerateRequest(), "prompt"),
    (request([]), "prompt"),
    (request([1] * 128), "prompt"),
    (request([1] * 120, max_tokens=9), "max_tokens"),
    (request(max_tokens=-3), "max_tokens"),
    (request(temperature=-1.0), "temperature"),
    (request(top_p=0.0), "top_p"),
    (request(top_k=-2), "top_k"),
    (request(n=5), "n"),
    (request(beam_width=5), "beam_width"),
    (request(beam_width=2, n=3), "n"),
    (request(model="other"), "model"),
    (request([1, -5]), "token_ids"),
    (request([1, 4096]), "token_ids"),
    (request(stop_token_ids=[5000]), "stop_token_ids"),
    (request(early_stopping="perhaps"), "early_stopping"),
    (request(presence_penalty=3.0), "presence_penalty"),
])
def test_bad_requests_name_the_field(validator, req, field):
    with pytest.raises(ValueError) as info:
        validate(validator, req)
    assert str(info.value).startswith(f"{field}:")


def test_sampling_options_round_trip():
    options = options_from_kwargs(max_tokens=5, stop="\n", early_stopping=True, seed=3, stop_token_ids=[1, 2])
    params = params_from_options(options)
    assert params == SamplingParams(max_tokens=5, stop=("\n",), early_stopping=True, seed=3, stop_token_ids=(1, 2))
    assert params_from_options(options_from_kwargs(early_stopping="never")).early_stopping == "never"
    with pytest.raises(ValueError, match="colour"):
        options_from_kwargs(colour=3)


# -- response building ------------------------------------------------------------------------


def job_for(validator, prompt, **sampling):
    return validate(validator, request(prompt, **sampling))


def stream(builder: ResponseBuilder, token_ids: list[int], finish: str = "length") -> list[SequenceOutput]:
    """Feed tokens one message at a time, the last with the finished result."""
    out = []
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        message = pb.DecodeResponse(deltas=[pb.SequenceDelta(index=0, token_ids=[t], finish_reason=finish if last else "")])
        if last:
            message.finished = True
            message.results.add(index=0, finish_reason=finish, cumulative_logprob=-1.5)
        out += builder.messages(message)
    return out


def test_multibyte_characters_are_never_split(validator, tokenizer):
    prompt = tokenizer.encode("s = '")
    chars = tokenizer.encode("你好 café")[1:]  # drop BOS
    builder = ResponseBuilder(job_for(validator, prompt), tokenizer, arrival=0.0)
    messages = stream(builder, chars)
    assert all("\ufffd" not in m.text for m in messages)
    assert "".join(m.text for m in messages) == "你好 café"
    assert [t for m in messages for t in m.token_ids] == chars
    assert any(m.token_ids and not m.text for m in messages)  # held back until complete


def tokens_until(tokenizer, prompt: list[int], tokens: list[int], stop: str) -> int:
    """How many tokens the engine generates before it sees `stop` (and stops)."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    for i, t in enumerate(tokens):
        detok.append(t)
        if stop in detok.text:
            return i + 1
    raise AssertionError(f"{stop!r} never appears")


def test_stop_strings_are_held_back_and_cut(validator, tokenizer):
    prompt = tokenizer.encode("x = ")
    tokens = tokenizer.encode("1\n\nfoo bar")[1:]
    builder = ResponseBuilder(job_for(validator, prompt, stop=["\n\n"]), tokenizer, arrival=0.0)
    messages = stream(builder, tokens[: tokens_until(tokenizer, prompt, tokens, "\n\n")], finish="stop")
    assert "".join(m.text for m in messages) == "1"
    assert all("\n\n" not in m.text for m in messages)


def test_the_last_message_carries_usage_and_timing(validator, tokenizer):
    builder = ResponseBuilder(job_for(validator, [5] * 20), tokenizer, arrival=0.0)
    builder.note_cached_tokens(16)
    messages = stream(builder, [300, 301, 302])
    last = messages[-1]
    assert last.finish_reason == "length" and all(not m.finish_reason for m in messages[:-1])
    assert last.usage == Usage(prompt_tokens=20, completion_tokens=3, cached_tokens=16)
    assert 0 < last.timing.ttft_seconds <= last.timing.e2e_seconds and last.cumulative_logprob == -1.5


def test_beams_arrive_whole_in_the_results(validator, tokenizer):
    builder = ResponseBuilder(job_for(validator, [5] * 4, beam_width=2, n=2), tokenizer, arrival=0.0)
    final = pb.DecodeResponse(finished=True)
    final.results.add(index=0, token_ids=[300, 301], finish_reason="length")
    final.results.add(index=1, token_ids=[302], finish_reason="stop")
    a, b = builder.messages(final)
    assert (a.index, list(a.token_ids), b.index, list(b.token_ids)) == (0, [300, 301], 1, [302])
    assert a.usage.completion_tokens == 2 and b.finish_reason == "stop"


# -- routing policy ---------------------------------------------------------------------------


def load(wid, inflight=0, waiting=0, free=100, cached=()):
    return policy.Load(wid, inflight, 0, waiting, free, frozenset(cached))


def test_decode_choice_balances_requests_then_prefers_cached_prefixes():
    hashes = hash_blocks(list(range(64)), 16)
    assert policy.pick_decode([load("a", 2), load("b", 1)], hashes, 16).worker_id == "b"
    assert policy.pick_decode([load("a"), load("b", cached=hashes[:2])], hashes, 16).worker_id == "b"
    assert policy.pick_decode([load("a", free=5), load("b", free=50)], hashes, 16).worker_id == "b"
    assert policy.pick_decode([], hashes, 16) is None


def test_prefill_choice_weighs_cached_prefix_against_queue():
    hashes = hash_blocks(list(range(64)), 16)
    warm, cold = load("warm", cached=hashes[:3]), load("cold")
    assert policy.pick_prefill([warm, cold], hashes, 16, queue_weight=16).worker_id == "warm"
    busy_warm = load("warm", inflight=4, cached=hashes[:3])
    assert policy.pick_prefill([busy_warm, cold], hashes, 16, queue_weight=16).worker_id == "cold"


def test_cached_prefix_stops_at_the_first_miss_and_threshold():
    hashes = hash_blocks(list(range(64)), 16)
    assert policy.cached_prefix_tokens(hashes, {hashes[0], hashes[2]}, 16) == 16
    assert policy.prefill_locally(prompt_len=70, decode_cached_tokens=64, threshold=10)
    assert not policy.prefill_locally(prompt_len=70, decode_cached_tokens=16, threshold=10)


# -- flags ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Demo:
    port: int = flags.flag(1, "a port")
    name: str | None = flags.flag(None, "a name")
    fast: bool = flags.flag(False, "go fast")
    ratio: float = flags.flag(0.5, "a ratio")
    hidden: str = flags.flag("x", "not a flag", cli=False)


def test_flags_round_trip_with_env_defaults(monkeypatch):
    monkeypatch.setenv("PDSERVE_RATIO", "0.25")
    parser = argparse.ArgumentParser()
    assert flags.add_flags(parser, Demo) == {"port", "name", "fast", "ratio"}
    config = flags.from_namespace(Demo, parser.parse_args(["--port", "7", "--fast"]), hidden="y")
    assert config == Demo(port=7, name=None, fast=True, ratio=0.25, hidden="y")
    argv = flags.to_argv(config)
    assert argv == ["--port", "7", "--fast", "--ratio", "0.25"]
    assert flags.from_namespace(Demo, parser.parse_args(argv), hidden="y") == config
    monkeypatch.setenv("PDSERVE_FAST", "maybe")
    with pytest.raises(ValueError, match="PDSERVE_FAST"):
        flags.add_flags(argparse.ArgumentParser(), Demo)


def test_the_credentials_block_is_flags_of_every_service(monkeypatch, tmp_path):
    from pdserve.services.common.credentials import ClusterCredentials
    from pdserve.services.worker.config import WorkerConfig

    token = tmp_path / "token"
    token.write_text("t" * 32)
    monkeypatch.setenv("PDSERVE_CLUSTER_SERVER_NAME", "pdserve.cluster")
    parser = argparse.ArgumentParser()
    names = flags.add_flags(parser, RouterConfig)
    assert {"cluster_token_file", "cluster_ca", "kv_curve_cert", "internal_port", "api_keys_file"} <= names
    config = flags.from_namespace(RouterConfig, parser.parse_args(["--cluster-token-file", str(token)]))
    assert config.credentials == ClusterCredentials(cluster_token_file=str(token), cluster_server_name="pdserve.cluster")
    argv = flags.to_argv(config)
    assert argv[argv.index("--cluster-token-file") + 1] == str(token)
    assert flags.from_namespace(RouterConfig, parser.parse_args(argv)) == config
    worker_parser = argparse.ArgumentParser()
    flags.add_flags(worker_parser, WorkerConfig)  # a worker takes the same block
    worker = flags.from_namespace(WorkerConfig, worker_parser.parse_args(flags.to_argv(config.credentials)))
    assert worker.credentials == config.credentials
    with pytest.raises(ValueError, match="^cluster_ca:"):
        ClusterCredentials(cluster_ca=str(token))  # without its certificate and key
    with pytest.raises(ValueError, match="^cluster_token_file:"):
        ClusterCredentials(cluster_token_file=str(tmp_path / "missing"))


def test_api_keys_reload_and_keep_the_old_ones_when_the_file_is_bad(tmp_path):
    from pdserve.services.router.api_keys import ApiKeys, key_id

    path = tmp_path / "keys"
    first, second = "first-key-" + "1" * 16, "second-key-" + "2" * 16
    path.write_text(f"# comment\n\n  {first}  \n")
    keys = ApiKeys(str(path))
    assert keys.identify({"authorization": f"Bearer {first}"}) == key_id(first)
    assert keys.identify({"authorization": f"bearer {first}"}) == key_id(first)
    assert keys.identify({"authorization": first}) is None and keys.identify({}) is None
    path.write_text(second)
    assert keys.reload()
    assert keys.identify({"authorization": f"Bearer {first}"}) is None
    assert keys.identify({"authorization": f"Bearer {second}"}) == key_id(second) != key_id(first)
    path.write_text("short\n")  # not a key: the keys in force stay
    assert not keys.reload()
    path.unlink()
    assert not keys.reload()
    assert keys.identify({"authorization": f"Bearer {second}"}) == key_id(second)


def test_router_config_checks_name_the_field():
    with pytest.raises(ValueError, match="^worker_timeout:"):
        RouterConfig(heartbeat_interval=2.0, worker_timeout=1.0)
    with pytest.raises(ValueError, match="^model:"):
        RouterConfig(model="/nonexistent")


# -- a router with no worker ---------------------------------------------------------------------


def test_a_router_without_workers_answers_unavailable_and_lists_its_model():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve.services.router.client import Client
    from pdserve.services.router.main import Router

    router = Router(RouterConfig(port=0))
    address = router.start()
    try:
        with Client(address, timeout=10) as client:
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate("def f():", max_tokens=2))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no decode worker" in info.value.details()
            assert [m.name for m in client.list_models()] == ["pdserve-tiny-code"]
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        router.stop()
