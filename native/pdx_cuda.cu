// pdxfer CUDA twins of pdx_cpu.cpp: same run lists, same geometry, GPU pointers, one stream.
//
// COMPILED BUT NEVER RUN: the development machines have no GPU. `native/build.sh --cuda` builds
// this for sm_90 and tests/unit/test_native_cuda.py checks the exported symbols; correctness on a
// device is unverified until someone runs the property tests against it on a GPU host.
//
// No bounds checks on the device: validate run lists on the host first (pdxfer.native does).
// Runs live in device memory so a prepared list can be replayed without another upload; the
// destination may be any device-visible memory (e.g. blocks a GPUDirect READ will target).
#include "pdx_native.h"

#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 256;

// One block per run, grid-strided over runs; 16-byte vectors when both ends are aligned.
__global__ void copy_runs_kernel(const char *src, char *dst, const pdx_run *runs, int64_t nruns) {
    for (int64_t r = blockIdx.x; r < nruns; r += gridDim.x) {
        const pdx_run run = runs[r];
        const char *s = src + run.src_off;
        char *d = dst + run.dst_off;
        int64_t n = run.len;
        if ((((uintptr_t)s | (uintptr_t)d) & 15) == 0) {
            int64_t nv = n / 16;
            const int4 *sv = reinterpret_cast<const int4 *>(s);
            int4 *dv = reinterpret_cast<int4 *>(d);
            for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) dv[i] = sv[i];
            for (int64_t i = nv * 16 + threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
        } else {
            for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
        }
    }
}

// One block per (run, part, head) unit; threads walk (token, dim) with dim fastest so reads and
// writes of NHD/HND rows coalesce.
template <class T>
__global__ void scatter_kernel(const char *src, char *dst, pdx_geom sg, pdx_geom dg,
                               const pdx_tok_run *runs, int64_t nruns, int64_t max_heads) {
    const int64_t units = nruns * sg.nparts * max_heads;
    const int64_t hd = sg.head_dim;
    for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
        int64_t h = u % max_heads;
        int64_t p = (u / max_heads) % sg.nparts;
        int64_t r = u / (max_heads * sg.nparts);
        const pdx_tok_run run = runs[r];
        if (h >= run.nheads || run.ntok <= 0) continue;
        const pdx_part a = sg.parts[p], b = dg.parts[p];
        const T *s = reinterpret_cast<const T *>(src + run.src_off) + a.base + run.src_tok * a.tok_stride +
                     (run.src_head + h) * a.head_stride;
        T *d = reinterpret_cast<T *>(dst + run.dst_off) + b.base + run.dst_tok * b.tok_stride +
               (run.dst_head + h) * b.head_stride;
        int64_t n = run.ntok * hd;
        for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
            int64_t t = i / hd, k = i % hd;
            d[t * b.tok_stride + k * b.dim_stride] = s[t * a.tok_stride + k * a.dim_stride];
        }
    }
}

int grid_for(int64_t units) {
    // Enough blocks to fill an H100/H200 several times over; the kernels grid-stride past it.
    return (int)(units < 65535 ? (units > 0 ? units : 1) : 65535);
}

}  // namespace

extern "C" {

int pdx_cuda_abi_version(void) { return PDX_ABI_VERSION; }

int pdx_cuda_copy_runs(const void *src, void *dst, const pdx_run *runs_dev, int64_t nruns, void *stream) {
    if (nruns < 0 || (nruns > 0 && !runs_dev)) return PDX_EARG;
    if (nruns == 0) return PDX_OK;
    copy_runs_kernel<<<grid_for(nruns), kThreads, 0, (cudaStream_t)stream>>>(
        (const char *)src, (char *)dst, runs_dev, nruns);
    return cudaGetLastError() == cudaSuccess ? PDX_OK : PDX_ECUDA;
}

int pdx_cuda_scatter_tokens(const void *src, void *dst, pdx_geom src_geom, pdx_geom dst_geom,
                            int elem_size, const pdx_tok_run *runs_dev, int64_t nruns, void *stream) {
    if (nruns < 0 || (nruns > 0 && !runs_dev)) return PDX_EARG;
    if (src_geom.nparts < 1 || src_geom.nparts > PDX_MAX_PARTS || src_geom.nparts != dst_geom.nparts ||
        src_geom.head_dim != dst_geom.head_dim)
        return PDX_EARG;
    if (nruns == 0) return PDX_OK;
    // Units are sized by the larger head count; surplus (run, head) units exit at once.
    int64_t max_heads = src_geom.heads > dst_geom.heads ? src_geom.heads : dst_geom.heads;
    int grid = grid_for(nruns * src_geom.nparts * max_heads);
    cudaStream_t st = (cudaStream_t)stream;
    const char *s = (const char *)src;
    char *d = (char *)dst;
    switch (elem_size) {
        case 1: scatter_kernel<uint8_t><<<grid, kThreads, 0, st>>>(s, d, src_geom, dst_geom, runs_dev, nruns, max_heads); break;
        case 2: scatter_kernel<uint16_t><<<grid, kThreads, 0, st>>>(s, d, src_geom, dst_geom, runs_dev, nruns, max_heads); break;
        case 4: scatter_kernel<uint32_t><<<grid, kThreads, 0, st>>>(s, d, src_geom, dst_geom, runs_dev, nruns, max_heads); break;
        case 8: scatter_kernel<uint64_t><<<grid, kThreads, 0, st>>>(s, d, src_geom, dst_geom, runs_dev, nruns, max_heads); break;
        default: return PDX_EARG;
    }
    return cudaGetLastError() == cudaSuccess ? PDX_OK : PDX_ECUDA;
}

}  // extern "C"
