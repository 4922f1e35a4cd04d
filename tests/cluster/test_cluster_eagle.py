"""EAGLE-3 through `pdserve up` (issue 22): real processes, the embedded model and its
committed head, every prompt prefilled on the prefill worker (threshold 0), which runs
the head over the prompt and ships its state with the KV pages. The decode worker's
acceptance counters equal those of an engine in this process that prefilled the same
prompts itself (vLLM's P/D acceptance test pattern), and its tokens are that engine's."""

from __future__ import annotations

import json

import pytest

from cluster_helpers import UpProcess, all_blocks_free, stats, wait_for
from engine_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import DEFAULT_EAGLE3_HEAD
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.client import Client, collect

CONFIG = {"method": "eagle3", "num_speculative_tokens": 4, "model": DEFAULT_EAGLE3_HEAD, "measure_payoff": False}
PROMPTS = [
    "def read_lines(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef walk(root):\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    cluster = UpProcess(["--num-blocks", "256", "--local-prefill-threshold", "0",
                         "--speculative-config", json.dumps(CONFIG)], tmp_path_factory.mktemp("eagle") / "up.log")
    yield cluster
    cluster.stop()


def test_remote_prefill_accepts_exactly_what_a_local_prefill_does(up):
    local = LLM(num_blocks=256, speculative_config=CONFIG)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [local.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]  # one at a time
    infos = {w.role: w for w in up.list_workers()}
    prefill, decode = infos[pb.ROLE_PREFILL], infos[pb.ROLE_DECODE]
    assert prefill.kv_layout == decode.kv_layout and "eagle_head=" in decode.kv_layout
    with Client(up.address, timeout=120) as client:
        for prompt, tokens in zip(PROMPTS, want):  # one at a time: the same passes as the local engine's
            (seq,) = collect(client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)).values()
            assert list(seq.token_ids) == tokens, prompt
    sent, got = stats(prefill.address, up.auth), stats(decode.address, up.auth)
    assert sent.kv_transfers == len(PROMPTS) and got.kv_transfer_failures == 0  # every prompt crossed
    expected = local.stats().spec_decode
    assert (got.spec_decode_num_drafts, got.spec_decode_num_draft_tokens, got.spec_decode_num_accepted_tokens,
            tuple(got.spec_decode_num_accepted_tokens_per_pos)) == (
        expected.num_drafts, expected.num_draft_tokens, expected.num_accepted_tokens,
        expected.num_accepted_tokens_per_pos)
    assert expected.num_accepted_tokens > 0
    print(f"eagle_pd_accepted={got.spec_decode_num_accepted_tokens} local_accepted={expected.num_accepted_tokens} "
          f"draft_tokens={got.spec_decode_num_draft_tokens}")
    for info in (prefill, decode):
        wait_for(lambda: all_blocks_free(info.address, up.auth), 20, f"{info.worker_id}'s blocks to be free")
