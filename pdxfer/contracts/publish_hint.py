"""The prefill's publish hint: how a decode knows that chunks are on their way to the master.

A prefill publishes in the background (never on its TTFT path), so a decode's lookup can arrive
before the publish. The prefill's ``request_finished`` returns ``kv_transfer_params`` carrying
how many leading prompt tokens its publish covers; proxies (pdxfer's, vLLM's own P/D proxies)
forward a prefill response's ``kv_transfer_params`` into the decode request, and the decode
waits (bounded by ``publish_hint_wait_s``) for those chunks instead of recomputing them.

A hint names the prompt it was computed for (a digest of its token ids): vLLM answers a completion
of several prompts with one ``kv_transfer_params`` and hands the decode request's params to every
one of its prompts, so a hint that named no prompt made each of them wait for prompt 0's chunks.
A proxy that prefills the prompts one by one can forward all their hints in one
``kv_transfer_params`` (``merge_hints``); each decode prompt uses only its own.

The hint only decides how long a lookup may wait: which bytes are read still follows content
keys and locks, so a wrong or forged hint costs at most the bounded wait, never wrong KV.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Any, Iterable, Sequence

HINT_KEY = "pdxfer"
# 1: {"published_tokens": N}, for whatever prompt carried it (ignored now: it may be another
# prompt's). 2: {"hints": [{"prompt": digest, "published_tokens": N}, ...]}.
HINT_VERSION = 2
MAX_HINTS = 1024  # prompts one kv_transfer_params may announce


def prompt_digest(prompt_token_ids: Sequence[int] | None) -> str | None:
    """The name of a prompt in a hint: a digest of its token ids (None: no token ids)."""
    if prompt_token_ids is None:
        return None
    try:
        data = array("I", prompt_token_ids)
    except (OverflowError, TypeError):
        return None  # not token ids pdxfer keys (the request is not looked up by them either)
    if data.itemsize != 4:  # pragma: no cover - every platform CPython runs on has 4-byte 'I'
        data = array("L", prompt_token_ids)
    return hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()


def publish_hint(published_tokens: int, prompt_tokens: int, chunk_tokens: int,
                 prompt_token_ids: Sequence[int] | None) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a prefill returns for a request whose publish was queued.

    The decode holds only the prompt. A publish reaching past it (a prefill that also generated
    tokens) named its last chunk with generated tokens in it, so only the full chunks inside the
    prompt are announced; a publish ending exactly at the prompt's end announces its tail too."""
    if published_tokens > prompt_tokens:
        published_tokens = prompt_tokens // chunk_tokens * chunk_tokens
    digest = prompt_digest(prompt_token_ids)
    if published_tokens <= 0 or digest is None:
        return None
    return {HINT_KEY: {"v": HINT_VERSION, "hints": [{"prompt": digest, "published_tokens": int(published_tokens)}]}}


def _entries(kv_transfer_params: Any) -> list[dict[str, Any]]:
    """The well-formed hint entries of one ``kv_transfer_params`` (anything else: none)."""
    if not isinstance(kv_transfer_params, dict):
        return []
    hint = kv_transfer_params.get(HINT_KEY)
    if not isinstance(hint, dict) or hint.get("v") != HINT_VERSION:
        return []
    entries = hint.get("hints")
    if not isinstance(entries, list):
        return []
    out = []
    for e in entries[:MAX_HINTS]:
        if not isinstance(e, dict):
            continue
        n, digest = e.get("published_tokens"), e.get("prompt")
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or not isinstance(digest, str):
            continue
        out.append({"prompt": digest, "published_tokens": n})
    return out


def merge_hints(params: Iterable[Any]) -> dict[str, Any] | None:
    """One ``kv_transfer_params`` carrying the hints of several prefill answers (one per prompt
    of a completion); None when none of them carries a hint."""
    entries = [e for p in params for e in _entries(p)][:MAX_HINTS]
    return {HINT_KEY: {"v": HINT_VERSION, "hints": entries}} if entries else None


def hinted_tokens(kv_transfer_params: Any, prompt_token_ids: Sequence[int] | None) -> int:
    """Leading tokens of this prompt a prefill said it published; 0 when no hint names it.

    Anything malformed (another connector's params, another version, another prompt's hint) is
    ignored, not an error: the request then simply does not wait."""
    entries = _entries(kv_transfer_params)
    if not entries:
        return 0
    digest = prompt_digest(prompt_token_ids)
    return next((e["published_tokens"] for e in entries if e["prompt"] == digest), 0)
