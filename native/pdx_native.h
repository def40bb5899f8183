/* pdxfer native kernels: C ABI shared by the CPU (pdx_cpu.cpp) and CUDA (pdx_cuda.cu) builds.
 *
 * Two operations, both over batches ("run lists") so that one call moves a whole transfer:
 *
 *   copy_runs       dst[dst_off : dst_off+len] = src[src_off : src_off+len] for every run.
 *   scatter_tokens  copy a token range and a head slice of KV blocks between two block
 *                   geometries (block size, NHD/HND/vLLM-CPU interior, K/V parts). Block-size
 *                   conversion, NHD<->HND, CPU<->flash and TP head slicing are all this one op.
 *
 * Offsets in runs are bytes relative to the src/dst base pointers. Geometry strides are in
 * elements. The CPU entry points check every run against src_nbytes/dst_nbytes before writing
 * anything, so a bad run list never leaves a half-written destination.
 */
#ifndef PDX_NATIVE_H
#define PDX_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bump whenever a struct below or a signature changes: the loader refuses other versions. */
#define PDX_ABI_VERSION 1
#define PDX_MAX_PARTS 4

/* Return codes. */
#define PDX_OK 0
#define PDX_EARG 1     /* bad argument (null pointer, element size, geometry); *bad = -1 */
#define PDX_ERANGE 2   /* run *bad reads or writes outside its buffer or block */
#define PDX_ECUDA 3    /* CUDA launch or API error (CUDA build only) */
#define PDX_EINTERNAL 4 /* out of memory for the run bookkeeping; nothing was written */

typedef struct {
    int64_t src_off; /* bytes */
    int64_t dst_off; /* bytes */
    int64_t len;     /* bytes; 0 is a no-op */
} pdx_run;

/* One part of a block (K, V, or K and V together), as element strides from the block start.
 * Element (token t, head h, dim d) of the part lives at base + t*tok + h*head + d*dim. */
typedef struct {
    int64_t base;
    int64_t tok_stride;
    int64_t head_stride;
    int64_t dim_stride;
} pdx_part;

/* The interior of one KV block. Examples (B = block_tokens, H = heads, D = head_dim):
 *   NHD [B,H,D]            1 part  {0, H*D, D, 1}
 *   HND [H,B,D]            1 part  {0, D, B*D, 1}
 *   vLLM CPU [H, 2B, D]    2 parts K^T {0, 1, 2*B*D, B}, V {B*D, D, 2*B*D, 1}
 *   flash [2, NB, B, H, D] 2 parts K {0, H*D, D, 1}, V {NB*B*H*D, H*D, D, 1} (V one K-tensor away)
 */
typedef struct {
    int64_t block_tokens;
    int64_t heads;
    int64_t head_dim;
    int64_t nparts;
    pdx_part parts[PDX_MAX_PARTS];
} pdx_geom;

/* Copy tokens [src_tok, src_tok+ntok) and heads [src_head, src_head+nheads) of the block at
 * src_off into tokens [dst_tok, ...) and heads [dst_head, ...) of the block at dst_off, for
 * every part (src part i -> dst part i). ntok == 0 or nheads == 0 is a no-op. */
typedef struct {
    int64_t src_off;
    int64_t dst_off;
    int64_t src_tok;
    int64_t dst_tok;
    int64_t ntok;
    int64_t src_head;
    int64_t dst_head;
    int64_t nheads;
} pdx_tok_run;

/* CPU (pdx_cpu.cpp). threads <= 0 means one thread; the work is cut into that many shards (fewer for
 * small calls) run on at most as many OS threads as CPUs in the caller's affinity mask. On failure
 * *bad (if not null) names the run. */
int pdx_abi_version(void);
/* Process-wide tuning, for tests and benchmarks (the defaults suit real transfers); values <= 0
 * keep the current setting, old (if not null) receives the previous two values.
 *   min_bytes_per_thread  fewer bytes per thread than this use fewer threads (1 MiB)
 *   stream_min_bytes      calls moving at least this many bytes use non-temporal stores (8 MiB) */
void pdx_set_tuning(int64_t min_bytes_per_thread, int64_t stream_min_bytes, int64_t *old);
int pdx_copy_runs(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes,
                  const pdx_run *runs, int64_t nruns, int threads, int64_t *bad);
int pdx_scatter_tokens(const void *src, int64_t src_nbytes, void *dst, int64_t dst_nbytes,
                       const pdx_geom *src_geom, const pdx_geom *dst_geom, int elem_size,
                       const pdx_tok_run *runs, int64_t nruns, int threads, int64_t *bad);

/* CUDA twins (pdx_cuda.cu): same meaning; src/dst are device pointers, runs must be in device
 * memory (the caller uploads them; they are read by the kernel), stream is a cudaStream_t (null =
 * default stream). They enqueue and return: no bounds checks on device (validate on the host
 * first, as pdxfer.native does), errors are launch errors only. */
int pdx_cuda_abi_version(void);
int pdx_cuda_copy_runs(const void *src, void *dst, const pdx_run *runs_dev, int64_t nruns,
                       void *stream);
int pdx_cuda_scatter_tokens(const void *src, void *dst, pdx_geom src_geom, pdx_geom dst_geom,
                            int elem_size, const pdx_tok_run *runs_dev, int64_t nruns,
                            void *stream);

#ifdef __cplusplus
}
#endif
#endif
