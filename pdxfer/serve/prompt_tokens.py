"""The prompt token ids of a request, as the instances will see them.

A completion that already carries token ids needs no round trip. Otherwise an instance's own
`/tokenize` (vLLM's endpoint) answers, with every request field that shapes the prompt, so the ids
are the ones the instance computes: a chat's template, tools and template arguments included.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

import aiohttp

# Fields of a chat request that change its prompt tokens (vLLM's /tokenize takes them all).
_CHAT_PROMPT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                       "add_special_tokens", "chat_template", "chat_template_kwargs", "tools",
                       "mm_processor_kwargs")
_COMPLETION_PROMPT_FIELDS = ("prompt", "add_special_tokens")


class TokenizeError(Exception):
    """The prompt's token ids are unknown; the message says why."""


def is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def single_prompt(body: Mapping[str, Any]) -> Any:
    """A completion's one prompt (a string or token ids), unwrapping a one-element list; None
    when there are several or none."""
    p = body.get("prompt")
    if isinstance(p, str) or is_token_ids(p):
        return p
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or is_token_ids(p[0])):
        return p[0]
    return None


def tokenize_request(path: str, body: Mapping[str, Any]) -> dict[str, Any] | list[int]:
    """What to POST to /tokenize for this request, or its token ids when it carries them."""
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            raise TokenizeError("chat request without a messages list")
        req = {k: body[k] for k in _CHAT_PROMPT_FIELDS if k in body}
    else:
        prompt = single_prompt(body)
        if prompt is None:
            raise TokenizeError("completion without a single prompt")
        if not isinstance(prompt, str):
            return list(prompt)
        req = {k: body[k] for k in _COMPLETION_PROMPT_FIELDS if k in body}
        req["prompt"] = prompt
    if "model" in body:
        req["model"] = body["model"]
    return req


async def prompt_tokens(session: aiohttp.ClientSession, instance_url: str, path: str,
                        body: Mapping[str, Any], headers: Mapping[str, str],
                        timeout_s: float) -> list[int]:
    """The request's prompt token ids, asking ``instance_url``'s /tokenize if needed (bounded by
    ``timeout_s``); TokenizeError naming the instance when it cannot tell."""
    req = tokenize_request(path, body)
    if isinstance(req, list):
        return req
    try:
        async with session.post(instance_url + "/tokenize", json=req, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise TokenizeError(f"{instance_url}/tokenize answered HTTP {r.status}")
            doc = await r.json(content_type=None)
    except asyncio.TimeoutError:
        raise TokenizeError(f"{instance_url}/tokenize timed out after {timeout_s:g} s") from None
    except (aiohttp.ClientError, OSError, ValueError) as e:
        raise TokenizeError(f"{instance_url}/tokenize failed: {e.__class__.__name__}: {e}") from None
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    if not is_token_ids(tokens):
        raise TokenizeError(f"{instance_url}/tokenize sent no token ids")
    return tokens
