"""The KV tiers inside the engine: tokens identical with tiers on and off under eviction
pressure, hits that came from the host tier and (host tier 0) from the disk tier, on
llama and qwen2, and through both tiers on every other family the tests build;
faults fall back to recompute; every tier's integrity after each test."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.config import CacheConfig, SchedulerConfig
from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.offload import blockfile
from engine_helpers import one_thread  # noqa: F401  (autouse: one torch thread)
from hf_models import build_model

BLOCK = 4
PREFIX_BLOCKS = 6  # each shared prefix: 24 tokens
NUM_PREFIXES = 4
DEVICE_BLOCKS = 20  # holds about two prompts' KV: revisits find their prefix evicted
HOST_BYTES = 1 << 22
DISK_BYTES = 1 << 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp(f"offload-{request.param}")
    build_model(path, request.param, seed=5)
    return str(path)


def engine(model_dir: str, num_blocks: int = DEVICE_BLOCKS, **offload) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model_dir, cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256), **offload))


def workload(rounds: int = 3) -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts sharing long prefixes, each prefix revisited after the others evicted it;
    greedy and seeded sampling alternate."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 250) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(NUM_PREFIXES)]
    out = []
    for r in range(rounds):
        for p, prefix in enumerate(prefixes):
            suffix = [rng.randrange(3, 250) for _ in range(3 + r)]
            params = (SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True) if (r + p) % 2 == 0 else
                      SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=100 * r + p, ignore_eos=True))
            out.append((f"r{r}p{p}", prefix + suffix, params))
    return out


def run(eng: LLMEngine, requests, one_at_a_time: bool = True) -> dict[str, list[int]]:
    """Each request's tokens; one at a time (the tiers' copies flushed in between, so
    hits are certain) or all queued at once (copies race the steps)."""
    tokens: dict[str, list[int]] = {}

    def drain() -> None:
        for _ in range(5000):
            if not eng.has_unfinished():
                return
            for o in eng.step():
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        raise AssertionError("the engine did not finish")

    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
        if one_at_a_time:
            drain()
            if eng.offload is not None:
                assert eng.offload.flush(30)
    drain()
    return tokens


def check_idle(eng: LLMEngine) -> None:
    """No block leaks in any tier: the pool is whole again, every tier's slots add up."""
    eng.check_integrity()
    stats = eng.stats()
    assert stats.num_free_blocks == stats.num_blocks
    if eng.offload is not None:
        assert eng.offload.flush(30)
        eng.offload.check_integrity(idle=True)


@pytest.fixture(scope="module")
def baseline(model_dir: str) -> dict[str, list[int]]:
    eng = engine(model_dir)
    tokens = run(eng, workload())
    check_idle(eng)
    return tokens


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_host_tier_hits_give_identical_tokens(model_dir: str, baseline, policy: str) -> None:
    off = engine(model_dir).stats().prefix_cache_hits
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES, kv_offload_policy=policy)
    assert run(eng, workload()) == baseline
    stats = eng.stats()
    host = stats.kv_offload.host
    assert host is not None and host.hits >= PREFIX_BLOCKS * NUM_PREFIXES  # every revisit found its prefix below
    assert stats.kv_offload.onloaded_blocks == host.hits
    assert stats.prefix_cache_hits > off  # counted as prefix-cache hits, as device hits are
    assert stats.kv_offload.offloads > 0 and stats.kv_offload.disk is None
    check_idle(eng)
    eng.close()


def test_disk_tier_alone_gives_identical_tokens(model_dir: str, baseline, tmp_path: Path) -> None:
    eng = engine(model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK_BYTES)
    assert run(eng, workload()) == baseline
    stats = eng.stats().kv_offload
    assert stats.host is None and stats.disk is not None
    assert stats.disk.hits >= PREFIX_BLOCKS * NUM_PREFIXES and stats.disk.stored > 0
    assert list(tmp_path.glob("*" + blockfile.SUFFIX))
    check_idle(eng)
    eng.close()


def test_host_and_disk_tiers_together(model_dir: str, baseline, tmp_path: Path) -> None:
    """A host tier of a few blocks: most revisits find their prefix on disk (demoted)."""
    per_block = engine(model_dir).memory.kv_bytes_per_block
    eng = engine(model_dir, kv_offload_host_bytes=4 * per_block, kv_offload_dir=str(tmp_path),
                 kv_offload_disk_bytes=DISK_BYTES, kv_offload_policy="arc")
    assert run(eng, workload()) == baseline
    stats = eng.stats().kv_offload
    assert stats.host.capacity_blocks == 4 and stats.disk.hits > 0 and stats.disk.stored > 0
    check_idle(eng)
    eng.close()


def test_requests_in_flight_together_give_identical_tokens(model_dir: str, baseline, tmp_path: Path) -> None:
    """All prompts queued at once: copies down race the steps, blocks are reused while
    queued (cancelled) or in flight (waited for); tokens stay the same."""
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES, kv_offload_dir=str(tmp_path),
                 kv_offload_disk_bytes=DISK_BYTES, kv_offload_queue_depth=2)
    assert run(eng, workload(), one_at_a_time=False) == baseline
    check_idle(eng)
    eng.close()


