"""The suite's CI rule (tests/conftest.py): with CI set, a skip fails naming its reason; xfail and
skips marked ``may_skip(reason=...)`` stay what they are. Checked with nested pytest runs of a
copy of that conftest, so the rule cannot silently stop working."""

from __future__ import annotations

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

@pytest.mark.may_skip(reason="needs a GPU; CI has none")
def test_gpu_only():
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
    res.assert_outcomes(failed=2, errors=2, passed=1, skipped=1, xfailed=1)
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
    assert "SKIPPED [1] test_cases.py" in out and "no GPU" in out
    assert "XFAIL test_cases.py::test_expected_failure" in out


@pytest.mark.parametrize("ci", [None, "", "0", "false"])
def test_without_ci_skips_stay_skips(suite, monkeypatch, ci):
    res = _run(suite, monkeypatch, ci)
    res.assert_outcomes(passed=1, skipped=5, xfailed=1)
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
