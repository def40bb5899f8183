"""Whether a request's KV is named by what pdxfer hashes, and which weights a namespace stands for.

A chunk key chains token ids under a namespace (model, layout, TP, chunk size, cache salt). That
names the KV only when nothing else shaped it: a LoRA adapter, multimodal inputs (their tokens
are identical placeholders for different images) or prompt embeddings change the KV behind the
same token ids, so such requests are kept out of the connector (no lookup, no publish) rather
than risk serving another request's KV. The weights fingerprint goes into the namespace's model
id, so an updated model at the same path never reads KV computed with the old weights.

No vLLM import: requests are read through the attributes named below.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import blake3

# File name endings that hold weights (the rest of a model directory does not shape the KV,
# except config.json, which is hashed whole).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE_BYTES = 1 << 20  # read this much at the start and at the end of each weight file


def unkeyable_reason(request: Any) -> str | None:
    """Why token ids + cache salt do not name this request's KV (a log-ready phrase), or None."""
    if getattr(request, "lora_request", None) is not None:
        return "it uses a LoRA adapter"
    if getattr(request, "mm_features", None):
        return "it has multimodal inputs"
    if getattr(request, "prompt_embeds", None) is not None:
        return "it was given prompt embeddings"
    return None


# Finished states whose request ran to its end: every token but the last has its KV written.
_PUBLISHABLE_STATUS = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def publishable_tokens(request: Any) -> list[int] | None:
    """The tokens of a finished request whose KV is certainly written, or None (aborted etc.).

    The last token never is: it was sampled, not computed; and with asynchronous scheduling
    ``num_computed_tokens`` already counts it while the step computing it is still in flight.
    """
    status = getattr(getattr(request, "status", None), "name", None)
    if status not in _PUBLISHABLE_STATUS:
        return None
    n = min(int(request.num_computed_tokens), int(request.num_tokens) - 1)
    return list(request.all_token_ids[:max(n, 0)])


def weights_fingerprint(model: str, quantization: str | None = None) -> str:
    """A short digest of the weights vLLM loads for ``model``, the same on every host that has
    the same files (sizes and sampled content, never paths or modification times).

    Sampling the first and last MiB of each file (a safetensors header holds every tensor's
    offsets; a fine-tune changes values throughout) keeps start-up cheap for large models; a
    user who updates weights in place without changing either end sets ``model_id`` instead.
    A name that is not a local directory (a hub id) is fingerprinted by name: its revision is
    part of the model id already.
    """
    h = blake3.blake3(b"pdxfer.weights\x00")
    h.update(f"quantization={quantization or ''}\x00".encode())
    root = Path(model)
    if not root.is_dir():
        h.update(f"name={model}\x00".encode())
        return h.hexdigest()[:16]
    files = sorted(p for p in root.rglob("*") if p.is_file() and
                   (p.name == "config.json" or p.name.endswith(_WEIGHT_SUFFIXES)))
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.relative_to(root).as_posix()}\x00{size}\x00".encode())
        with open(p, "rb") as f:
            if p.name == "config.json" or size <= 2 * _SAMPLE_BYTES:
                h.update(f.read())
            else:
                h.update(f.read(_SAMPLE_BYTES))
                f.seek(-_SAMPLE_BYTES, os.SEEK_END)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]
