"""What the engine and engine-loop tests share (tests/engine/, tests/services/worker/)."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.services.worker.events import RequestStream, TokenEvent

POISON = 13  # the token that makes `Poisoned` fail


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for the in-process engines of every module that imports this
    (autouse there: `from engine_helpers import one_thread`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Poisoned(torch.nn.Module):
    """The model, failing whenever the batch holds `poison` (a kernel fault that only
    some inputs trigger)."""

    def __init__(self, model: torch.nn.Module, poison: int) -> None:
        super().__init__()
        self.model = model
        self.poison = poison

    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if bool((input_ids == self.poison).any()):
            raise RuntimeError("device fault on a poisoned input")
        return self.model(input_ids, *args, **kwargs)


def drain(stream: RequestStream, timeout: float = 30.0) -> list:
    """A request's events until it ends."""
    events: list = []
    give_up = time.monotonic() + timeout
    while not events or isinstance(events[-1], TokenEvent):
        assert time.monotonic() < give_up, f"no end of {stream.request_id} within {timeout}s"
        events += stream.get(0.5)
    return events
