"""docs/metrics.md is what the code exports, and every metric name the docs cite exists."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdxfer.docgen.metrics import DOC_PATH, all_exposed_names, render
from pdxfer.serve.proxy_metrics import PROXY_METRICS, ProxyMetrics

ROOT = Path(__file__).resolve().parents[2]
# Where users read metric names: the docs, the README and the deploy material (alert rules,
# dashboards, manifests, unit files).
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
          *sorted(p for p in (ROOT / "deploy").rglob("*") if p.suffix in (".md", ".yml", ".yaml", ".json"))]
# A metric name as a doc writes it; a trailing `_*` or `_<` is a family the text describes.
_CITED = re.compile(r"(?<![\w.:/-])((?:vllm:pdxfer|pdxfer_master|pdxfer_proxy)_[a-z0-9_]*[a-z0-9])(_\*|_<)?")


def test_the_reference_page_matches_the_code() -> None:
    assert DOC_PATH.read_text() == render(), (
        "docs/metrics.md differs from the metric definitions: run `python -m pdxfer.docgen.metrics --write`")


def _cited(text: str) -> set[tuple[str, bool]]:
    return {(m.group(1), bool(m.group(2))) for m in _CITED.finditer(text)}


def test_every_metric_name_the_docs_cite_exists() -> None:
    known = all_exposed_names()
    bare = known | {n[: -len(s)] for n in known for s in ("_bucket", "_sum", "_count") if n.endswith(s)}
    wrong = []
    for path in CITING:
        for name, family in _cited(path.read_text()):
            if family:
                if not any(k.startswith(name + "_") for k in known):
                    wrong.append(f"{path.relative_to(ROOT)}: {name}_* names no metric")
            elif name not in bare:
                wrong.append(f"{path.relative_to(ROOT)}: {name}")
    assert not wrong, "metric names cited but not exported:\n" + "\n".join(sorted(wrong))


def test_the_citation_check_catches_a_wrong_name() -> None:
    # The check above would pass on a pattern that matches nothing: show it sees real citations.
    found = _cited("alert on `vllm:pdxfer_repulls` and pdxfer_master_lookups_per_second; "
                   "see vllm:pdxfer_phase_* and libpdxfer_native.so")
    assert ("vllm:pdxfer_repulls", False) in found
    assert ("pdxfer_master_lookups_per_second", False) in found
    assert ("vllm:pdxfer_phase", True) in found
    assert not any("native" in n for n, _ in found) and len(found) == 3


def test_the_proxy_exports_what_it_declares() -> None:
    m = ProxyMetrics()
    assert isinstance(m.registry, CollectorRegistry)
    families = {(f.name, f.type) for f in m.registry.collect()}
    # The client library names a counter's family without _total.
    assert families == {(d.name, d.kind) for d in PROXY_METRICS}
