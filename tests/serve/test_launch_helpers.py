"""Launcher, serve shim and tiny model helpers (no vLLM needed except the tiny model build).
Process control: tests/unit/test_procs.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdxfer.launch.fleet import start_fleet
from pdxfer.launch.plan import (instance_names, instances_share_cores, parse_core_list, parse_kv_config_args,
                             pdxfer_kv_config, shared_cores_env, split_cores, split_cores_among)
from pdxfer.launch.serve_shim import vllm_serve_argv, vllm_serve_env
from pdxfer.launch.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_model_deterministic_and_idempotent(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=0)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "a", seed=0) == a  # reused, not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime
    b = make_tiny_model(tmp_path / "b", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    with pytest.raises(ValueError, match="another seed"):
        make_tiny_model(tmp_path / "a", seed=1)
    with pytest.raises(ValueError, match="another seed or architecture"):
        make_tiny_model(tmp_path / "a", seed=0, arch="sliding")
    with pytest.raises(ValueError, match="unknown tiny model architecture 'mamba'; pick one of llama, sliding, gdn"):
        make_tiny_model(tmp_path / "c", arch="mamba")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("mine")
    with pytest.raises(ValueError, match="not a pdxfer tiny model"):
        make_tiny_model(foreign)

    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(a)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 4, 2, 64)
    assert cfg.max_position_embeddings >= 4096
    tok = AutoTokenizer.from_pretrained(a)
    assert 2000 <= len(tok) <= 4096 and len(tok) == cfg.vocab_size
    text = "the data block cache 12345 ünïcode"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|assistant|>\n")


@pytest.mark.parametrize("arch,layer_kinds,dtype", [
    ("sliding", ["sliding_attention", "sliding_attention", "full_attention"] * 2, "float32"),
    ("gdn", ["linear_attention"] * 3 + ["full_attention"], "bfloat16"),
])
def test_the_hybrid_tiny_models_mix_the_layer_kinds_vllm_groups(tmp_path: Path, arch: str,
                                                                 layer_kinds: list[str], dtype: str) -> None:
    """Each hybrid mixes layer kinds that vLLM's hybrid KV cache manager puts in separate KV cache
    groups, in a dtype its CPU kernels take, with the shared tokenizer."""
    from transformers import AutoConfig

    built = make_tiny_model(tmp_path / arch, arch=arch)
    assert make_tiny_model(tmp_path / arch, arch=arch) == built  # reused
    cfg = AutoConfig.from_pretrained(built)
    assert cfg.layer_types == layer_kinds
    assert str(cfg.dtype).removeprefix("torch.") == dtype
    if arch == "sliding":
        assert cfg.architectures == ["Gemma3ForCausalLM"] and cfg.sliding_window == 128
    else:
        assert cfg.architectures == ["Qwen3NextForCausalLM"]
        assert cfg.head_dim == cfg.linear_key_head_dim == cfg.linear_value_head_dim == 128
        assert cfg.linear_num_key_heads == cfg.linear_num_value_heads
    assert (built / "tokenizer.json").read_bytes() == (make_tiny_model(tmp_path / "llama") / "tokenizer.json").read_bytes()


def test_vllm_argv_and_env(tmp_path: Path) -> None:
    argv = vllm_serve_argv(tmp_path, 1234, {"kv_connector": "PdxferConnector", "kv_role": "kv_both"},
                           ["--max-model-len", "4096"])
    assert argv[:4] == [sys.executable, "-m", "pdxfer.launch.serve_shim", "serve"]
    assert argv[argv.index("--port") + 1] == "1234"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--enforce-eager" in argv and argv[-2:] == ["--max-model-len", "4096"]
    assert '"kv_connector":"PdxferConnector"' in argv[argv.index("--kv-transfer-config") + 1]
    env = vllm_serve_env("1", tmp_path / "cache", {"X_EXTRA": "y"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["X_EXTRA"] == "y"
    assert env["VLLM_CACHE_ROOT"].startswith(str(tmp_path))


def test_split_cores_gives_disjoint_halves() -> None:
    assert split_cores([0, 1]) == ("0", "1")
    assert split_cores([3]) == ("3", "3")
    assert split_cores([4, 5, 6, 7, 8]) == ("4,5", "6,7,8")
    with pytest.raises(ValueError, match="no CPU"):
        split_cores([])
    p, d = split_cores()
    assert set(map(int, p.split(","))) | set(map(int, d.split(","))) == os.sched_getaffinity(0)


def test_cores_are_split_among_every_instance_of_a_fleet() -> None:
    assert split_cores_among(4, range(8)) == ["0,1", "2,3", "4,5", "6,7"]
    assert split_cores_among(4, range(10)) == ["0,1", "2,3", "4,5,6", "7,8,9"]
    assert split_cores_among(4, [0, 1]) == ["0", "1", "0", "1"]  # fewer cores: shared in turn
    assert split_cores_among(1, [2, 3]) == ["2,3"]
    with pytest.raises(ValueError, match="at least one instance"):
        split_cores_among(0, [0])
    assert instance_names("prefill", 1) == ["prefill"]
    assert instance_names("decode", 2) == ["decode-0", "decode-1"]


def test_a_fleet_refuses_bad_counts_and_core_lists_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        start_fleet(tmp_path, tmp_path, n_prefill=0)
    with pytest.raises(ValueError, match="one core list per instance"):
        start_fleet(tmp_path, tmp_path, n_prefill=2, n_decode=1, prefill_cpus=["0"])


def test_each_instance_is_told_its_own_serve_url() -> None:
    cfg = pdxfer_kv_config("kv_consumer", "127.0.0.1:5000", serve_url="http://127.0.0.1:8101")
    assert cfg["kv_connector_extra_config"]["serve_url"] == "http://127.0.0.1:8101"
    assert cfg["kv_role"] == "kv_consumer"


def test_launch_rejects_bad_model_dir(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "pdxfer.cli", "launch", str(tmp_path / "nothing")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no config.json" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pdxfer.cli", "launch"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--make-tiny-model" in r.stderr


def test_kv_config_items_become_typed_connector_settings() -> None:
    assert parse_kv_config_args(["publish_hint_wait_s=2.5", "load_benefit=true", "host_tier_mib=auto",
                                 'listen_host="0.0.0.0"']) == {
        "publish_hint_wait_s": 2.5, "load_benefit": True, "host_tier_mib": "auto", "listen_host": "0.0.0.0"}
    assert parse_kv_config_args([]) == {}


@pytest.mark.parametrize("item, says", [
    ("publish_hint_wait_s", "expected KEY=VALUE"),
    ("=3", "expected KEY=VALUE"),
    ("master=10.0.0.1:7000", "use --master"),
    ("chunk_tokens=128", "use --chunk-tokens"),
    ("serve_url=http://x:1", "set by launch itself"),
    ("publish_hint_wait_s=soon", "publish_hint_wait_s must be a number"),
    ("publish_hint_wait=1", "unknown kv_connector_extra_config key(s) ['publish_hint_wait']"),
])
def test_a_bad_kv_config_item_is_refused_naming_it(item: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_kv_config_args(["retention_s=30", item])


def test_launch_refuses_a_bad_kv_config_before_starting_anything(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, "-m", "pdxfer.cli", "launch", str(tmp_path), "--log-dir",
                        str(tmp_path / "logs"), "--kv-config", "lock_ttl=5"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "['lock_ttl']" in r.stderr, r.stderr
    assert not (tmp_path / "logs").exists()  # refused before any process or log
    r = subprocess.run([sys.executable, "-m", "pdxfer.cli", "launch", str(tmp_path), "--no-connector",
                        "--kv-config", "lock_ttl_s=5"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--no-connector" in r.stderr, r.stderr


def test_core_lists_in_vllm_bind_syntax() -> None:
    assert parse_core_list("3") == {3}
    assert parse_core_list("0-2,5") == {0, 1, 2, 5}
    assert parse_core_list("0,1|2,3") == {0, 1, 2, 3}  # TP ranks
    for bad in ("", "a", "3-1", "-1", "0,,1"):
        with pytest.raises(ValueError, match="not a core or a range"):
            parse_core_list(bad)


def test_instances_that_share_a_core_get_the_spin_sleep_unless_the_user_chose() -> None:
    # More instances than cores: split_cores_among shares round-robin (a 2x1 fleet on 2 cores).
    shared = split_cores_among(3, cores=[0, 1])
    assert instances_share_cores(shared) and not instances_share_cores(split_cores_among(2, cores=[0, 1]))
    assert instances_share_cores(["0-3", "3-5"]) and not instances_share_cores(["0-3", "4-5"])
    assert instances_share_cores(["0", None]) and not instances_share_cores([None])
    assert shared_cores_env(shared, connector=True, environ={}) == {"PDXFER_VLLM_SPIN_SLEEP_US": "200"}
    assert shared_cores_env(["0", "1"], connector=True, environ={}) == {}
    assert shared_cores_env(shared, connector=False, environ={}) == {}  # nothing applies it
    assert shared_cores_env(shared, connector=True, environ={"PDXFER_VLLM_SPIN_SLEEP_US": "50"}) == {}
