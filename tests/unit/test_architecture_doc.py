"""docs/architecture.md's parts list is what the code's docstrings say, room by room."""

from __future__ import annotations

import pytest

from pdxfer.docgen import architecture as arch


def test_the_parts_list_matches_the_code() -> None:
    assert arch.splice(arch.DOC_PATH.read_text(), arch.render()) == arch.DOC_PATH.read_text(), (
        "docs/architecture.md's parts differ from the docstrings: run `python -m pdxfer.docgen.architecture --write`")


def test_a_changed_docstring_or_a_new_room_is_seen(tmp_path, monkeypatch) -> None:
    """The oracle: a module whose docstring changed, a module without one and a package without a
    place in the reading order all fail the page."""
    page = arch.DOC_PATH.read_text()
    pkg = tmp_path / "pdxfer"
    (pkg / "kv").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""Top."""\n')
    (pkg / "kv" / "__init__.py").write_text('"""KV room."""\n')
    (pkg / "kv" / "keys.py").write_text('"""Keys. More."""\n')
    monkeypatch.setattr(arch, "PACKAGE_DIR", pkg)
    assert "| `keys.py` | Keys. |" in arch.render()
    assert arch.render() not in page
    (pkg / "kv" / "blank.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="blank.py has no docstring"):
        arch.render()
    (pkg / "kv" / "blank.py").unlink()
    (pkg / "newroom").mkdir()
    (pkg / "newroom" / "__init__.py").write_text('"""New."""\n')
    with pytest.raises(ValueError, match="pdxfer.newroom"):
        arch.render()


def test_rooms_stay_small() -> None:
    """No folder holds more than 15 modules and no module more than ~500 lines: the page is a map a
    newcomer can read only while each room, and each module in it, is small."""
    too_many = {name: n for name, folder in arch.packages().items()
                if (n := len([m for m in folder.glob("*.py") if m.name != "__init__.py"])) > 15}
    assert not too_many, f"rooms with more than 15 modules: {too_many}"
    too_long = {str(m.relative_to(arch.PACKAGE_DIR.parent)): n for m in arch.PACKAGE_DIR.rglob("*.py")
                if (n := len(m.read_text().splitlines())) > 550}
    assert not too_long, f"modules over ~500 lines: {too_long}"
