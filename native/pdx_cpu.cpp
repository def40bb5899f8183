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

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

// Batches larger than this go out with non-temporal stores: they cannot stay in cache anyway,
// and skipping the read-for-ownership of every destination line is what lets many small rows
// keep up with one big memcpy (glibc switches a single large memcpy to such stores too).
std::atomic<int64_t> g_stream_bytes{8 << 20};

void copy_bytes(char *dst, const char *src, size_t n, bool stream) {
#if defined(__SSE2__)
    if (stream && n >= 64) {
        size_t head = (size_t)(-(uintptr_t)dst & 15);
        std::memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        std::memcpy(dst + body, src + body, n - body);
        return;
    }
    // Rows of a few cache lines (K^T rows of 32-128 tokens, one head's D-vector) are copied
    // inline rather than paying a memcpy call and its size dispatch per row.
    if (n <= 512 && (n & 15) == 0) {
        for (size_t i = 0; i < n; i += 16)
            _mm_storeu_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        return;
    }
#endif
    (void)stream;
    std::memcpy(dst, src, n);
}

// Non-temporal stores are weakly ordered: fence before a worker reports its part done.
void store_fence() {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

// Below this many bytes per thread, starting a thread costs more than it saves. Settable so tests
// can drive the work split with small inputs.
std::atomic<int64_t> g_min_bytes_per_thread{256 * 1024};
constexpr int kMaxThreads = 64;
constexpr int64_t kMaxGroup = 16;  // runs interleaved row by row; 16 covers 256 -> 16 blocks

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
    int started = 1;
    try {
        pool.reserve(nthreads - 1);
        for (; started < nthreads; ++started) pool.emplace_back(fn, started, nthreads);
    } catch (...) {
        // Out of threads or memory: this thread does the shards that did not get one.
    }
    for (int i = started; i < nthreads; ++i) fn(i, nthreads);
    fn(0, nthreads);
    for (auto &t : pool) t.join();
}

// ------------------------------------------------------------------ copy_runs

void copy_byte_range(const char *src, char *dst, const pdx_run *runs, const std::vector<int64_t> &prefix,
                     int64_t lo, int64_t hi, bool stream) {
    // prefix[r] = bytes before run r; find the run holding byte lo of the concatenated stream.
    int64_t r = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
    int64_t n = (int64_t)prefix.size() - 1;
    for (; r < n && prefix[r] < hi; ++r) {
        int64_t a = std::max(lo, prefix[r]) - prefix[r];
        int64_t b = std::min(hi, prefix[r + 1]) - prefix[r];
        if (b > a) copy_bytes(dst + runs[r].dst_off + a, src + runs[r].src_off + a, (size_t)(b - a), stream);
    }
    store_fence();
}

// ------------------------------------------------------------------ strided copies

struct Dim {
    int64_t n, s, d;  // extent, src stride, dst stride (elements)
};

template <class T>
void transpose_tiles(const T *src, T *dst, Dim x, Dim y) {
    // x is contiguous in src (x.s == 1), y in dst (y.d == 1). Square tiles keep the lines of both
    // sides resident in L1 while each is walked across its stride.
    constexpr int64_t kTile = 16;
    for (int64_t x0 = 0; x0 < x.n; x0 += kTile) {
        int64_t x1 = std::min(x.n, x0 + kTile);
        for (int64_t y0 = 0; y0 < y.n; y0 += kTile) {
            int64_t y1 = std::min(y.n, y0 + kTile);
            for (int64_t i = x0; i < x1; ++i) {
                const T *s = src + i;
                T *d = dst + i * x.d;
                for (int64_t j = y0; j < y1; ++j) d[j] = s[j * y.s];
            }
        }
    }
}

template <class T>
void copy_strided(const T *src, T *dst, const Dim *dims_in, int nd, bool stream) {
    // dims_in: outermost first, 1..3 of them after collapsing; pad to exactly three.
    Dim dims[3] = {{1, 0, 0}, {1, 0, 0}, {1, 0, 0}};
    std::copy(dims_in, dims_in + nd, dims + (3 - nd));
    const Dim &o = dims[0], &m = dims[1], &in = dims[2];
    if (in.s == 1 && in.d == 1) {
        size_t row = (size_t)in.n * sizeof(T);
        for (int64_t i = 0; i < o.n; ++i)
            for (int64_t j = 0; j < m.n; ++j)
                copy_bytes((char *)(dst + i * o.d + j * m.d), (const char *)(src + i * o.s + j * m.s), row, stream);
        return;
    }
    // A transpose (K^T <-> row-major): one dim contiguous in src, another in dst.
    int xs = -1, yd = -1;
    for (int i = 0; i < 3; ++i) {
        if (dims[i].n > 1 && dims[i].s == 1 && xs < 0) xs = i;
        if (dims[i].n > 1 && dims[i].d == 1 && yd < 0) yd = i;
    }
    if (xs >= 0 && yd >= 0 && xs != yd) {
        const Dim &z = dims[3 - xs - yd];
        for (int64_t k = 0; k < z.n; ++k) transpose_tiles(src + k * z.s, dst + k * z.d, dims[xs], dims[yd]);
        return;
    }
    for (int64_t i = 0; i < o.n; ++i)
        for (int64_t j = 0; j < m.n; ++j) {
            const T *s = src + i * o.s + j * m.s;
            T *d = dst + i * o.d + j * m.d;
            for (int64_t k = 0; k < in.n; ++k) d[k * in.d] = s[k * in.s];
        }
}

