"""Reading a one-line secret from a file (the master's token, an etcd password): stripped, and
refused when it cannot be read, is empty or is too large to be one.

Every refusal is a :class:`SecretFileError` whose message names the file and what it was for, so
each caller only adds who it is (``pdxfer-master: ...``) or turns it into its own error type.
"""

from __future__ import annotations

import os

# A token or password is a line; a file far larger was named by mistake (a key, a log), and its
# bytes must not become a credential sent to a server.
MAX_SECRET_BYTES = 64 * 1024


class SecretFileError(ValueError):
    """A secret file that cannot be used: unreadable, empty or oversized; the message names it."""


def read_secret_file(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_SECRET_BYTES) -> str:
    """The text of secret file ``path`` without surrounding whitespace (a trailing newline
    included). ``what`` names the file's use in errors ("token file", "etcd password file")."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)  # one byte over is enough to know it is too large
    except OSError as exc:
        raise SecretFileError(f"cannot read {what} {os.fspath(path)}: {exc}") from None
    if len(raw) > max_bytes:
        raise SecretFileError(f"{what} {os.fspath(path)} is larger than {max_bytes} bytes: "
                              f"not a token or password")
    try:
        secret = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise SecretFileError(f"{what} {os.fspath(path)} is not UTF-8 text: {exc}") from None
    if not secret:
        raise SecretFileError(f"{what} {os.fspath(path)} is empty")
    return secret


__all__ = ["MAX_SECRET_BYTES", "SecretFileError", "read_secret_file"]
