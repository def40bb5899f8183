"""`pdxfer status --json` against a running pair (master, prefill, decode on the CPU): both
instances are listed with their roles, and the prefill holds the chunks of the prompt it served."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.vllm.conftest import make_pair, prompt_of, through_pair, wait_until

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_model):
    # The decode registers as a holder too, so the status lists both instances.
    yield from make_pair(tmp_path_factory, tiny_model, "tcp", extra_cfg={"publish_as_decode": True})


def status(master: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "pdxfer.cli", "status", "--master", master, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_lists_both_instances_and_the_prefills_chunks(pair):
    through_pair(pair, prompt_of(600, seed=5100), 4)
    pair.wait_published(1)

    def prefill_holds() -> bool:
        return any(n["role"] == "kv_producer" and n["entries"] > 0 for n in status(pair.master_addr)["nodes"])

    wait_until(prefill_holds, "the prefill's chunks in the status", timeout=20)
    doc = status(pair.master_addr)
    assert doc["master"]["leader"] is True
    roles = {n["role"]: n for n in doc["nodes"]}
    assert set(roles) == {"kv_producer", "kv_consumer"}, doc["nodes"]
    prefill, decode = roles["kv_producer"], roles["kv_consumer"]
    assert prefill["node_id"] != decode["node_id"]
    assert prefill["entries"] > 0 and prefill["blocks"] > 0
    assert prefill["transport"] == "tcp" and prefill["endpoints"][0]["endpoint"]
    assert prefill["layout"]["chunk_tokens"] > 0 and prefill["layout"]["namespace"]
