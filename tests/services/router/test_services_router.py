"""Router pieces without processes: validation, response building, routing policy,
flags, the front end and its records (with no worker); and the client's option mapping."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common import flags
from pdserve.services.common.convert import SAMPLING_FIELDS, options_of, params_from_options
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router import policy
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.client import options_from_kwargs
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import Attempt, Path
from pdserve.services.router.events import update_of
from pdserve.services.router.pb_records import logprob_of, request_of, response_of
from pdserve.services.router.records import Request, SequenceOutput, Timing, TokenLogprob, Usage
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
        out += builder.messages(update_of(message))
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


def test_every_sequence_carries_the_requests_speculative_counts(validator, tokenizer):
    """The decode worker's final message counts the request's drafts (all sequences):
    each sequence's usage carries them to the client; zeros without speculation."""
    builder = ResponseBuilder(job_for(validator, [5] * 4, n=2, temperature=1.0), tokenizer, arrival=0.0)
    final = pb.DecodeResponse(finished=True, num_draft_tokens=9, num_accepted_tokens=4)
    final.results.add(index=0, token_ids=[300], finish_reason="length")
    final.results.add(index=1, token_ids=[301], finish_reason="length")
    outputs = builder.messages(update_of(final))
    assert [(o.usage.num_draft_tokens, o.usage.num_accepted_tokens) for o in outputs] == [(9, 4), (9, 4)]
    usage = response_of(outputs[1], "r").usage
    assert (usage.num_draft_tokens, usage.num_accepted_tokens) == (9, 4)
    plain = stream(ResponseBuilder(job_for(validator, [5] * 4), tokenizer, arrival=0.0), [300])[-1]
    assert (plain.usage.num_draft_tokens, plain.usage.num_accepted_tokens) == (0, 0)


def test_beams_arrive_whole_in_the_results(validator, tokenizer):
    builder = ResponseBuilder(job_for(validator, [5] * 4, beam_width=2, n=2), tokenizer, arrival=0.0)
    final = pb.DecodeResponse(finished=True)
    final.results.add(index=0, token_ids=[300, 301], finish_reason="length")
    final.results.add(index=1, token_ids=[302], finish_reason="stop")
    a, b = builder.messages(update_of(final))
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

    from pdserve.services.router.client import Client, RetryPolicy
    from pdserve.services.router.main import Router

    router = Router(RouterConfig(port=0))
    address = router.start()
    try:  # the router's own answer: a client that does not retry it (one attempt)
        with Client(address, timeout=10, retry=RetryPolicy(max_attempts=1)) as client:
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


# -- the front end and its records ---------------------------------------------------------------


def test_every_status_maps_to_the_grpc_code_of_its_name():
    import grpc

    from pdserve.services.common.errors import GRPC_CODES, status_of_rpc

    assert set(GRPC_CODES) == set(Status)
    assert all(code.name == status.name for status, code in GRPC_CODES.items())
    assert all(status_of_rpc(code) is status for status, code in GRPC_CODES.items())
    assert status_of_rpc(grpc.StatusCode.OK) is Status.UNKNOWN


def test_sampling_params_carry_every_proto_field_both_ways():
    assert set(SAMPLING_FIELDS) == set(pb.SamplingOptions.DESCRIPTOR.fields_by_name)
    assert set(SAMPLING_FIELDS) <= {f.name for f in dataclasses.fields(SamplingParams)}
    options = options_from_kwargs(max_tokens=5, stop=["\n", "x"], early_stopping="never", seed=3, stop_token_ids=[1, 2],
                                  temperature=0.0)
    sampling = params_from_options(options)
    assert sampling == SamplingParams(max_tokens=5, stop=("\n", "x"), early_stopping="never", seed=3,
                                      stop_token_ids=(1, 2), temperature=0.0)
    assert params_from_options(options_of(sampling)) == sampling  # what every worker reads back
    sent = {f.name for f, _ in options_of(SamplingParams()).ListFields()}
    assert sent == set(SAMPLING_FIELDS) - {"seed", "logprobs", "prompt_logprobs", "stop", "stop_token_ids",
                                           "structured_outputs", "logit_bias"}  # None, empty
    for early in (True, False, "never"):
        beams = SamplingParams(beam_width=2, early_stopping=early, length_penalty=0.5)
        assert params_from_options(options_of(beams)) == beams
    with pytest.raises(ValueError, match="^max_tokens:"):
        options_of(SamplingParams(max_tokens=2**40))  # int32 on the wire
    with pytest.raises(ValueError, match="^seed:"):
        options_of(SamplingParams(seed=2**63))  # a uint64 seed: int64 on the wire
    with pytest.raises(ValueError, match="^temperature:"):
        SamplingParams(temperature="hot")  # type: ignore[arg-type]


