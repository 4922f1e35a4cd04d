"""Structured outputs on the router, over fake workers (fake_workers.py), no process:

    before dispatch (structured.py, validate.py)   a malformed JSON schema (its metaschema:
        Draft 2020-12, or the draft its $schema names), one too large or too deep for
        --structured-outputs-max-bytes / -max-depth, a logit_bias token outside the
        vocabulary: INVALID_ARGUMENT naming the field, and no worker is asked anything
    a worker's refusal (dispatch.py)               INVALID_CONSTRAINT -> INVALID_ARGUMENT,
        CONSTRAINT_TIMEOUT -> DEADLINE_EXCEEDED: the request's own final failure, from a
        decode or a prefill worker, before or after tokens: never retried, migrated or
        prefilled elsewhere
    the HTTP API (in process, over ASGI)           400 / 504 with OpenAI's error body naming
        the caller's field; in a stream, before the first token the request's status,
        after it one error event, then [DONE]
    metrics                                        requests by kind, refusals by reason
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from fake_workers import PREFILL, FakeRegistry, FakeWorker, final, message, refusal, tokens
from pdserve.engine.errors import FailureKind
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs
from pdserve.services.common.deadline import Deadline
from pdserve.services.common.errors import GRPC_CODES
from pdserve.services.common.metrics import RouterMetrics
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import Dispatcher
from pdserve.services.router.frontend import FrontEnd
from pdserve.services.router.http.app import HttpApi
from pdserve.services.router.records import Request
from pdserve.services.router.structured import ConstraintLimits, ConstraintRefused, check_constraint
from pdserve.services.router.validate import Limits, Validator

BLOCK = 16
PROMPT = tuple(range(100, 120))
VOCAB = 4096
LIMITS = Limits("tiny", vocab_size=VOCAB, max_model_len=256, max_n=4, block_size=BLOCK,
                constraints=ConstraintLimits(max_bytes=4096, max_depth=16))
CONFIG = RouterConfig(port=0, local_prefill_threshold=4, admission_timeout=0.0)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
DRAFT_04 = "http://json-schema.org/draft-04/schema#"
DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def schema(value: object) -> StructuredOutputs:
    return StructuredOutputs.json_schema(value)


def refusal_of(constraint: StructuredOutputs, limits: ConstraintLimits = LIMITS.constraints) -> ConstraintRefused:
    with pytest.raises(ConstraintRefused) as info:
        check_constraint(constraint, limits)
    return info.value


# -- the router's checks -----------------------------------------------------------------


@pytest.mark.parametrize("value", [
    SCHEMA, True, False, {},
    {"type": "string", "pattern": r"^\p{L}+$"},  # ECMA-262, not Python's re: left to the backend
    {"type": "string", "format": "not-a-known-format"},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
     "$ref": "#/$defs/node"},
    {"$schema": DRAFT_07, "definitions": {"a": {"type": "integer"}}, "exclusiveMinimum": 5},
    {"$schema": DRAFT_04, "exclusiveMinimum": True, "minimum": 5},
    {"$schema": "https://example.com/unknown-draft", "type": "object"},  # read as Draft 2020-12
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"anyOf": [{"type": "string"}, {"type": "null"}], "x-vendor-keyword": [1, 2]},
])
def test_valid_schemas_pass(value):
    check_constraint(schema(value), LIMITS.constraints)


@pytest.mark.parametrize("value, where", [
    ({"type": "strin"}, "type"),
    ({"type": 5}, "type"),
    ({"properties": []}, "properties"),
    ({"required": "a"}, "required"),
    ({"minLength": -1}, "minLength"),
    ({"properties": {"a": {"type": "object", "properties": {"b": {"type": "nope"}}}}}, "properties/a/properties/b"),
    ({"$schema": DRAFT_04, "exclusiveMinimum": 5}, "exclusiveMinimum"),  # a boolean in Draft 4
    ({"$schema": 5}, "$schema"),
    ({"enum": "a"}, "enum"),
])
def test_a_malformed_schema_is_refused_naming_the_field_and_where(value, where):
    error = refusal_of(schema(value))
    assert error.reason == "invalid_schema"
    assert str(error).startswith("structured_outputs.json_schema: "), str(error)
    assert where in str(error), str(error)


def test_the_draft_named_by_schema_is_the_metaschema():
    value = {"exclusiveMinimum": True, "minimum": 5}
    refusal_of(schema(value))  # Draft 2020-12: exclusiveMinimum is a number
    check_constraint(schema({"$schema": DRAFT_04, **value}), LIMITS.constraints)


def test_size_and_depth_limits_mirror_the_workers_flags():
    limits = ConstraintLimits(max_bytes=64, max_depth=3)
    big = refusal_of(StructuredOutputs(ConstraintKind.REGEX, "a" * 65), limits)
    assert big.reason == "too_large" and "--structured-outputs-max-bytes" in str(big)
    assert str(big).startswith("structured_outputs.regex: 65 bytes")
    choices = refusal_of(StructuredOutputs(ConstraintKind.CHOICE, choices=("x" * 40, "y" * 40)), limits)
    assert choices.reason == "too_large" and str(choices).startswith("structured_outputs.choice:")
    check_constraint(StructuredOutputs(ConstraintKind.REGEX, "a" * 64), limits)
    limits = ConstraintLimits(max_bytes=4096, max_depth=3)
    deep = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}  # 5 deep
    error = refusal_of(schema(deep), limits)
    assert error.reason == "too_deep" and "--structured-outputs-max-depth" in str(error)
    check_constraint(schema({"type": "object", "properties": {"a": {}}}), limits)  # 3 deep
    check_constraint(StructuredOutputs(ConstraintKind.REGEX, "((((((a))))))"), limits)  # depth: JSON schemas only
    check_constraint(StructuredOutputs(ConstraintKind.GRAMMAR, 'root ::= "[[[[[["'), limits)
    with pytest.raises(ValueError, match="structured_outputs_max_depth"):
        ConstraintLimits(max_depth=0)


def test_regexes_and_grammars_are_left_to_the_workers_backend():
    """Python's re is not the backends' dialect: the router refuses no regex by syntax."""
    for pattern in (r"\p{Lu}[a-z]+", "(?<name>a)", "[[:alpha:]]+", "a{,3}", "(unclosed"):
        check_constraint(StructuredOutputs(ConstraintKind.REGEX, pattern), LIMITS.constraints)


def test_the_validator_refuses_what_the_workers_would_naming_the_field():
    validator = Validator(LIMITS, None)

    def refused(**sampling) -> str:
        with pytest.raises(ValueError) as info:
            validator.validate(Request(token_ids=PROMPT, sampling=SamplingParams(**sampling)))
        return str(info.value)

    assert refused(structured_outputs=schema({"type": "strin"})).startswith("structured_outputs.json_schema:")
    assert refused(structured_outputs=StructuredOutputs(ConstraintKind.REGEX, "a" * 5000)).startswith(
        "structured_outputs.regex:")
    assert refused(logit_bias={VOCAB: 1.0}).startswith("logit_bias: token ids must be < vocab_size 4096")
    job = validator.validate(Request(token_ids=PROMPT, sampling=SamplingParams(
        structured_outputs=schema(SCHEMA), logit_bias={VOCAB - 1: -100})))
    assert job.options.structured_outputs.json_schema == json.dumps(SCHEMA, separators=(",", ":"))
    assert dict(job.options.logit_bias) == {VOCAB - 1: -100.0}


def test_the_router_limits_default_to_the_workers():
    """`pdserve up` parses one flag for both; a router and workers started apart agree
    only if their defaults do (needs the workers' flags: the engine's branch)."""
    import dataclasses

    from pdserve.services.worker.config import WorkerConfig

    worker = {f.name: f.default for f in dataclasses.fields(WorkerConfig)}
    router = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    for name in ("structured_outputs_max_bytes", "structured_outputs_max_depth"):
        assert router[name] == worker[name], name


def test_the_router_flags_are_checked():
    assert RouterConfig(port=0, structured_outputs_max_bytes=10, structured_outputs_max_depth=2)
    for bad in (dict(structured_outputs_max_bytes=0), dict(structured_outputs_max_depth=0),
                dict(structured_outputs_max_bytes=(1 << 20) + 1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterConfig(port=0, **bad)


# -- the front end: refused before any worker; counted -----------------------------------------


def front_end(*decode: FakeWorker, prefill: tuple[FakeWorker, ...] = ()) -> FrontEnd:
    metrics = RouterMetrics("tiny")
    dispatcher = Dispatcher(FakeRegistry(decode, prefill), CONFIG, metrics)
    config = RouterConfig(port=0, admission_timeout=0.0)
    return FrontEnd(config, LIMITS, None, dispatcher, metrics)


def counted(front: FrontEnd, name: str, **labels: str) -> float:
    labels = {"model_name": "tiny", "role": "router", "worker": "router", **labels}
    return front.metrics.registry.get_sample_value(f"pdserve:router_structured_outputs_{name}_total", labels) or 0.0


def served(max_tokens: int = 2) -> list:
    ids = list(range(5, 5 + max_tokens))
    return [final((0, "length", -1.0), deltas=[tokens(0, ids, [-0.5] * max_tokens)])]


def test_a_malformed_schema_costs_no_worker_time():
    worker = FakeWorker("d1", decode=served())
    front = front_end(worker)
    bad = SamplingParams(structured_outputs=schema({"type": "object", "properties": {"a": {"type": "intger"}}}))
    with pytest.raises(ServeError) as info:
        front.generate(Request(token_ids=PROMPT, sampling=bad))
    assert info.value.status is Status.INVALID_ARGUMENT and GRPC_CODES[info.value.status] is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith("structured_outputs.json_schema: not a valid JSON schema")
    assert worker.requests == [] and worker.aborted == []
    assert counted(front, "refusals", reason="invalid_schema") == 1
    assert counted(front, "requests", kind="json_schema") == 0


def test_requests_are_counted_by_kind_and_adapter_refusals_by_reason():
    front = front_end(FakeWorker("d1", decode=served()))
    good = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(ConstraintKind.CHOICE, choices=("a",)))
    with front.generate(Request(token_ids=PROMPT, sampling=good)) as stream:
        list(stream)
    assert counted(front, "requests", kind="choice") == 1
    front.refuse(ConstraintRefused("guided_regex: conflicts with guided_json: ...", "conflict"))
    front.refuse(ValueError("structured_outputs.regex: must not be empty"))  # e.g. a gRPC message's
    front.refuse(ValueError("n: must be >= 1"))
    assert counted(front, "refusals", reason="conflict") == 1
    assert counted(front, "refusals", reason="malformed") == 1


# -- a worker's refusal: the request's own final failure ----------------------------------------


INVALID = refusal(grpc.StatusCode.INVALID_ARGUMENT, "request 'r-0': structured_outputs.regex: bad escape",
                  FailureKind.INVALID_CONSTRAINT)
TIMEOUT = refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "request 'r-0': grammar not compiled within 5s",
                  FailureKind.CONSTRAINT_TIMEOUT)
CONSTRAINED = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(ConstraintKind.REGEX, "[a-z]+"))
WANT = {INVALID: (Status.INVALID_ARGUMENT, "invalid"), TIMEOUT: (Status.DEADLINE_EXCEEDED, "timeout")}


def failed(front: FrontEnd, sampling: SamplingParams = CONSTRAINED) -> ServeError:
    with pytest.raises(ServeError) as info:
        with front.generate(Request(token_ids=PROMPT, sampling=sampling)) as stream:
            list(stream)
    return info.value


@pytest.mark.parametrize("error", [INVALID, TIMEOUT], ids=["invalid", "timeout"])
def test_a_decode_workers_refusal_is_final_no_other_worker_is_tried(error):
    refusing = FakeWorker("d1", decode=[error])
    other = FakeWorker("d2", decode=served())
    front = front_end(refusing, other)
    failure = failed(front)
    status, reason = WANT[error]
    assert failure.status is status and failure.message.startswith("structured_outputs: ")
    assert error.details() in failure.message and "d1" in failure.message
    assert len(refusing.decodes()) == 1 and other.requests == []
    assert counted(front, "refusals", reason=reason) == 1


@pytest.mark.parametrize("error", [INVALID, TIMEOUT], ids=["invalid", "timeout"])
def test_a_prefill_workers_refusal_is_final_no_fallback_to_a_local_prefill(error):
    decode = FakeWorker("d1", decode=served(), kv=True)
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=error)
    spare = FakeWorker("p2", role_code=PREFILL, kv=True, first=(7, -0.5))
    front = front_end(decode, prefill=(prefill, spare))
    failure = failed(front)
    assert failure.status is WANT[error][0] and "p1" in failure.message
    reserve, attach = decode.requests  # reserved, attached; never a local prefill
    assert not any(r.local_prefill for r in decode.decodes())
    assert decode.aborted == [reserve.request_id]  # the reservation is freed
    assert spare.requests == []


class DroppingRegistry(FakeRegistry):
    """Its prefill workers drop as soon as they are watched (after their Prefill answered)."""

    def watch(self, handle, on_drop):
        on_drop()
        return lambda: None


def test_a_refusal_is_final_even_when_the_prefill_worker_dropped_meanwhile():
    """D's reservation was abandoned (its P dropped) and D refuses the constraint: the
    request fails, D is not asked to prefill it after all."""
    decode = FakeWorker("d1", decode=[INVALID], kv=True)
    prefill = FakeWorker("p1", role_code=PREFILL, kv=True, first=(7, -0.5))
    metrics = RouterMetrics("tiny")
    dispatcher = Dispatcher(DroppingRegistry([decode], [prefill]), CONFIG, metrics)
    front = FrontEnd(RouterConfig(port=0, admission_timeout=0.0), LIMITS, None, dispatcher, metrics)
    assert failed(front).status is Status.INVALID_ARGUMENT
    assert not any(r.local_prefill for r in decode.decodes())


@pytest.mark.parametrize("error", [INVALID, TIMEOUT], ids=["invalid", "timeout"])
def test_a_refusal_after_tokens_is_not_migrated(error):
    first = FakeWorker("d1", decode=[message(tokens(0, [5], [-0.5])), error])
    other = FakeWorker("d2", decode=served())
    failure = failed(front_end(first, other))
    assert failure.status is WANT[error][0] and other.requests == []


def test_a_deadline_of_the_request_itself_is_still_a_plain_deadline():
    worker = FakeWorker("d1", decode=[refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")])
    front = front_end(worker)
    failure = failed(front)
    assert failure.status is Status.DEADLINE_EXCEEDED and failure.message.startswith("deadline passed")
    assert counted(front, "refusals", reason="timeout") == 0


# -- the HTTP API, in process -------------------------------------------------------------------


def http(front: FrontEnd, method_path: str, body: dict) -> httpx.Response:
    async def call() -> httpx.Response:
        with ThreadPoolExecutor(4) as pool:
            api = HttpApi(front, None, pool, healthy=lambda: True)
            transport = httpx.ASGITransport(app=api)
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
                return await client.post(method_path, json=body)

    return asyncio.run(call())


def completion(**fields) -> dict:
    return {"prompt": list(PROMPT), "max_tokens": 4, **fields}


def error_body(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_http_a_malformed_schema_is_a_400_naming_the_callers_field_and_no_worker_is_asked():
    worker = FakeWorker("d1", decode=served())
    front = front_end(worker)
    bad = {"type": "object", "properties": {"a": {"type": "intger"}}}
    for fields, field in [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}),
         "response_format.json_schema"),
        (dict(structured_outputs={"json": bad}), "structured_outputs.json"),
        (dict(guided_json=bad), "guided_json"),
    ]:
        for stream in (False, True):
            error = error_body(http(front, "/v1/completions", completion(stream=stream, **fields)), 400)
            assert error["param"] == field and error["message"].startswith(f"{field}: not a valid JSON schema")
            assert error["type"] == "invalid_request_error"
    assert worker.requests == []
    assert counted(front, "refusals", reason="invalid_schema") == 6


@pytest.mark.parametrize("error, status", [(INVALID, 400), (TIMEOUT, 504)], ids=["invalid", "timeout"])
def test_http_a_workers_refusal_is_its_status_with_openais_body(error, status):
    for stream in (False, True):
        worker = FakeWorker("d1", decode=[error])
        front = front_end(worker, FakeWorker("d2", decode=served()))
        reply = http(front, "/v1/completions", completion(stream=stream, guided_regex="[a-z]+"))
        body = error_body(reply, status)  # before the first token: the request's own status, streaming too
        assert body["message"].startswith("guided_regex: ")
        assert body["param"] == ("guided_regex" if status == 400 else None)
        assert body["code"] == ("invalid_value" if status == 400 else "timeout")


def test_http_a_refusal_after_the_first_token_is_one_error_event_then_done():
    worker = FakeWorker("d1", decode=[message(tokens(0, [5], [-0.5])), INVALID])
    front = front_end(worker, FakeWorker("d2", decode=served()))
    reply = http(front, "/v1/completions", completion(stream=True, response_format={"type": "json_object"}))
    assert reply.status_code == 200
    events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"].startswith("response_format: refused by the grammar backend") and error["param"] == \
        "response_format"
    assert all("error" not in json.loads(e) for e in events[:-2])


# -- gRPC: the client's keyword arguments and `pdserve generate`'s flags ----------------------


@pytest.mark.parametrize("value, want", [
    ({"json": SCHEMA}, schema(SCHEMA)),
    ({"json": json.dumps(SCHEMA)}, schema(SCHEMA)),
    ({"regex": "[0-9]+"}, StructuredOutputs(ConstraintKind.REGEX, "[0-9]+")),
    ({"choice": ["a", "b"]}, StructuredOutputs(ConstraintKind.CHOICE, choices=("a", "b"))),
    ({"grammar": 'root ::= "x"'}, StructuredOutputs(ConstraintKind.GRAMMAR, 'root ::= "x"')),
    ({"json_object": True}, StructuredOutputs(ConstraintKind.JSON_OBJECT)),
    (StructuredOutputs(ConstraintKind.REGEX, "a+"), StructuredOutputs(ConstraintKind.REGEX, "a+")),
])
def test_the_client_sends_a_constraint_the_workers_read_back(value, want):
    from pdserve.services.common.convert import params_from_options
    from pdserve.services.router.client import options_from_kwargs

    options = options_from_kwargs(max_tokens=4, structured_outputs=value, logit_bias={"5": -100, 7: 2.5})
    params = params_from_options(options)
    assert params.structured_outputs == want and params.logit_bias == ((5, -100.0), (7, 2.5))
    assert options_from_kwargs(structured_outputs=options.structured_outputs) == pb_options(options)


def pb_options(options):
    from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

    return pb.SamplingOptions(structured_outputs=options.structured_outputs)


def test_the_client_refuses_an_unknown_or_doubled_constraint_by_name():
    from pdserve.services.router.client import options_from_kwargs

    for value in ({"regex": "a", "choice": ["b"]}, {"xml": "a"}, {}):
        with pytest.raises(ValueError, match="^structured_outputs: "):
            options_from_kwargs(structured_outputs=value)


def test_generate_flags_name_one_constraint(tmp_path):
    import argparse

    from pdserve.cli import _constraint, _logit_bias

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))

    def args(**given) -> argparse.Namespace:
        fields = dict(json_schema=None, grammar=None, regex=None, choice=None, json_object=False)
        return argparse.Namespace(**{**fields, **given})

    assert _constraint(args()) is None
    assert _constraint(args(json_schema=str(path))) == {"json": json.dumps(SCHEMA)}
    assert _constraint(args(choice=["yes", "no"])) == {"choice": ["yes", "no"]}
    assert _constraint(args(regex="a+")) == {"regex": "a+"}
    assert _constraint(args(json_object=True)) == {"json_object": True}
    assert _logit_bias(["5=-100", "7=2.5"]) == {5: -100.0, 7: 2.5} and _logit_bias(None) is None
    with pytest.raises(SystemExit):
        _logit_bias(["5"])
