"""A discrete-event simulator of a pdserve cluster, driven by a profile (profile.py):
what TTFT, TPOT and ITL a traffic would see on a given split of workers.

    requests (arrival, prompt and output lengths, prefix blocks)
        |  Router: decode worker = fewest requests (running + waiting), the one with
        |  the longest cached prefix first; the prompt crosses from a prefill worker
        |  when there is one and its uncached part is >= local_prefill_threshold, and
        |  the decode worker can reserve its blocks (else it prefills there itself)
        v
    Worker (each one an engine stepping, as engine/scheduler.py schedules):
        running first, oldest first, one token each (or their next prefill chunk),
        then waiting requests in arrival order while the token budget, the sequence
        slots and the blocks allow; no block for a running one: the youngest is
        preempted and recomputed later
        a step's time: decode_seconds(batch, mean context) for a pure decode step,
        prefill_seconds(chunk tokens + decodes, cached) and what the decodes add to
        one decode step for a step with prefill
    prefill worker: a prompt done -> its first token (TTFT) -> its KV blocks cross
        (transfer_seconds) -> the decode worker (blocks reserved at dispatch) decodes
        the rest
    mixed / decode worker with a local prompt: prefill and decode in the same steps

Tokens are emitted at the end of the step that makes them. Prefix caching: a worker
keeps every prefix (of `block_tokens`-token blocks, by their hash ids) it prefilled; a
request's cached tokens are its longest kept prefix (not its whole prompt: the last
token is always computed). The serving path's own cost (router, gRPC streams, the
worker's loop) comes from the profile where it was measured (`pdserve profile
--serving`): a delay before each request reaches a worker (and, for a prompt that
crosses, the reservation and the prefill call), time added to every step by its batch
size, and a factor on prefill steps (a serving worker's against the engine alone). Not modelled: the router's CPU competing with the workers',
speculative decoding, KV tiers, migrations, a worker's memory other than its blocks.

    Simulation(profile, Shape(prefill=1, decode=1), Limits(...)).run(requests) -> [Outcome]
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.planner.profile import Profile
from pdserve.services.common.quantiles import percentile


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds
    prompt: int  # tokens
    output: int  # tokens (>= 1)
    hash_ids: tuple[int, ...] = ()  # the prompt's leading blocks, for prefix sharing
    block_tokens: int = 16  # tokens a hash id stands for


@dataclass(frozen=True)
class Shape:
    """A split of workers and the router's knob that decides where prompts prefill."""

    prefill: int = 0
    decode: int = 0
    mixed: int = 1
    local_prefill_threshold: int = 64

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.mixed) < 0:
            raise ValueError(f"shape: worker counts must be >= 0, got {self}")
        if self.decode + self.mixed < 1:
            raise ValueError("shape: at least one decode or mixed worker")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.mixed

    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D+{self.mixed}M"


@dataclass(frozen=True)
class Limits:
    """One worker's engine limits (the workers' flags)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    num_blocks: int = 4096
    block_size: int = 16

    @classmethod
    def of(cls, profile: Profile) -> "Limits":
        flags, source = profile.source.get("flags", {}), profile.source
        return cls(flags.get("max_num_batched_tokens") or 2048, flags.get("max_num_seqs") or 256,
                   source.get("num_blocks") or 4096, source.get("block_size") or 16)


@dataclass
class Outcome:
    request: SimRequest
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    path: str = "local"  # local | remote | fallback (meant to cross; the decode worker could not reserve)

    @property
    def ttft(self) -> float:
        return (self.first_token or math.inf) - self.request.arrival

    @property
    def tpot(self) -> float:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.request.output


class _Seq:
    """A request on one worker: how far its KV is computed, what it still needs."""

    def __init__(self, outcome: Outcome, order: int, prompt: int, cached: int, to_emit: int, given: int = 0) -> None:
        self.outcome, self.order = outcome, order
        self.prompt = prompt  # tokens to prefill (a recompute: prompt + tokens made)
        self.computed = cached
        self.to_emit = to_emit  # tokens this worker emits (a prefill worker: the first only)
        self.emitted = given  # tokens already emitted elsewhere (remote prefill's first token)
        self.blocks = 0

    def need(self) -> int:
        """Tokens this step would compute: its prefill's rest, or one decode token."""
        return self.prompt - self.computed if self.computed < self.prompt else 1


