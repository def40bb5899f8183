"""Content-addressed chunk keys.

A prompt is cut into chunks of ``chunk_tokens`` consecutive tokens; chunk ``i`` is named by a
chained BLAKE3 digest ``h_i = BLAKE3(h_{i-1} || tokens[i*C:(i+1)*C] as big-endian uint32)``.
``h_{-1}`` is the *root*, which is the digest of a :class:`Namespace`: two prompts only share
keys when model, KV layout, tensor-parallel placement, chunk size and cache salt all agree.

The partial chunk at the end of a prompt (1 to C-1 tokens) has a *tail key*
``BLAKE3("pdxfer.tail" || h_last || count as big-endian uint32 || tokens)``: it names exactly
those tokens after exactly that prefix, so only a request with the very same prompt finds it
(what P/D needs: the decode reads everything the prefill computed), while prefix reuse across
requests stays with full chunks.

The builtin ``hash()`` is never used: it is seeded per process (LMCache's classic P/D bug).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import blake3
import numpy as np

KEY_BYTES = 32
DEFAULT_CHUNK_TOKENS = 256
_UINT32_MAX = 0xFFFFFFFF
# Namespace encoding versions (a bump changes every key; instances of different versions never
# share chunks, which is the point when what a namespace means changes):
#   1  model id, layout fingerprint (byte format, dtype, layers, per-rank KV heads, head dim),
#      TP size and rank, chunk tokens, cache salt
#   2  model id, *content* fingerprint (dtype, layers, total KV heads, head dim), chunk tokens,
#      cache salt. Byte format, block size and TP are out: readers convert formats and block
#      sizes and gather their TP heads from any holder rank, so instances that differ only there
#      must find each other's chunks (see Namespace).
_NAMESPACE_VERSION = 2


def _as_uint32_be(tokens: Any) -> np.ndarray:
    """Validate token ids and return them as a big-endian uint32 array (a copy only if needed)."""
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch tensor, without importing torch
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size == 0:
        return np.zeros(0, dtype=">u4")
    if arr.dtype == object:
        # Lists holding Python ints beyond int64 land here; anything but plain ints is refused.
        items = arr.tolist()
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise ValueError("token ids must be integers, got a list holding other types")
        ints = items
        bad = next((t for t in ints if t < 0 or t > _UINT32_MAX), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside uint32 [0, {_UINT32_MAX}]")
        return np.asarray(ints, dtype=">u4")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _UINT32_MAX:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside uint32 [0, {_UINT32_MAX}]")
    return arr.astype(">u4", copy=False)


def _check_chunk_tokens(chunk_tokens: int) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)):
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")


def _check_root(root: bytes) -> None:
    if not isinstance(root, (bytes, bytearray)) or len(root) != KEY_BYTES:
        raise ValueError(f"root must be {KEY_BYTES} bytes, got {root!r:.60}")


def chunk_hashes(
    tokens: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, root: bytes = bytes(KEY_BYTES)
) -> list[bytes]:
    """Chained 32-byte BLAKE3 digests of every *full* chunk of ``tokens``.

    ``tokens`` may be a list of ints, a numpy array or a torch tensor (1-D). A trailing partial
    chunk is not hashed: only full chunks are ever published or looked up.
    """
    _check_chunk_tokens(chunk_tokens)
    _check_root(root)
    data = _as_uint32_be(tokens)
    return _chain(bytes(root), data, chunk_tokens)


def _chain(prev: bytes, data: np.ndarray, chunk_tokens: int) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(data) // chunk_tokens):
        h = blake3.blake3(prev)
        h.update(data[i * chunk_tokens : (i + 1) * chunk_tokens].tobytes())
        prev = h.digest()
        out.append(prev)
    return out


def tail_key(prev: bytes, tail_tokens: Any) -> bytes:
    """Key of a prompt's partial last chunk: ``tail_tokens`` (1 or more tokens) after the chunk
    (or root) whose key is ``prev``. Distinct from every full-chunk key (own domain, the count)."""
    _check_root(prev)
    data = _as_uint32_be(tail_tokens)
    if len(data) == 0:
        raise ValueError("a tail key names at least one token")
    h = blake3.blake3(b"pdxfer.tail\x00")
    h.update(bytes(prev))
    h.update(len(data).to_bytes(4, "big"))
    h.update(data.tobytes())
    return h.digest()


def state_key(key: bytes) -> bytes:
    """Key of the entry ending where ``key``'s chunk (or tail) ends that also names a hybrid
    model's recurrent state after those tokens (:mod:`pdxfer.kv.groups`). Its own domain: the
    plain entry of ``key`` may be held without that state."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"a state key derives from a {KEY_BYTES}-byte key")
    h = blake3.blake3(b"pdxfer.state\x00")
    h.update(bytes(key))
    return h.digest()


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two instances' KV *content* to be interchangeable.

    ``content_fingerprint`` names the numbers (dtype, layers, total KV heads, head dim; see
    :func:`pdxfer.kv.layout.content_fingerprint`), not how they are laid out. Deliberately absent:

    - block size and byte format (CPU / flash NHD / HND): a reader converts while it reads;
    - TP size and rank: a chunk key names the KV of *all* heads of a token range. A TP holder
      publishes once per engine, and each reader rank reads its own heads from the holder
      rank(s) holding them. Keying per rank would make a TP2 decode unable to use a TP1
      prefill's chunks, which is the whole point of disaggregating them.

    Whether a particular holder can be read (AMX-packed blocks, a dtype mismatch through an
    explicit ``model_id``) is decided per holder by the reader, not by the key.
    """

    model_id: str
    content_fingerprint: str
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("namespace model_id must be a non-empty string")
        if not self.content_fingerprint:
            raise ValueError("namespace content_fingerprint must be a non-empty string")
        _check_chunk_tokens(self.chunk_tokens)

    def encode(self) -> bytes:
        """Canonical bytes: sorted-key JSON with a version, so field order never matters."""
        doc = {
            "v": _NAMESPACE_VERSION,
            "model_id": self.model_id,
            "content": self.content_fingerprint,
            "chunk_tokens": self.chunk_tokens,
            "cache_salt": self.cache_salt,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def root(self) -> bytes:
        return blake3.blake3(b"pdxfer.namespace\x00" + self.encode()).digest()

    def chunk_hashes(self, tokens: Any) -> list[bytes]:
        return chunk_hashes(tokens, self.chunk_tokens, self.root())


class IncrementalHasher:
    """Hashes a growing prompt; chunks already hashed are never hashed again.

    ``update(tokens)`` takes the *whole* prompt so far (the scheduler sees whole requests) and
    checks that its already-hashed prefix is unchanged, so a caller that mixes up requests gets
    an error instead of wrong keys.
    """

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, root: bytes = bytes(KEY_BYTES)):
        _check_chunk_tokens(chunk_tokens)
        _check_root(root)
        self.chunk_tokens = chunk_tokens
        self.root = bytes(root)
        self._hashes: list[bytes] = []
        self._hashed_tokens = np.zeros(0, dtype=">u4")
        self.chunks_hashed = 0  # how many chunk digests were computed over this object's life

    @property
    def hashes(self) -> list[bytes]:
        return list(self._hashes)

    def update(self, tokens: Any) -> list[bytes]:
        data = _as_uint32_be(tokens)
        done = len(self._hashes) * self.chunk_tokens
        if len(data) < done or not np.array_equal(data[:done], self._hashed_tokens[:done]):
            raise ValueError("prompt does not extend the tokens already hashed by this hasher")
        full = len(data) // self.chunk_tokens * self.chunk_tokens
        if full > done:
            prev = self._hashes[-1] if self._hashes else self.root
            new = _chain(prev, data[done:full], self.chunk_tokens)
            self.chunks_hashed += len(new)
            self._hashes.extend(new)
            self._hashed_tokens = np.array(data[:full], copy=True)
        return list(self._hashes)

    def tail(self, tokens: Any) -> bytes | None:
        """Tail key of ``tokens`` (the whole prompt, as for ``update``), None when it ends on a
        chunk boundary."""
        data = _as_uint32_be(tokens)
        hashes = self.update(data)
        full = len(data) // self.chunk_tokens * self.chunk_tokens
        if full == len(data):
            return None
        return tail_key(hashes[-1] if hashes else self.root, data[full:])


def validate_keys(keys: Sequence[bytes]) -> None:
    for i, k in enumerate(keys):
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            raise ValueError(f"key {i} must be {KEY_BYTES} bytes, got {type(k).__name__} of len "
                             f"{len(k) if hasattr(k, '__len__') else '?'}")
