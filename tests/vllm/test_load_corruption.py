"""The load-corruption test hook (pdxfer.vllm.faults.load_corruption) on real tensors, without vLLM:
each mode damages exactly what it says, and nothing happens without the hook."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pdxfer.kv.layout import describe_kv_caches  # noqa: E402
from pdxfer.vllm.faults import load_corruption  # noqa: E402
from pdxfer.contracts.connector_config import TEST_HOOKS_ENV  # noqa: E402

BLOCKS, HEADS, BS, HD = 12, 2, 16, 8


@pytest.fixture
def kv():
    # Two layers as views of one allocation, like vLLM's CPU cache: [blocks, heads, block_size, 2*hd].
    whole = torch.randn(2, BLOCKS, HEADS, BS, 2 * HD)
    caches = {"layer.0": whole[0], "layer.1": whole[1]}
    return caches, describe_kv_caches(caches, block_size=BS)


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    monkeypatch.setattr(load_corruption, "_earlier", [])
    return tmp_path


def _set(hooks, mode: str) -> None:
    (hooks / load_corruption.HOOK_NAME).write_text(mode)


def test_without_the_hook_nothing_changes(kv, tmp_path, monkeypatch):
    caches, layout = kv
    before = {k: v.clone() for k, v in caches.items()}
    monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    (tmp_path / load_corruption.HOOK_NAME).write_text("zero_layer")
    load_corruption.maybe_corrupt_load(layout, "r", [1, 2, 3])
    monkeypatch.setenv(TEST_HOOKS_ENV, str(tmp_path))
    (tmp_path / load_corruption.HOOK_NAME).unlink()
    load_corruption.maybe_corrupt_load(layout, "r", [1, 2, 3])
    assert all(torch.equal(caches[k], before[k]) for k in caches)


def test_shift_moves_every_block_one_later(kv, hooks):
    caches, layout = kv
    before = {k: v.clone() for k, v in caches.items()}
    _set(hooks, "shift")
    load_corruption.maybe_corrupt_load(layout, "r", [5, 2, 7])
    for k in caches:
        assert torch.equal(caches[k][5], before[k][5])
        assert torch.equal(caches[k][2], before[k][5]) and torch.equal(caches[k][7], before[k][2])
        untouched = [b for b in range(BLOCKS) if b not in (2, 7)]
        assert torch.equal(caches[k][untouched], before[k][untouched])


def test_other_takes_a_block_an_earlier_load_filled(kv, hooks):
    caches, layout = kv
    _set(hooks, "zero_layer")
    load_corruption.maybe_corrupt_load(layout, "r1", [9, 10])  # an earlier load
    before = {k: v.clone() for k, v in caches.items()}
    _set(hooks, "other")
    load_corruption.maybe_corrupt_load(layout, "r2", [1, 3, 4])
    for k in caches:
        assert torch.equal(caches[k][3], before[k][10])  # the middle block, from the latest earlier load
        assert torch.equal(caches[k][[1, 4]], before[k][[1, 4]])


def test_zero_layer_zeroes_the_first_layer_of_the_loaded_blocks_only(kv, hooks):
    caches, layout = kv
    before = {k: v.clone() for k, v in caches.items()}
    _set(hooks, "zero_layer")
    load_corruption.maybe_corrupt_load(layout, "r", [0, 6])
    assert not caches["layer.0"][[0, 6]].any()
    assert torch.equal(caches["layer.0"][1:6], before["layer.0"][1:6])
    assert torch.equal(caches["layer.1"], before["layer.1"])


def test_a_mode_that_cannot_apply_is_logged_and_changes_nothing(kv, hooks, caplog):
    caches, layout = kv
    before = {k: v.clone() for k, v in caches.items()}
    _set(hooks, "other")  # no earlier load to take a block from
    load_corruption.maybe_corrupt_load(layout, "r", [1, 2])
    _set(hooks, "bogus")
    load_corruption.maybe_corrupt_load(layout, "r", [3, 4])
    assert all(torch.equal(caches[k], before[k]) for k in caches)
    assert sum("cannot apply mode" in r.getMessage() for r in caplog.records) == 2
