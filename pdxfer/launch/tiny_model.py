"""The tiny random-weight models that tests, demos and benchmarks serve (no download): a Llama,
and two hybrids of the kinds people serve now (``arch``): ``sliding`` (Gemma 3 style, sliding-window
attention on 4 of 6 layers, float32) and ``gdn`` (Qwen3-Next style, three gated-delta-net layers
and one full-attention layer, bf16: vLLM's CPU GDN kernel takes bf16 only).

``make_tiny_model(DIR)`` builds one once (deterministic for a seed, idempotent: a complete
directory is reused) together with a byte-level BPE tokenizer trained on seeded pseudo-text;
``default_tiny_model_dir()`` is where tests and benchmarks share it. A marker file tells a
complete tiny model from a half-built or foreign directory, and lets the serve shim name it
``tiny``. torch, tokenizers and transformers are imported only when a model is built.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from pdxfer.common.procs import default_run_dir

TINY_COMPLETE_MARKER = ".pdxfer-tiny-model"
TINY_ARCHS = ("llama", "sliding", "gdn")
TINY_SLIDING_WINDOW = 128  # tokens: far below the prompts tests use, so windows are visible
TINY_VOCAB = 4096
TINY_MAX_POSITIONS = 8192
# A simple chat template so /v1/chat/completions works with the local tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_SYLLABLES = (
    "ka ri to mu se na lo vi pe da quo zen tra bel mor fin gal hus ix op ul em ar in on "
    "st ch sh th pl gr br cl dr fr "
    "the and of to in is it that was for on are with as be at by this from or have an they "
    "data block cache token layer chunk read write key value model prefix decode prefill "
).split()


def _tiny_corpus(seed: int, n_lines: int = 6000) -> list[str]:
    """Deterministic pseudo-text with enough distinct words for a ~4k-entry BPE vocabulary."""
    rng = random.Random(seed)
    words = []
    for _ in range(3000):
        n = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(n)))
    # Zipf-like weights so merges have a clear frequency order.
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(words))]
    punct = (".", ",", "?", "!", ";", ":", "")
    lines = []
    for _ in range(n_lines):
        k = rng.randint(5, 25)
        toks = rng.choices(words, weights, k=k)
        if rng.random() < 0.3:
            toks.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(toks) + rng.choice(punct))
    return lines


def _is_complete_tiny(path: Path, seed: int, arch: str = "llama") -> bool:
    marker = path / TINY_COMPLETE_MARKER
    try:
        built = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return built.get("seed") == seed and built.get("arch", "llama") == arch


def _model_of(arch: str, vocab: int, bos: int, eos: int) -> tuple[object, object]:
    """(the random model, its torch dtype) for ``arch``; the caller seeds torch."""
    import torch

    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=TINY_MAX_POSITIONS, bos_token_id=bos,
                  eos_token_id=eos, tie_word_embeddings=False, initializer_range=0.02)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, head_dim=64, **common)), torch.bfloat16
    if arch == "sliding":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        kinds = ["sliding_attention", "sliding_attention", "full_attention"] * 2
        config = Gemma3TextConfig(num_hidden_layers=len(kinds), head_dim=32, layer_types=kinds,
                                  sliding_window=TINY_SLIDING_WINDOW, **common)
        config.architectures = ["Gemma3ForCausalLM"]
        return Gemma3ForCausalLM(config), torch.float32
    if arch == "gdn":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        # vLLM's CPU kernels accept only these head shapes: every head dim 128, as many linear key
        # heads as value heads (others fail at the first request).
        kinds = ["linear_attention"] * 3 + ["full_attention"]
        config = Qwen3NextConfig(num_hidden_layers=len(kinds), head_dim=128, layer_types=kinds,
                                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                                 linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=128, shared_expert_intermediate_size=128, **common)
        config.architectures = ["Qwen3NextForCausalLM"]
        return Qwen3NextForCausalLM(config), torch.bfloat16
    raise ValueError(f"unknown tiny model architecture {arch!r}; pick one of {', '.join(TINY_ARCHS)}")


def make_tiny_model(out_dir: str | Path, seed: int = 0, arch: str = "llama") -> Path:
    """Build a tiny random-weight model and a locally trained tokenizer in `out_dir`.

    Every ``arch``: hidden 256, 4 heads, 2 KV heads, vocab 4096, 8192 positions. ``llama``: 4 layers,
    head_dim 64, bf16. ``sliding``: 6 layers (sliding window of 128 tokens on 4), head_dim 32,
    float32. ``gdn``: 3 gated-delta-net layers + 1 full-attention layer, head dims 128, 4 experts,
    bf16. Idempotent: a complete directory built with the same seed and arch is reused as is; one
    built otherwise is an error, a half-built one is rebuilt. Deterministic for a seed.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny model architecture {arch!r}; pick one of {', '.join(TINY_ARCHS)}")
    out = Path(out_dir).resolve()
    if _is_complete_tiny(out, seed, arch):
        return out
    if out.exists() and (out / TINY_COMPLETE_MARKER).exists():
        raise ValueError(f"{out} holds a tiny model built with another seed or architecture; pick another "
                         "directory")
    if out.exists() and any(out.iterdir()) and not (out / ".pdxfer-building").exists():
        raise ValueError(f"{out} exists, is not empty and is not a pdxfer tiny model")

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / ".pdxfer-building").touch()

    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(seed), trainer=trainer)
    vocab = tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.model_max_length = TINY_MAX_POSITIONS
    fast.save_pretrained(tmp)

    torch.manual_seed(seed)
    model, dtype = _model_of(arch, vocab, fast.bos_token_id, fast.eos_token_id)
    with torch.no_grad():
        # Spread the logits: with the default 0.02 init the top-2 logits of a random model differ
        # by less than bf16 noise, so greedy output would flip between numerically different (but
        # correct) execution paths. A wide lm_head makes greedy decoding a stable reference.
        model.lm_head.weight.normal_(0.0, 0.5)
    model = model.to(dtype)
    model.save_pretrained(tmp)
    (tmp / ".pdxfer-building").unlink()
    (tmp / TINY_COMPLETE_MARKER).write_text(json.dumps({"seed": seed, "vocab": vocab, "arch": arch}))
    if out.exists() and not _is_complete_tiny(out, seed, arch):
        shutil.rmtree(out, ignore_errors=True)  # a half-built directory left by a killed build
    try:
        tmp.rename(out)
    except OSError:
        # Another process finished the same build first (tests in parallel): use theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_complete_tiny(out, seed, arch):
            raise
    return out


def is_tiny_model(model_dir: str | Path) -> bool:
    """True for a directory that make_tiny_model completed (whatever the seed)."""
    return (Path(model_dir) / TINY_COMPLETE_MARKER).exists()


def default_tiny_model_dir(arch: str = "llama") -> Path:
    """Where tests and benchmarks keep the shared tiny model of ``arch`` (seed 0)."""
    return default_run_dir() / ("tiny-model" if arch == "llama" else f"tiny-model-{arch}")
