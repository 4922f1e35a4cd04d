"""Streams survive a router kill (issue 40): `pdserve up --routers 2`, streams through
the project's `Client` over both routers, router 0 SIGKILLed while they stream. The
client resumes each stream that was on it on router 1 (GenerateRequest.resume), and:
  - no stream fails; every one that was on the killed router was resumed;
  - each gives what the same request sent again undisturbed gives: tokens and text
    (greedy, seeded, n > 1 with each sequence from its own point, logprobs, stop
    strings, penalties), usage and cumulative logprob;
  - router 1 counts what it resumed (`pdserve:request_resumptions_total`).
Hostile resumes (raw stub, router 1), each INVALID_ARGUMENT naming the field while a
victim stream beside them goes on undisturbed: token ids outside the vocabulary,
more tokens than the model allows, more sequences than asked, another tenant's
cache_salt, a token of another prompt, a forged token.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from cluster_helpers import UpProcess, metric, pid_alive, router_metrics_url, wait_for
from pdserve.engine.config import ModelConfig
from pdserve.engine.llm import DEFAULT_MODEL
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.proto.pdserve.v1 import pdserve_pb2_grpc as pb_grpc
from pdserve.services.router.client import Client, collect

pytestmark = pytest.mark.cluster(seconds=40)

PROMPT = "def fibonacci(n):\n    "
# Each kind of stream the client must resume exactly (long enough to be cut mid-way).
CASES = {
    "greedy": dict(max_tokens=160, temperature=0.0, ignore_eos=True),
    "greedy-stop": dict(max_tokens=160, temperature=0.0, stop=["return"], min_tokens=40),
    "seeded": dict(max_tokens=160, temperature=1.0, seed=11, ignore_eos=True),
    "seeded-n2": dict(max_tokens=160, temperature=0.9, seed=5, n=2, ignore_eos=True),
    "logprobs-penalties": dict(max_tokens=160, temperature=0.8, seed=3, logprobs=2, presence_penalty=0.5,
                               frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
}
UNSEEDED = dict(max_tokens=120, temperature=1.0, ignore_eos=True)  # resumed too; nothing to compare it with


class Consumer:
    """A call read on its own thread: every message kept."""

    def __init__(self, call) -> None:
        self.call = call
        self.messages: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
        except grpc.RpcError as e:
            self.error = e

    def tokens(self) -> int:
        return sum(len(m.token_ids) for m in list(self.messages))


def folded(messages) -> dict[int, tuple]:
    """What the caller got of each sequence: (tokens, text, finish, usage), then its
    logprobs and cumulative logprob (which another batch moves in the last digits:
    compared within a tolerance)."""
    return {i: ((tuple(m.token_ids), m.text, m.finish_reason, m.usage.prompt_tokens, m.usage.completion_tokens),
                [e.logprob for e in m.logprobs], m.cumulative_logprob)
            for i, m in collect(messages).items()}


def assert_same(resumed: dict, undisturbed: dict, name: str) -> None:
    assert resumed.keys() == undisturbed.keys(), name
    for i in resumed:
        a, a_logprobs, a_cum = resumed[i]
        b, b_logprobs, b_cum = undisturbed[i]
        assert a == b, f"{name} sequence {i}: resumed {a} != undisturbed {b}"
        assert a_logprobs == pytest.approx(b_logprobs, abs=1e-4), f"{name} sequence {i}: logprobs"
        assert a_cum == pytest.approx(b_cum, abs=2e-3), f"{name} sequence {i}: cumulative logprob"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    up = UpProcess(["--routers", "2", "--prefill", "0", "--decode", "1", "--num-blocks", "512", "--max-num-seqs", "32",
                    "--restart-backoff", "0.5"], tmp / "up.log")
    try:
        up.read_routers(2)
        yield up
    finally:
        up.stop()


def test_streams_on_a_killed_router_resume_on_the_other_and_match_undisturbed_runs(cluster):
    (public0, _), (public1, registry1) = cluster.routers
    # a client each, so that every call's first attempt is on router 0 (the list's first)
    clients = {name: Client([public0, public1], timeout=120) for name in [*CASES, "unseeded"]}
    try:
        streams = {name: Consumer(clients[name].generate(PROMPT, **CASES.get(name, UNSEEDED))) for name in clients}
        wait_for(lambda: all(s.tokens() >= 2 for s in streams.values()), 60, "every stream to have tokens")
        assert {s.call._address for s in streams.values()} == {public0}
        pid = cluster.router_pid(0)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), 10, "router 0 to die")
        for name, s in streams.items():
            s.thread.join(120)
            assert not s.thread.is_alive(), f"{name} hung"
            assert s.error is None, f"{name}: {s.error}"
            assert s.call.resumptions >= 1 and clients[name].resumptions >= 1, name
        cut = {name: sum(len(m.token_ids) for m in s.messages) for name, s in streams.items()}
        print(f"every stream resumed on router 1; tokens per stream {cut}", flush=True)
        unseeded = collect(streams["unseeded"].messages)[0]
        assert len(unseeded.token_ids) == unseeded.usage.completion_tokens == UNSEEDED["max_tokens"]
        with Client([public1], timeout=120) as client:
            for name, sampling in CASES.items():  # the same requests again, undisturbed
                again = list(client.generate(PROMPT, **sampling))
                assert_same(folded(streams[name].messages), folded(again), name)
                assert sum(bool(m.finish_reason) for m in streams[name].messages) == sampling.get("n", 1), name
    finally:
        for client in clients.values():
            client.close()
    served = metric(router_metrics_url(registry1, cluster.auth), "pdserve:request_resumptions_total")
    assert sum(served.values()) >= len(streams), served


def resumable_first(stub, prompt: str, salt: str = "", **sampling) -> tuple[pb.GenerateRequest, pb.GenerateResponse]:
    """A resumable request and its stream's first message (the rest left unread)."""
    request = pb.GenerateRequest(text=prompt, cache_salt=salt, resumable=True,
                                 sampling=pb.SamplingOptions(**sampling))
    call = stub.Generate(request, timeout=60)
    first = next(call)
    call.cancel()
    return request, first


