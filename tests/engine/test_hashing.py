"""Block hashes are stable across processes and chain through every earlier block."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.engine.hashing import (
    ROOT_HASH, BlockHashMismatch, checked_block_hashes, extended_block_hashes, hash_block, hash_blocks,
)


def test_only_full_blocks_are_hashed():
    assert len(hash_blocks(list(range(31)), 16)) == 1
    assert len(hash_blocks(list(range(32)), 16)) == 2
    assert hash_blocks([], 16) == []


def test_hash_chains_on_the_parent():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same second block, different history
    assert a[0] == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(ROOT_HASH, [1, 2], ("lora:a",)) != hash_block(ROOT_HASH, [1, 2])


def test_hash_is_identical_in_another_process():
    code = "from engine.hashing import hash_blocks; print(hash_blocks(list(range(100)), 16)[-1].hex())"
    env_seeds = []
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=__file__.rsplit("/tests/", 1)[0],
        )
        env_seeds.append(out.stdout.strip())
    assert env_seeds[0] == env_seeds[1] == hash_blocks(list(range(100)), 16)[-1].hex()


def test_a_cache_salt_changes_every_block_hash_and_the_engine_agrees():
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams

    tokens = list(range(40))
    plain, a, b = (hash_blocks(tokens, 16, cache_salt=s) for s in (None, "tenant-a", "tenant-b"))
    assert len(plain) == len(a) == len(b) == 2
    assert not set(plain) & set(a) and not set(a) & set(b)  # the salt reaches every block through the chain
    assert hash_blocks(tokens, 16, cache_salt="") == plain  # empty: no salt
    assert a == hash_blocks(tokens, 16, cache_salt="tenant-a")  # and it is deterministic
    # What the engine computes for a request is what the router and kvtransfer compute.
    request = Request("r", tokens[:20], SamplingParams(cache_salt="tenant-a"), 16)
    for t in tokens[20:]:
        request.append_token(t)
    assert request.block_hashes == a
    assert Request("r", tokens, SamplingParams(), 16).block_hashes == plain


def test_salts_are_checked():
    import pytest

    from pdserve.engine.sampling_params import SamplingParams

    assert SamplingParams(cache_salt="").cache_salt is None
    with pytest.raises(ValueError, match="^cache_salt:"):
        SamplingParams(cache_salt="x" * 10_000)
    with pytest.raises(ValueError, match="^cache_salt:"):
        hash_blocks(list(range(32)), 16, parent=b"p" * 32, cache_salt="x")


# -- a peer's hashes, checked once ---------------------------------------------------------

def test_checked_hashes_are_ours_when_they_match_or_none_were_sent():
    prompt = list(range(40))
    ours = hash_blocks(prompt, 16, cache_salt="s")
    assert checked_block_hashes(ours, prompt, 16, "s") == ours
    assert checked_block_hashes([], prompt, 16, "s") == ours


@pytest.mark.parametrize("why, sent", [
    ("another salt", lambda p: hash_blocks(p, 16, cache_salt="other")),
    ("another block size", lambda p: hash_blocks(p, 8)[:2]),  # as many blocks, other contents
    ("another tokenizer", lambda p: hash_blocks([t + 1 for t in p], 16)),
])
def test_a_mismatch_is_refused_naming_the_field_and_the_causes(why, sent):
    prompt = list(range(40))
    with pytest.raises(BlockHashMismatch) as info:
        checked_block_hashes(sent(prompt), prompt, 16, None)
    message = str(info.value)
    assert message.startswith("block_hashes[0]:"), why
    assert "tokenizer" in message and "block size" in message and "salt" in message


def test_hostile_hash_lists_get_errors_naming_the_field():
    prompt = list(range(40))
    ours = hash_blocks(prompt, 16)
    with pytest.raises(BlockHashMismatch, match=r"^block_hashes: 3 hashes .* 2 full blocks"):
        checked_block_hashes([*ours, ours[0]], prompt, 16)
    with pytest.raises(BlockHashMismatch, match=r"^block_hashes: 1 hashes"):
        checked_block_hashes(ours[:1], prompt, 16)
    with pytest.raises(ValueError, match=r"^block_hashes\[1\]: 5 bytes; a block hash has 32"):
        checked_block_hashes([ours[0], b"short"], prompt, 16)
    with pytest.raises(ValueError, match=r"^block_hashes\[0\]: 33 bytes"):
        checked_block_hashes([ours[0] + b"x", ours[1]], prompt, 16)
    with pytest.raises(ValueError, match=r"^prefill.block_hashes\[0\]"):
        checked_block_hashes([b"", b""], prompt, 16, field="prefill.block_hashes")


def test_the_engine_takes_a_requests_hashes_instead_of_hashing_again(monkeypatch):
    from pdserve.engine import request as request_module
    from pdserve.engine.request import Request
    from pdserve.engine.sampling_params import SamplingParams

    prompt = list(range(40))
    hashes = hash_blocks(prompt, 16)
    calls = []
    real = request_module.hash_block
    monkeypatch.setattr(request_module, "hash_block", lambda *a: calls.append(a) or real(*a))
    request = Request("r", prompt, SamplingParams(), 16, block_hashes=list(hashes))
    assert request.block_hashes == hashes and not calls  # not one prompt block hashed again
    for t in range(8):  # the output's blocks are hashed as they fill
        request.append_token(t)
    assert len(calls) == 1 and request.block_hashes[:2] == hashes
    assert request.block_hashes == hash_blocks(request.token_ids, 16)


def counting_hash_block(monkeypatch, *modules) -> list:
    """Every hash_block call made through `modules` (engine.hashing's hash_blocks, the
    engine's Request), recorded."""
    from pdserve.engine import hashing

    calls: list = []
    real = hashing.hash_block
    for module in modules:
        monkeypatch.setattr(module, "hash_block", lambda *a: calls.append(a) or real(*a))
    return calls


def test_a_decode_engine_given_the_hashes_with_a_first_token_hashes_no_prompt_block(monkeypatch):
    """The decode worker's local prefill after a lost transfer: the router's hashes
    (checked by the worker) and P's first token go to add_request; the engine computes
    the prompt without hashing one of its blocks, and caches them under those hashes."""
    from pdserve.engine import hashing, request as request_module
    from pdserve.engine.config import CacheConfig
    from pdserve.engine.engine import EngineConfig, LLMEngine
    from pdserve.engine.llm import DEFAULT_MODEL
    from pdserve.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=DEFAULT_MODEL, cache=CacheConfig(num_blocks=16)))
    bs = engine.kv.block_size
    prompt = list(range(3, 3 + 2 * bs + 5))  # two full blocks and a partial one
    hashes = hash_blocks(prompt, bs, cache_salt="t")
    calls = counting_hash_block(monkeypatch, hashing, request_module)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt="t")
    assert engine.add_request("d", prompt, params, first_token=7, block_hashes=hashes) == []
    while engine.has_unfinished():
        engine.step()
    assert not calls  # 2 * bs + 5 + 4 tokens fill no third block: nothing was hashed
    assert set(hashes) <= set(engine.cached_block_hashes())
    engine.check_integrity()


def test_an_extended_prompt_hashes_only_its_new_blocks(monkeypatch):
    from pdserve.engine import hashing

    tokens = list(range(70))
    known = hash_blocks(tokens[:20], 16, cache_salt="s")  # one full block
    calls = counting_hash_block(monkeypatch, hashing)
    extended = extended_block_hashes(known, tokens, 16, "s")
    assert len(calls) == 3  # 70 tokens: four full blocks, the first one known
    assert extended == hash_blocks(tokens, 16, cache_salt="s")
    assert extended_block_hashes([], tokens, 16, "s") == hash_blocks(tokens, 16, cache_salt="s")
    assert extended_block_hashes(known, tokens[:20], 16, "s") == known
    with pytest.raises(ValueError, match="^block_hashes: 2 known for 20 tokens"):
        extended_block_hashes(known * 2, tokens[:20], 16, "s")
