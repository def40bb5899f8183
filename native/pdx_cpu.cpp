// pdxfer CPU kernels: threaded batched memcpy and token-range scatter between KV block geometries.
// Build: native/build.sh (g++ -O3 -shared -fPIC -pthread). ABI: pdx_native.h.
//
// Every call validates the whole run list first and returns PDX_ERANGE/PDX_EARG before writing
// a byte, so the destination is untouched on error. Work is split over threads by bytes (not by
// run count) because run lengths in a plan vary by orders of magnitude.
#include "pdx_native.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
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
        if (head) std::memcpy(dst, src, head);
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
        if (n > body) std::memcpy(dst + body, src + body, n - body);
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

// A thread start + join costs 18-23 us on the 2-core dev box (measured, std::thread), the time
// to copy ~400 KiB; below 1 MiB per thread a second thread barely pays for itself (256 KiB, the
// earlier threshold, split a 512 KiB call in two at a loss). Settable so tests can drive the work
// split with small inputs.
std::atomic<int64_t> g_min_bytes_per_thread{1 << 20};
constexpr int kMaxThreads = 64;
constexpr int64_t kMaxGroup = 16;  // runs interleaved row by row; 16 covers 256 -> 16 blocks

// How many shards the work is cut into: what the caller asked for, fewer for small calls.
int clamp_shards(int threads, int64_t total_bytes) {
    int64_t by_size = std::max<int64_t>(1, total_bytes / std::max<int64_t>(1, g_min_bytes_per_thread.load()));
    return (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, by_size, kMaxThreads}));
}

// CPUs the calling thread may run on. More threads than that only time-slice them: a memory copy
// gains nothing from it and pays thread starts and, at every switch, the other thread's cache lines
// and half-filled write-combining buffers.
int cpus_available() {
#if defined(__linux__)
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, (int)CPU_COUNT(&set));
#endif
    unsigned n = std::thread::hardware_concurrency();
    return n ? (int)n : 1;
}

// fn(i, shards) for every shard, on at most `threads` OS threads (thread k takes shards k,
// k + threads, ...). The split depends only on the shard count, so a 4-way split is the same code
// path on a 1-CPU box as on a 4-CPU one (the tests rely on that).
template <class F>
void run_parallel(int shards, int threads, F &&fn) {
    threads = std::max(1, std::min(threads, shards));
    auto worker = [&fn, shards, threads](int k) {
        for (int i = k; i < shards; i += threads) fn(i, shards);
    };
    if (threads == 1) {
        worker(0);
        return;
    }
    std::vector<std::thread> pool;
    int started = 1;
    try {
        pool.reserve(threads - 1);
        for (; started < threads; ++started) pool.emplace_back(worker, started);
    } catch (...) {
        // Out of threads or memory: this thread does the shards that did not get one.
    }
    for (int k = started; k < threads; ++k) worker(k);
    worker(0);
    for (auto &t : pool) t.join();
}

// ------------------------------------------------------------------ row queue with source prefetch

// Every contiguous row (one memcpy's worth) goes through this short queue, so that a prefetch
// cursor can run a fixed distance ahead through the source bytes still to be copied, across row and
// run boundaries. The hardware prefetcher follows one sequential stream and restarts at every jump:
// reading 32 KiB out of every 64 KiB (a head slice of vLLM CPU blocks) ran at 14.8-16 GB/s against
// 21-25 GB/s for a dense source, and at 22-25 GB/s with this cursor 8 KiB ahead (C harness on the
// dev box: 2048 x 32 KiB into shuffled slots, non-temporal stores; 4 KiB ahead: 22, in-row only:
// 21; for 8 KiB chunks 10 -> 21-22). Dense sources gain too (21 -> 26).
class RowSink {
public:
    explicit RowSink(bool stream) : stream_(stream) {}
    RowSink(const RowSink &) = delete;
    RowSink &operator=(const RowSink &) = delete;

    void push(const char *src, char *dst, int64_t len) {
        if (len < kQueueMin) {
            // Short rows (K^T rows of one block, one head's D-vector) cost more to queue and track
            // than to copy (256 -> 32 with its 64 B rows queued: 0.90x -> 0.46x of memcpy), and they
            // come in dense runs the hardware prefetcher follows. Copied at once, after what is
            // queued so a thread's writes stay in order.
            if (len <= 0) return;
            if (count_) flush();
            last_end_ = src + len;
            copy_bytes(dst, src, (size_t)len, stream_);
            return;
        }
        push_long(src, dst, len);
    }

