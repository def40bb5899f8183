"""The small helpers written once for the whole package: the secret file reader, the memo that is
emptied when full, the holder route key and the off-path lock release."""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from pdxfer.common.bounded_cache import ClearWhenFullCache
from pdxfer.common.secret_file import MAX_SECRET_BYTES, SecretFileError, read_secret_file
from pdxfer.vllm.holder_routes import holder_route_key
from pdxfer.vllm.lock_release import release_off_path

# ---- read_secret_file --------------------------------------------------------------------------


def test_a_secret_loses_its_surrounding_whitespace_only(tmp_path):
    f = tmp_path / "token"
    f.write_bytes(b"  s3 cr\tet \r\n\n")
    assert read_secret_file(f, "token file") == "s3 cr\tet"
    assert read_secret_file(str(f), "token file") == "s3 cr\tet"  # a str path too


@pytest.mark.parametrize("content", [b"", b"\n", b"  \t\r\n "])
def test_an_empty_secret_file_is_refused_naming_it(tmp_path, content):
    f = tmp_path / "token"
    f.write_bytes(content)
    with pytest.raises(SecretFileError, match=rf"^etcd password file {re.escape(str(f))} is empty$"):
        read_secret_file(f, "etcd password file")


def test_a_missing_file_is_refused_naming_it_and_its_use(tmp_path):
    f = tmp_path / "nope"
    with pytest.raises(SecretFileError, match=rf"^cannot read token file {re.escape(str(f))}: .*No such file"):
        read_secret_file(f, "token file")
    with pytest.raises(SecretFileError, match="cannot read token file"):
        read_secret_file(tmp_path, "token file")  # a folder is no file either


def test_an_oversized_secret_file_is_refused_and_the_bound_is_inclusive(tmp_path):
    f = tmp_path / "token"
    f.write_bytes(b"a" * 16)
    assert read_secret_file(f, "token file", max_bytes=16) == "a" * 16
    f.write_bytes(b"a" * 17)
    with pytest.raises(SecretFileError, match=rf"^token file {re.escape(str(f))} is larger than 16 bytes"):
        read_secret_file(f, "token file", max_bytes=16)
    # The default bound: a file one byte over it is refused even when it is all whitespace
    # around a short secret (its size, not its content, is what is too large).
    f.write_bytes(b"x" + b" " * MAX_SECRET_BYTES)
    with pytest.raises(SecretFileError, match="is larger than"):
        read_secret_file(f, "token file")
    f.write_bytes(b"x" * MAX_SECRET_BYTES)
    assert len(read_secret_file(f, "token file")) == MAX_SECRET_BYTES


def test_a_secret_that_is_no_text_is_refused(tmp_path):
    f = tmp_path / "token"
    f.write_bytes(b"\xff\xfe\x00key")
    with pytest.raises(SecretFileError, match="is not UTF-8 text"):
        read_secret_file(f, "token file")


def test_a_secret_file_error_is_a_value_error():
    # Callers that report ValueErrors as a CLI's exit message (pdxfer proxy) rely on it.
    assert issubclass(SecretFileError, ValueError)


def test_the_sites_keep_their_own_error_types(tmp_path):
    from pdxfer.contracts.connector_config import ConnectorConfigError, parse_extra_config
    from pdxfer.master.backends.etcd_security import EtcdRefused, EtcdSecurity
    from pdxfer.master.cli import _read_token as master_read_token

    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match=rf"^pdxfer-master: token file {re.escape(str(empty))} is empty$"):
        master_read_token(str(empty))
    nope = tmp_path / "nope"
    with pytest.raises(SystemExit, match=rf"^pdxfer-master: cannot read token file {re.escape(str(nope))}: "):
        master_read_token(str(nope))
    with pytest.raises(EtcdRefused, match=rf"^etcd password file {re.escape(str(empty))} is empty$"):
        EtcdSecurity(user="u", password_file=str(empty)).read_password()
    with pytest.raises(ConnectorConfigError, match="master_token_file .* is empty"):
        _ = parse_extra_config({"master": "h:1", "master_token_file": str(empty)}, env={}).token


def test_the_status_cli_refuses_an_empty_token_file(tmp_path, capsys):
    from pdxfer.master.client.status_cli import EXIT_USAGE, main

    empty = tmp_path / "empty"
    empty.write_text("")
    # Refused before any master is asked: the address is never dialled.
    assert main(["--master", "127.0.0.1:1", "--token-file", str(empty)]) == EXIT_USAGE
    assert f"pdxfer status: token file {empty} is empty" in capsys.readouterr().err


def test_the_proxy_refuses_an_empty_token_file(tmp_path):
    from pdxfer.serve.proxy import _read_token

    assert _read_token(None) is None
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    with pytest.raises(ValueError, match=rf"--master-token-file {re.escape(str(empty))} is empty"):
        _read_token(empty)
    (tmp_path / "tok").write_text("abc\n")
    assert _read_token(tmp_path / "tok") == "abc"


