"""pdxfer's own TCP transport: transport.py (reader side and the Transport), server.py (holder),
wire.py (framing), handshake.py (the reader proves the holder's secret), metadata.py (what a
holder exports), plan.py (splitting a read over connections), connection.py and handle.py (reader connections and read handles), bounce.py, bounce_send.py and
bounce_recv.py (GPU regions through a pinned bounce buffer)."""

from pdxfer.transport.tcp.metadata import TcpPeerInfo, parse_metadata
from pdxfer.transport.tcp.server import region_view
from pdxfer.transport.tcp.transport import TcpTransport

__all__ = ["TcpPeerInfo", "TcpTransport", "parse_metadata", "region_view"]
