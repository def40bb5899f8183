"""Build (and cache) the soft-RoCE guest: a Debian kernel plus a busybox initramfs.

The guest has no disk: the initramfs loads the virtio/9p modules, mounts the host root read-only
over 9p, lays tmpfs over the paths that must be writable and chroots into it, so the host's own
packages (rdma-core, perftest, pyverbs, the Python venv, the repository) are what runs inside.
Only the kernel and a handful of modules come from the kernel package.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Modules needed before the chroot (virtio transport + 9p). Everything else (rdma_rxe, veth) is
# loaded inside the chroot with the host's modprobe, against the kernel package's module tree.
EARLY_MODULES = ("virtio_pci", "9pnet_virtio", "9p")

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /modules/$m || echo "softroce-init: insmod $m failed"; done
mkdir -p /host
# The host root, read-only: 'cache=loose' is safe because nothing changes it during a run.
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro hostroot /host; then
  echo "softroce-init: cannot mount the host root over 9p"; reboot -f
fi
# A second view of the host root, taken before the tmpfs mounts hide /tmp, /var/tmp and /run.
mkdir -p /ro
mount --bind /host /ro
for d in tmp var/tmp run; do mount -t tmpfs -o mode=1777 tmpfs /host/$d; done
mount -t proc proc /host/proc
mount -t sysfs sys /host/sys
mount -o bind /dev /host/dev
mkdir -p /host/dev/shm /host/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /host/dev/shm
mount -t devpts devpts /host/dev/pts
mkdir -p /host/run/softroce
if ! mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 xfer /host/run/softroce; then
  echo "softroce-init: cannot mount the run directory over 9p"; reboot -f
fi
# Paths the command needs that live under a hidden directory (a CI clone in /tmp, say).
for p in $(cat /host/run/softroce/binds); do
  mkdir -p "/host$p" && mount --bind "/ro$p" "/host$p" || echo "softroce-init: cannot bind $p"
done
echo "softroce-init: chroot"
chroot /host /bin/sh /run/softroce/guest_setup.sh
echo "softroce-init: done rc=$?"
sync
umount /host/run/softroce
reboot -f
"""


@dataclass(frozen=True)
class Kernel:
    version: str
    vmlinuz: Path
    modules: Path  # /lib/modules/<version> as seen on the host (and, over 9p, in the guest)


def find_kernel(boot: str = "/boot", modroot: str = "/lib/modules") -> Kernel | None:
    """The newest installed kernel package that has rdma_rxe (Debian 12: 6.1), or None."""
    found = []
    for vmlinuz in glob.glob(os.path.join(boot, "vmlinuz-*")):
        ver = os.path.basename(vmlinuz)[len("vmlinuz-"):]
        mods = Path(modroot, ver)
        if (mods / "modules.dep").exists() and list(mods.rglob("rdma_rxe.ko*")):
            found.append(Kernel(ver, Path(vmlinuz), mods))
    if not found:
        return None

    def key(k: Kernel) -> list[int]:
        return [int(x) for x in re.findall(r"\d+", k.version)]
    return max(found, key=key)


def module_files(kernel: Kernel, names: tuple[str, ...]) -> list[Path]:
    """Module files to insmod, dependencies first, each once (kmod resolves the order)."""
    out: list[Path] = []
    for name in names:
        res = subprocess.run(["modprobe", "-S", kernel.version, "--show-depends", name],
                             capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"modprobe --show-depends {name} for {kernel.version} failed: {res.stderr.strip()}")
        for line in res.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod":
                p = Path(parts[1])
                if p not in out:
                    out.append(p)
    return out


def _newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio 'newc' archive (what the kernel unpacks as initramfs) of (name, mode, data)."""
    buf = io.BytesIO()

    def pad(n: int) -> None:
        buf.write(b"\0" * ((4 - n % 4) % 4))

    for ino, (name, mode, data) in enumerate(entries + [("TRAILER!!!", 0, b"")], start=1):
        nb = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0]
        hdr = b"070701" + b"".join(b"%08X" % f for f in fields)
        buf.write(hdr + nb)
        pad(len(hdr) + len(nb))
        buf.write(data)
        pad(len(data))
    return buf.getvalue()


def build_initramfs(kernel: Kernel, busybox: Path, cache: Path) -> Path:
    """The initramfs for ``kernel``; rebuilt only when its inputs change."""
    mods = module_files(kernel, EARLY_MODULES)
    h = hashlib.sha256()
    for part in (INIT.encode(), kernel.version.encode(), busybox.read_bytes(), *(str(m).encode() for m in mods)):
        h.update(part)
    out = cache / f"initramfs-{kernel.version}-{h.hexdigest()[:12]}.cpio.gz"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    d, f = 0o040755, 0o100755
    entries: list[tuple[str, int, bytes]] = [(n, d, b"") for n in ("bin", "dev", "proc", "sys", "modules", "host")]
    entries.append(("bin/busybox", f, busybox.read_bytes()))
    entries.append(("init", f, INIT.encode()))
    order = []
    for m in mods:
        entries.append((f"modules/{m.name}", 0o100644, m.read_bytes()))
        order.append(m.name)
    entries.append(("modules.order", 0o100644, ("\n".join(order) + "\n").encode()))
    tmp = out.with_suffix(".tmp")
    with gzip.open(tmp, "wb", compresslevel=6) as g:
        g.write(_newc(entries))
    os.replace(tmp, out)
    for old in cache.glob("initramfs-*.cpio.gz"):
        if old != out:
            old.unlink(missing_ok=True)
    return out


def static_busybox() -> Path | None:
    """busybox-static's binary (the dynamic one cannot run in an initramfs without libc)."""
    for cand in ("/bin/busybox", "/usr/bin/busybox"):
        p = Path(cand)
        if p.exists() and b"/lib64/ld-linux" not in p.read_bytes()[:4096]:
            return p
    return None


def copy_setup_script(src: Path, rundir: Path) -> None:
    shutil.copy(src, rundir / "guest_setup.sh")


# Directories the guest covers with tmpfs (writable there, but the host's content is hidden).
HIDDEN = ("/tmp", "/var/tmp", "/run")


def binds_for(paths: list[Path]) -> list[str]:
    """Those of ``paths`` (resolved) that lie under a hidden directory: the guest binds them back."""
    out: list[str] = []
    for p in paths:
        r = str(p.resolve())
        if any(r == h or r.startswith(h + "/") for h in HIDDEN) and r not in out:
            out.append(r)
    return out
