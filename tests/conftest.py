"""Suite-wide rule: in CI a skip is a failure.

A test that skips because something it needs is missing (etcd's binary, NIXL, vLLM, nvcc, g++,
root, qemu...) proves nothing, and a tier of such skips would leave CI green on a machine that
cannot run it. So when the ``CI`` environment variable is set (``CI=true bash .ci/run``), every
skip, at collection or while a test runs, is reported as a failure that names the reason.

* xfail stays xfail: an expected failure is not a skip.
* ``@pytest.mark.may_skip(reason="...")`` lets one test skip in CI too. It is for skips that are
  legitimately conditional on the machine, not on the set-up: a test that needs a GPU (CI has
  none) or one that runs only inside the soft-RoCE guest. The reason is required.
* A module that skips as a whole (``pytest.importorskip`` at module level) always fails in CI:
  nothing of it was even imported, so no marker could allow it.

scripts/setup.sh installs everything the suite needs, so on a fresh machine CI skips nothing.
tests/unit/test_ci_skip_rule.py checks this rule with a nested pytest run.
"""

from __future__ import annotations

import os

import pytest

ALLOW_MARKER = "may_skip"
_FALSE = {"", "0", "false", "no", "off"}


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set to anything but an explicit no."""
    return os.environ.get("CI", "").strip().lower() not in _FALSE


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{ALLOW_MARKER}(reason): this test may skip in CI too, for the machine-dependent reason given "
        "(a GPU test on a machine without one); any other skip fails when CI is set (tests/conftest.py)")


def _skip_reason(longrepr: object) -> str:
    # A skip's longrepr is (path, lineno, "Skipped: reason"); anything else is shown as it is.
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _as_failure(rep: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    reason = _skip_reason(rep.longrepr)
    rep.outcome = "failed"
    rep.longrepr = (f"{what} skipped in CI (CI={os.environ.get('CI')!r}), and a skip fails there: {reason}\n"
                    f"Install what is missing (scripts/setup.sh should), or, only for a skip that depends on "
                    f"the machine and not its set-up (no GPU), mark the test "
                    f"@pytest.mark.{ALLOW_MARKER}(reason=...).")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    rep = yield
    if not rep.skipped or hasattr(rep, "wasxfail") or not in_ci():
        return rep
    allow = item.get_closest_marker(ALLOW_MARKER)
    if allow is not None:
        if allow.kwargs.get("reason") or allow.args:
            return rep
        _as_failure(rep, f"{item.nodeid} (its {ALLOW_MARKER} marker gives no reason)")
        return rep
    _as_failure(rep, item.nodeid)
    return rep


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector):
    rep = yield
    if rep.skipped and in_ci():
        _as_failure(rep, f"collecting {collector.nodeid}")
    return rep
