"""`python -m pdserve.bench.structured`: its parts, and its quick mode end to end (in
this process: the embedded model, a few requests)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pdserve.bench.structured import __main__ as bench
from pdserve.bench.structured.run import SCHEMAS, RunResult, Job, unconstrained_twins, validate_outputs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.params import StructuredOutputs


def test_every_schema_is_a_valid_bounded_schema():
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        StructuredOutputs.json_schema(schema)


def test_twins_generate_exactly_their_constrained_lengths_unconstrained():
    params = SamplingParams(max_tokens=96, structured_outputs=StructuredOutputs.json_schema(SCHEMAS[0]))
    jobs = [Job(0, [1, 2], params, SCHEMAS[0]), Job(1, [3], params, SCHEMAS[0])]
    twins = unconstrained_twins(jobs, [7, 0])
    assert [t.params.max_tokens for t in twins] == [7, 1]
    assert all(t.params.structured_outputs is None and t.params.ignore_eos and t.schema is None for t in twins)
    assert [t.prompt for t in twins] == [[1, 2], [3]]


def test_an_output_that_does_not_validate_or_did_not_end_is_a_problem():
    job = Job(0, [1], SamplingParams(), SCHEMAS[0])
    good = json.dumps({"name": "a", "age": 3})
    result = RunResult("x", 1, 1.0, 3, [], [3, 3, 3], [good, '{"name": 1}', good[:-1]], ["stop", "stop", "length"])
    problems = validate_outputs([job, job, job], result)
    assert len(problems) == 2 and "ValidationError" in problems[0] and "'length'" in problems[1]


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--requests", "0"])
    assert info.value.code == 2 and "requests" in capsys.readouterr().err


def test_quick_run_validates_every_output_and_prints_the_ratio(capsys):
    assert bench.main(["--quick", "--requests", "5", "--concurrency", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "isa=" in out and "compile per schema" in out
    # every hostile constraint failed alone (else the exit status is 1), the victim's ratio printed
    assert re.search(r"victim_tpot_ratio=\d+\.\d+", out)
    assert re.search(r"hostile slow_regex +(CONSTRAINT_TIMEOUT|none)", out)
    assert re.search(r"hostile endless_recursion +INVALID_CONSTRAINT", out)
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"structured_valid=(\d+)/(\d+) structured_tpot_ratio_c3=(\S+)", last)
    assert match, last
    valid, generated, ratio = int(match[1]), int(match[2]), float(match[3])
    assert valid == generated == 5 * 3  # the reference run, then one repetition at each concurrency
    assert ratio > 0