def test_requests_and_outputs_cross_the_grpc_adapter_unchanged():
    r = request([5, 6], model="tiny", max_tokens=3)
    r.request_id, r.cache_salt = "mine", "salt"
    assert request_of(r, "Bearer k") == Request(token_ids=(5, 6), sampling=SamplingParams(max_tokens=3), model="tiny",
                                                request_id="mine", cache_salt="salt", authorization="Bearer k")
    assert (request_of(request("")).text, request_of(request("")).token_ids) == ("", None)  # set, but empty
    assert (request_of(pb.GenerateRequest()).text, request_of(pb.GenerateRequest()).token_ids) == (None, None)
    output = SequenceOutput(
        0, "ab", (1, 2), (TokenLogprob(1, -0.5, ((1, -0.5), (3, -1.0))), TokenLogprob(2, -0.1)), "length",
        Usage(2, 2, 0), Timing(0.1, 0.2, 0.3), -0.6, (TokenLogprob(5, None), TokenLogprob(6, -2.0, ((6, -2.0),))),
    )
    message = response_of(output, "mine")
    assert (message.request_id, message.index, message.text, list(message.token_ids)) == ("mine", 0, "ab", [1, 2])
    assert tuple(logprob_of(e) for e in message.logprobs) == output.logprobs
    assert tuple(logprob_of(e) for e in message.prompt_logprobs) == output.prompt_logprobs
    assert not message.prompt_logprobs[0].HasField("logprob")
    assert message.usage == pb.Usage(prompt_tokens=2, completion_tokens=2, cached_tokens=0)
    assert message.timing == pb.Timing(ttft_seconds=0.1, tpot_seconds=0.2, e2e_seconds=0.3)
    assert (message.finish_reason, message.cumulative_logprob) == ("length", -0.6)
    running = response_of(SequenceOutput(1, token_ids=(4,)), "mine")
    assert running.finish_reason == "" and not running.HasField("usage") and not running.HasField("cumulative_logprob")


def test_a_request_with_two_prompts_is_refused(validator):
    with pytest.raises(ValueError, match="^prompt: set text or token_ids, not both"):
        validator.validate(Request(text="a", token_ids=(1,)))


def test_every_try_of_a_request_has_a_worker_request_id_of_its_own():
    """Within a decode attempt: remote prefill tries (each with its own reservation),
    then D prefilling after all or after lost KV; across attempts, the number."""
    tries = [Attempt("job", n, path, k).worker_request_id
             for n in range(3) for path in (Path.REMOTE, Path.FALLBACK, Path.KV_LOST) for k in range(3)]
    assert len(set(tries)) == len(tries) == 27 and all(t.startswith("job-") for t in tries)
    local = [Attempt("job", n).worker_request_id for n in range(3)]  # prefilled on D from the start: never reserved
    assert local == ["job-0", "job-1", "job-2"] == [Attempt("job", n, Path.REMOTE).worker_request_id for n in range(3)]


def test_a_cancellation_runs_each_callback_once_and_late_ones_at_once():
    calls: list[str] = []
    token = Cancellation()
    token.add_callback(lambda: calls.append("call"))
    token.cancel()
    token.cancel()
    assert calls == ["call"] and token.cancelled
    token.add_callback(lambda: calls.append("late"))
    assert calls == ["call", "late"]
    over = Cancellation()
    over.add_callback(lambda: calls.append("left running"))
    over.close()
    assert calls[-1] == "left running" and not over.cancelled
    over.add_callback(lambda: calls.append("after"))
    assert calls[-1] == "after"


@pytest.fixture
def router_without_workers():
    """A router never started: nothing registers, so every request finds no worker."""
    from pdserve.services.router.main import Router

    router = Router(RouterConfig(port=0, admission_timeout=0.0, max_concurrent_requests=1, max_queued_requests=0))
    yield router
    router.stop()