def test_persist_across_a_new_engine(model_dir: str, baseline, tmp_path: Path) -> None:
    first = engine(model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK_BYTES,
                   kv_offload_persist=True)
    requests = workload()
    run(first, requests[:NUM_PREFIXES])
    check_idle(first)
    first.close()
    again = engine(model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK_BYTES,
                   kv_offload_persist=True)
    assert again.stats().kv_offload.disk.used_blocks > 0
    later = requests[NUM_PREFIXES:2 * NUM_PREFIXES]  # revisits the prefixes the first engine computed
    assert run(again, later) == {rid: baseline[rid] for rid, _, _ in later}
    assert again.stats().kv_offload.disk.hits >= PREFIX_BLOCKS * NUM_PREFIXES
    check_idle(again)
    again.close()
    fresh = engine(model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK_BYTES)
    assert fresh.stats().kv_offload.disk.used_blocks == 0  # without persist: its own files removed
    assert not list(tmp_path.glob("*" + blockfile.SUFFIX))
    fresh.close()


def test_corrupt_disk_files_are_recomputed(model_dir: str, baseline, tmp_path: Path) -> None:
    eng = engine(model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK_BYTES)
    requests = workload()
    run(eng, requests[:NUM_PREFIXES])
    for path in tmp_path.glob("*" + blockfile.SUFFIX):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    assert run(eng, requests[NUM_PREFIXES:]) == {rid: baseline[rid] for rid, _, _ in requests[NUM_PREFIXES:]}
    assert eng.stats().kv_offload.corrupt_files > 0
    check_idle(eng)
    eng.close()


def test_disk_full_keeps_serving(model_dir: str, baseline, tmp_path: Path, monkeypatch) -> None:
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blockfile, "write_atomic", full)
    eng = engine(model_dir, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK_BYTES)
    assert run(eng, workload()) == baseline
    stats = eng.stats().kv_offload
    assert stats.disk_writes_disabled and stats.disk_write_errors == 1 and stats.disk.hits == 0
    check_idle(eng)
    eng.close()


def test_a_failing_onload_falls_back_to_prefill(model_dir: str, baseline, monkeypatch) -> None:
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES)

    def broken(src, block_id):
        raise RuntimeError("copy up failed")

    monkeypatch.setattr(eng.offload.copier, "to_device", broken)
    assert run(eng, workload()) == baseline
    stats = eng.stats().kv_offload
    assert stats.onload_failures > 0 and stats.onloaded_blocks == 0
    check_idle(eng)
    eng.close()


def test_a_reservation_counts_blocks_found_below_the_pool(model_dir: str) -> None:
    """A decode worker's reservation (P/D) counts host-tier blocks as already here."""
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES)
    requests = workload(rounds=1)
    run(eng, requests)  # the first prompts' prefixes were evicted from the pool by the later ones
    _, prompt, params = requests[0]
    reservation = eng.reserve_remote("again", prompt, params)
    assert reservation.num_cached_tokens == PREFIX_BLOCKS * BLOCK
    assert eng.stats().kv_offload.host.hits >= PREFIX_BLOCKS
    eng.abort("again")
    check_idle(eng)
    eng.close()


def test_the_memory_line_names_the_tiers(model_dir: str, tmp_path: Path) -> None:
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES, kv_offload_dir=str(tmp_path),
                 kv_offload_disk_bytes=DISK_BYTES)
    line = eng.memory.log_line()
    assert f"disk tier {DISK_BYTES} bytes" in line and "host tier" in line
    assert 0 < eng.memory.host_tier_bytes <= HOST_BYTES
    eng.close()
    assert "kv offload" not in engine(model_dir).memory.log_line()


def test_tiers_off_without_a_prefix_cache(model_dir: str) -> None:
    eng = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(block_size=BLOCK, num_blocks=DEVICE_BLOCKS,
                                                                    enable_prefix_caching=False),
                                 kv_offload_host_bytes=HOST_BYTES))
    assert eng.offload is None and eng.stats().kv_offload.host is None


def test_persist_keeps_the_host_tiers_blocks_too(model_dir: str, baseline, tmp_path: Path) -> None:
    """Host and disk tiers with persist: closing writes the host tier's blocks down, so a
    restarted engine (host tier empty) finds them on disk."""
    offload = dict(kv_offload_host_bytes=HOST_BYTES, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=DISK_BYTES,
                   kv_offload_persist=True)
    first = engine(model_dir, **offload)
    requests = workload()
    run(first, requests[:NUM_PREFIXES])
    assert first.stats().kv_offload.disk.used_blocks == 0  # nothing evicted from the host tier yet
    first.close()
    again = engine(model_dir, **offload)
    later = requests[NUM_PREFIXES:2 * NUM_PREFIXES]
    assert run(again, later) == {rid: baseline[rid] for rid, _, _ in later}
    assert again.stats().kv_offload.disk.hits >= PREFIX_BLOCKS * NUM_PREFIXES
    check_idle(again)
    again.close()


