"""Suite-wide rule: in CI a skip is a failure.

A test that skips because something it needs is missing (etcd's binary, NIXL, vLLM, nvcc, g++,
root, qemu...) proves nothing, and a tier of such skips would leave CI green on a machine that
cannot run it. So when the ``CI`` environment variable is set (``CI=true bash .ci/run``), every
skip, at collection or while a test runs, is reported as a failure that names the reason.

* xfail stays xfail: an expected failure is not a skip.
* ``@pytest.mark.may_skip(reason="...", match="...")`` lets one test skip in CI too. It is for
  skips that are legitimately conditional on the machine, not on the set-up: a test that needs a
  GPU (CI has none) or one that runs only inside the soft-RoCE guest. Both are required: the skip
  is allowed only when its own reason matches ``match`` (a regular expression), so a GPU test
  cannot hide an unrelated missing tool (no nvcc) behind its "no GPU" allowance.
* A module that skips as a whole (``pytest.importorskip`` at module level) always fails in CI:
  nothing of it was even imported, so no marker could allow it.

scripts/setup.sh installs everything the suite needs, so on a fresh machine CI skips nothing.
tests/unit/test_ci_skip_rule.py checks this rule with a nested pytest run.

Suite-wide budget: a run of the suite has :data:`DEFAULT_BUDGET_S` seconds in all
(``PDXFER_TEST_BUDGET_S`` overrides it, 0 turns it off). Each test's timeout (pytest-timeout,
set-up and teardown included) is cut to what is left of the budget, and once the budget is
spent the run stops, naming the test it was in: a hung run ends well inside CI's 90 minutes
with a summary instead of being killed without one. Tests that start real ``vllm serve``
processes (marker ``vllm``) get :data:`PAIR_TEST_TIMEOUT_S` unless they set their own, since
their module's pair start-up is bounded by the pair's own ready timeout, which is longer than
the default per-test timeout.
"""

from __future__ import annotations

import os
import re
import time

import pytest

ALLOW_MARKER = "may_skip"
_FALSE = {"", "0", "false", "no", "off"}
# The whole suite takes 15-25 minutes here; twice that on a slow afternoon still ends (with the
# named test that was running) inside CI's 90 minutes, set-up (up to 12 minutes cold) included.
DEFAULT_BUDGET_S = 55 * 60
BUDGET_ENV = "PDXFER_TEST_BUDGET_S"
# A pair start waits up to tests/vllm/conftest.py READY_TIMEOUT_S (420 s) for its instances, in
# the set-up of a module's first test: the test's own bound has to cover that and the test.
PAIR_TEST_TIMEOUT_S = 420 + 300
_deadline = pytest.StashKey[float]()
_budget = pytest.StashKey[float]()


def in_ci() -> bool:
    """True when the ``CI`` environment variable is set to anything but an explicit no."""
    return os.environ.get("CI", "").strip().lower() not in _FALSE


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{ALLOW_MARKER}(reason): this test may skip in CI too, for the machine-dependent reason given "
        "(a GPU test on a machine without one), when the skip's own reason matches the regular expression "
        "match; any other skip fails when CI is set (tests/conftest.py)")
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        budget = float(raw) if raw else float(DEFAULT_BUDGET_S)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_ENV}={raw!r} is not a number of seconds") from None
    config.stash[_budget] = budget
    config.stash[_deadline] = time.monotonic() + budget if budget > 0 else 0.0


def _item_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
        if value is not None:
            return float(value)
    if item.get_closest_marker("vllm") is not None:
        return float(PAIR_TEST_TIMEOUT_S)
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:
        return 0.0


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Give the test its timeout, cut to what is left of the suite's budget (the outermost
    wrapper, so that pytest-timeout's reads the marker added here); stop the run once the budget
    is spent."""
    own = _item_timeout(item) or float("inf")
    deadline = item.config.stash[_deadline]
    left = deadline - time.monotonic() if deadline else float("inf")
    if left <= 0:
        item.session.shouldfail = (f"the suite's budget of {item.config.stash[_budget]:.0f} s ({BUDGET_ENV}) was "
                                   f"spent before {item.nodeid}")
    bound = min(own, left)
    if bound != float("inf"):
        item.add_marker(pytest.mark.timeout(max(1.0, bound)), append=False)
    return (yield)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    budget = config.stash.get(_budget, 0.0)
    if budget > 0:
        used = budget - (config.stash[_deadline] - time.monotonic())
        terminalreporter.write_line(f"suite budget: {used:.0f} s used of {budget:.0f} s ({BUDGET_ENV})")


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
                    f"@pytest.mark.{ALLOW_MARKER}(reason=..., match=<regex of the skip reasons it allows>).")


def _allowance_problem(allow: pytest.Mark, reason: str) -> str | None:
    """Why a may_skip marker does not allow a skip for ``reason``; None when it does."""
    if not (allow.kwargs.get("reason") or allow.args):
        return f"its {ALLOW_MARKER} marker gives no reason"
    pattern = allow.kwargs.get("match")
    if not pattern:
        return f"its {ALLOW_MARKER} marker gives no match= for the skip reasons it allows"
    if not re.search(pattern, reason):
        return f"its {ALLOW_MARKER} marker allows skips matching {pattern!r}, not this one"
    return None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    rep = yield
    deadline = item.config.stash.get(_deadline, 0.0)
    if call.when == "teardown" and deadline and time.monotonic() > deadline:
        item.session.shouldfail = (f"the suite's budget of {item.config.stash[_budget]:.0f} s ({BUDGET_ENV}) "
                                   f"ran out in {item.nodeid}")
    if not rep.skipped or hasattr(rep, "wasxfail") or not in_ci():
        return rep
    allow = item.get_closest_marker(ALLOW_MARKER)
    if allow is not None:
        problem = _allowance_problem(allow, _skip_reason(rep.longrepr))
        if problem is None:
            return rep
        _as_failure(rep, f"{item.nodeid} ({problem})")
        return rep
    _as_failure(rep, item.nodeid)
    return rep


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector):
    rep = yield
    if rep.skipped and in_ci():
        _as_failure(rep, f"collecting {collector.nodeid}")
    return rep
