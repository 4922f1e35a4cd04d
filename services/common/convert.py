"""Between proto messages (pdserve.v1) and engine types. No policy here, beyond
refusing oversized repeated fields before they are copied.

Sampling has one type on both sides of the wire, the engine's SamplingParams; this
module is its only crossing:

    pb.SamplingOptions -> SamplingParams   params_from_options  (router adapter, workers)
    SamplingParams     -> pb.SamplingOptions  options_of        (what the router sends)

The router sends every value it validated (only what is None stays unset), so no
worker's default decides a request: `params_from_options(options_of(p), p.cache_salt
or "") == p`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams, check_field, short_repr
from pdserve.engine.structured.params import ConstraintKind, StructuredOutputs
from pdserve.engine.validation import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.proto.pdserve.v1 import pdserve_pb2 as pb

if TYPE_CHECKING:  # the engine (torch) is the workers'; the router imports this module without it
    from pdserve.engine.output import TokenDelta

_SCALARS = (
    "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "ignore_eos", "logprobs", "prompt_logprobs",
    "n", "beam_width", "length_penalty", "sample_index", "resumed_tokens",
)
_REPEATED = ("stop", "stop_token_ids")
# Every pb.SamplingOptions field, each named as SamplingParams names it.
SAMPLING_FIELDS = (*_SCALARS, *_REPEATED, "early_stopping", "structured_outputs", "logit_bias")
_EARLY_STOPPING = {"true": True, "false": False, "never": "never"}

ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "mixed": pb.ROLE_MIXED}
ROLE_NAMES = {v: k for k, v in ROLES.items()}


def params_from_options(options: pb.SamplingOptions, cache_salt: str = "") -> SamplingParams:
    """SamplingParams from the set fields (unset ones keep the engine defaults) and the
    request's cache salt. Raises ValueError naming the field for any value
    SamplingParams refuses."""
    kwargs: dict[str, object] = {name: getattr(options, name) for name in _SCALARS if options.HasField(name)}
    kwargs["cache_salt"] = cache_salt or None
    # Counted before anything is copied: a 4 MB message holds a million stop ids.
    check_field(len(options.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings",
                len(options.stop))
    check_field(len(options.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} ids", len(options.stop_token_ids))
    if options.stop:
        kwargs["stop"] = tuple(options.stop)
    if options.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(options.stop_token_ids)
    if options.HasField("early_stopping"):
        value = options.early_stopping.strip().lower()
        if value not in _EARLY_STOPPING:
            raise ValueError(f"early_stopping: must be 'true', 'false' or 'never', got {options.early_stopping!r}")
        kwargs["early_stopping"] = _EARLY_STOPPING[value]
    if options.HasField("structured_outputs"):
        kwargs["structured_outputs"] = constraint_of(options.structured_outputs)
    check_field(len(options.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens",
                len(options.logit_bias))
    if options.logit_bias:
        kwargs["logit_bias"] = tuple(options.logit_bias.items())
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def constraint_of(message: pb.StructuredOutputs) -> StructuredOutputs:
    """The engine's StructuredOutputs of a message (ValueError naming the field)."""
    which = message.WhichOneof("constraint")
    if which is None:
        raise ValueError("structured_outputs: set, but with no constraint (json_schema, json_object, regex, "
                         "choice or grammar)")
    if which == "json_object":
        if not message.json_object:
            raise ValueError("structured_outputs.json_object: must be true when set")
        return StructuredOutputs(ConstraintKind.JSON_OBJECT)
    if which == "choice":
        return StructuredOutputs(ConstraintKind.CHOICE, choices=tuple(message.choice.choices))
    return StructuredOutputs(ConstraintKind(which), getattr(message, which))


def constraint_message(constraint: StructuredOutputs) -> pb.StructuredOutputs:
    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return pb.StructuredOutputs(json_object=True)
    if kind is ConstraintKind.CHOICE:
        return pb.StructuredOutputs(choice=pb.ChoiceList(choices=constraint.choices))
    return pb.StructuredOutputs(**{kind.value: constraint.spec})


def options_of(params: SamplingParams) -> pb.SamplingOptions:
    """The options a worker is sent: every field that is not None (the cache salt
    travels in its request's own field). Raises ValueError
    naming a field whose value the proto cannot hold (an int32 field given 2**40, a
    seed past int64)."""
    options = pb.SamplingOptions()
    for name in SAMPLING_FIELDS:
        value = getattr(params, name)
        if value is None:
            continue
        try:
            if name in _REPEATED:
                getattr(options, name).extend(value)
            elif name == "early_stopping":
                options.early_stopping = value if isinstance(value, str) else str(value).lower()
            elif name == "structured_outputs":
                options.structured_outputs.CopyFrom(constraint_message(value))
            elif name == "logit_bias":
                options.logit_bias.update(dict(value))
            else:
                setattr(options, name, value)
        except (ValueError, TypeError, OverflowError):
            raise ValueError(f"{name}: out of range or of the wrong type, got {short_repr(value)}") from None
    return options


def token_logprob(token_id: int, logprob: float, top: dict[int, float] | None) -> pb.TokenLogprob:
    ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])
    return pb.TokenLogprob(
        token_id=token_id, logprob=logprob,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in ranked],
    )


def delta_logprob(delta: TokenDelta) -> pb.TokenLogprob | None:
    """The chosen token's logprob and the top-k, when the request asked for logprobs."""
    if delta.top_logprobs is None or delta.logprob is None:
        return None
    return token_logprob(delta.token_id, delta.logprob, delta.top_logprobs)


def prompt_logprobs(prompt: list[int], entries: list[dict[int, float] | None]) -> list[pb.PromptTokenLogprob]:
    """Engine prompt logprobs (None first, then {top-k..., actual}) as messages; `top`
    holds the engine's entry as is: the top-k and the actual token."""
    out = []
    for token, entry in zip(prompt, entries):
        message = pb.PromptTokenLogprob(token_id=token)
        if entry is not None:
            if token in entry:
                message.logprob = entry[token]
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            message.top.extend(pb.TopLogprob(token_id=t, logprob=lp) for t, lp in ranked)
        out.append(message)
    return out
