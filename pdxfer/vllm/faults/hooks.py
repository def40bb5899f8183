"""Fault-injection hooks for the real-vLLM tests, off unless ``$PDXFER_TEST_HOOKS_DIR`` is set.

A test writes ``<dir>/<name>`` (e.g. ``read_delay_s`` containing ``1.5``) while the instances
run; the connector reads it at the point of use, so one running pair serves every fault test.
Without the environment variable every hook answers None after one dict lookup.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdxfer.contracts.connector_config import TEST_HOOKS_ENV


def test_hooks_on() -> bool:
    """Whether this process reads hook files at all (``$PDXFER_TEST_HOOKS_DIR`` is set)."""
    return bool(os.environ.get(TEST_HOOKS_ENV))


def test_hook_float(name: str) -> float | None:
    """The positive number in hook file ``name``, else None."""
    text = test_hook_text(name)
    try:
        value = float(text) if text is not None else 0.0
    except ValueError:
        return None
    return value if value > 0 else None


def test_hook_text(name: str) -> str | None:
    """The stripped text of hook file ``name`` (None when hooks are off, the file is absent or empty)."""
    d = os.environ.get(TEST_HOOKS_ENV)
    if not d:
        return None
    try:
        text = (Path(d) / name).read_text().strip()
    except OSError:
        return None
    return text or None
