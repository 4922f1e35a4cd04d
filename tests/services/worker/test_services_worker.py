"""The Worker service of each role, in process and standalone (no router)."""

from __future__ import annotations

import json
from dataclasses import replace

import grpc
import pytest
import torch

from cluster_helpers import metric, wait_for
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.engine.offload import blockfile
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.worker.config import WorkerConfig
from pdserve.services.node import Worker

PROMPT = list(range(3, 40))
OPTIONS = pb.SamplingOptions(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def stubs():
    torch.set_num_threads(1)
    workers = {role: Worker(WorkerConfig(role=role, worker_id=f"{role}-t", num_blocks=32)) for role in ("prefill", "decode")}
    channels = {}
    for role, worker in workers.items():
        channels[role] = grpc.insecure_channel(worker.start())
    yield {role: pb_grpc.WorkerStub(c) for role, c in channels.items()}
    for role in workers:
        channels[role].close()
        workers[role].stop()


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, pb.PrefillResponse | pb.ReserveResponse):
            list(result)
    return info.value.code(), info.value.details()


def test_rpcs_a_role_does_not_serve_are_unimplemented(stubs):
    code, details = code_of(lambda: stubs["prefill"].Decode(pb.DecodeRequest(request_id="x", local_prefill=True), timeout=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "prefill" in details
    code, _ = code_of(lambda: stubs["prefill"].Reserve(pb.ReserveRequest(request_id="x"), timeout=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    code, _ = code_of(lambda: stubs["decode"].Prefill(pb.PrefillRequest(request_id="x"), timeout=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED


def test_transfer_rpcs_without_a_connector_fail_the_precondition(stubs):
    code, details = code_of(lambda: stubs["decode"].Reserve(
        pb.ReserveRequest(request_id="r", token_ids=PROMPT, sampling=OPTIONS), timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "kv-connector" in details
    code, _ = code_of(lambda: stubs["prefill"].Prefill(
        pb.PrefillRequest(request_id="p", token_ids=PROMPT, sampling=OPTIONS), timeout=5))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_local_decode_streams_and_stats_report_the_cache(stubs):
    request = pb.DecodeRequest(request_id="d", local_prefill=True, token_ids=PROMPT, sampling=OPTIONS)
    messages = list(stubs["decode"].Decode(request, timeout=30))
    tokens = [t for m in messages for d in m.deltas for t in d.token_ids]
    assert len(tokens) == 4 and messages[-1].finished and messages[-1].results[0].finish_reason == "length"
    assert not messages[-1].results[0].token_ids  # all streamed already
    stats = stubs["decode"].Stats(pb.StatsRequest(include_block_hashes=True), timeout=5)
    assert (stats.worker_id, stats.role, stats.num_blocks, stats.num_free_blocks) == ("decode-t", pb.ROLE_DECODE, 32, 32)
    assert set(stats.cached_block_hashes) >= set(hash_blocks(PROMPT, 16))
    assert stats.prefix_cache_queries > 0
    assert not stubs["decode"].Stats(pb.StatsRequest(), timeout=5).cached_block_hashes


def test_decode_errors_have_codes(stubs):
    code, details = code_of(lambda: stubs["decode"].Decode(pb.DecodeRequest(request_id="nothing-reserved"), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("request_id:")
    bad = pb.DecodeRequest(request_id="b", local_prefill=True, token_ids=[1, 99999], sampling=OPTIONS)
    code, details = code_of(lambda: stubs["decode"].Decode(bad, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt_token_ids:")
    bad = pb.DecodeRequest(request_id="b", local_prefill=True, token_ids=PROMPT,
                           sampling=pb.SamplingOptions(temperature=-1.0))
    code, details = code_of(lambda: stubs["decode"].Decode(bad, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("temperature:")


def test_deadline_on_a_worker_stream_frees_the_request(stubs):
    long = pb.SamplingOptions(max_tokens=900, temperature=0.0, ignore_eos=True)
    request = pb.DecodeRequest(request_id="slow", local_prefill=True, token_ids=PROMPT, sampling=long)
    code, _ = code_of(lambda: stubs["decode"].Decode(request, timeout=0.5))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    def free() -> bool:
        s = stubs["decode"].Stats(pb.StatsRequest(), timeout=5)
        return s.num_free_blocks == s.num_blocks and s.num_running == 0

    wait_for(free, 10, "the expired request to be freed")
    stubs["decode"].Abort(pb.AbortRequest(request_id="slow"), timeout=5)  # idempotent


def test_streams_past_the_call_limit_are_refused_and_control_rpcs_still_answer():
    """--grpc-threads bounds Reserve/Prefill/Decode calls; one more is RESOURCE_EXHAUSTED
    at once (the router tries another worker), and Stats, Abort and Drain keep their
    own threads, so a worker full of streams can still be asked and told."""
    worker = Worker(WorkerConfig(role="decode", worker_id="full-t", num_blocks=64, grpc_threads=4))
    channel = grpc.insecure_channel(worker.start())
    stub = pb_grpc.WorkerStub(channel)
    long = pb.SamplingOptions(max_tokens=400, temperature=0.0, ignore_eos=True)
    calls = [stub.Decode(pb.DecodeRequest(request_id=f"s{i}", local_prefill=True, token_ids=PROMPT[:8], sampling=long),
                         timeout=120) for i in range(4)]
    try:
        for call in calls:
            next(call)  # each stream is being served (holds a thread)
        code, details = code_of(lambda: stub.Decode(
            pb.DecodeRequest(request_id="one-more", local_prefill=True, token_ids=PROMPT[:8], sampling=OPTIONS), timeout=10))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--grpc-threads" in details
        for _ in range(20):  # more control calls than the work calls' threads
            assert stub.Stats(pb.StatsRequest(), timeout=5).num_running == 4
        stub.Abort(pb.AbortRequest(request_id="s0"), timeout=5)
        with pytest.raises(grpc.RpcError):
            list(calls[0])
        # a slot freed: a new stream is served again
        done = list(stub.Decode(pb.DecodeRequest(request_id="again", local_prefill=True, token_ids=PROMPT[:8],
                                                 sampling=OPTIONS), timeout=30))
        assert done[-1].finished
    finally:
        for call in calls:
            call.cancel()
        channel.close()
        worker.stop()


def test_a_speculating_decode_worker_counts_drafts_in_its_response_stats_and_metrics(stubs):
    """--speculative-config on a decode worker: the same greedy tokens as the worker
    without it, the request's draft counts on the final message, and the same counts in
    Stats and /metrics (accepted <= drafted; per position non-increasing, summing to
    the accepted)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    worker = Worker(WorkerConfig(role="decode", worker_id="spec-t", num_blocks=32, speculative_config=json.dumps(ngram)))
    prompt = Tokenizer(DEFAULT_MODEL).encode("".join(f"    x_{k} = compute({k}, 'x')  # step {k}\n" for k in range(6)))
    options = pb.SamplingOptions(max_tokens=16, temperature=0.0, ignore_eos=True)
    channel = grpc.insecure_channel(worker.start())
    try:
        stub = pb_grpc.WorkerStub(channel)
        messages = {}
        for name, target in (("spec", stub), ("plain", stubs["decode"])):
            request = pb.DecodeRequest(request_id=f"{name}-d", local_prefill=True, token_ids=prompt, sampling=options)
            messages[name] = list(target.Decode(request, timeout=60))
        tokens = {name: [t for m in ms for d in m.deltas for t in d.token_ids] for name, ms in messages.items()}
        assert tokens["spec"] == tokens["plain"] and len(tokens["spec"]) == 16
        final, plain = messages["spec"][-1], messages["plain"][-1]
        assert final.finished and 0 <= final.num_accepted_tokens <= final.num_draft_tokens and final.num_draft_tokens > 0
        assert (plain.num_draft_tokens, plain.num_accepted_tokens) == (0, 0)
        stats = stub.Stats(pb.StatsRequest(), timeout=5)
        assert (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (
            final.num_draft_tokens, final.num_accepted_tokens)
        per_pos = list(stats.spec_decode_num_accepted_tokens_per_pos)
        assert len(per_pos) == 3 and per_pos == sorted(per_pos, reverse=True)
        assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
        assert 0 < stats.spec_decode_num_drafts <= stats.spec_decode_num_draft_tokens
        url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
        scraped = {name: metric(url, f"pdserve:spec_decode_{name}_total")
                   for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_unspeculated_requests")}
        assert scraped == {"num_drafts": {(): stats.spec_decode_num_drafts},
                           "num_draft_tokens": {(): stats.spec_decode_num_draft_tokens},
                           "num_accepted_tokens": {(): stats.spec_decode_num_accepted_tokens},
                           "num_unspeculated_requests": {(): 0.0}}
        assert metric(url, "pdserve:spec_decode_num_accepted_tokens_per_pos_total") == {
            (("position", str(i)),): count for i, count in enumerate(per_pos)}
    finally:
        channel.close()
        worker.stop()



def test_a_worker_with_kv_tiers_closes_them_on_every_way_out(tmp_path, monkeypatch):
    """Stopped after serving: the engine's tiers are closed, so a persistent disk tier
    holds the host tier's blocks (written at close; nothing reached the disk before). A
    worker that fails while it is being built (here: its KV connector) closes the
    engine it had made too."""
    config = WorkerConfig(role="mixed", worker_id="tiers-t", num_blocks=16, kv_offload_host_bytes=1 << 22,
                          kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 26, kv_offload_persist=True)
    worker = Worker(config)
    try:
        with grpc.insecure_channel(worker.start()) as channel:
            request = pb.DecodeRequest(request_id="t", local_prefill=True, token_ids=list(range(3, 70)),
                                       sampling=OPTIONS)
            assert list(pb_grpc.WorkerStub(channel).Decode(request, timeout=30))[-1].finished
        wait_for(lambda: worker.engine.stats().kv_offload.host.stored >= 4, 10, "blocks copied to the host tier")
        assert not list(tmp_path.glob("*" + blockfile.SUFFIX))
    finally:
        worker.stop()
    assert len(list(tmp_path.glob("*" + blockfile.SUFFIX))) >= 4  # the host tier's blocks, written down at close
    closed = []
    monkeypatch.setattr("pdserve.services.node.LLMEngine.close", lambda engine: closed.append(engine))
    monkeypatch.setattr("pdserve.services.node.open_connector",
                        lambda *args: (_ for _ in ()).throw(ValueError("kv_connector: refused")))
    with pytest.raises(ValueError, match="kv_connector"):
        Worker(replace(config, kv_offload_persist=False))
    assert len(closed) == 1
