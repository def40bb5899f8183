"""The versioned metadata blob a NIXL holder exports and a reader passes to ``connect``.

Layout: ``MAGIC | u16 version | u32 header length | header JSON | NIXL agent metadata``.
The header names the agent, the host and pid (for error messages only), the region table
(index, address, size, NIXL memory type, device id) and a random cookie the reader READs back at
connect to prove the peer is alive and that the metadata is not stale. The length of the NIXL
part is in the header, so a truncated blob is detected instead of handed to NIXL.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from pdxfer.transport.base import MetadataError

MAGIC = b"PDXNIXL\x00"
# Version history of this blob (a reader refuses any version but its own, naming both):
#   1  header JSON: kind, agent, host, pid, regions [index, ptr, nbytes, mem_type, dev_id],
#      cookie_ptr, cookie (hex), nixl_md_len; then the NIXL agent metadata
VERSION = 1
_HDR = struct.Struct("<HI")


@dataclass(frozen=True)
class RemoteRegion:
    index: int
    ptr: int
    nbytes: int
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int


@dataclass(frozen=True)
class NixlPeerInfo:
    agent: str
    host: str
    pid: int
    regions: tuple[RemoteRegion, ...]
    cookie_ptr: int
    cookie: bytes
    nixl_md: bytes


def encode(info: NixlPeerInfo) -> bytes:
    header = {
        "kind": "nixl",
        "agent": info.agent,
        "host": info.host,
        "pid": info.pid,
        "regions": [[r.index, r.ptr, r.nbytes, r.mem_type, r.dev_id] for r in info.regions],
        "cookie_ptr": info.cookie_ptr,
        "cookie": info.cookie.hex(),
        "nixl_md_len": len(info.nixl_md),
    }
    hdr = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + _HDR.pack(VERSION, len(hdr)) + hdr + info.nixl_md


def decode(blob: bytes) -> NixlPeerInfo:
    """Parse a blob; every malformation is a MetadataError that says what is wrong."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise MetadataError(f"NIXL peer metadata must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if not blob.startswith(MAGIC):
        raise MetadataError(f"not NIXL transport metadata (starts with {blob[:8]!r}, expected {MAGIC!r}); "
                            "was it exported by another transport kind?")
    off = len(MAGIC)
    if len(blob) < off + _HDR.size:
        raise MetadataError(f"NIXL metadata truncated: {len(blob)} bytes")
    version, hlen = _HDR.unpack_from(blob, off)
    if version != VERSION:
        raise MetadataError(f"NIXL metadata wire version {version}, this side speaks {VERSION}")
    off += _HDR.size
    if len(blob) < off + hlen:
        raise MetadataError(f"NIXL metadata truncated in header ({len(blob)} bytes, header needs {off + hlen})")
    try:
        h = json.loads(blob[off:off + hlen])
        md = blob[off + hlen:]
        if h.get("kind") != "nixl":
            raise MetadataError(f"metadata kind {h.get('kind')!r}, expected 'nixl'")
        if len(md) != h["nixl_md_len"]:
            raise MetadataError(f"NIXL agent metadata is {len(md)} bytes, header says {h['nixl_md_len']}")
        regions = tuple(RemoteRegion(int(i), int(p), int(n), str(m), int(d)) for i, p, n, m, d in h["regions"])
        return NixlPeerInfo(str(h["agent"]), str(h["host"]), int(h["pid"]), regions,
                            int(h["cookie_ptr"]), bytes.fromhex(h["cookie"]), md)
    except MetadataError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise MetadataError(f"NIXL metadata header is malformed: {exc!r}") from exc