    void flush() {
        while (count_) pop();
    }

    bool streaming() const { return stream_; }

    // The source up to `end` was just read outside the sink (a transpose): a row starting there
    // continues that stream (the V row after its head's K^T in cpu -> flash HND) and is not prefetched.
    void read_until(const char *end) { last_end_ = end; }

private:
    __attribute__((noinline)) void push_long(const char *src, char *dst, int64_t len) {
        // Only rows that do not continue where the previous one's source ended get prefetched:
        // a continuing stream is already followed by the hardware prefetcher, and prefetching it
        // too only competed with the copy's own loads (block 128 -> 64 and 64 -> 256, whose 4-8 KiB
        // V rows follow their head's K^T rows: 1.1x -> 0.6-0.7x of memcpy).
        bool cold = src != last_end_;
        last_end_ = src + len;
        q_[(head_ + count_) & (kCap - 1)] = {src, dst, len, cold};
        ++count_;
        queued_ += len;
        // Copy the oldest row once enough is queued behind it for the cursor to stay kAhead ahead.
        while (count_ > 1 && queued_ - q_[head_ & (kCap - 1)].len >= kAhead) pop();
    }

    struct Row {
        const char *src;
        char *dst;
        int64_t len;
        bool cold;  // starts away from where the previous row's source ended
    };
    static constexpr int64_t kQueueMin = 1024;  // shorter rows are copied without the queue
    static constexpr int64_t kAhead = 8192;     // prefetch distance, bytes of source
    static constexpr int64_t kSlice = 1024;     // bytes copied between cursor top-ups
    // push() leaves at most kAhead / kQueueMin rows behind the oldest one, so with one more being
    // added the ring never fills.
    static constexpr int64_t kCap = 16;  // a power of two
    static_assert(kCap >= kAhead / kQueueMin + 2 && (kCap & (kCap - 1)) == 0, "row ring too small");

    void pop() {
        const Row r = q_[head_ & (kCap - 1)];
        for (int64_t off = 0; off < r.len;) {
            // Slices end on destination cache lines: only the first has an unaligned head.
            int64_t n = std::min<int64_t>(r.len - off, kSlice - (int64_t)((uintptr_t)(r.dst + off) & 63));
            top_up();
            copy_bytes(r.dst + off, r.src + off, (size_t)n, stream_);
            off += n;
            lead_ -= n;
            if (lead_ < 0) {  // the rationed top-up fell behind the copy: restart at the copy
                pf_ = head_, pf_off_ = off, lead_ = 0;
                if (pf_off_ == r.len) ++pf_, pf_off_ = 0;
            }
        }
        ++head_;
        --count_;
        queued_ -= r.len;
    }

    // Prefetch line by line until the cursor is kAhead bytes ahead of the copy or at the queue's end.
    void top_up() {
        // At most two lines per line about to be copied: the lead builds up over a few slices
        // instead of stalling the copy behind a burst of prefetches into full miss buffers (an
        // 8 KiB row copied on its own, between short rows, lost 10-30% to that burst).
        for (int64_t budget = 2 * kSlice; lead_ < kAhead && pf_ < head_ + count_ && budget > 0;) {
            const Row &r = q_[pf_ & (kCap - 1)];
            if (!r.cold) {  // skipped, but counted: the distance is in bytes still to copy
                lead_ += r.len - pf_off_;
                ++pf_, pf_off_ = 0;
                continue;
            }
            const char *p = r.src + pf_off_;
            __builtin_prefetch(p, 0, 3);
            int64_t step = std::min<int64_t>(64 - (int64_t)((uintptr_t)p & 63), r.len - pf_off_);
            pf_off_ += step;
            lead_ += step;
            budget -= 64;
            if (pf_off_ == r.len) ++pf_, pf_off_ = 0;
        }
    }

    Row q_[kCap];
    int64_t head_ = 0, count_ = 0, queued_ = 0;  // head_ counts rows ever popped (slot head_ & (kCap-1))
    int64_t pf_ = 0, pf_off_ = 0;                // cursor: row (same numbering) and offset in it
    int64_t lead_ = 0;                           // source bytes between the copy and the cursor
    const char *last_end_ = nullptr;             // end of the last row pushed, in the source
    bool stream_;
};

