"""The front end's blocking Generations, seen from the event loop.

    runs = await Runs.admit(front_end, pool, [Request, ...])   # validate + admit, on the pool
    async for prompt_index, output in runs:                     # every prompt's outputs, as they come
        ...
    runs.cancel()    # the client is gone: every Generation ends at once, its workers abort

Each admitted Generation gets one pump thread from `pool`: it iterates the
Generation (blocking on the workers) and hands each output to the loop with
`call_soon_threadsafe`; it also closes the Generation, from the thread that iterated
it (frontend.py's rule). `cancel` (from the loop) makes a pending `next` return at
once. A failure of one prompt's Generation cancels the others and is raised by the
iteration as its ServeError. The pool is sized by the caller so that every
admission slot and queue place has a thread (the router: the same count as gRPC's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Executor

from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.frontend import FrontEnd, Generation
from pdserve.services.router.records import Request, SequenceOutput

log = logging.getLogger(__name__)
_DONE = object()


class Runs:
    def __init__(self, generations: list[Generation], pool: Executor, loop: asyncio.AbstractEventLoop) -> None:
        self.generations = generations
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._left = len(generations)
        self._cancelled = False
        for index, generation in enumerate(generations):
            pool.submit(self._pump, index, generation)

    @classmethod
    async def admit(cls, front_end: FrontEnd, pool: Executor, requests: Sequence[Request]) -> Runs:
        """Admit every request (each validated and given a slot by the front end), or
        none: the first refusal closes those admitted and is raised (ServeError)."""
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(loop.run_in_executor(pool, front_end.generate, r) for r in requests),
                                       return_exceptions=True)
        admitted = [r for r in results if isinstance(r, Generation)]
        failed = [r for r in results if not isinstance(r, Generation)]
        if failed:
            for generation in admitted:
                await loop.run_in_executor(pool, generation.close)
            error = failed[0]
            raise error if isinstance(error, ServeError) else ServeError(Status.INTERNAL, f"router: {error!r}")
        return cls(admitted, pool, loop)

    def cancel(self) -> None:
        """The client is gone: every Generation ends (thread-safe, idempotent)."""
        self._cancelled = True
        for generation in self.generations:
            generation.cancel()

    async def __aiter__(self) -> AsyncIterator[tuple[int, SequenceOutput]]:
        """(prompt index, output) until every Generation is over; ServeError on the
        first that fails (the others are cancelled). Cancelling the consumer (the
        client left) cancels them all."""
        try:
            while self._left:
                index, item = await self._queue.get()
                if item is _DONE:
                    self._left -= 1
                elif isinstance(item, BaseException):
                    self.cancel()
                    raise item
                else:
                    yield index, item
        finally:
            if self._left:
                self.cancel()

    def _pump(self, index: int, generation: Generation) -> None:
        try:
            with generation:
                for output in generation:
                    self._put(index, output)
        except ServeError as e:
            self._put(index, e)
        except BaseException as e:  # a fault of ours: the client gets a 500, the log the trace
            log.exception("request %s: unexpected error", generation.request_id)
            self._put(index, ServeError(Status.INTERNAL, f"router: internal error ({type(e).__name__})"))
        finally:
            self._put(index, _DONE)

    def _put(self, index: int, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, item))
        except RuntimeError:  # the loop is closed (the server stopped): nobody is listening
            pass
