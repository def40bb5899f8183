"""Property test: no well-framed request, however wrong its fields, makes the service fail
internally; every bad field is answered with a named protocol error."""

from __future__ import annotations

import json
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pdxfer.master.wire import protocol as P
from pdxfer.master.server.master_service import MasterService

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
_fields = ["node_id", "epoch", "seq", "upto", "fence", "rank", "transport", "fp", "layout", "ttl", "n", "per", "counts", "ret", "reader", "lock", "have", "skip", "transport", "serve_url", "ns", "ct", "role"]
_docs = st.dictionaries(st.sampled_from(_fields), _values | st.just("h") | st.just(1), max_size=6)


def _service() -> MasterService:
    svc = MasterService()
    svc.index.register("h", json.dumps({"epoch": 1}), 60.0, time.monotonic())
    return svc


SVC = _service()


@settings(max_examples=150, deadline=None)
@given(op=st.sampled_from(sorted(P.OP_NAMES)), doc=_docs, blob=st.binary(max_size=200))
def test_no_internal_errors(op, doc, blob):
    SVC.index.heartbeat("h", time.monotonic())
    frame = P.encode_frame(op, 9, doc, blob)
    hdr = P.parse_header(frame[: P.HEADER_BYTES])
    reply, _keep = SVC._handle(hdr, frame[P.HEADER_BYTES :], "prop")
    rhdr = P.parse_header(reply[: P.HEADER_BYTES])
    assert rhdr.req_id == 9
    rdoc = P.decode_json(reply[P.HEADER_BYTES : P.HEADER_BYTES + rhdr.json_len])
    if rhdr.op == P.OP_ERROR:
        assert rdoc["err"] != P.ERR_INTERNAL, (op, doc, rdoc)
        assert rdoc["msg"]
    else:
        assert rhdr.op == op | P.REPLY_BIT
