"""Text on the embedded model: tokenizer round trip, incremental detokenization, stop strings."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llm():
    return LLM(model=DEFAULT_MODEL)


def test_incremental_detokenization_never_splits_characters():
    tok = Tokenizer(DEFAULT_MODEL)
    text = "def naïve(x):\n    return 'héllo wörld ✓ 数据 🚀'  # ok\n"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, ids[:1])
    pieces = [detok.append(t) for t in ids[1:]]
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_token_boundary_is_cut(llm):
    prompt = "import os\n\n\ndef "
    free = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0))[0].outputs[0]
    tok = llm.tokenizer
    # Find a boundary between two generated tokens and build a stop string spanning it.
    pieces = [tok.decode(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]
    for i in range(3, len(pieces) - 1):
        left, right = pieces[i], pieces[i + 1]
        if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(right) - len(left) >= 2 and right.startswith(left):
            stop = left[-2:] + right[len(left) : len(left) + 2]
            break
    else:
        pytest.fail("no two adjacent multi-character tokens in the completion")
    cut = free.text.find(stop)
    out = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert stop not in out.text
    llm.check_integrity()


def test_text_prompt_and_completion(llm):
    out = llm.generate(["class Foo:\n    def "], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.prompt == "class Foo:\n    def "
    assert len(out.outputs[0].token_ids) == 16 and out.outputs[0].text
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
