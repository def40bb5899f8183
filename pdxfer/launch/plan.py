"""What each instance of a `pdxfer launch` fleet is given before it starts: its name, cores,
environment and pdxfer connector config.

Cores: the allowed cores split among the instances; instances that share a core get a setting so
that none starves another. The ``--kv-config`` items are checked here, so that a mistake is found
before minutes of model loading. launch.py starts the processes.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

from pdxfer.contracts.spin import ENV as SPIN_ENV


def pdxfer_kv_config(role: str, master: str, transport: str = "tcp",
                     chunk_tokens: int | None = None, **extra: object) -> dict:
    """--kv-transfer-config for the pdxfer connector in `role` (kv_producer|kv_consumer|kv_both)."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"kv role must be kv_producer, kv_consumer or kv_both, not {role!r}")
    cfg: dict[str, object] = {"master": master, "transport": transport, **extra}
    if chunk_tokens is not None:
        cfg["chunk_tokens"] = chunk_tokens
    return {"kv_connector": "PdxferConnector", "kv_connector_module_path": "pdxfer.vllm",
            "kv_role": role, "kv_connector_extra_config": cfg}


def split_cores_among(n: int, cores: Sequence[int] | None = None) -> list[str]:
    """``n`` disjoint core lists (VLLM_CPU_OMP_THREADS_BIND syntax), one per instance, of near
    equal size (later lists get the spare cores), from the cores this process may run on (its
    affinity mask, so containers work). With fewer cores than instances they share round-robin."""
    if n < 1:
        raise ValueError(f"need at least one instance, got {n}")
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if not allowed:
        raise ValueError("no CPU cores available")
    if len(allowed) < n:
        return [str(allowed[i % len(allowed)]) for i in range(n)]
    base, spare = divmod(len(allowed), n)
    out, at = [], 0
    for i in range(n):
        size = base + (1 if i >= n - spare else 0)
        out.append(",".join(map(str, allowed[at:at + size])))
        at += size
    return out


def parse_core_list(spec: str) -> set[int]:
    """The cores of a VLLM_CPU_OMP_THREADS_BIND value: ``0``, ``0-3``, ``0,2``, TP ranks
    separated by ``|``. ValueError naming the part that is not a core or range."""
    out: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"core list {spec!r}: {part!r} is not a core or a range of cores") from None
        if first < 0 or last < first:
            raise ValueError(f"core list {spec!r}: {part!r} is not a core or a range of cores")
        out.update(range(first, last + 1))
    return out


def instances_share_cores(core_lists: Sequence[str | None]) -> bool:
    """Whether two instances may run on the same core (None: vLLM chooses, i.e. any core)."""
    if len(core_lists) > 1 and any(c is None for c in core_lists):
        return True
    seen: set[int] = set()
    for spec in core_lists:
        if spec is None:
            continue
        cores = parse_core_list(spec)
        if cores & seen:
            return True
        seen |= cores
    return False


# Instances that share cores: vLLM's busy-wait sleeps this long instead of yielding (see
# pdxfer/contracts/spin.py). Without it a decode waiting for its load starved the holder sharing its
# core: the holder's first handshake came after connect_timeout_s, its publish after the decode's
# hint wait, and both loads were recomputed.
SHARED_CORES_SPIN_SLEEP_US = "200"


def shared_cores_env(core_lists: Sequence[str | None], connector: bool,
                     environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the instances' environment gets so that instances sharing cores do not starve each
    other: nothing without the connector (it applies the setting), when no core is shared, or
    when the user set it."""
    environ = os.environ if environ is None else environ
    if not connector or SPIN_ENV in environ or not instances_share_cores(core_lists):
        return {}
    return {SPIN_ENV: SHARED_CORES_SPIN_SLEEP_US}


def split_cores(cores: Sequence[int] | None = None) -> tuple[str, str]:
    """Disjoint core lists for one prefill and one decode: halves of the allowed cores (with a
    single core both share it)."""
    allowed = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(allowed) == 1:
        return str(allowed[0]), str(allowed[0])
    p, d = split_cores_among(2, allowed)
    return p, d


def instance_names(role: str, n: int) -> list[str]:
    """Component names: "prefill" for a lone one, else "prefill-0", "prefill-1", ..."""
    return [role] if n == 1 else [f"{role}-{i}" for i in range(n)]


# Set by `pdxfer launch` itself, from its own flags and each instance's address.
_LAUNCH_OWNED_KEYS = {"master": "--master", "transport": "--transport", "chunk_tokens": "--chunk-tokens",
                      "serve_url": "(each instance's own address)"}


def parse_kv_config_args(items: Sequence[str]) -> dict[str, object]:
    """``KEY=VALUE`` items of ``--kv-config`` as kv_connector_extra_config entries. VALUE is JSON
    when it parses as JSON (``2.5``, ``true``, ``"auto"``), else the string as given. Raises
    ValueError naming the item: not KEY=VALUE, a key launch sets itself, or a key or value the
    connector would refuse at start (found here, before minutes of model loading)."""
    from pdxfer.contracts.connector_config import ConnectorConfigError, parse_extra_config

    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--kv-config {item!r}: expected KEY=VALUE")
        if key in _LAUNCH_OWNED_KEYS:
            raise ValueError(f"--kv-config {item!r}: {key} is set by launch itself; use "
                             f"{_LAUNCH_OWNED_KEYS[key]}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    try:
        parse_extra_config({"master": "127.0.0.1:1", **out}, env={})
    except ConnectorConfigError as exc:
        raise ValueError(f"--kv-config: {exc}") from exc
    return out
