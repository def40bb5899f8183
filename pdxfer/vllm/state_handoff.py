"""A prefill step of a model with recurrent layers stops one prompt token short.

The decode computes the prompt's last token (vLLM samples from it), so it needs the recurrent
state after every token but the last. The prefill step (marked by the proxy:
:mod:`pdxfer.contracts.prefill_step`) computes exactly those tokens and publishes them with the
state after them; the decode looks up the same tokens (its reader names the prompt without its
last token when the model has recurrent groups). The prefill's own answer is the proxy's to
throw away. vLLM's NixlConnector does the same for Mamba models.
"""

from __future__ import annotations

import logging
from typing import Any

from pdxfer.contracts.prefill_step import is_prefill_step

log = logging.getLogger("pdxfer.vllm")


def truncate_prefill_step(request: Any) -> int | None:
    """Drop the last prompt token of a marked prefill step (in vLLM's ``Request``, before it is
    scheduled); the dropped token, or None when the request is not one or too short."""
    if not is_prefill_step(getattr(request, "kv_transfer_params", None)):
        return None
    prompt = getattr(request, "prompt_token_ids", None)
    if prompt is None or int(request.num_prompt_tokens) < 2 or request.num_computed_tokens:
        return None
    dropped = int(prompt[-1])
    del prompt[-1]
    del request._all_token_ids[-1]
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    return dropped