// ------------------------------------------------------------------ copy_runs

void copy_byte_range(const char *src, char *dst, const pdx_run *runs, const std::vector<int64_t> &prefix,
                     int64_t lo, int64_t hi, bool stream) {
    // prefix[r] = bytes before run r; find the run holding byte lo of the concatenated stream.
    int64_t r = std::upper_bound(prefix.begin(), prefix.end(), lo) - prefix.begin() - 1;
    int64_t n = (int64_t)prefix.size() - 1;
    RowSink sink(stream);
    for (; r < n && prefix[r] < hi; ++r) {
        int64_t a = std::max(lo, prefix[r]) - prefix[r];
        int64_t b = std::min(hi, prefix[r + 1]) - prefix[r];
        if (b > a) sink.push(src + runs[r].src_off + a, dst + runs[r].dst_off + a, b - a);
    }
    sink.flush();
    store_fence();
}

// ------------------------------------------------------------------ strided copies

struct Dim {
    int64_t n, s, d;  // extent, src stride, dst stride (elements)
};

constexpr int kMaxDims = 4;  // part, head, token, dim

// One strided copy: element (i0, .., ik) goes from src + sum(i*s) to dst + sum(i*d) (elements of
// the call's size from these byte pointers). dims[0] is outermost.
struct Strided {
    const char *src;
    char *dst;
    Dim dims[kMaxDims];
    int nd;
};

// Canonical form, so that a copy is as few and as long rows as the two layouts allow: drop extent-1
// dims, order outermost-first by source stride (reads in address order: the source is usually a
// staging buffer just received, read once; measured, reading in order beats writing in order
// 1.3-2x, and non-temporal stores absorb scattered writes), then fold each dim into the next inner
// one wherever the pair is contiguous on both sides (outer stride == inner extent * inner stride, in
// src and in dst): a whole HND head, all NHD heads of a token, a whole-token K^T block. The fold is
// exact for any strides, so a wrong order only costs speed. Returns false for an empty copy.
bool canonicalize(Strided &c) {
    Dim dims[kMaxDims];
    int nd = 0;
    for (int i = 0; i < c.nd; ++i) {
        if (c.dims[i].n <= 0) return false;
        if (c.dims[i].n > 1) dims[nd++] = c.dims[i];
    }
    auto before = [](const Dim &x, const Dim &y) { return x.s != y.s ? x.s > y.s : x.d > y.d; };
    for (int i = 1; i < nd; ++i)  // insertion sort of at most four dims
        for (int j = i; j > 0 && before(dims[j], dims[j - 1]); --j) std::swap(dims[j], dims[j - 1]);
    int m = -1;
    for (int i = 0; i < nd; ++i) {
        if (m >= 0 && dims[m].s == dims[i].n * dims[i].s && dims[m].d == dims[i].n * dims[i].d)
            dims[m] = {dims[m].n * dims[i].n, dims[i].s, dims[i].d};
        else
            dims[++m] = dims[i];
    }
    c.nd = m + 1;
    std::copy(dims, dims + c.nd, c.dims);
    return true;
}

// Parts whose canonical copies have the same dims and lie the same distance apart in src and in dst
// become one copy with a part dim, which canonicalize then usually folds too. That is what makes a
// whole-token head range of a vLLM CPU block ([heads, 2B, D]: K^T then V per head, each one
// contiguous B*D range) a single row instead of one per part and head (head slice 2 of 4 heads,
// block 64: 4 rows of 8 KiB per run -> one of 32 KiB). Parts are taken in source address order;
// a part dim needs positive distances on both sides. np == 1 is the copy itself.
bool merge_parts(const Strided *c, int np, int esize, Strided &out) {
    if (np == 1) {
        out = c[0];
        return true;
    }
    int idx[PDX_MAX_PARTS];
    for (int i = 0; i < np; ++i) {  // insertion sort of at most four parts by source address
        int j = i;
        for (; j > 0 && c[idx[j - 1]].src > c[i].src; --j) idx[j] = idx[j - 1];
        idx[j] = i;
    }
    const Strided &first = c[idx[0]];
    if (first.nd >= kMaxDims) return false;
    std::ptrdiff_t ds = c[idx[1]].src - first.src, dd = c[idx[1]].dst - first.dst;
    if (ds <= 0 || dd <= 0 || ds % esize || dd % esize) return false;
    for (int k = 1; k < np; ++k) {
        const Strided &x = c[idx[k]], &prev = c[idx[k - 1]];
        if (x.src - prev.src != ds || x.dst - prev.dst != dd || x.nd != first.nd) return false;
        for (int i = 0; i < first.nd; ++i)
            if (x.dims[i].n != first.dims[i].n || x.dims[i].s != first.dims[i].s || x.dims[i].d != first.dims[i].d)
                return false;
    }
    out.src = first.src;
    out.dst = first.dst;
    out.dims[0] = {(int64_t)np, (int64_t)(ds / esize), (int64_t)(dd / esize)};
    std::copy(first.dims, first.dims + first.nd, out.dims + 1);
    out.nd = first.nd + 1;
    return canonicalize(out);
}

