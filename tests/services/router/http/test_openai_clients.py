"""The OpenAI HTTP API driven by the real clients, checked against the gRPC API and
transformers, through a prefill + decode cluster where every prompt's KV travels.

    random llama (tests/hf_models.py) + the embedded model's tokenizer + a Jinja
    chat template (chat_template.jinja beside the weights)
        |
    `pdserve up --http-port 0 --prefill 1 --decode 1 --local-prefill-threshold 0`
        |                         |
    openai.OpenAI / AsyncOpenAI   services/router/client.py Client (gRPC)
    langchain ChatOpenAI          transformers' greedy tokens (hf_greedy)
    httpx (raw SSE bytes)

One cluster for the module; requests are short (a few tokens each).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

from cluster_helpers import REPO, UpProcess, wait_for
from hf_models import build_model, hf_greedy
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=20)

MODEL = "random-chat"
TOKENIZER = REPO / "models" / "pdserve-tiny-code"  # its tokenizer (4096 ids) on random weights
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
TEXT = "def add(a, b):\n    return a + b\n"
ID_PROMPTS = [[5, 6, 7, 8], list(range(40, 70)), [300, 17, 2048, 99, 1000, 4, 77]]
MAX_TOKENS = 8


def render(messages: list[dict[str, str]]) -> str:
    """TEMPLATE by hand (add_generation_prompt): what the router must have rendered."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


# -- the cluster ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> tuple[Path, Any]:
    """(model directory, the HF model): random weights, a real tokenizer, a chat template.
    A wider init than the default spreads the logits, so greedy choices are far from ties."""
    path = tmp_path_factory.mktemp("random-chat")
    model = build_model(path, "llama", seed=3, vocab_size=4096, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                        initializer_range=0.1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path, model


@pytest.fixture(scope="module")
def up(chat_model, tmp_path_factory):
    path, _ = chat_model
    up = UpProcess(["--prefill", "1", "--decode", "1", "--local-prefill-threshold", "0", "--model", str(path),
                    "--served-model-name", MODEL, "--http-port", "0", "--num-blocks", "256", "--max-n", "4"],
                   tmp_path_factory.mktemp("up") / "up.log")
    yield up
    up.stop()


@pytest.fixture(scope="module")
def tokenizer(chat_model) -> Tokenizer:
    return Tokenizer(chat_model[0])


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    with openai.OpenAI(base_url=up.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(up) -> Client:
    with Client(up.address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def root(up) -> str:
    """The server's root URL (the tokenizer, health and version routes)."""
    return up.openai_url.removesuffix("/v1")


def grpc_run(grpc_client: Client, prompt: str | list[int], **sampling) -> dict[int, pb.GenerateResponse]:
    return collect(grpc_client.generate(prompt, model=MODEL, **sampling))


def grpc_greedy(grpc_client: Client, prompt: str | list[int], max_tokens: int = MAX_TOKENS, **sampling) -> pb.GenerateResponse:
    (seq,) = grpc_run(grpc_client, prompt, max_tokens=max_tokens, temperature=0.0, **sampling).values()
    return seq


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, str]] = MESSAGES) -> list[int]:
    return tokenizer.encode(render(messages), add_special_tokens=False)


def prefill_transfers(up: UpProcess) -> int:
    (prefill,) = [w for w in up.list_workers() if w.role == pb.ROLE_PREFILL]
    return up.stats(prefill.address).kv_transfers


# -- the plain routes ------------------------------------------------------------------


def test_models_version_and_health(up, client, root):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model" and card.owned_by == "pdserve"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    error = e.value.response.json()["error"]
    assert e.value.status_code == 404 and error["param"] == "model" and "gpt-4o" in error["message"]
    version = httpx.get(f"{root}/version", timeout=10)
    assert version.status_code == 200 and isinstance(version.json()["version"], str) and version.json()["version"]
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200


def test_tokenize_and_detokenize_round_trip(root, tokenizer):
    got = httpx.post(f"{root}/tokenize", json={"model": MODEL, "prompt": TEXT, "return_token_strs": True}, timeout=30).json()
    ids = tokenizer.encode(TEXT)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == 1024
    assert got["token_strs"] == [tokenizer.token_text(t) for t in ids]
    back = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": got["tokens"]}, timeout=30).json()
    assert back == {"prompt": TEXT}
    chat = httpx.post(f"{root}/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == chat_ids(tokenizer) and chat["count"] == len(chat["tokens"])
    back = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}, timeout=30).json()
    assert back == {"prompt": render(MESSAGES)}


# -- agreement: HTTP = gRPC = transformers ------------------------------------------------


