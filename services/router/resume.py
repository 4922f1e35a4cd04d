"""Resuming a stream on another router: the client continues a stream whose router
died from the tokens it received (GenerateRequest.resume).

    client (services/router/client.py)     router A                 router B
    Generate(request, resumable) -------->  resume_state on every message:
                                            the token (first), each sequence's
    <-- tokens, logprob_sum, ended? -------  logprob_sum and finish_reason so far
                                            X  (killed: UNAVAILABLE, a broken connection)
    Generate(request, resume{token, what arrived of each sequence}) ------------------->
                                                 `Resumes.job`: the sequences checked (indices below
                                                 n and once each, token ids in the vocabulary, within
                                                 max_tokens and max_model_len, no beam search), then
                                                 the token (issued for this API key and cache_salt,
                                                 this model, prompt and sampling)
                                                 -> Job.resumed: dispatch serves it as a stream that
                                                 migrated after those tokens (migration.py: prompt +
                                                 tokens, seeded draws keyed as the uninterrupted
                                                 run's, stop strings across the cut, usage and
                                                 cumulative logprob of the whole sequence)
    <-- what A would have sent next ---------------------------------------------------

The token is two HMAC-SHA256 tags under a key every router of the cluster derives
from the cluster token (--cluster-token-file): one over the caller's API key id and
the cache salt the job runs with, one over the model, prompt and sampling. So a
resume is refused, naming the field, when its cache_salt or API key is not the
stream's (`cache_salt`), or its prompt, model or sampling are not (`resume.token`).
Nothing a resume carries reaches another caller's state: its prompt and salt are
checked as any request's, and the tokens it claims are only its own prompt's tail.
A router without a cluster token issues no token; its streams cannot be resumed.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import math
from dataclasses import replace

from pdserve.services.router.records import Resume, ResumedSequence
from pdserve.services.router.validate import Job

VERSION = b"\x01"
TAG_BYTES = 16
TOKEN_BYTES = 1 + 2 * TAG_BYTES
FINISH_REASONS = ("stop", "length", "abort")


class Resumes:
    """Issues resume tokens and turns a resume into the job that continues it."""

    def __init__(self, secret: bytes | None) -> None:
        """`secret`: the cluster token every router shares (None: no tokens issued)."""
        self._key = hmac.new(secret, b"pdserve resume tokens v1", hashlib.sha256).digest() if secret else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def token(self, job: Job, model: str, key_id: str) -> bytes:
        """The token of `job`'s stream (b"": this router signs none)."""
        if self._key is None:
            return b""
        return VERSION + self._salt_tag(job, key_id) + self._request_tag(job, model)

    def job(self, job: Job, resume: Resume, model: str, key_id: str, vocab_size: int, max_model_len: int) -> Job:
        """`job` (validated like any request) continuing after `resume`'s tokens; raises
        ValueError naming the field a resume gets wrong (the module docstring)."""
        params = job.params
        if params.use_beam_search:
            raise ValueError("resume: beam search streams nothing before its end; send the request again instead")
        n = params.n
        if len(resume.sequences) > n:
            raise ValueError(f"resume.sequences: {len(resume.sequences)} sequences, more than the request's n={n}")
        seen: set[int] = set()
        for i, seq in enumerate(resume.sequences):
            _check_sequence(i, seq, n, seen, len(job.prompt), params.max_tokens, vocab_size, max_model_len)
        if self._key is None:
            raise ValueError("resume.token: this router has no cluster token (--cluster-token-file) to verify it")
        token = resume.token
        if len(token) != TOKEN_BYTES or token[:1] != VERSION:
            raise ValueError(f"resume.token: not a resume token of this cluster ({len(token)} bytes)")
        # the request's tag first: a forged token, or another cluster's, fails there
        if not hmac.compare_digest(token[1 + TAG_BYTES:], self._request_tag(job, model)):
            raise ValueError("resume.token: not issued by this cluster for this request's prompt, model and "
                             "sampling")
        if not hmac.compare_digest(token[1:1 + TAG_BYTES], self._salt_tag(job, key_id)):
            raise ValueError("cache_salt: not the resumed stream's (resume.token was issued for another API key "
                             "or cache_salt)")
        return replace(job, resumed=tuple(sorted(resume.sequences, key=lambda s: s.index)))

    def _salt_tag(self, job: Job, key_id: str) -> bytes:
        return self._tag(b"salt", key_id.encode(), job.cache_salt.encode())

    def _request_tag(self, job: Job, model: str) -> bytes:
        sampling = replace(job, params=replace(job.params, cache_salt=None)).options
        return self._tag(b"request", model.encode(), array.array("q", job.prompt).tobytes(),
                         sampling.SerializeToString(deterministic=True))

    def _tag(self, *parts: bytes) -> bytes:
        mac = hmac.new(self._key or b"", digestmod=hashlib.sha256)
        for part in parts:  # length-prefixed: no two part lists sign alike
            mac.update(len(part).to_bytes(8, "little"))
            mac.update(part)
        return mac.digest()[:TAG_BYTES]


def _check_sequence(i: int, seq: ResumedSequence, n: int, seen: set[int], prompt_len: int, max_tokens: int,
                    vocab_size: int, max_model_len: int) -> None:
    field = f"resume.sequences[{i}]"
    if not 0 <= seq.index < n:
        raise ValueError(f"{field}.index: {seq.index} is not a sequence of the request (n={n})")
    if seq.index in seen:
        raise ValueError(f"{field}.index: sequence {seq.index} given twice")
    seen.add(seq.index)
    ids = seq.token_ids
    if prompt_len + len(ids) > max_model_len:
        raise ValueError(f"{field}.token_ids: the prompt's {prompt_len} tokens and these {len(ids)} exceed "
                         f"max_model_len {max_model_len}")
    if len(ids) > max_tokens:
        raise ValueError(f"{field}.token_ids: {len(ids)} tokens, more than max_tokens {max_tokens}")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{field}.token_ids: token id {bad} is outside the vocabulary (size {vocab_size})")
    if not math.isfinite(seq.logprob_sum):
        raise ValueError(f"{field}.logprob_sum: must be a finite number, got {seq.logprob_sum}")
    if seq.finish_reason is not None and seq.finish_reason not in FINISH_REASONS:
        raise ValueError(f"{field}.finish_reason: {seq.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}")
