"""The OpenAI-compatible HTTP API: FastAPI routes over the router's front end.

    POST /v1/completions        prompt: text, [text], [ids] or [[ids]]; one request per prompt
    POST /v1/chat/completions   messages through the chat template (chat.py); tools,
                                tool_choice and tool calls in answers: tools/
    GET  /v1/models, /v1/models/{model}
    POST /tokenize, /detokenize vLLM's shapes (`messages` form included)
    GET  /health                200 while a worker that can decode is registered (a decode
                                worker prefills what no prefill worker takes), else 503
    GET  /version

Validation, admission, API-key tenants, cache salts, metrics and dispatch are the
front end's (frontend.py), shared with gRPC; this file only frames. Bodies are read
up to --http-max-body-bytes (413 beyond, before parsing) and parsed by protocol.py;
every error is errors.py's shape. Every route but /health and /version wants
`Authorization: Bearer KEY` when the router has --api-keys-file. A request's
structured-outputs constraint (structured.py) is checked by the front end and may be
refused by a worker; either error names the field the caller used
(`response_format.json_schema`, `guided_regex`, ...), whenever it comes.

A request runs on the front end's blocking Generations through bridge.py. Before the
first output a request can still fail with its own HTTP status (a streaming one
too: its headers wait for the first token, which is what clients time TTFT by);
after, a stream carries an error as one `data: {"error": ...}` event, then
`data: [DONE]`. A client that disconnects, before or after its first token, cancels
every Generation of its request: the workers abort it and free its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from importlib import metadata
from typing import Any, TypeVar

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.common.status import ServeError
from pdserve.services.router.api_keys import AUTHORIZATION, ApiKeys
from pdserve.services.router.frontend import FrontEnd
from pdserve.services.router.http import render
from pdserve.services.router.http.bridge import Runs
from pdserve.services.router.http.chat import chat_prompt
from pdserve.services.router.http.errors import ApiError, api_error_of, bad_request, invalid
from pdserve.services.router.http.protocol import (
    MAX_PROMPTS, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, parse, sampling_of,
)
from pdserve.services.router.http.structured import aliases
from pdserve.services.router.http.tools import output as tool_output
from pdserve.services.router.http.tools.constraint import with_tool_constraint
from pdserve.services.router.http.tools.registry import parser_factory
from pdserve.services.router.http.tools.request import ToolRequest, tool_request
from pdserve.services.router.records import Request, SequenceOutput
from pdserve.services.router.validate import check_prompt_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
BODY_TIMEOUT_S = 30.0  # to read a request's whole body
CHAT_NAMES = {"token_ids": "messages", "prompt": "messages", "text": "messages", "logprobs": "top_logprobs"}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/version")


def version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class ClientGone(Exception):
    """The client disconnected before its answer: nothing is sent."""


@dataclass
class _Choice:
    """One choice's answer as it grows (non-streaming) or what was sent (streaming)."""

    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    prompt_logprobs: tuple = ()
    cached_tokens: int = 0
    started: bool = False


