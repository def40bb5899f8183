#!/usr/bin/env bash
# Build pdxfer's native kernels into pdxfer/_native/ (gitignored).
#   native/build.sh            CPU library libpdxfer_native.so (g++ -O3, no torch, no CUDA)
#   native/build.sh --cuda     also the CUDA twins libpdxfer_native_cuda.so (nvcc, sm_90);
#                              they are compiled only: nothing on the dev machines can run them
# Env: CXX (default g++), NVCC (default nvcc), CUDA_ARCH (default sm_90), PDXFER_NATIVE_OUT (dir).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${PDXFER_NATIVE_OUT:-$here/../pdxfer/_native}"
mkdir -p "$out"
cuda=0
for arg in "$@"; do
  case "$arg" in
    --cuda) cuda=1 ;;
    *) echo "usage: $0 [--cuda]" >&2; exit 2 ;;
  esac
done
CXX="${CXX:-g++}"
# Write to a temporary name and rename, so a concurrent loader never maps a half-written file.
tmp="$out/.libpdxfer_native.so.$$"
"$CXX" -O3 -std=c++17 -shared -fPIC -pthread -Wall -Wextra -o "$tmp" "$here/pdx_cpu.cpp"
mv -f "$tmp" "$out/libpdxfer_native.so"
echo "built $out/libpdxfer_native.so" >&2
if [ "$cuda" = 1 ]; then
  NVCC="${NVCC:-nvcc}"
  arch="${CUDA_ARCH:-sm_90}"
  tmp="$out/.libpdxfer_native_cuda.so.$$"
  "$NVCC" -O3 -std=c++17 -arch="$arch" -shared -Xcompiler -fPIC -o "$tmp" "$here/pdx_cuda.cu"
  mv -f "$tmp" "$out/libpdxfer_native_cuda.so"
  echo "built $out/libpdxfer_native_cuda.so ($arch, compiled only: not run here)" >&2
fi
