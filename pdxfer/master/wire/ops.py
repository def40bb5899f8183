"""Every master op's request and reply codecs, listed in one place (each op group's module holds
their code). The client and the service call them as ``ops.<name>``.

``encode_<op>(...)`` builds a request (op, JSON document, blob); ``decode_<op>(doc, blob)`` checks
and parses it on the service side. ``encode_<op>_reply(...)`` builds the reply document and
``decode_<op>_reply(doc, blob, ...)`` checks and parses it on the client side. Every check names the
field that is wrong (a ``ProtocolError`` with code ``malformed`` or ``oversized``), so a field's
name, type and bounds are written down once, in the op's module:

- ops_common.py: the request triple, shared bounds and field checks, block counts, node references;
- ops_nodes.py: register (and node descriptions), heartbeat, deregister, nodes;
- ops_publish.py: publish, unpublish_if_unlocked, fence;
- ops_lookup.py: lookup_and_lock, peek, release;
- ops_service.py: hello, stats, ping, status.
"""

from __future__ import annotations

# Shared by every op.
from pdxfer.master.wire.ops_common import (
    MAX_EPOCH,
    MAX_KV_HEADS,
    MAX_RANK,
    MAX_RETENTION_S,
    MAX_SEQ,
    MAX_SKIP,
    MAX_TP,
    MAX_TTL_S,
    MIN_LEASE_TTL_S,
    MIN_LOCK_TTL_S,
    NodeRef,
    Request,
    get_block_counts,
    put_block_counts,
)

# register (its reply, and the node description a lookup, peek or nodes reply carries)
from pdxfer.master.wire.ops_nodes import (
    MAX_CHUNK_TOKENS,
    MAX_NAMESPACE_CHARS,
    MAX_URL_CHARS,
    ROLES,
    RegisterRequest,
    Serving,
    decode_node_description,
    decode_register,
    decode_register_reply,
    encode_node_description,
    encode_register,
    encode_register_reply,
    serving_of,
)

# heartbeat, deregister
from pdxfer.master.wire.ops_nodes import (
    decode_deregister,
    decode_deregister_reply,
    decode_heartbeat,
    decode_heartbeat_reply,
    encode_deregister,
    encode_deregister_reply,
    encode_heartbeat,
    encode_heartbeat_reply,
)

# nodes (the live registrations)
from pdxfer.master.wire.ops_nodes import decode_nodes_reply, encode_nodes, encode_nodes_reply

# publish
from pdxfer.master.wire.ops_publish import (
    PublishRequest,
    decode_publish,
    decode_publish_reply,
    encode_publish,
    encode_publish_reply,
)

# unpublish_if_unlocked
from pdxfer.master.wire.ops_publish import (
    UnpublishRequest,
    decode_unpublish,
    decode_unpublish_reply,
    encode_unpublish,
    encode_unpublish_reply,
)

# fence
from pdxfer.master.wire.ops_publish import decode_fence, decode_fence_reply, encode_fence, encode_fence_reply

# lookup_and_lock
from pdxfer.master.wire.ops_lookup import (
    LookupReply,
    LookupRequest,
    decode_lookup,
    decode_lookup_reply,
    encode_lookup,
    encode_lookup_reply,
)

# peek (read-only lookup)
from pdxfer.master.wire.ops_lookup import (
    PeekReply,
    PeekRequest,
    decode_peek,
    decode_peek_reply,
    encode_peek,
    encode_peek_reply,
)

# release
from pdxfer.master.wire.ops_lookup import decode_release, decode_release_reply, encode_release, encode_release_reply

# hello
from pdxfer.master.wire.ops_service import decode_hello, decode_hello_reply, encode_hello

# stats, ping
from pdxfer.master.wire.ops_service import (
    decode_ping_reply,
    decode_stats_reply,
    encode_ping,
    encode_ping_reply,
    encode_stats,
)

# status (operator view)
from pdxfer.master.wire.ops_service import decode_status_reply, encode_status
