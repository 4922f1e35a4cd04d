"""Compiling constraints off the engine step: a small thread pool, a deadline, a cache.

    check(constraint)   admission: refuse what is too large or too deep (ValueError naming the field)
    submit(constraint)  -> CompileJob: a future (shared by equal constraints) and a deadline
    the engine polls job.future each step; never waits for it while it has work

Cached: a bounded LRU of futures keyed by (backend, constraint.key, vocabulary
fingerprint), so equal constraints compile once, even while the first is still
compiling; a refused constraint's error is cached too (compiling is deterministic).

Threads, not processes: both libraries compile in native code and release the GIL
(measured on the embedded model's vocabulary: a Python loop on the engine thread kept
97 % of its pace beside a 0.14 s xgrammar compile, 93 % beside llguidance), and a
compiled grammar does not cross a process boundary cheaply. The cost: neither library
can cancel a compile, and a pathological one (a regex of ten bounded alternatives takes
xgrammar ~1 s, 150 of them ~14 s) keeps its thread to the end. A compile past its deadline fails its request, but its
thread runs to the end: a pool of `max_workers` threads bounds what such compiles
can take from the others (tests/engine/structured/test_compiler.py measures it).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from pdserve.engine.structured.backend import CompiledGrammar, GrammarBackend
from pdserve.engine.structured.params import StructuredOutputs

DEFAULT_CACHE_SIZE = 256
DEFAULT_WORKERS = 2


@dataclass(frozen=True)
class StructuredStats:
    """Counters since start (`EngineStats.structured_outputs`; metrics named in
    services/common/metrics.py: pdserve:structured_outputs_*)."""

    num_compiles: int = 0
    compile_seconds_total: float = 0.0
    cache_hits: int = 0
    requests: tuple[tuple[str, int], ...] = ()  # (constraint kind, requests)
    refusals: tuple[tuple[str, int], ...] = ()  # (reason: invalid | timeout | too_large | too_deep, requests)


@dataclass
class CompileJob:
    key: tuple[str, str, str]
    future: Future[CompiledGrammar]
    deadline: float  # time.monotonic()


@dataclass
class _Counters:
    num_compiles: int = 0
    compile_seconds: float = 0.0
    cache_hits: int = 0
    requests: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    new_times: list[float] = field(default_factory=list)  # not yet taken by the metrics


class GrammarCompiler:
    def __init__(
        self, backend: Callable[[], GrammarBackend], backend_name: str, fingerprint: str,
        timeout: float, max_bytes: int, max_depth: int, max_workers: int = DEFAULT_WORKERS,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """`backend`: builds the backend, on first use, on a pool thread (its library's
        import and vocabulary preparation never run on the step); `fingerprint`: the
        vocabulary's (Vocabulary.fingerprint), part of every cache key."""
        self._make_backend = backend
        self._backend: GrammarBackend | None = None
        self.backend_name = backend_name
        self._fingerprint = fingerprint
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # cache and counters: held briefly, also by the engine thread
        self._backend_lock = threading.Lock()  # building the backend: pool threads only
        self._cache: OrderedDict[tuple[str, str, str], Future[CompiledGrammar]] = OrderedDict()
        self._counters = _Counters()

    def check(self, constraint: StructuredOutputs) -> None:
        """Refuse, before any compiling, a constraint over this server's limits."""
        name = f"structured_outputs.{constraint.kind.value}"
        size = constraint.size_bytes
        if size > self.max_bytes:
            self.refused("too_large")
            raise ValueError(f"{name}: {size} bytes, more than structured_outputs_max_bytes={self.max_bytes}")
        depth = constraint.nesting_depth()
        if depth > self.max_depth:
            self.refused("too_deep")
            raise ValueError(f"{name}: nested {depth} deep, more than structured_outputs_max_depth={self.max_depth}")

    def submit(self, constraint: StructuredOutputs) -> CompileJob:
        """Start compiling (or share the cached or running compile); counts the request."""
        key = (self.backend_name, constraint.key, self._fingerprint)
        with self._lock:
            self._counters.requests[constraint.kind.value] += 1
            future = self._cache.get(key)
            if future is not None:
                self._counters.cache_hits += 1
                self._cache.move_to_end(key)
            else:
                future = self._pool.submit(self._compile, constraint)
                self._cache[key] = future
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return CompileJob(key, future, time.monotonic() + self.timeout)

    def refused(self, reason: str) -> None:
        with self._lock:
            self._counters.refusals[reason] += 1

    def _compile(self, constraint: StructuredOutputs) -> CompiledGrammar:
        backend = self._get_backend()
        started = time.perf_counter()
        try:
            return backend.compile(constraint)
        finally:
            seconds = time.perf_counter() - started
            with self._lock:
                self._counters.num_compiles += 1
                self._counters.compile_seconds += seconds
                self._counters.new_times.append(seconds)
                del self._counters.new_times[:-1024]  # unread by any metrics: keep the last ones

    def _get_backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def take_compile_times(self) -> list[float]:
        """Seconds of each compile since the last call (a histogram's observations)."""
        with self._lock:
            times, self._counters.new_times = self._counters.new_times, []
        return times

    def stats(self) -> StructuredStats:
        with self._lock:
            c = self._counters
            return StructuredStats(c.num_compiles, c.compile_seconds, c.cache_hits,
                                   tuple(sorted(c.requests.items())), tuple(sorted(c.refusals.items())))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