// Order dims so reads are sequential (the source is usually a staging buffer just received or a
// holder's cache, read once), merge dims contiguous in both buffers (a whole HND head, all NHD
// heads of a token), and pick the tightest loop. Scattered writes are absorbed by the
// non-temporal stores of large calls; measured, reading in order beats writing in order 1.3-2x.
void copy_3d(const char *src, char *dst, const Dim dims_in[3], int esize, bool stream) {
    Dim dims[3];
    int nd = 0;
    for (int i = 0; i < 3; ++i)
        if (dims_in[i].n == 0) return;
        else if (dims_in[i].n > 1) dims[nd++] = dims_in[i];
    if (nd == 0) {
        std::memcpy(dst, src, (size_t)esize);
        return;
    }
    auto before = [](const Dim &x, const Dim &y) { return x.s != y.s ? x.s > y.s : x.d > y.d; };
    for (int i = 1; i < nd; ++i)  // insertion sort of at most three dims
        for (int j = i; j > 0 && before(dims[j], dims[j - 1]); --j) std::swap(dims[j], dims[j - 1]);
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
    switch (esize) {
        case 1: copy_strided((const uint8_t *)src, (uint8_t *)dst, dims, nd, stream); break;
        case 2: copy_strided((const uint16_t *)src, (uint16_t *)dst, dims, nd, stream); break;
        case 4: copy_strided((const uint32_t *)src, (uint32_t *)dst, dims, nd, stream); break;
        default: copy_strided((const uint64_t *)src, (uint64_t *)dst, dims, nd, stream); break;
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

const char *part_src(const char *src, const pdx_part &a, const pdx_tok_run &r, int64_t h, int esize) {
    return src + r.src_off + (a.base + r.src_tok * a.tok_stride + (r.src_head + h) * a.head_stride) * esize;
}

char *part_dst(char *dst, const pdx_part &b, const pdx_tok_run &r, int64_t h, int esize) {
    return dst + r.dst_off + (b.base + r.dst_tok * b.tok_stride + (r.dst_head + h) * b.head_stride) * esize;
}

void scatter_part(const char *src, char *dst, const pdx_geom *sg, const pdx_geom *dg, int64_t p, int esize,
                  const pdx_tok_run &r, int64_t h0, int64_t h1, bool stream) {
    const pdx_part &a = sg->parts[p], &b = dg->parts[p];
    Dim dims[3] = {{h1 - h0, a.head_stride, b.head_stride},
                   {r.ntok, a.tok_stride, b.tok_stride},
                   {sg->head_dim, a.dim_stride, b.dim_stride}};
    copy_3d(part_src(src, a, r, h0, esize), part_dst(dst, b, r, h0, esize), dims, esize, stream);
}

// Token-fastest parts (vLLM CPU's K^T) on both sides, a group of runs sharing one source block (a
// big block split into small ones): copy row d of every run before row d+1, so the source block is
// read in address order instead of in stripes (256 -> 32: 1.5x). Grouping runs that share a
// destination block instead (small blocks merged) was measured slower with non-temporal stores
// (0.75x vs 0.9x of memcpy for 64 -> 256: it reads several source streams at once), so it is not done.
void scatter_rows_grouped(const char *src, char *dst, const pdx_geom *sg, const pdx_geom *dg, int64_t p,
                          int esize, const pdx_tok_run *runs, int64_t g0, int64_t g1, int64_t h0, int64_t h1,
                          bool stream) {
    const pdx_part &a = sg->parts[p], &b = dg->parts[p];
    for (int64_t h = h0; h < h1; ++h)
        for (int64_t d = 0; d < sg->head_dim; ++d)
            for (int64_t g = g0; g < g1; ++g) {
                const pdx_tok_run &r = runs[g];
                copy_bytes(part_dst(dst, b, r, h, esize) + d * b.dim_stride * esize,
                           part_src(src, a, r, h, esize) + d * a.dim_stride * esize, (size_t)(r.ntok * esize), stream);
            }
}

bool same_group(const pdx_tok_run &x, const pdx_tok_run &y) {
    return x.src_off == y.src_off && x.src_head == y.src_head && x.dst_head == y.dst_head &&
           x.nheads == y.nheads && y.ntok > 0;
}

int copy_runs_impl(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes, const pdx_run *runs,
                   int64_t nruns, int threads, int64_t *bad) {
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
    bool stream = total >= g_stream_bytes.load();
    run_parallel(nt, [&](int i, int n) {
        copy_byte_range((const char *)src, (char *)dst, runs, prefix, total * i / n, total * (i + 1) / n, stream);
    });
    return PDX_OK;
}

int scatter_tokens_impl(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes,
                        const pdx_geom *src_geom, const pdx_geom *dst_geom, int elem_size, const pdx_tok_run *runs,
                        int64_t nruns, int threads, int64_t *bad) {
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
    bool stream = total * unit_bytes >= g_stream_bytes.load();
    // Parts interleaved per head in the source (vLLM CPU: K^T then V of head 0, then head 1):
    // copy head by head so reads advance through the block in address order.
    bool head_major = src_geom->nparts > 1;
    for (int64_t p = 0; p < src_geom->nparts; ++p)
        head_major = head_major && src_geom->parts[p].head_stride == src_geom->parts[0].head_stride &&
                     src_geom->parts[p].base < src_geom->parts[0].head_stride;
    int row_parts = 0;  // parts whose tokens are contiguous on both sides
    for (int64_t p = 0; p < src_geom->nparts; ++p)
        if (src_geom->parts[p].tok_stride == 1 && dst_geom->parts[p].tok_stride == 1) row_parts |= 1 << p;
    run_parallel(nt, [&](int t, int n) {
        int64_t lo = total * t / n, hi = total * (t + 1) / n;
        // A thread owns the (run, head) units whose first element falls in [lo, hi).
        int64_t r = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
        while (r < nruns && prefix[r] < hi) {
            const pdx_tok_run &run = runs[r];
            int64_t per_head = run.ntok;
            if (per_head == 0 || run.nheads == 0) {
                ++r;
                continue;
            }
            int64_t h0 = std::max<int64_t>(0, (lo - prefix[r] + per_head - 1) / per_head);
            int64_t h1 = std::min<int64_t>(run.nheads, (hi - prefix[r] + per_head - 1) / per_head);
            // Extend to a group of following runs this thread owns whole (see scatter_rows_grouped).
            int64_t g1 = r + 1;
            if (row_parts && h0 == 0 && h1 == run.nheads)
                while (g1 < nruns && g1 - r < kMaxGroup && same_group(run, runs[g1]) &&
                       prefix[g1] + (runs[g1].nheads - 1) * runs[g1].ntok < hi)
                    ++g1;
            // Head-major where K and V of a head are adjacent, so both sides advance in address order.
            int64_t nh = run.nheads;
            int64_t hstep = head_major ? 1 : nh;
            for (int64_t hb = 0; hb < nh; hb += hstep)
                for (int64_t p = 0; p < src_geom->nparts; ++p) {
                    int64_t ha = hb, he = hb + hstep;
                    if (g1 - r > 1 && (row_parts >> p & 1)) {
                        scatter_rows_grouped((const char *)src, (char *)dst, src_geom, dst_geom, p, elem_size, runs,
                                             r, g1, ha, he, stream);
                        continue;
                    }
                    for (int64_t g = r; g < g1; ++g) {
                        // The first run may be shared with the previous thread: only heads [h0, h1).
                        int64_t lo_h = std::max(ha, g == r ? h0 : 0), hi_h = std::min(he, g == r ? h1 : nh);
                        if (hi_h > lo_h)
                            scatter_part((const char *)src, (char *)dst, src_geom, dst_geom, p, elem_size, runs[g],
                                         lo_h, hi_h, stream);
                    }
                }
            r = g1;
        }
        store_fence();
    });
    return PDX_OK;
}

}  // namespace

extern "C" {

int pdx_abi_version(void) { return PDX_ABI_VERSION; }

void pdx_set_tuning(int64_t min_bytes_per_thread, int64_t stream_min_bytes, int64_t *old) {
    int64_t prev[2] = {g_min_bytes_per_thread.load(), g_stream_bytes.load()};
    if (min_bytes_per_thread > 0) g_min_bytes_per_thread.store(min_bytes_per_thread);
    if (stream_min_bytes > 0) g_stream_bytes.store(stream_min_bytes);
    if (old) old[0] = prev[0], old[1] = prev[1];
}

// No C++ exception may cross the C ABI: the only ones possible are allocation failures (the
// prefix-sum vector), reported as PDX_EINTERNAL before anything was written.
int pdx_copy_runs(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes,
                  const pdx_run *runs, int64_t nruns, int threads, int64_t *bad) {
    if (bad) *bad = -1;
    try {
        return copy_runs_impl(src, src_nbytes, dst, dst_nbytes, runs, nruns, threads, bad);
    } catch (...) {
        return PDX_EINTERNAL;
    }
}

int pdx_scatter_tokens(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes,
                       const pdx_geom *src_geom, const pdx_geom *dst_geom, int elem_size,
                       const pdx_tok_run *runs, int64_t nruns, int threads, int64_t *bad) {
    if (bad) *bad = -1;
    try {
        return scatter_tokens_impl(src, src_nbytes, dst, dst_nbytes, src_geom, dst_geom, elem_size, runs, nruns,
                                   threads, bad);
    } catch (...) {
        return PDX_EINTERNAL;
    }
}

}  // extern "C"
