"""Fan-out: an n > 1 request whose decode worker failed mid-stream continues sample
by sample.

    request (n = 3)        sample 0 ended ("stop") before the failure
      |-- sample 1 --> one_sample(job, 1), continued: a request of its own  (thread s1)
      |-- sample 2 --> one_sample(job, 2), continued: a request of its own  (thread s2)
      v
    merged queue: (index, update | error | None when done)
      -> each sample's tokens forwarded under its own index, as they come
      -> each sample's final result kept; one final update at the end: every
         sequence's result (those that had ended from what the client was sent),
         the draft counts summed, the first continuation's cached tokens and
         prompt logprobs

Each sample runs on its own thread with its own attempts and migrations (the
caller's `serve`); the first failure fails the request, and every sample still
running is cancelled. The deadline bounds the wait, plus FAN_OUT_SLACK for a
sample's thread to say how it ended.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

from pdserve.services.common.deadline import Deadline
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.events import Finished, Result, Update
from pdserve.services.router.migration import Progress, one_sample
from pdserve.services.router.validate import Job

FAN_OUT_SLACK = 5.0  # seconds past the deadline a migrated sample's thread has to say how it ended
JOIN_TIMEOUT = 1.0  # seconds a sample's thread has to end once the request is over

# A sample served as a request of its own (n == 1), from its progress, under a cancellation.
ServeSample = Callable[[Job, Progress, Cancellation], Iterator[Update]]


def fan_out(job: Job, progress: Progress, deadline: Deadline, cancel: Cancellation,
            serve: ServeSample) -> Iterator[Update]:
    """Continue each sequence of `job` that had not ended as a request of its own, all
    at once; their updates merged back under their indices, then one final update
    (the module docstring). Raises the first sample's error."""
    inner = Cancellation()
    cancel.add_callback(inner.cancel)
    merged: queue.Queue[tuple[int, Update | BaseException | None]] = queue.Queue()
    final = _Final(progress.final_message().end)
    threads = []
    for index in progress.unfinished():
        sent = progress.sample(index)
        sample = Progress(samples={0: replace(sent, token_ids=list(sent.token_ids))}, migrations=progress.migrations)
        updates = serve(one_sample(job, index), sample, inner)
        threads.append(threading.Thread(target=_pump, args=(index, updates, merged), daemon=True,
                                        name=f"{job.worker_request_id}-s{index}"))
    for thread in threads:
        thread.start()
    try:
        left = len(threads)
        while left:
            try:
                index, item = merged.get(timeout=max(0.0, deadline.remaining()) + FAN_OUT_SLACK)
            except queue.Empty:
                raise ServeError(Status.DEADLINE_EXCEEDED, "deadline passed (migrated samples)") from None
            if item is None:
                left -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            update = item.as_sample(index)
            final.add(update.end)
            if update.tokens:
                yield Update(update.tokens)
    finally:
        inner.cancel()  # the request ended (or failed): nothing of it keeps running
        for thread in threads:
            thread.join(JOIN_TIMEOUT)
    yield Update(end=final.finished())


class _Final:
    """The request's final update, gathered from its samples' final ones."""

    def __init__(self, ended: Finished) -> None:
        self._results: dict[int, Result] = {r.index: r for r in ended.results}
        self._end = ended

    def add(self, end: Finished | None) -> None:
        """A sample's final update (already under its own index)."""
        if end is None:
            return
        self._results.update({r.index: r for r in end.results})
        self._end = replace(
            self._end, num_draft_tokens=self._end.num_draft_tokens + end.num_draft_tokens,
            num_accepted_tokens=self._end.num_accepted_tokens + end.num_accepted_tokens,
            # the first continuation's (rebase kept them to the original prompt)
            num_cached_tokens=self._end.num_cached_tokens or end.num_cached_tokens,
            prompt_logprobs=self._end.prompt_logprobs or end.prompt_logprobs,
        )

    def finished(self) -> Finished:
        return replace(self._end, results=tuple(self._results[i] for i in sorted(self._results)))


def _pump(index: int, serve: Iterator[Update], out: queue.Queue[tuple[int, Update | BaseException | None]]) -> None:
    """A migrated sample's updates onto the merged queue, then how it ended (None: done)."""
    try:
        for update in serve:
            out.put((index, update))
    except BaseException as e:  # handed to the request's thread, which raises it
        out.put((index, e))
        return
    out.put((index, None))
