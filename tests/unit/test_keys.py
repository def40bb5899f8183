import random
import struct

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.kv.keys import IncrementalHasher, Namespace, chunk_hashes, validate_keys


def reference_chain(tokens: list[int], chunk: int, root: bytes) -> list[bytes]:
    """Independent computation: pack each token with struct, hash with a fresh blake3 object."""
    out, prev = [], root
    for i in range(len(tokens) // chunk):
        body = b"".join(struct.pack(">I", t) for t in tokens[i * chunk:(i + 1) * chunk])
        prev = blake3.blake3(prev + body).digest()
        out.append(prev)
    return out


def test_matches_independent_blake3_for_random_prompts_up_to_5000_tokens():
    rng = random.Random(1234)
    lengths = [0, 1, 255, 256, 257, 511, 512, 4999, 5000] + [rng.randrange(0, 5001) for _ in range(20)]
    for n in lengths:
        toks = [rng.randrange(0, 2**32) for _ in range(n)]
        chunk = rng.choice([1, 7, 16, 256])
        root = bytes(rng.randrange(256) for _ in range(32))
        assert chunk_hashes(toks, chunk, root) == reference_chain(toks, chunk, root), (n, chunk)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.integers(1, 64))
def test_property_matches_reference(toks, chunk):
    assert chunk_hashes(toks, chunk) == reference_chain(toks, chunk, bytes(32))


def test_only_full_chunks_and_default_chunk_is_256():
    toks = list(range(256 * 3 + 10))
    hs = chunk_hashes(toks)
    assert len(hs) == 3 and all(len(h) == 32 for h in hs)
    assert chunk_hashes(toks[:255]) == []


def test_list_numpy_and_torch_inputs_agree():
    toks = list(range(1000, 1000 + 600))
    ref = chunk_hashes(toks, 64)
    assert chunk_hashes(np.array(toks, dtype=np.int64), 64) == ref
    assert chunk_hashes(np.array(toks, dtype=np.uint32), 64) == ref
    assert chunk_hashes(torch.tensor(toks, dtype=torch.int32), 64) == ref
    assert chunk_hashes(torch.tensor(toks, dtype=torch.int64), 64) == ref


def test_prefix_sharing_and_divergence():
    a = list(range(512)) + [1] * 256
    b = list(range(512)) + [2] * 256
    ha, hb = chunk_hashes(a, 256), chunk_hashes(b, 256)
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    # A change in chunk 0 changes every later key (the chain), even if later tokens are equal.
    c = [7] + a[1:]
    assert all(x != y for x, y in zip(chunk_hashes(c, 256), ha))


@pytest.mark.parametrize("bad, what", [
    ([1, -1, 2], "token id -1"),
    ([2**32], "token id 4294967296"),
    (np.array([1, -5]), "token id -5"),
    (torch.tensor([3, -2]), "token id -2"),
    ([1.5, 2.0], "integers"),
    (np.array([[1, 2], [3, 4]]), "one-dimensional"),
    (["a", "b"], "integers"),
    ([True, False], "integers"),
    ([1, 2**70], "token id 1180591620717411303424"),
])
def test_bad_tokens_raise_clear_errors(bad, what):
    with pytest.raises(ValueError, match=what):
        chunk_hashes(bad, 1)


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
def test_bad_chunk_size(chunk):
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_hashes([1, 2, 3], chunk)


def test_bad_root():
    with pytest.raises(ValueError, match="root"):
        chunk_hashes([1, 2], 1, root=b"short")


def test_namespaces_isolate():
    base = Namespace("llama-tiny", "kv-bfloat16-abc", 256, None)
    variants = [
        Namespace("llama-other", "kv-bfloat16-abc", 256, None),
        Namespace("llama-tiny", "kv-float16-abc", 256, None),
        Namespace("llama-tiny", "kv-bfloat16-abc", 128, None),
        Namespace("llama-tiny", "kv-bfloat16-abc", 256, "tenant-a"),
    ]
    roots = {base.root()} | {v.root() for v in variants}
    assert len(roots) == len(variants) + 1
    toks = list(range(1024))
    assert base.chunk_hashes(toks) == chunk_hashes(toks, 256, base.root())
    assert base.chunk_hashes(toks)[0] != variants[-1].chunk_hashes(toks)[0]
    # Equal namespaces built separately agree (no per-process randomness).
    assert Namespace("llama-tiny", "kv-bfloat16-abc", 256, None).root() == base.root()


def test_namespace_has_no_tp_or_format():
    """Namespace v2: TP and byte format are not part of a key (readers convert and gather heads)."""
    doc = Namespace("m", "kv-bfloat16-abc").encode().decode()
    assert '"v":2' in doc and "tp" not in doc and "layout" not in doc


@pytest.mark.parametrize("kwargs, what", [
    (dict(model_id=""), "model_id"),
    (dict(content_fingerprint=""), "content_fingerprint"),
    (dict(chunk_tokens=0), "chunk_tokens"),
])
def test_namespace_validation(kwargs, what):
    args = dict(model_id="m", content_fingerprint="f") | kwargs
    with pytest.raises(ValueError, match=what):
        Namespace(**args)


def test_incremental_hasher_does_not_rehash():
    rng = random.Random(5)
    toks = [rng.randrange(50000) for _ in range(2000)]
    h = IncrementalHasher(256)
    assert h.update(toks[:300]) == chunk_hashes(toks[:300], 256)
    assert h.chunks_hashed == 1
    assert h.update(toks[:300]) == chunk_hashes(toks[:300], 256)
    assert h.chunks_hashed == 1
    assert h.update(toks[:1100]) == chunk_hashes(toks[:1100], 256)
    assert h.chunks_hashed == 4
    assert h.update(toks) == chunk_hashes(toks, 256)
    assert h.chunks_hashed == 7


def test_incremental_hasher_rejects_a_different_prompt():
    h = IncrementalHasher(4)
    h.update([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="does not extend"):
        h.update([9, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="does not extend"):
        h.update([1, 2])


def test_validate_keys():
    validate_keys([bytes(32)])
    with pytest.raises(ValueError, match="key 1"):
        validate_keys([bytes(32), b"x"])


def test_tail_key_names_exactly_those_tokens_after_that_prefix():
    import struct

    import blake3

    from pdxfer.kv.keys import IncrementalHasher, chunk_hashes, tail_key

    toks = list(range(1000, 1000 + 2 * 256 + 7))
    full = chunk_hashes(toks, 256)
    want = blake3.blake3(b"pdxfer.tail\x00" + full[-1] + struct.pack(">I", 7)
                         + struct.pack(">7I", *toks[512:])).digest()
    assert tail_key(full[-1], toks[512:]) == want  # an independent computation of the format
    assert IncrementalHasher(256).tail(toks) == want
    assert IncrementalHasher(256).tail(toks[:512]) is None  # on a chunk boundary: no tail
    assert tail_key(full[-1], toks[512:-1]) != want  # one token fewer: another key
    assert tail_key(full[0], toks[512:]) != want  # the same tokens after another prefix
    assert want not in full and tail_key(bytes(32), toks[:256]) != full[0]  # never a chunk key
    with pytest.raises(ValueError, match="at least one token"):
        tail_key(full[-1], [])
