"""A bigger random-weight Llama for bench/pd.py --model: the tiny model's tokenizer, larger layers.

The project's tiny model prefills 300 tokens in ~18 ms on one core here, so a millisecond of
scheduling noise is 5% of a TTFT; this model (default: hidden 512, 6 layers, 8 heads, 4 KV heads,
head_dim 64, ~18 M parameters, 12 KiB of float32 KV per token) makes prefills 5-10x longer and
KV loads 6x larger, closer to what the issue's users measure, and still fits the 2-core box.

    python bench/make_model.py --out .pdxfer-run/bench-model [--hidden 512 --layers 6 ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from pdxfer.launch.tiny_model import TINY_COMPLETE_MARKER, TINY_MAX_POSITIONS, default_tiny_model_dir, make_tiny_model

_MARKER = ".pdxfer-bench-model"


def make_bench_model(out: Path, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                     intermediate: int, seed: int = 0) -> Path:
    """Build (idempotently: same arguments, same directory reused) the model in ``out``."""
    spec = {"hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "intermediate": intermediate, "seed": seed}
    marker = out / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    if out.exists() and any(out.iterdir()) and not marker.exists():
        raise SystemExit(f"{out} exists, is not empty and is not a pdxfer bench model")
    if heads % kv_heads:
        raise SystemExit(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = make_tiny_model(default_tiny_model_dir())
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json",
                                                                "generation_config.json", TINY_COMPLETE_MARKER))
    tiny_cfg = json.loads((tiny / "config.json").read_text())
    config = LlamaConfig(vocab_size=tiny_cfg["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=TINY_MAX_POSITIONS,
                         bos_token_id=tiny_cfg["bos_token_id"], eos_token_id=tiny_cfg["eos_token_id"],
                         tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # a stable greedy argmax (see tiny_model.py)
    model.to(torch.bfloat16).save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = make_bench_model(a.out.resolve(), a.hidden, a.layers, a.heads, a.kv_heads, a.head_dim, a.intermediate,
                           a.seed)
    print(out)


if __name__ == "__main__":
    main()
