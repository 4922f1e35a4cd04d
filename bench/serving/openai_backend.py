"""The serving benchmark against any OpenAI-compatible server (pdserve's HTTP API,
vLLM, SGLang, ...): `pdserve bench --backend openai|openai-chat --base-url URL`.

    bench thread  send(request) --run_coroutine_threadsafe--> event loop thread (httpx)
                   waits on the future                          POST {base}/completions
                   (InFlight cancels it: the task is                 or /chat/completions
                    cancelled, the connection closed)          stream: true, include_usage
                                                               data: {chunk} ... [DONE]

One asyncio loop on its own thread does all the I/O (one httpx.AsyncClient, HTTP/1.1
keep-alive connections, as many as there are requests in flight); the benchmark's
threads only wait, so that a request can be cancelled at any point (even while the
server holds its headers back until the first token, as pdserve does) and the
deadline covers the whole request.

What is measured, per request (the gRPC backend's report, bench/serving/metrics.py):

    TTFT     sending -> the first chunk that carries text (chat: not the role chunk,
             which may come first with an empty content)
    ITL      gaps between chunks that carry text
    tokens   usage.completion_tokens of the last chunk (stream_options.include_usage)
    answer   the chunks' text, tokenized with the tokenizer (multiturn's history)
    prompt   usage.prompt_tokens; cached: usage.prompt_tokens_details.cached_tokens

Prompts: `openai` sends token-id prompts as token ids (the prompt's exact length
is then checked against usage) and text as text; `openai-chat` sends one user
message (a multiturn turn: its history as user and assistant messages), token ids decoded to text with the tokenizer (`--tokenizer`, default the
embedded model's), as vLLM's benchmark does: its prompt length is the server's
chat template's business and is not checked. Every request is greedy with vLLM's
`ignore_eos` (pdserve and vLLM honour it; a server that does not fails the
token-count check, loudly).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Coroutine
from contextlib import aclosing
from concurrent.futures import CancelledError
from typing import Any, TypeVar

from pdserve.bench.serving.backend import CONNECT_TIMEOUT, INTERRUPTED, InFlight, ServedModel, incomplete, result_base
from pdserve.bench.serving.metrics import RequestResult
from pdserve.bench.serving.workloads import BenchRequest, load_tokenizer

T = TypeVar("T")
UNKNOWN_MAX_MODEL_LEN = 1 << 31  # a server whose model card does not say: it refuses what does not fit


class OpenAiBackend:
    """`chat`: /v1/chat/completions (else /v1/completions) under `base_url` (…/v1).
    `model`: the model id to send (default: the first one /v1/models lists)."""

    def __init__(self, base_url: str, *, chat: bool, tokenizer: str | None = None, api_key: str | None = None,
                 model: str | None = None) -> None:
        try:
            import httpx  # the bench extra (pyproject.toml): only these backends need it
        except ImportError:
            raise RuntimeError("--backend openai needs httpx: pip install 'pdserve[bench]'") from None
        self.name = "openai-chat" if chat else "openai"
        self.address = base_url
        self.chat = chat
        self.path = "chat/completions" if chat else "completions"
        self.tokenizer = load_tokenizer(tokenizer)
        self.model = model
        self._errors = (httpx.HTTPError, OSError, json.JSONDecodeError)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-http", daemon=True)
        self._thread.start()
        self.headers = headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

        async def open_client() -> httpx.AsyncClient:  # on its loop
            return httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers, limits=limits, timeout=None)

        self._http = self._wait(open_client())

    # -- the model --------------------------------------------------------------------

    def served(self) -> ServedModel:
        """The model card (GET /models); the vocabulary is the tokenizer's."""
        try:
            status, text = self._wait(self._get("models"))
            cards = list(json.loads(text).get("data") or []) if status == 200 else None
        except self._errors + (TimeoutError, AttributeError) as e:
            raise ConnectionError(f"{self.address}: GET models: {type(e).__name__}: {e}") from None
        if cards is None:
            raise ConnectionError(f"{self.address}: GET models: HTTP {status}: {error_message(text)}")
        ids = [card.get("id") for card in cards]
        name = self.model or (ids[0] if ids else None)
        if name is None or name not in ids:
            raise ConnectionError(f"{self.address} serves {ids}, not {name!r} (--served-model-name)")
        card = cards[ids.index(name)]
        self.model = name
        return ServedModel(name, self.tokenizer.get_vocab_size(with_added_tokens=False),
                           int(card.get("max_model_len") or UNKNOWN_MAX_MODEL_LEN))

    async def _get(self, path: str) -> tuple[int, str]:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            reply = await self._http.get(path)
        return reply.status_code, reply.text

    # -- requests ---------------------------------------------------------------------

    def body(self, request: BenchRequest) -> dict[str, Any]:
        common = {"model": self.model, "temperature": 0.0, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}
        if not self.chat:
            prompt = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
            return {**common, "prompt": prompt, "max_tokens": request.max_tokens}
        return {**common, "messages": self.messages(request), "max_completion_tokens": request.max_tokens}

    def messages(self, request: BenchRequest) -> list[dict[str, str]]:
        """One user message, or a conversation's turns (user and assistant alternating)."""
        if isinstance(request.prompt, str):
            return [{"role": "user", "content": request.prompt}]
        segments = request.turns or (request.prompt,)
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": self.tokenizer.decode(list(segment))}
                for i, segment in enumerate(segments)]

    def send(self, request: BenchRequest, timeout: float, inflight: InFlight) -> RequestResult:
        """One streamed request; never raises for a failed one."""
        started = time.perf_counter()
        future = asyncio.run_coroutine_threadsafe(self._stream(request, timeout, started), self._loop)
        if not inflight.add(future):
            return RequestResult(error=INTERRUPTED, started=started, finished=time.perf_counter(), **self._base(request))
        try:
            return future.result()
        except CancelledError:
            return RequestResult(error=INTERRUPTED, started=started, finished=time.perf_counter(), **self._base(request))
        finally:
            inflight.discard(future)

    def _base(self, request: BenchRequest) -> dict:
        base = result_base(request)
        if self.chat:  # the chat template adds tokens of its own
            base["requested_prompt_tokens"] = None
        return base

    async def _stream(self, request: BenchRequest, timeout: float, started: float) -> RequestResult:
        base = self._base(request)
        times: list[float] = []
        texts: list[str] = []
        finish: str | None = None
        usage: dict | None = None

        def failed(error: str) -> RequestResult:
            return RequestResult(error=error, started=started, finished=time.perf_counter(), **base)

        try:
            async with asyncio.timeout(timeout), self._http.stream("POST", self.path, json=self.body(request)) as reply:
                if reply.status_code != 200:
                    return failed(f"HTTP {reply.status_code}: {error_message((await reply.aread()).decode(errors='replace'))}")
                async with aclosing(reply.aiter_lines()) as lines:  # closed here, not by the GC after the loop
                    async for line in lines:
                        if not line.startswith("data:"):
                            continue  # blank separators, SSE comments
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        now = time.perf_counter()
                        chunk = json.loads(data)
                        if "error" in chunk:
                            return failed(f"error event: {error_message(data)}")
                        for choice in chunk.get("choices") or ():
                            if text := self._text(choice):
                                times.append(now)
                                texts.append(text)
                            finish = choice.get("finish_reason") or finish
                        usage = chunk.get("usage") or usage
        except TimeoutError:
            return failed(f"DEADLINE_EXCEEDED: not done within {timeout:g}s")
        except self._errors as e:
            return failed(f"{type(e).__name__}: {e}")
        finished = time.perf_counter()
        if usage is None:
            return failed("the stream carried no usage (stream_options.include_usage)")
        tokens = int(usage.get("completion_tokens") or 0)
        problem = incomplete(finish, tokens, request.max_tokens) or ("" if times else "no chunk carried text")
        if problem:
            return failed(problem)
        details = usage.get("prompt_tokens_details") or {}
        return RequestResult(error="", started=started, finished=finished, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                             cached_tokens=int(details.get("cached_tokens") or 0), output_tokens=tokens,
                             token_times=tuple(times), output_ids=self._ids("".join(texts)), **base)

    def _ids(self, text: str) -> tuple[int, ...]:
        """The answer's text as token ids, for a multi-turn history (a server's own
        tokens may differ where its text re-tokenizes otherwise)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _text(self, choice: dict) -> str:
        if self.chat:
            return (choice.get("delta") or {}).get("content") or ""
        return choice.get("text") or ""

    # -- lifetime ---------------------------------------------------------------------

    def _wait(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    def close(self) -> None:
        try:
            self._wait(self._http.aclose())
            self._wait(self._loop.shutdown_asyncgens())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> "OpenAiBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def error_message(text: str) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}} or vLLM's older
    {"message"}; else the text itself, shortened."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else body.get("message")
        if isinstance(message, str):
            return message
    return text[:300]
