"""A closed-loop load of streaming clients over real gRPC, for the load and chaos tests.

    summary = run_clients(router_address, LoadConfig(clients=200, duration=60.0), vocab_size=4096)
    print(summary.table())
    assert not summary.problems()

    run_clients([router_a, router_b], cfg, vocab)   # several routers (the retrying Client)

Each of `clients` threads loops until `duration` has passed: it picks a request kind
from `LoadConfig.mix` (seeded per thread), sends one streaming Generate with a
deadline, reads the stream to its end (or cancels it), records the outcome, and
starts the next. Kinds:

  short    a prompt below the router's local-prefill threshold (prefills on the decode worker)
  long     a prompt above it (prefills on a prefill worker, its KV crosses)
  n        parallel sampling, n > 1
  beam     beam search (beam_width > 1, n > 1)
  cancel   the client cancels the call after its first `cancel_after` tokens
  tiny     a deadline of 10 ms to 2 s (log-uniform): it expires before dispatch, or
           during the prefill, the KV transfer or the decode

A share of the prompts (`shared_prefix_fraction`) starts with one of a few common
prefixes (whole blocks), so cached blocks are shared, hit, evicted and freed by many
requests at once. Every call carries a deadline; a record says whether the call outlived it by more
than `LoadConfig.slack` (a hang). A call that ends with status OK must have ended
every sequence it asked for (n of them) with a finish reason and have received
exactly max_tokens tokens for each (every request sets ignore_eos), else its code is
INCOMPLETE. `Summary.problems()` lists every outcome outside `allowed` (by default:
OK for every kind, CANCELLED for cancels, DEADLINE_EXCEEDED for tiny deadlines,
RESOURCE_EXHAUSTED, the router's admission limit, for any) and every overrun.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.bench.serving.backend import InFlight
from pdserve.bench.serving.workloads import random_ids
from pdserve.services.router.client import Client

KINDS = ("short", "long", "n", "beam", "cancel", "tiny")
INCOMPLETE = "INCOMPLETE"  # status OK, but a sequence without its finish reason or max_tokens tokens
EVERY_KIND = frozenset({"OK", "RESOURCE_EXHAUSTED"})
ALLOWED: Mapping[str, frozenset[str]] = {
    "short": EVERY_KIND, "long": EVERY_KIND, "n": EVERY_KIND, "beam": EVERY_KIND,
    "cancel": EVERY_KIND | {"CANCELLED"}, "tiny": EVERY_KIND | {"DEADLINE_EXCEEDED"},
}


@dataclass(frozen=True)
class LoadConfig:
    clients: int = 200
    duration: float = 60.0  # seconds each client keeps starting requests
    # relative weights of the kinds (a kind not named is never sent)
    mix: tuple[tuple[str, float], ...] = (("short", 4), ("long", 3), ("n", 1), ("beam", 1), ("cancel", 1),
                                          ("tiny", 1))
    short_prompt: tuple[int, int] = (4, 48)  # prompt tokens, inclusive
    long_prompt: tuple[int, int] = (80, 320)
    max_tokens: tuple[int, int] = (2, 12)
    n: tuple[int, int] = (2, 3)  # for the n kind
    beam_width: tuple[int, int] = (2, 3)  # for the beam kind (n = 2)
    cancel_after: tuple[int, int] = (1, 3)  # tokens read before cancelling
    cancel_max_tokens: int = 64  # long enough that the cancel lands mid-stream
    shared_prefixes: int = 4
    shared_prefix_tokens: int = 48  # 3 blocks of 16
    shared_prefix_fraction: float = 0.3
    deadline: float = 60.0  # seconds, every kind but tiny
    # seconds, log-uniform: from before the router dispatches to mid-prefill, mid-transfer, mid-decode
    tiny_deadline: tuple[float, float] = (0.01, 2.0)
    slack: float = 2.0  # a call that outlives its deadline by more is a hang
    # seconds a client waits (x0.5-1.5, jittered) after UNAVAILABLE or RESOURCE_EXHAUSTED
    # before its next request, as a real client backs off; 0: at once
    retry_backoff: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name, weight in self.mix:
            if name not in KINDS:
                raise ValueError(f"mix: unknown kind {name!r} (one of {KINDS})")
            if not weight >= 0:
                raise ValueError(f"mix: weight of {name!r} must be >= 0, got {weight}")
        if not sum(w for _, w in self.mix) > 0:
            raise ValueError("mix: needs a positive weight")
        if self.clients < 1:
            raise ValueError(f"clients: must be >= 1, got {self.clients}")
        if not self.duration > 0:
            raise ValueError(f"duration: must be > 0, got {self.duration}")
        for name in ("short_prompt", "long_prompt", "max_tokens", "n", "beam_width", "cancel_after"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: needs 1 <= MIN <= MAX, got {lo} {hi}")
        if not 0 <= self.shared_prefix_fraction <= 1:
            raise ValueError(f"shared_prefix_fraction: must be in [0, 1], got {self.shared_prefix_fraction}")
        if self.shared_prefixes < 1 or self.shared_prefix_tokens < 1:
            raise ValueError(f"shared_prefixes, shared_prefix_tokens: must be >= 1, got {self.shared_prefixes}, "
                             f"{self.shared_prefix_tokens}")
        if not 0 < self.tiny_deadline[0] <= self.tiny_deadline[1]:
            raise ValueError(f"tiny_deadline: needs 0 < MIN <= MAX, got {self.tiny_deadline}")


@dataclass(frozen=True)
class Record:
    """One request as its client saw it (times: time.monotonic())."""

    kind: str
    client: int
    started: float
    ended: float
    deadline: float  # seconds
    code: str  # a grpc.StatusCode name, or INCOMPLETE
    details: str
    tokens: int  # token ids received, all sequences
    sequences: int  # sequences asked for
    finished: int  # sequences that ended with a finish reason
    router: str = ""  # the router its last attempt went to (a retried call may have tried others)
    resumptions: int = 0  # times its stream was resumed on another router after tokens arrived

    @property
    def overran(self) -> float:
        """Seconds the call lasted past its deadline (negative: it ended in time)."""
        return self.ended - self.started - self.deadline


@dataclass(frozen=True)
class Request:
    kind: str
    prompt: tuple[int, ...]
    sampling: dict = field(hash=False)
    deadline: float
    cancel_after: int = 0  # > 0: cancel after this many tokens


def shared_prefixes(cfg: LoadConfig, vocab_size: int) -> list[tuple[int, ...]]:
    rng = random.Random(cfg.seed)
    return [random_ids(cfg.shared_prefix_tokens, vocab_size, rng) for _ in range(cfg.shared_prefixes)]


def make_request(cfg: LoadConfig, kind: str, rng: random.Random, vocab_size: int,
                 prefixes: Sequence[tuple[int, ...]] = ()) -> Request:
    """One request of `kind`; its prompt starts with one of `prefixes` in a
    `cfg.shared_prefix_fraction` share of requests (its length range still holds)."""
    prompt_range = cfg.long_prompt if kind == "long" else cfg.short_prompt
    length = rng.randint(*prompt_range)
    head: tuple[int, ...] = ()
    if prefixes and rng.random() < cfg.shared_prefix_fraction:
        head = rng.choice(prefixes)[:length - 1]
    prompt = head + random_ids(length - len(head), vocab_size, rng)
    sampling: dict = dict(max_tokens=rng.randint(*cfg.max_tokens), temperature=0.0, ignore_eos=True)
    deadline, cancel_after = cfg.deadline, 0
    if kind == "n":
        sampling.update(n=rng.randint(*cfg.n), temperature=0.8, seed=rng.randrange(1 << 30))
    elif kind == "beam":
        sampling.update(beam_width=rng.randint(*cfg.beam_width), n=2)
    elif kind == "cancel":
        sampling.update(max_tokens=cfg.cancel_max_tokens)
        cancel_after = rng.randint(*cfg.cancel_after)
    elif kind == "tiny":
        lo, hi = cfg.tiny_deadline
        deadline = lo * (hi / lo) ** rng.random()
    return Request(kind, prompt, sampling, deadline, cancel_after)


def run_one(client: Client, request: Request, index: int, inflight: InFlight) -> Record:
    """Send one request, read its stream to the end (or cancel it); never raises for
    an RPC failure."""
    started = time.monotonic()
    sequences = request.sampling.get("n", 1)
    tokens, finished = 0, set()
    code, details = "OK", ""
    call = client.generate(request.prompt, timeout=request.deadline, **request.sampling)
    if not inflight.add(call):
        code, details = "CANCELLED", "load stopped"
    else:
        try:
            for message in call:
                tokens += len(message.token_ids)
                if message.finish_reason:
                    finished.add(message.index)
                if request.cancel_after and tokens >= request.cancel_after:
                    call.cancel()
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
        finally:
            inflight.discard(call)
    expected = sequences * request.sampling["max_tokens"]
    if code == "OK" and (len(finished) < sequences or tokens != expected):
        code, details = INCOMPLETE, f"{len(finished)}/{sequences} sequences finished, {tokens}/{expected} tokens"
    # RetryingCall keeps the address of its current attempt private; tests read it to
    # tell which router a call was on when that router went away
    return Record(request.kind, index, started, time.monotonic(), request.deadline, code, details, tokens,
                  sequences, len(finished), getattr(call, "_address", ""), getattr(call, "resumptions", 0))


@dataclass(frozen=True)
class Summary:
    records: tuple[Record, ...]
    slack: float
    allowed: Mapping[str, frozenset[str]] = field(default_factory=lambda: ALLOWED)

    def counts(self) -> Counter[tuple[str, str]]:
        return Counter((r.kind, r.code) for r in self.records)

    def overruns(self) -> list[Record]:
        return [r for r in self.records if r.overran > self.slack]

    def unexpected(self) -> list[Record]:
        return [r for r in self.records if r.code not in self.allowed.get(r.kind, EVERY_KIND)]

    def problems(self) -> list[str]:
        """Every outcome outside `allowed`, and every call that outlived its deadline +
        slack, grouped (one line per kind, code and first details)."""
        lines = Counter(f"{r.kind}: {r.code}: {r.details[:160]}" for r in self.unexpected())
        out = [f"x{count} {line}" for line, count in sorted(lines.items())]
        overruns = self.overruns()
        if overruns:
            worst = max(overruns, key=lambda r: r.overran)
            out.append(f"{len(overruns)} calls outlived their deadline by > {self.slack}s; worst: {worst.kind} "
                       f"{worst.code} {worst.overran:.2f}s past a {worst.deadline:.2f}s deadline")
        return out

    def table(self) -> str:
        """Requests by kind (rows) and final status (columns), then latency by kind."""
        counts = self.counts()
        codes = sorted({c for _, c in counts}, key=lambda c: (c != "OK", c))
        width = max([6, *(len(c) + 2 for c in codes)])
        lines = [f"{'kind':<8}" + "".join(f"{c:>{width}}" for c in codes) + f"{'total':>8}"]
        for kind in [k for k in KINDS if any(key[0] == k for key in counts)]:
            row = [counts[kind, c] for c in codes]
            lines.append(f"{kind:<8}" + "".join(f"{v:>{width}}" for v in row) + f"{sum(row):>8}")
        totals = [sum(counts[k, c] for k in KINDS) for c in codes]
        lines.append(f"{'total':<8}" + "".join(f"{v:>{width}}" for v in totals) + f"{sum(totals):>8}")
        lines.append(f"{'kind':<8}{'p50 s':>10}{'p99 s':>10}{'max s':>10}{'tokens':>10}")
        for kind in KINDS:
            times = sorted(r.ended - r.started for r in self.records if r.kind == kind)
            if times:
                tokens = sum(r.tokens for r in self.records if r.kind == kind)
                lines.append(f"{kind:<8}{times[len(times) // 2]:>10.2f}{times[min(len(times) - 1, int(len(times) * 0.99))]:>10.2f}"
                             f"{times[-1]:>10.2f}{tokens:>10}")
        return "\n".join(lines)


def run_clients(address: str | Sequence[str], cfg: LoadConfig, vocab_size: int,
                stop: threading.Event | None = None, channels: int = 8,
                finish: threading.Event | None = None) -> Summary:
    """`cfg.clients` threads sending requests until `cfg.duration` has passed, or
    `finish` is set (calls in flight run to their end), or `stop` is set (calls in
    flight are cancelled); returns every request's record once every thread has
    ended. `address`: a router, or several (a list or "a:1,b:2"): each client is the
    retrying Client over all of them. The threads share `channels` Clients (each a
    gRPC channel per router)."""
    stop = stop or threading.Event()
    finish = finish or threading.Event()
    inflight = InFlight()
    records: list[Record] = []
    lock = threading.Lock()
    clients = [Client(address, timeout=cfg.deadline) for _ in range(max(1, min(channels, cfg.clients)))]
    kinds, weights = zip(*cfg.mix)
    prefixes = shared_prefixes(cfg, vocab_size)
    end = time.monotonic() + cfg.duration

    def loop(index: int) -> None:
        rng = random.Random(cfg.seed * 100003 + index)
        client = clients[index % len(clients)]
        while time.monotonic() < end and not stop.is_set() and not finish.is_set():
            kind = rng.choices(kinds, weights)[0]
            record = run_one(client, make_request(cfg, kind, rng, vocab_size, prefixes), index, inflight)
            with lock:
                records.append(record)
            if cfg.retry_backoff and record.code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
                stop.wait(cfg.retry_backoff * rng.uniform(0.5, 1.5))

    threads = [threading.Thread(target=loop, args=(i,), name=f"load-{i}", daemon=True) for i in range(cfg.clients)]
    # every call has a deadline: a thread ends at most one deadline (+ slack) after `end`
    give_up = end + cfg.deadline + cfg.slack + 5.0
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
            if stop.wait(0.2):
                inflight.close()  # calls in flight are cancelled, new ones too
        stuck = sum(t.is_alive() for t in threads)
    finally:
        inflight.close()
        stop.set()
    for t in threads:
        t.join(5.0)
    for c in clients:
        c.close()
    if stuck:
        raise TimeoutError(f"{stuck} client threads still in a call {cfg.deadline + cfg.slack + 5.0}s after the load "
                           "ended, though every call has a deadline")
    return Summary(tuple(records), cfg.slack)
