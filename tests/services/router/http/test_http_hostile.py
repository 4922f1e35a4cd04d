"""Hostile bodies against the HTTP API while a long stream runs on the same cluster.

`pdserve up --http-port 0` (one decode worker, a chat template, a 2 MiB body cap):
a long greedy stream is run alone, then again with every hostile body below sent
while it runs. Each hostile body gets a 4xx with the one error shape (naming the
field where there is one), never a 5xx; the stream beside them ends as it did alone:
the same text, its full token count, no error event. Then every block is free and
the cluster still serves.

    wrong types          huge values (10**30, 1e308)    NaN, Infinity
    nesting 100k deep    strings near the body cap       invalid UTF-8, not JSON
    empty body           arrays, strings, null           huge n, negative max_tokens
    huge stop lists      bad roles and content parts     unsupported fields
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from cluster_helpers import wait_for
from http_checks import HttpUp, chat_template, error_of, events, stream_text

pytestmark = pytest.mark.cluster(seconds=20)

BODY_CAP = 2 << 20
MAX_PROMPT_BYTES = 1 << 20  # the router's default --max-prompt-bytes
C, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
LONG = {"prompt": "class Tree:\n", "max_tokens": 600, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}}
USER = [{"role": "user", "content": "hi"}]


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def completion(**fields) -> bytes:
    return j({"prompt": "def f(x):", "max_tokens": 4, **fields})


def chat(**fields) -> bytes:
    return j({"messages": USER, "max_tokens": 4, **fields})


DEEP = b"[" * 100_000 + b"]" * 100_000
# (route, body, status, param): the status and the field `param` names (or "body").
HOSTILE = [
    # wrong types
    (C, completion(max_tokens="many"), 400, "max_tokens"),
    (C, completion(prompt=5), 400, "prompt"),
    (C, completion(prompt=[1, "two", 3.5]), 400, "prompt"),
    (C, completion(prompt={"text": "x"}), 400, "prompt"),
    (C, completion(stop=[1, 2]), 400, "stop"),
    (C, completion(stream_options={"include_usage": "maybe"}, stream=True), 400, "stream_options.include_usage"),
    (C, completion(n=2.5), 400, "n"),
    # huge values
    (C, completion(max_tokens=10**30), 400, "max_tokens"),
    (C, b'{"prompt": "x", "max_tokens": 1e308}', 400, "max_tokens"),
    (C, completion(seed=10**30), 400, "seed"),
    (C, completion(n=10**6), 400, "n"),
    (C, completion(logprobs=10**9), 400, "logprobs"),
    (C, completion(presence_penalty=1e308), 400, "presence_penalty"),
    (C, completion(prompt=[10**12]), 400, "prompt"),
    (C, completion(min_tokens=10**6), 400, "min_tokens"),
    (C, completion(use_beam_search=True, n=1000), 400, "n"),
    # NaN, infinities
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (C, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    (C, b'{"prompt": "x", "frequency_penalty": -Infinity}', 400, "frequency_penalty"),
    # negative, empty
    (C, completion(max_tokens=-5), 400, "max_tokens"),
    (C, completion(n=-1), 400, "n"),
    (C, completion(prompt=[]), 400, "prompt"),
    (C, completion(prompt=[[]]), 400, "prompt"),
    (C, completion(prompt=""), 400, "prompt"),
    (C, completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    # huge lists and strings, near the body cap and over it
    (C, completion(stop=["x"] * 100_000), 400, "stop"),
    (C, completion(stop="y" * 100_000), 400, "stop"),
    (C, completion(prompt=["a"] * 100_000), 400, "prompt"),
    (C, completion(prompt="x" * (BODY_CAP - 100)), 400, "prompt"),
    (C, completion(prompt="x" * BODY_CAP), 413, "body"),
    (C, completion(prompt=list(range(2000))), 400, "prompt"),
    (C, completion(cache_salt="s" * 100_000), 400, "cache_salt"),
    (CHAT, chat(messages=[{"role": "user", "content": "z" * (BODY_CAP - 200)}]), 400, "messages"),
    # nesting, encodings, not JSON, not an object
    (C, DEEP, 400, "body"),
    (C, b'{"prompt": ' + DEEP + b"}", 400, "body"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": ' + b'{"a": ' * 50_000 + b"1"
     + b"}" * 50_001, 400, "body"),
    (C, b'{"prompt": "\xff\xfe\xfd"}', 400, "body"),
    (C, b'{"prompt": "\xed\xa0\x80"}', 400, "body"),  # a UTF-8-encoded surrogate
    (C, b"not json at all", 400, "body"),
    (C, b"", 400, "body"),
    (C, b"[1, 2, 3]", 400, "body"),
    (C, b'"def f(x):"', 400, "body"),
    (C, b"null", 400, "body"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}]' + b" " * 1000, 400, "body"),  # cut off
    # chat: roles, content parts, what pdserve cannot do
    (CHAT, chat(messages=[]), 400, "messages"),
    (CHAT, chat(messages="hello"), 400, "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    (CHAT, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages.0.content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content.0"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages.0.content.0"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), 400, "tools.0.function.name"),
    (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (CHAT, chat(logit_bias={"five": 100}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"5": 1e9}), 400, "logit_bias"),
    (CHAT, chat(top_logprobs=5), 400, "top_logprobs"),
    (CHAT, chat(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs"),
    (CHAT, chat(continue_final_message=True), 400, "continue_final_message"),
    (C, completion(suffix="}"), 400, "suffix"),
    (C, completion(model="gpt-4"), 404, "model"),
    # the tokenizer routes
    (TOKENIZE, j({"prompt": 5}), 400, "prompt"),
    (TOKENIZE, j({}), 400, "prompt"),
    (TOKENIZE, j({"prompt": "x" * (MAX_PROMPT_BYTES + 1)}), 400, "prompt"),
    (DETOKENIZE, j({"tokens": [10**12]}), 400, "tokens"),
    (DETOKENIZE, j({"tokens": "abc"}), 400, "tokens"),
    (DETOKENIZE, b"[" * 100_000, 400, "body"),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    up = HttpUp(["--prefill", "0", "--decode", "1", "--num-blocks", "128", "--http-max-body-bytes", str(BODY_CAP),
                 "--chat-template", str(chat_template(tmp)), "--log-level", "WARNING"], tmp / "up.log")
    try:
        (worker,) = up.list_workers()
        with httpx.Client(base_url=up.root, timeout=120) as http:
            yield dict(up=up, http=http, worker=worker.address)
    finally:
        assert up.stop() == 0


class LongStream:
    """LONG streamed on a thread of its own, every event kept."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.received: list = []
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=120) as http, http.stream("POST", f"{self.root}{C}", json=LONG) as reply:
                assert reply.status_code == 200, reply.read()
                for line in reply.iter_lines():
                    self.received += events([line])
                    self.started.set()
        except BaseException as e:  # the test reads it
            self.error = e
        finally:
            self.started.set()

    def join(self) -> list:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the long stream hung"
        assert self.error is None, self.error
        return self.received


