"""The metadata a TCP holder exports and a reader passes to ``connect``: a small JSON object.

Fields: ``kind`` ("tcp"), ``v`` (METADATA_VERSION), ``wire`` (the framing version of wire.py),
``host`` and ``port`` to connect to, ``instance`` (16 random bytes, hex: a restarted holder on the
same address is told apart at the handshake), ``secret`` (32 random bytes, hex, new with every
memory registration: what a reader proves at the handshake, so whoever can read this object can
read the holder's memory — hand it only to authenticated parties) and ``regions`` (index, nbytes,
device per region).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

from pdxfer.transport.base import MetadataError, RegisteredRegion
from pdxfer.transport.tcp.handshake import SECRET_BYTES
from pdxfer.transport.tcp.wire import WIRE_VERSION

# Version history of this JSON object (bump when a reader of the old version would misread it):
#   1  kind, v, wire, host, port, instance (16 bytes hex), regions [{index, nbytes, device}]
#   2  + secret (32 bytes hex); ``wire`` is checked by readers
METADATA_VERSION = 2


@dataclass(frozen=True)
class TcpPeerInfo:
    host: str
    port: int
    instance: bytes
    region_sizes: tuple[int, ...]
    secret: bytes = field(default=b"", repr=False)  # never in logs or reprs

    @property
    def peer_id(self) -> str:
        return f"tcp://{self.host}:{self.port}/{self.instance.hex()[:12]}"


def encode_metadata(host: str, port: int, instance: bytes, wire_version: int,
                    regions: Sequence[RegisteredRegion], secret: bytes) -> bytes:
    doc = {
        "kind": "tcp",
        "v": METADATA_VERSION,
        "wire": wire_version,
        "host": host,
        "port": port,
        "instance": instance.hex(),
        "secret": secret.hex(),
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
        raise MetadataError(f"tcp metadata version {doc.get('v')!r}, this side speaks {METADATA_VERSION}: "
                            f"run the same pdxfer version on holder and reader")
    if doc.get("wire") != WIRE_VERSION:
        raise MetadataError(f"the holder speaks TCP wire version {doc.get('wire')!r}, this side speaks "
                            f"{WIRE_VERSION}: run the same pdxfer version on holder and reader")
    try:
        regions = doc["regions"]
        for i, r in enumerate(regions):
            if int(r["index"]) != i:
                raise MetadataError(f"tcp metadata region {i} carries index {r['index']}")
        info = TcpPeerInfo(str(doc["host"]), int(doc["port"]), bytes.fromhex(doc["instance"]),
                           tuple(int(r["nbytes"]) for r in regions), bytes.fromhex(doc["secret"]))
    except (KeyError, TypeError, ValueError) as exc:
        # (fromhex errors name a position, never the text: the secret cannot reach a log this way)
        raise MetadataError(f"tcp metadata is missing or has a bad field: {exc!r}") from exc
    if len(info.instance) != 16 or not 0 < info.port < 65536:
        raise MetadataError(f"tcp metadata has a bad instance id or port {info.port}")
    if len(info.secret) != SECRET_BYTES:
        raise MetadataError(f"tcp metadata secret must be {SECRET_BYTES} bytes, has {len(info.secret)}")
    return info
