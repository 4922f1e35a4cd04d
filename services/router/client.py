"""A small Python client for the public API, retrying on another router.

    with Client("127.0.0.1:50051") as client:
        for message in client.generate("def fib(n):", max_tokens=32, temperature=0.0):
            print(message.text, end="")

    Client(["10.0.0.1:50051", "10.0.0.2:50051"])      # several routers (or "a:1,b:2")
    Client("pdserve-router-headless:50051")            # a DNS name: each address (A, else AAAA) a router
    Client(address, api_key="...", tls_ca="ca.pem")    # a router with API keys and TLS

`generate` returns a call: iterate it for GenerateResponse messages, or `.cancel()`
it; `code()`, `details()`, `trailing_metadata()` once it ended. Keyword arguments
are engine.SamplingParams fields, and `cache_salt` (requests with different salts
never share cached prompt blocks). Importing this module needs only grpcio and
protobuf (no torch).

The life of a call (the policy is proto/pdserve/v1/service_config.json's, the one
other gRPC clients are given):

    attempt on a router (untried first, then the least tried; not one that
      |              said to wait, nor one that just failed, while another can serve)
      +-- a message --> committed: from now on a failure is the caller's, with the
      |                 tokens received named (never replayed: the router migrates)
      +-- UNAVAILABLE / RESOURCE_EXHAUSTED / CANCELLED before any message, the
      |     caller not having cancelled (a router only ever sends CANCELLED to a
      |     caller that left: one that is still there read it from gRPC's server
      |     shutdown, which cancels a call that arrived as it began)
      |     wait: none before a router this call has not tried yet, else
      |           random(0, min(initialBackoff * multiplier^k, maxBackoff)); and
      |           for that router at least its hint (trailing `retry-after-ms`)
      |     maxAttempts reached, or the wait would pass the deadline --> fail
      |     (the last status; its details list every attempt); the deadline passing
      |     during a retry --> DEADLINE_EXCEEDED, saying why it was retried
      +-- any other status --> fail with it
    after messages arrived (a Generate call): the router died or the connection
      broke (UNAVAILABLE, CANCELLED the caller did not cause, a reset HTTP/2 stream)
      --> resumed on another router (GenerateRequest.resume: the same request plus
          what arrived of each sequence), within the deadline and maxAttempts; the
          caller reads on as if nothing happened: no token twice, none missing, one
          final message per sequence. Not for beam search (it streams nothing
          before its end, so it is retried as above), nor when the router issued no
          resume token (no cluster token): then it fails, naming where it stopped.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.common.addresses import is_ip, join_host_port, lookup
from pdserve.services.common.keepalive import with_keepalive

log = logging.getLogger(__name__)
_OPTIONS = pb.SamplingOptions.DESCRIPTOR.fields_by_name
SERVICE_CONFIG = Path(pb.__file__).with_name("service_config.json")
# the router's retry hint on RESOURCE_EXHAUSTED (services/router/service.py sets both)
HINT_KEYS = ("retry-after-ms", "grpc-retry-pushback-ms")
_SCHEMES = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")


def options_from_kwargs(**sampling: object) -> pb.SamplingOptions:
    """SamplingOptions from engine.SamplingParams-style keyword arguments (None: unset).

    `structured_outputs`: a `pb.StructuredOutputs`, the engine's `StructuredOutputs`, or
    vLLM's form, a dict of one key: `{"json": schema (a dict or its text)}`, `{"regex":
    str}`, `{"choice": [str, ...]}`, `{"grammar": str}`, `{"json_object": True}`.
    `logit_bias`: {token id: bias in [-100, 100]} (ids as ints or strings, as OpenAI's)."""
    options = pb.SamplingOptions()
    for name, value in sampling.items():
        field = _OPTIONS.get(name)
        if field is None:
            raise ValueError(f"{name}: not a sampling option (one of {sorted(_OPTIONS)})")
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name == "early_stopping" and isinstance(value, bool):
            value = str(value).lower()
        if name == "structured_outputs":
            options.structured_outputs.CopyFrom(constraint_option(value))
        elif name == "logit_bias":
            if not isinstance(value, dict):
                raise ValueError("logit_bias: must map token ids to biases")
            options.logit_bias.update({int(token): float(bias) for token, bias in value.items()})
        elif field.is_repeated:
            getattr(options, name).extend(value)  # type: ignore[arg-type]
        else:
            setattr(options, name, value)
    return options


_CONSTRAINT_KEYS = {"json": "json_schema", "json_schema": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}


def constraint_option(value: object) -> pb.StructuredOutputs:
    """The message of a structured-outputs constraint (`options_from_kwargs`'s forms).
    The router checks it (as it does every field) before any worker sees it."""
    if isinstance(value, pb.StructuredOutputs):
        return value
    if not isinstance(value, dict):
        from pdserve.services.common.convert import constraint_message  # the engine's StructuredOutputs

        return constraint_message(value)  # type: ignore[arg-type]
    if len(value) != 1:
        raise ValueError(f"structured_outputs: one constraint of {sorted(_CONSTRAINT_KEYS)}, got {sorted(value)}")
    ((key, spec),) = value.items()
    kind = _CONSTRAINT_KEYS.get(key)
    if kind is None:
        raise ValueError(f"structured_outputs: unknown constraint {key!r} (one of {sorted(_CONSTRAINT_KEYS)})")
    if kind == "choice":
        return pb.StructuredOutputs(choice=pb.ChoiceList(choices=list(spec)))  # type: ignore[call-overload]
    if kind == "json_schema" and not isinstance(spec, str):
        spec = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
    return pb.StructuredOutputs(**{kind: spec})


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's retryPolicy (gRFC A6), read from the published service config."""

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    codes: frozenset[grpc.StatusCode] = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                   grpc.StatusCode.CANCELLED})

    @classmethod
    def from_service_config(cls, path: Path = SERVICE_CONFIG, service: str = "pdserve.v1.Generation") -> "RetryPolicy":
        config = json.loads(path.read_text())
        (policy,) = [m["retryPolicy"] for m in config["methodConfig"]
                     if any(n.get("service") == service for n in m["name"])]
        return cls(
            max_attempts=int(policy["maxAttempts"]),
            initial_backoff=_seconds(policy["initialBackoff"]),
            max_backoff=_seconds(policy["maxBackoff"]),
            multiplier=float(policy["backoffMultiplier"]),
            codes=frozenset(grpc.StatusCode[c] for c in policy["retryableStatusCodes"]),
        )

    def backoff(self, retry: int, rng: random.Random) -> float:
        """The wait before retry number `retry` (1, 2, ...): full jitter."""
        return rng.uniform(0.0, min(self.initial_backoff * self.multiplier ** (retry - 1), self.max_backoff))


def _seconds(duration: str) -> float:
    if not duration.endswith("s"):
        raise ValueError(f"{duration!r}: a protobuf Duration in JSON ends with 's'")
    return float(duration[:-1])


Lookup = Callable[[str, int], list[str]]


def resolve(target: str | Sequence[str], lookup: Lookup = lookup) -> list[str]:
    """Every router address `target` names: a "host:port", a comma-separated list of
    them, or a sequence; a host that is a DNS name stands for each of its addresses
    (same port). Targets with a gRPC scheme (unix:, dns:...) stay as they are; a name
    that does not resolve too (its calls fail UNAVAILABLE, and are retried)."""
    return list(_resolved(target, lookup))


def _resolved(target: str | Sequence[str], lookup: Lookup) -> dict[str, str | None]:
    """resolve(), each address with the DNS name it came from (None: given as is)."""
    targets = target.split(",") if isinstance(target, str) else list(target)
    out = {a: name for t in targets if t.strip() for a, name in _resolve_one(t.strip(), lookup)}
    if not out:
        raise ValueError(f"{target!r}: no router address")
    return out


def _resolve_one(target: str, lookup: Lookup) -> list[tuple[str, str | None]]:
    host, sep, port = target.rpartition(":")
    if target.startswith(_SCHEMES) or not sep or not port.isdigit() or is_ip(host.strip("[]")):
        return [(target, None)]
    try:
        ips = lookup(host, int(port))
    except OSError:
        return [(target, None)]
    return [(join_host_port(ip, port), host) for ip in ips] or [(target, None)]


class CallFailed(grpc.RpcError):
    """How a call ended when the client retried it, or when it failed after tokens
    arrived: the last attempt's status, with details that say what happened."""

    def __init__(self, code: grpc.StatusCode, details: str, last: grpc.RpcError | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self.last = code, details, last

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return _call_attr(self.last, "trailing_metadata", ())

    def initial_metadata(self) -> tuple:
        return _call_attr(self.last, "initial_metadata", ())


def _call_attr(error: object, name: str, default: object):
    method = getattr(error, name, None)
    return (method() or default) if callable(method) else default


def retry_hint(error: grpc.RpcError) -> float | None:
    """The server's `retry-after-ms` (or gRPC's pushback) in seconds, if it sent one."""
    trailers = dict(_call_attr(error, "trailing_metadata", ()))
    for key in HINT_KEYS:
        try:
            return max(0.0, int(trailers[key]) / 1000)
        except (KeyError, ValueError):
            continue
    return None


class _Routers:
    """The addresses, one channel each, re-resolved every `resolve_every` seconds
    when a name was given; which ones failed lately (a preference, across calls)."""

    def __init__(self, target: str | Sequence[str], channel_of: Callable[[str, str | None], grpc.Channel],
                 resolve_every: float, lookup: Lookup) -> None:
        self._target, self._channel_of, self._resolve_every = target, channel_of, resolve_every
        self._lookup = lookup
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._down_until: dict[str, float] = {}
        self._calls = itertools.count()
        self.addresses: list[str] = []
        self._resolved_at = 0.0
        self.closed = False
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        """Resolve again if it is time; channels of addresses that left stay open
        (calls may still run on them) until close()."""
        now = time.monotonic()
        if not force and now - self._resolved_at < self._resolve_every:
            return
        addresses = _resolved(self._target, self._lookup)
        with self._lock:
            self._resolved_at = now
            for a, name in addresses.items():
                if a not in self._channels:
                    self._channels[a] = self._channel_of(a, name)
            self.addresses = list(addresses)

    def channel(self, address: str) -> grpc.Channel:
        return self._channels[address]

    def first_channel(self) -> grpc.Channel:
        return self._channels[self.addresses[0]]

    def rotation(self) -> int:
        """Where a new call starts in the list: calls spread over the routers."""
        return next(self._calls)

    def choose(self, start: int, tried: Counter[str], wait_until: dict[str, float]) -> str:
        """The next router for a call: one free to serve now (no hint pending) before
        one that asked to wait; then the least tried; then one not failing lately;
        then the list's order from `start`."""
        now = time.monotonic()
        with self._lock:
            addresses = self.addresses
            n = len(addresses)
            return min(addresses, key=lambda a: (
                wait_until.get(a, 0.0) > now, tried[a], self._down_until.get(a, 0.0) > now,
                (addresses.index(a) - start) % n,
            ))

    def failed(self, address: str, for_s: float) -> None:
        with self._lock:
            self._down_until[address] = time.monotonic() + for_s

    def served(self, address: str) -> None:
        with self._lock:
            self._down_until.pop(address, None)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


Attempt = Callable[[grpc.Channel, float | None], Iterator]


class _Resumable:
    """What of a Generate call's sequences arrived (their resume states), and the
    request that resumes it on another router."""

    def __init__(self, request: pb.GenerateRequest, metadata: tuple | None) -> None:
        self.request = request
        self.metadata = metadata
        self._sent = request  # what the next attempt sends
        self.beam = request.sampling.beam_width > 1
        self.n = 1 if self.beam else max(1, request.sampling.n if request.sampling.HasField("n") else 1)
        self.token = b""
        self.received: dict[int, pb.ResumedSequence] = {}
        self.closed: set[int] = set()  # sequences whose final message arrived

    def seen(self, message: pb.GenerateResponse) -> bool:
        """Note `message`; False for one the caller has already (a resumed router
        sends each sequence's final message, which may have arrived before the break)."""
        if message.index in self.closed:
            return False
        state = message.resume_state
        self.token = state.token or self.token
        seq = self.received.setdefault(message.index, pb.ResumedSequence(index=message.index))
        seq.token_ids.extend(message.token_ids)
        seq.logprob_sum = state.logprob_sum
        seq.finish_reason = message.finish_reason or state.finish_reason
        if message.finish_reason:
            self.closed.add(message.index)
        if not self.request.request_id:  # the router's, kept by the routers that resume it
            self.request.request_id = message.request_id
        return True

    @property
    def complete(self) -> bool:
        """Every sequence's final message arrived: only the stream's close was lost."""
        return len(self.closed) >= self.n

    def why_not(self) -> str | None:
        """Why the call cannot be resumed; None if it can."""
        if self.beam:
            return "beam search is never resumed"
        if not self.token:
            return "the router issued no resume token (it has no --cluster-token-file)"
        return None

    def attempt(self, channel: grpc.Channel, left: float | None) -> Iterator:
        return pb_grpc.GenerationStub(channel).Generate(self._sent, timeout=left, metadata=self.metadata)

    def resume(self) -> None:
        """From now on attempts continue the stream from what arrived."""
        request = pb.GenerateRequest()
        request.CopyFrom(self.request)
        request.resume.CopyFrom(pb.Resume(token=self.token, sequences=list(self.received.values())))
        self._sent = request

    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.received.values())


class RetryingCall:
    """One call to the routers, retried per `policy` until a message arrives. An
    iterator of the responses, with `cancel()` and, once ended, `code()`/`details()`."""

    def __init__(self, attempt: Attempt, routers: _Routers, policy: RetryPolicy, timeout: float | None,
                 rng: random.Random, stream: _Resumable | None = None,
                 on_resume: Callable[[], None] | None = None) -> None:
        """`stream`: a Generate call, resumed on another router after a break
        (`attempt` then sends whatever request `stream` says)."""
        self._attempt, self._routers, self._policy, self._rng = attempt, routers, policy, rng
        self._stream, self._on_resume = stream, on_resume
        self.resumptions = 0
        self._deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        self._start = routers.rotation()
        self._tried: Counter[str] = Counter()
        self._wait_until: dict[str, float] = {}
        self._history: list[str] = []
        self._tokens: Counter[int] = Counter()
        self._messages = 0
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self._call: Iterator | None = None
        self._address = ""
        self._ended: grpc.RpcError | None = None
        self._refused: grpc.RpcError | None = None  # the last retryable failure
        self._begin(routers.choose(self._start, self._tried, self._wait_until))

    def __iter__(self) -> "RetryingCall":
        return self

    def __next__(self):
        while True:
            if self._ended is _COMPLETE:
                raise StopIteration
            if self._ended is not None:
                raise self._ended
            try:
                message = next(self._call)  # type: ignore[arg-type]
            except grpc.RpcError as e:
                self._ended = self._after(e)
                continue
            if self._stream is not None and not self._stream.seen(message):
                continue
            if not self._messages:
                self._routers.served(self._address)
            self._messages += 1
            self._tokens[getattr(message, "index", 0)] += len(getattr(message, "token_ids", ()))
            return message

    def cancel(self) -> bool:
        self._cancelled.set()
        with self._lock:
            call = self._call
        cancel = getattr(call, "cancel", None)
        return cancel() if cancel else True

    def is_active(self) -> bool:
        return self._ended is None and _call_attr(self._call, "is_active", False)

    def time_remaining(self) -> float | None:
        left = self._deadline - time.monotonic()
        return None if left == float("inf") else max(0.0, left)

    def code(self) -> grpc.StatusCode | None:
        if self._ended is _COMPLETE:
            return grpc.StatusCode.OK
        return self._ended.code() if self._ended is not None else _call_attr(self._call, "code", None)

    def details(self) -> str | None:
        if self._ended is _COMPLETE:
            return ""
        return self._ended.details() if self._ended is not None else _call_attr(self._call, "details", None)

    def trailing_metadata(self) -> tuple:
        return _call_attr(self._ended if self._ended is not None else self._call, "trailing_metadata", ())

    def initial_metadata(self) -> tuple:
        return _call_attr(self._call, "initial_metadata", ())

    def _begin(self, address: str) -> None:
        left = self._deadline - time.monotonic()
        call = self._attempt(self._routers.channel(address), None if left == float("inf") else max(left, 0.0))
        with self._lock:
            self._call, self._address = call, address
            self._tried[address] += 1
        if self._cancelled.is_set():
            self.cancel()

    def _after(self, error: grpc.RpcError) -> grpc.RpcError | None:
        """Start the next attempt (None) or say how the call ends."""
        code, address = error.code(), self._address
        hint = retry_hint(error)
        self._history.append(f"{address}: {code.name}" + (f" (retry after {hint:g}s)" if hint is not None else ""))
        if self._cancelled.is_set() or self._routers.closed:
            return error  # the caller cancelled, or closed the client: that is how the call ends
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):  # down, or shutting down
            self._routers.failed(address, self._policy.max_backoff)
        if self._messages:  # committed: resumed on another router, or fails saying where it stopped
            if not (code in self._policy.codes or _stream_reset(error)):
                return error
            if self._stream is not None and self._stream.complete:
                return _COMPLETE
            why = self._stream.why_not() if self._stream is not None else "not a Generate call"
            if why is not None or len(self._history) >= self._policy.max_attempts:
                return self._stopped(error, why or f"{len(self._history)} attempts, maxAttempts of the retry policy")
            return self._resume(error)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._refused is not None:
            # the deadline cut a retry short: that is how it ended, and the details say
            # why it was retried
            return CallFailed(code, f"deadline passed during attempt {len(self._history)}, a retry after: "
                              f"{self._refused.details()} [attempts: {_summary(self._history)}]", error)
        if code not in self._policy.codes:
            return error if len(self._history) == 1 else self._gave_up(error, f"{code.name} is not retried")
        if len(self._history) >= self._policy.max_attempts:
            return self._gave_up(error, f"{len(self._history)} attempts, maxAttempts of the retry policy")
        if hint is not None:
            self._wait_until[address] = time.monotonic() + hint
        self._refused = error
        return self._retry(error)

    def _resume(self, error: grpc.RpcError) -> grpc.RpcError | None:
        """Continue the stream on another router from what arrived (the module docstring)."""
        stream = self._stream
        assert stream is not None
        stream.resume()
        self.resumptions += 1
        log.info("call %s: %s from %s after %d tokens; resuming it on another router (resumption %d)",
                 stream.request.request_id, error.code().name, self._address, stream.tokens(), self.resumptions)
        if self._on_resume is not None:
            self._on_resume()
        self._refused = error
        return self._retry(error)

    def _retry(self, error: grpc.RpcError) -> grpc.RpcError | None:
        retry = len(self._history)
        if time.monotonic() >= self._deadline:
            # the refusal came (or was read, on a loaded machine) after the deadline: the
            # deadline is what ends the call, not the refusal
            return CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed during attempt {retry}: "
                              f"{error.details()} [attempts: {_summary(self._history)}]", error)
        nxt = self._routers.choose(self._start, self._tried, self._wait_until)
        # A router this call has not tried yet is asked at once (it is another process,
        # with its own load: backing off protects the one that failed, not it).
        backoff = self._policy.backoff(retry, self._rng) if self._tried[nxt] else 0.0
        wait = max(backoff, self._wait_until.get(nxt, 0.0) - time.monotonic())
        if time.monotonic() + wait >= self._deadline:
            return self._gave_up(error, f"the deadline leaves no time to wait {wait:.2f}s for attempt {retry + 1}")
        if self._cancelled.wait(wait):
            return CallFailed(grpc.StatusCode.CANCELLED, "cancelled by the caller while waiting to retry "
                              f"({_summary(self._history)})", error)
        self._begin(nxt)
        return None

    def _gave_up(self, error: grpc.RpcError, why: str) -> CallFailed:
        return CallFailed(error.code(), f"{error.details()} [gave up: {why}; attempts: {_summary(self._history)}]",
                          error)

    def _stopped(self, error: grpc.RpcError, why: str) -> CallFailed:
        """After messages arrived the call is never replayed; when it cannot be resumed
        either, say where it stopped and why."""
        per_sequence = ", ".join(f"sequence {i}: {n}" for i, n in sorted(self._tokens.items()))
        return CallFailed(error.code(), f"{error.details()} [the stream stopped after {self._messages} messages, "
                          f"{sum(self._tokens.values())} tokens received ({per_sequence}) from {self._address}; "
                          f"not resumed: {why}; attempts: {_summary(self._history)}]", error)


class _Complete(grpc.RpcError):
    """How a call whose every final message arrived ends when only its close was lost."""


_COMPLETE = _Complete()


def _stream_reset(error: grpc.RpcError) -> bool:
    """A broken HTTP/2 stream (the router's connection died mid-call): gRPC says INTERNAL."""
    return error.code() == grpc.StatusCode.INTERNAL and "RST_STREAM" in (error.details() or "")


def _summary(history: list[str]) -> str:
    """The attempts, repeats folded: "a: UNAVAILABLE x3; b: RESOURCE_EXHAUSTED"."""
    runs = [(h, len(list(g))) for h, g in itertools.groupby(history)]
    return "; ".join(h if n == 1 else f"{h} x{n}" for h, n in runs)


class Client:
    """`address`: a router "host:port", several (a list, or comma-separated), or a DNS
    name whose every address is a router (`lookup`; again every `resolve_every`
    seconds). Calls retry per `retry` (default: the published service config) on
    another router, within `timeout` (the whole call's deadline, retries included).
    `api_key`: sent as `authorization: Bearer <key>` on every call. `tls_ca`: a CA
    certificate file (PEM): the router is reached over TLS and must show a certificate
    that CA signed (`tls_server_name`: the name it carries, if not the host dialed)."""

    def __init__(self, address: str | Sequence[str], timeout: float | None = 600.0, *, api_key: str | None = None,
                 tls_ca: str | None = None, tls_server_name: str | None = None, retry: RetryPolicy | None = None,
                 resolve_every: float = 30.0, lookup: Lookup = lookup, seed: int | None = None) -> None:
        self.address = address if isinstance(address, str) else ",".join(address)
        self.timeout = timeout
        self.retry = retry or RetryPolicy.from_service_config()
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._rng = random.Random(seed)
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes()) if tls_ca else None

        def channel_of(target: str, dns_name: str | None) -> grpc.Channel:
            if credentials is None:
                return grpc.insecure_channel(target, options=with_keepalive([]))
            # an address resolved from a name still checks the certificate for that name
            name = tls_server_name or dns_name
            options = with_keepalive([("grpc.ssl_target_name_override", name)] if name else [])
            return grpc.secure_channel(target, credentials, options=options)

        self._routers = _Routers(address, channel_of, resolve_every, lookup)
        self._lock = threading.Lock()
        self.resumptions = 0  # calls of this client resumed on another router (each resumption)

    @property
    def addresses(self) -> list[str]:
        """The routers this client calls now."""
        return list(self._routers.addresses)

    @property
    def _channel(self) -> grpc.Channel:
        """The first router's channel (for tests that call a raw stub)."""
        return self._routers.first_channel()

    def generate(
        self, prompt: str | Sequence[int], *, request_id: str = "", model: str = "", cache_salt: str = "",
        timeout: float | None = None, **sampling: object,
    ) -> RetryingCall:
        """Stream the completion; the call is an iterator of GenerateResponse."""
        request = pb.GenerateRequest(request_id=request_id, model=model, sampling=options_from_kwargs(**sampling),
                                     cache_salt=cache_salt, resumable=True)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        stream = _Resumable(request, self._metadata)
        self._routers.refresh()
        return RetryingCall(stream.attempt, self._routers, self.retry, timeout or self.timeout, self._rng, stream,
                            self._resumed)

    def _resumed(self) -> None:
        with self._lock:
            self.resumptions += 1

    def list_models(self, timeout: float = 10.0) -> list[pb.ModelInfo]:
        def attempt(channel: grpc.Channel, left: float | None) -> Iterator:
            yield pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=left,
                                                             metadata=self._metadata)

        return list(next(self._call(attempt, timeout)).models)

    def _call(self, attempt: Attempt, timeout: float | None) -> RetryingCall:
        self._routers.refresh()
        return RetryingCall(attempt, self._routers, self.retry, timeout, self._rng)

    def close(self) -> None:
        self._routers.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def collect(messages) -> dict[int, pb.GenerateResponse]:
    """Fold a stream into one message per sequence: all text and tokens, and the
    last message's finish reason, usage, timing."""
    out: dict[int, pb.GenerateResponse] = {}
    for m in messages:
        acc = out.setdefault(m.index, pb.GenerateResponse(request_id=m.request_id, index=m.index))
        acc.text += m.text
        acc.token_ids.extend(m.token_ids)
        acc.logprobs.extend(m.logprobs)
        if m.finish_reason:
            acc.finish_reason = m.finish_reason
            acc.usage.CopyFrom(m.usage)
            acc.timing.CopyFrom(m.timing)
            if m.HasField("cumulative_logprob"):
                acc.cumulative_logprob = m.cumulative_logprob
            acc.prompt_logprobs.extend(m.prompt_logprobs)
    return out