# ---- ClearWhenFullCache ------------------------------------------------------------------------


def test_the_cache_is_bounded_and_emptied_when_a_new_key_finds_it_full():
    c: ClearWhenFullCache[int, str] = ClearWhenFullCache(3)
    for k in range(3):
        c.put(k, str(k))
    assert len(c) == 3 and all(k in c for k in range(3))
    c.put(1, "one")  # a key it has: replaced, nothing forgotten
    assert len(c) == 3 and c.get(1) == "one" and c.get(0) == "0"
    c.put(3, "3")  # a new key: everything else goes
    assert len(c) == 1 and c.get(3) == "3" and 0 not in c and c.get(0) is None
    assert list(c.items()) == [(3, "3")]  # what callers that list the answers (the chaos reader) see
    for k in range(100):
        c.put(100 + k, "x")
        assert len(c) <= 3


def test_get_or_make_makes_once_and_keeps_falsy_answers():
    c: ClearWhenFullCache[str, object] = ClearWhenFullCache(8)
    made: list[str] = []

    def make(key: str, value: object):
        def f() -> object:
            made.append(key)
            return value
        return f

    assert c.get_or_make("a", make("a", False)) is False
    assert c.get_or_make("a", make("a", True)) is False  # a cached False is an answer
    assert c.get_or_make("n", make("n", None)) is None
    assert c.get_or_make("n", make("n", 1)) is None  # so is a cached None
    assert made == ["a", "n"]


def test_get_or_make_also_empties_a_full_cache_and_keeps_nothing_when_make_raises():
    c: ClearWhenFullCache[int, int] = ClearWhenFullCache(2)
    c.put(0, 0)
    c.put(1, 1)
    assert c.get_or_make(2, lambda: 20) == 20
    assert len(c) == 1 and 0 not in c

    def boom() -> int:
        raise RuntimeError("no answer")
    with pytest.raises(RuntimeError):
        c.get_or_make(5, boom)
    assert 5 not in c and 2 in c  # a failed make neither keeps a value nor empties the cache


def test_the_cache_clears_on_demand_and_needs_room_for_one():
    c: ClearWhenFullCache[int, int] = ClearWhenFullCache(1)
    c.put(1, 1)
    c.put(2, 2)
    assert len(c) == 1 and c.get(2) == 2
    c.clear()
    assert len(c) == 0
    with pytest.raises(ValueError, match="max_entries"):
        ClearWhenFullCache(0)


# ---- holder_route_key --------------------------------------------------------------------------


def _holder(node_id="h", total=8, eps=((0, "fp0", 16), (1, "fp1", 16))):
    return SimpleNamespace(node_id=node_id, total_kv_heads=total, endpoints=[
        SimpleNamespace(rank=r, fp=fp, layout={"block_size": bs}) for r, fp, bs in eps])


def test_a_holder_route_key_changes_with_each_part_that_routes_depend_on():
    part = lambda e: e.fp  # noqa: E731
    key = holder_route_key(_holder(), part)
    assert key == holder_route_key(_holder(), part)  # the same announcement again: the same key
    assert key[0] == "h"
    others = [_holder(node_id="g"), _holder(total=16), _holder(eps=((0, "fp0", 16), (1, "other", 16))),
              _holder(eps=((0, "fp0", 16), (1, "fp1", 32))), _holder(eps=((0, "fp0", 16),))]
    keys = {holder_route_key(h, part) for h in others}
    assert key not in keys and len(keys) == len(others)
    # The part is the caller's: the same holder keyed on another endpoint field differs.
    assert holder_route_key(_holder(), lambda e: e.rank) != key
    hash(holder_route_key(_holder(eps=((0, ["unhashable"], 16),)), part))  # always a hashable key


# ---- release_off_path --------------------------------------------------------------------------


def test_a_release_runs_on_the_executor_and_a_failure_is_only_logged(caplog):
    calls: list[tuple[str, bool, str]] = []

    def release(lock_id: str, all_parties: bool = False) -> bool:
        calls.append((lock_id, all_parties, threading.current_thread().name))
        if lock_id == "bad":
            raise ConnectionError("master gone")
        return True

    ex = ThreadPoolExecutor(1, thread_name_prefix="test-release")
    try:
        release_off_path(ex, release, "l-1", all_parties=True)
        release_off_path(ex, release, "l-2")
        with caplog.at_level(logging.DEBUG, logger="pdxfer.vllm.lock_release"):
            release_off_path(ex, release, "bad")
            release_off_path(ex, release, "")  # no lock: nothing to give back
            ex.shutdown(wait=True)
    finally:
        ex.shutdown(wait=True)
    assert [(c[0], c[1]) for c in calls] == [("l-1", True), ("l-2", False), ("bad", False)]
    assert all(c[2].startswith("test-release") for c in calls)  # never on the caller's thread
    assert "release of unused lock bad failed: master gone" in caplog.text
    release_off_path(ex, release, "late")  # the executor is shut down: dropped, no error
    assert len(calls) == 3
