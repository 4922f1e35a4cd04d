"""The KV-transfer wire format (version 3): pure frames, no state.

What a receiver does with a message (which reservation it fills, when it is
accepted, refused or fails its transfer) is kvtransfer/inbox.py's; this module only
says what the bytes are, how they are encoded and decoded, and how a message proves
the reservation's secret.

A message is a multipart ZeroMQ message:

    frame 0       header: a msgpack map, at most MAX_HEADER_BYTES, no pickle anywhere
    frame 1..n    raw page bytes, one frame per run (`pages` headers), or the EAGLE
                  head's state in frames of at most the receiver's frame size (a
                  `final` header whose `draft` is not nil)

Over torch.distributed the header still travels over ZeroMQ and each run follows as
one point-to-point tensor instead of a frame.

Page bytes are the engine's KV layout, byte for byte. Block b of layer l is the
contiguous page `kv_cache[l, b]` = [2 (K, V), block_size, num_kv_heads, head_dim] of
`dtype` (float32, float16, bfloat16, or float8_e4m3fn / float8_e5m2 for an FP8 cache:
a quarter of float32's bytes, moved as stored, never converted); a run of n blocks is
n * page_bytes bytes:

    prompt     [ blk 0 | blk 1 | blk 2 | blk 3 | blk 4 ]     block *indices* on the wire
    reserved   [  17   |  18   |  19   |   4   |   5   ]     the receiver's block ids
                 cached          run (2, 1)    run (3, 2)     <- runs [first, count]

What the bytes mean beyond shape and dtype (the weights' quantization, an FP8
cache's K/V scales) is the layout's `kv_format`: the transfer plan carries the
decode worker's layout, and the prefill worker refuses a plan whose layout is not
its own (LayoutMismatch) before any page leaves. Every pages header names its
dtype and page shape again, and the receiver drops pages that are not its own.
Blocks are named by their index in the prompt's block table, never by a worker's
physical block id (inbox.py maps an index to a reserved block).

Headers (every key is required; unknown keys are ignored):

    pages    v kind rid seq layer runs nbytes dtype page via mac
    final    v kind rid seq num_tokens digest first draft mac
    abort    v kind rid reason mac
    ack      v kind rid ok reason
    hello    v kind pair                  (torch.distributed pairing, sender -> receiver)
    welcome  v kind pair host port rank   (receiver -> sender)

Only the sender the router chose may fill a reservation. The decode worker draws a
one-time secret for each reservation (`new_secret`); it travels in the transfer plan
over the cluster's authenticated gRPC channels to that one prefill worker, and every
pages, final and abort message carries `mac` = HMAC-SHA256(secret, its other fields)
(`sign`, checked by `proves`). A fresh secret per reservation means a secret, or a
message, from an earlier reservation proves nothing. The mac covers the header, and
so every page's position and length; page bytes are protected in transit by CURVE
(kvtransfer/transports/zmq.py), which the launchers always turn on.

`seq` numbers a request's pages and final messages 0, 1, 2, ... in sending order
(what the receiver does with a replay or a gap: inbox.py).

A final message's `draft` is nil, or [base, nbytes, dtype]: the prefill worker's EAGLE
head state for the prompt (engine/spec/draft_state.py DraftState), its bytes in the frames
after the header: the head's KV rows base .. num_tokens-2 ([rows, 2, kv_heads,
head_dim], row-major) and then the target's feature at num_tokens-1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import msgpack
import torch

from pdserve.engine.validation import MAX_REQUEST_ID

if TYPE_CHECKING:
    from pdserve.engine.spec.draft_state import DraftState

VERSION = 3  # 3: final messages carry `draft` (an EAGLE head's state)
MAX_HEADER_BYTES = 1 << 16
MAX_REASON_CHARS = 1024
MAX_FIRST_TOKENS = 16
MAX_INT = (1 << 63) - 1
DIGEST_BYTES = 32
MAC_BYTES = 32
SECRET_BYTES = 32  # a reservation secret as drawn; at least MIN_SECRET_BYTES accepted
MIN_SECRET_BYTES = 16
_MAC_DOMAIN = b"pdserve/kv-message/v2"
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,  # --kv-cache-dtype fp8*: moved as stored
}
MAX_FORMAT_CHARS = 256


class WireError(ValueError):
    """A message the receiver refuses. `reason` is a short code, counted in stats."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class TransferError(RuntimeError):
    """A transfer cannot go on (peer not accepting, connection broken, pairing failed)."""


