// pdxfer CPU kernels: threaded batched memcpy and token-range scatter between KV block geometries.
// Build: native/build.sh (g++ -O3 -shared -fPIC -pthread). ABI: pdx_native.h.
//
// Every call validates the whole run list first and returns PDX_ERANGE/PDX_EARG before writing
// a byte, so the destination is untouched on error. Work is split over threads by bytes (not by
// run count) because run lengths in a plan vary by orders of magnitude.
#include "pdx_native.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace {

// Below this many bytes per thread, starting a thread costs more than it saves. Settable so tests
// can drive the work split with small inputs.
std::atomic<int64_t> g_min_bytes_per_thread{256 * 1024};
constexpr int kMaxThreads = 64;

int clamp_threads(int threads, int64_t total_bytes) {
    int64_t by_size = std::max<int64_t>(1, total_bytes / std::max<int64_t>(1, g_min_bytes_per_thread.load()));
    return (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, by_size, kMaxThreads}));
}

template <class F>
void run_parallel(int nthreads, F &&fn) {
    if (nthreads <= 1) {
        fn(0, 1);
        return;
    }
    std::vector<std::thread> pool;
    pool.reserve(nthreads - 1);
    for (int i = 1; i < nthreads; ++i) pool.emplace_back(fn, i, nthreads);
    fn(0, nthreads);
    for (auto &t : pool) t.join();
}

// ------------------------------------------------------------------ copy_runs

void copy_byte_range(const char *src, char *dst, const pdx_run *runs, const std::vector<int64_t> &prefix,
                     int64_t lo, int64_t hi) {
    // prefix[r] = bytes before run r; find the run holding byte lo of the concatenated stream.
    int64_t r = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
    int64_t n = (int64_t)prefix.size() - 1;
    for (; r < n && prefix[r] < hi; ++r) {
        int64_t a = std::max(lo, prefix[r]) - prefix[r];
        int64_t b = std::min(hi, prefix[r + 1]) - prefix[r];
        if (b > a) std::memcpy(dst + runs[r].dst_off + a, src + runs[r].src_off + a, (size_t)(b - a));
    }
}

// ------------------------------------------------------------------ strided copies

struct Dim {
    int64_t n, s, d;  // extent, src stride, dst stride (elements)
};

template <class T>
void transpose_tiles(const T *src, T *dst, Dim a, Dim b) {
    // a: contiguous in dst (a.d == 1); b: contiguous in src (b.s == 1). Tiles keep both sides'
    // cache lines resident while one is walked with a stride.
    constexpr int64_t kTile = 16;
    for (int64_t b0 = 0; b0 < b.n; b0 += kTile) {
        int64_t b1 = std::min(b.n, b0 + kTile);
        for (int64_t a0 = 0; a0 < a.n; a0 += kTile) {
            int64_t a1 = std::min(a.n, a0 + kTile);
            for (int64_t j = b0; j < b1; ++j) {
                const T *s = src + j;
                T *d = dst + j * b.d;
                for (int64_t i = a0; i < a1; ++i) d[i] = s[i * a.s];
            }
        }
    }
}

template <class T>
void copy_strided(const T *src, T *dst, Dim *dims, int nd) {
    // dims are outermost first, at most 3 after collapsing.
    Dim one{1, 0, 0};
    while (nd < 3) {
        std::copy_backward(dims, dims + nd, dims + nd + 1);
        dims[0] = one;
        ++nd;
    }
    Dim o = dims[0], m = dims[1], in = dims[2];
    if (in.d == 1 && o.s == 1) std::swap(o, m);  // the two outer loops commute; put the src-contiguous one in the middle
    if (in.s == 1 && in.d == 1) {
        size_t row = (size_t)in.n * sizeof(T);
        for (int64_t i = 0; i < o.n; ++i)
            for (int64_t j = 0; j < m.n; ++j)
                std::memcpy(dst + i * o.d + j * m.d, src + i * o.s + j * m.s, row);
        return;
    }
    if (in.d == 1 && m.s == 1) {
        for (int64_t i = 0; i < o.n; ++i) transpose_tiles(src + i * o.s, dst + i * o.d, in, m);
        return;
    }
    for (int64_t i = 0; i < o.n; ++i)
        for (int64_t j = 0; j < m.n; ++j) {
            const T *s = src + i * o.s + j * m.s;
            T *d = dst + i * o.d + j * m.d;
            for (int64_t k = 0; k < in.n; ++k) d[k * in.d] = s[k * in.s];
        }
}

