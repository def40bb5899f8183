"""Whether a request's KV is named by what pdxfer hashes, and which weights a namespace stands for.

A chunk key chains token ids under a namespace (model, layout, TP, chunk size, cache salt). That
names the KV only when nothing else shaped it: a LoRA adapter, multimodal inputs (their tokens
are identical placeholders for different images) or prompt embeddings change the KV behind the
same token ids, so such requests are kept out of the connector (no lookup, no publish) rather
than risk serving another request's KV. The weights fingerprint goes into the namespace's model
id, so an updated model at the same path never reads KV computed with the old weights (or
old KV scales); KV scales computed at run time, per instance, leave no key at all.

No vLLM import: requests are read through the attributes named below.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import blake3

# File name endings that hold weights (the rest of a model directory does not shape the KV,
# except config.json and quantization configs, which are hashed whole).
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


def runtime_kv_scales_reason(vllm_config: Any) -> str | None:
    """Why this instance's KV scales make its quantized KV unnameable (log-ready), or None.

    Scales computed at run time from what each instance happened to see first (vLLM's
    ``calculate_kv_scales``, present in some vLLM versions) differ between instances, so the
    same tokens are stored as other numbers. Scales loaded from the checkpoint are named by the
    weights fingerprint (:func:`weights_fingerprint` hashes every scale tensor whole).
    """
    for where in ("cache_config", "model_config"):
        if getattr(getattr(vllm_config, where, None), "calculate_kv_scales", False):
            return (f"its KV scales are computed at run time ({where}.calculate_kv_scales), so two "
                    "instances store the same tokens as different numbers and no key can name them; "
                    "to move KV, turn calculate_kv_scales off (scales from the checkpoint are part of the key)")
    return None


def weights_fingerprint(model: str, quantization: str | None = None) -> str:
    """A short digest of the weights vLLM loads for ``model``, the same on every host that has
    the same files (sizes and sampled content, never paths or modification times).

    Sampling the first and last MiB of each file (a fine-tune changes values throughout) keeps
    start-up cheap for large models. Of a safetensors file the whole header (every tensor's
    name, shape and offsets) and every quantization scale (``*scale``, ``*zero_point``: KV
    scales among them, recalibrated without touching anything else) are hashed whole, as are
    ``config.json`` and quantization configs beside it (``*quant*.json``). A user who updates
    other weights in place without changing either end, or keeps scales in another weight
    format, sets ``model_id`` instead. A name that is not a local directory (a hub id) is
    fingerprinted by name: its revision is part of the model id already.
    """
    h = blake3.blake3(b"pdxfer.weights\x00")
    h.update(f"quantization={quantization or ''}\x00".encode())
    root = Path(model)
    if not root.is_dir():
        h.update(f"name={model}\x00".encode())
        return h.hexdigest()[:16]
    files = sorted(p for p in root.rglob("*") if p.is_file() and (_whole_config(p.name) or
                                                                    p.name.endswith(_WEIGHT_SUFFIXES)))
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.relative_to(root).as_posix()}\x00{size}\x00".encode())
        with open(p, "rb") as f:
            if _whole_config(p.name) or size <= 2 * _SAMPLE_BYTES:
                h.update(f.read())
                continue
            h.update(f.read(_SAMPLE_BYTES))
            f.seek(-_SAMPLE_BYTES, os.SEEK_END)
            h.update(f.read(_SAMPLE_BYTES))
            if p.name.endswith(".safetensors"):
                _hash_safetensors_scales(f, size, h)
    return h.hexdigest()[:16]


def _whole_config(name: str) -> bool:
    """Small files that say how the weights are used: hashed whole."""
    return name == "config.json" or (name.endswith(".json") and "quant" in name)


_SCALE_SUFFIXES = ("scale", "zero_point")  # last name part: k_scale, v_scale, kv_scale, weight_scale, ...
_MAX_HEADER = 1 << 27  # safetensors caps its header at 100 MB


def _hash_safetensors_scales(f: Any, size: int, h: Any) -> None:
    """Hash a safetensors file's header and every quantization-scale tensor's bytes (they may
    lie anywhere in the file, and one recalibration changes only them)."""
    f.seek(0)
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 0 < n <= min(_MAX_HEADER, size - 8):
        h.update(b"unparsed-safetensors\x00")  # vLLM cannot load it either; the sampled ends stay
        return
    header = f.read(n)
    h.update(header)
    try:
        entries = json.loads(header)
    except ValueError:
        h.update(b"unparsed-safetensors\x00")
        return
    for name in sorted(k for k in entries if k != "__metadata__"):
        if not name.rsplit(".", 1)[-1].endswith(_SCALE_SUFFIXES):
            continue
        try:
            begin, end = (int(x) for x in entries[name]["data_offsets"])
        except (KeyError, TypeError, ValueError):
            continue  # a malformed entry: the header bytes hashed above still name it
        f.seek(8 + n + begin)
        h.update(f"{name}\x00".encode())
        h.update(f.read(max(0, min(end, size) - begin)))
