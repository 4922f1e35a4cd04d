"""The KV-transfer wire format (version 3) and the receiver's rules for accepting it.

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
physical block id: the receiver maps an index to the block it reserved itself, so
no header can point a write at another request's block, and indices below the
receiver's cached prefix (`skip`) are refused.

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
(`sign`). A message whose mac does not prove the secret fails the reservation (its
blocks are freed; nothing it carried is kept), unless the reservation is already
bound to another sender, whose transfer it then leaves alone. A fresh secret per
reservation means a secret, or a message, from an earlier reservation proves nothing.
The mac covers the header, and so every page's position and length; page bytes are
protected in transit by CURVE (kvtransfer/zmq.py), which the launchers always turn on.

`seq` numbers a request's pages and final messages 0, 1, 2, ... in sending order.
The receiver accepts exactly the next number: a smaller one is a replay and a larger
one means a message was lost; either fails the transfer. A final message is accepted
only when every page of every layer from `skip` on has arrived intact, and only then
may the pages enter the decode worker's prefix cache (on commit).

A final message's `draft` is nil, or [base, nbytes, dtype]: the prefill worker's EAGLE
head state for the prompt (engine/spec/draft_state.py DraftState), its bytes in the frames
after the header: the head's KV rows base .. num_tokens-2 ([rows, 2, kv_heads,
head_dim], row-major) and then the target's feature at num_tokens-1. The receiver
takes it only if it expects one (its own head's DraftLayout) and nbytes and dtype
are exactly that layout's for those rows; anything else fails the transfer.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, Union

import msgpack
import torch

from pdserve.engine.spec.draft_state import DraftLayout, DraftState
from pdserve.engine.validation import MAX_REQUEST_ID

VERSION = 3  # 3: final messages carry `draft` (an EAGLE head's state)
MAX_HEADER_BYTES = 1 << 16
MAX_REASON_CHARS = 1024
MAX_FIRST_TOKENS = 16
MAX_ENDED = 4096  # ended reservations an Inbox remembers, to tell their late senders
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


# -- the receiver's table -------------------------------------------------------------


@dataclass(frozen=True)
class TransferEvent:
    """A transfer reached a terminal state on the receiver (done, or failed with a reason)."""

    request_id: str
    ok: bool
    reason: str = ""
    first_tokens: tuple[int, ...] = ()
    peer: bytes | None = None
    nbytes: int = 0
    draft: DraftState | None = None  # the prefill worker's EAGLE head state, when one came


@dataclass
class _Expected:
    """One reservation waiting for pages. `have[layer][i]` is 1 once page i of that layer
    arrived intact; `missing` counts the zeros at indices >= skip."""

    request_id: str
    block_ids: tuple[int, ...]
    skip: int
    num_tokens: int
    digest: bytes
    secret: bytes  # every message of the transfer proves it (see `sign`)
    draft: DraftLayout | None  # the head state it takes with the final message (None: none)
    have: list[bytearray]
    missing: int
    peer: bytes | None = None
    next_seq: int = 0
    nbytes: int = 0
    started: bool = False  # a message proving the secret has begun to land
    writing: bool = False  # a message's bytes are landing in its blocks right now
    doomed: str | None = None  # cancelled while writing: fail when the write ends


class Landing:
    """Where one run's bytes land: straight in the reserved pages when their block ids are
    consecutive (and, for `host` byte transports, on the CPU); otherwise in a staging
    buffer that `commit` scatters into those pages."""

    def __init__(self, kv: torch.Tensor, layer: int, block_ids: Sequence[int], host: bool,
                 layer_bytes: memoryview | None = None) -> None:
        self._kv, self._layer, self._ids = kv, layer, block_ids
        first, n = block_ids[0], len(block_ids)
        consecutive = block_ids[-1] - first == n - 1 and all(b == first + i for i, b in enumerate(block_ids))
        self._staged = not consecutive or (host and kv.device.type != "cpu")
        self._view: memoryview | None = None
        self._tensor: torch.Tensor | None = None
        if self._staged:
            device = torch.device("cpu") if host else kv.device
            pin = host and kv.device.type == "cuda"
            self._tensor = torch.empty((n, *kv.shape[2:]), dtype=kv.dtype, device=device, pin_memory=pin)
            self.nbytes = self._tensor.numel() * self._tensor.element_size()
        elif host and layer_bytes is not None:
            page = layer_bytes.nbytes // kv.shape[1]
            self._view = layer_bytes[first * page : (first + n) * page]  # no torch call: cheap
            self.nbytes = self._view.nbytes
        else:
            self.nbytes = self.tensor.numel() * self.tensor.element_size()

    @property
    def tensor(self) -> torch.Tensor:
        """The landing area as pages [n, 2, block_size, heads, head_dim] (for p2p receives)."""
        if self._tensor is None:
            self._tensor = self._kv[self._layer, self._ids[0] : self._ids[0] + len(self._ids)]
        return self._tensor

    def buffer(self) -> memoryview:
        """Writable bytes of the landing area (CPU only)."""
        return self._view if self._view is not None else as_bytes_view(self.tensor)

    def commit(self) -> None:
        if self._staged:  # as bytes: torch has no index_copy_ for float8 pages
            index = torch.tensor(list(self._ids), device=self._kv.device)
            pages = self.tensor.to(self._kv.device).view(torch.uint8)
            self._kv[self._layer].view(torch.uint8).index_copy_(0, index, pages)


class Inbox:
    """The receiver's transfers: which blocks each may fill, what has landed, and the
    acknowledgements owed. Bytes and acknowledgements only: whether and when a request
    waits, expires or is freed is its owner's (services/worker/requests.py), which
    ends a transfer here with `cancel`.

        expect ──first proven message──> (started) ──final, all pages──> done event
           │ cancel / bad message / sender abort / lost connection ──> failed event
           └ cancel while a write lands: the failed event follows when the write ends

    Thread-safe: the engine thread calls `expect`/`cancel`, a transport thread feeds
    messages. Every write into the KV tensor happens inside `pages()` under the lock and
    only into blocks of a live reservation at indices >= its `skip`; once a transfer is
    done or failed it leaves the table before its event is published, so nothing writes
    its blocks after the engine learns of it (and maybe frees them).
    """

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.layout = PageLayout.of(kv_cache)
        self.kv = kv_cache
        self.lock = threading.RLock()
        self.rejected: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()
        self._table: dict[str, _Expected] = {}
        self._events: list[TransferEvent] = []
        self._started: list[str] = []  # transfers whose first proven message began to land
        # Reservations that ended before any sender was bound to them (no message
        # accepted): their secret and why, so the first message their sender sends
        # later (proving the secret) is answered with a failed ack, and the sender
        # frees its held blocks at once instead of at its lease's end. Bounded.
        self._ended: OrderedDict[str, tuple[bytes, str]] = OrderedDict()
        self._replies: list[tuple[bytes, AckHeader]] = []  # (peer, failed ack) to send: see `take_replies`
        # Flat bytes of each layer, so a landing is a memoryview slice (no torch call).
        self._layer_bytes = [as_bytes_view(kv_cache[i]) for i in range(kv_cache.shape[0])] if kv_cache.device.type == "cpu" else None

    # -- engine side -------------------------------------------------------------

    def expect(self, request_id: str, block_ids: Sequence[int], skip: int, num_tokens: int,
               digest: bytes, secret: bytes, draft: DraftLayout | None = None) -> None:
        """Register a reservation: pages of blocks [skip, len(block_ids)) will arrive, in
        messages that prove `secret` (which only the chosen sender knows), and maybe
        the head state of `draft`'s layout with the final message."""
        check_secret(secret)
        n = len(block_ids)
        num_blocks = self.kv.shape[1]
        if not 0 <= skip <= n or any(not 0 <= b < num_blocks for b in block_ids):
            raise ValueError(f"block_ids: out of range for {request_id!r}")
        if -(-num_tokens // self.layout.block_size) != n:
            raise ValueError(f"num_tokens: {num_tokens} tokens do not fill {n} blocks")
        with self.lock:
            if request_id in self._table:
                raise ValueError(f"request_id: {request_id!r} is already expected")
            have = [bytearray(n) for _ in range(self.layout.num_layers)]
            missing = (n - skip) * self.layout.num_layers
            self._table[request_id] = _Expected(
                request_id, tuple(block_ids), skip, num_tokens, digest, secret, draft, have, missing,
            )

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Fail a reservation (its owner gave up on it: aborted, or its deadline passed).
        True when nothing writes its blocks any more, so the engine may free them now;
        False while a message is landing in them: the failed event follows when that
        write ends (bounded by the transport's timeout), and the blocks must be freed
        only then. Never waits for the network."""
        with self.lock:
            t = self._table.get(request_id)
            if t is None:
                return True
            if t.writing:
                t.doomed = t.doomed or reason
                return False
            self._fail(t, reason)
            return True

    def has_events(self) -> bool:
        """Events or replies to hand out (a racy peek is fine: the takes are locked)."""
        return bool(self._events or self._replies)

    def take_replies(self) -> list[tuple[bytes, AckHeader]]:
        """Failed acks for senders of reservations that had already ended (not events:
        nothing changed state); the transport sends each to its peer."""
        with self.lock:
            replies, self._replies = self._replies, []
            return replies

    def take_events(self) -> list[TransferEvent]:
        with self.lock:
            events, self._events = self._events, []
            return events

    def take_started(self) -> list[str]:
        """Transfers whose first message proving their secret began to land since the
        last call (each once; not events: nothing ended)."""
        with self.lock:
            started, self._started = self._started, []
            return started

    def pending(self) -> list[str]:
        with self.lock:
            return list(self._table)

    def fail_peer(self, peer: bytes, reason: str, request_id: str | None = None) -> None:
        """The connection to a sender broke: fail its transfers now (and `request_id`'s,
        if no other sender holds it) instead of leaving them to their owners' deadlines."""
        with self.lock:
            for t in list(self._table.values()):
                if t.peer == peer or (t.request_id == request_id and t.peer is None):
                    if t.writing:
                        t.doomed = t.doomed or reason
                    else:
                        self._fail(t, reason)

    # -- transport side ----------------------------------------------------------

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] += 1

    @contextlib.contextmanager
    def pages(self, h: PagesHeader, peer: bytes, host: bool = True) -> Iterator[list[Landing]]:
        """Validate a pages header and yield where each run must land.

        The caller fills every landing (raising WireError if the bytes do not match);
        on a clean exit the pages count as received, on any exception none of this
        message's pages do, and the exception propagates (the caller counts it). The
        lock is not held while the bytes land: the transfer is marked `writing`, so a
        cancel meanwhile is deferred until the write ends (one transport thread writes,
        so at most one message per transfer is in flight).
        """
        with self.lock:
            t = self._admit(h, peer)
            layer_bytes = self._layer_bytes[h.layer] if self._layer_bytes is not None else None
            landings = [Landing(self.kv, h.layer, t.block_ids[f : f + c], host, layer_bytes) for f, c in h.runs]
            t.writing = True
            if not t.started:
                t.started = True
                self._started.append(t.request_id)
        ok = False
        try:
            yield landings
            for landing in landings:
                landing.commit()
            ok = True
        finally:
            with self.lock:
                t.writing = False
                self._mark(t, h, 1 if ok else 0)
                if ok:
                    t.peer = peer  # the first accepted message binds the transfer to its sender
                    t.next_seq += 1
                    t.nbytes += h.total_bytes
                    self.stats["bytes"] += h.total_bytes
                    self.stats["messages"] += 1
                if t.doomed is not None:
                    self._fail(t, t.doomed)

    def final(self, h: FinalHeader, peer: bytes, src: FrameSource | None = None) -> None:
        """The last message: complete the transfer (or fail it if pages are missing, or
        the head state in its frames (`src`) is not what the reservation takes)."""
        with self.lock:
            t = self._check_seq(self._proven(h, peer), h.seq, peer)
            if t is None:
                return
            t.peer = peer
            if h.num_tokens != t.num_tokens or h.digest != t.digest:
                self._fail(t, "final: prompt does not match the reservation")
                return
            if t.missing:
                self._fail(t, f"final: {t.missing} pages never arrived intact")
                return
            draft = None
            if h.draft is not None:
                try:
                    draft = _read_draft(t, h.draft, src)
                except WireError as exc:
                    self._fail(t, f"final: {exc}")
                    raise
            del self._table[t.request_id]
            self.stats["done"] += 1
            self._events.append(TransferEvent(t.request_id, True, "", h.first_tokens, t.peer, t.nbytes, draft))

    def abort(self, h: AbortHeader, peer: bytes) -> None:
        """The sender gave up: fail the transfer now instead of leaving it to its owner's deadline."""
        with self.lock:
            t = self._proven(h, peer)
            t.peer = peer
            self._fail(t, f"sender aborted: {h.reason}")

    # -- internals ---------------------------------------------------------------

    def _proven(self, h: Signed, peer: bytes) -> _Expected:
        """The transfer a message belongs to, once the message proves its secret.

        A message from a sender other than the one a transfer is bound to is refused
        and leaves the transfer alone. Otherwise a message that does not prove the
        secret (a stranger, a wrong or stale secret) fails the transfer: its blocks
        are freed and nothing received for it is ever committed or cached."""
        t = self._table.get(h.request_id)
        if t is None:
            ended = self._ended.get(h.request_id)
            if ended is not None and proves(h, ended[0]):  # its sender, late: tell it (once)
                del self._ended[h.request_id]
                self._replies.append((peer, AckHeader(h.request_id, False, ended[1])))
                raise WireError("ended_request", f"the reservation for {h.request_id!r} has ended: {ended[1]}")
            raise WireError("unknown_request", f"no reservation for {h.request_id!r}")
        if t.peer is not None and t.peer != peer:
            raise WireError("wrong_peer", f"{h.request_id!r} is bound to another sender")
        if not proves(h, t.secret):
            self._fail(t, f"{h.kind} message without the reservation's secret")
            raise WireError("bad_mac", f"{h.kind} for {h.request_id!r} does not prove the reservation's secret")
        return t

    def _check_seq(self, t: _Expected, seq: int, peer: bytes) -> _Expected | None:
        """`t` if `seq` is the next number; None if a replay or a gap just failed it."""
        if seq == t.next_seq:
            return t
        t.peer = peer  # so the sender hears why
        what = "replayed" if seq < t.next_seq else "lost"
        self._fail(t, f"messages {what}: seq {seq}, expected {t.next_seq}")
        return None

    def _admit(self, h: PagesHeader, peer: bytes) -> _Expected:
        lay = self.layout
        t = self._proven(h, peer)
        if h.dtype != lay.dtype or h.page != lay.wire_page:
            raise WireError("bad_layout", f"pages {h.dtype} {h.page}, receiver holds {lay.dtype} {lay.wire_page}")
        if h.layer >= lay.num_layers:
            raise WireError("out_of_range", f"layer {h.layer} >= {lay.num_layers}")
        end = -1
        for (first, count), nbytes in zip(h.runs, h.nbytes):
            if first < t.skip or first + count > len(t.block_ids) or first < end:
                raise WireError("out_of_range", f"run [{first}, {first + count}) outside [{t.skip}, {len(t.block_ids)}) or overlapping")
            if nbytes != count * lay.page_bytes:
                raise WireError("bad_length", f"run of {count} pages declares {nbytes} bytes, expected {count * lay.page_bytes}")
            end = first + count
        if self._check_seq(t, h.seq, peer) is None:
            raise WireError("bad_sequence", f"seq {h.seq} out of order failed {h.request_id!r}")
        return t

    def _mark(self, t: _Expected, h: PagesHeader, value: int) -> None:
        row = t.have[h.layer]
        for first, count in h.runs:
            had = row.count(1, first, first + count)
            row[first : first + count] = bytes([value]) * count
            t.missing += had - (count if value else 0)

    def _fail(self, t: _Expected, reason: str) -> None:
        del self._table[t.request_id]
        if t.peer is None:  # no sender hears of it now: tell it when it shows up
            self._ended[t.request_id] = (t.secret, reason)
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
        self.stats["failed"] += 1
        self._events.append(TransferEvent(t.request_id, False, reason, (), t.peer, t.nbytes))


def _read_draft(t: _Expected, draft: tuple[int, int, str], src: FrameSource | None) -> DraftState:
    """The head state that follows a final header, checked against the reservation's
    layout by dtype and size before a byte is read; WireError if it does not fit."""
    base, nbytes, dtype = draft
    layout = t.draft
    if layout is None:
        raise WireError("bad_draft", "head state sent to a worker without an EAGLE head")
    ours = str(layout.dtype).removeprefix("torch.")
    if dtype != ours:
        raise WireError("bad_draft", f"head state of {dtype}, this worker's head holds {ours}")
    if base > t.num_tokens - 1:
        raise WireError("bad_draft", f"head state from position {base} of a {t.num_tokens}-token prompt")
    rows = t.num_tokens - 1 - base
    want = rows * layout.row_bytes + layout.feature_bytes
    if nbytes != want:
        raise WireError("bad_draft", f"head state of {nbytes} bytes, {rows} rows and a feature of this worker's "
                                     f"head are {want}")
    buf = bytearray(want)
    view, got = memoryview(buf), 0
    while src is not None and src.more():
        n = src.recv_into(view[got:])
        if n > want - got:
            raise WireError("oversized", f"head state frames exceed the {want} bytes declared")
        got += n
    if got != want:
        raise WireError("truncated", f"head state of {got} bytes, {want} declared")
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    kv_bytes = rows * layout.row_bytes
    kv = flat[:kv_bytes].view(layout.dtype).view(rows, 2, layout.num_kv_heads, layout.head_dim)
    return DraftState(base, kv, flat[kv_bytes:].view(layout.dtype))


# -- reading one message -----------------------------------------------------------


class FrameSource(Protocol):
    """The frames of one incoming message after the sender's identity (ZeroMQ's RCVMORE
    semantics: `recv_into` writes at most len(buf) bytes and returns the frame's size)."""

    def more(self) -> bool: ...
    def next_frame(self) -> bytes: ...
    def recv_into(self, buf: memoryview) -> int: ...


def fill_frames(src: FrameSource, landings: list[Landing]) -> None:
    """Copy each run's frame into its landing; WireError unless there is exactly one
    frame per run, each of exactly the run's size."""
    for landing in landings:
        if not src.more():
            raise WireError("truncated", f"{len(landings)} runs announced, fewer frames sent")
        n = src.recv_into(landing.buffer())
        if n != landing.nbytes:
            reason = "oversized" if n > landing.nbytes else "truncated"
            raise WireError(reason, f"frame of {n} bytes for a run of {landing.nbytes}")
    if src.more():
        raise WireError("extra_frames", "more frames than runs")


PagesHandler = Callable[[PagesHeader], None]


def deliver(inbox: Inbox, peer: bytes, src: FrameSource, pages: PagesHandler | None = None) -> Header | None:
    """Read one message: pages, final and abort go to the inbox; any other kind is
    returned for the transport to handle. `pages` replaces the default (frames) way of
    taking page data. Raises WireError on anything malformed; the caller counts it and
    discards what is left of the message."""
    if not src.more():
        raise WireError("truncated", "message has no header frame")
    header = decode(src.next_frame())
    if isinstance(header, PagesHeader):
        if pages is not None:
            pages(header)
            return None
        if header.via != "frames":
            raise WireError("bad_header", f"via {header.via!r}: this receiver takes pages as frames only")
        with inbox.pages(header, peer, host=True) as landings:
            fill_frames(src, landings)
        return None
    if isinstance(header, FinalHeader) and header.draft is not None:
        inbox.final(header, peer, src)
        return None
    if src.more():
        raise WireError("extra_frames", f"{header.kind} message carries data frames")
    if isinstance(header, FinalHeader):
        inbox.final(header, peer)
    elif isinstance(header, AbortHeader):
        inbox.abort(header, peer)
    else:
        return header
    return None


# -- the sender's view -----------------------------------------------------------------


@dataclass
class Outgoing:
    """Sender-side state of one transfer: where it goes, the reservation's secret its
    messages prove, and the next sequence number."""

    request_id: str
    endpoint: str
    secret: bytes
    server_key: bytes | None = None
    seq: int = 0
    nbytes: int = 0
