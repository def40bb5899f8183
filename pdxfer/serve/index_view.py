"""What the fleet holds of a prompt: how many leading tokens, and which instance holds how many.

Asks the master, read-only (no lock, no pin): ``MasterClient.nodes()`` for each live holder's
namespace root, chunk size and OpenAI base URL (``serve_url``), then ``MasterClient.peek()`` with
the keys a decode's lookup would send. The keys are the connector's own: the reader hashes a
request's whole prompt with :class:`pdxfer.kv.keys.IncrementalHasher` (every full chunk, then the
tail key of the partial last chunk) and so does this view, through the same class.

A request with a ``cache_salt`` has another root, which the master does not announce: the caller
routes such a request without the index.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pdxfer.kv.keys import KEY_BYTES, IncrementalHasher
from pdxfer.master import MasterClient, MasterError
from pdxfer.master.client.locator import locator_for

MAX_NAMESPACES = 4  # distinct (namespace, chunk size) groups one request is peeked in


class IndexUnavailable(Exception):
    """The view cannot answer; ``code`` is a short reason (metrics label), the message details."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Holding:
    prompt_tokens: int
    held_tokens: int  # leading prompt tokens the live fleet holds (all holders together)
    # serve_url -> leading tokens that instance's own KV cache holds: a prefix cache hit there. A
    # prefix its host tier holds is left out: that copy serves other readers, not the instance.
    by_url: dict[str, int] = field(default_factory=dict)
    # Leading held tokens some holder's device tier (KV cache) holds: the longest device prefix
    # over the holders. The rest of ``held_tokens`` counts as held only in host tiers. None: all
    # of them (no holder's host tier holds part of its prefix).
    device_tokens: int | None = None

    @property
    def device_held(self) -> int:
        """Leading held tokens a device tier holds somewhere."""
        return self.held_tokens if self.device_tokens is None else min(self.device_tokens, self.held_tokens)


def held_tokens(keys_held: int, full_chunks: int, chunk_tokens: int, prompt_tokens: int) -> int:
    """Prompt tokens named by the first ``keys_held`` keys of a lookup (full chunks, then the
    tail, which covers the rest of the prompt)."""
    if keys_held > full_chunks:
        return prompt_tokens
    return min(keys_held * chunk_tokens, prompt_tokens)


def lookup_keys(tokens: Sequence[int], chunk_tokens: int, root: bytes) -> tuple[list[bytes], int]:
    """(the keys a decode's lookup of this prompt asks for, how many of them are full chunks)."""
    hasher = IncrementalHasher(chunk_tokens, root)
    full = hasher.update(tokens)
    tail = hasher.tail(tokens)
    return full + ([tail] if tail is not None else []), len(full)


def _namespace_root(hex_root: str) -> bytes | None:
    try:
        root = bytes.fromhex(hex_root)
    except (TypeError, ValueError):
        return None
    return root if len(root) == KEY_BYTES else None


class IndexView:
    """Thread-safe; each call does blocking master calls bounded by ``timeout_s`` (run it off an
    event loop). After a failure the master is not asked again for ``backoff_s``: a dead master
    must not cost every request a timeout."""

    def __init__(self, master: str, token: str | None = None, timeout_s: float = 0.5,
                 nodes_ttl_s: float = 2.0, backoff_s: float = 1.0,
                 client_factory: Callable[..., Any] = MasterClient) -> None:
        if timeout_s <= 0 or nodes_ttl_s < 0 or backoff_s < 0:
            raise ValueError("index timeout must be positive, nodes_ttl_s and backoff_s not negative")
        locator_for(master)  # a bad address is the operator's to fix now, not a per-request note
        self.master = master
        self.timeout_s = timeout_s
        self.nodes_ttl_s = nodes_ttl_s
        self.backoff_s = backoff_s
        self._token = token
        self._factory = client_factory
        self._lock = threading.Lock()
        self._client: Any = None
        self._groups: dict[tuple[bytes, int], int] = {}
        self._groups_at = float("-inf")
        self._down_until = float("-inf")
        self._down_note = ""

    def _master(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._factory(self.master, token=self._token, timeout_s=self.timeout_s)
            return self._client

    def _namespaces(self, client: Any) -> list[tuple[bytes, int]]:
        now = time.monotonic()
        with self._lock:
            if now - self._groups_at <= self.nodes_ttl_s:
                return self._ordered()
        groups: dict[tuple[bytes, int], int] = {}
        for n in client.nodes():
            root = _namespace_root(getattr(n, "namespace", ""))
            chunk = getattr(n, "chunk_tokens", 0)
            if root is not None and isinstance(chunk, int) and chunk > 0:
                groups[(root, chunk)] = groups.get((root, chunk), 0) + 1
        with self._lock:
            self._groups, self._groups_at = groups, now
            return self._ordered()

    def _ordered(self) -> list[tuple[bytes, int]]:
        # Most-populated namespaces first: the fleet's model, not a stray instance of another.
        return sorted(self._groups, key=lambda g: -self._groups[g])[:MAX_NAMESPACES]

    def holding(self, tokens: Sequence[int]) -> Holding:
        """What the live fleet holds of the prompt ``tokens``; IndexUnavailable when it cannot tell."""
        if not tokens:
            raise IndexUnavailable("no-prompt", "empty prompt")
        now = time.monotonic()
        if now < self._down_until:
            raise IndexUnavailable("index-down", f"master {self.master} failed less than "
                                   f"{self.backoff_s:g} s ago ({self._down_note})")
        try:
            client = self._master()
            groups = self._namespaces(client)
            if not groups:
                raise IndexUnavailable("index-empty", "no live instance announced its namespace")
            best = Holding(len(tokens), 0, {})
            device, in_host = 0, False
            for root, chunk in groups:
                keys, n_full = lookup_keys(tokens, chunk, root)
                res = client.peek(keys)
                held = held_tokens(res.hit, n_full, chunk, len(tokens))
                by_url = dict(best.by_url)
                if res.device_prefix_by_node:
                    # Some holder's host tier holds part of its prefix: how far a device tier goes
                    # (a holder without host part holds all of its prefix in its device tier).
                    in_host = True
                    device = max([device] + [
                        held_tokens(res.device_prefix_by_node.get(n, k), n_full, chunk, len(tokens))
                        for n, k in res.prefix_by_node.items()])
                else:
                    device = max(device, held)
                for node_id, n_keys in res.prefix_by_node.items():
                    n_keys = res.device_prefix_by_node.get(node_id, n_keys)
                    info = res.nodes.get(node_id)
                    url = getattr(info, "serve_url", "") if info is not None else ""
                    if url and n_keys > 0:
                        url = url.rstrip("/")
                        by_url[url] = max(by_url.get(url, 0),
                                          held_tokens(n_keys, n_full, chunk, len(tokens)))
                best = Holding(len(tokens), max(best.held_tokens, held), by_url)
            return Holding(best.prompt_tokens, best.held_tokens, best.by_url,
                           device if in_host else None)
        except MasterError as e:
            with self._lock:
                self._down_until = time.monotonic() + self.backoff_s
                self._down_note = str(e)
                self._groups_at = float("-inf")  # ask for the nodes again once it is back
            raise IndexUnavailable("index-down", f"master {self.master}: {e}") from None

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
