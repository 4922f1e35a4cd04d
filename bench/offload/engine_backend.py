"""An LLMEngine in this process as a serving benchmark's Backend (bench/serving/backend.py),
so that the multi-turn workload runs on one engine with no router or gRPC between, and
the engine's own statistics (its KV tiers' hits) can be read beside the timings.

    bench threads  send(request) --submit--> engine thread: add_request, step() in a loop
                   wait on the request's       token_hook: a perf_counter time per token
                   Event (deadline: timeout)   step() -> finished RequestOutput: Event set

One thread owns the engine (it is not thread-safe): it adds what was submitted, steps
while anything is unfinished, and sleeps on a condition when idle. TTFT is measured
as over gRPC: sending -> the first token's time (here: the step that sampled it).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from pdserve.bench.serving.backend import INTERRUPTED, InFlight, ServedModel, result_base
from pdserve.bench.serving.metrics import RequestResult
from pdserve.bench.serving.workloads import BenchRequest


@dataclass
class _Pending:
    request_id: str
    prompt: list[int]
    max_tokens: int
    times: list[float] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    output: object | None = None  # the finished RequestOutput
    error: str = ""


class _Call:
    """What InFlight cancels: the request, aborted on the engine thread."""

    def __init__(self, backend: "EngineBackend", pending: _Pending) -> None:
        self.backend, self.pending = backend, pending

    def cancel(self) -> None:
        self.backend._abort(self.pending)


class EngineBackend:
    """`engine`: an LLMEngine this backend drives until close(); `label` names it in reports."""

    name = "engine"

    def __init__(self, engine, label: str) -> None:
        from pdserve.engine.sampling_params import SamplingParams  # torch: only with an engine

        self._params = SamplingParams
        self.engine = engine
        self.address = label
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._submitted: list[_Pending] = []
        self._aborts: list[_Pending] = []
        self._live: dict[str, _Pending] = {}
        self._closed = False
        engine.token_hook = self._on_token
        self._thread = threading.Thread(target=self._loop, name=f"engine-{label}", daemon=True)
        self._thread.start()

    def served(self) -> ServedModel:
        return ServedModel(self.address, self.engine.model_config.vocab_size, self.engine.max_model_len)

    def stats(self):
        """The engine's EngineStats, read on the engine thread's terms (between steps)."""
        with self._cond:
            return self.engine.stats()

    # -- requests ---------------------------------------------------------------------

    def send(self, request: BenchRequest, timeout: float, inflight: InFlight) -> RequestResult:
        if isinstance(request.prompt, str):
            raise ValueError("the engine backend takes token-id prompts")
        started = time.perf_counter()
        base = result_base(request)
        pending = _Pending(f"bench-{next(self._ids)}", list(request.prompt), request.max_tokens)
        call = _Call(self, pending)
        if not inflight.add(call):
            return RequestResult(error=INTERRUPTED, started=started, finished=time.perf_counter(), **base)
        with self._cond:
            self._submitted.append(pending)
            self._cond.notify()
        try:
            if not pending.done.wait(timeout):
                self._abort(pending)
                return RequestResult(error=f"DEADLINE_EXCEEDED: not done within {timeout:g}s", started=started,
                                     finished=time.perf_counter(), output_tokens=len(pending.times), **base)
        finally:
            inflight.discard(call)
        finished = time.perf_counter()
        output = pending.output
        if pending.error or output is None:
            return RequestResult(error=pending.error or "no output", started=started, finished=finished, **base)
        completion = output.outputs[0]
        tokens = len(completion.token_ids)
        problem = "" if completion.finish_reason == "length" and tokens == request.max_tokens else \
            f"finish_reason={completion.finish_reason!r} after {tokens}/{request.max_tokens} tokens"
        return RequestResult(error=problem, started=started, finished=finished, prompt_tokens=len(pending.prompt),
                             cached_tokens=output.num_cached_tokens, output_tokens=tokens,
                             token_times=tuple(pending.times), output_ids=tuple(completion.token_ids), **base)

    def _abort(self, pending: _Pending) -> None:
        with self._cond:
            self._aborts.append(pending)
            self._cond.notify()

    # -- the engine thread ------------------------------------------------------------

    def _on_token(self, delta) -> None:
        pending = self._live.get(delta.request_id)
        if pending is not None:
            pending.times.append(time.perf_counter())

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._submitted or self._aborts or self.engine.has_unfinished()):
                    self._cond.wait()
                if self._closed:
                    break
                submitted, self._submitted = self._submitted, []
                aborts, self._aborts = self._aborts, []
                for pending in submitted:
                    self._add(pending)
                for pending in aborts:
                    self._finish(pending, None, INTERRUPTED)
                    self.engine.abort(pending.request_id)
                try:
                    finished = self.engine.step() if self.engine.has_unfinished() else []
                except Exception as e:  # a broken engine fails every request, loudly
                    for pending in list(self._live.values()):
                        self._finish(pending, None, f"engine step failed: {type(e).__name__}: {e}")
                    raise
            for output in finished:
                pending = self._live.get(output.request_id)
                if pending is not None:
                    self._finish(pending, output, output.error or "")

    def _add(self, pending: _Pending) -> None:
        params = self._params(max_tokens=pending.max_tokens, temperature=0.0, ignore_eos=True)
        self._live[pending.request_id] = pending
        try:
            for output in self.engine.add_request(pending.request_id, pending.prompt, params):
                self._finish(pending, output, output.error or "")
        except ValueError as e:
            self._finish(pending, None, f"INVALID_ARGUMENT: {e}")

    def _finish(self, pending: _Pending, output, error: str) -> None:
        self._live.pop(pending.request_id, None)
        pending.output, pending.error = output, error
        pending.done.set()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(30.0)

    def __enter__(self) -> "EngineBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
