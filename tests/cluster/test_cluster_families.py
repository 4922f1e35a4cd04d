"""A prefill worker and a decode worker (in this process, ZeroMQ ipc between them)
serving a new family's random model: every prompt crosses (threshold 0), its KV pages
(Gemma 2's sliding and global layers with soft-capped attention; Phi-3's longrope past
original_max_position_embeddings) travel, and the tokens are transformers' greedy ones. Prompts are token ids: the model has no
tokenizer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cluster_helpers import all_blocks_free, stats, wait_for
from hf_models import build_model, hf_greedy
from pdserve.services.node import Worker
from pdserve.services.router.client import Client, collect
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.main import Router
from pdserve.services.worker.config import WorkerConfig

MAX_NEW = 8


LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 8 for i in range(8)],
                long_factor=[1.0 + i / 2 for i in range(8)])


@pytest.mark.parametrize("arch, overrides", [
    ("gemma2", dict(sliding_window=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # prompts past original_max_position_embeddings: long factors on both sides
    ("phi3", dict(head_dim=16, original_max_position_embeddings=64, rope_parameters=LONGROPE)),
], ids=["gemma2-softcap-sliding", "phi3-longrope"])
def test_prefill_and_decode_workers_serve_transformers_tokens(tmp_path, arch, overrides):
    model = build_model(tmp_path, arch, seed=5, qk_gain=16.0 if arch == "gemma2" else 1.0, **overrides)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (70, 90)]
    router = Router(RouterConfig(model=str(tmp_path), port=0, local_prefill_threshold=0))
    address = router.start()
    started: list[Worker] = []
    try:
        for role in ("decode", "prefill"):
            worker = Worker(WorkerConfig(role=role, model=str(tmp_path), router=router.internal_address,
                                         worker_id=f"{role}-{arch}", num_blocks=64, kv_connector="zmq_ipc"))
            worker.start()
            started.append(worker)
        with Client(address, timeout=60) as client, ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: collect(client.generate(p, max_tokens=MAX_NEW, temperature=0.0,
                                                                  ignore_eos=True)), prompts))
        assert [list(g[0].token_ids) for g in got] == [hf_greedy(model, p, MAX_NEW, eos=False) for p in prompts]
        decode, prefill = started
        wait_for(lambda: stats(prefill.address).kv_transfers == len(prompts), 10, "both transfers acknowledged")
        for w in started:
            wait_for(lambda: all_blocks_free(w.address, None), 20, f"{w.config.id}'s blocks to be free")
    finally:
        for worker in reversed(started):
            worker.stop()
        router.stop()