// ------------------------------------------------------------------ transposes

// K^T <-> row-major (vLLM CPU's K [D, B] against flash's [B, .., D]) swaps which dim is contiguous:
// no row exists to copy, and element by element ran at 1.6-2.1 GB/s (0.26-0.39x of memcpy for
// bf16). Full tiles are transposed in SSE registers instead: x is the dim contiguous in the source
// (x.s == 1), y the one contiguous in the destination (y.d == 1); one vector load brings V
// consecutive x of one y, and after the shuffles one vector holds V consecutive y of one x, ready to
// store as part of a destination row. SSE2 only (the x86-64 baseline), so the library needs no
// CPU dispatch. Partial tiles at the edges, and 8-byte elements, go element by element.
#if defined(__SSE2__)
// r[j] = x0..x7 at y0+j (16-bit) -> r[i] = y0..y7 at x0+i.
inline void tr_8x8_16(__m128i r[8]) {
    __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
    __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
    __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
    // a0: (x0: y0 y1) (x1: y0 y1) (x2..) (x3..); a1 the same for x4..x7; a2/a3 for y2, y3; ...
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    // b0: (x0: y0..y3) (x1: y0..y3); b4: the same for y4..y7.
    r[0] = _mm_unpacklo_epi64(b0, b4), r[1] = _mm_unpackhi_epi64(b0, b4);
    r[2] = _mm_unpacklo_epi64(b1, b5), r[3] = _mm_unpackhi_epi64(b1, b5);
    r[4] = _mm_unpacklo_epi64(b2, b6), r[5] = _mm_unpackhi_epi64(b2, b6);
    r[6] = _mm_unpacklo_epi64(b3, b7), r[7] = _mm_unpackhi_epi64(b3, b7);
}

