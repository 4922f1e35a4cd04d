"""The front end's blocking Generations, seen from the event loop.

    runs = await Runs.admit(front_end, pool, [Request, ...])   # validate + admit, on the pool
    async for prompt_index, output in runs:                     # every prompt's outputs, as they come
        ...
    runs.cancel()    # the client is gone: every Generation ends at once, its workers abort

Each request gets one thread from `pool` for its whole life: it calls
`front_end.generate` (validation, admission), hands the Generation to the loop,
then iterates it (blocking on the workers), handing each output to the loop with
`call_soon_threadsafe`, and closes it, from the thread that iterated it
(frontend.py's rule). One thread, not one for admission and another for the
outputs: every hop between a thread and the loop waits for the GIL, and the first
token's hops are what a client's TTFT adds over gRPC. `cancel` (from the loop)
makes a pending `next` return at once. A failure of one prompt's Generation
cancels the others and is raised by the iteration as its ServeError. The pool is
sized by the caller so that every admission slot and queue place has a thread (the
router: the same count as gRPC's).
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
    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self.generations: list[Generation] = []
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self._left = count

    @classmethod
    async def admit(cls, front_end: FrontEnd, pool: Executor, requests: Sequence[Request]) -> Runs:
        """Admit every request (each validated and given a slot by the front end), or
        none: the first refusal cancels those admitted and is raised (ServeError)."""
        loop = asyncio.get_running_loop()
        runs = cls(loop, len(requests))
        admitted = [loop.create_future() for _ in requests]
        for index, (request, future) in enumerate(zip(requests, admitted)):
            pool.submit(runs._run, index, front_end, request, future)
        results = await asyncio.gather(*admitted, return_exceptions=True)
        generations = [r for r in results if isinstance(r, Generation)]
        failed = [r for r in results if not isinstance(r, Generation)]
        if failed:
            for generation in generations:
                generation.cancel()  # its thread ends the iteration and closes it
            error = failed[0]
            raise error if isinstance(error, ServeError) else ServeError(Status.INTERNAL, f"router: {error!r}")
        runs.generations = generations
        return runs

    def cancel(self) -> None:
        """The client is gone: every Generation ends (thread-safe, idempotent)."""
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

    def _run(self, index: int, front_end: FrontEnd, request: Request, admitted: asyncio.Future) -> None:
        """One request's thread: admission, then its outputs (see the module docstring)."""
        try:
            generation = front_end.generate(request)
        except BaseException as e:
            self._call(lambda error=e: admitted.cancelled() or admitted.set_exception(error))  # `e` dies with the block
            return

        def hand_over() -> None:
            if admitted.cancelled():  # the handler is gone already: nobody will read
                generation.cancel()
            else:
                admitted.set_result(generation)

        self._call(hand_over)
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
        self._call(lambda: self._queue.put_nowait((index, item)))

    def _call(self, callback: object) -> None:
        try:
            self._loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed (the server stopped): nobody is listening
            pass
