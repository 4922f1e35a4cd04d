"""The OpenAI HTTP API on a model with no chat template (the embedded default's
weights and tokenizer, without its chat_template.jinja): chat is a clear 400 naming
`messages`, from every client, before anything is admitted; completions work and
equal the gRPC API's.

One decode worker (it prefills itself): the KV path over HTTP is
test_openai_clients.py's; this module needs only the model.
"""

from __future__ import annotations

import asyncio
import shutil

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

from cluster_helpers import UpProcess
from pdserve.engine.config import DEFAULT_MODEL
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=15)

MODEL = "pdserve-tiny-code"
MESSAGES = [{"role": "user", "content": "Write fib."}]
PROMPTS = ["def fib(n):\n", "for i in range("]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    model = tmp_path_factory.mktemp("model") / MODEL
    shutil.copytree(DEFAULT_MODEL, model, ignore=shutil.ignore_patterns("chat_template.jinja"))
    up = UpProcess(["--model", str(model), "--prefill", "0", "--decode", "1", "--http-port", "0",
                    "--num-blocks", "64"], tmp_path_factory.mktemp("up") / "up.log")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    with openai.OpenAI(base_url=up.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def want(up) -> list[str]:
    """Each prompt's greedy text from the gRPC API."""
    with Client(up.address, timeout=120) as grpc_client:
        runs = [collect(grpc_client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0)) for p in PROMPTS]
    return [run[0].text for run in runs]


def assert_no_template_error(error: openai.APIStatusError) -> None:
    body = error.response.json()["error"]
    assert error.status_code == 400 and body["type"] == "invalid_request_error" and body["param"] == "messages"
    assert "no chat template" in body["message"] and "/v1/completions" in body["message"]


def test_chat_is_a_clear_400_from_the_sync_client_streaming_or_not(client):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=stream)
        assert_no_template_error(e.value)


def test_chat_is_a_clear_400_from_the_async_client_and_langchain(up):
    async def chat(stream: bool) -> openai.APIStatusError:
        async with openai.AsyncOpenAI(base_url=up.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=stream)
            return e.value

    for stream in (False, True):
        assert_no_template_error(asyncio.run(chat(stream)))
    llm = ChatOpenAI(base_url=up.openai_url, api_key="unused", model=MODEL, max_retries=0, max_tokens=MAX_TOKENS)
    with pytest.raises(openai.BadRequestError) as e:
        llm.invoke("Write fib.")
    assert_no_template_error(e.value)


def test_tokenize_messages_is_a_400_while_a_prompt_tokenizes(up):
    root = up.openai_url.removesuffix("/v1")
    r = httpx.post(f"{root}/tokenize", json={"messages": MESSAGES}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{root}/tokenize", json={"prompt": PROMPTS[0]}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200


def test_completions_work_and_equal_grpc(up, client, want):
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.text for c in r.choices] == want
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
                                           stream=True):
        (choice,) = chunk.choices
        streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == want

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=up.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
            rs = await asyncio.gather(*(c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                                             temperature=0) for p in PROMPTS))
        return [r.choices[0].text for r in rs]

    assert asyncio.run(main()) == want