def test_greedy_completions_equal_grpc_and_transformers_through_the_prefill_worker(up, client, grpc_client, chat_model,
                                                                                    tokenizer):
    """Token-id prompts (one, then all as a list of lists) and a text prompt: the text,
    the tokens (by their names and logprobs) and the counts of the gRPC API, whose
    tokens are transformers' greedy ones; every prompt's KV crossed from the prefill worker."""
    _, hf = chat_model
    before = prefill_transfers(up)
    prompts: list[str | list[int]] = [*ID_PROMPTS, TEXT]
    want = [grpc_greedy(grpc_client, p, logprobs=0) for p in prompts]
    for prompt, w in zip(prompts, want):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert list(w.token_ids) == hf_greedy(hf, ids, MAX_TOKENS), prompt
        assert len(w.token_ids) == MAX_TOKENS  # no early EOS: the counts below mean something

    def check(choice, w: pb.GenerateResponse) -> None:
        assert choice.text == w.text and choice.finish_reason == w.finish_reason == "length"
        assert choice.logprobs.tokens == [tokenizer.token_text(t) for t in w.token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in w.logprobs], abs=1e-4)

    for prompt, w in zip(prompts, want):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
        (choice,) = r.choices
        check(choice, w)
        assert r.usage.prompt_tokens == w.usage.prompt_tokens and r.usage.completion_tokens == MAX_TOKENS
    batch = client.completions.create(model=MODEL, prompt=ID_PROMPTS, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    assert [c.index for c in batch.choices] == list(range(len(ID_PROMPTS)))
    for choice, w in zip(batch.choices, want):
        check(choice, w)
    assert batch.usage.prompt_tokens == sum(map(len, ID_PROMPTS))
    assert batch.usage.completion_tokens == MAX_TOKENS * len(ID_PROMPTS)
    # gRPC 4 + HTTP 4 + the batch's 3, each prefilled on the prefill worker
    wait_for(lambda: prefill_transfers(up) - before == 2 * len(prompts) + len(ID_PROMPTS), 10,
             "every request's KV to have crossed from the prefill worker")


def test_sync_client_chat_and_completions_stream_and_not(client, grpc_client, tokenizer):
    chat_want = grpc_greedy(grpc_client, chat_ids(tokenizer))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == chat_want.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer)) and r.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]

    want = grpc_greedy(grpc_client, TEXT)
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_async_client_chat_and_completions_stream_and_not_concurrently(up, grpc_client, tokenizer):
    chat_want = grpc_greedy(grpc_client, chat_ids(tokenizer)).text
    want = [grpc_greedy(grpc_client, p).text for p in ID_PROMPTS]

    async def completion(c: openai.AsyncOpenAI, prompt: list[int], stream: bool) -> str:
        r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
        if not stream:
            return r.choices[0].text
        return "".join([chunk.choices[0].text async for chunk in r])

    async def chat(c: openai.AsyncOpenAI, stream: bool) -> str:
        r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=stream)
        if not stream:
            return r.choices[0].message.content
        return "".join([chunk.choices[0].delta.content or "" async for chunk in r])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=up.openai_url, api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(completion(c, p, s) for s in (False, True) for p in ID_PROMPTS),
                                        chat(c, False), chat(c, True))

    assert asyncio.run(main()) == [*want, *want, chat_want, chat_want]


def test_langchain_chat_openai_invoke_stream_and_batch(up, grpc_client, tokenizer):
    other = [{"role": "user", "content": "Multiply them."}]
    want = grpc_greedy(grpc_client, chat_ids(tokenizer)).text
    want_other = grpc_greedy(grpc_client, chat_ids(tokenizer, other)).text
    llm = ChatOpenAI(base_url=up.openai_url, api_key="unused", model=MODEL, max_retries=0, temperature=0,
                     max_tokens=MAX_TOKENS, timeout=120)
    as_langchain = [("system", MESSAGES[0]["content"]), ("user", MESSAGES[1]["content"])]
    answer = llm.invoke(as_langchain)
    assert answer.content == want and answer.response_metadata["finish_reason"] == "length"
    assert answer.usage_metadata["output_tokens"] == MAX_TOKENS
    assert "".join(chunk.content for chunk in llm.stream(as_langchain)) == want
    answers = llm.batch([as_langchain, [("user", other[0]["content"])]])
    assert [a.content for a in answers] == [want, want_other]


# -- the options, one test each ---------------------------------------------------------


