"""Check 2: KV tensors shaped like vLLM's moved between two processes, every byte checked.

For each transport, one holder process registers tensors of every VRAM layout (tests/gpu/kv.py:
vLLM's flash shapes and KVCacheLayout views, MLA's among them),
each with its own seeded bytes, and this process registers its own (other bytes). Per layout it
reads a shuffled half of the holder's blocks into shuffled blocks of its own through the
transport, and compares all of its memory with what tensor indexing says it must hold (moved
blocks equal the holder's, every other byte unchanged).
Throughput is the median read and is printed against a device-to-device torch ``copy_`` of the
same number of bytes in this run (absolute numbers vary between machines; the ratio less).

NIXL (UCX: cuda_ipc between the processes, or cuda_copy staging through host memory when UCX_TLS
says so) runs when it imports; TCP moves VRAM through the transport's pinned bounce buffer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdxfer.kv import layout as L
from pdxfer.transport.plan import TransferPlan
from pdxfer.planning.peer_plan import build_plan
from pdxfer.transport import create_transport, transport_options, unavailable_reason
from pdxfer.transport.base import ReadState, Transport
from pdxfer.common.procs import close_stdin_and_reap
from tests.gpu.kv import (
    HOST_ONLY,
    VRAM_LAYOUTS,
    KVSpec,
    byte_view,
    describe,
    expected_after_read,
    format_seed,
    has_tensor_field,
    make_kv,
    registered_regions,
    shift_plan,
)
from tests.gpu.report import Report
from tests.gpu.target import Target, d2d_copy_seconds, first_difference, size_text
from tests.proc_lines import read_prefixed_line

REPO = Path(__file__).resolve().parents[2]
HOLDER_START_S = 120.0  # torch + CUDA context + NIXL agent + filling VRAM
CONNECT_S = 30.0
READ_S = 120.0
HOLDER_SEED, LOCAL_SEED = 11, 23


@dataclass(frozen=True)
class Variant:
    kind: str
    label: str
    env: tuple[tuple[str, str], ...] = ()  # set for the holder and this side's transport


def variants(standin: bool) -> list[Variant]:
    out = [Variant("nixl", "nixl (UCX, host memory)" if standin else
                   "nixl (UCX picks: cuda_ipc between processes on one GPU)")]
    if not standin:  # host staging means nothing on the stand-in's host memory
        out.append(Variant("nixl", "nixl (UCX_TLS=cuda_copy,tcp: staged through host memory)",
                           (("UCX_TLS", "cuda_copy,tcp"),)))
    out.append(Variant("tcp", "tcp (pinned bounce buffer)" if not standin else "tcp (stand-in device)"))
    return out


def _read_meta(proc: subprocess.Popen, timeout: float) -> str:
    return read_prefixed_line(proc, "META ", timeout, what=f"holder pid {proc.pid}")


def _start_holder(v: Variant, specs: list[KVSpec], device: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.update(v.env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    s = specs[0]
    cmd = [sys.executable, "-m", "tests.gpu.holder", "--kind", v.kind,
           "--layouts", ",".join(f"{x.layout}:{x.num_blocks}" for x in specs),
           "--layers", str(s.layers), "--block-size", str(s.block_size), "--heads", str(s.heads),
           "--head-dim", str(s.head_dim), "--seed", str(HOLDER_SEED), "--device", device]
    # stderr to a pipe read only after exit: a holder is quiet unless it fails.
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env)


class _Env:
    """Set variables for this process while its transport is created (UCX reads them then)."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs, self.saved = pairs, {}

    def __enter__(self) -> None:
        for k, val in self.pairs:
            self.saved[k] = os.environ.get(k)
            os.environ[k] = val

    def __exit__(self, *exc: object) -> None:
        for k, old in self.saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _compare(local: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    for name, t in local.items():
        got = byte_view(t).reshape(-1)
        w = want[name].reshape(-1)
        if not torch.equal(got, w):
            return f"layer {name}: {first_difference(got, w)}"
    return None


def move_once(t: Target, reader: Transport, peer: str, plan: TransferPlan, local: dict[str, torch.Tensor],
              initial: dict[str, torch.Tensor]) -> float:
    """Reset this side's KV to its initial bytes, read the plan, return the read's seconds."""
    for name, lt in local.items():
        byte_view(lt).copy_(initial[name])
    t.sync()  # the reset must have landed before the transport writes (another stream, or another process)
    t0 = time.perf_counter()
    h = reader.read(peer, plan)
    state = h.wait(READ_S)
    secs = time.perf_counter() - t0
    if state is not ReadState.DONE:
        raise RuntimeError(f"read ended {state.value}: {h.error}")
    return secs


@dataclass
class _Side:
    """One layout of a move: the holder's (where its regions start there) and this side's."""

    spec: KVSpec
    remote_first: int
    remote_layout: L.KVLayout
    local_first: int = 0
    local: dict[str, torch.Tensor] | None = None
    local_layout: L.KVLayout | None = None


def _move_format(rep: Report, t: Target, label: str, side: _Side, reader: Transport, peer: str, position: int,
                 repeats: int, corrupt: bool) -> None:
    spec, local = side.spec, side.local
    assert local is not None and side.local_layout is not None
    remote = make_kv(spec, t.device, format_seed(HOLDER_SEED, position))  # the holder's bytes, rebuilt here
    initial = {n: byte_view(x).clone() for n, x in local.items()}
    rng = np.random.default_rng(HOLDER_SEED + position)
    n = spec.num_blocks // 2
    rblocks = [int(b) for b in rng.permutation(spec.num_blocks)[:n]]
    lblocks = [int(b) for b in rng.permutation(spec.num_blocks)[:n]]
    want = expected_after_read(spec, remote, local, rblocks, lblocks)
    del remote
    plan = shift_plan(build_plan(side.remote_layout, rblocks, side.local_layout, lblocks),
                      side.remote_first, side.local_first)
    times = []
    for i in range(repeats + 1):  # the first read (connection warm-up) is checked, not timed
        secs = move_once(t, reader, peer, plan, local, initial)
        if corrupt and i == 0:  # --corrupt-for-test: prove a wrong byte is reported
            byte_view(next(iter(local.values()))).view(-1)[7] ^= 0x5A
        why = _compare(local, want)
        if why:
            rep.failed(label, f"read {i}: {why}")
            return
        if i:
            times.append(secs)
    secs = float(np.median(times))
    nbytes = plan.total_bytes
    base = d2d_copy_seconds(t, nbytes, repeats)
    rep.passed(label, f"{size_text(nbytes)} in {len(plan)} runs ({n} of {spec.num_blocks} blocks x "
                      f"{spec.layers} layers), every byte checked {repeats + 1} times; "
                      f"{nbytes / secs / 1e9:.2f} GB/s = {base / secs:.3f}x a device torch copy_ "
                      f"of the same bytes ({nbytes / base / 1e9:.2f} GB/s)")


def run_variant(rep: Report, t: Target, v: Variant, specs: list[KVSpec], repeats: int, corrupt: bool) -> None:
    """One holder process and one reader transport for every layout, then each layout's move."""
    labels = [f"move {s.layout} {v.label}" for s in specs]
    if v.kind == "tcp" and not t.standin and not has_tensor_field():
        for label in labels:
            rep.failed(label, "pdxfer.transport.base.RegisteredRegion has no 'tensor' field: this checkout lacks "
                              "the TCP transport's bounce-buffer path for CUDA memory")
        return
    holder = _start_holder(v, specs, t.device)
    reader = None
    done = 0
    try:
        _, meta_hex, table_json = _read_meta(holder, HOLDER_START_S).split(" ", 2)
        sides = [_Side(spec, int(first), L.KVLayout.from_wire(doc))
                 for spec, (_fmt, first, doc) in zip(specs, json.loads(table_json))]
        regions = []
        for i, side in enumerate(sides):
            side.local = make_kv(side.spec, t.device, format_seed(LOCAL_SEED, i))
            side.local_layout = describe(side.spec, side.local)
            side.local_first = len(regions)
            regions += registered_regions(side.local_layout, side.local, first_index=len(regions))
        with _Env(v.env):
            reader = create_transport(v.kind, **transport_options(v.kind, listen_host="127.0.0.1"))
        reader.register(regions)
        peer = reader.connect(bytes.fromhex(meta_hex), timeout=CONNECT_S)
        for i, (label, side) in enumerate(zip(labels, sides)):
            done = i
            if rep.out_of_time(label):
                continue
            try:
                _move_format(rep, t, label, side, reader, peer, i, repeats, corrupt and i == 0)
            except Exception as exc:  # noqa: BLE001 - this layout's FAIL; the next layouts still run
                rep.failed(label, f"{type(exc).__name__}: {exc}")
        done = len(labels)
    except Exception as exc:  # noqa: BLE001 - the holder or the connection broke: every layout not run FAILs
        for label in labels[done:]:
            rep.failed(label, f"{type(exc).__name__}: {exc}")
    finally:
        if reader is not None:
            reader.close()
        close_stdin_and_reap(holder, 15.0, kill_wait_s=10.0)


def run_moves(rep: Report, t: Target, kinds: list[str], kv_mib: float, repeats: int, corrupt: bool,
              wheel_hint: str) -> None:
    covered = {v.kv_format for v in VRAM_LAYOUTS.values()}
    for fmt in L.FORMATS:
        if fmt not in HOST_ONLY and fmt not in covered:
            rep.skipped(f"move {fmt}", "no VRAM layout of this format in tests/gpu/kv.py VRAM_LAYOUTS yet")
    specs = []
    for name in VRAM_LAYOUTS:
        spec = KVSpec(name, 4, 1, 16, 8, 128) if not t.standin else KVSpec(name, 2, 1, 16, 2, 32)
        per_block = spec.layer_bytes()
        specs.append(KVSpec(name, spec.layers, max(4, int(kv_mib * 2**20) // per_block), spec.block_size,
                            spec.heads, spec.head_dim))
    first, shown_nixl = True, False
    for v in variants(t.standin):
        if v.kind not in kinds:
            continue
        why = unavailable_reason(v.kind)
        if why:
            rep.skipped(f"move * {v.label}", f"{why}. {wheel_hint}" if v.kind == "nixl" else why)
            continue
        if v.kind == "nixl" and not shown_nixl:
            shown_nixl = True
            mod = next((sys.modules[m] for m in ("nixl_cu12", "nixl_cu13", "nixl") if m in sys.modules), None)
            rep.info(f"NIXL imported from {getattr(mod, '__file__', '?')}")
        if v.kind == "tcp" and t.standin and not has_tensor_field():
            rep.info("RegisteredRegion has no 'tensor' field yet: the stand-in TCP moves take the host-memory path, "
                     "not the bounce buffer")
        if rep.out_of_time(f"move * {v.label}"):
            continue
        run_variant(rep, t, v, specs, repeats, corrupt and first)
        first = False
