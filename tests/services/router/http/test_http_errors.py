"""Every error path of the HTTP API through a real router, each with its status and
the one body `{"error": {"message", "type", "param", "code"}}`; TLS and API keys.

`guarded`: `pdserve up --http-port 0` with one decode worker, TLS (tests/certs.py),
--api-keys-file, one admission slot and no queue, a 64 KiB body cap:

    TLS  https with the CA; plain http and an unknown CA refused
    400  a bad field, named in `param`      401  no key, a wrong key; SIGHUP: new keys
    404  unknown model, unknown route       413  a body over --http-max-body-bytes
    429  the one slot held by a stream, with Retry-After

`bare`: `pdserve router --http-port 0` with no worker and --admission-timeout 0, a
2 s --request-timeout:

    503  at once, /health 503 (a client mistake is still a 4xx)
    then a worker process joins (`served`):
    504  the worker frozen (SIGSTOP) at the request: past its deadline on any machine
         an error after the stream started is one `data: {"error": ...}` event, then
         `data: [DONE]`: the deadline passing mid-stream (504's body), and the worker
         killed mid-stream (503's); /health 503 once it is gone

A client mistake is never a 5xx. pdserve:http_requests_total{route,status} counts
exactly what was sent.
"""

from __future__ import annotations

import os
import signal
import ssl
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from certs import CA
from cluster_helpers import all_blocks_free, list_workers, metric, wait_for
from forked_pdserve import ForkedProcess, spawn_pdserve
from http_checks import HttpUp, error_of, error_shape, events, stream_text

pytestmark = pytest.mark.cluster(seconds=35)

KEY_A, KEY_B = "k-http-a-" + "a" * 24, "k-http-b-" + "b" * 24
BODY_CAP = 64 << 10
REQUEST_TIMEOUT = 2.0  # the bare router's: what a frozen worker makes a request outlive
PROMPT = "def fib(n):\n"
LONG = dict(prompt=PROMPT, max_tokens=900, ignore_eos=True, temperature=0.0)
MODEL = "pdserve-tiny-code"


@dataclass
class Guarded:
    up: HttpUp
    ca: ssl.SSLContext
    keys: Path
    key: str  # the key in force
    worker: str  # the decode worker's address

    def http(self, key: str | None = "", **kwargs) -> httpx.Client:
        """A client of the API over TLS; `key` "" means the key in force, None none."""
        key = self.key if key == "" else key
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.Client(base_url=self.up.root, verify=self.ca, headers=headers, timeout=60, **kwargs)

    def openai(self, key: str = "") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.up.url, api_key=key or self.key, max_retries=0,
                             http_client=openai.DefaultHttpxClient(verify=self.ca))


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guarded")
    ca = CA(tmp / "ca")
    server = ca.issue("router")
    keys = tmp / "api-keys"
    keys.write_text(f"{KEY_A}\n")
    up = HttpUp(["--prefill", "0", "--decode", "1", "--num-blocks", "128", "--api-keys-file", str(keys),
                 "--tls-cert", str(server.cert), "--tls-key", str(server.key), "--max-concurrent-requests", "1",
                 "--max-queued-requests", "0", "--http-max-body-bytes", str(BODY_CAP), "--log-level", "WARNING"],
                tmp / "up.log")
    try:
        (worker,) = up.list_workers()
        yield Guarded(up, ssl.create_default_context(cafile=str(ca.pem)), keys, KEY_A, worker.address)
    finally:
        assert up.stop() == 0


def completion(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, **fields}


# -- TLS ------------------------------------------------------------------------------------


def test_the_api_answers_over_tls_with_the_ca_and_refuses_plain_http(guarded):
    assert guarded.up.url.startswith("https://")
    with guarded.openai() as client:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
        assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
        streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    plain = guarded.up.root.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):  # the TLS port closes on a plaintext request
        httpx.get(f"{plain}/version", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # a CA that did not sign it
        httpx.get(f"{guarded.up.root}/version", timeout=10)
    with openai.OpenAI(base_url=guarded.up.url, api_key=guarded.key, max_retries=0) as client:
        with pytest.raises(openai.APIConnectionError):
            client.models.list()


# -- 401 --------------------------------------------------------------------------------------

KEYED = [("POST", "/v1/completions", completion()),
         ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
         ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
         ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]})]


@pytest.mark.parametrize("header", [None, "Bearer k-wrong-" + "c" * 24, "Bearer", f"Basic {KEY_A}", KEY_A],
                         ids=["none", "wrong", "no-key", "basic", "no-scheme"])
