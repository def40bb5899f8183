"""The prefill's publish hint: how a decode knows that chunks are on their way to the master.

A prefill publishes in the background (never on its TTFT path), so a decode's lookup can arrive
before the publish. The prefill's ``request_finished`` returns ``kv_transfer_params`` carrying
how many leading prompt tokens its publish covers; proxies (pdxfer's, vLLM's own P/D proxies)
forward a prefill response's ``kv_transfer_params`` into the decode request, and the decode
waits (bounded by ``publish_hint_wait_s``) for those chunks instead of recomputing them.

The hint only decides how long a lookup may wait: which bytes are read still follows content
keys and locks, so a wrong or forged hint costs at most the bounded wait, never wrong KV.
"""

from __future__ import annotations

from typing import Any

HINT_KEY = "pdxfer"
HINT_VERSION = 1


def publish_hint(published_tokens: int, prompt_tokens: int, chunk_tokens: int) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a prefill returns for a request whose publish was queued.

    The decode holds only the prompt. A publish reaching past it (a prefill that also generated
    tokens) named its last chunk with generated tokens in it, so only the full chunks inside the
    prompt are announced; a publish ending exactly at the prompt's end announces its tail too."""
    if published_tokens > prompt_tokens:
        published_tokens = prompt_tokens // chunk_tokens * chunk_tokens
    if published_tokens <= 0:
        return None
    return {HINT_KEY: {"v": HINT_VERSION, "published_tokens": int(published_tokens)}}


def hinted_tokens(kv_transfer_params: Any) -> int:
    """Leading prompt tokens a prefill said it published; 0 when there is no usable hint.

    Anything malformed (another connector's params, another version) is ignored, not an error:
    the request then simply does not wait."""
    if not isinstance(kv_transfer_params, dict):
        return 0
    hint = kv_transfer_params.get(HINT_KEY)
    if not isinstance(hint, dict) or hint.get("v") != HINT_VERSION:
        return 0
    n = hint.get("published_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        return 0
    return n
