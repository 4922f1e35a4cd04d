"""KV tiers through a real P/D cluster (issue 36): `pdserve up` with one prefill and one
decode worker whose device pools hold about two prompts and a host tier each; prompts
that share long prefixes come back after others evicted them from the pools, so their
blocks come back from the host tiers. Greedy tokens equal a tiers-off engine's, the
host tier's hit counter moves on both workers' /metrics, every block is free at the
end, and each worker's start-up memory line names its tier."""

from __future__ import annotations

import pytest

from cluster_helpers import UpProcess, metric, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from pdserve.engine import LLM, SamplingParams
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=25)

NUM_BLOCKS = 24  # blocks of 16 tokens: about two of the prompts below
HOST_BYTES = 64 << 20


def document(name: str, lines: int) -> str:
    """A distinct code-like text (its first block differs from every other's)."""
    body = "".join(f"    {name}_{k} = compute({k}, '{name}')\n" for k in range(lines))
    return f"def {name}(data):\n{body}"


PREFIXES = [document(name, 9) for name in ("alpha", "beta", "gamma", "delta")]  # ~ 140 tokens each
# Each prefix, then the others (evicting it from both pools), then each prefix again
# with another question.
PROMPTS = [p + "    return data\n" for p in PREFIXES] + [p + "    yield from data\n" for p in PREFIXES]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    up = UpProcess(["--num-blocks", str(NUM_BLOCKS), "--kv-offload-host-bytes", str(HOST_BYTES),
                    "--local-prefill-threshold", "0", "--no-supervise"],
                   tmp_path_factory.mktemp("kv-tiers") / "up.log")
    yield up
    up.stop()


def test_prefixes_come_back_from_the_host_tiers_with_the_same_tokens(cluster):
    llm = LLM(num_blocks=512)  # no tiers, a pool that never evicts
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0))]
    with Client(cluster.address, timeout=120) as client:
        got = [list(collect(client.generate(p, max_tokens=4, temperature=0.0))[0].token_ids) for p in PROMPTS]
    assert got == want
    hits = {}
    for worker in cluster.list_workers():
        assert worker.metrics_port
        url = f"http://{worker.address.rsplit(':', 1)[0]}:{worker.metrics_port}/metrics"
        hits[worker.role] = metric(url, "pdserve:kv_offload_tiering_block_hits_total", tier="host").get((), 0.0)
        assert metric(url, "pdserve:kv_offload_cache_usage_perc", tier="host").get((), 0.0) > 0
    assert hits[pb.ROLE_DECODE] > 0, hits  # its reservations found the prefixes below its pool: not shipped again
    assert hits[pb.ROLE_PREFILL] > 0, hits  # its lookups did too: not recomputed
    cluster.wait_every_block_free()


def test_each_workers_memory_line_names_its_host_tier(cluster):
    memory_lines = [line for line in cluster.log_path.read_text().splitlines() if " memory: weights " in line]
    assert len(memory_lines) == 2 and all("; kv offload: host tier " in line for line in memory_lines), memory_lines
