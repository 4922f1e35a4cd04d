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
