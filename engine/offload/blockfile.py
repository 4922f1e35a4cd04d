"""The disk tier's file format: one block per file, self-describing and checked.

    offset  size  field
    0       8     magic b"PDSKVBLK"
    8       2     version (little-endian u16), 1
    10      4     header length H (u32)
    14      H     header: UTF-8 JSON {"layout": KVLayout, "block_hash": hex, "token_ids": [...],
                                       "data_bytes": N}
    14+H    N     the block's KV bytes, as the device pool stores them (every layer, K and V)
    14+H+N  32    sha256 over every byte before it (magic, version, header, data)

A reader checks, in order: the magic and version, that the header parses, that its
layout is the reader's (else the file is *foreign*: another model's or dtype's, left
alone), that its hash and tokens are the ones asked for, that the size is exact
(a truncated file fails here) and the checksum (a corrupt one fails here). Anything
but foreign is *corrupt*: the tier deletes it and counts it. Writing goes to a
temporary name in the same directory, then `os.replace` (atomic on POSIX), so a reader
never sees half a file and a crash leaves only a temporary file behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.offload.layout import KVLayout

MAGIC = b"PDSKVBLK"
VERSION = 1
_PREFIX = struct.Struct("<8sHI")
_SUM = 32
SUFFIX = ".kvblock"
TMP_SUFFIX = ".tmp"


class CorruptBlockFile(ValueError):
    """A file of ours that cannot be served: truncated, corrupted, or not what it claims."""


class ForeignBlockFile(ValueError):
    """A well-formed file of another layout (model, dtype, block size): not ours to judge."""


@dataclass(frozen=True)
class BlockHeader:
    layout: KVLayout
    block_hash: bytes
    token_ids: tuple[int, ...]
    data_bytes: int


def file_name(layout: KVLayout, block_hash: bytes) -> str:
    return f"{layout.digest}-{block_hash.hex()}{SUFFIX}"


def encode(layout: KVLayout, block_hash: bytes, token_ids: Sequence[int], data: bytes | memoryview) -> list[bytes]:
    """The file's bytes, in pieces (so the data is not copied once more)."""
    header = json.dumps({"layout": json.loads(layout.to_json()), "block_hash": block_hash.hex(),
                         "token_ids": list(token_ids), "data_bytes": len(data)}, sort_keys=True).encode()
    head = _PREFIX.pack(MAGIC, VERSION, len(header)) + header
    digest = hashlib.sha256(head)
    digest.update(data)
    return [head, bytes(data), digest.digest()]


def write_atomic(path: Path, pieces: list[bytes], fsync: bool) -> None:
    """Write to `path` + a temporary suffix, optionally fsync, then rename into place."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with tmp.open("wb") as f:
            for piece in pieces:
                f.write(piece)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:  # the rename itself
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_header(raw: bytes | bytearray, layout: KVLayout) -> tuple[BlockHeader, int]:
    """The header of a file's bytes (whole, or its beginning) and where its data
    starts; raises ForeignBlockFile or CorruptBlockFile."""
    if len(raw) < _PREFIX.size:
        raise CorruptBlockFile(f"{len(raw)} bytes: shorter than the fixed prefix")
    magic, version, header_len = _PREFIX.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlockFile(f"magic {magic!r} version {version}: not a pdserve KV block file of version {VERSION}")
    end = _PREFIX.size + header_len
    if len(raw) < end:
        raise CorruptBlockFile("truncated inside the header")
    try:
        d = json.loads(bytes(raw[_PREFIX.size:end]).decode())
        header = BlockHeader(KVLayout.from_dict(d["layout"]), bytes.fromhex(d["block_hash"]),
                             tuple(int(t) for t in d["token_ids"]), int(d["data_bytes"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptBlockFile(f"unreadable header: {exc}") from None
    if header.layout != layout:
        raise ForeignBlockFile(f"layout {header.layout.digest}, not this engine's {layout.digest}")
    return header, end


def decode(raw: bytes | bytearray, layout: KVLayout, block_hash: bytes, token_ids: Sequence[int]) -> memoryview:
    """The data of a whole file's bytes, checked against what the reader asked for."""
    header, start = read_header(raw, layout)
    if header.block_hash != block_hash or header.token_ids != tuple(token_ids):
        raise CorruptBlockFile("holds another block than its name says")
    if header.data_bytes != layout.block_bytes:
        raise CorruptBlockFile(f"{header.data_bytes} data bytes; a block of this layout has {layout.block_bytes}")
    end = start + header.data_bytes
    if len(raw) != end + _SUM:
        raise CorruptBlockFile(f"{len(raw)} bytes; expected {end + _SUM} (truncated or padded)")
    view = memoryview(raw)
    if hashlib.sha256(view[:end]).digest() != bytes(view[end:]):
        raise CorruptBlockFile("checksum mismatch")
    return view[start:end]
