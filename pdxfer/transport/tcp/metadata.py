"""The metadata a TCP holder exports and a reader passes to ``connect``: a small JSON object.

Fields: ``kind`` ("tcp"), ``v`` (METADATA_VERSION), ``wire`` (the framing version of wire.py),
``host`` and ``port`` to connect to, ``instance`` (16 random bytes, hex: a restarted holder on the
same address is told apart at the handshake) and ``regions`` (index, nbytes, device per region).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from pdxfer.transport.base import MetadataError, RegisteredRegion

# Version history of this JSON object (bump when a reader of the old version would misread it):
#   1  kind, v, wire, host, port, instance (16 bytes hex), regions [{index, nbytes, device}]
METADATA_VERSION = 1


@dataclass(frozen=True)
class TcpPeerInfo:
    host: str
    port: int
    instance: bytes
    region_sizes: tuple[int, ...]

    @property
    def peer_id(self) -> str:
        return f"tcp://{self.host}:{self.port}/{self.instance.hex()[:12]}"


def encode_metadata(host: str, port: int, instance: bytes, wire_version: int,
                    regions: Sequence[RegisteredRegion]) -> bytes:
    doc = {
        "kind": "tcp",
        "v": METADATA_VERSION,
        "wire": wire_version,
        "host": host,
        "port": port,
        "instance": instance.hex(),
        "regions": [{"index": r.index, "nbytes": r.nbytes, "device": r.device} for r in regions],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_metadata(blob: bytes) -> TcpPeerInfo:
    """Decode a peer's metadata; MetadataError says what is wrong with it."""
    try:
        doc = json.loads(bytes(blob).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise MetadataError(f"tcp metadata is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise MetadataError("tcp metadata must be a JSON object")
    if doc.get("kind") != "tcp":
        raise MetadataError(f"metadata is for transport kind {doc.get('kind')!r}, not 'tcp'")
    if doc.get("v") != METADATA_VERSION:
        raise MetadataError(f"tcp metadata version {doc.get('v')!r}, this side speaks {METADATA_VERSION}")
    try:
        regions = doc["regions"]
        for i, r in enumerate(regions):
            if int(r["index"]) != i:
                raise MetadataError(f"tcp metadata region {i} carries index {r['index']}")
        info = TcpPeerInfo(str(doc["host"]), int(doc["port"]), bytes.fromhex(doc["instance"]),
                           tuple(int(r["nbytes"]) for r in regions))
    except (KeyError, TypeError, ValueError) as exc:
        raise MetadataError(f"tcp metadata is missing or has a bad field: {exc!r}") from exc
    if len(info.instance) != 16 or not 0 < info.port < 65536:
        raise MetadataError(f"tcp metadata has a bad instance id or port {info.port}")
    return info
