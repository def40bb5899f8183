"""The transport registry and the UCX environment rule: what callers rely on."""

from __future__ import annotations

import pytest

from pdxfer import transport as T
from pdxfer.transport.nixl.env import apply_ucx_env, ucx_env_defaults


def test_every_kind_creates_through_the_registry_with_its_own_options():
    assert T.KINDS == tuple(T.REGISTRY)
    assert T.transport_options("tcp", listen_host="127.0.0.1", advertise_host=None, connections=3) == {
        "listen_host": "127.0.0.1", "connections": 3}  # None means "the transport's default"
    assert T.transport_options("nixl", listen_host="127.0.0.1", connections=3) == {}
    t = T.create_transport("tcp", **T.transport_options("tcp", listen_host="127.0.0.1", connections=3))
    try:
        assert t.kind == "tcp"
    finally:
        t.close()


def test_unknown_kind_and_unknown_setting_are_named():
    with pytest.raises(ValueError, match=r"unknown transport 'verbs'; known: tcp, nixl"):
        T.create_transport("verbs")
    with pytest.raises(ValueError, match=r"unknown transport 'verbs'"):
        T.unavailable_reason("verbs")
    with pytest.raises(ValueError, match=r"unknown transport setting\(s\) \['listen_backlog'\]"):
        T.transport_options("tcp", listen_backlog=1)


def test_availability_gives_a_reason_when_a_kind_cannot_load(monkeypatch):
    monkeypatch.setattr(T, "_checked", dict(T._checked))  # leave no cached verdict behind
    monkeypatch.setitem(T.REGISTRY, "ghost", T.TransportKind("ghost", "pdxfer.transport.no_such:Ghost", "test"))
    reason = T.unavailable_reason("ghost")
    assert reason is not None and "ghost" in reason and "no_such" in reason
    assert T.unavailable_reason("tcp") is None


def test_ucx_modules_rule(tmp_path):
    empty, ib = tmp_path / "empty", tmp_path / "ib"
    empty.mkdir()
    (ib / "mlx5_0").mkdir(parents=True)
    assert ucx_env_defaults({}, str(empty)) == {"UCX_MODULES": "^ib"}
    assert ucx_env_defaults({}, str(tmp_path / "absent")) == {"UCX_MODULES": "^ib"}
    assert ucx_env_defaults({}, str(ib)) == {}, "never disable real InfiniBand"
    assert ucx_env_defaults({"UCX_MODULES": "ib"}, str(empty)) == {}, "never override the operator"
    env = {"UCX_MODULES": "^tcp"}
    assert apply_ucx_env(env) is env and env == {"UCX_MODULES": "^tcp"}
