"""The UCX environment rule, and loading NIXL after it is applied.

This is the one module that decides ``UCX_MODULES``; the probe, the tests, the launcher and the
benchmarks call into it for this process (``prepare_ucx_env``) or for a child's environment
(``apply_ucx_env``).

Measured with NIXL 1.5 and UCX: every process that creates a UCX backend segfaults at exit (rc 139, in
the bundled libnl) unless ``UCX_MODULES=^ib`` is set before NIXL loads UCX. On a host with real
InfiniBand devices that setting would disable them, so it is applied only when
``/sys/class/infiniband`` has no entries, and never overrides a value the operator already set.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType
from typing import Mapping, MutableMapping

log = logging.getLogger(__name__)

_IB_SYSFS = "/sys/class/infiniband"


def has_infiniband(sysfs: str = _IB_SYSFS) -> bool:
    """True when the kernel exposes at least one RDMA device."""
    try:
        return bool(os.listdir(sysfs))
    except OSError:
        return False


def ucx_env_defaults(env: Mapping[str, str], sysfs: str = _IB_SYSFS) -> dict[str, str]:
    """The UCX variables ``env`` lacks on this host: ``UCX_MODULES=^ib`` where there is no
    InfiniBand and ``env`` does not set UCX_MODULES itself, else nothing."""
    if "UCX_MODULES" in env or has_infiniband(sysfs):
        return {}
    return {"UCX_MODULES": "^ib"}


def apply_ucx_env(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add :func:`ucx_env_defaults` to a (child process's) environment in place; returns it."""
    env.update(ucx_env_defaults(env))
    return env


def env_for_device_query(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` for asking UCX about RDMA devices (``ucx_info -d``): without the
    no-InfiniBand default this module applied, which would hide exactly the devices asked about."""
    out = dict(env)
    if out.get("UCX_MODULES") == "^ib":
        del out["UCX_MODULES"]
    return out


def prepare_ucx_env() -> None:
    """Apply the rule to this process before NIXL loads; idempotent, never overrides the operator."""
    if ucx_env_defaults(os.environ) and any(m in sys.modules for m in ("nixl_cu12", "nixl_cu13", "nixl")):
        # Too late to help this process: UCX already read its environment.
        log.warning("NIXL was imported before pdxfer could set UCX_MODULES=^ib; "
                    "this process may segfault at exit (set it in the environment)")
    apply_ucx_env(os.environ)
    # NIXL logs every agent creation at INFO; keep test and probe output readable.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def load_nixl() -> ModuleType:
    """The NIXL Python API module (``nixl_cu12``, ``nixl_cu13`` or ``nixl``), environment prepared first.

    Raises ImportError naming the packages to install when none is present.
    """
    prepare_ucx_env()
    errors = []
    for name in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            mod = __import__(f"{name}._api", fromlist=["nixl_agent"])
            return mod
        except ImportError as exc:  # try the next distribution name
            errors.append(f"{name}: {exc}")
    raise ImportError("NIXL is not installed (pip install nixl-cu12==1.5.1); tried " + "; ".join(errors))


def load_bindings() -> ModuleType:
    """The compiled bindings module next to the API (exception types, status codes)."""
    api = load_nixl()
    pkg = api.__name__.rsplit(".", 1)[0]
    return __import__(f"{pkg}._bindings", fromlist=["nixlAgent"])


def unavailable_reason() -> str | None:
    """None if NIXL loads in this process (the registry's availability check), else why not."""
    try:
        load_nixl()
    except ImportError as exc:
        return str(exc)
    return None