def outcome(received: list) -> tuple[str, int, list]:
    """(text, completion tokens, finish reasons) of a LONG stream that ended well."""
    assert received[-1] == "[DONE]" and received.count("[DONE]") == 1
    assert not [e for e in received if isinstance(e, dict) and "error" in e]
    usage = received[-2]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] > 0
    finishes = [e["choices"][0]["finish_reason"] for e in received[:-2] if e["choices"][0]["finish_reason"]]
    return stream_text(received[:-2]), usage["usage"]["completion_tokens"], finishes


def test_hostile_bodies_get_a_4xx_while_a_long_stream_beside_them_is_unaffected(cluster):
    assert len(HOSTILE) >= 40
    up, http = cluster["up"], cluster["http"]
    alone = outcome(LongStream(up.root).join())
    assert alone[1] == LONG["max_tokens"] and alone[2] == ["length"] and alone[0]

    stream = LongStream(up.root)
    stream.started.wait(120)
    answered = []
    for route, body, status, param in HOSTILE:
        reply = http.post(route, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= reply.status_code < 500, (route, body[:80], reply.status_code, reply.text[:300])
        error = error_of(reply, status, param)
        answered.append((route, body[:60], error["message"][:80]))
    running = stream.thread.is_alive()
    beside = outcome(stream.join())
    print(f"{len(HOSTILE)} hostile bodies refused; the long stream was {'still' if running else 'no longer'} "
          "running when the last was answered")
    assert beside == alone

    # Nothing was left behind, and the cluster serves as before.
    wait_for(lambda: up.all_blocks_free(cluster["worker"]), 30, "every block free")
    ok = http.post(C, json={"prompt": "def f(x):", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    ok = http.post(CHAT, json={"messages": USER, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_long_but_valid_bodies_are_served(cluster):
    """Near the limits, not over them: a token-id prompt longer than the cap on the
    number of prompts (256) is one prompt; 256 prompts are 256 choices."""
    http = cluster["http"]
    ids = list(range(10, 310))
    one = http.post(C, json={"prompt": ids, "max_tokens": 2, "temperature": 0.0})
    assert one.status_code == 200, one.text
    assert one.json()["usage"]["prompt_tokens"] == len(ids) and len(one.json()["choices"]) == 1
    many = http.post(C, json={"prompt": [[5 + k % 50] for k in range(256)], "max_tokens": 1})
    assert many.status_code == 200, many.text
    assert sorted(c["index"] for c in many.json()["choices"]) == list(range(256))
    wait_for(lambda: cluster["up"].all_blocks_free(cluster["worker"]), 30, "every block free")


@pytest.mark.parametrize("route", [C, CHAT, TOKENIZE])
def test_a_declared_length_over_the_cap_is_a_413_before_any_body_is_sent(cluster, route):
    """The headers alone (Content-Length past the cap), and the connection held open:
    the answer comes without the router waiting for a byte of the body."""
    host, port = cluster["up"].root.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {BODY_CAP * 100}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert json.loads(body)["error"]["param"] == "body"