def test_n_gives_distinct_indexed_choices_seeded_like_grpc(client, grpc_client, tokenizer):
    sampled = dict(max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
    want = grpc_run(grpc_client, ID_PROMPTS[1], n=3, **sampled)
    r = client.completions.create(model=MODEL, prompt=ID_PROMPTS[1], n=3, **sampled)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3 and texts == [want[i].text for i in range(3)]
    assert r.usage.completion_tokens == sum(len(want[i].token_ids) for i in range(3))
    assert [c.text for c in client.completions.create(model=MODEL, prompt=ID_PROMPTS[1], n=3, **sampled).choices] == texts
    chat_want = grpc_run(grpc_client, chat_ids(tokenizer), n=2, **sampled)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, **sampled)
    assert [c.index for c in chat.choices] == [0, 1]
    contents = [c.message.content for c in chat.choices]
    assert contents[0] != contents[1] and contents == [chat_want[0].text, chat_want[1].text]


def test_completion_logprobs_shape_and_values_agree_with_grpc(client, grpc_client, tokenizer):
    want = grpc_greedy(grpc_client, ID_PROMPTS[2], logprobs=2)
    r = client.completions.create(model=MODEL, prompt=ID_PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == MAX_TOKENS
    assert lp.tokens == [tokenizer.token_text(t) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    for top, entry in zip(lp.top_logprobs, want.logprobs):
        expected = {tokenizer.token_text(t.token_id): t.logprob for t in entry.top}
        assert len(entry.top) == 2 and top == pytest.approx(expected, abs=1e-4)
    # offsets count each token's text from the start of the choice's text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX_TOKENS)]


def test_chat_logprobs_shape_and_values_agree_with_grpc(client, grpc_client, tokenizer):
    want = grpc_greedy(grpc_client, chat_ids(tokenizer), logprobs=3)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS
    for got, entry in zip(content, want.logprobs):
        assert got.token == tokenizer.token_text(entry.token_id) and got.bytes == list(got.token.encode())
        assert got.logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert len(got.top_logprobs) == 3
        assert [t.token for t in got.top_logprobs] == [tokenizer.token_text(t.token_id) for t in entry.top]
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in entry.top], abs=1e-4)
        assert all(t.bytes == list(t.token.encode()) for t in got.top_logprobs)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3,
        stream=True) if c.choices and c.choices[0].logprobs]
    assert [e.token for lp in streamed for e in lp.content] == [e.token for e in content]


def test_echo_leads_the_text_with_the_prompt(client, grpc_client, tokenizer):
    want = grpc_greedy(grpc_client, TEXT, max_tokens=4).text
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == TEXT + want
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith(TEXT) and "".join(c.choices[0].text for c in chunks) == TEXT + want
    ids = ID_PROMPTS[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1)
    prompt_text = tokenizer.decode(ids)
    assert r.choices[0].text == prompt_text + grpc_greedy(grpc_client, ids, max_tokens=4).text
    lp = r.choices[0].logprobs  # the echoed prompt's tokens lead, the first with no logprob
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tokenizer.token_text(t) for t in ids]


