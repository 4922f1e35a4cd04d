"""Hypothesis, time-bounded: request validation never lets a bad request through and
never fails any other way than with a ValueError naming the field (issue 13).

    random SamplingParams kwargs -> SamplingParams + validate_* : accepted, or ValueError "<field>: ..."
        accepted -> runs on a real tiny engine: finishes without an error, every block free
    random GenerateRequest (proto)  -> router Validator          : a Job, or ValueError "<field>: ..."
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.validation import validate_prompt, validate_sampling_params
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.pb_records import request_of
from pdserve.services.router.validate import Limits, Validator

FIELDS = (
    "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "n",
    "beam_width", "length_penalty", "early_stopping", "cache_salt",
)
NAMED = re.compile(r"^(\w+): ")
# What a request may name besides SamplingParams' fields (router and engine checks).
REQUEST_FIELDS = {*FIELDS, "prompt", "prompt_token_ids", "token_ids", "model", "request_id", "text"}
MAX_MODEL_LEN = 256
FUZZ = settings(deadline=None, max_examples=150, suppress_health_check=list(HealthCheck))

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-6, 0.5, 1.0, 2.0, 16.0, 1e300, -1.0]),
)
ints = st.one_of(
    st.integers(-3, 70), st.sampled_from([-(2**63), 2**31 - 1, 2**63 - 1, 2**64, 2**70, 4095, 4096, 10**6]),
)
strings = st.one_of(st.text(max_size=8), st.sampled_from(["", "\n", "def", "\x00", "é" * 300]))


def mostly(valid: st.SearchStrategy, anything: st.SearchStrategy) -> st.SearchStrategy:
    """Valid about three times in four (extremes included), else anything: enough
    accepted requests reach the engine."""
    return st.one_of(valid, valid, valid, anything)


values = {
    "max_tokens": mostly(st.integers(1, 4), ints), "min_tokens": mostly(st.integers(0, 1), ints),
    "temperature": mostly(st.one_of(st.floats(0, 3), st.sampled_from([1e-5, 1e-300, 1e300])), floats),
    "top_k": mostly(st.integers(-1, 4096), ints),
    "top_p": mostly(st.one_of(st.floats(1e-300, 1), st.just(5e-324)), floats),
    "min_p": mostly(st.floats(0, 1), floats),
    "repetition_penalty": mostly(st.one_of(st.floats(1e-3, 1e3), st.sampled_from([5e-324, 1e-300, 1e300])), floats),
    "presence_penalty": mostly(st.floats(-2, 2), floats), "frequency_penalty": mostly(st.floats(-2, 2), floats),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), ints),
    "stop": mostly(st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple),
                   st.lists(strings, max_size=20).map(tuple)),
    "stop_token_ids": mostly(st.lists(st.integers(0, 4095), max_size=3).map(tuple),
                             st.lists(ints, max_size=70).map(tuple)),
    "ignore_eos": st.booleans(),
    "logprobs": mostly(st.one_of(st.none(), st.integers(0, 20)), ints),
    "prompt_logprobs": mostly(st.one_of(st.none(), st.integers(0, 20)), ints),
    "n": mostly(st.integers(1, 3), ints), "beam_width": mostly(st.just(1), st.one_of(st.integers(2, 3), ints)),
    "length_penalty": mostly(st.floats(-16, 16), floats),
    "early_stopping": st.sampled_from([True, False, "never", "sometimes", 1]),
    "cache_salt": st.one_of(st.none(), strings),
}
# Any JSON-ish value in any field: the wrong type is refused like a wrong value.
junk = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4), st.binary(max_size=4),
                 st.lists(st.one_of(st.integers(), st.text(max_size=2), st.none()), max_size=3))
values = {name: st.one_of(strategy, strategy, strategy, junk) for name, strategy in values.items()}
kwargs_strategy = st.fixed_dictionaries({}, optional=values)
prompts = st.one_of(
    st.lists(st.integers(0, 4095), min_size=1, max_size=12),
    st.lists(st.one_of(st.integers(-5, 5000), st.just(2**40)), max_size=12),
)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=64), max_n=4,
                                  scheduler=_scheduler()))


def _scheduler():
    from pdserve.engine.config import SchedulerConfig

    return SchedulerConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=8)


def _assert_names_a_field(error: ValueError, allowed: set[str]) -> None:
    match = NAMED.match(str(error))
    assert match and match.group(1) in allowed, f"the error names no request field: {error}"
    assert len(str(error)) < 1024, f"error message too long to send as a status: {len(str(error))} chars"


@FUZZ
@given(kwargs=kwargs_strategy, prompt=prompts)
def test_sampling_params_are_refused_naming_a_field_or_run(engine, kwargs, prompt):
    try:
        params = SamplingParams(**kwargs)
        validate_sampling_params(params, engine.limits)
        validate_prompt(prompt, params, engine.model_config.vocab_size, engine.max_model_len)
    except ValueError as e:
        _assert_names_a_field(e, REQUEST_FIELDS)
        event(f"refused: {str(e).split(':')[0]}")
        return
    event("accepted")
    # Accepted: keep the run short (the fuzzed fields are what matter), then it must
    # finish without an engine error and free every block.
    engine.add_request("fuzz", prompt, params)
    out = None
    for _ in range(200):
        for o in engine.step():
            out = o
        if not engine.has_unfinished():
            break
    assert out is not None and out.error is None, (kwargs, out and out.error)
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    engine.check_integrity()


def _options(draw_kwargs: dict) -> pb.SamplingOptions:
    """Only what the proto can carry (int32/int64/double ranges)."""
    opts = pb.SamplingOptions()
    for name, value in draw_kwargs.items():
        field = pb.SamplingOptions.DESCRIPTOR.fields_by_name.get(name)
        if field is None:
            continue
        try:
            if name == "early_stopping":
                opts.early_stopping = str(value)
            elif name == "stop":
                opts.stop.extend(value)
            elif name == "stop_token_ids":
                opts.stop_token_ids.extend(value)
            elif value is not None:
                setattr(opts, name, value)
        except (ValueError, TypeError, OverflowError):  # out of the proto type's range: a client cannot send it
            continue
    return opts


@pytest.fixture(scope="module")
def validator(engine):
    return Validator(Limits("pdserve-tiny-code", 4096, MAX_MODEL_LEN, 4, 16, max_logprobs=20,
                            max_prompt_bytes=4096, max_prompt_tokens=200), engine.tokenizer)


@FUZZ
@given(
    kwargs=kwargs_strategy, prompt=prompts, text=st.one_of(st.none(), st.text(max_size=40), st.just("x" * 5000)),
    model=st.sampled_from(["", "pdserve-tiny-code", "gpt-9", "m" * 10_000]),
    request_id=st.sampled_from(["", "r1", "r" * 300]), salt=st.sampled_from(["", "tenant", "s" * 1000]),
)
def test_proto_requests_are_refused_naming_a_field_or_become_jobs(validator, kwargs, prompt, text, model, request_id,
                                                                  salt):
    request = pb.GenerateRequest(request_id=request_id, model=model, sampling=_options(kwargs), cache_salt=salt)
    if text is not None:
        request.text = text
    elif prompt:
        request.token_ids.ids.extend(prompt)
    try:
        job = validator.validate(request_of(request))
    except ValueError as e:
        _assert_names_a_field(e, REQUEST_FIELDS)
        return
    assert 0 < len(job.prompt) <= 200 and all(0 <= t < 4096 for t in job.prompt)
    assert all(math.isfinite(getattr(job.params, f)) for f in ("temperature", "top_p", "min_p", "length_penalty"))


VALID_WIRE = pb.GenerateRequest(text="def f(x):", sampling=pb.SamplingOptions(max_tokens=4, temperature=0.5,
                                                                              stop=["\n"])).SerializeToString()


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), st.builds(
    lambda cut, junk, at: VALID_WIRE[:at] + junk + VALID_WIRE[at + cut:],
    st.integers(0, 4), st.binary(max_size=6), st.integers(0, len(VALID_WIRE)))))
def test_request_bytes_parse_then_validate_or_are_refused(validator, raw):
    """What the server does with a request's bytes (services/common/malformed.py):
    a DecodeError (answered INVALID_ARGUMENT 'request: ...'), or a message that
    validation turns into a job or refuses naming a field."""
    from google.protobuf.message import DecodeError

    try:
        request = pb.GenerateRequest.FromString(raw)
    except DecodeError:
        return
    try:
        validator.validate(request_of(request))
    except ValueError as e:
        _assert_names_a_field(e, REQUEST_FIELDS)