class _Worker:
    def __init__(self, sim: "Simulation", name: str, role: str) -> None:
        self.sim, self.name, self.role = sim, name, role
        self.limits = sim.limits
        self.free_blocks = sim.limits.num_blocks
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self.prefixes: set[tuple[int, ...]] = set()
        self.queued_tokens = 0  # prompt tokens waiting or in prefill (the router's view)

    # -- the router's view --------------------------------------------------------------

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def cached(self, request: SimRequest) -> int:
        """Tokens of `request`'s prompt this worker has cached (its longest kept prefix)."""
        ids = request.hash_ids
        for k in range(len(ids), 0, -1):
            if ids[:k] in self.prefixes:
                return min(k * request.block_tokens, request.prompt - 1) // self.limits.block_size * \
                    self.limits.block_size
        return 0

    # -- work ---------------------------------------------------------------------------

    def add(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.queued_tokens += seq.prompt - seq.computed
        self.kick()

    def reserve(self, tokens: int) -> bool:
        need = -(-tokens // self.limits.block_size)
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        return True

    def receive(self, seq: _Seq, reserved_tokens: int) -> None:
        """A remotely prefilled request: its reserved blocks become its KV."""
        seq.blocks = -(-reserved_tokens // self.limits.block_size)
        self.running.append(seq)
        self.running.sort(key=lambda s: s.order)
        self.kick()

    def kick(self) -> None:
        if not self.busy and (self.running or self.waiting):
            self._step()

    def _grow(self, seq: _Seq, tokens: int) -> bool:
        need = -(-tokens // self.limits.block_size) - seq.blocks
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        seq.blocks += need
        return True

    def _free(self, seq: _Seq) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def _step(self) -> None:
        lim = self.limits
        budget = lim.max_num_batched_tokens
        batch: list[tuple[_Seq, int]] = []
        for seq in list(self.running):  # oldest first
            if seq not in self.running:  # preempted below for an older one
                continue
            n = min(seq.need(), budget)
            if n <= 0:
                break
            while not self._grow(seq, seq.computed + n):
                victim = self.running[-1]
                self.running.remove(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < lim.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.need(), budget)
            if not self._grow(seq, seq.computed + n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        if not batch:
            return
        self.busy = True
        self.sim.at(self.sim.now + self.sim.step_seconds(batch), self._done, batch)

    def _preempt(self, seq: _Seq) -> None:
        """Recompute later: its blocks freed, its prompt now all it has computed."""
        self._free(seq)
        seq.outcome.preemptions += 1
        seq.prompt, seq.computed = max(seq.prompt, seq.computed), 0
        self.queued_tokens += seq.prompt
        # back among the waiting by age
        index = next((i for i, w in enumerate(self.waiting) if w.order > seq.order), len(self.waiting))
        self.waiting.insert(index, seq)

    def _done(self, batch: list[tuple[_Seq, int]]) -> None:
        now = self.sim.now
        self.busy = False
        for seq, n in batch:
            prefilling = seq.computed < seq.prompt
            seq.computed += n
            if prefilling:
                self.queued_tokens -= n
            if seq.computed < seq.prompt:
                continue  # more of its prompt next step
            self._emit(seq, now)  # a prefill's end samples a token, as a decode step does
        self.kick()

    def _emit(self, seq: _Seq, now: float) -> None:
        outcome = seq.outcome
        if outcome.first_token is None:
            outcome.first_token = now
            ids = outcome.request.hash_ids
            self.prefixes.update(ids[:k] for k in range(1, len(ids) + 1))
        outcome.token_times.append(now)
        seq.emitted += 1
        if self.role == "prefill":  # the first token made: the KV goes to the decode worker
            self.running.remove(seq)
            self._free(seq)
            self.sim.transfer(seq)
        elif seq.emitted >= seq.to_emit:
            self.running.remove(seq)
            self._free(seq)


class Simulation:
    def __init__(self, profile: Profile, shape: Shape, limits: Limits | None = None) -> None:
        self.profile, self.shape = profile, shape
        self.limits = limits or Limits.of(profile)
        self.now = 0.0
        self._events: list[tuple[float, int, object, tuple]] = []
        self._ids = itertools.count()
        self.prefill = [_Worker(self, f"prefill-{i}", "prefill") for i in range(shape.prefill)]
        self.decode = [_Worker(self, f"decode-{i}", "decode") for i in range(shape.decode)] + [
            _Worker(self, f"mixed-{i}", "mixed") for i in range(shape.mixed)]
        self._remote: dict[int, tuple[_Worker, int]] = {}  # seq -> (decode worker, reserved tokens)

    def at(self, when: float, fn, *args) -> None:
        heapq.heappush(self._events, (when, next(self._ids), fn, args))

    def step_seconds(self, batch: Sequence[tuple[_Seq, int]]) -> float:
        """One step's time from the profile (the module docstring)."""
        decodes = [s for s, _ in batch if s.computed >= s.prompt]
        prefill_tokens = sum(n for s, n in batch if s.computed < s.prompt)
        context = sum(s.computed for s in decodes) / len(decodes) if decodes else 0
        serving = self.profile.step_overhead(len(batch))  # the worker's loop and streams (profile --serving)
        if not prefill_tokens:
            return self.profile.decode_seconds(len(decodes), context) + serving
        cached = max((s.computed for s, _ in batch if s.computed < s.prompt), default=0)
        seconds = self.profile.prefill_seconds(prefill_tokens + len(decodes), cached) * self.profile.prefill_factor()
        if decodes:  # what attending over the decodes' contexts adds to their tokens' own cost
            seconds += max(0.0, self.profile.decode_seconds(len(decodes), context) -
                           self.profile.prefill_seconds(len(decodes), 0))
        return seconds + serving

    def run(self, requests: Iterable[SimRequest]) -> list[Outcome]:
        outcomes = [Outcome(r) for r in sorted(requests, key=lambda r: r.arrival)]
        delay = self.profile.request_overhead()  # router and streams, first token (profile --serving)
        for order, outcome in enumerate(outcomes):
            self.at(outcome.request.arrival + delay, self._arrive, outcome, order)
        while self._events:
            when, _, fn, args = heapq.heappop(self._events)
            self.now = when
            fn(*args)
        return outcomes

    # -- the router ----------------------------------------------------------------------

    def _arrive(self, outcome: Outcome, order: int) -> None:
        r = outcome.request
        decode = min(self.decode, key=lambda w: (-w.cached(r), w.load))
        cached = decode.cached(r)
        if self.prefill and decode.role == "decode" and r.prompt - cached >= self.shape.local_prefill_threshold:
            if decode.reserve(r.prompt + 1):
                prefill = min(self.prefill, key=lambda w: (w.queued_tokens - w.cached(r), w.load))
                seq = _Seq(outcome, order, r.prompt, prefill.cached(r), to_emit=1)
                self._remote[id(seq)] = (decode, r.prompt + 1)
                outcome.path = "remote"
                # the reservation and the prefill call (profile --serving), before P queues it
                self.at(self.now + self.profile.remote_overhead(), prefill.add, seq)
                return
            outcome.path = "fallback"
        decode.add(_Seq(outcome, order, r.prompt, cached, to_emit=r.output))

    def transfer(self, seq: _Seq) -> None:
        """A prefilled prompt's KV crosses to its decode worker, which decodes the rest."""
        decode, reserved = self._remote.pop(id(seq))
        r = seq.outcome.request
        if r.output <= 1:
            decode.free_blocks += -(-reserved // self.limits.block_size)
            return
        blocks = -(-r.prompt // self.limits.block_size)
        moved = _Seq(seq.outcome, seq.order, r.prompt, r.prompt, to_emit=r.output, given=1)
        decode.prefixes.update(r.hash_ids[:k] for k in range(1, len(r.hash_ids) + 1))
        self.at(self.now + self.profile.transfer_seconds(blocks), decode.receive, moved, reserved)


# -- traffic -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Arrivals and lengths: Poisson at `rate` (or bursty: gamma inter-arrival times of
    coefficient of variation `burstiness`), lengths uniform in their ranges."""

    rate: float
    requests: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate: must be a positive number of requests per second, got {self.rate}")
        if self.requests < 1:
            raise ValueError(f"requests: must be at least 1, got {self.requests}")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: must be 1 <= low <= high, got {lo}-{hi}")
        if self.burstiness <= 0:
            raise ValueError(f"burstiness: must be > 0, got {self.burstiness}")

    def draw(self) -> list[SimRequest]:
        rng = random.Random(self.seed)
        shape = 1.0 / self.burstiness ** 2
        t, out = 0.0, []
        for _ in range(self.requests):
            t += rng.gammavariate(shape, 1.0 / (self.rate * shape))
            out.append(SimRequest(t, rng.randint(*self.input_len), rng.randint(*self.output_len)))
        return out


# -- figures -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float
    itl_p50: float
    goodput: float  # requests per second that met both SLOs
    met: float  # share of requests that met both SLOs
    duration: float


def figures(outcomes: Sequence[Outcome], slo_ttft: float = math.inf, slo_tpot: float = math.inf) -> Figures:
    ttfts = [o.ttft for o in outcomes]
    tpots = [o.tpot for o in outcomes if len(o.token_times) > 1]
    itls = [x for o in outcomes for x in o.itls]
    good = sum(o.ttft <= slo_ttft and o.tpot <= slo_tpot for o in outcomes)
    start = min(o.request.arrival for o in outcomes)
    end = max((o.token_times[-1] for o in outcomes if o.token_times), default=start)
    duration = max(end - start, 1e-9)
    return Figures(percentile(ttfts, 50), percentile(ttfts, 90), percentile(tpots, 50), percentile(tpots, 90),
                   percentile(itls, 50), good / duration, good / len(outcomes), duration)
