"""The structured-outputs comparison: the same requests with and without a JSON-schema
constraint, on one engine in this process, at a fixed concurrency (closed loop).

    constrained    each request carries one of SCHEMAS (bounded: every output ends)
    unconstrained  the same prompts, each with max_tokens = what its constrained run
                   generated and ignore_eos: the same tokens a request, the same
                   batch shapes, so the difference is the grammar's (mask, matcher)

A run keeps `concurrency` requests in flight on the engine (a finished one is replaced
at once); TPOT of a request is (finished - first token) / (tokens - 1) from the
engine's own times (RequestTimes), throughput is output tokens over the run's wall
time. Grammars are compiled before the timed runs (the compile cache is warm: the
steady state of a server that has seen its schemas); compile times are measured apart.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve.bench.common.stats import median, percentile
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.params import StructuredOutputs

_STR = {"type": "string", "maxLength": 12}
_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 999}
# Shapes applications send (a record, a list, an enum'd choice, a nested call), each
# bounded so that any output the grammar allows ends within MAX_TOKENS.
SCHEMAS: tuple[dict, ...] = (
    {"type": "object", "properties": {"name": _STR, "age": _SMALL_INT}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error", "pending"]}, "code": _SMALL_INT},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"function": {"const": "get_weather"},
                                      "arguments": {"type": "object", "properties": {"city": _STR,
                                                                                     "unit": {"enum": ["c", "f"]}},
                                                    "required": ["city", "unit"], "additionalProperties": False}},
     "required": ["function", "arguments"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": _SMALL_INT,
                                      "note": {"anyOf": [_STR, {"type": "null"}]}},
     "required": ["ok", "score", "note"], "additionalProperties": False},
)
PROMPTS = (
    '"""Return the user as a JSON record."""\n',
    "def parse(text):\n    ",
    "# the configuration, as JSON\nconfig = ",
    "import json\n\n\ndef load(path):\n    ",
    '"""A tool call: which function, with which arguments."""\n',
    "class Result:\n    ",
)
MAX_TOKENS = 96


@dataclass(frozen=True)
class Job:
    index: int
    prompt: list[int]
    params: SamplingParams
    schema: dict | None  # the constrained run's schema (None: unconstrained)


@dataclass(frozen=True)
class RunResult:
    label: str
    concurrency: int
    wall_seconds: float
    output_tokens: int
    tpot: list[float]  # seconds, one per request with >= 2 tokens
    lengths: list[int]  # output tokens per request, by job index
    texts: list[str]
    finish_reasons: list[str]

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else math.nan

    @property
    def tpot_p50(self) -> float:
        return median(self.tpot)

    def line(self) -> str:
        return (f"{self.label:<14} c={self.concurrency:<3} requests={len(self.lengths):<4} tokens={self.output_tokens:<6} "
                f"wall={self.wall_seconds:7.2f}s  out_tok/s={self.throughput:8.1f}  "
                f"tpot_p50={self.tpot_p50 * 1e3:7.2f}ms  tpot_p90={percentile(self.tpot, 90) * 1e3:7.2f}ms")


def constrained_jobs(encode, num_requests: int, temperature: float, seed: int) -> list[Job]:
    """Request i: prompt i mod len(PROMPTS), schema i mod len(SCHEMAS)."""
    jobs = []
    for i in range(num_requests):
        schema = SCHEMAS[i % len(SCHEMAS)]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed + i,
                                structured_outputs=StructuredOutputs.json_schema(schema))
        jobs.append(Job(i, encode(PROMPTS[i % len(PROMPTS)]), params, schema))
    return jobs


def unconstrained_twins(jobs: Sequence[Job], lengths: Sequence[int]) -> list[Job]:
    """The same requests without the constraint, each generating as many tokens as its
    constrained twin did (ignore_eos: no earlier end)."""
    return [replace(job, schema=None, params=replace(job.params, structured_outputs=None, ignore_eos=True,
                                                     max_tokens=max(1, n)))
            for job, n in zip(jobs, lengths)]


def run_closed_loop(engine, jobs: Sequence[Job], concurrency: int, label: str, tag: str,
                    decode=lambda ids: "", timeout: float = 600.0) -> RunResult:
    """Every job through `engine` (an LLMEngine), `concurrency` in flight at a time."""
    pending = list(jobs)
    by_id: dict[str, Job] = {}
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label}: not done within {timeout:.0f} s")
        while pending and len(by_id) - len(outputs) < concurrency:
            job = pending.pop(0)
            request_id = f"{tag}-{job.index}"
            by_id[request_id] = job
            for out in engine.add_request(request_id, job.prompt, job.params):
                outputs[by_id[out.request_id].index] = out
        for out in engine.step():
            outputs[by_id[out.request_id].index] = out
    wall = time.perf_counter() - start
    tpot, lengths, texts, reasons = [], [], [], []
    for job in jobs:
        out = outputs[job.index]
        if out.error:
            raise RuntimeError(f"{label}: request {job.index} failed: {out.error}")
        completion = out.outputs[0]
        n = len(completion.token_ids)
        lengths.append(n)
        texts.append(completion.text or decode(completion.token_ids))
        reasons.append(completion.finish_reason or "")
        times = out.times
        if n >= 2 and times is not None and times.first_token is not None:
            tpot.append((times.finished - times.first_token) / (n - 1))
    return RunResult(label, concurrency, wall, sum(lengths), tpot, lengths, texts, reasons)


def validate_outputs(jobs: Sequence[Job], result: RunResult) -> list[str]:
    """Problems: each constrained output must have ended by its grammar and be JSON that
    validates against its schema (jsonschema)."""
    import jsonschema

    problems = []
    for job, text, reason in zip(jobs, result.texts, result.finish_reasons):
        if job.schema is None:
            continue
        if reason != "stop":
            problems.append(f"request {job.index}: finished {reason!r}, not by its grammar: {text[:80]!r}")
            continue
        try:
            jsonschema.validate(json.loads(text), job.schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            problems.append(f"request {job.index}: {type(exc).__name__}: {str(exc)[:120]} in {text[:80]!r}")
    return problems


# -- hostile constraints beside a victim ----------------------------------------------------

# What an attacker sends, and what each must come to: refused at admission (ValueError,
# a 400 before any compile), refused by the grammar engine (INVALID_CONSTRAINT) or past
# the compile deadline (CONSTRAINT_TIMEOUT); never an output, never INTERNAL.
SLOW_REGEX = "|".join(f"[a-z]{{{i},{i + 300}}}q{i}" for i in range(40))  # seconds of xgrammar's compile


def hostile_constraints(max_bytes: int, max_depth: int) -> dict[str, StructuredOutputs | None]:
    """name -> constraint (None: the engine must refuse to build it at all)."""
    deep: dict = {"type": "string"}
    for _ in range(max_depth + 1):
        deep = {"type": "array", "items": deep}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(max_bytes // 16)}}
    endless = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    return {
        "invalid_type": StructuredOutputs.json_schema({"type": "no-such-type"}),
        "too_deep": StructuredOutputs.json_schema(deep),
        "too_large": StructuredOutputs.json_schema(huge),
        "endless_recursion": StructuredOutputs.json_schema(endless),
        "bad_regex": StructuredOutputs("regex", "(unclosed"),
        "slow_regex": StructuredOutputs("regex", SLOW_REGEX),
    }


@dataclass(frozen=True)
class HostileResult:
    victim_alone: RunResult
    victim_beside: RunResult
    outcomes: dict[str, str]  # hostile request -> how it ended

    @property
    def tpot_ratio(self) -> float:
        return self.victim_beside.tpot_p50 / self.victim_alone.tpot_p50 if self.victim_alone.tpot_p50 else math.nan


def run_hostile(engine, prompt: list[int], max_bytes: int, max_depth: int, victim_tokens: int = 64) -> HostileResult:
    """A greedy victim alone, then again with every hostile constraint sent beside it (one
    a step while it decodes). Each hostile request must fail alone; the victim's tokens must
    not change."""
    victim = Job(0, prompt, SamplingParams(max_tokens=victim_tokens, temperature=0.0, ignore_eos=True), None)
    alone = run_closed_loop(engine, [victim], 1, "victim alone", "va")
    hostile = list(hostile_constraints(max_bytes, max_depth).items())
    outcomes: dict[str, str] = {}
    outputs: dict[str, object] = {}
    engine.add_request("vb", prompt, victim.params)
    start = time.perf_counter()
    deadline = time.monotonic() + 600
    while engine.has_unfinished():
        if time.monotonic() > deadline:
            raise RuntimeError("hostile phase: not done within 600 s")
        if hostile:
            name, constraint = hostile.pop(0)
            try:
                for out in engine.add_request(f"h-{name}", prompt, SamplingParams(max_tokens=8, structured_outputs=constraint)):
                    outputs[out.request_id] = out
            except ValueError as exc:
                outcomes[name] = f"refused at admission: {str(exc)[:90]}"
        for out in engine.step():
            outputs[out.request_id] = out
    wall = time.perf_counter() - start
    for request_id, out in outputs.items():
        if request_id.startswith("h-"):
            failure = out.failure.name if out.failure is not None else "none"
            outcomes[request_id[2:]] = f"{failure}: {(out.error or '')[:90]}"
    v = outputs["vb"]
    n = len(v.outputs[0].token_ids)
    times = v.times
    tpot = [(times.finished - times.first_token) / (n - 1)] if n >= 2 and times and times.first_token else []
    beside = RunResult("victim beside", 1, wall, n, tpot, [n], [""], [v.outputs[0].finish_reason or ""])
    if list(v.outputs[0].token_ids) != list(alone_tokens(engine, victim)):
        outcomes["victim"] = "TOKENS CHANGED"
    return HostileResult(alone, beside, outcomes)


def alone_tokens(engine, victim: Job) -> list[int]:
    """The victim's tokens alone (greedy: the same every run)."""
    engine.add_request("va-check", victim.prompt, victim.params)
    out = None
    while engine.has_unfinished():
        for done in engine.step():
            out = done
    return list(out.outputs[0].token_ids) if out is not None else []


def hostile_problems(result: HostileResult) -> list[str]:
    """Every hostile request failed alone (at admission, INVALID_CONSTRAINT or
    CONSTRAINT_TIMEOUT), and the victim's tokens are unchanged."""
    problems = []
    for name, outcome in result.outcomes.items():
        if name == "victim":
            problems.append("hostile phase: the victim's tokens changed beside hostile constraints")
        elif name == "slow_regex" and outcome.startswith("none"):
            continue  # compiled within the deadline on a fast machine: served, which is right too
        elif not outcome.startswith(("refused at admission", "INVALID_CONSTRAINT", "CONSTRAINT_TIMEOUT")):
            problems.append(f"hostile request {name}: {outcome}")
    return problems