# -- page layout --------------------------------------------------------------------


@dataclass(frozen=True)
class PageLayout:
    """What one KV page is; sender and receiver must agree on it exactly.

    Shape and dtype say how many bytes a page has; `kv_format` says what they mean
    beyond that (the engine's ModelRunner.kv_format: the weights' quantization scheme,
    which the K and V projections ran in, and a float8 cache's per-layer K/V scales).
    Pages are moved as stored, never converted, so two workers whose layouts differ
    in any field (`differences`) do not pair."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_format: str = ""  # "" where the caller does not know it (tests, benches): equal only to ""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} not one of {sorted(DTYPES)}")
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if not isinstance(self.kv_format, str) or len(self.kv_format) > MAX_FORMAT_CHARS:
            raise ValueError(f"kv_format: must be a string of at most {MAX_FORMAT_CHARS} chars")

    @classmethod
    def of(cls, kv_cache: torch.Tensor, kv_format: str = "") -> "PageLayout":
        """The layout of an engine KV tensor [layers, blocks, 2, block_size, heads, head_dim]
        whose pages mean `kv_format` (the engine's ModelRunner.kv_format)."""
        names = {v: k for k, v in DTYPES.items()}
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2 or kv_cache.dtype not in names:
            raise ValueError(f"kv_cache: not an engine KV tensor ({tuple(kv_cache.shape)}, {kv_cache.dtype})")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache: must be contiguous")
        layers, _, _, block_size, heads, head_dim = kv_cache.shape
        return cls(layers, block_size, heads, head_dim, names[kv_cache.dtype], kv_format)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def wire_page(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def differences(self, other: "PageLayout") -> list[str]:
        """The fields in which `other` differs from this layout (none: they pair)."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def describe(self) -> str:
        """E.g. 'float8_e4m3fn pages [16, 2, 64] x 4 layers (weights=int8/online;kv_scales=...)'."""
        return (f"{self.dtype} pages {list(self.wire_page)} x {self.num_layers} layers"
                f" ({self.kv_format or 'format not given'})")

    def to_wire(self) -> dict[str, Any]:
        return {"layers": self.num_layers, "page": list(self.wire_page), "dtype": self.dtype, "format": self.kv_format}

    @classmethod
    def from_wire(cls, d: Any) -> "PageLayout":
        if not isinstance(d, dict):
            raise ValueError("layout: must be a map")
        page = d.get("page")
        if not isinstance(page, list) or len(page) != 3:
            raise ValueError("layout.page: must be [block_size, num_kv_heads, head_dim]")
        if not isinstance(d.get("format"), str):  # a layout that does not say what its pages mean pairs with none
            raise ValueError("layout.format: must be a string")
        return cls(d.get("layers"), page[0], page[1], page[2], d.get("dtype"), d["format"])


class LayoutMismatch(ValueError):
    """A prefill and a decode worker whose pages differ (dtype, shape or format): they
    cannot pair, whichever request asks; a configuration error, not the request's."""

    def __init__(self, what: str, theirs: PageLayout, ours: PageLayout, their_role: str, our_role: str) -> None:
        differ = " and ".join(ours.differences(theirs))
        super().__init__(f"{what}: {differ} differ: the {their_role} holds {theirs.describe()}, "
                         f"the {our_role} {ours.describe()}; pages move as stored, never converted: start both "
                         "with the same --dtype, --quantization, --kv-cache-dtype and checkpoint (its KV scales)")
        self.theirs, self.ours = theirs, ours


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """A fingerprint of the whole prompt: the final message proves the pages belong to it."""
    if any(not 0 <= t <= MAX_INT for t in token_ids):
        raise ValueError("token_ids: must be in [0, 2**63)")
    h = hashlib.sha256(b"pdserve/kv-prompt/v1")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def as_bytes_view(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor, sharing its memory (any dtype)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor: need a contiguous CPU tensor for a byte view")
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


# -- headers --------------------------------------------------------------------------


@dataclass(frozen=True)
class PagesHeader:
    request_id: str
    seq: int
    layer: int
    runs: tuple[tuple[int, int], ...]  # (first block index, number of blocks)
    nbytes: tuple[int, ...]  # bytes of each run
    dtype: str
    page: tuple[int, int, int]  # block_size, num_kv_heads, head_dim
    via: str = "frames"  # "frames": runs follow as frames; "p2p": as torch.distributed tensors
    mac: bytes = b""  # see `sign`
    kind = "pages"

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes)


@dataclass(frozen=True)
class FinalHeader:
    request_id: str
    seq: int
    num_tokens: int
    digest: bytes
    first_tokens: tuple[int, ...]
    draft: tuple[int, int, str] | None = None  # (base, nbytes, dtype) of the head state that follows
    mac: bytes = b""
    kind = "final"


@dataclass(frozen=True)
class AbortHeader:
    request_id: str
    reason: str
    mac: bytes = b""
    kind = "abort"


@dataclass(frozen=True)
class AckHeader:
    request_id: str
    ok: bool
    reason: str
    kind = "ack"


@dataclass(frozen=True)
class HelloHeader:
    pair: str
    kind = "hello"


@dataclass(frozen=True)
class WelcomeHeader:
    pair: str
    host: str
    port: int
    rank: int
    kind = "welcome"


Header = Union[PagesHeader, FinalHeader, AbortHeader, AckHeader, HelloHeader, WelcomeHeader]
Signed = Union[PagesHeader, FinalHeader, AbortHeader]


# -- proof of the reservation secret ---------------------------------------------------


def new_secret() -> bytes:
    """A fresh one-time reservation secret."""
    return os.urandom(SECRET_BYTES)


def check_secret(secret: object, what: str = "secret") -> bytes:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{what}: a reservation secret of at least {MIN_SECRET_BYTES} bytes is required")
    return secret


def _signed_fields(h: Signed) -> list[Any]:
    if isinstance(h, PagesHeader):
        return [h.request_id, h.seq, h.layer, [list(r) for r in h.runs], list(h.nbytes), h.dtype, list(h.page), h.via]
    if isinstance(h, FinalHeader):
        return [h.request_id, h.seq, h.num_tokens, h.digest, list(h.first_tokens),
                None if h.draft is None else list(h.draft)]
    return [h.request_id, h.reason]


def message_mac(secret: bytes, h: Signed) -> bytes:
    """HMAC-SHA256 over a canonical encoding of every field of `h` but its mac."""
    body = msgpack.packb([VERSION, h.kind, *_signed_fields(h)], use_bin_type=True)
    return hmac.new(secret, _MAC_DOMAIN + body, hashlib.sha256).digest()


def sign(h: Signed, secret: bytes) -> Signed:
    """`h` carrying the proof that its sender holds the reservation's secret."""
    return dataclasses.replace(h, mac=message_mac(secret, h))


def proves(h: Signed, secret: bytes) -> bool:
    return hmac.compare_digest(h.mac, message_mac(secret, h))


def final_message(request_id: str, seq: int, secret: bytes, num_tokens: int, digest: bytes,
                  first_tokens: Sequence[int], draft: DraftState | None, max_frame_bytes: int) -> list[Any]:
    """The frames of a signed final message: its header, then the EAGLE head's state
    `draft` (if any: its KV rows, then its feature) in frames of at most
    `max_frame_bytes`, views of one buffer."""
    frames: list[Any] = []
    described = None
    if draft is not None:
        flat = torch.cat([draft.kv.reshape(-1).view(torch.uint8), draft.feature.reshape(-1).view(torch.uint8)])
        data = as_bytes_view(flat)
        frames = [data[i : i + max_frame_bytes] for i in range(0, len(data), max_frame_bytes)]
        described = (draft.base, len(data), str(draft.kv.dtype).removeprefix("torch."))
    header = FinalHeader(request_id, seq, num_tokens, digest, tuple(first_tokens), described)
    return [encode(sign(header, secret)), *frames]


def abort_message(request_id: str, secret: bytes, reason: str) -> list[bytes]:
    """The one frame of a signed abort message (the reason cut to fit)."""
    return [encode(sign(AbortHeader(request_id, reason[:1000]), secret))]


def encode(h: Header) -> bytes:
    """The header frame of a message (msgpack map)."""
    d: dict[str, Any] = {"v": VERSION, "kind": h.kind}
    if isinstance(h, PagesHeader):
        d.update(rid=h.request_id, seq=h.seq, layer=h.layer, runs=[list(r) for r in h.runs],
                 nbytes=list(h.nbytes), dtype=h.dtype, page=list(h.page), via=h.via, mac=h.mac)
    elif isinstance(h, FinalHeader):
        d.update(rid=h.request_id, seq=h.seq, num_tokens=h.num_tokens, digest=h.digest, first=list(h.first_tokens),
                 draft=None if h.draft is None else list(h.draft), mac=h.mac)
    elif isinstance(h, AbortHeader):
        d.update(rid=h.request_id, reason=h.reason, mac=h.mac)
    elif isinstance(h, AckHeader):
        d.update(rid=h.request_id, reason=h.reason, ok=h.ok)
    elif isinstance(h, HelloHeader):
        d["pair"] = h.pair
    elif isinstance(h, WelcomeHeader):
        d.update(pair=h.pair, host=h.host, port=h.port, rank=h.rank)
    else:
        raise TypeError(f"header: unknown type {type(h).__name__}")
    return msgpack.packb(d, use_bin_type=True)


def decode(raw: bytes | memoryview) -> Header:
    """Parse and validate a header frame; raises WireError, never anything else."""
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError("oversized", f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise WireError("bad_header", f"not a msgpack map ({type(exc).__name__})") from None
    if not isinstance(d, dict):
        raise WireError("bad_header", "header is not a map")
    version = d.get("v")
    if version != VERSION or isinstance(version, bool):
        raise WireError("bad_version", f"version {version!r}, this receiver speaks {VERSION}")
    parse = _PARSERS.get(d.get("kind")) if isinstance(d.get("kind"), str) else None
    if parse is None:
        raise WireError("bad_kind", f"unknown kind {d.get('kind')!r}")
    return parse(d)


def _check_int(v: Any, key: str, lo: int = 0, hi: int = MAX_INT) -> int:
    if v.__class__ is not int or not lo <= v <= hi:  # bool is a subclass of int: refused
        raise WireError("bad_header", f"{key}: {v!r} is not an int in [{lo}, {hi}]")
    return v


def _int(d: dict, key: str, lo: int = 0, hi: int = MAX_INT) -> int:
    return _check_int(d.get(key), key, lo, hi)


def _str(d: dict, key: str, max_chars: int, min_chars: int = 0) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not min_chars <= len(v) <= max_chars:
        raise WireError("bad_header", f"{key}: must be a string of {min_chars}..{max_chars} chars")
    return v


def _int_list(d: dict, key: str, max_len: int, lo: int = 0, hi: int = MAX_INT) -> tuple[int, ...]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) > max_len:
        raise WireError("bad_header", f"{key}: must be a list of at most {max_len} ints")
    return tuple(_check_int(x, key, lo, hi) for x in v)


def _rid(d: dict) -> str:
    return _str(d, "rid", MAX_REQUEST_ID, 1)


def _mac(d: dict) -> bytes:
    v = d.get("mac")
    if not isinstance(v, bytes) or len(v) != MAC_BYTES:
        raise WireError("bad_header", f"mac: must be {MAC_BYTES} bytes")
    return v


def _parse_pages(d: dict) -> PagesHeader:
    runs_raw = d.get("runs")
    if not isinstance(runs_raw, list) or not 1 <= len(runs_raw) <= 1 << 16:
        raise WireError("bad_header", "runs: must be a non-empty list of [first, count]")
    runs = []
    for r in runs_raw:
        if r.__class__ is not list or len(r) != 2:
            raise WireError("bad_header", "runs: each run is [first, count]")
        runs.append((_check_int(r[0], "runs.first"), _check_int(r[1], "runs.count", 1)))
    nbytes = _int_list(d, "nbytes", len(runs))
    if len(nbytes) != len(runs):
        raise WireError("bad_length", f"nbytes: {len(nbytes)} lengths for {len(runs)} runs")
    page = _int_list(d, "page", 3, 1)
    if len(page) != 3:
        raise WireError("bad_header", "page: must be [block_size, num_kv_heads, head_dim]")
    via = d.get("via")
    if via not in ("frames", "p2p"):
        raise WireError("bad_header", f"via: {via!r} is not 'frames' or 'p2p'")
    return PagesHeader(
        _rid(d), _int(d, "seq"), _int(d, "layer"), tuple(runs), nbytes,
        _str(d, "dtype", 16), (page[0], page[1], page[2]), via, _mac(d),
    )


def _parse_final(d: dict) -> FinalHeader:
    digest = d.get("digest")
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise WireError("bad_header", f"digest: must be {DIGEST_BYTES} bytes")
    first = _int_list(d, "first", MAX_FIRST_TOKENS, 0, (1 << 31) - 1)
    if "draft" not in d:
        raise WireError("bad_header", "draft: required (nil or [base, nbytes, dtype])")
    raw, draft = d["draft"], None
    if raw is not None:
        if raw.__class__ is not list or len(raw) != 3 or not isinstance(raw[2], str) or len(raw[2]) > 16:
            raise WireError("bad_header", "draft: must be nil or [base, nbytes, dtype]")
        draft = (_check_int(raw[0], "draft.base"), _check_int(raw[1], "draft.nbytes", 1), raw[2])
    return FinalHeader(_rid(d), _int(d, "seq"), _int(d, "num_tokens", 1), digest, first, draft, _mac(d))


def _parse_abort(d: dict) -> AbortHeader:
    return AbortHeader(_rid(d), _str(d, "reason", MAX_REASON_CHARS), _mac(d))


def _parse_ack(d: dict) -> AckHeader:
    ok = d.get("ok")
    if not isinstance(ok, bool):
        raise WireError("bad_header", "ok: must be a bool")
    return AckHeader(_rid(d), ok, _str(d, "reason", MAX_REASON_CHARS))


def _parse_hello(d: dict) -> HelloHeader:
    return HelloHeader(_str(d, "pair", 64, 1))


def _parse_welcome(d: dict) -> WelcomeHeader:
    return WelcomeHeader(_str(d, "pair", 64, 1), _str(d, "host", 255, 1), _int(d, "port", 1, 65535), _int(d, "rank", 0, 1))


_PARSERS: dict[str, Callable[[dict], Header]] = {
    "pages": _parse_pages, "final": _parse_final, "abort": _parse_abort,
    "ack": _parse_ack, "hello": _parse_hello, "welcome": _parse_welcome,
}