def refused(stub, request: pb.GenerateRequest) -> str:
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value.details()


def test_hostile_resumes_are_refused_naming_the_field_while_a_victim_streams_on(cluster):
    (_, _), (public1, _) = cluster.routers
    vocab = ModelConfig.from_dir(DEFAULT_MODEL).vocab_size
    victim_sampling = dict(max_tokens=120, temperature=1.0, seed=9, ignore_eos=True)
    with Client([public1], timeout=120) as client, grpc.insecure_channel(public1) as channel:
        undisturbed = folded(list(client.generate("class Victim:\n", **victim_sampling)))
        victim = Consumer(client.generate("class Victim:\n", **victim_sampling))
        stub = pb_grpc.GenerationStub(channel)
        request, first = resumable_first(stub, "import os\n", salt="alice", max_tokens=32, temperature=0.0)
        token = first.resume_state.token
        assert len(token) > 0

        def resume(sequences, salt="alice", prompt="import os\n", token=token, **sampling):
            r = pb.GenerateRequest()
            r.CopyFrom(request)
            r.text, r.cache_salt = prompt, salt
            for k, v in sampling.items():
                setattr(r.sampling, k, v)
            r.resume.CopyFrom(pb.Resume(token=token, sequences=sequences))
            return r

        one = pb.ResumedSequence(index=0, token_ids=list(first.token_ids))
        assert "resume.sequences[0].token_ids" in refused(stub, resume([pb.ResumedSequence(index=0, token_ids=[vocab])]))
        assert "vocabulary" in refused(stub, resume([pb.ResumedSequence(index=0, token_ids=[-1])]))
        too_long = refused(stub, resume([pb.ResumedSequence(index=0, token_ids=[1] * 1024)]))
        assert "resume.sequences[0].token_ids" in too_long and "max_model_len" in too_long
        assert "max_tokens" in refused(stub, resume([pb.ResumedSequence(index=0, token_ids=[1] * 33)]))
        assert "resume.sequences" in refused(stub, resume([one, pb.ResumedSequence(index=1, token_ids=[1])]))
        assert "resume.sequences[0].index" in refused(stub, resume([pb.ResumedSequence(index=3, token_ids=[1])]))
        assert "cache_salt" in refused(stub, resume([one], salt="mallory"))
        assert "resume.token" in refused(stub, resume([one], prompt="import sys\n"))
        assert "resume.token" in refused(stub, resume([one], max_tokens=31))
        assert "resume.token" in refused(stub, resume([one], token=b"\x01" + bytes(32)))
        assert "resume" in refused(stub, resume([one], beam_width=2))
        # the genuine resume is served, as the rest of that stream
        rest = list(stub.Generate(resume([one]), timeout=60))
        whole = list(stub.Generate(pb.GenerateRequest(text="import os\n", cache_salt="alice",
                                                      sampling=request.sampling), timeout=60))
        got = list(first.token_ids) + [t for m in rest for t in m.token_ids]
        assert got == [t for m in whole for t in m.token_ids]
        victim.thread.join(120)
        assert victim.error is None, victim.error
        assert_same(folded(victim.messages), undisturbed, "victim")