def test_every_route_but_health_and_version_wants_a_valid_key(guarded, header):
    with guarded.http(key=None) as http:
        headers = {} if header is None else {"Authorization": header}
        for method, path, body in KEYED:
            error = error_of(http.request(method, path, json=body, headers=headers), 401, None)
            assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key"), (path, error)
        # The key is checked before the body is read: a bad body without one is a 401, not a 400.
        error_of(http.post("/v1/completions", content=b"not json", headers=headers), 401)
        error_of(http.post("/v1/completions", json=completion(max_tokens=0), headers=headers), 401)
        assert http.get("/health", headers=headers).status_code == 200
        version = http.get("/version", headers=headers)
        assert version.status_code == 200 and set(version.json()) == {"version"}
    if header is not None and header.startswith("Bearer "):
        with guarded.openai(key=header.removeprefix("Bearer ")) as client, \
                pytest.raises(openai.AuthenticationError) as info:
            client.models.list()
        error_shape(info.value.body, None)


def test_a_valid_key_opens_every_route(guarded):
    with guarded.http() as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
        ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
        assert http.post("/v1/completions", json=completion()).json()["usage"]["completion_tokens"] == 4


# -- 400, 404, 405, 413 -------------------------------------------------------------------------


@pytest.mark.parametrize("fields, param", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens="four"), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(n=100), "n"), (dict(best_of=3), "best_of"), (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(suffix="}"), "suffix"), (dict(top_k="x"), "top_k"), (dict(stream_options={"include_usage": True}),
                                                                  "stream_options"),
    (dict(prompt=[9999]), "prompt"), (dict(prompt=""), "prompt"), (dict(stop=["s"] * 100), "stop"),
    (dict(logprobs=50), "logprobs"), (dict(cache_salt="s" * 1000), "cache_salt"),
])
def test_a_bad_field_is_a_400_naming_it(guarded, fields, param):
    with guarded.http() as http:
        # A streaming request is refused with its status too, before any event (stream_options needs none).
        for stream in (False,) if param == "stream_options" else (False, True):
            error = error_of(http.post("/v1/completions", json=completion(stream=stream, **fields)), 400, param)
            assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")


def test_the_openai_client_gets_a_bad_request_naming_the_field(guarded):
    with guarded.openai() as client:
        bad_requests(client)


def bad_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert error_shape(info.value.body, "max_tokens")["message"].startswith("max_tokens:")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True, extra_body={"min_p": 7})
    error_shape(info.value.body, "min_p")
    # A message the template cannot take is a clear 400, never a 5xx (a model without a
    # template: test_openai_without_chat_template.py).
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert "role" in error_shape(info.value.body, "messages.0.role")["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "tool", "content": "hi"}])
    error_shape(info.value.body, "messages.0.tool_call_id")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}])
    error_shape(info.value.body, "tools.0.function.parameters")


def test_an_unknown_model_or_route_is_a_404(guarded):
    with guarded.http() as http:
        for path, body in (("/v1/completions", completion(model="gpt-4")),
                           ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}),
                           ("/tokenize", {"model": "gpt-4", "prompt": "x"})):
            error = error_of(http.post(path, json=body), 404, "model")
            assert (error["type"], error["code"]) == ("not_found_error", "model_not_found")
        error_of(http.get("/v1/models/gpt-4"), 404, "model")
        for method, path in (("GET", "/v1/nothing"), ("POST", "/v2/completions"), ("GET", "/"),
                             ("POST", "/v1/completions/extra")):
            error = error_of(http.request(method, path, json={}), 404, None)
            assert error["type"] == "not_found_error" and path in error["message"]
        # A known route with the wrong method: a 4xx in the same shape.
        assert error_of(http.get("/v1/completions"), 405)["code"] == "method_not_allowed"
    with guarded.openai() as client, pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    error_shape(info.value.body, "model")


