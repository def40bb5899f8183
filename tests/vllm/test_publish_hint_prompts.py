"""Issue 16, hole 8: publish hints are per prompt.

vLLM answers a completion of several prompts with ONE ``kv_transfer_params`` (prompt 0's), and
the decode request's ``kv_transfer_params`` go to every one of its prompts: a hint that does not
name its prompt made every prompt wait for prompt 0's chunks. A hint names the prompt it was
computed for; the proxy prefills each prompt of a multi-prompt completion on its own and forwards
all their hints; each decode prompt uses only its own.
"""

from __future__ import annotations

import pytest
from aiohttp import web

from pdxfer.serve.proxy import PDProxy, RunningProxy
from pdxfer.contracts import publish_hint as hints
from tests.serve.test_proxy import FakeInstance, instances, post  # noqa: F401  (instances: a fixture)

C = 256


def test_a_hint_applies_only_to_the_prompt_it_was_computed_for():
    publish_hint, hinted_tokens, merge_hints = hints.publish_hint, hints.hinted_tokens, hints.merge_hints
    p0, p1 = list(range(2 * C + 5)), list(range(1, 3 * C + 1))
    h0 = publish_hint(len(p0), len(p0), C, p0)
    assert hinted_tokens(h0, p0) == len(p0)
    assert hinted_tokens(h0, p1) == 0  # another prompt never waits on prompt 0's hint
    assert hinted_tokens(h0, p0[:-1]) == 0 and hinted_tokens(h0, p0 + [7]) == 0
    # A publish past the prompt (generated tokens) still announces only the prompt's full chunks.
    assert hinted_tokens(publish_hint(len(p0) + 9, len(p0), C, p0), p0) == 2 * C
    assert publish_hint(0, len(p0), C, p0) is None
    # Several prompts' hints in one kv_transfer_params: each prompt finds its own.
    both = merge_hints([h0, publish_hint(2 * C, len(p1), C, p1), None, {"other": 1}])
    assert hinted_tokens(both, p0) == len(p0) and hinted_tokens(both, p1) == 2 * C
    assert hinted_tokens(both, list(range(7, 300))) == 0
    assert merge_hints([None, {"other": 1}]) is None
    # Malformed or old hints (no prompt named) are ignored: the request simply does not wait.
    for bad in ({"pdxfer": {"v": 1, "published_tokens": 5}}, {"pdxfer": {"v": 2, "hints": "x"}},
                {"pdxfer": {"v": 2, "hints": [{"published_tokens": True, "prompt": "ab"}]}}, None, 3):
        assert hinted_tokens(bad, p0) == 0


class PrefillLike(FakeInstance):
    """Answers like a pdxfer prefill: ``kv_transfer_params`` carry the hint of prompt 0 only
    (what vLLM does for a completion of several prompts)."""

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append((request.path, body))
        prompt = body["prompt"]
        prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        first = prompts[0]
        return web.json_response({"choices": [{"text": "x"} for _ in prompts],
                                  "kv_transfer_params": hints.publish_hint(len(first), len(first), C, first)})


@pytest.fixture
def prefill_like():
    inst = PrefillLike("prefill")
    yield inst
    inst.stop()


def test_each_prompt_of_a_multi_prompt_completion_gets_its_own_hint(prefill_like, instances):
    dec = instances("decode")
    prompts = [list(range(10, 10 + 2 * C + 3)), list(range(20, 20 + C + 40)), list(range(30, 30 + 3 * C))]
    with RunningProxy(PDProxy([prefill_like.url], [dec.url])) as rp:
        status, _, _ = post(rp.url + "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 4})
    assert status == 200
    # One prefill step per prompt (each answer's hint is that prompt's), one decode request.
    assert sorted(len(b["prompt"]) for _, b in prefill_like.received) == sorted(len(p) for p in prompts)
    assert len(dec.received) == 1
    params = dec.received[0][1]["kv_transfer_params"]
    assert [hints.hinted_tokens(params, p) for p in prompts] == [len(p) for p in prompts]
