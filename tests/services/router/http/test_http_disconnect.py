"""Clients that hang up: every request they leave is aborted on every worker.

`pdserve up --http-port 0` with a prefill and a decode worker, every prompt crossing
(--local-prefill-threshold 0), a chat template. 32 streaming requests, completions
and chat, are dropped by closing their connections:

    8   before their first token: the prefill worker is frozen (SIGSTOP) while they
        wait on it, each holding a reservation on the decode worker; their sockets
        close, then the prefill worker thaws
    24  after 1 to 5 chunks, all at once

Then every worker's blocks are all free, nothing runs or waits on either, the
router's pdserve:num_requests_inflight is 0, each request was counted CANCELLED,
and none as a 5xx. A non-streaming request dropped before its answer frees its
blocks too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from contextlib import contextmanager

import httpx
import pytest

from cluster_helpers import metric, wait_for
from http_checks import HttpUp, chat_template, events

pytestmark = pytest.mark.cluster(seconds=20)

STREAMS_BEFORE, STREAMS_AFTER = 8, 24
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HTTP_REQUESTS = "pdserve:http_requests_total"
ALL_FREE_S = 30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disconnect")
    up = HttpUp(["--prefill", "1", "--decode", "1", "--local-prefill-threshold", "0", "--num-blocks", "256",
                 "--chat-template", str(chat_template(tmp)), "--worker-timeout", "30", "--log-level", "WARNING"],
                tmp / "up.log")
    try:
        workers = {w.worker_id: w.address for w in up.list_workers()}
        assert set(workers) == {"prefill-0", "decode-0"}, workers
        yield dict(up=up, workers=workers, metrics=up.metrics_url())
    finally:
        assert up.stop() == 0


def body(k: int, **fields) -> tuple[str, dict]:
    """The k-th request: completions or chat in turn, a prompt of its own (no cache hit)."""
    sampling = {"max_tokens": 300, "ignore_eos": True, "temperature": 0.0 if k % 3 else 0.8, "stream": True, **fields}
    if k % 2:
        return CHAT, {"messages": [{"role": "user", "content": f"def task_{k}(x):"}], **sampling}
    return COMPLETIONS, {"prompt": f"def task_{k}(x):\n    return", **sampling}


def raw_request(root: str, route: str, payload: dict) -> socket.socket:
    """A request sent on a socket of its own, nothing read: close it to hang up."""
    host, port = root.removeprefix("http://").rsplit(":", 1)
    data = json.dumps(payload).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def drop_after(root: str, route: str, payload: dict, chunks: int, got: list) -> None:
    """Read `chunks` events of a stream, then close its connection."""
    with httpx.Client(base_url=root, timeout=60) as http, http.stream("POST", route, json=payload) as reply:
        assert reply.status_code == 200, reply.read()
        lines = (line for line in reply.iter_lines() if line)
        got.append(events([next(lines) for _ in range(chunks)]))


def idle(cluster) -> bool:
    up = cluster["up"]
    return all(up.all_blocks_free(address) for address in cluster["workers"].values()) and \
        metric(cluster["metrics"], "pdserve:num_requests_inflight") == {(): 0.0}


def cancelled(cluster) -> float:
    return metric(cluster["metrics"], "pdserve:request_failure_total", code="CANCELLED").get((), 0.0)


@contextmanager
def frozen(up: HttpUp, worker_id: str):
    pid = up.worker_pid(worker_id)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def answered(cluster) -> dict:
    """pdserve:http_requests_total by (route, status)."""
    return {tuple(v for _, v in key): value for key, value in metric(cluster["metrics"], HTTP_REQUESTS).items()}


def delta(now: dict, then: dict) -> dict:
    return {key: value - then.get(key, 0.0) for key, value in now.items() if value != then.get(key, 0.0)}


def test_32_streams_dropped_before_and_after_their_first_token_free_every_worker(cluster):
    up, root = cluster["up"], cluster["up"].root
    decode = cluster["workers"]["decode-0"]
    before, statuses = cancelled(cluster), answered(cluster)
    with frozen(up, "prefill-0"):
        sockets = [raw_request(root, *body(k)) for k in range(STREAMS_BEFORE)]
        # Each waits on the frozen prefill worker, its KV blocks reserved on the decode worker.
        wait_for(lambda: up.stats(decode).num_reserved == STREAMS_BEFORE, 30, "every reservation")
        for sock in sockets:
            sock.close()
        wait_for(lambda: cancelled(cluster) == before + STREAMS_BEFORE, 30, "the router to cancel them")
    got: list = []
    threads = [threading.Thread(target=drop_after, args=(root, *body(k), 1 + k % 5, got))
               for k in range(STREAMS_BEFORE, STREAMS_BEFORE + STREAMS_AFTER)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert len(got) == STREAMS_AFTER, "a stream failed"
    assert all(e["choices"][0]["finish_reason"] is None for received in got for e in received if e["choices"])
    wait_for(lambda: idle(cluster), ALL_FREE_S, "every block free on both workers and nothing in flight")
    assert cancelled(cluster) == before + STREAMS_BEFORE + STREAMS_AFTER
    # A hang-up is no fault of ours: nothing counted 5xx. Those gone before their first
    # token got no status line (499, nginx's "client closed"); the others had their 200.
    halves = {route: sum(1 for k in range(STREAMS_BEFORE) if body(k)[0] == route) for route in (COMPLETIONS, CHAT)}
    want = {(route, "499"): count for route, count in halves.items()}
    for route in (COMPLETIONS, CHAT):
        want[(route, "200")] = STREAMS_AFTER // 2
    wait_for(lambda: delta(answered(cluster), statuses) == want, 10, f"{HTTP_REQUESTS}: {want}")


def test_a_request_dropped_before_its_answer_frees_its_blocks(cluster):
    up = cluster["up"]
    decode = cluster["workers"]["decode-0"]
    before, statuses = cancelled(cluster), answered(cluster)
    route, payload = body(100, stream=False, max_tokens=900)
    sock = raw_request(up.root, route, payload)
    wait_for(lambda: up.stats(decode).num_running == 1, 30, "the request to run on the decode worker")
    sock.close()
    wait_for(lambda: idle(cluster), ALL_FREE_S, "every block free on both workers and nothing in flight")
    assert cancelled(cluster) == before + 1
    wait_for(lambda: delta(answered(cluster), statuses) == {(route, "499"): 1}, 10, f"{HTTP_REQUESTS} 499")
