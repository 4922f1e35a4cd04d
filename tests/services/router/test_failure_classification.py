"""The router classifies a worker's failure by its FailureKind (trailing metadata),
never by text, and names the kind in the details its client gets."""

from __future__ import annotations

import grpc
import pytest

from pdserve.engine.errors import FailureKind
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.services.common.failure import FAILURE_METADATA, failure_metadata
from pdserve.services.common.metrics import Disabled
from pdserve.services.common.status import ServeError, Status
from pdserve.services.router.cancel import Cancellation
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dispatch import Dispatcher, WorkerFailed, _kv_lost


class CallError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, metadata=()) -> None:
        self._code, self._details, self._metadata = code, details, metadata

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._metadata


class Worker:
    worker_id, dropped = "d0", False


@pytest.mark.parametrize("kind", list(FailureKind))
def test_only_a_lost_kv_kind_is_a_lost_kv(kind):
    error = CallError(grpc.StatusCode.UNAVAILABLE, "x", failure_metadata(kind))
    assert _kv_lost(error) is (kind in (FailureKind.TRANSFER, FailureKind.EXPIRED))


def test_the_old_free_text_and_no_metadata_are_not_a_lost_kv():
    assert not _kv_lost(CallError(grpc.StatusCode.UNAVAILABLE, "KV transfer: lost", ()))
    assert not _kv_lost(CallError(grpc.StatusCode.UNAVAILABLE, "x", ((FAILURE_METADATA, "transfer"),)))


def classify(error: CallError) -> Exception:
    dispatcher = Dispatcher(None, RouterConfig(model=DEFAULT_MODEL), Disabled())
    return dispatcher._classify(Worker(), error, Cancellation(), "r-0")


def test_client_details_name_the_workers_failure_kind():
    failed = classify(CallError(grpc.StatusCode.UNAVAILABLE, "request 'r-0': worker is shutting down",
                                failure_metadata(FailureKind.SHUTDOWN)))
    assert isinstance(failed, WorkerFailed)
    assert str(failed) == "worker d0 UNAVAILABLE: request 'r-0': worker is shutting down [FAILURE_KIND_SHUTDOWN]"
    internal = classify(CallError(grpc.StatusCode.INTERNAL, "request 'r-0': engine: boom",
                                  failure_metadata(FailureKind.INTERNAL)))
    assert isinstance(internal, ServeError) and internal.status is Status.INTERNAL
    assert internal.message == "request 'r-0': engine: boom [FAILURE_KIND_INTERNAL]"
    full = classify(CallError(grpc.StatusCode.RESOURCE_EXHAUSTED, "", failure_metadata(FailureKind.NO_ROOM)))
    assert isinstance(full, WorkerFailed) and full.busy
    assert str(full).endswith("RESOURCE_EXHAUSTED: [FAILURE_KIND_NO_ROOM]")


def test_details_without_a_kind_are_passed_on_as_they_are():
    plain = classify(CallError(grpc.StatusCode.INVALID_ARGUMENT, "n: must be <= 4 (max_n), got 5"))
    assert isinstance(plain, ServeError) and plain.message == "n: must be <= 4 (max_n), got 5"
