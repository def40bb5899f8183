"""The run's shared pair of :func:`tests.vllm.conftest.make_pair`'s defaults (TCP), as a pytest
plugin that tests/vllm/conftest.py and tests/monitoring/conftest.py install
(:func:`register_default_pair`; a run may collect either directory alone).

A pair start costs 45-75 s here and idle ``vllm serve`` instances on CPU keep cores busy, so
every test that needs no pair config of its own takes this one, and it lives only while they
run: they are moved next to each other (``@pytest.mark.default_pair_order("first")`` ones first,
``"last"`` ones last, collection order otherwise), the pair starts for the first and stops after
the last. A test takes it through fixture ``default_pair``, or a fixture of wider scope through
``default_pair_keeper.get(tmp_path_factory)``: both make the test a user.

Each user gets the pair with no hook set, its prefill not frozen and a live master (started
again if a test left it dead); a pair that lost an instance is replaced, so one broken test does
not fail the ones after it. A test that leaves the pair without an instance carries
``default_pair_order("last")``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Iterator

import pytest

from pdxfer.launch.tiny_model import default_tiny_model_dir, make_tiny_model
from tests.vllm.conftest import PDPair, make_pair

KEEPER = "default_pair_keeper"  # the fixture every user of the default pair depends on
ORDER_MARK = "default_pair_order"
_ORDERS = ("first", None, "last")
_PLUGIN = "pdxfer-default-pair"


class DefaultPair:
    """The shared pair's state: started at the first :meth:`get`, replaced if it lost an
    instance, stopped by :meth:`stop`."""

    def __init__(self) -> None:
        self.pair: PDPair | None = None
        self._run: Iterator[PDPair] | None = None  # the make_pair generator that owns self.pair
        self.start_error: str | None = None
        self.starts = 0
        self.users = 0

    def get(self, tmp_path_factory: pytest.TempPathFactory) -> PDPair:
        if self.start_error is not None:  # each retry would cost up to READY_TIMEOUT_S
            pytest.fail(f"the default pair did not start earlier in this run: {self.start_error}")
        pair = self.pair
        if pair is not None and not (pair.prefill.alive() and pair.decode.alive()):
            self.stop()
            pair = None
        if pair is None:
            self.starts += 1
            run = make_pair(tmp_path_factory, make_tiny_model(default_tiny_model_dir()), "tcp")
            try:
                pair = next(run)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # a start that timed out too
                self.start_error = f"{type(exc).__name__}: {exc}"
                raise
            self.pair, self._run = pair, run
        else:
            if not pair.master.alive():
                pair.start_master()
            os.killpg(pair.prefill.pid, signal.SIGCONT)
            for hook in pair.hooks.iterdir():
                hook.unlink(missing_ok=True)
        self.users += 1
        return pair

    def stop(self) -> None:
        run, self.pair, self._run = self._run, None, None
        if run is not None:
            run.close()  # make_pair's finally stops the pair


_KEEPER = DefaultPair()


def uses_default_pair(item: pytest.Item | None) -> bool:
    return item is not None and KEEPER in getattr(item, "fixturenames", ())


def _order(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker(ORDER_MARK)
    value = mark.args[0] if mark is not None and mark.args else None
    if mark is not None and value not in ("first", "last"):
        raise pytest.UsageError(f"{item.nodeid}: {ORDER_MARK} takes \"first\" or \"last\", not {value!r}")
    return value


@pytest.fixture(scope="session")
def default_pair_keeper() -> DefaultPair:
    return _KEEPER


@pytest.fixture
def default_pair(default_pair_keeper: DefaultPair, tmp_path_factory: pytest.TempPathFactory) -> PDPair:
    return default_pair_keeper.get(tmp_path_factory)


@pytest.hookimpl(trylast=True)  # after any other reordering, so the users stay together
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [i for i in items if uses_default_pair(i)]
    if not users:
        return
    first = items.index(users[0])
    users.sort(key=lambda i: _ORDERS.index(_order(i)))  # stable: collection order otherwise
    taken = {id(i) for i in users}
    rest = [i for i in items if id(i) not in taken]
    items[:] = rest[:first] + users + rest[first:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    try:
        return (yield)  # the item's own fixtures first (a proxy or Prometheus in front of the pair)
    finally:
        if _KEEPER.pair is not None and not uses_default_pair(nextitem):
            _KEEPER.stop()


def pytest_sessionfinish() -> None:
    _KEEPER.stop()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _KEEPER.starts:
        terminalreporter.write_line(f"default pair: started {_KEEPER.starts} time(s) for {_KEEPER.users} test(s)")


def register_default_pair(config: pytest.Config) -> None:
    """Install this module as a plugin once per run (its fixtures are then seen everywhere)."""
    if config.pluginmanager.get_plugin(_PLUGIN) is None:
        config.addinivalue_line("markers", f"{ORDER_MARK}(order): \"first\" or \"last\" among the tests on "
                                "the shared default pair (tests/vllm/default_pair.py)")
        config.pluginmanager.register(sys.modules[__name__], _PLUGIN)
