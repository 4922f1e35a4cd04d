"""Helpers for the HTTP API's error, hostile-input and disconnect tests: `pdserve up
--http-port 0` as a child (its `openai URL` line read), the error shape checked,
SSE events read, the router's /metrics URL, a worker's pid found by its id."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import httpx

from cluster_helpers import UpProcess
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc

ANY = object()
# A plain template (the embedded model's own writes docstrings): chat prompts easy to read in a log.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def chat_template(directory: Path) -> Path:
    path = directory / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


class HttpUp(UpProcess):
    """`pdserve up --http-port 0 ...`; `url` (…/v1) and `root` once it printed
    `openai URL` (after `ready`, once the API answered)."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 240.0) -> None:
        super().__init__(["--http-port", "0", *args], log_path, timeout)  # UpProcess reads the `openai` line
        self.url = self.openai_url
        self.root = self.url.removesuffix("/v1")

    def worker_pid(self, worker_id: str) -> int:
        """The pid of the child serving as `worker_id`."""
        for pid in self.children():
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--worker-id" in args and args[args.index(b"--worker-id") + 1].decode() == worker_id:
                return pid
        raise LookupError(f"no child serves as {worker_id}")

    def metrics_url(self) -> str:
        """The router's /metrics (its port from the Registry's ListWorkers)."""
        with self.auth.channel(self.internal) as channel:
            port = pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5).router_metrics_port
        return f"http://{self.internal.rsplit(':', 1)[0]}:{port}/metrics"


def error_of(reply: httpx.Response, status: int, param: object = ANY) -> dict:
    """The `error` of a reply that must be `status` with the one error shape."""
    assert reply.status_code == status, (reply.status_code, reply.text[:300])
    assert reply.headers["content-type"].startswith("application/json"), reply.headers
    body = reply.json()
    assert set(body) == {"error"}, body
    return error_shape(body["error"], param)


def error_shape(error: dict, param: object = ANY) -> dict:
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    if param is not ANY:
        assert error["param"] == param, error
    return error


def events(lines: Iterable[str]) -> list[dict | str]:
    """The SSE `data:` payloads of a stream's lines: JSON objects, and "[DONE]"."""
    out: list[dict | str] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line.removeprefix("data: ")
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def stream_text(received: list[dict | str]) -> str:
    """The text of a one-choice completions stream's events."""
    return "".join(e["choices"][0]["text"] for e in received if isinstance(e, dict) and e.get("choices"))
