"""The README and docs/ stay inside the repository: every relative link resolves to a file here,
no link or path points outside it, and the README's first screen has the two commands and says
what runs on CPU and what has not run on a GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIRST_SCREEN_COMMANDS = ("bash scripts/demo.sh", "bash scripts/test.sh")

# [text](target) with an optional "title"; images too. Targets with a scheme are not files.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])/work/")


def relative_links(text: str) -> list[str]:
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s), mailto, in-page anchors
        out.append(target.split("#", 1)[0])
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(doc: Path) -> None:
    bad = []
    for target in relative_links(doc.read_text()):
        path = (doc.parent / target).resolve()
        if not path.is_relative_to(ROOT):
            bad.append(f"{target} (leaves the repository)")
        elif not path.exists():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{doc.relative_to(ROOT)}: bad links: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_path_outside_the_repository(doc: Path) -> None:
    hits = [f"line {n}: {line.strip()}" for n, line in enumerate(doc.read_text().splitlines(), 1)
            if OUTSIDE.search(line)]
    assert not hits, f"{doc.relative_to(ROOT)} names paths outside the repository: {hits}"


def test_readme_first_screen() -> None:
    head = "\n".join((ROOT / "README.md").read_text().splitlines()[:40])
    for cmd in FIRST_SCREEN_COMMANDS:
        assert cmd in head, f"README's first 40 lines lack {cmd!r}"
    for word in ("GPU", "CPU"):
        assert re.search(rf"\b{word}\b", head), f"README's first 40 lines never say {word}"


def test_link_extraction_sees_what_it_must() -> None:
    text = "[a](docs/x.md) [b](https://e.org/y) [c](#z) ![d](img.png \"t\") [e](../f.md#g)"
    assert relative_links(text) == ["docs/x.md", "img.png", "../f.md"]
