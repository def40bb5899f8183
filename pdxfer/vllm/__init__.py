"""vLLM integration: ``PdxferConnector``, the KV connector (the proxy, launcher, serve shim and
tiny model are in :mod:`pdxfer.serve`, which never imports vLLM).

``PdxferConnector`` is resolved lazily (module ``__getattr__``) so that importing a module of this
package that needs no vLLM does not import it. What the serving layer shares with the connector
(its configuration, the publish hint, its metric definitions) is in :mod:`pdxfer.contracts`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdxferConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdxferConnector":
        from pdxfer.vllm.connector import PdxferConnector

        return PdxferConnector
    raise AttributeError(f"module 'pdxfer.vllm' has no attribute {name!r}")
