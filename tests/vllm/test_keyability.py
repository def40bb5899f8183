"""Issue 9, hole 3: keys must name everything that shapes the KV, or the connector stays out.

Token ids and the cache salt do not name the KV of a request with a LoRA adapter, multimodal
inputs (identical placeholder tokens for different images) or prompt embeddings; and the same
model id can name different weights after an update. Real vLLM ``Request`` objects, real files.
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402



def _request(**kw) -> Request:
    return Request("r", [5, 6, 7], SamplingParams(max_tokens=1), None, **kw)


def test_requests_whose_kv_tokens_do_not_name_are_unkeyable():
    from pdxfer.vllm.keyability import unkeyable_reason

    assert unkeyable_reason(_request()) is None
    assert "LoRA" in unkeyable_reason(_request(lora_request=LoRARequest("ad", 1, "/tmp/ad")))
    assert "embeddings" in unkeyable_reason(_request(prompt_embeds=torch.zeros(3, 8)))


def test_weights_fingerprint_follows_the_bytes_not_the_path_or_mtime(tmp_path, tiny_model):
    from pdxfer.vllm.keyability import weights_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model, copy)  # new mtimes, same bytes: the same weights on another host
    assert weights_fingerprint(str(copy)) == weights_fingerprint(str(tiny_model))
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # an updated weight
    shard.write_bytes(bytes(data))
    assert weights_fingerprint(str(copy)) != weights_fingerprint(str(tiny_model))
    # Quantization changes what the KV is computed from, with the same files.
    assert weights_fingerprint(str(tiny_model), "fp8") != weights_fingerprint(str(tiny_model))
    # A hub name that is not a local directory: stable, and says so.
    assert weights_fingerprint("org/model") == weights_fingerprint("org/model")


def test_amx_packed_blocks_never_share_a_fingerprint_with_plain_cpu_blocks():
    """vLLM's CPU attention packs blocks for AMX tiles on AMX hosts (same tensor shape, other
    bytes): an AMX prefill host and a non-AMX decode host must not find each other's chunks."""
    from pdxfer.kv.layout import CPU, CPU_AMX, describe_kv_caches
    from pdxfer.vllm.connector_layout import cpu_kv_format

    buf = torch.zeros(2, 8, 2, 16, 2 * 8, dtype=torch.bfloat16)
    caches = {f"layer.{i}": buf[i] for i in range(2)}
    plain = describe_kv_caches(caches, kv_format=CPU)
    amx = describe_kv_caches(caches, kv_format=CPU_AMX)
    assert plain.fingerprint() != amx.fingerprint()
    assert (plain.head_dim, plain.kv_heads) == (amx.head_dim, amx.kv_heads) == (8, 2)
    assert cpu_kv_format("amx") == CPU_AMX
    assert cpu_kv_format("vec") == cpu_kv_format("vec16") == CPU


def test_only_tokens_whose_kv_is_written_are_published():
    """Issue 9, hole 8: with asynchronous scheduling ``num_computed_tokens`` already counts the
    token of the step in flight, whose KV is still being written when the request finishes."""
    from vllm.v1.request import RequestStatus

    from pdxfer.vllm.keyability import publishable_tokens

    prompt = list(range(10, 10 + 512))  # exactly two chunks
    req = _request_with(prompt)
    req.append_output_token_ids(7)  # sampled from the last prompt position
    req.num_computed_tokens = len(prompt) + 1  # async: the step computing token 7 is in flight
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert publishable_tokens(req) == prompt  # never the in-flight token 7
    req.num_computed_tokens = len(prompt)  # synchronous scheduling: the same answer
    assert publishable_tokens(req) == prompt
    req.status = RequestStatus.FINISHED_ABORTED
    assert publishable_tokens(req) is None  # aborted: nothing is known to be written


def _request_with(prompt: list[int]) -> Request:
    return Request("r", prompt, SamplingParams(max_tokens=1), None)
