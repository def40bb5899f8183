"""The live monitoring test runs on tests/vllm's shared default pair (tests/vllm/default_pair.py):
this installs its plugin when tests/monitoring is collected without tests/vllm."""

from __future__ import annotations

import pytest

from tests.vllm.default_pair import register_default_pair


def pytest_configure(config: pytest.Config) -> None:
    register_default_pair(config)
