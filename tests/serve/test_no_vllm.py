"""pdxfer.serve and pdxfer.launch never import vLLM: the proxy and launcher must run where vLLM is
not installed (or would take seconds to import). Checked in a fresh interpreter, where nothing else imported it."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pdxfer.launch
import pdxfer.serve

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_of_pdxfer_serve_or_launch_imports_vllm() -> None:
    names = sorted(m.name for pkg in (pdxfer.serve, pdxfer.launch)
                   for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."))
    assert {"pdxfer.serve.proxy", "pdxfer.launch.fleet", "pdxfer.launch.serve_shim",
            "pdxfer.launch.tiny_model"} <= set(names)
    code = ("import importlib, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "import pdxfer.cli\n"
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
            "print('VLLM:' + ','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "VLLM:\n" in out.stdout, f"vllm modules imported: {out.stdout}"
