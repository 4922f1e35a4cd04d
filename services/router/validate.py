"""A front-end `Request` -> a `Job` the dispatcher can run, or ValueError naming the field.

Every check the engine would make is made here first, so a bad request never
reaches a worker: model name, prompt (text or ids, non-empty, text within
--max-prompt-bytes before it is tokenized, within --max-prompt-tokens and below
max_model_len, in the vocabulary), every sampling field (the request's SamplingParams
checked its ranges when its adapter built it; here each value must fit its proto field,
then the engine's own `validate_sampling_params` with the workers' limits: n and
beam_width within --max-n, logprobs within --max-logprobs, stop strings and ids,
logit_bias's token ids in the vocabulary), prompt + max_tokens within max_model_len,
cache_salt, a structured-outputs constraint within --structured-outputs-max-bytes and
--structured-outputs-max-depth and, a JSON schema, valid against its metaschema
(structured.py: regexes and grammars are left to the workers' backends).

A Job holds one sampling type, the engine's SamplingParams, salted: what each worker
reads from the options it is sent (`Job.options`, derived, never stored).

The cache salt a job runs with is the client's, behind its tenant's name when the
router salts by API key (`tenant/salt`): a client can pick its own salt, never step
into another tenant's.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from pdserve.engine.config import DEFAULT_MAX_LOGPROBS
from pdserve.engine.hashing import hash_blocks
from pdserve.engine.sampling_params import MAX_CACHE_SALT, SamplingParams, check_field
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.validation import MAX_REQUEST_ID, SamplingLimits, validate_prompt, validate_sampling_params
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb
from pdserve.services.common.convert import options_of
from pdserve.services.router.records import Request, ResumedSequence
from pdserve.services.router.structured import ConstraintLimits, check_constraint

# A client's salt: half of what the engine takes, so the tenant in front of it (`key_id/`) always fits.
MAX_CLIENT_SALT = MAX_CACHE_SALT // 2
DEFAULT_MAX_PROMPT_BYTES = 1 << 20


@dataclass(frozen=True)
class Job:
    request_id: str  # the client's, echoed in every response
    worker_request_id: str  # unique per router: what workers see
    prompt: tuple[int, ...]
    params: SamplingParams  # cache_salt included: the one the job runs with
    block_hashes: tuple[bytes, ...]  # salted with params.cache_salt, as every worker hashes them
    # a resume (resume.py): what of each sequence reached the client before its stream
    # broke, by index; dispatch continues from there. None: a request of its own.
    resumed: tuple[ResumedSequence, ...] | None = None

    @property
    def options(self) -> pb.SamplingOptions:
        """The sampling options workers are sent: `params` on the wire (convert.py),
        parsed back by every worker into `params` itself."""
        return options_of(self.params)

    @property
    def cache_salt(self) -> str:
        """What workers get (RPC fields are strings: "" for none)."""
        return self.params.cache_salt or ""


@dataclass(frozen=True)
class Limits:
    model_name: str
    vocab_size: int
    max_model_len: int
    max_n: int
    block_size: int
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # of a text prompt, checked before tokenizing it
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    constraints: ConstraintLimits = ConstraintLimits()  # --structured-outputs-max-bytes / -max-depth

    @property
    def prompt_token_cap(self) -> int:
        longest = self.max_model_len - 1
        return longest if self.max_prompt_tokens is None else min(self.max_prompt_tokens, longest)


def check_prompt_bytes(text: str, limit: int, field: str) -> None:
    """Refuse `text` past `limit` bytes of UTF-8 (--max-prompt-bytes) before anyone
    tokenizes it (tokenizing megabytes costs the router seconds). ValueError naming `field`."""
    size = len(text.encode("utf-8", "surrogatepass"))
    check_field(size <= limit, field, f"must be at most {limit} bytes of UTF-8 (--max-prompt-bytes)", size)


class Validator:
    def __init__(self, limits: Limits, tokenizer: Tokenizer | None) -> None:
        self.limits = limits
        self.tokenizer = tokenizer

    def validate(self, request: Request, tenant: str | None = None) -> Job:
        """The job of a request; `tenant` (an API key's id) goes in front of its salt.
        The sampling fields are checked as the workers will read them: each must fit
        its proto field, then the workers' limits apply."""
        lim = self.limits
        check_field(not request.model or request.model == lim.model_name, "model",
                    f"unknown model; this router serves {lim.model_name!r}", request.model)
        if len(request.request_id) > MAX_REQUEST_ID:
            raise ValueError(f"request_id: longer than {MAX_REQUEST_ID} characters")
        prompt = self._prompt(request)
        if len(request.cache_salt) > MAX_CLIENT_SALT:
            raise ValueError(f"cache_salt: longer than {MAX_CLIENT_SALT} characters")
        salt = request.cache_salt if tenant is None else f"{tenant}/{request.cache_salt}"
        params = replace(request.sampling, cache_salt=salt or None)
        if request.fill_context:
            room = lim.max_model_len - len(prompt)
            check_field(room >= 1, "prompt", f"leaves no room for output within max_model_len {lim.max_model_len}",
                        len(prompt))
            params = replace(params, max_tokens=min(params.max_tokens, room))
        options_of(params)  # raises naming a value its proto field cannot hold
        validate_sampling_params(params, SamplingLimits(
            lim.vocab_size, max_n=lim.max_n, max_logprobs=lim.max_logprobs, has_tokenizer=self.tokenizer is not None,
        ))
        if params.structured_outputs is not None:
            check_constraint(params.structured_outputs, lim.constraints)
        validate_prompt(prompt, params, lim.vocab_size, lim.max_model_len, ids_field="token_ids")
        worker_id = uuid.uuid4().hex
        return Job(
            request.request_id or worker_id, worker_id, tuple(prompt), params,
            tuple(hash_blocks(prompt, lim.block_size, cache_salt=params.cache_salt)),
        )

    def _prompt(self, request: Request) -> list[int]:
        if request.text is None and request.token_ids is None:
            raise ValueError("prompt: set text or token_ids")
        if request.text is not None and request.token_ids is not None:
            raise ValueError("prompt: set text or token_ids, not both")
        if request.text is not None:
            if not request.text:
                raise ValueError("prompt: text must not be empty")
            check_prompt_bytes(request.text, self.limits.max_prompt_bytes, "text")
            if self.tokenizer is None:
                raise ValueError("prompt: text given but the model has no tokenizer; send token_ids")
            ids = self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
            if not ids:
                raise ValueError("prompt: text encodes to no tokens")
            return self._capped(ids)
        ids = list(request.token_ids)
        if not ids:
            raise ValueError("prompt: token_ids must not be empty")
        return self._capped(ids)

    def _capped(self, ids: list[int]) -> list[int]:
        """The prompt within --max-prompt-tokens (and below max_model_len)."""
        cap = self.limits.prompt_token_cap
        check_field(len(ids) <= cap, "prompt", f"may hold at most {cap} tokens (--max-prompt-tokens, "
                    f"max_model_len {self.limits.max_model_len})", len(ids))
        return ids
