#!/usr/bin/env bash
# Download what the GPU check (scripts/test.sh gpu) needs and a GPU machine without network lacks:
# the NIXL wheel for that machine's Python, into .gpu-wheels/ (ignored by git). Carry the folder to
# the GPU machine with the working tree; the check unpacks the wheels into a temporary directory and
# puts it on sys.path (no pip there, no network).
#   scripts/fetch_gpu_wheels.sh [PY_VERSION ...]   the GPU machine's `python3 -c 'import sys; print(sys.version[:4])'`,
#                                                  e.g. 3.12 (default); several versions: one wheel each
#   --full                                         keep the wheels whole (see below)
# Env: NIXL_PACKAGE (default nixl-cu12==1.5.1; nixl-cu13==1.5.1 for a CUDA 13 torch), PLATFORM
# (default manylinux_2_28_x86_64), PDXFER_GPU_WHEELS (folder, default .gpu-wheels), PYTHON (runs pip).
# --no-deps: NIXL requires torch and numpy, which the GPU machine has (torch's CUDA build) and must
# keep. The check needs nothing else: it is plain scripts, no pytest.
# By default each wheel is slimmed: nixl_ep_cu1*/ (NIXL's expert-parallel kernels, ~38 of the 68 MB;
# pdxfer never imports it) is dropped, so a wheel fits a 64 MiB limit on what travels with a tree.
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
versions=()
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    [0-9].[0-9]*) versions+=("$arg") ;;
    *) echo "usage: $0 [--full] [PY_VERSION ...]   e.g. $0 3.12" >&2; exit 2 ;;
  esac
done
[ ${#versions[@]} -gt 0 ] || versions=(3.12)
dest=${PDXFER_GPU_WHEELS:-.gpu-wheels}
pkg=${NIXL_PACKAGE:-nixl-cu12==1.5.1}
plat=${PLATFORM:-manylinux_2_28_x86_64}
py=${PYTHON:-python3}
mkdir -p "$dest"
for v in "${versions[@]}"; do
  "$py" -m pip download --no-deps --only-binary=:all: --python-version "$v" --platform "$plat" \
    -d "$dest" "$pkg"
done
if [ "$full" = 0 ]; then
  "$py" - "$dest" <<'PY'
import os, sys, zipfile
from pathlib import Path

for whl in sorted(Path(sys.argv[1]).glob("nixl_cu1*.whl")):
    with zipfile.ZipFile(whl) as z:
        drop = [i for i in z.infolist() if i.filename.split("/", 1)[0].startswith("nixl_ep_")]
        if not drop:
            continue
        tmp = whl.with_name(whl.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for info in z.infolist():
                if info not in drop:
                    out.writestr(info, z.read(info), zipfile.ZIP_DEFLATED, 9)
    os.replace(tmp, whl)
    print(f"slimmed {whl.name}: dropped {len(drop)} nixl_ep files, now {whl.stat().st_size / 2**20:.1f} MiB")
PY
fi
du -sh "$dest"
ls -l "$dest"