// Order dims so writes are as sequential as possible, merge dims that are contiguous in both
// buffers (e.g. a whole HND head, or all NHD heads of a token), and pick the tightest loop.
void copy_3d(const char *src, char *dst, Dim dims_in[3], int esize) {
    Dim dims[3];
    int nd = 0;
    for (int i = 0; i < 3; ++i)
        if (dims_in[i].n == 0) return;
        else if (dims_in[i].n > 1) dims[nd++] = dims_in[i];
    if (nd == 0) {
        std::memcpy(dst, src, (size_t)esize);
        return;
    }
    std::sort(dims, dims + nd, [](const Dim &x, const Dim &y) {
        return x.d != y.d ? x.d > y.d : x.s > y.s;
    });
    int m = 0;
    for (int i = 1; i < nd; ++i) {
        Dim &outer = dims[m];
        if (outer.s == dims[i].n * dims[i].s && outer.d == dims[i].n * dims[i].d) {
            outer = {outer.n * dims[i].n, dims[i].s, dims[i].d};
        } else {
            dims[++m] = dims[i];
        }
    }
    nd = m + 1;
    // A single fully-contiguous run: one memcpy whatever the element size.
    if (nd == 1 && dims[0].s == 1 && dims[0].d == 1) {
        std::memcpy(dst, src, (size_t)(dims[0].n * esize));
        return;
    }
    switch (esize) {
        case 1: copy_strided((const uint8_t *)src, (uint8_t *)dst, dims, nd); break;
        case 2: copy_strided((const uint16_t *)src, (uint16_t *)dst, dims, nd); break;
        case 4: copy_strided((const uint32_t *)src, (uint32_t *)dst, dims, nd); break;
        default: copy_strided((const uint64_t *)src, (uint64_t *)dst, dims, nd); break;
    }
}

// ------------------------------------------------------------------ scatter_tokens

bool geom_ok(const pdx_geom *g) {
    if (!g || g->block_tokens <= 0 || g->heads <= 0 || g->head_dim <= 0) return false;
    if (g->nparts < 1 || g->nparts > PDX_MAX_PARTS) return false;
    for (int64_t p = 0; p < g->nparts; ++p) {
        const pdx_part &q = g->parts[p];
        if (q.base < 0 || q.tok_stride < 0 || q.head_stride < 0 || q.dim_stride < 0) return false;
    }
    return true;
}

// One past the last byte a run touches in one part (strides are non-negative).
int64_t touched_end(const pdx_part &q, int64_t off, int64_t tok, int64_t ntok, int64_t head,
                    int64_t nheads, int64_t head_dim, int esize) {
    int64_t last = q.base + (tok + ntok - 1) * q.tok_stride + (head + nheads - 1) * q.head_stride +
                   (head_dim - 1) * q.dim_stride;
    return off + (last + 1) * esize;
}

bool tok_run_ok(const pdx_tok_run &r, const pdx_geom *sg, const pdx_geom *dg, int esize,
                int64_t src_nbytes, int64_t dst_nbytes) {
    if (r.ntok < 0 || r.nheads < 0 || r.src_off < 0 || r.dst_off < 0) return false;
    if (r.ntok == 0 || r.nheads == 0) return true;
    if (r.src_tok < 0 || r.dst_tok < 0 || r.src_head < 0 || r.dst_head < 0) return false;
    if (r.src_tok + r.ntok > sg->block_tokens || r.dst_tok + r.ntok > dg->block_tokens) return false;
    if (r.src_head + r.nheads > sg->heads || r.dst_head + r.nheads > dg->heads) return false;
    for (int64_t p = 0; p < sg->nparts; ++p) {
        if (touched_end(sg->parts[p], r.src_off, r.src_tok, r.ntok, r.src_head, r.nheads,
                        sg->head_dim, esize) > src_nbytes)
            return false;
        if (touched_end(dg->parts[p], r.dst_off, r.dst_tok, r.ntok, r.dst_head, r.nheads,
                        dg->head_dim, esize) > dst_nbytes)
            return false;
    }
    return true;
}

