"""The suite's CI rule (tests/conftest.py): with CI set, a skip fails naming its reason; xfail and
skips marked ``may_skip(reason=...)`` stay what they are. Checked with nested pytest runs of a
copy of that conftest, so the rule cannot silently stop working."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

CASES = '''
import pytest

def test_skips_for_a_missing_tool():
    pytest.skip("no frobnicator binary")

@pytest.mark.skipif(True, reason="no widget library")
def test_skipif_marker():
    pass

@pytest.fixture
def needs_service():
    pytest.skip("no service daemon")

def test_fixture_skips(needs_service):
    pass

@pytest.mark.xfail(reason="known bug", strict=True)
def test_expected_failure():
    assert False

@pytest.mark.may_skip(reason="needs a GPU; CI has none", match="^no GPU$")
def test_gpu_only():
    pytest.skip("no GPU")

@pytest.mark.may_skip(reason="needs a GPU; CI has none", match="^no GPU$")
def test_gpu_only_hiding_a_missing_tool():
    pytest.skip("no nvcc")

@pytest.mark.may_skip(reason="needs a GPU; CI has none")
def test_allowed_without_a_match():
    pytest.skip("no GPU")

@pytest.mark.may_skip
def test_allowed_without_a_reason():
    pytest.skip("no GPU")

def test_plain_pass():
    pass
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_cases=CASES)
    return pytester


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str | None) -> pytest.RunResult:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    return pytester.runpytest("-p", "no:cacheprovider", "-rA")


def test_with_ci_every_skip_fails_naming_its_reason(suite, monkeypatch):
    res = _run(suite, monkeypatch, "true")
    # A skip during set-up (skipif, a fixture) fails as an error, as any set-up failure does.
    res.assert_outcomes(failed=4, errors=2, passed=1, skipped=1, xfailed=1)
    assert res.ret == pytest.ExitCode.TESTS_FAILED
    out = res.stdout.str()
    for name, reason, how in (("test_skips_for_a_missing_tool", "no frobnicator binary", "FAILED"),
                              ("test_skipif_marker", "no widget library", "ERROR"),
                              ("test_fixture_skips", "no service daemon", "ERROR")):
        assert f"{how} test_cases.py::{name}" in out
        assert f"test_cases.py::{name} skipped in CI (CI='true'), and a skip fails there: {reason}" in out
    # An allowance must say why; a bare marker is not one.
    assert "FAILED test_cases.py::test_allowed_without_a_reason" in out
    assert "its may_skip marker gives no reason" in out
    # An allowance names the skips it allows: a GPU test's cannot cover a missing tool.
    assert "FAILED test_cases.py::test_gpu_only_hiding_a_missing_tool" in out
    assert "allows skips matching '^no GPU$', not this one" in out and "no nvcc" in out
    assert "FAILED test_cases.py::test_allowed_without_a_match" in out
    assert "gives no match= for the skip reasons it allows" in out
    assert "SKIPPED [1] test_cases.py" in out and "no GPU" in out
    assert "XFAIL test_cases.py::test_expected_failure" in out


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_without_ci_skips_stay_skips(suite, monkeypatch, ci):
    res = _run(suite, monkeypatch, ci)
    res.assert_outcomes(passed=1, skipped=7, xfailed=1)
    assert res.ret == 0


def test_with_ci_a_module_that_skips_whole_fails_collection(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_whole='import pytest\npytest.importorskip("no_such_module_pdxfer")\n'
                                   'def test_never_collected():\n    pass\n')
    res = _run(pytester, monkeypatch, "1")
    res.assert_outcomes(errors=1)
    assert "could not import 'no_such_module_pdxfer'" in res.stdout.str()
    monkeypatch.delenv("CI")
    res = pytester.runpytest("-p", "no:cacheprovider")
    res.assert_outcomes(skipped=1)


def test_a_hung_run_stops_at_the_suite_budget_naming_the_test(pytester, monkeypatch):
    """The suite's budget (PDXFER_TEST_BUDGET_S) cuts the running test's timeout to what is left
    and stops the run there: the summary names the test that hung, later tests never start."""
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_budget='import time\n'
                                    'def test_quick():\n    pass\n'
                                    'def test_hangs():\n    time.sleep(60)\n'
                                    'def test_after():\n    pass\n')
    monkeypatch.setenv("PDXFER_TEST_BUDGET_S", "3")
    monkeypatch.delenv("CI", raising=False)
    t0 = time.monotonic()
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", timeout=60)
    took = time.monotonic() - t0
    out = res.stdout.str()
    assert "PASSED test_budget.py::test_quick" in out
    assert "FAILED test_budget.py::test_hangs" in out and "Timeout" in out, out
    assert "test_after" not in out.split("short test summary info")[-1], out
    assert "ran out in test_budget.py::test_hangs" in out, out
    assert took < 40, f"the run took {took:.0f} s with a 3 s budget"


def test_a_bad_budget_is_refused_naming_it(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    monkeypatch.setenv("PDXFER_TEST_BUDGET_S", "ten minutes")
    res = pytester.runpytest("-p", "no:cacheprovider")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    assert "PDXFER_TEST_BUDGET_S='ten minutes' is not a number of seconds" in res.stderr.str()