def stop_string(text: str, tokenizer: Tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop string that first occurs in `text` where a later token begins: (it, where)."""
    for k in range(2, len(ids)):
        piece = tokenizer.token_text(ids[k]).strip()
        start = len(tokenizer.decode(ids[:k]))
        if len(piece) >= 2 and piece.isascii() and piece.isprintable() and text.find(piece) >= start:
            return piece, text.find(piece)
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_cut_the_text_streamed_or_not(client, grpc_client, tokenizer):
    full = grpc_greedy(grpc_client, ID_PROMPTS[1])
    stop, at = stop_string(full.text, tokenizer, list(full.token_ids))
    expected = full.text[:at]
    r = client.completions.create(model=MODEL, prompt=ID_PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                  stop=["never here", stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=ID_PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            stop=stop, stream=True))
    assert all(stop not in c.choices[0].text for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]

    chat_full = grpc_greedy(grpc_client, chat_ids(tokenizer))
    stop, at = stop_string(chat_full.text, tokenizer, list(chat_full.token_ids))
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                                 stop=stop, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks]
    assert all(stop not in d for d in deltas) and "".join(deltas) == chat_full.text[:at]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_stream_options_usage_chunks(client):
    args = dict(model=MODEL, prompt=ID_PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    plain = client.completions.create(**args).usage
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == [] and all(c.choices for c in chunks[:-1])
    assert chunks[-1].usage == plain
    chunks = list(client.completions.create(**args, stream=True))
    assert all(c.usage is None and c.choices for c in chunks)
    chunks = list(client.completions.create(**args, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and chunks[-1].usage == plain
    assert chunks[-1].choices == [] and all(c.usage.prompt_tokens == plain.prompt_tokens for c in chunks)

    chat = dict(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    plain = client.chat.completions.create(**chat).usage
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage == plain


def test_beam_search_equals_grpc_beam_search(client, grpc_client):
    want = grpc_run(grpc_client, ID_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, beam_width=2, n=2)
    r = client.completions.create(model=MODEL, prompt=ID_PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, n=2,
                                  extra_body={"use_beam_search": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [want[0].text, want[1].text] and want[0].text != want[1].text
    assert r.usage.completion_tokens == len(want[0].token_ids) + len(want[1].token_ids)


def test_token_id_prompts_list_of_ints_and_list_of_lists(client, grpc_client):
    want = [grpc_greedy(grpc_client, p, max_tokens=3).text for p in ID_PROMPTS]
    one = client.completions.create(model=MODEL, prompt=ID_PROMPTS[1], max_tokens=3, temperature=0)
    assert [c.text for c in one.choices] == [want[1]] and one.usage.prompt_tokens == len(ID_PROMPTS[1])
    # more ids than a body may have prompts (256): still one prompt
    long = [3 + (7 * k) % 4000 for k in range(300)]
    r = client.completions.create(model=MODEL, prompt=long, max_tokens=3, temperature=0)
    assert r.choices[0].text == grpc_greedy(grpc_client, long, max_tokens=3).text and r.usage.prompt_tokens == 300
    many = client.completions.create(model=MODEL, prompt=ID_PROMPTS, max_tokens=3, temperature=0, n=2)
    # choice index = prompt index * n + sample index
    assert [c.index for c in many.choices] == list(range(2 * len(ID_PROMPTS)))
    assert [c.text for c in many.choices] == [w for w in want for _ in range(2)]
    assert many.usage.prompt_tokens == sum(map(len, ID_PROMPTS)) and many.usage.completion_tokens == 3 * 2 * 3


def test_max_completion_tokens_wins_over_max_tokens_on_chat(client, grpc_client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, max_completion_tokens=3,
                                       temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content == grpc_greedy(grpc_client, chat_ids(tokenizer), max_tokens=3).text
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                          temperature=0).usage.completion_tokens == 5


def test_a_repeated_long_prompt_reports_cached_tokens(client):
    prompt = list(range(1000, 1100))  # 100 tokens no other test sends: six full blocks of 16
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 64 <= second.prompt_tokens_details.cached_tokens < second.prompt_tokens == 100


# -- the stream's bytes -----------------------------------------------------------------


def sse_events(response: httpx.Response) -> list[dict]:
    """The body's events, checked byte for byte: each `data: {json}\\n\\n`, `[DONE]` last."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    raw = response.read()
    assert re.fullmatch(rb"(data: [^\n]+\n\n)+", raw), raw[:400]
    events = raw.split(b"\n\n")[:-1]
    assert events[-1] == b"data: [DONE]" and b"data: [DONE]" not in events[:-1]
    return [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]


def check_chat_framing(chunks: list[dict], n: int) -> dict[int, str]:
    """Role chunks first, one per choice in index order; then one choice per chunk with
    its index; exactly one finish_reason per choice, on its last chunk. Returns the texts."""
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index, chunk in enumerate(chunks[:n]):
        (choice,) = chunk["choices"]
        assert choice["index"] == index and choice["delta"]["role"] == "assistant" and not choice["delta"]["content"]
        assert choice["finish_reason"] is None
    texts: dict[int, str] = {i: "" for i in range(n)}
    finished: list[int] = []
    for chunk in chunks[n:]:
        (choice,) = chunk["choices"]
        index = choice["index"]
        assert index in texts and index not in finished and "role" not in choice["delta"]
        texts[index] += choice["delta"].get("content", "")
        if choice["finish_reason"] is not None:
            assert choice["finish_reason"] in ("stop", "length")
            finished.append(index)
    assert sorted(finished) == list(range(n))
    return texts


def test_raw_sse_framing_of_a_chat_stream_with_n_2(client, root):
    body = {"model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 5}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{root}/v1/chat/completions", json={**body, "stream": True}) as response:
            chunks = sse_events(response)
        assert all(c.get("usage") is None for c in chunks)
        texts = check_chat_framing(chunks, 2)
        with http.stream("POST", f"{root}/v1/chat/completions",
                         json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            with_usage = sse_events(response)
    *rest, last = with_usage
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(c.get("usage") is None for c in rest) and check_chat_framing(rest, 2) == texts
    plain = client.chat.completions.create(**body)  # the same seed, not streamed: the same text
    assert [c.message.content for c in plain.choices] == [texts[0], texts[1]] and texts[0] != texts[1]
    assert plain.usage == openai.types.CompletionUsage.model_validate(last["usage"])


def test_streamed_completions_join_to_the_seeded_non_streamed_text(client):
    args = dict(model=MODEL, prompt=ID_PROMPTS[1], n=2, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=21)
    plain = client.completions.create(**args)
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for chunk in client.completions.create(**args, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert [texts[0], texts[1]] == [c.text for c in plain.choices] and texts[0] != texts[1]
    assert [finishes[0], finishes[1]] == [[c.finish_reason] for c in plain.choices]
