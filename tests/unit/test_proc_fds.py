"""bench/proc_fds.py: fds counted by kind, TCP sockets named by the process at the other end."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from bench.proc_fds import fd_targets, group_pids, kinds_by_group

_SERVER = """
import socket, sys
s = socket.create_server(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
conns = [s.accept()[0] for _ in range(2)]
sys.stdin.read()
"""


def test_sockets_are_named_by_the_group_at_the_other_end_and_the_rest_by_kind():
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    clients: list[socket.socket] = []
    r, w = os.pipe()
    try:
        port = int(server.stdout.readline())
        clients = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2)]
        # Bounded wait for the server to accept both (until then they sit in its listen queue).
        deadline = time.monotonic() + 10
        while True:
            kinds = kinds_by_group({"me": fd_targets([os.getpid()]), "srv": fd_targets(group_pids(server.pid))})
            if kinds["srv"].get("socket:tcp<-me") == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert kinds["srv"]["socket:tcp-listen"] == 1, kinds
        assert kinds["srv"]["socket:tcp<-me"] == 2, kinds
        assert kinds["me"]["socket:tcp->srv"] == 2, kinds
        assert kinds["me"]["pipe"] >= 2, kinds  # ours, and the ones to the server's stdin/stdout
        lone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            after = kinds_by_group({"me": fd_targets([os.getpid()])})["me"]
            assert after.get("socket:unix", 0) == kinds["me"].get("socket:unix", 0) + 1, (kinds, after)
            # A peer outside the groups given is "other", not a guess.
            assert after["socket:tcp->other"] == 2, after
        finally:
            lone.close()
    finally:
        for c in clients:
            c.close()
        os.close(r)
        os.close(w)
        server.kill()
        server.wait(10)