// r[j] = x0..x3 at y0+j (32-bit) -> r[i] = y0..y3 at x0+i.
inline void tr_4x4_32(__m128i r[4]) {
    __m128i a0 = _mm_unpacklo_epi32(r[0], r[1]), a1 = _mm_unpackhi_epi32(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi32(r[2], r[3]), a3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(a0, a2), r[1] = _mm_unpackhi_epi64(a0, a2);
    r[2] = _mm_unpacklo_epi64(a1, a3), r[3] = _mm_unpackhi_epi64(a1, a3);
}

// Low 8 bytes of r[j] = x0..x7 at y0+j (8-bit) -> low 8 bytes of r[i] = y0..y7 at x0+i.
inline void tr_8x8_8(__m128i r[8]) {
    __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpacklo_epi8(r[2], r[3]);
    __m128i a2 = _mm_unpacklo_epi8(r[4], r[5]), a3 = _mm_unpacklo_epi8(r[6], r[7]);
    __m128i b0 = _mm_unpacklo_epi16(a0, a1), b1 = _mm_unpackhi_epi16(a0, a1);  // x0..3, x4..7: y0..y3
    __m128i b2 = _mm_unpacklo_epi16(a2, a3), b3 = _mm_unpackhi_epi16(a2, a3);  // the same for y4..y7
    __m128i c0 = _mm_unpacklo_epi32(b0, b2), c1 = _mm_unpackhi_epi32(b0, b2);  // (x0: y0..y7) (x1: ..)
    __m128i c2 = _mm_unpacklo_epi32(b1, b3), c3 = _mm_unpackhi_epi32(b1, b3);
    r[0] = c0, r[1] = _mm_unpackhi_epi64(c0, c0), r[2] = c1, r[3] = _mm_unpackhi_epi64(c1, c1);
    r[4] = c2, r[5] = _mm_unpackhi_epi64(c2, c2), r[6] = c3, r[7] = _mm_unpackhi_epi64(c3, c3);
}

// One full tile: V x V elements, V = 16 / sizeof(T) (8 for 1-byte: 8-byte halves of a vector).
template <class T>
struct Tile {
    static constexpr int64_t V = sizeof(T) == 1 ? 8 : (int64_t)(16 / sizeof(T));
    static constexpr bool kSimd = sizeof(T) <= 4;

    static void run(const T *s, int64_t ys, T *d, int64_t xd, bool nt) {
        __m128i r[V];
        for (int64_t j = 0; j < V; ++j)
            r[j] = sizeof(T) == 1 ? _mm_loadl_epi64((const __m128i *)(s + j * ys))
                                  : _mm_loadu_si128((const __m128i *)(s + j * ys));
        if constexpr (sizeof(T) == 1) tr_8x8_8(r);
        if constexpr (sizeof(T) == 2) tr_8x8_16(r);
        if constexpr (sizeof(T) == 4) tr_4x4_32(r);
        for (int64_t i = 0; i < V; ++i) {
            T *p = d + i * xd;
            if constexpr (sizeof(T) == 1)
                _mm_storel_epi64((__m128i *)p, r[i]);
            else if (nt)
                _mm_stream_si128((__m128i *)p, r[i]);
            else
                _mm_storeu_si128((__m128i *)p, r[i]);
        }
    }
};
#endif

template <class T>
void transpose_scalar(const T *src, T *dst, Dim x, Dim y, int64_t x0, int64_t x1, int64_t y0, int64_t y1) {
    for (int64_t i = x0; i < x1; ++i) {
        const T *s = src + i;
        T *d = dst + i * x.d;
        for (int64_t j = y0; j < y1; ++j) d[j] = s[j * y.s];
    }
}

template <class T>
void prefetch_rows(const T *p, int64_t row_elems, int64_t stride, int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
        const char *a = (const char *)(p + j * stride), *e = a + row_elems * (int64_t)sizeof(T);
        for (a = (const char *)((uintptr_t)a & ~(uintptr_t)63); a < e; a += 64) __builtin_prefetch(a, 0, 3);
    }
}