def test_fp8_pages_move_as_stored(model_dir: str, tmp_path: Path) -> None:
    """FP8 KV: blocks go down and come back as stored (bytes, never converted)."""
    plain = engine(model_dir, kv_cache_dtype="fp8")
    off = run(plain, workload(rounds=2))
    host_bytes = 4 * plain.memory.kv_bytes_per_block  # a few blocks: most go on to disk
    eng = engine(model_dir, kv_cache_dtype="fp8", kv_offload_host_bytes=host_bytes, kv_offload_dir=str(tmp_path),
                 kv_offload_disk_bytes=DISK_BYTES)
    assert run(eng, workload(rounds=2)) == off
    stats = eng.stats().kv_offload
    assert stats.host.stored > 0 and stats.disk.hits > 0
    check_idle(eng)
    eng.close()


def test_latency_samples_are_handed_over_once(model_dir: str) -> None:
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES)
    run(eng, workload(rounds=2))
    offload, onload = eng.offload.take_latency_samples()
    stats = eng.stats().kv_offload
    assert len(offload) == stats.offload_seconds_count > 0 and len(onload) == stats.onload_seconds_count > 0
    assert all(s >= 0 for s in offload + onload)
    assert eng.offload.take_latency_samples() == ([], [])
    eng.close()


def test_ngram_speculation_with_tiers(model_dir: str, baseline) -> None:
    """The ngram proposer keeps no KV: tiers and speculation together, tokens unchanged."""
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES,
                 speculative={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                              "prompt_lookup_min": 1})
    assert run(eng, workload()) == baseline
    assert eng.stats().kv_offload.host.hits > 0
    check_idle(eng)
    eng.close()


def test_a_plan_counts_the_tiers_as_the_engine_does(model_dir: str, tmp_path: Path) -> None:
    from pdserve.engine.memory import plan_memory

    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES + 100, kv_offload_dir=str(tmp_path),
                 kv_offload_disk_bytes=DISK_BYTES)
    plan = plan_memory(model_dir, block_size=BLOCK, num_blocks=DEVICE_BLOCKS, kv_offload_host_bytes=HOST_BYTES + 100,
                       kv_offload_disk_bytes=DISK_BYTES)
    assert (plan.host_tier_bytes, plan.disk_tier_bytes) == (eng.memory.host_tier_bytes, eng.memory.disk_tier_bytes)
    eng.close()


def test_prefix_tiers_say_where_each_block_sits(model_dir: str, tmp_path: Path) -> None:
    eng = engine(model_dir, kv_offload_host_bytes=HOST_BYTES)
    requests = workload(rounds=1)
    run(eng, requests)
    first, last = requests[0][1], requests[-1][1]
    before = eng.stats().kv_offload
    assert eng.prefix_tiers(first) == ["host"] * PREFIX_BLOCKS  # evicted from the pool by the later prompts
    assert eng.stats().kv_offload == before  # nothing moved or counted
    tiers = eng.prefix_tiers(last)
    assert tiers[0] == "device" and set(tiers) <= {"device", "host"} and len(tiers) == (len(last) - 1) // BLOCK
    assert eng.prefix_tiers([9] * 30) == []
    eng.close()
    assert engine(model_dir).prefix_tiers(first) == []  # tiers off: the pool alone, which lost it


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", dict(sliding_window=12)),
    ("qwen3", {}),
    ("gemma2", dict(sliding_window=12, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    ("gemma3", dict(sliding_window=12, layer_types=["sliding_attention", "full_attention"])),
    ("phi3", {}),
])
def test_every_other_family_gives_identical_tokens_through_both_tiers(arch: str, overrides: dict,
                                                                      tmp_path: Path) -> None:
    """The families beside llama and qwen2 (sliding windows, qk-norm, soft-caps,
    local/global layers): revisits find their prefixes in the host tier, then (host tier
    0) on disk; greedy and seeded tokens as with the tiers off."""
    model_dir = tmp_path / "model"
    build_model(model_dir, arch, seed=5, **overrides)
    off = engine(str(model_dir))
    baseline = run(off, workload(rounds=2))
    check_idle(off)
    for tier, offload in (("host", dict(kv_offload_host_bytes=HOST_BYTES)),
                          ("disk", dict(kv_offload_dir=str(tmp_path / "tier"), kv_offload_disk_bytes=DISK_BYTES))):
        eng = engine(str(model_dir), **offload)
        assert run(eng, workload(rounds=2)) == baseline, tier
        stats = getattr(eng.stats().kv_offload, tier)
        assert stats.hits >= PREFIX_BLOCKS * NUM_PREFIXES, (tier, stats)  # every revisit found its prefix there
        check_idle(eng)
        eng.close()
