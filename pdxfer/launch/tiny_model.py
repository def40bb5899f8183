"""The tiny random-weight Llama that tests, demos and benchmarks serve (no download).

``make_tiny_model(DIR)`` builds it once (deterministic for a seed, idempotent: a complete
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


def _is_complete_tiny(path: Path, seed: int) -> bool:
    marker = path / TINY_COMPLETE_MARKER
    try:
        return json.loads(marker.read_text()).get("seed") == seed
    except (OSError, ValueError):
        return False


def make_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny random-weight Llama and a locally trained tokenizer in `out_dir`.

    hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, vocab 4096, 8192 positions, bf16.
    Idempotent: a complete directory built with the same seed is reused as is; a directory built
    with another seed (or half-built) is an error / rebuilt respectively. Deterministic for a seed.
    """
    out = Path(out_dir).resolve()
    if _is_complete_tiny(out, seed):
        return out
    if out.exists() and (out / TINY_COMPLETE_MARKER).exists():
        raise ValueError(f"{out} holds a tiny model built with another seed; pick another directory")
    if out.exists() and any(out.iterdir()) and not (out / ".pdxfer-building").exists():
        raise ValueError(f"{out} exists, is not empty and is not a pdxfer tiny model")

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=TINY_MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.02,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Spread the logits: with the default 0.02 init the top-2 logits of a random model differ
        # by less than bf16 noise, so greedy output would flip between numerically different (but
        # correct) execution paths. A wide lm_head makes greedy decoding a stable reference.
        model.lm_head.weight.normal_(0.0, 0.5)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp)
    (tmp / ".pdxfer-building").unlink()
    (tmp / TINY_COMPLETE_MARKER).write_text(json.dumps({"seed": seed, "vocab": vocab}))
    if out.exists() and not _is_complete_tiny(out, seed):
        shutil.rmtree(out, ignore_errors=True)  # a half-built directory left by a killed build
    try:
        tmp.rename(out)
    except OSError:
        # Another process finished the same build first (tests in parallel): use theirs.
        shutil.rmtree(tmp, ignore_errors=True)
        if not _is_complete_tiny(out, seed):
            raise
    return out


def is_tiny_model(model_dir: str | Path) -> bool:
    """True for a directory that make_tiny_model completed (whatever the seed)."""
    return (Path(model_dir) / TINY_COMPLETE_MARKER).exists()


def default_tiny_model_dir() -> Path:
    """Where tests and benchmarks keep the shared tiny model (seed 0)."""
    return default_run_dir() / "tiny-model"
