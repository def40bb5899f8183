"""Decode instances are holders: a kv_consumer publishes its prompt and answer when a request
finishes, like a prefill, and another instance loads them (issue 18, item 3).

Driven through vLLM's real ``Scheduler`` (it builds ``PdxferConnector``, decides what is
scheduled, when a load finished, when and with what state a request finished) with a stand-in
forward pass (tests/vllm/sched_engine.py), a real master process and the real TCP transport.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

pytest.importorskip("vllm")

from pdxfer.kv.keys import IncrementalHasher  # noqa: E402
from pdxfer.master import MasterClient  # noqa: E402
from tests.vllm.conftest import wait_until  # noqa: E402
from tests.vllm.sched_engine import BS, CHUNK, LAYERS, NUM_BLOCKS, Engine, token_kv  # noqa: E402

PROMPT, ANSWER = 100, 60  # the answer's KV fills the prompt's partial chunk and one more


@pytest.fixture
def fleet(tiny_model, master):
    engines: list[Engine] = []

    def make(name: str, role: str, **extra) -> Engine:
        engines.append(Engine(name, str(tiny_model), master.address, role, **extra))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def _keys(engine: Engine, tokens: list[int]) -> list[bytes]:
    """What a holder of ``tokens`` publishes: every full chunk's key, then the tail's (if any)."""
    h = IncrementalHasher(CHUNK, engine.side.namespace(None).root())
    keys = h.update(list(tokens))
    tail = h.tail(list(tokens))
    return keys + ([tail] if tail is not None else [])


def _publish_spy(engine: Engine) -> list[list[bytes]]:
    """The keys of every publish the engine sends the master."""
    sent: list[list[bytes]] = []
    real = engine.side._hot.publish

    def publish(node_id, entries, *a, **kw):
        sent.append([bytes(k) for k, _ in entries])
        return real(node_id, entries, *a, **kw)

    engine.side._hot.publish = publish
    return sent


def _slot_kv(engine: Engine, blocks: list[int], pos: int) -> torch.Tensor:
    return torch.stack([engine.kv[n][blocks[pos // BS], :, pos % BS, :] for n in LAYERS])


def _holders(master_addr: str, keys: list[bytes], skip: dict[str, int] | None = None) -> tuple[int, set[str]]:
    """How many leading ``keys`` the fleet (less ``skip``) holds, and which nodes hold them."""
    with MasterClient(master_addr) as c:
        res = c.lookup_and_lock(keys, "probe", lock_ttl_s=2.0, skip=skip)
        if res.lock_id is not None:
            c.release(res.lock_id, all_parties=True)
    return res.hit_chunks, {loc.node_id for loc in res.locations}


def test_a_decode_publishes_its_prompt_and_answer_but_not_the_last_token(fleet, master):
    prefill = fleet("p1", "kv_producer")
    decode = fleet("d1", "kv_consumer")
    sent = _publish_spy(decode)
    prompt = _prompt(PROMPT, 1)
    prefill.run("pre", prompt, 1)
    req = decode.run("r", prompt, ANSWER)
    assert req.status.name == "FINISHED_LENGTH_CAPPED"
    assert decode.worker.stats.tokens_loaded == PROMPT - 1  # its prompt came from the prefill
    tokens = list(req.all_token_ids)
    assert len(tokens) == PROMPT + ANSWER
    # The last answer token was sampled, never computed: its KV slot was never written.
    blocks = decode.blocks["r"]
    assert torch.isnan(_slot_kv(decode, blocks, len(tokens) - 1)).all()
    want = _keys(decode, tokens[:-1])
    assert len(want) == 3  # 2 full chunks (the second holds answer tokens) and a 31-token tail
    wait_until(lambda: decode.side.stats.published_chunks == 3, "the decode never published", 5)
    assert sent == [want]
    assert decode.side.held_chunks == 3
    # Nobody waits for a decode's publish: its answer carries no hint (the prefill's does).
    assert decode.answer_params["r"] is None and prefill.answer_params["pre"]["pdxfer"]["hints"]
    # Every published token's KV is what computing it gives, loaded or computed here.
    for p in range(len(tokens) - 1):
        assert torch.equal(_slot_kv(decode, blocks, p), token_kv(tokens[:p + 1], decode.kv_heads, 2 * decode.head)), p
    # The master serves them from the decode: the chunk with answer tokens from it alone.
    assert _holders(master.address, want, skip={"p1": 0}) == (3, {"d1"})
    assert _holders(master.address, want[1:2]) == (1, {"d1"})


def test_a_second_decode_loads_the_first_decodes_answer(fleet):
    prefill = fleet("p2", "kv_producer")
    first = fleet("d2a", "kv_consumer")
    second = fleet("d2b", "kv_consumer")
    prompt = _prompt(PROMPT, 2)
    prefill.run("pre", prompt, 1)
    turn1 = list(first.run("t1", prompt, ANSWER).all_token_ids)
    wait_until(lambda: first.side.stats.published_chunks == 3, "the first decode never published", 5)
    # The next turn of the conversation: its previous prompt, the answer, a new message.
    turn2 = turn1 + _prompt(30, 3)
    second.run("t2", turn2, 4)
    # The full chunks of what the first decode held; its tail ends mid-chunk of turn 2.
    loaded = (len(turn1) - 1) // CHUNK * CHUNK
    assert second.worker.stats.tokens_loaded == loaded == 2 * CHUNK
    assert "d2a" in second.worker.connected_holders()
    a, b = first.blocks["t1"], second.blocks["t2"]
    for p in range(loaded):
        got = _slot_kv(second, b, p)
        assert torch.equal(got, _slot_kv(first, a, p)), p
        assert torch.equal(got, token_kv(turn2[:p + 1], second.kv_heads, 2 * second.head)), p


def test_a_decode_never_looks_up_its_own_chunks(fleet):
    prefill = fleet("p3", "kv_producer")
    decode = fleet("d3", "kv_consumer")
    other = fleet("d3b", "kv_consumer")
    prompt = _prompt(PROMPT, 4)
    prefill.run("pre", prompt, 1)
    turn2 = list(decode.run("t1", prompt, ANSWER).all_token_ids) + _prompt(30, 5)
    wait_until(lambda: decode.side.stats.published_chunks == 3, "the decode never published", 5)
    # Beyond the first chunk, only the decode itself holds turn 2's prefix: nothing to read.
    assert decode.side.get_num_new_matched_tokens("q", turn2, len(turn2), CHUNK, None) == (0, False)
    assert other.side.get_num_new_matched_tokens("q", turn2, len(turn2), CHUNK, None) == (CHUNK, True)
    other.side.request_finished("q", None, [], None)


def test_publish_as_decode_false_keeps_a_decode_a_reader_only(fleet, master):
    prefill = fleet("p4", "kv_producer", publish_as_decode=False)
    decode = fleet("d4", "kv_consumer", publish_as_decode=False)
    sent = _publish_spy(decode)
    prompt = _prompt(PROMPT, 6)
    prefill.run("pre", prompt, 1)
    assert prefill.side.held_chunks == 2  # a prefill publishes whatever the key says
    tokens = list(decode.run("r", prompt, ANSWER).all_token_ids)
    assert decode.worker.stats.tokens_loaded == PROMPT - 1
    time.sleep(0.2)  # a publish would be queued at request_finished: give it time to show
    assert sent == [] and decode.side.held_chunks == 0 and decode.side.stats.published_chunks == 0
    assert decode.side.holder.node_id is None and decode.side.fence is None
    assert "d4" not in _registrations(master.address) and "p4" in _registrations(master.address)
    assert decode.sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert _holders(master.address, _keys(decode, tokens[:-1])[1:]) == (0, set())


def test_a_decode_publishes_only_what_its_device_confirmed_written(fleet, master):
    prefill = fleet("p5", "kv_producer")
    decode = fleet("d5", "kv_consumer", publish_wait_s=0.0, publish_fence_wait_s=0.3)
    sent = _publish_spy(decode)
    prompt = _prompt(PROMPT, 7)
    prefill.run("pre", prompt, 1)
    decode.skip_fence = True  # its steps' KV writes are never confirmed
    tokens = list(decode.run("r", prompt, ANSWER).all_token_ids)
    wait_until(lambda: decode.side.stats.publishes_unfenced == 1, "the unfenced publish was never dropped", 5)
    wait_until(lambda: decode.side.held_chunks == 0, "the unfenced chunks were never given back", 5)
    assert sent == [] and decode.side.stats.published_chunks == 0
    assert _holders(master.address, _keys(decode, tokens[:-1]), skip={"p5": 0}) == (0, set())


def _registrations(master_addr: str) -> dict[str, object]:
    with MasterClient(master_addr) as c:
        return {info.node_id: info for info in c.nodes()}


def test_the_registration_tells_a_router_what_the_instance_is(fleet, master, monkeypatch):
    monkeypatch.setenv("PDXFER_SERVE_URL", "http://10.0.0.6:8200")  # what a launcher sets
    decode = fleet("d6", "kv_consumer", serve_url="http://10.0.0.5:8100/")
    prefill = fleet("p6", "kv_producer")
    both = fleet("b6", "kv_both", chunk_tokens=2 * CHUNK)
    regs = _registrations(master.address)
    for engine, role, url in ((decode, "kv_consumer", "http://10.0.0.5:8100"),
                              (prefill, "kv_producer", "http://10.0.0.6:8200"),
                              (both, "kv_both", "http://10.0.0.6:8200")):
        info = regs[engine.conn.engine_id]
        assert (info.role, info.serve_url, info.chunk_tokens) == (role, url, engine.conn.cfg.chunk_tokens)
        # A router hashes a prompt under this root and finds the keys this instance publishes.
        assert info.namespace == engine.side.namespace(None).root().hex()
    assert regs["b6"].chunk_tokens == 2 * CHUNK and regs["b6"].namespace != regs["p6"].namespace
    assert regs["d6"].namespace == regs["p6"].namespace
