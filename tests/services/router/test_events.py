"""The router's events (services/router/events.py): one conversion of a worker's
message, and the operations on them, none of which changes an event."""

from __future__ import annotations

from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.router.events import Result, Tokens, Update, first_of, update_of
from pdserve.services.router.records import TokenLogprob

TOP = pb.TopLogprob(token_id=5, logprob=-0.5)


def test_a_worker_message_becomes_one_update():
    message = pb.DecodeResponse(
        deltas=[pb.SequenceDelta(index=1, token_ids=[5, 6], token_logprobs=[-0.5, -0.25], finish_reason="stop",
                                 logprobs=[pb.TokenLogprob(token_id=5, logprob=-0.5, top=[TOP]),
                                           pb.TokenLogprob(token_id=6, logprob=-0.25)])],
        finished=True, num_cached_tokens=16, num_draft_tokens=3, num_accepted_tokens=2,
        results=[pb.SequenceResult(index=1, finish_reason="stop", cumulative_logprob=-0.75, token_ids=[])],
        prompt_logprobs=[pb.PromptTokenLogprob(token_id=1), pb.PromptTokenLogprob(token_id=2, logprob=-3.0)],
    )
    update = update_of(message)
    assert update.tokens == (Tokens(1, (5, 6), (TokenLogprob(5, -0.5, ((5, -0.5),)), TokenLogprob(6, -0.25)),
                                    (-0.5, -0.25), "stop"),)
    assert update.finished and update.end.results == (Result(1, "stop", -0.75),)
    assert (update.end.num_cached_tokens, update.end.num_draft_tokens, update.end.num_accepted_tokens) == (16, 3, 2)
    assert update.end.prompt_logprobs == (TokenLogprob(1, None), TokenLogprob(2, -3.0))
    running = update_of(pb.DecodeResponse(deltas=[pb.SequenceDelta(index=0, token_ids=[1])]))
    assert not running.finished and running.tokens[0].finish_reason is None and running.has_tokens


def test_the_prefill_workers_first_token_is_sequence_0s_first_update():
    first = pb.TokenLogprob(token_id=7, logprob=-0.5, top=[pb.TopLogprob(token_id=7, logprob=-0.5)])
    assert first_of(first, with_logprobs=False) == Update((Tokens(0, (7,), (), (-0.5,)),))
    assert first_of(first, with_logprobs=True).tokens[0].logprobs == (TokenLogprob(7, -0.5, ((7, -0.5),)),)


def test_counting_adds_to_the_final_results_only_and_builds_a_new_update():
    end = update_of(pb.DecodeResponse(finished=True, results=[pb.SequenceResult(index=0, cumulative_logprob=-1.0),
                                                              pb.SequenceResult(index=1, cumulative_logprob=-2.0)]))
    counted = end.counting({0: -0.5})
    assert [r.cumulative_logprob for r in counted.end.results] == [-1.5, -2.0]
    assert [r.cumulative_logprob for r in end.end.results] == [-1.0, -2.0]  # unchanged
    running = Update((Tokens(0, (1,)),))
    assert running.counting({0: -0.5}) is running and end.counting({}) is end


def test_a_migrated_samples_update_under_its_own_index():
    update = Update((Tokens(0, (1,)),), update_of(pb.DecodeResponse(
        finished=True, results=[pb.SequenceResult(index=0, finish_reason="length")])).end)
    moved = update.as_sample(2)
    assert moved.tokens[0].index == 2 and moved.end.results == (Result(2, "length"),)
    assert update.tokens[0].index == 0


def test_a_cut_keeps_the_tokens_up_to_the_stop():
    tokens = Tokens(0, (1, 2, 3), (TokenLogprob(1, -1.0), TokenLogprob(2, -2.0), TokenLogprob(3, -3.0)),
                    (-1.0, -2.0, -3.0))
    assert tokens.cut_after(1) == Tokens(0, (1, 2), tokens.logprobs[:2], (-1.0, -2.0), "stop")