// `next`: the source of the transpose to come after this one (same x and y), or null. Its lines are
// prefetched a band's share at a time: a flash source's K block read head by head is 16-64 rows of
// one head's D-vector, a jump each, and without this every head started with a round trip to memory
// per band (flash NHD -> cpu measured ~0.5x of memcpy).
template <class T>
void transpose_tiles(const T *src, T *dst, Dim x, Dim y, bool stream, const T *next) {
    // x is contiguous in src (x.s == 1), y in dst (y.d == 1).
    int64_t xv = 0, yv = 0;  // extents covered by full SIMD tiles
#if defined(__SSE2__)
    if constexpr (Tile<T>::kSimd) {
        constexpr int64_t V = Tile<T>::V;
        xv = x.n - x.n % V, yv = y.n - y.n % V;
        // Non-temporal 16-byte stores need 16-byte aligned destinations: every tile row starts at
        // dst + x * x.d + y0 with y0 a multiple of V, so the base and the row pitch decide.
        bool nt = stream && sizeof(T) > 1 && ((uintptr_t)dst & 15) == 0 && (x.d * (int64_t)sizeof(T)) % 16 == 0;
        // A band of V destination rows at a time, walked along y: each row's bytes are written in
        // order, so write-combining fills whole lines; the band's source (V elements of every y)
        // stays in L1 between tiles of consecutive bands.
        int64_t bands = xv / V;
        const T *seq = src + (y.n - 1) * y.s + x.n;  // one past the last source element
        int64_t span = seq - src;  // elements
        // Destination rows back to back (a K^T head: x.d == y.n) and source rows far apart (a flash
        // NHD head: y.s = heads x head_dim): a band of V x reads one 16 B piece of each of y.n source
        // rows, and y.n rows 2 KiB apart fall into two L1 sets, so at block 64 every band re-read its
        // lines from L2. Instead G bands (one 64 B source line across) go through an L1 buffer tile
        // by tile, y outer, and leave it as one contiguous range. Up to 16 rows fit the two sets'
        // 16 ways, and there the staging cost more than it saved (block 16: 0.81x -> 0.71x memcpy).
        constexpr int64_t G = 64 / (V * (int64_t)sizeof(T)) > 0 ? 64 / (V * (int64_t)sizeof(T)) : 1;
        constexpr int64_t kStage = 4096;  // bytes
        if (sizeof(T) > 1 && x.d == y.n && yv == y.n && G * V * y.n * (int64_t)sizeof(T) <= kStage &&
            y.s * (int64_t)sizeof(T) >= 1024 && y.n > 16) {
            alignas(64) T buf[kStage / sizeof(T)];
            int64_t groups = xv / (G * V), xg = groups * G * V;
            for (int64_t x0 = 0, b = 0; x0 < xg; x0 += G * V) {
                for (int64_t k = 0; k < G; ++k, ++b)
                    if (next)
                        prefetch_rows(next, x.n, y.s, y.n * b / bands, y.n * (b + 1) / bands);
                    else
                        prefetch_rows(seq + span * b / bands, span / bands + 1, 0, 0, 1);
                for (int64_t y0 = 0; y0 < yv; y0 += V)
                    for (int64_t k = 0; k < G; ++k)
                        Tile<T>::run(src + x0 + k * V + y0 * y.s, y.s, buf + k * V * y.n + y0, y.n, false);
                copy_bytes((char *)(dst + x0 * x.d), (const char *)buf, (size_t)(G * V * y.n) * sizeof(T), stream);
            }
            for (int64_t x0 = xg; x0 < xv; x0 += V)
                for (int64_t y0 = 0; y0 < yv; y0 += V) Tile<T>::run(src + x0 + y0 * y.s, y.s, dst + x0 * x.d + y0, x.d, nt);
            transpose_scalar(src, dst, x, y, xv, x.n, 0, y.n);
            return;
        }
        for (int64_t x0 = 0, b = 0; x0 < xv; x0 += V, ++b) {
            if (next)
                prefetch_rows(next, x.n, y.s, y.n * b / bands, y.n * (b + 1) / bands);
            else  // the last (or only) head of a copy: the source most likely goes on where this one ends
                prefetch_rows(seq + span * b / bands, span / bands + 1, 0, 0, 1);
            for (int64_t y0 = 0; y0 < yv; y0 += V) Tile<T>::run(src + x0 + y0 * y.s, y.s, dst + x0 * x.d + y0, x.d, nt);
            transpose_scalar(src, dst, x, y, x0, x0 + V, yv, y.n);
        }
    }
#endif
    (void)stream;
    transpose_scalar(src, dst, x, y, xv, x.n, 0, y.n);
}

// Copies with no dim contiguous on both sides: a transpose (K^T <-> row-major: one dim contiguous
// in src, another in dst) through tiles, anything else element by element.
template <class T>
void copy_elements(const T *src, T *dst, const Strided &c, bool stream) {
    Dim dims[kMaxDims];
    for (int i = 0; i < kMaxDims; ++i) dims[i] = {1, 0, 0};
    std::copy(c.dims, c.dims + c.nd, dims + (kMaxDims - c.nd));
    int xs = -1, yd = -1;
    for (int i = 0; i < kMaxDims; ++i) {
        if (dims[i].n > 1 && dims[i].s == 1 && xs < 0) xs = i;
        if (dims[i].n > 1 && dims[i].d == 1 && yd < 0) yd = i;
    }
    if (xs >= 0 && yd >= 0 && xs != yd) {
        Dim o[2] = {{1, 0, 0}, {1, 0, 0}};
        for (int i = 0, k = 0; i < kMaxDims; ++i)
            if (i != xs && i != yd) o[k++] = dims[i];
        for (int64_t i = 0; i < o[0].n; ++i)
            for (int64_t j = 0; j < o[1].n; ++j) {
                const T *next = j + 1 < o[1].n ? src + i * o[0].s + (j + 1) * o[1].s
                                : i + 1 < o[0].n ? src + (i + 1) * o[0].s : nullptr;
                transpose_tiles(src + i * o[0].s + j * o[1].s, dst + i * o[0].d + j * o[1].d, dims[xs], dims[yd],
                                stream, next);
            }
        return;
    }
    const Dim &a = dims[0], &b = dims[1], &m = dims[2], &in = dims[3];
    for (int64_t i = 0; i < a.n; ++i)
        for (int64_t j = 0; j < b.n; ++j)
            for (int64_t k = 0; k < m.n; ++k) {
                const T *s = src + i * a.s + j * b.s + k * m.s;
                T *d = dst + i * a.d + j * b.d + k * m.d;
                for (int64_t l = 0; l < in.n; ++l) d[l * in.d] = s[l * in.s];
            }
}