def test_a_body_over_the_cap_is_a_413_before_it_is_parsed(guarded):
    big = completion(prompt="x" * BODY_CAP)
    with guarded.http() as http:
        error = error_of(http.post("/v1/completions", json=big), 413, "body")
        assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
        error_of(http.post("/v1/completions", content=b"\xff" * (BODY_CAP + 1)), 413, "body")  # not even read as JSON

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(BODY_CAP // 4096 + 2):
                yield b" " * 4096

        error_of(http.post("/v1/chat/completions", content=chunks()), 413, "body")
        # Under the cap it is parsed (and this prompt is too long for the model).
        under = completion(prompt="x " * (BODY_CAP // 2 - 64))
        error_of(http.post("/v1/completions", json=under), 400, "prompt")


# -- 429 --------------------------------------------------------------------------------------


def test_a_full_admission_queue_is_a_429_with_retry_after(guarded):
    with guarded.http() as http, guarded.http() as holder:
        with holder.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as held:
            lines = held.iter_lines()
            assert next(lines).startswith("data: {")  # the one slot is taken from here on
            for body in (completion(), completion(stream=True)):
                reply = http.post("/v1/completions", json=body)
                error = error_of(reply, 429, None)
                assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
                assert int(reply.headers["Retry-After"]) >= 1
            with guarded.openai() as client, pytest.raises(openai.RateLimitError) as info:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert int(info.value.response.headers["Retry-After"]) >= 1
            assert http.get("/health").status_code == 200 and http.get("/v1/models").status_code == 200
        # The holder hung up: its slot comes back.
        wait_for(lambda: http.post("/v1/completions", json=completion()).status_code == 200, 30, "the slot back")
    wait_for(lambda: all_blocks_free(guarded.worker, guarded.up.auth), 30, "every block free")


# -- SIGHUP -----------------------------------------------------------------------------------


def test_sighup_reloads_the_keys_file(guarded):
    guarded.keys.write_text(f"# rotated\n{KEY_B}\n")
    guarded.up.proc.send_signal(signal.SIGHUP)  # to the launcher, which passes it on to the router

    def works(key: str) -> bool:
        with guarded.http(key=key) as http:
            reply = http.get("/v1/models")
            if reply.status_code != 200:
                error_of(reply, 401)
            return reply.status_code == 200

    wait_for(lambda: works(KEY_B), 30, "the new key to be taken")
    guarded.key = KEY_B
    assert not works(KEY_A)
    with guarded.openai() as client:
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


# -- the metric ---------------------------------------------------------------------------------


def test_http_requests_are_counted_by_route_and_status(guarded):
    url = guarded.up.metrics_url()
    name = "pdserve:http_requests_total"
    before = metric(url, name)
    sent = {("/v1/completions", "200"): 1, ("/v1/completions", "400"): 2, ("/v1/completions", "413"): 1,
            ("/v1/models", "401"): 1, ("/v1/models/{model}", "404"): 1, ("unmatched", "404"): 2,
            ("/version", "200"): 1, ("/health", "200"): 1, ("/tokenize", "200"): 1}
    with guarded.http() as http:
        http.post("/v1/completions", json=completion())
        http.post("/v1/completions", json=completion(max_tokens=0))
        http.post("/v1/completions", content=b"[")
        http.post("/v1/completions", content=b" " * (BODY_CAP + 1))
        http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        http.get("/v1/models/gpt-4")
        http.get("/nothing")
        http.post("/v1/nothing/else")
        http.get("/version")
        http.get("/health")
        http.post("/tokenize", json={"prompt": "x"})
    want = {(("route", route), ("status", status)): before.get((("route", route), ("status", status)), 0.0) + count
            for (route, status), count in sent.items()}

    def counted() -> bool:
        now = metric(url, name)
        return all(now.get(key, 0.0) == value for key, value in want.items()) and \
            all(value == before.get(key, 0.0) for key, value in now.items() if key not in want)

    wait_for(counted, 10, f"{name} to count what was sent")


# -- no worker: 503; then one that freezes (504) and dies mid-stream ----------------------------


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bare")
    address_file = tmp / "router.address"
    proc = spawn_pdserve(
        ["router", "--port", "0", "--http-port", "0", "--admission-timeout", "0", "--request-timeout",
         str(REQUEST_TIMEOUT), "--address-file", str(address_file), "--heartbeat-interval", "0.5", "--worker-timeout",
         "5", "--log-level", "WARNING"], tmp / "router.log")
    try:
        wait_for(lambda: address_file.is_file() and len(address_file.read_text().split()) == 3, 120,
                 "the router to serve")
        _, internal, http_address = address_file.read_text().split()
        root = f"http://{http_address}"
        with httpx.Client(base_url=root, timeout=60) as http:
            yield Bare(root, http, internal, tmp)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@dataclass
class Bare:
    root: str
    http: httpx.Client
    internal: str  # the Registry's address
    tmp: Path
    worker: ForkedProcess | None = None
    worker_address: str = ""

    def join(self) -> None:
        """A mixed worker (a process of its own) joins and serves."""
        self.worker = spawn_pdserve(
            ["mixed", "--router", self.internal, "--worker-id", "lonely", "--num-blocks", "128"], self.tmp / "worker.log")
        wait_for(lambda: self.http.get("/health").status_code == 200, 120, "the worker to make /health 200")
        (info,) = list_workers(self.internal)
        self.worker_address = info.address
        wait_for(lambda: self.http.post("/v1/completions", json=completion()).status_code == 200, 60, "a warm worker")

    @contextmanager
    def frozen(self):
        """The worker stopped (SIGSTOP) for the block, then every block free. A request
        sent at the freeze outlives its deadline (REQUEST_TIMEOUT) before the router's
        keepalive pings find the worker gone (3 s after a ping goes unanswered). Each
        freeze starts from a worker the router serves with: a freeze before may have
        outlived those 3 s on a loaded machine, and a dropped worker takes a heartbeat
        or two to register again (until then: 503, no worker, not the 504 a frozen one
        gives)."""
        wait_for(lambda: self.http.get("/health").status_code == 200, 30, "the worker to be registered and serving")
        os.kill(self.worker.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.worker.pid, signal.SIGCONT)
        wait_for(lambda: all_blocks_free(self.worker_address), 30, "the thawed worker to free every block")
        wait_for(lambda: self.http.get("/health").status_code == 200, 30, "the thawed worker to serve again")


@pytest.fixture(scope="module")
def served(bare):
    bare.join()
    yield bare
    if bare.worker.poll() is None:
        bare.worker.kill()
    bare.worker.wait(10)


def test_without_a_worker_a_request_is_a_503_at_once_and_health_is_503(bare):
    http = bare.http
    for body in (completion(), completion(stream=True)):
        error = error_of(http.post("/v1/completions", json=body), 503, None)
        assert (error["type"], error["code"]) == ("server_error", "unavailable")
    assert error_of(http.get("/health"), 503, None)["code"] == "unavailable"
    # What needs no worker still answers; a client mistake is still a 4xx, never a 5xx.
    assert http.get("/version").status_code == 200 and http.get("/v1/models").status_code == 200
    assert http.post("/tokenize", json={"prompt": PROMPT}).status_code == 200
    error_of(http.post("/v1/completions", json=completion(max_tokens=-1)), 400, "max_tokens")
    error_of(http.post("/v1/completions", json=completion(model="gpt-4")), 404, "model")
    with openai.OpenAI(base_url=f"{bare.root}/v1", api_key="x", max_retries=0) as client, \
            pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503
    error_shape(info.value.body, None)


@pytest.mark.parametrize("stream", [False, True])
def test_past_the_deadline_is_a_504(served, stream):
    with served.frozen():  # before the first token: the status says it, streaming or not
        error = error_of(served.http.post("/v1/completions", json=completion(stream=stream)), 504, None)
    assert (error["type"], error["code"]) == ("server_error", "timeout")


def test_an_error_after_the_stream_started_is_one_error_event_then_done(served):
    """The deadline passes mid-stream (the worker frozen after the first token)."""
    with served.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        lines = reply.iter_lines()
        first = events([next(lines)])
        with served.frozen():
            received = first + events(lines)
    error = stream_error(received)
    assert error["code"] == "timeout" and error["type"] == "server_error"


def test_a_worker_killed_mid_stream_ends_the_stream_with_one_error_event_then_done(served):
    with served.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first = events([next(lines)])
        served.worker.kill()
        received = first + events(lines)
    error = stream_error(received)
    assert (error["type"], error["code"]) == ("server_error", "unavailable"), error
    # The dead worker leaves the registry: /health says so.
    wait_for(lambda: served.http.get("/health").status_code == 503, 30, "/health 503 once the worker is gone")


def stream_error(received: list) -> dict:
    """The error of a stream that failed after it started: text chunks, then exactly
    one `{"error": ...}` event, then [DONE], nothing after."""
    assert received[-1] == "[DONE]" and received.count("[DONE]") == 1, received[-3:]
    *chunks, failure, _ = received
    assert all(e["object"] == "text_completion" and e["choices"][0]["finish_reason"] is None for e in chunks)
    assert stream_text(chunks), "the stream had started"
    assert set(failure) == {"error"}, failure
    return error_shape(failure["error"], None)
