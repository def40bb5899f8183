"""scripts/setup.sh's cache hit: whose checkout does a shared venv's editable pdxfer load?"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "venv_editable.sh"


def points_here(venv: Path, checkout: Path) -> bool:
    result = subprocess.run(["bash", "-c", '. "$0"; editable_points_here "$1" "$2"', str(HELPER),
                             str(venv), str(checkout)], capture_output=True, text=True, timeout=60)
    return result.returncode == 0


@pytest.fixture(scope="module")
def venv() -> Path:
    """The venv running these tests: its editable pdxfer is this checkout's (setup.sh made it so)."""
    import pdxfer

    if Path(pdxfer.__file__).resolve().parent != REPO / "pdxfer":
        pytest.fail(f"pdxfer imports from {pdxfer.__file__}, not this checkout: run scripts/setup.sh")
    return Path(sys.prefix)


def test_the_checkout_it_points_at(venv):
    assert points_here(venv, REPO)


def test_a_checkout_whose_path_is_a_suffix_is_not_taken_for_it(venv):
    # /work/main must not pass for /check/work/main: a substring match once left CI importing
    # another checkout's code.
    suffix = Path("/", *REPO.parts[2:])
    assert suffix != REPO and str(REPO).endswith(str(suffix))
    assert not points_here(venv, suffix)


def test_another_checkout_or_no_venv(venv, tmp_path):
    assert not points_here(venv, tmp_path)
    assert not points_here(tmp_path / "no-venv", REPO)
