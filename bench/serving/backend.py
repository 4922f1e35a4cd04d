"""What a benchmark sends its requests through: a backend runs one BenchRequest,
timed message by message, and names the model it serves.

    backend.served() -> ServedModel                  name, vocab size, max_model_len
    backend.send(request, timeout, inflight)         one streamed request -> RequestResult
                                                     (never raises for a failed request)

    GrpcBackend      pdserve's own API: Generation.Generate, streamed (this file)
    OpenAiBackend    any OpenAI-compatible server: /v1/completions or
                     /v1/chat/completions, streamed SSE (bench/serving/openai_backend.py)

Every request is greedy with `ignore_eos`, so it must end with finish_reason
"length" after exactly its max_tokens; one that ends otherwise is a failure. A
call joins `InFlight` while it runs, so that an interrupted benchmark can cancel
every call still running, whichever thread waits on it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

import grpc

from pdserve.bench.serving.metrics import RequestResult
from pdserve.bench.serving.workloads import BenchRequest
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client

CONNECT_TIMEOUT = 30.0  # seconds for the server to say what it serves
INTERRUPTED = "CANCELLED: benchmark interrupted"


class Cancellable(Protocol):
    def cancel(self) -> object: ...


class InFlight:
    """The calls running now, so that an interrupted benchmark can cancel them all;
    once closed, new calls are cancelled as they start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[Cancellable] = set()
        self._closed = False

    def add(self, call: Cancellable) -> bool:
        with self._lock:
            if not self._closed:
                self._calls.add(call)
                return True
        call.cancel()
        return False

    def discard(self, call: Cancellable) -> None:
        with self._lock:
            self._calls.discard(call)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()


@dataclass(frozen=True)
class ServedModel:
    name: str
    vocab_size: int  # random token-id prompts are drawn below it
    max_model_len: int


class Backend(Protocol):
    name: str  # "grpc", "openai", "openai-chat"
    address: str  # what a report names as the target

    def served(self) -> ServedModel: ...

    def send(self, request: BenchRequest, timeout: float, inflight: InFlight) -> RequestResult: ...


def result_base(request: BenchRequest) -> dict:
    """The RequestResult fields a request fixes before it is sent."""
    return dict(index=request.index, requested_tokens=request.max_tokens, requested_prompt_tokens=request.prompt_len)


def incomplete(finish_reason: str | None, tokens: int, expected: int) -> str:
    """Why a stream that ended is not the request's answer ('' when it is)."""
    if not finish_reason:
        return f"stream ended without a finish_reason after {tokens} tokens"
    if finish_reason != "length" or tokens != expected:
        return f"finish_reason={finish_reason!r} after {tokens}/{expected} tokens"
    return ""


class GrpcBackend:
    """pdserve's gRPC API through a Client (its channel is shared by every thread)."""

    name = "grpc"

    def __init__(self, client: Client) -> None:
        self.client = client
        self.address = client.address

    def served(self) -> ServedModel:
        try:
            (model, *_) = self.client.list_models(timeout=CONNECT_TIMEOUT)
        except grpc.RpcError as e:
            raise ConnectionError(f"router at {self.address}: {e.code().name}: {e.details()}") from e
        except ValueError:
            raise ConnectionError(f"router at {self.address} serves no model") from None
        return ServedModel(model.name, model.vocab_size, model.max_model_len)

    def send(self, request: BenchRequest, timeout: float, inflight: InFlight) -> RequestResult:
        """One streamed Generate call: a token time per message that carries tokens."""
        started = time.perf_counter()
        base = result_base(request)
        call = self.client.generate(request.prompt, max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True,
                                    timeout=timeout)
        if not inflight.add(call):
            return RequestResult(error=INTERRUPTED, started=started, finished=time.perf_counter(), **base)
        times: list[float] = []
        ids: list[int] = []
        final: pb.GenerateResponse | None = None
        try:
            for message in call:
                if message.token_ids:
                    times.append(time.perf_counter())
                    ids += message.token_ids
                if message.finish_reason:
                    final = message
        except grpc.RpcError as e:
            return RequestResult(error=f"{e.code().name}: {e.details()}", started=started,
                                 finished=time.perf_counter(), output_tokens=len(ids), **base)
        finally:
            inflight.discard(call)
        finished = time.perf_counter()
        problem = incomplete(final.finish_reason if final else None, len(ids), request.max_tokens)
        if problem or final is None:
            return RequestResult(error=problem, started=started, finished=finished, output_tokens=len(ids), **base)
        return RequestResult(
            error="", started=started, finished=finished, prompt_tokens=final.usage.prompt_tokens,
            cached_tokens=final.usage.cached_tokens, output_tokens=len(ids), token_times=tuple(times),
            output_ids=tuple(ids),
            server_ttft=final.timing.ttft_seconds, server_tpot=final.timing.tpot_seconds, **base,
        )