// Run a canonical copy: rows (innermost dim contiguous on both sides) go through the sink; other
// copies run directly, after the sink has drained so a thread's writes keep their order.
void emit(const Strided &c, int esize, RowSink &sink) {
    if (c.nd == 0) {
        sink.push(c.src, c.dst, esize);
        return;
    }
    const Dim &in = c.dims[c.nd - 1];
    if (in.s == 1 && in.d == 1) {
        Dim o[3] = {{1, 0, 0}, {1, 0, 0}, {1, 0, 0}};
        std::copy(c.dims, c.dims + c.nd - 1, o + (4 - c.nd));
        int64_t row = in.n * esize;
        for (int64_t i = 0; i < o[0].n; ++i)
            for (int64_t j = 0; j < o[1].n; ++j)
                for (int64_t k = 0; k < o[2].n; ++k) {
                    int64_t s = i * o[0].s + j * o[1].s + k * o[2].s, d = i * o[0].d + j * o[1].d + k * o[2].d;
                    sink.push(c.src + s * esize, c.dst + d * esize, row);
                }
        return;
    }
    sink.flush();
    switch (esize) {
        case 1: copy_elements((const uint8_t *)c.src, (uint8_t *)c.dst, c, sink.streaming()); break;
        case 2: copy_elements((const uint16_t *)c.src, (uint16_t *)c.dst, c, sink.streaming()); break;
        case 4: copy_elements((const uint32_t *)c.src, (uint32_t *)c.dst, c, sink.streaming()); break;
        default: copy_elements((const uint64_t *)c.src, (uint64_t *)c.dst, c, sink.streaming()); break;
    }
    int64_t last = 0;  // strides are non-negative: the last element read is the one at every dim's end
    for (int i = 0; i < c.nd; ++i) last += (c.dims[i].n - 1) * c.dims[i].s;
    sink.read_until(c.src + (last + 1) * esize);
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

struct Scatter {
    const char *src;
    char *dst;
    const pdx_geom *sg, *dg;
    int esize;

    const char *part_src(const pdx_part &a, const pdx_tok_run &r, int64_t h) const {
        return src + r.src_off + (a.base + r.src_tok * a.tok_stride + (r.src_head + h) * a.head_stride) * esize;
    }
    char *part_dst(const pdx_part &b, const pdx_tok_run &r, int64_t h) const {
        return dst + r.dst_off + (b.base + r.dst_tok * b.tok_stride + (r.dst_head + h) * b.head_stride) * esize;
    }

    // Part p, heads [h0, h1) of run r, canonical.
    Strided part_copy(const pdx_tok_run &r, int64_t p, int64_t h0, int64_t h1) const {
        const pdx_part &a = sg->parts[p], &b = dg->parts[p];
        Strided c{part_src(a, r, h0), part_dst(b, r, h0),
                  {{h1 - h0, a.head_stride, b.head_stride},
                   {r.ntok, a.tok_stride, b.tok_stride},
                   {sg->head_dim, a.dim_stride, b.dim_stride},
                   {1, 0, 0}},
                  3};
        canonicalize(c);  // never empty: callers pass ntok > 0 and h1 > h0
        return c;
    }

    // Heads [h0, h1) of run r, all parts, as one copy if the parts merge; false (nothing copied) if not.
    bool try_merged(const pdx_tok_run &r, int64_t h0, int64_t h1, RowSink &sink) const {
        Strided c[PDX_MAX_PARTS], m;
        int np = (int)sg->nparts;
        for (int p = 0; p < np; ++p) c[p] = part_copy(r, p, h0, h1);
        if (!merge_parts(c, np, esize, m)) return false;
        emit(m, esize, sink);
        return true;
    }

    void copy_part(const pdx_tok_run &r, int64_t p, int64_t h0, int64_t h1, RowSink &sink) const {
        emit(part_copy(r, p, h0, h1), esize, sink);
    }

    // Heads [h0, h1) of one run. Where K and V of a head are adjacent in the source (head_major),
    // a copy that does not merge whole goes head by head, so reads still advance in address order.
    void copy_heads(const pdx_tok_run &r, int64_t h0, int64_t h1, bool head_major, RowSink &sink) const {
        if (try_merged(r, h0, h1, sink)) return;
        if (!head_major) {
            for (int64_t p = 0; p < sg->nparts; ++p) copy_part(r, p, h0, h1, sink);
            return;
        }
        for (int64_t h = h0; h < h1; ++h)
            if (h1 - h0 == 1 || !try_merged(r, h, h + 1, sink))
                for (int64_t p = 0; p < sg->nparts; ++p) copy_part(r, p, h, h + 1, sink);
    }

    // Token-fastest parts (vLLM CPU's K^T) on both sides, a group of runs sharing one source block
    // (a big block split into small ones): row d of every run before row d+1, so the source block is
    // read in address order instead of in stripes (256 -> 32: 1.5x). Grouping runs that share a
    // destination block instead (small blocks merged) was measured slower with non-temporal stores
    // (0.75x vs 0.9x of memcpy for 64 -> 256: it reads several source streams at once), so it is not
    // done.
    void rows_grouped(int64_t p, const pdx_tok_run *runs, int64_t g0, int64_t g1, int64_t h0, int64_t h1,
                      RowSink &sink) const {
        const pdx_part &a = sg->parts[p], &b = dg->parts[p];
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t d = 0; d < sg->head_dim; ++d)
                for (int64_t g = g0; g < g1; ++g) {
                    const pdx_tok_run &r = runs[g];
                    sink.push(part_src(a, r, h) + d * a.dim_stride * esize, part_dst(b, r, h) + d * b.dim_stride * esize,
                              r.ntok * esize);
                }
    }
};

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
    int shards = clamp_shards(threads, total);
    bool stream = total >= g_stream_bytes.load();
    run_parallel(shards, shards > 1 ? cpus_available() : 1, [&](int i, int n) {
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
    int shards = clamp_shards(threads, total * unit_bytes);
    bool stream = total * unit_bytes >= g_stream_bytes.load();
    // Parts interleaved per head in the source (vLLM CPU: K^T then V of head 0, then head 1).
    bool head_major = src_geom->nparts > 1;
    for (int64_t p = 0; p < src_geom->nparts; ++p)
        head_major = head_major && src_geom->parts[p].head_stride == src_geom->parts[0].head_stride &&
                     src_geom->parts[p].base < src_geom->parts[0].head_stride;
    int row_parts = 0;  // parts whose tokens are contiguous on both sides
    for (int64_t p = 0; p < src_geom->nparts; ++p)
        if (src_geom->parts[p].tok_stride == 1 && dst_geom->parts[p].tok_stride == 1) row_parts |= 1 << p;
    const Scatter sc{(const char *)src, (char *)dst, src_geom, dst_geom, elem_size};
    run_parallel(shards, shards > 1 ? cpus_available() : 1, [&](int t, int n) {
        RowSink sink(stream);
        int64_t lo = total * t / n, hi = total * (t + 1) / n;
        // A shard owns the (run, head) units whose first element falls in [lo, hi).
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
            // Extend to a group of following runs this shard owns whole (see rows_grouped).
            int64_t g1 = r + 1;
            if (row_parts && h0 == 0 && h1 == run.nheads)
                while (g1 < nruns && g1 - r < kMaxGroup && same_group(run, runs[g1]) &&
                       prefix[g1] + (runs[g1].nheads - 1) * runs[g1].ntok < hi)
                    ++g1;
            if (g1 - r == 1) {
                if (h1 > h0) sc.copy_heads(run, h0, h1, head_major, sink);
                r = g1;
                continue;
            }
            int64_t nh = run.nheads;
            int64_t hstep = head_major ? 1 : nh;
            for (int64_t hb = 0; hb < nh; hb += hstep)
                for (int64_t p = 0; p < src_geom->nparts; ++p) {
                    if (row_parts >> p & 1)
                        sc.rows_grouped(p, runs, r, g1, hb, hb + hstep, sink);
                    else
                        for (int64_t g = r; g < g1; ++g) sc.copy_part(runs[g], p, hb, hb + hstep, sink);
                }
            r = g1;
        }
        sink.flush();
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