void scatter_heads(const char *src, char *dst, const pdx_geom *sg, const pdx_geom *dg, int esize,
                   const pdx_tok_run &r, int64_t h0, int64_t h1) {
    for (int64_t p = 0; p < sg->nparts; ++p) {
        const pdx_part &a = sg->parts[p], &b = dg->parts[p];
        const char *s = src + r.src_off +
                        (a.base + r.src_tok * a.tok_stride + (r.src_head + h0) * a.head_stride) * esize;
        char *d = dst + r.dst_off +
                  (b.base + r.dst_tok * b.tok_stride + (r.dst_head + h0) * b.head_stride) * esize;
        Dim dims[3] = {{h1 - h0, a.head_stride, b.head_stride},
                       {r.ntok, a.tok_stride, b.tok_stride},
                       {sg->head_dim, a.dim_stride, b.dim_stride}};
        copy_3d(s, d, dims, esize);
    }
}

}  // namespace

extern "C" {

int pdx_abi_version(void) { return PDX_ABI_VERSION; }

int64_t pdx_set_min_bytes_per_thread(int64_t nbytes) {
    return g_min_bytes_per_thread.exchange(nbytes > 0 ? nbytes : 1);
}

int pdx_copy_runs(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes,
                  const pdx_run *runs, int64_t nruns, int threads, int64_t *bad) {
    if (bad) *bad = -1;
    if (nruns < 0 || (nruns > 0 && !runs)) return PDX_EARG;
    std::vector<int64_t> prefix((size_t)nruns + 1, 0);
    for (int64_t i = 0; i < nruns; ++i) {
        const pdx_run &r = runs[i];
        bool ok = r.len >= 0 && r.src_off >= 0 && r.dst_off >= 0 &&
                  (r.len == 0 || (r.src_off <= src_nbytes - r.len && r.dst_off <= dst_nbytes - r.len));
        if (!ok) {
            if (bad) *bad = i;
            return PDX_ERANGE;
        }
        prefix[i + 1] = prefix[i] + r.len;
    }
    int64_t total = prefix[nruns];
    if (total == 0) return PDX_OK;
    if (!src || !dst) return PDX_EARG;
    int nt = clamp_threads(threads, total);
    run_parallel(nt, [&](int i, int n) {
        copy_byte_range((const char *)src, (char *)dst, runs, prefix, total * i / n, total * (i + 1) / n);
    });
    return PDX_OK;
}

int pdx_scatter_tokens(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes,
                       const pdx_geom *src_geom, const pdx_geom *dst_geom, int elem_size,
                       const pdx_tok_run *runs, int64_t nruns, int threads, int64_t *bad) {
    if (bad) *bad = -1;
    if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) return PDX_EARG;
    if (!geom_ok(src_geom) || !geom_ok(dst_geom)) return PDX_EARG;
    if (src_geom->nparts != dst_geom->nparts || src_geom->head_dim != dst_geom->head_dim) return PDX_EARG;
    if (nruns < 0 || (nruns > 0 && !runs)) return PDX_EARG;
    // Work units are (run, head); prefix[r] = weight (elements) before run r.
    std::vector<int64_t> prefix((size_t)nruns + 1, 0);
    for (int64_t i = 0; i < nruns; ++i) {
        if (!tok_run_ok(runs[i], src_geom, dst_geom, elem_size, src_nbytes, dst_nbytes)) {
            if (bad) *bad = i;
            return PDX_ERANGE;
        }
        int64_t w = runs[i].ntok * runs[i].nheads;
        prefix[i + 1] = prefix[i] + w;
    }
    int64_t total = prefix[nruns];
    if (total == 0) return PDX_OK;
    if (!src || !dst) return PDX_EARG;
    int64_t unit_bytes = src_geom->head_dim * src_geom->nparts * elem_size;
    int nt = clamp_threads(threads, total * unit_bytes);
    run_parallel(nt, [&](int t, int n) {
        int64_t lo = total * t / n, hi = total * (t + 1) / n;
        // A thread owns the (run, head) units whose first element falls in [lo, hi).
        int64_t r = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
        for (; r < nruns && prefix[r] < hi; ++r) {
            const pdx_tok_run &run = runs[r];
            int64_t per_head = run.ntok;
            if (per_head == 0 || run.nheads == 0) continue;
            int64_t h0 = std::max<int64_t>(0, (lo - prefix[r] + per_head - 1) / per_head);
            int64_t h1 = std::min<int64_t>(run.nheads, (hi - prefix[r] + per_head - 1) / per_head);
            if (h1 > h0)
                scatter_heads((const char *)src, (char *)dst, src_geom, dst_geom, elem_size, run, h0, h1);
        }
    });
    return PDX_OK;
}

}  // extern "C"
