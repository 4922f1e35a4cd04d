"""Block hashes are stable across processes and chain through every earlier block."""

from __future__ import annotations

import subprocess
import sys

from pdserve.engine.hashing import ROOT_HASH, hash_block, hash_blocks


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