def failures(router, code: str) -> float:
    labels = {"model_name": "pdserve-tiny-code", "role": "router", "worker": "router", "code": code}
    return router.metrics.registry.get_sample_value("pdserve:request_failure_total", labels) or 0.0


def in_flight(router) -> float:
    labels = {"model_name": "pdserve-tiny-code", "role": "router", "worker": "router"}
    return router.metrics.registry.get_sample_value("pdserve:num_requests_inflight", labels)


def test_the_front_end_refuses_naming_the_field_and_counts_the_status(router_without_workers):
    router = router_without_workers
    with pytest.raises(ServeError) as info:
        router.front_end.generate(Request(token_ids=(1, 10**6)))
    assert info.value.status is Status.INVALID_ARGUMENT and info.value.message.startswith("token_ids:")
    assert failures(router, "INVALID_ARGUMENT") == 1 and in_flight(router) == 0
    stream = router.front_end.generate(Request(text="def f():", sampling=SamplingParams(max_tokens=2)))
    with pytest.raises(ServeError) as info:
        list(stream)
    assert info.value.status is Status.UNAVAILABLE and "no decode worker" in info.value.message
    assert stream.status is Status.UNAVAILABLE and failures(router, "UNAVAILABLE") == 1 and in_flight(router) == 0


class _Aborted(Exception):
    pass


class _CallContext:
    """What the gRPC adapter asks of a call: its metadata, deadline, end callback, abort."""

    def __init__(self) -> None:
        self.code = None
        self.details = ""

    def invocation_metadata(self):
        return ()

    def time_remaining(self):
        return None

    def add_callback(self, callback) -> bool:
        return True

    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


def test_the_grpc_adapter_refuses_a_sampling_value_naming_the_field_and_counts_it(router_without_workers):
    import grpc

    from pdserve.services.router.service import GenerationServicer

    router = router_without_workers
    servicer = GenerationServicer(router.front_end, 5.0, router.metrics)
    context = _CallContext()
    with pytest.raises(_Aborted):
        list(servicer._generate(request([5, 6], temperature=-1.0), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("temperature: must be >= 0")
    assert failures(router, "INVALID_ARGUMENT") == 1 and in_flight(router) == 0
    context = _CallContext()
    with pytest.raises(_Aborted):
        list(servicer._generate(request([5, 10**6], max_tokens=2), context))  # the validator's refusal
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and context.details.startswith("token_ids: ")
    assert failures(router, "INVALID_ARGUMENT") == 2 and in_flight(router) == 0


def test_the_front_end_admits_with_a_retry_hint_and_frees_the_slot_on_close(router_without_workers):
    front_end = router_without_workers.front_end
    holder = front_end.generate(Request(text="a"))  # the one slot, never read
    with pytest.raises(ServeError) as info:
        front_end.generate(Request(text="b"))
    refused = info.value
    assert refused.status is Status.RESOURCE_EXHAUSTED and "--max-queued-requests" in refused.message
    assert refused.retry_after_s == front_end.admission.retry_after() > 0
    holder.close()  # closed unread: the caller left
    assert holder.status is Status.CANCELLED and failures(router_without_workers, "CANCELLED") == 1
    with front_end.generate(Request(text="c")) as again:
        assert again.request_id
    assert again.status is Status.CANCELLED


def test_a_cancelled_stream_ends_quietly_with_the_callers_status(router_without_workers):
    front_end = router_without_workers.front_end
    stream = front_end.generate(Request(text="a"))
    stream.cancel()
    assert list(stream) == [] and stream.status is Status.CANCELLED
    expired = front_end.generate(Request(text="a", deadline=Deadline.after(0.0)))
    expired.cancel()
    assert list(expired) == [] and expired.status is Status.DEADLINE_EXCEEDED
    assert failures(router_without_workers, "DEADLINE_EXCEEDED") == 1


def test_a_draining_front_end_admits_nothing(router_without_workers):
    front_end = router_without_workers.front_end
    assert front_end.drain(0.0)  # nothing in flight
    with pytest.raises(ServeError) as info:
        front_end.generate(Request(text="a"))
    assert info.value.status is Status.UNAVAILABLE and "draining" in info.value.message