class HttpApi:
    def __init__(
        self, front_end: FrontEnd, tokenizer: Tokenizer | None, pool: Executor, healthy: Callable[[], bool],
        chat_template: str | None = None, api_keys: ApiKeys | None = None, max_body_bytes: int = 8 << 20,
        on_request: Callable[[str, int], None] | None = None, tool_call_parser: str = "hermes",
    ) -> None:
        self.front_end = front_end
        self.limits = front_end.limits
        self.tokenizer = tokenizer
        self.pool = pool
        self.healthy = healthy
        self.chat_template = chat_template
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.body_timeout = BODY_TIMEOUT_S
        self.on_request = on_request or (lambda route, status: None)
        self.name = render.token_namer(tokenizer)
        self.tool_parser = parser_factory(tool_call_parser)
        self.created = int(time.time())
        self.fastapi = self._build()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """The ASGI app: FastAPI's, with every response counted by route and status."""
        if scope["type"] != "http":
            await self.fastapi(scope, receive, send)
            return
        status = 500

        async def counting_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.fastapi(scope, receive, counting_send)
        finally:
            self.on_request(_route_label(scope.get("path", "")), status)

    # -- the app ------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI(title="pdserve", version=version(), docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(ApiError, _api_error_response)
        app.add_exception_handler(ServeError, lambda _r, e: _api_error_response(_r, api_error_of(e)))
        app.add_exception_handler(HTTPException, _http_exception_response)
        # Its own handler: one for Exception re-raises to uvicorn, which logs an error per hang-up.
        app.add_exception_handler(ClientGone, lambda _r, _e: Response(status_code=499))
        app.add_exception_handler(Exception, _internal_error_response)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        return app

    async def health(self) -> Response:
        if self.healthy():
            return Response(status_code=200)
        return _api_error_response(None, ApiError(503, "no worker that can decode is registered (or the router is "
                                                       "draining)"))

    async def version(self) -> dict:
        return {"version": version()}

    async def models(self, request: HttpRequest) -> dict:
        self._authorize(request)
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str, request: HttpRequest) -> dict:
        self._authorize(request)
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        name = self.limits.model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve", "root": name,
                "parent": None, "max_model_len": self.limits.max_model_len}

    # -- completions --------------------------------------------------------------------

    async def completions(self, request: HttpRequest) -> Response:
        authorization = self._authorize(request)
        body = parse(CompletionRequest, await self._body(request))
        self._check_model(body.model)
        prompts = _prompts(body.prompt)
        fill = body.max_tokens is None  # an explicit null: up to max_model_len
        prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None and prompt_logprobs is None and not body.stream:
            prompt_logprobs = body.logprobs  # echoed tokens carry their logprobs too
        to_api = _errors(None, aliases(body))
        try:
            sampling = replace(sampling_of(body, self.limits.max_model_len if fill else body.max_tokens, body.logprobs),
                               prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise to_api(self.front_end.refuse(e)) from None
        requests = [
            Request(text=text, token_ids=ids, sampling=sampling, request_id=_request_id(body.request_id, i, len(prompts)),
                    cache_salt=body.cache_salt or "", authorization=authorization,
                    add_special_tokens=body.add_special_tokens, fill_context=fill)
            for i, (text, ids) in enumerate(prompts)
        ]
        runs = await _as_api(Runs.admit(self.front_end, self.pool, requests), to_api)
        n = sampling.n
        echoes = [self._echo(text, gen.prompt_token_ids) if body.echo else "" for (text, _), gen in
                  zip(prompts, runs.generations)]
        completion_id = f"cmpl-{runs.generations[0].request_id}"
        if body.stream:
            return await self._stream(request, runs, CompletionEvents(self, runs, body, completion_id, n, echoes),
                                      to_api)
        choices = await _as_api(self._until_gone(request, runs, _collect(runs, n)), to_api)
        return JSONResponse(self._completion(body, completion_id, choices, runs, n, echoes))

    def _completion(self, body: CompletionRequest, completion_id: str, choices: dict[int, _Choice], runs: Runs,
                    n: int, echoes: list[str]) -> dict:
        out = []
        # A prompt's logprobs come with its first sequence's end; they belong to all n.
        prompt_lps = {index // n: c.prompt_logprobs for index, c in choices.items() if c.prompt_logprobs}
        for index in sorted(choices):
            choice = choices[index]
            echo = echoes[index // n]
            prompt_lp = prompt_lps.get(index // n, ())
            logprobs = None
            if body.logprobs is not None:
                entries = (list(prompt_lp) if body.echo else []) + choice.logprobs
                logprobs = render.CompletionLogprobs(self.name).of(entries)
            entry = {"index": index, "text": echo + "".join(choice.text), "logprobs": logprobs,
                     "finish_reason": choice.finish_reason, "stop_reason": None}
            if body.prompt_logprobs is not None:
                entry["prompt_logprobs"] = render.prompt_logprobs(prompt_lp, self.name)
            out.append(entry)
        return {"id": completion_id, "object": "text_completion", "created": int(time.time()),
                "model": self.limits.model_name, "choices": out, "usage": _usage(runs, choices, n),
                "system_fingerprint": None}

    # -- chat ---------------------------------------------------------------------------

    async def chat_completions(self, request: HttpRequest) -> Response:
        authorization = self._authorize(request)
        body = parse(ChatCompletionRequest, await self._body(request))
        self._check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs", "needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        names = {**CHAT_NAMES, "max_tokens": "max_completion_tokens"} if body.max_completion_tokens is not None \
            else CHAT_NAMES
        to_api = _errors(names, aliases(body))
        tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        try:  # unset: up to max_model_len (fill_context)
            sampling = sampling_of(body, self.limits.max_model_len if max_tokens is None else max_tokens, logprobs)
            sampling = with_tool_constraint(sampling, tools)
        except ValueError as e:
            raise to_api(self.front_end.refuse(e)) from None
        prompt = await self._chat_prompt(body, body.add_special_tokens, tools)
        chat_request = Request(token_ids=tuple(prompt), sampling=sampling, request_id=body.request_id or "",
                               cache_salt=body.cache_salt or "", authorization=authorization,
                               fill_context=max_tokens is None)
        runs = await _as_api(Runs.admit(self.front_end, self.pool, [chat_request]), to_api)
        n = sampling.n
        chat_id = f"chatcmpl-{runs.generations[0].request_id}"
        last = body.messages[-1]
        echo = (last.content if isinstance(last.content, str) else "") if body.echo and last.role == "assistant" else ""
        top_k = body.top_logprobs or 0
        if body.stream:
            return await self._stream(request, runs, ChatEvents(self, runs, body, chat_id, n, top_k, echo, tools),
                                      to_api)
        choices = await _as_api(self._until_gone(request, runs, _collect(runs, n)), to_api)
        out = []
        for index in sorted(choices):
            choice = choices[index]
            logprobs = ({"content": render.chat_logprobs(choice.logprobs, self.name, top_k), "refusal": None}
                        if body.logprobs else None)
            message, finish = self._chat_message(tools, echo + "".join(choice.text), choice.finish_reason)
            out.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                        "stop_reason": None})
        return JSONResponse({"id": chat_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.limits.model_name, "choices": out, "usage": _usage(runs, choices, n),
                             "system_fingerprint": None})

    def _chat_message(self, tools: ToolRequest | None, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A whole choice's message (its tool calls read from `text`) and finish reason."""
        if tools is None:
            return {"role": "assistant", "content": text, "refusal": None}, reason
        content, calls = tool_output.whole(tools, self.tool_parser, text)
        message = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return message, reason if reason is None else tool_output.finish_reason(tools, reason, bool(calls))

    # -- tokenizer ----------------------------------------------------------------------

    async def tokenize(self, request: HttpRequest) -> dict:
        self._authorize(request)
        body = parse(TokenizeRequest, await self._body(request))
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", "send a prompt or messages, one of them")
        tokenizer = self._tokenizer()
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages", "must not be empty")
            tools = tool_request(body.tools, "none" if body.tools else None, None)
            ids = await self._chat_prompt(body, bool(body.add_special_tokens), tools)
        else:
            try:
                check_prompt_bytes(body.prompt, self.limits.max_prompt_bytes, "prompt")
            except ValueError as e:
                raise invalid(e) from None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self._off_loop(lambda: tokenizer.encode(body.prompt, add_special_tokens=special))
        strs = [self.name(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: HttpRequest) -> dict:
        self._authorize(request)
        body = parse(DetokenizeRequest, await self._body(request))
        self._check_model(body.model)
        tokenizer = self._tokenizer()
        bad = next((t for t in body.tokens if not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise bad_request("tokens", f"ids must be in [0, {self.limits.vocab_size}), got {bad}")
        return {"prompt": await self._off_loop(lambda: tokenizer.decode(body.tokens))}

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise bad_request("model", "this model has no tokenizer")
        return self.tokenizer

    async def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest, add_special_tokens: bool,
                           tools: ToolRequest | None = None) -> list[int]:
        """A body's messages (and tools) through the chat template, tokenized off the loop
        (400 naming the field)."""
        template_tools = tools.template_tools() if tools is not None else None
        try:
            return await self._off_loop(lambda: chat_prompt(
                self.tokenizer, self.chat_template, body.messages, body.add_generation_prompt,
                body.continue_final_message, body.chat_template_kwargs, add_special_tokens,
                self.limits.max_prompt_bytes, template_tools))
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None

    # -- shared -------------------------------------------------------------------------

    def _authorize(self, request: HttpRequest) -> str:
        """The caller's `Authorization` header, once its key is valid (ApiError 401 if not)."""
        value = request.headers.get(AUTHORIZATION, "")
        if self.api_keys is None:
            return value
        if not value:
            raise ApiError(401, "API key required: send `Authorization: Bearer <key>`")
        if self.api_keys.identify({AUTHORIZATION: value}) is None:
            raise ApiError(401, "API key not valid")
        return value

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.limits.model_name:
            raise ApiError(404, f"model: {model!r} does not exist; this server serves {self.limits.model_name!r}",
                           param="model", code="model_not_found")

    async def _body(self, request: HttpRequest) -> bytes:
        """The body, read up to --http-max-body-bytes (413 beyond, before parsing) within
        `body_timeout` seconds (408 after: a client trickling its body holds no buffer forever)."""
        cap = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise ApiError(413, f"body: larger than {cap} bytes (--http-max-body-bytes)", param="body")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > cap:
                        raise ApiError(413, f"body: larger than {cap} bytes (--http-max-body-bytes)", param="body")
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"body: not received within {self.body_timeout:g}s", param="body") from None
        return b"".join(chunks)

    def _echo(self, text: str | None, prompt_ids: tuple[int, ...]) -> str:
        if text is not None:
            return text
        return self.tokenizer.decode(list(prompt_ids)) if self.tokenizer is not None else ""

    async def _off_loop(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

    async def _until_gone(self, request: HttpRequest, runs: Runs, work: Awaitable[T]) -> T:
        """`work`'s result, unless the client disconnects first (then every Generation
        is cancelled and ClientGone raised)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            runs.cancel()
            raise
        finally:
            gone.cancel()
        if task in done:
            return task.result()
        runs.cancel()
        task.cancel()
        await asyncio.wait({task})  # over before the caller closes what it ran (an async generator's aclose)
        raise ClientGone()

    async def _stream(self, request: HttpRequest, runs: Runs, events: Events,
                      to_api: Callable[[ServeError], ApiError] = api_error_of) -> Response:
        """An SSE response: waits for the first output (a failure until then is the
        request's HTTP status), then streams; an error later is one event, then [DONE]
        (`to_api`: a failure as the request's API error)."""
        outputs = aiter(runs)
        try:
            first = await self._until_gone(request, runs, anext(outputs, None))
        except ServeError as e:
            await outputs.aclose()
            raise to_api(e) from None
        except BaseException:
            await outputs.aclose()
            raise

        async def body() -> AsyncIterator[bytes]:
            try:
                if first is not None:
                    yield events.on(*first)
                    async for prompt_index, output in outputs:
                        chunk = events.on(prompt_index, output)
                        if chunk:
                            yield chunk
                yield events.end()
            except ServeError as e:
                yield _event(to_api(e).body())
            finally:
                runs.cancel()
                await outputs.aclose()
            yield DONE

        return EventStream(body(), on_close=runs.cancel)


class Events:
    """One streaming request's SSE chunks: `on` per output, `end` after the last."""

    def __init__(self, api: HttpApi, runs: Runs, obj: str, request_id: str, options: Any, n: int) -> None:
        self.api = api
        self.runs = runs
        self.object = obj
        self.id = request_id
        self.options = options
        self.n = n
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}

    def on(self, prompt_index: int, output: SequenceOutput) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        """The usage chunk (empty `choices`), when stream_options.include_usage asks."""
        if self.options is None or not self.options.include_usage:
            return b""
        return _event(self._chunk([], usage=True))

    def _chunk(self, choices: list[dict], usage: bool = False) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.api.limits.model_name,
               "choices": choices}
        if usage or (self.options is not None and self.options.continuous_usage_stats):
            out["usage"] = _usage(self.runs, self.choices, self.n)
        return out


class CompletionEvents(Events):
    def __init__(self, api: HttpApi, runs: Runs, body: CompletionRequest, request_id: str, n: int,
                 echoes: list[str]) -> None:
        super().__init__(api, runs, "text_completion", request_id, body.stream_options, n)
        self.logprobs = body.logprobs is not None
        self.echoes = echoes
        self.offsets: dict[int, render.CompletionLogprobs] = {}

    def on(self, prompt_index: int, output: SequenceOutput) -> bytes:
        index = prompt_index * self.n + output.index
        choice = self.choices.setdefault(index, _Choice())
        text = output.text
        if not choice.started:  # the echoed prompt leads the choice's first chunk
            choice.started = True
            text = self.echoes[prompt_index] + text
            self.offsets[index] = render.CompletionLogprobs(self.api.name, len(self.echoes[prompt_index]))
        _grow(choice, output)
        if not text and not output.logprobs and choice.finish_reason is None:
            return b""
        logprobs = self.offsets[index].of(output.logprobs) if self.logprobs else None
        return _event(self._chunk([{"index": index, "text": text, "logprobs": logprobs,
                                    "finish_reason": choice.finish_reason, "stop_reason": None}]))


class ChatEvents(Events):
    def __init__(self, api: HttpApi, runs: Runs, body: ChatCompletionRequest, request_id: str, n: int, top_k: int,
                 echo: str, tools: ToolRequest | None = None) -> None:
        super().__init__(api, runs, "chat.completion.chunk", request_id, body.stream_options, n)
        self.logprobs = body.logprobs
        self.top_k = top_k
        self.echo = echo
        self.roles_sent = False
        self.tools = tools
        self.tool_deltas: dict[int, tool_output.ToolDeltas] = {}  # per choice, under a tool_choice that reads calls

    def on(self, prompt_index: int, output: SequenceOutput) -> bytes:
        out = b""
        if not self.roles_sent:  # with the first token, not on accept: clients time TTFT by it
            self.roles_sent = True
            for index in range(self.n):
                role = {"role": "assistant", "content": "" if self._reads_calls else self.echo}
                out += _event(self._chunk([{"index": index, "delta": role, "logprobs": None, "finish_reason": None}]))
        choice = self.choices.setdefault(output.index, _Choice())
        _grow(choice, output)
        logprobs = None
        if self.logprobs and output.logprobs:
            logprobs = {"content": render.chat_logprobs(output.logprobs, self.api.name, self.top_k), "refusal": None}
        if self._reads_calls:
            return out + self._tool_chunks(output, choice, logprobs)
        if output.text or logprobs is not None or choice.finish_reason is not None:
            delta = {"content": output.text} if output.text or logprobs is not None else {}
            out += _event(self._chunk([{"index": output.index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": choice.finish_reason}]))
        return out

    @property
    def _reads_calls(self) -> bool:
        return self.tools is not None and self.tools.choice != "none"

    def _tool_chunks(self, output: SequenceOutput, choice: _Choice, logprobs: dict | None) -> bytes:
        """An output's text as content and tool-call deltas (tools/output.py), the logprobs
        on the first chunk, the finish reason on the last. An echoed assistant turn is
        read first, as the whole answer reads it."""
        tools = self.tools
        deltas = self.tool_deltas.get(output.index)
        items: list[dict] = []
        if deltas is None:
            extractor = tool_output.extractor_of(tools, self.api.tool_parser)
            deltas = self.tool_deltas[output.index] = tool_output.ToolDeltas(extractor, tools.parallel)
            items += deltas.feed(self.echo)
        items += deltas.feed(output.text)
        finish = choice.finish_reason
        if finish is not None:
            items += deltas.finish()
            finish = tool_output.finish_reason(tools, finish, deltas.calls > 0)
        if not items and (logprobs is not None or finish is not None):
            items = [{}]
        out = b""
        for i, delta in enumerate(items):
            out += _event(self._chunk([{"index": output.index, "delta": delta,
                                        "logprobs": logprobs if i == 0 else None,
                                        "finish_reason": finish if i == len(items) - 1 else None}]))
        return out


class EventStream(StreamingResponse):
    """`text/event-stream`; `on_close` runs however the response ends (a client that
    disconnects cancels the body mid-iteration)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._content.aclose()


def _errors(names: dict[str, str] | None, aliases: dict[str, str]) -> Callable[[ServeError], ApiError]:
    """A request's failures as its API errors: the fields its messages name renamed to
    the request's (`names` for `param`; `aliases`, a constraint's, in the message too)."""
    return lambda error: api_error_of(error, names, aliases)


async def _as_api(work: Awaitable[T], to_api: Callable[[ServeError], ApiError]) -> T:
    """`work`'s result; a ServeError it raises as the request's API error."""
    try:
        return await work
    except ServeError as e:
        raise to_api(e) from None


async def _collect(runs: Runs, n: int) -> dict[int, _Choice]:
    choices: dict[int, _Choice] = {}
    async for prompt_index, output in runs:
        _grow(choices.setdefault(prompt_index * n + output.index, _Choice()), output)
    return choices


def _grow(choice: _Choice, output: SequenceOutput) -> None:
    choice.text.append(output.text)
    choice.logprobs.extend(output.logprobs)
    choice.tokens += len(output.token_ids)
    if output.prompt_logprobs:
        choice.prompt_logprobs = output.prompt_logprobs
    if output.usage is not None:
        choice.cached_tokens = output.usage.cached_tokens
    if output.finished:
        choice.finish_reason = render.finish_of(output.finish_reason)


def _usage(runs: Runs, choices: dict[int, _Choice], n: int) -> dict:
    """Every prompt's tokens once, every choice's tokens; cached: each prompt's prefix-cache hit."""
    prompt = sum(len(g.prompt_token_ids) for g in runs.generations)
    cached: dict[int, int] = {}
    for index, choice in choices.items():
        cached[index // n] = max(cached.get(index // n, 0), choice.cached_tokens)
    return render.usage(prompt, sum(c.tokens for c in choices.values()), sum(cached.values()))


def _prompts(prompt: str | list) -> list[tuple[str | None, tuple[int, ...] | None]]:
    """(text, token ids) per prompt of a completions body."""
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise bad_request("prompt", "must not be empty")
    if isinstance(prompt[0], int):  # one prompt of token ids: its length is the front end's to judge
        return [(None, tuple(prompt))]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    return [(p, None) if isinstance(p, str) else (None, tuple(p)) for p in prompt]


def _request_id(given: str | None, index: int, count: int) -> str:
    if not given:
        return ""
    return given if count == 1 else f"{given}-{index}"


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _route_label(path: str) -> str:
    """A bounded label for a request's path (unknown paths all count as one)."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "unmatched"


async def _disconnected(request: HttpRequest) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _api_error_response(_request: HttpRequest | None, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers())


def _http_exception_response(_request: HttpRequest, error: HTTPException) -> JSONResponse:
    detail = error.detail if isinstance(error.detail, str) else "error"
    if error.status_code == 404:
        detail = f"no route {_request.url.path}"
    return _api_error_response(_request, ApiError(error.status_code, detail))


def _internal_error_response(request: HttpRequest, error: Exception) -> Response:
    log.error("HTTP %s %s: internal error", request.method, request.url.path, exc_info=error)
    return _api_error_response(request, ApiError(500, f"internal error ({type(error).__name__})"))
