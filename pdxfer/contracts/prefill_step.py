"""The mark a proxy puts on a prefill step: "this request computes KV for another instance's
decode, and its answer is thrown away".

Only a hybrid model with recurrent layers (Mamba, gated delta-net) needs it. The decode computes
the prompt's last token itself, so it needs the recurrent state after every token but the last,
which a prefill of the whole prompt never holds (a state cannot be rewound). A marked prefill
therefore computes the prompt without its last token. An unmarked request is always served
whole: an instance answering clients directly never drops a token. vLLM's own P/D proxies mark
their prefill steps with ``do_remote_decode``, which counts as the mark too.
"""

from __future__ import annotations

from typing import Any

PREFILL_KEY = "pdxfer_prefill"
PREFILL_VERSION = 1


def prefill_step_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` pdxfer's proxy sends with a prefill step."""
    return {PREFILL_KEY: {"v": PREFILL_VERSION}}


def is_prefill_step(kv_transfer_params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` mark it as a prefill step for a decode."""
    if not isinstance(kv_transfer_params, dict):
        return False
    mark = kv_transfer_params.get(PREFILL_KEY)
    if isinstance(mark, dict) and mark.get("v") == PREFILL_VERSION:
        return True
    return kv_transfer_params.get("do_remote_decode") is True
