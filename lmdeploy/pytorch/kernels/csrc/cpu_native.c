/* Native CPU kernels for float32 decode steps; why and what each one does: the docstring of
 * lmdeploy/pytorch/kernels/cpu_native.py. Prototypes and the binding rule: cpu_native.h.
 * Built when a CPU engine starts with -O3 -march=native -fopenmp -Wall -Wextra (see _FLAGS). */
#include "cpu_native.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load16(const float* p) { v16 v; memcpy(&v, p, sizeof v); return v; }

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LM_HAVE_SHUFFLE 1
#endif
#endif

static inline float hsum16(v16 v) {
#ifdef LM_HAVE_SHUFFLE   /* halving tree in vector registers (GCC >= 12, clang) */
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  v8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  a += b;
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
#else                    /* the same tree on the elements */
  float t[16];
  memcpy(t, &v, sizeof t);
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; i++) t[i] += t[i + w];
  return t[0];
#endif
}

enum { NB = 4, MB = 4 };   /* weight rows x input rows per register block */

#ifdef __AVX512F__
/* y[j * ldy + i] = sum_k x[j * ldx + k] * w[i * ldw + k] for j < mb, i < nb (nb, mb <= 4); always
   inlined with constant nb and mb (see dot_block), so the accumulators stay in registers */
static inline __attribute__((always_inline)) void dot_block_nm(const float* x, ptrdiff_t ldx, const float* w,
                                                               ptrdiff_t ldw, int K, float* y, ptrdiff_t ldy,
                                                               const int nb, const int mb) {
  v16 acc[NB][MB];
  for (int i = 0; i < nb; i++)
    for (int j = 0; j < mb; j++) acc[i][j] = (v16){0};
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    v16 wv[NB], xv[MB];
    for (int i = 0; i < nb; i++) wv[i] = load16(w + i * ldw + k);
    for (int j = 0; j < mb; j++) xv[j] = load16(x + j * ldx + k);
    for (int i = 0; i < nb; i++)
      for (int j = 0; j < mb; j++) acc[i][j] += wv[i] * xv[j];
  }
  for (int i = 0; i < nb; i++)
    for (int j = 0; j < mb; j++) {
      float s = hsum16(acc[i][j]);
      for (int kk = k; kk < K; kk++) s += w[i * ldw + kk] * x[j * ldx + kk];
      y[j * ldy + i] = s;
    }
}
#else
/* Without AVX-512 a 16-float vector is no register, and GCC keeps arrays of them in memory: every
   multiply-add of the v16 form above became a load and a store on the stack (AMD EPYC with AVX2,
   2 threads: 10-13 GB/s for one input row, 0.7-1.3 GB/s for 16). Here each v16 accumulator is two
   8-float halves (one AVX2 register each), lane for lane the same sums in the same order, and
   hsum_halves adds them as hsum16 does, so y is bit for bit what the v16 form gives. Weight
   vectors are used as soon as they are loaded. dot_block_nm takes up to NB weight rows x MB input
   rows (the register budget: NB x 1 or 1 x MB accumulator pairs), but matmul_rows_nowait gives it
   one weight row per block and up to MB input rows; same host: 5-6 GB/s for 16 input rows.
   A block streams its single weight row, and with one row in flight there are too few misses for
   the hardware prefetcher to keep up: the block prefetches a cache line per 16 columns, ahead in
   the weights by
   - GEMV_AHEAD floats (512 B) in a block of one input row (a product of one row, or the last
     block of 5, 9, ... rows, whose weight row the earlier blocks have just read). Against the
     former blocks of 8 weight rows without a prefetch, one input row, same host, 2 threads,
     weights streamed from memory: a C sweep (huge pages, medians over 21 interleaved rounds)
     read [1024, 512] 22.5-25.3 GB/s against 17.8-20.0 and [3072, 1024] 22.4-25.3 against
     21.7-23.2, with 256-768 B ahead alike and 1 KiB slower; benchmark/ab_native_product.py
     (15 rounds) gave [1024, 512] 1.25x, [1024, 1024] 1.17x, [3072, 1024] 1.17x, [1024, 4096]
     1.08x. 8 weight rows with a prefetch in every row were slower than without (16.1 -> 13.5
     GB/s). Short rows gain most: an 8-row block streams 8 rows of 2 KiB at once, each too short
     for the hardware prefetcher to learn before it ends.
   - PREFETCH_AHEAD floats (1 KiB) in a block of 2-4 input rows, whose multiply-adds run longer per
     line (benchmark/ab_native_product.py against the library without it, medians: 2-4 input rows
     1.15-1.39x, 8 rows 1.00-1.14x, 16 and 24 rows 0.98-1.05x; 512 B there read 0.88-0.98x of
     1 KiB).
   A prefetch never faults, so one past the last row is harmless; it changes no result, and the
   blocking changes none either (each y element is one accumulator pair over K in order). */
enum { GEMV_AHEAD = 128, PREFETCH_AHEAD = 256 };

static inline v8 load8(const float* p) { v8 v; memcpy(&v, p, sizeof v); return v; }

/* hsum16 of the vector whose lanes 0-7 are lo and 8-15 are hi */
static inline float hsum_halves(v8 lo, v8 hi) {
  v8 a = lo + hi;
#ifdef LM_HAVE_SHUFFLE
  v4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
#else
  float t[8];
  memcpy(t, &a, sizeof t);
  for (int w = 4; w >= 1; w /= 2)
    for (int i = 0; i < w; i++) t[i] += t[i + w];
  return t[0];
#endif
}

/* y[j * ldy + i] = sum_k x[j * ldx + k] * w[i * ldw + k] for j < mb <= MB, i < nb <= NB;
   always inlined with constant nb and mb (see dot_block), so the accumulators stay in registers */
static inline __attribute__((always_inline)) void dot_block_nm(const float* x, ptrdiff_t ldx, const float* w,
                                                               ptrdiff_t ldw, int K, float* y, ptrdiff_t ldy,
                                                               const int nb, const int mb) {
  v8 acc[NB][MB][2];
  for (int i = 0; i < nb; i++)
    for (int j = 0; j < mb; j++) acc[i][j][0] = acc[i][j][1] = (v8){0};
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    if (nb == 1)   /* as an address, not a pointer: it may lie past the weights */
      __builtin_prefetch((const void*)((uintptr_t)(w + k) + (mb == 1 ? GEMV_AHEAD : PREFETCH_AHEAD) * sizeof(float)),
                         0, 0);
    for (int h = 0; h < 2; h++) {
      v8 xv[MB];
      for (int j = 0; j < mb; j++) xv[j] = load8(x + j * ldx + k + 8 * h);
      for (int i = 0; i < nb; i++) {
        v8 wv = load8(w + i * ldw + k + 8 * h);
        for (int j = 0; j < mb; j++) acc[i][j][h] += wv * xv[j];
      }
    }
  }
  for (int i = 0; i < nb; i++)
    for (int j = 0; j < mb; j++) {
      float s = hsum_halves(acc[i][j][0], acc[i][j][1]);
      for (int kk = k; kk < K; kk++) s += w[i * ldw + kk] * x[j * ldx + kk];
      y[j * ldy + i] = s;
    }
}
#endif

#define DOT_CASE(n, m) case (n) * 8 + (m): dot_block_nm(x, ldx, w, ldw, K, y, ldy, n, m); break;
#define DOT_ROW(n) DOT_CASE(n, 1) DOT_CASE(n, 2) DOT_CASE(n, 3) DOT_CASE(n, 4)

/* dot_block_nm for 1 <= nb, mb <= 4, one specialised body per shape */
static void dot_block(const float* x, ptrdiff_t ldx, int mb, const float* w, ptrdiff_t ldw, int nb, int K,
                      float* y, ptrdiff_t ldy) {
  switch (nb * 8 + mb) {
    DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4)
  }
}

#ifdef __AVX512F__
/* With AVX-512's 32 vector registers the weight rows of a block are widened, each weight vector
   used as soon as it is loaded, so that more weight-row streams are in flight: WIDE_NB1 rows for
   one input row, WIDE_NB23 for two or three, WIDE_NB for four and more (blocks of 4 input rows).
   On the AMD EPYC benchmark host (one thread, 480 MB of 3072 x 1024 float32 weights, GB/s):
       input rows        1          2          3          4        8       16
       4 weight rows  17.6-18.5  15.5-16.7  13.5-14.7   12.3     8.3-8.7  3.9-5.1
       6                                     17.4-18.1   16.9     12.2     7.5
       8              20.0-21.1  20.0-21.3  19.0-19.9   17.6     11.6     7.0
       16             22.0-23.4
   (a software prefetch gained nothing). Live vectors: 16 + 1, 16 + 3, 24 + 4, 24 + 5. Every y
   element is summed exactly as in dot_block_nm (one accumulator over K in order, the same halving
   tree, the same tail), so results do not depend on the blocking nor on the input row count. */
enum { WIDE_NB1 = 16, WIDE_NB23 = 8, WIDE_NB = 6 };

static inline __attribute__((always_inline)) void dot_wide(const float* x, ptrdiff_t ldx, const float* w,
                                                           ptrdiff_t ldw, int K, float* y, ptrdiff_t ldy,
                                                           const int nb, const int mb) {
  v16 acc[WIDE_NB1][MB];
  for (int i = 0; i < nb; i++)
    for (int j = 0; j < mb; j++) acc[i][j] = (v16){0};
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    v16 xv[MB];
    for (int j = 0; j < mb; j++) xv[j] = load16(x + j * ldx + k);
    for (int i = 0; i < nb; i++) {
      v16 wv = load16(w + i * ldw + k);
      for (int j = 0; j < mb; j++) acc[i][j] += wv * xv[j];
    }
  }
  for (int i = 0; i < nb; i++)
    for (int j = 0; j < mb; j++) {
      float s = hsum16(acc[i][j]);
      for (int kk = k; kk < K; kk++) s += w[i * ldw + kk] * x[j * ldx + kk];
      y[j * ldy + i] = s;
    }
}

/* y rows [0, M) x weight rows [0, nb) (nb = the width for M: WIDE_NB1, WIDE_NB23 or WIDE_NB), one
   specialised body per shape */
static void dot_wide_rows(const float* x, ptrdiff_t ldx, int M, const float* w, ptrdiff_t ldw, int K, float* y,
                          ptrdiff_t ldy) {
  if (M == 1) {
    dot_wide(x, ldx, w, ldw, K, y, ldy, WIDE_NB1, 1);
  } else if (M == 2) {
    dot_wide(x, ldx, w, ldw, K, y, ldy, WIDE_NB23, 2);
  } else if (M == 3) {
    dot_wide(x, ldx, w, ldw, K, y, ldy, WIDE_NB23, 3);
  } else {
    for (int m0 = 0; m0 < M; m0 += MB) {
      const float* xb = x + m0 * ldx;
      float* yb = y + m0 * ldy;
      switch (M - m0 < MB ? M - m0 : MB) {
        case 1: dot_wide(xb, ldx, w, ldw, K, yb, ldy, WIDE_NB, 1); break;
        case 2: dot_wide(xb, ldx, w, ldw, K, yb, ldy, WIDE_NB, 2); break;
        case 3: dot_wide(xb, ldx, w, ldw, K, yb, ldy, WIDE_NB, 3); break;
        default: dot_wide(xb, ldx, w, ldw, K, yb, ldy, WIDE_NB, 4); break;
      }
    }
  }
}
#endif

/* inside a parallel region: y [M, N] = x [M, K] w[N, K]^T, weight rows split over the threads,
   no barrier at the end */
static void matmul_rows_nowait(const float* x, int M, int K, ptrdiff_t ldx, const float* w, int N, ptrdiff_t ldw,
                               float* y, ptrdiff_t ldy) {
#ifdef __AVX512F__
  const int wide = M == 1 ? WIDE_NB1 : M <= 3 ? WIDE_NB23 : WIDE_NB;
#else
  const int wide = 1;    /* one weight row for blocks of up to MB input rows */
#endif
  #pragma omp for schedule(static) nowait
  for (int n0 = 0; n0 < N; n0 += wide) {
    const float* wb = w + n0 * ldw;
    float* yb = y + n0;
#ifdef __AVX512F__
    if (N - n0 >= wide) {
      dot_wide_rows(x, ldx, M, wb, ldw, K, yb, ldy);
      continue;
    }
#else
    if (M == 1) {
      dot_block_nm(x, ldx, wb, ldw, K, yb, ldy, 1, 1);
      continue;
    }
#endif
    for (int n1 = 0; n1 < N - n0 && n1 < wide; n1 += NB) {   /* blocks of NB (the last one partial) */
      int nb = N - n0 - n1 < NB ? N - n0 - n1 : NB;
      if (nb > wide - n1) nb = wide - n1;
      for (int m0 = 0; m0 < M; m0 += MB) {
        int mb = M - m0 < MB ? M - m0 : MB;
        dot_block(x + m0 * ldx, ldx, mb, wb + n1 * ldw, ldw, nb, K, yb + m0 * ldy + n1, ldy);
      }
    }
  }
}

void lm_matmul_rows(const float* x, int M, int K, int64_t ldx, const float* w, int N, int64_t ldw,
                    float* y, int64_t ldy, int threads) {
  #pragma omp parallel num_threads(threads)
  matmul_rows_nowait(x, M, K, ldx, w, N, ldw, y, ldy);
}

/* The broadcast form of y [M, N] = x [M, K] w [N, K]^T for 25-64 input rows, built without
   AVX-512 only (lm_bcast_rows_max; an AVX-512 build returns 0 and the rows keep MKL). x is first
   transposed into xT [K, Mp] (Mp = M rounded up to BC_MR, padding rows zero), so that one input
   column of BC_MR rows is two vector loads; a block of BC_NR weight rows multiplies it by each
   row's broadcast scalar w[n][k]: 12 accumulators, 2 vector loads and 6 broadcasts per 12
   multiply-adds, against the dot form's 5 vector loads per 4 (whose 16 input rows also come
   back from L2 once per weight row). Each y element is summed one k after another within a chunk
   of BC_KC columns, and the chunk sums are added to its total in chunk order: the order does not
   depend on M, N, the blocking or the threads, so a row of a 40-row product equals the same
   row of a 25-row one bit for bit (it differs from the dot form of 1-24 rows and from MKL in the
   last bits, as those differ from each other). Chunking keeps the rounding error near the dot
   form's (one float32 sum over 1024 terms would be about 3x MKL's).
   AMD EPYC (AVX2) benchmark host, 2 threads, weights streamed from memory, interleaved against
   MKL's transposed product (W x^T)^T, GFLOP/s at 32 / 48 / 64 rows: [3072, 1024] 62 / 62 / 61
   against 45 / 50 / 53; [1024, 1024] 54 / 51 / 35 against 43 / 49 / 34; [1024, 512] 45 / 50 / 36
   against 36 / 45 / 30 (at 128 rows MKL's own packing catches up). */
enum { BC_MR = 16, BC_NR = 6, BC_KC = 64, BC_ROWS_MAX = 64 };

#ifndef __AVX512F__
/* tot [nr][BC_MR] = the chunked sums of xT columns [0, BC_MR) (row stride Mp) times weight rows
   [0, nr) over k in [0, K); always inlined with a constant nr */
static inline __attribute__((always_inline)) void bcast_block(const float* xT, ptrdiff_t Mp, const float* w,
                                                              ptrdiff_t ldw, int K, float* tot, const int nr) {
  for (int i = 0; i < nr * BC_MR; i++) tot[i] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += BC_KC) {
    const int k1 = K - k0 < BC_KC ? K : k0 + BC_KC;
    v8 acc[BC_NR][2];
    for (int r = 0; r < nr; r++) acc[r][0] = acc[r][1] = (v8){0};
    for (int k = k0; k < k1; k++) {
      const v8 x0 = load8(xT + k * Mp), x1 = load8(xT + k * Mp + 8);
      for (int r = 0; r < nr; r++) {
        const float b = w[r * ldw + k];
        acc[r][0] += x0 * b;
        acc[r][1] += x1 * b;
      }
    }
    for (int r = 0; r < nr; r++) {
      v8 t0 = load8(tot + r * BC_MR) + acc[r][0], t1 = load8(tot + r * BC_MR + 8) + acc[r][1];
      memcpy(tot + r * BC_MR, &t0, sizeof t0);
      memcpy(tot + r * BC_MR + 8, &t1, sizeof t1);
    }
  }
}

#endif

int lm_bcast_rows_max(void) {
#ifdef __AVX512F__
  return 0;
#else
  return BC_ROWS_MAX;
#endif
}

int lm_matmul_bcast(const float* x, int M, int K, int64_t ldx, const float* w, int N, int64_t ldw, float* y,
                    int64_t ldy, int threads) {
#ifdef __AVX512F__
  (void)x, (void)M, (void)K, (void)ldx, (void)w, (void)N, (void)ldw, (void)y, (void)ldy, (void)threads;
  return -1;
#else
  if (M < 1 || M > BC_ROWS_MAX || K < 1 || N < 1) return -1;
  const int Mp = (M + BC_MR - 1) / BC_MR * BC_MR;
  float* xT = malloc((size_t)K * Mp * sizeof(float));
  if (!xT) return -1;
  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(static)
    for (int k = 0; k < K; k++)
      for (int m = 0; m < Mp; m++) xT[(size_t)k * Mp + m] = m < M ? x[m * ldx + k] : 0.0f;
    float tot[BC_NR * BC_MR];
    #pragma omp for schedule(static)
    for (int n0 = 0; n0 < N; n0 += BC_NR) {
      const int nr = N - n0 < BC_NR ? N - n0 : BC_NR;
      const float* wb = w + n0 * ldw;
      for (int m0 = 0; m0 < Mp; m0 += BC_MR) {
        switch (nr) {
          case 1: bcast_block(xT + m0, Mp, wb, ldw, K, tot, 1); break;
          case 2: bcast_block(xT + m0, Mp, wb, ldw, K, tot, 2); break;
          case 3: bcast_block(xT + m0, Mp, wb, ldw, K, tot, 3); break;
          case 4: bcast_block(xT + m0, Mp, wb, ldw, K, tot, 4); break;
          case 5: bcast_block(xT + m0, Mp, wb, ldw, K, tot, 5); break;
          default: bcast_block(xT + m0, Mp, wb, ldw, K, tot, BC_NR); break;
        }
        for (int j = 0; j < BC_MR && m0 + j < M; j++)
          for (int r = 0; r < nr; r++) y[(m0 + j) * ldy + n0 + r] = tot[r * BC_MR + j];
      }
    }
  }
  free(xT);
  return 0;
#endif
}

/* The stable counting sort of S (token, slot) pairs on their expert that both MoE layers below
   run: offsets [E + 1] gets each expert's first row (offsets[E] = S), pos [S] the row of pair p
   in its expert's run, in pair order within a run. Returns -1 (nothing sorted) on an expert id
   outside [0, E). */
static int expert_sort(const int64_t* index, int S, int E, int64_t* offsets, int64_t* pos) {
  for (int e = 0; e <= E; e++) offsets[e] = 0;
  for (int p = 0; p < S; p++) {
    if (index[p] < 0 || index[p] >= E) return -1;
    offsets[index[p] + 1]++;
  }
  for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
  int64_t fill[E];
  for (int e = 0; e < E; e++) fill[e] = offsets[e];
  for (int p = 0; p < S; p++) pos[p] = fill[index[p]]++;
  return 0;
}

/* inside a parallel region: the (token, slot) rows of x [T, H] placed at their sorted positions
   pos in xs [S, H] (S = T * topk), then each expert's rows (offsets from expert_sort) through its
   first product w [E, F, H] into h [S, F]; no barrier at the end */
static void experts_first_product(const float* x, int H, int topk, int S, const int64_t* pos, float* xs,
                                  const int64_t* offsets, int E, const float* w, int F, float* h) {
  #pragma omp for schedule(static)
  for (int p = 0; p < S; p++) memcpy(xs + pos[p] * H, x + (ptrdiff_t)(p / topk) * H, sizeof(float) * H);
  for (int e = 0; e < E; e++) {
    int rows = (int)(offsets[e + 1] - offsets[e]);
    if (rows)
      matmul_rows_nowait(xs + offsets[e] * H, rows, H, H, w + (ptrdiff_t)e * F * H, F, H, h + offsets[e] * F, F);
  }
}

/* inside a parallel region, after a barrier: out[t] (T rows of H) = weights[t, 0] * y_0 +
   weights[t, 1] * y_1 + ... over the slots in order, y_j the expert output row pos[t * topk + j]
   of ys (S = T * topk rows of H), which it scales in place. The weighting and the sum are two
   loops because a product and a sum in one statement may be contracted into one fused
   multiply-add (-ffp-contract), which rounds differently from torch's product and then sum. */
static void experts_weighted_sum(int T, int H, int topk, const int64_t* pos, const float* weights, float* ys,
                                 float* out) {
  int S = T * topk;
  #pragma omp for schedule(static)
  for (int p = 0; p < S; p++) {
    float* y = ys + pos[p] * H;
    float w = weights[p];
    for (int c = 0; c < H; c++) y[c] *= w;
  }
  #pragma omp for schedule(static)
  for (int t = 0; t < T; t++) {
    float* o = out + (ptrdiff_t)t * H;
    memcpy(o, ys + pos[(ptrdiff_t)t * topk] * H, sizeof(float) * H);
    for (int j = 1; j < topk; j++) {
      const float* y = ys + pos[(ptrdiff_t)t * topk + j] * H;
      for (int c = 0; c < H; c++) o[c] += y[c];
    }
  }
}

/* The SwiGLU activations of an expert layer (act of lm_limited_swiglu_experts) */
enum { SWIGLU_PLAIN = 0, SWIGLU_CLIPPED = 1, SWIGLU_CLAMPED = 2 };

/* The body of both SwiGLU expert layers below: act SWIGLU_PLAIN keeps lm_swiglu_experts's fused
   weighted sum (its results unchanged), the limited ones sum as experts_weighted_sum. */
static int swiglu_experts(const float* x, int T, int H, int I, int topk, const int64_t* index, const float* weights,
                          const float* gate_up, const float* down, int E, int act, float limit, int64_t* pos,
                          float* xs, float* h, float* ys, float* out, int threads) {
  int S = T * topk;
  int64_t offsets[E + 1];
  if (expert_sort(index, S, E, offsets, pos)) return -1;
  ptrdiff_t H2 = 2 * (ptrdiff_t)I;
  #pragma omp parallel num_threads(threads)
  {
    experts_first_product(x, H, topk, S, pos, xs, offsets, E, gate_up, (int)H2, h);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int s = 0; s < S; s++) {
      float* row = h + s * H2;
      if (act == SWIGLU_PLAIN) {
        for (int i = 0; i < I; i++) {
          float g = row[i];
          row[i] = g / (1.0f + expf(-g)) * row[I + i];
        }
      } else {
        /* torch's clamp(max=limit) and clamp(-limit, limit) (max, then min), written so a NaN
           stays NaN as in torch (fminf would return the limit) */
        for (int i = 0; i < I; i++) {
          float g = row[i], u = row[I + i];
          if (act == SWIGLU_CLAMPED) g = g > limit ? limit : g;
          float a = g / (1.0f + expf(-g));
          if (act == SWIGLU_CLIPPED) a = a > limit ? limit : a;
          u = u < -limit ? -limit : u;
          u = u > limit ? limit : u;
          row[i] = a * u;
        }
      }
    }
    for (int e = 0; e < E; e++) {
      int rows = (int)(offsets[e + 1] - offsets[e]);
      if (rows)
        matmul_rows_nowait(h + offsets[e] * H2, rows, I, H2, down + (ptrdiff_t)e * H * I, H, I,
                           ys + offsets[e] * H, H);
    }
    #pragma omp barrier
    if (act != SWIGLU_PLAIN) {
      experts_weighted_sum(T, H, topk, pos, weights, ys, out);
    } else {
      #pragma omp for schedule(static)
      for (int t = 0; t < T; t++) {
        float* o = out + (ptrdiff_t)t * H;
        const float* first = ys + pos[(ptrdiff_t)t * topk] * H;
        float w0 = weights[(ptrdiff_t)t * topk];
        for (int c = 0; c < H; c++) o[c] = first[c] * w0;
        for (int j = 1; j < topk; j++) {
          const float* y = ys + pos[(ptrdiff_t)t * topk + j] * H;
          float wj = weights[(ptrdiff_t)t * topk + j];
          for (int c = 0; c < H; c++) o[c] += y[c] * wj;
        }
      }
    }
  }
  return 0;
}

/* A MoE layer of SwiGLU experts for T tokens, each routed to topk experts.
   x [T, H]; index, weights [T, topk]; gate_up [E, 2I, H] (gate rows first); down [E, H, I];
   scratch: pos [T * topk] int64, xs [S, H], h [S, 2I], ys [S, H] with S = T * topk; out [T, H].
   Pairs (token, slot) are placed by a stable counting sort on the expert; out[t] is the sum over
   the slots in order of weights[t, j] * expert_j(x[t]). Returns -1 on an expert id out of range. */
int lm_swiglu_experts(const float* x, int T, int H, int I, int topk, const int64_t* index, const float* weights,
                      const float* gate_up, const float* down, int E, int64_t* pos, float* xs, float* h, float* ys,
                      float* out, int threads) {
  return swiglu_experts(x, T, H, I, topk, index, weights, gate_up, down, E, SWIGLU_PLAIN, 0.0f, pos, xs, h, ys, out,
                        threads);
}

/* lm_swiglu_experts with a limited activation (Ling 3, GLM-5.3-Flash): act 1 (clipped) is
   min(silu(gate), limit) * clamp(up, -limit, limit), act 2 (clamped) is
   silu(min(gate, limit)) * clamp(up, -limit, limit), act 0 plain silu(gate) * up; silu(g) is
   g / (1 + expf(-g)). out[t] = weights[t, 0] * y_0 + weights[t, 1] * y_1 + ... summed over the
   slots in order, each product rounded before its sum (the torch loop's order, bit for bit).
   Returns -1 (nothing computed) on an expert id out of range or an act outside [0, 2]. */
int lm_limited_swiglu_experts(const float* x, int T, int H, int I, int topk, const int64_t* index,
                              const float* weights, const float* gate_up, const float* down, int E, int act,
                              float limit, int64_t* pos, float* xs, float* h, float* ys, float* out, int threads) {
  if (act < SWIGLU_PLAIN || act > SWIGLU_CLAMPED) return -1;
  /* act 0 here still sums as experts_weighted_sum: the limited layers' loop order */
  if (act == SWIGLU_PLAIN) {
    act = SWIGLU_CLIPPED;
    limit = INFINITY;
  }
  return swiglu_experts(x, T, H, I, topk, index, weights, gate_up, down, E, act, limit, pos, xs, h, ys, out, threads);
}

/* The routing and shared-expert activation of a Qwen-MoE layer (softmax top-k router plus a
   sigmoid-gated SwiGLU shared expert) from one product per token: row t of proj (row stride ld)
   holds [router logits (E) | shared-expert gate (1) | shared gate (I) | shared up (I)].
   index, weights [T, k]: the k largest of softmax(logits) in descending order (ties: the lower
   id), renormalised to sum 1 when norm; act [T, I] = sigmoid(shared gate) * silu(gate) * up (the
   gate scales the shared expert's down-projection input: the projection is linear). */
void lm_moe_route(const float* proj, int64_t ld, int T, int E, int k, int norm, int I, int64_t* index,
                  float* weights, float* act, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
  for (int t = 0; t < T; t++) {
    const float* row = proj + (ptrdiff_t)t * ld;
    float e[E];
    unsigned char taken[E];
    float m = row[0], sum = 0.0f, kept = 0.0f;
    for (int i = 1; i < E; i++) m = row[i] > m ? row[i] : m;
    for (int i = 0; i < E; i++) {
      e[i] = expf(row[i] - m);
      sum += e[i];
      taken[i] = 0;
    }
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int i = 0; i < E; i++)
        if (!taken[i] && (best < 0 || e[i] > e[best])) best = i;
      taken[best] = 1;
      index[(ptrdiff_t)t * k + j] = best;
      weights[(ptrdiff_t)t * k + j] = e[best] / sum;
      kept += e[best] / sum;
    }
    if (norm)
      for (int j = 0; j < k; j++) weights[(ptrdiff_t)t * k + j] /= kept;
    float sg = 1.0f / (1.0f + expf(-row[E]));
    const float* g = row + E + 1;
    const float* u = g + I;
    float* a = act + (ptrdiff_t)t * I;
    for (int c = 0; c < I; c++) a[c] = sg * (g[c] / (1.0f + expf(-g[c]))) * u[c];
  }
}

/* One decode token of the delta rule with a gated decay for N sequences x H heads, the state
   updated in place: the gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks",
   ICLR 2025, eq. 10: one decay per head) and Kimi Delta Attention (Kimi Team, "Kimi Linear",
   2025: one decay per key channel) are the same step. Per (sequence, head), with a [dk] the
   decay multipliers (exp of the log decays; a per-head decay repeats one value) and S [dk, dv]:

       S' = diag(a) S + k delta^T,   delta = beta (v - (diag(a) S)^T k),   o = S'^T q
          = (diag(a) S)^T q + (q . k) delta

   so S is read twice (both products in one pass, the decay folded into k and q there) and
   written once, the update pass finding one head's dk x dv block in cache. kq [N, H, 2, dk]:
   the key, then the scaled query; v, out [N, H, dv]; decay [N, H, dk] when per_channel, else
   [N, H]; beta [N, H]; state element (n, h, i, c) at n * s_slot + h * s_head + i * s_row + c. */
/* One decode tap of a depthwise causal conv channel: returns w . (window, xv) over the K taps and
   shifts xv into the window s (its K - 1 previous inputs, oldest first), in place. */
static inline float conv_tap(float* s, const float* w, float xv, int K) {
  float acc = 0.0f;
  for (int j = 0; j < K - 1; j++) acc += w[j] * s[j];
  acc += w[K - 1] * xv;
  for (int j = 0; j + 1 < K - 1; j++) s[j] = s[j + 1];
  if (K > 1) s[K - 2] = xv;
  return acc;
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* softplus(x) = log(1 + e^x), x itself above 20 (torch's threshold) */
static inline float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* delta_head: that step for one (sequence, head), S (rows at stride s_row) updated in place, o [dv];
   lm_delta_step runs it for every pair (gdn_head_rows runs the same step over slices of columns). */
static void delta_head(float* S, int64_t s_row, const float* k, const float* q, const float* a, int sa,
                       const float* vp, float b, int dk, int dv, float* o) {
  float kv[dv], qv[dv], delta[dv];
  for (int c = 0; c < dv; c++) kv[c] = qv[c] = 0.0f;
  float qk = 0.0f;
  for (int i = 0; i < dk; i++) {
    const float* row = S + (ptrdiff_t)i * s_row;
    float ai = a[i * sa], ki = ai * k[i], qi = ai * q[i];   /* (diag(a) S)^T x = S^T (a * x) */
    qk += q[i] * k[i];
    for (int c = 0; c < dv; c++) {
      kv[c] += row[c] * ki;
      qv[c] += row[c] * qi;
    }
  }
  for (int c = 0; c < dv; c++) delta[c] = b * (vp[c] - kv[c]);
  for (int i = 0; i < dk; i++) {
    float* row = S + (ptrdiff_t)i * s_row;
    float ai = a[i * sa], ki = k[i];
    for (int c = 0; c < dv; c++) row[c] = ai * row[c] + ki * delta[c];
  }
  for (int c = 0; c < dv; c++) o[c] = qv[c] + qk * delta[c];
}

void lm_delta_step(const float* kq, const float* v, const float* decay, int per_channel, const float* beta,
                   float* state, int N, int H, int dk, int dv, int64_t s_slot, int64_t s_head, int64_t s_row,
                   float* out, int threads) {
  const int sa = per_channel ? 1 : 0;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < N * H; p++) {
    const float* k = kq + (ptrdiff_t)p * 2 * dk;
    delta_head(state + (ptrdiff_t)(p / H) * s_slot + (ptrdiff_t)(p % H) * s_head, s_row, k, k + dk,
               decay + (ptrdiff_t)p * (per_channel ? dk : 1), sa, v + (ptrdiff_t)p * dv, beta[p], dk, dv,
               out + (ptrdiff_t)p * dv);
  }
}

/* The whole decode step of a Gated DeltaNet layer between its two projections (Yang, Kautz,
   Hatamizadeh, "Gated Delta Networks", ICLR 2025), for N sequences, both states updated in place:

     x     = proj[n, cols[0 .. C)]                       the conv's channels q | k | v, C = 2 Hk dk + Hv dv
     y     = silu(causal conv of x over its window)      window state element (n, c, j) at
                                                         n * cs_slot + c * cs_chan + j, K - 1 of them
     q, k  = l2norm(y's head kh = h / (Hv / Hk)), q scaled by dk^-1/2 (eps 1e-6 inside the root)
     beta  = beta_scale * sigmoid(b),  b = proj[n, cols[C + Hv dv + h]]
     decay = exp(-exp(A_log[h]) * softplus(a + dt_bias[h])),  a = proj[n, cols[C + Hv dv + Hv + h]]
     o     = the delta-rule step of head h (delta_head's), state element (n, h, i, c) at
             n * s_slot + h * s_head + i * s_row + c
     out   = norm_w * o / sqrt(mean(o^2) + eps) * silu(z),  z = proj[n, cols[C + h dv + c]]

   cols [C + Hv dv + 2 Hv] maps each input to its column of the projection row (row stride
   ld_proj), so any packing of the projections is read in place. work [N, C] holds y between the
   two phases; out [N, Hv dv]. softplus(x) = x above 20 (torch's threshold).

   gdn_conv_rows (the conv before its SiLU, which silu_rows applies to all rows at once: a block
   of channels) and gdn_head_rows (one head) run over the rows [r0, r1) of one sequence in order
   (a decode step: one row); lm_gdn_varlen runs them over whole sequences, so a
   prompt's rows give bit for bit the states and outputs of as many decode steps. */
/* the conv (before its SiLU) of channels [c0, c1) over rows [r0, r1) of one sequence, row by
   row (each row's channels read from and written to one row of proj / work), windows at
   s + c * cs_chan updated in place */
enum { GDN_CONV_BLOCK = 64 };

static void gdn_conv_rows(const float* proj, int64_t ld_proj, const int64_t* cols, const float* conv_w, float* s,
                          int64_t cs_chan, int K, int c0, int c1, int64_t r0, int64_t r1, float* work, int C) {
  for (int64_t t = r0; t < r1; t++) {
    const float* row = proj + t * ld_proj;
    float* y = work + t * C;
    for (int c = c0; c < c1; c++) {
      float* win = s + (ptrdiff_t)c * cs_chan;
      const float* w = conv_w + (ptrdiff_t)c * K;
      float xv = row[cols[c]];
      float acc = 0.0f;
      for (int j = 0; j < K - 1; j++) acc += w[j] * win[j];
      acc += w[K - 1] * xv;
      for (int j = 0; j + 1 < K - 1; j++) win[j] = win[j + 1];
      if (K > 1) win[K - 2] = xv;
      y[c] = acc;
    }
  }
}

static inline float expf_nonpos(float x);

/* x * sigmoid(x) = x / (1 + exp(-x)) with exp(-|x|) by expf_nonpos (about 1 ulp; unlike a libm
   call, a loop of it vectorizes) */
static inline float silu_fast(float x) {
  float e = expf_nonpos(x < 0.0f ? x : -x);
  return x * (x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e));
}

/* work[p] = silu(work[p]) for p < n, inside a parallel region */
static void silu_rows(float* work, int64_t n) {
  #pragma omp for schedule(static)
  for (int64_t p = 0; p < n; p++) work[p] = silu_fast(work[p]);
}

/* rows of one sequence per block of gdn_head_rows: their q, k, gates and outputs stay on the stack
   while each group of GDN_SLICES GDN_COLS-column slices of the head's state (dk x 64 floats, 32 KB at
   dk = 128, with AVX-512; half that without) is stepped through all of them from L1 / L2 */
enum { GDN_ROWS = 16, GDN_SLICES = 4 };

/* the state's columns GDN_COLS at a time: one register each (without AVX-512 a v16 is none and
   arrays of them live on the stack; see dot_block_nm). Every column is stepped on its own, lane for
   lane the same operations; the columns of whole groups of GDN_GROUP take the vector path and the
   rest the scalar one (which may contract its multiply-adds differently) on every CPU, so the
   results do not depend on the width. */
#ifdef __AVX512F__
typedef v16 vcols;
enum { GDN_COLS = 16 };
#else
typedef v8 vcols;
enum { GDN_COLS = 8 };
#endif
enum { GDN_GROUP = 64 };   /* a multiple of GDN_SLICES * GDN_COLS */
_Static_assert(GDN_GROUP % (GDN_SLICES * GDN_COLS) == 0, "a group is whole vector steps");

static inline vcols load_cols(const float* p) { vcols v; memcpy(&v, p, sizeof v); return v; }
static inline void store_cols(float* p, vcols v) { memcpy(p, &v, sizeof v); }

static void gdn_head_rows(const float* proj, int64_t ld_proj, const int64_t* cols, const float* work,
                          const float* A_log, const float* dt_bias, float beta_scale, float* S, int64_t s_row,
                          const float* norm_w, float eps, int Hk, int Hv, int dk, int dv, int h, int64_t r0,
                          int64_t r1, float* out) {
  const int C = 2 * Hk * dk + Hv * dv, kh = h / (Hv / Hk);
  const int64_t* z_cols = cols + C;
  const int64_t* b_cols = z_cols + (ptrdiff_t)Hv * dv;
  const int64_t* a_cols = b_cols + Hv;
  const float q_scale = 1.0f / sqrtf((float)dk);
  for (int64_t t0 = r0; t0 < r1; t0 += GDN_ROWS) {
    const int nr = r1 - t0 < GDN_ROWS ? (int)(r1 - t0) : GDN_ROWS;
    float kn[GDN_ROWS][dk], qn[GDN_ROWS][dk], akn[GDN_ROWS][dk], aqn[GDN_ROWS][dk], o[GDN_ROWS][dv];
    float beta[GDN_ROWS], decay[GDN_ROWS], qk[GDN_ROWS];
    for (int r = 0; r < nr; r++) {
      const float* y = work + (t0 + r) * C;
      const float* row = proj + (t0 + r) * ld_proj;
      float kk = 0.0f, qq = 0.0f;
      for (int i = 0; i < dk; i++) {
        kn[r][i] = y[Hk * dk + kh * dk + i];
        qn[r][i] = y[kh * dk + i];
        kk += kn[r][i] * kn[r][i];
        qq += qn[r][i] * qn[r][i];
      }
      float ik = 1.0f / sqrtf(kk + 1e-6f), iq = 1.0f / sqrtf(qq + 1e-6f);
      float dot = 0.0f;
      for (int i = 0; i < dk; i++) {
        kn[r][i] *= ik;
        qn[r][i] = qn[r][i] * iq * q_scale;
        dot += qn[r][i] * kn[r][i];
      }
      qk[r] = dot;
      float b = row[b_cols[h]], a = row[a_cols[h]] + dt_bias[h];
      beta[r] = beta_scale * (1.0f / (1.0f + expf(-b)));
      float sp = a > 20.0f ? a : log1pf(expf(a));
      decay[r] = expf(-expf(A_log[h]) * sp);
      for (int i = 0; i < dk; i++) {   /* (diag(a) S)^T x = S^T (a * x) */
        akn[r][i] = decay[r] * kn[r][i];
        aqn[r][i] = decay[r] * qn[r][i];
      }
    }
    /* the delta rule (delta_head's step) column slice by column slice: every column of S evolves
       on its own, so each slice runs all the rows before the next is touched; GDN_SLICES slices
       at once give as many independent sums (a single one waits on each add's latency) */
    int c0 = 0;
    for (; c0 < dv / GDN_GROUP * GDN_GROUP; c0 += GDN_SLICES * GDN_COLS) {
      for (int r = 0; r < nr; r++) {
        vcols kv[GDN_SLICES], qv[GDN_SLICES], d[GDN_SLICES];
        for (int b = 0; b < GDN_SLICES; b++) kv[b] = qv[b] = (vcols){0};
        for (int i = 0; i < dk; i++) {
          const float* sp = S + (ptrdiff_t)i * s_row + c0;
          for (int b = 0; b < GDN_SLICES; b++) {
            vcols sv = load_cols(sp + b * GDN_COLS);
            kv[b] += sv * akn[r][i];
            qv[b] += sv * aqn[r][i];
          }
        }
        const float* vp = work + (t0 + r) * C + 2 * Hk * dk + (ptrdiff_t)h * dv + c0;
        for (int b = 0; b < GDN_SLICES; b++) d[b] = beta[r] * (load_cols(vp + b * GDN_COLS) - kv[b]);
        const float a = decay[r];
        for (int i = 0; i < dk; i++) {
          float* sp = S + (ptrdiff_t)i * s_row + c0;
          for (int b = 0; b < GDN_SLICES; b++)
            store_cols(sp + b * GDN_COLS, a * load_cols(sp + b * GDN_COLS) + kn[r][i] * d[b]);
        }
        for (int b = 0; b < GDN_SLICES; b++) store_cols(&o[r][c0 + b * GDN_COLS], qv[b] + qk[r] * d[b]);
      }
    }
    for (; c0 < dv; c0++) {   /* the columns past the last whole group, one at a time */
      for (int r = 0; r < nr; r++) {
        float kv = 0.0f, qv = 0.0f;
        for (int i = 0; i < dk; i++) {
          float sv = S[(ptrdiff_t)i * s_row + c0];
          kv += sv * akn[r][i];
          qv += sv * aqn[r][i];
        }
        float d = beta[r] * (work[(t0 + r) * C + 2 * Hk * dk + (ptrdiff_t)h * dv + c0] - kv);
        const float a = decay[r];
        for (int i = 0; i < dk; i++) {
          float* sp = S + (ptrdiff_t)i * s_row + c0;
          *sp = a * *sp + kn[r][i] * d;
        }
        o[r][c0] = qv + qk[r] * d;
      }
    }
    for (int r = 0; r < nr; r++) {
      const float* row = proj + (t0 + r) * ld_proj;
      float ss = 0.0f;
      for (int c = 0; c < dv; c++) ss += o[r][c] * o[r][c];
      float inv = 1.0f / sqrtf(ss / (float)dv + eps);
      float* dst = out + (t0 + r) * (int64_t)Hv * dv + (ptrdiff_t)h * dv;
      for (int c = 0; c < dv; c++) {
        float z = row[z_cols[(ptrdiff_t)h * dv + c]];
        dst[c] = norm_w[c] * (o[r][c] * inv) * silu_fast(z);
      }
    }
  }
}

void lm_gdn_decode(const float* proj, int64_t ld_proj, const int64_t* cols, const float* conv_w, float* conv_state,
                   int64_t cs_slot, int64_t cs_chan, const float* A_log, const float* dt_bias, float beta_scale,
                   float* state, int64_t s_slot, int64_t s_head, int64_t s_row, const float* norm_w, float eps,
                   int N, int Hk, int Hv, int dk, int dv, int K, float* work, float* out, int threads) {
  const int C = 2 * Hk * dk + Hv * dv;
  #pragma omp parallel num_threads(threads)
  {
    const int nblk = (C + GDN_CONV_BLOCK - 1) / GDN_CONV_BLOCK;
    #pragma omp for schedule(static)
    for (int p = 0; p < N * nblk; p++) {
      int n = p / nblk, c0 = (p % nblk) * GDN_CONV_BLOCK, c1 = c0 + GDN_CONV_BLOCK < C ? c0 + GDN_CONV_BLOCK : C;
      gdn_conv_rows(proj, ld_proj, cols, conv_w, conv_state + (ptrdiff_t)n * cs_slot, cs_chan, K, c0, c1, n, n + 1,
                    work, C);
    }
    silu_rows(work, (int64_t)N * C);
    #pragma omp for schedule(static)
    for (int p = 0; p < N * Hv; p++) {
      int n = p / Hv, h = p % Hv;
      gdn_head_rows(proj, ld_proj, cols, work, A_log, dt_bias, beta_scale,
                    state + (ptrdiff_t)n * s_slot + (ptrdiff_t)h * s_head, s_row, norm_w, eps, Hk, Hv, dk, dv, h,
                    n, n + 1, out);
    }
  }
}

/* lm_gdn_decode for a flat batch of N sequences of any lengths (a prefill step, or prefill
   chunks beside decodes): sequence n owns the proj / work / out rows [cu[n], cu[n + 1]) and the
   state slot slots[n] (conv window at slots[n] * cs_slot, recurrent state at slots[n] * s_slot);
   fresh[n] != 0 zeroes both first (a sequence with no history, whatever the slot held). Each
   (sequence, channel) runs its rows in order in the conv phase, each (sequence, head) in the
   delta phase; the step arithmetic is lm_gdn_decode's. work [T, C], out [T, Hv dv]. */
void lm_gdn_varlen(const float* proj, int64_t ld_proj, const int64_t* cols, const float* conv_w, float* conv_cache,
                   int64_t cs_slot, int64_t cs_chan, const float* A_log, const float* dt_bias, float beta_scale,
                   float* state_cache, int64_t s_slot, int64_t s_head, int64_t s_row, const float* norm_w, float eps,
                   const int64_t* cu, const int64_t* slots, const uint8_t* fresh, int N, int Hk, int Hv, int dk,
                   int dv, int K, float* work, float* out, int threads) {
  const int C = 2 * Hk * dk + Hv * dv;
  #pragma omp parallel num_threads(threads)
  {
    const int nblk = (C + GDN_CONV_BLOCK - 1) / GDN_CONV_BLOCK;
    #pragma omp for schedule(static)
    for (int p = 0; p < N * nblk; p++) {
      int n = p / nblk, c0 = (p % nblk) * GDN_CONV_BLOCK, c1 = c0 + GDN_CONV_BLOCK < C ? c0 + GDN_CONV_BLOCK : C;
      float* s = conv_cache + (ptrdiff_t)slots[n] * cs_slot;
      if (fresh[n])
        for (int c = c0; c < c1; c++)
          for (int j = 0; j < K - 1; j++) s[(ptrdiff_t)c * cs_chan + j] = 0.0f;
      gdn_conv_rows(proj, ld_proj, cols, conv_w, s, cs_chan, K, c0, c1, cu[n], cu[n + 1], work, C);
    }
    silu_rows(work, cu[N] * C);
    #pragma omp for schedule(dynamic, 1)
    for (int p = 0; p < N * Hv; p++) {
      int n = p / Hv, h = p % Hv;
      float* S = state_cache + (ptrdiff_t)slots[n] * s_slot + (ptrdiff_t)h * s_head;
      if (fresh[n])
        for (int i = 0; i < dk; i++) memset(S + (ptrdiff_t)i * s_row, 0, sizeof(float) * (size_t)dv);
      gdn_head_rows(proj, ld_proj, cols, work, A_log, dt_bias, beta_scale, S, s_row, norm_w, eps, Hk, Hv, dk, dv, h,
                    cu[n], cu[n + 1], out);
    }
  }
}

/* The whole decode step of a Kimi Delta Attention layer between its projections (Kimi Team,
   "Kimi Linear: An Expressive, Efficient Attention Architecture", 2025), for N sequences, the three
   conv windows and the recurrent state updated in place. Per sequence n and head h, channel
   c = h d + i of D = H d:

     q, k, v = silu(causal conv of qkv[n, c], qkv[n, D + c], qkv[n, 2 D + c])   (three convs, no
               bias; window element (n, c, j) of conv s at cs[s] + n * cs_slot + c * cs_chan + j)
     q, k    = l2norm over the head's d channels (eps 1e-6 inside the root), q scaled by d^-1/2
     u       = f[n, c] + dt_bias[c]
     g       = -exp(A_log[h]) * softplus(u)                 (safe_gate == 0: Kimi-Linear)
             = lower_bound * sigmoid(exp(A_log[h]) * u)     (safe_gate != 0: GLM-5.3-Flash)
     beta    = sigmoid(b[n, h])
     o       = delta_head with the per-channel decay exp(g), state element (n, h, i, c) at
               n * s_slot + h * s_head + i * s_row + c
     out     = norm_w * o / sqrt(mean(o^2) + eps) * sigmoid(gate[n, c])

   qkv, f, b, gate rows at strides ld_qkv, ld_f, ld_b, ld_gate (views of the projections' output
   are read in place); conv_w [3][D, K] (q, k, v); out [N, D]. A head reads only its own channels,
   so each (sequence, head) pair is one independent task. */
void lm_kda_decode(const float* qkv, int64_t ld_qkv, const float* f, int64_t ld_f, const float* b, int64_t ld_b,
                   const float* gate, int64_t ld_gate, const float* q_conv_w, const float* k_conv_w,
                   const float* v_conv_w, float* q_conv, float* k_conv, float* v_conv, int64_t cs_slot,
                   int64_t cs_chan, const float* A_log, const float* dt_bias, int safe_gate, float lower_bound,
                   float* state, int64_t s_slot, int64_t s_head, int64_t s_row, const float* norm_w, float eps,
                   int N, int H, int d, int K, float* out, int threads) {
  const int D = H * d;
  const float q_scale = 1.0f / sqrtf((float)d);
  const float* conv_w[3] = {q_conv_w, k_conv_w, v_conv_w};
  float* conv_s[3] = {q_conv, k_conv, v_conv};
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < N * H; p++) {
    int n = p / H, h = p % H;
    float y[3][d], decay[d], o[d];
    const float* row = qkv + (ptrdiff_t)n * ld_qkv;
    for (int part = 0; part < 3; part++) {
      for (int i = 0; i < d; i++) {
        int c = h * d + i;
        float acc = conv_tap(conv_s[part] + (ptrdiff_t)n * cs_slot + (ptrdiff_t)c * cs_chan,
                             conv_w[part] + (ptrdiff_t)c * K, row[part * D + c], K);
        y[part][i] = acc / (1.0f + expf(-acc));
      }
    }
    float qq = 0.0f, kk = 0.0f;
    for (int i = 0; i < d; i++) {
      qq += y[0][i] * y[0][i];
      kk += y[1][i] * y[1][i];
    }
    float iq = q_scale / sqrtf(qq + 1e-6f), ik = 1.0f / sqrtf(kk + 1e-6f);
    for (int i = 0; i < d; i++) {
      y[0][i] *= iq;
      y[1][i] *= ik;
    }
    const float* fr = f + (ptrdiff_t)n * ld_f + (ptrdiff_t)h * d;
    const float* bias = dt_bias + (ptrdiff_t)h * d;
    float rate = expf(A_log[h]);
    for (int i = 0; i < d; i++) {
      float u = fr[i] + bias[i];
      decay[i] = expf(safe_gate ? lower_bound * sigmoidf(rate * u) : -rate * softplusf(u));
    }
    delta_head(state + (ptrdiff_t)n * s_slot + (ptrdiff_t)h * s_head, s_row, y[1], y[0], decay, 1, y[2],
               sigmoidf(b[(ptrdiff_t)n * ld_b + h]), d, d, o);
    float ss = 0.0f;
    for (int i = 0; i < d; i++) ss += o[i] * o[i];
    float inv = 1.0f / sqrtf(ss / (float)d + eps);
    const float* gr = gate + (ptrdiff_t)n * ld_gate + (ptrdiff_t)h * d;
    float* dst = out + (ptrdiff_t)n * D + (ptrdiff_t)h * d;
    for (int i = 0; i < d; i++) dst[i] = norm_w[i] * (o[i] * inv) * sigmoidf(gr[i]);
  }
}

/* One decode token of the Mamba-2 selective state space recurrence (Dao & Gu, "Transformers are
   SSMs", ICML 2024, the SSD recurrence) for N sequences x H heads, state updated in place:
   a = exp(dt A_h); S <- a S + (dt x) B^T; y = S C + D_h x, head h reading B and C of group
   h / (H / G). x, y [N, H, P]; dt [N, H]; A, D [H] (D may be NULL: no skip); B, C [N, G, Dn];
   state element (n, h, p, j) at n * s_slot + h * s_head + p * s_row + j. One pass over the state:
   each row is updated and read against C while it is in registers. */
/* ssd_head: that step for one (sequence, head): S [P, Dn] (rows at stride s_row) updated in
   place, y [P] written; lm_ssd_step runs it for every pair, lm_mamba2_decode inside a whole layer. */
static void ssd_head(float* S, int64_t s_row, const float* xp, const float* b, const float* c, float d, float A,
                     float skip, int P, int Dn, float* yp) {
  float a = expf(d * A);
  for (int p = 0; p < P; p++) {
    float* row = S + (ptrdiff_t)p * s_row;
    float u = d * xp[p];
    v16 acc = (v16){0};
    int j = 0;
    for (; j + 16 <= Dn; j += 16) {
      v16 s = load16(row + j) * a + load16(b + j) * u;
      memcpy(row + j, &s, sizeof s);
      acc += s * load16(c + j);
    }
    float tot = hsum16(acc);
    for (; j < Dn; j++) {
      float s = row[j] * a + b[j] * u;
      row[j] = s;
      tot += s * c[j];
    }
    yp[p] = tot + skip * xp[p];
  }
}

void lm_ssd_step(const float* x, const float* dt, const float* A, const float* B, const float* C, const float* D,
                 float* state, int N, int H, int P, int G, int Dn, int64_t s_slot, int64_t s_head, int64_t s_row,
                 float* y, int threads) {
  int per_group = H / G;
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int q = 0; q < N * H; q++) {
    int n = q / H, h = q % H;
    const float* b = B + ((ptrdiff_t)n * G + h / per_group) * Dn;
    const float* c = C + ((ptrdiff_t)n * G + h / per_group) * Dn;
    ssd_head(state + (ptrdiff_t)n * s_slot + (ptrdiff_t)h * s_head, s_row, x + (ptrdiff_t)q * P, b, c, dt[q], A[h],
             D ? D[h] : 0.0f, P, Dn, y + (ptrdiff_t)q * P);
  }
}

/* The whole decode step of a Mamba-2 layer between its projections (Dao & Gu, "Transformers are
   SSMs", ICML 2024), for N sequences, both states updated in place. proj rows (stride ld_proj):
   [z (H P) | x (H P) | B (G Dn) | C (G Dn) | dt (H)]; the conv channels are x | B | C (C_ch of them):

     xbc   = silu(conv_b + causal conv over the window)   conv_b may be NULL; window element
                                                          (n, c, j) at n * cs_slot + c * cs_chan + j
     dt    = min(max(softplus(dt + dt_bias[h]), dt_min), dt_max)
     y     = the SSD step of head h (ssd_head) with A = -exp(A_log[h]), skip D[h], B and C of group
             h / (H / G); state element (n, h, p, j) at n * s_slot + h * s_head + p * s_row + j
     out   = norm_w * r / sqrt(mean over the group's channels of r^2 + eps),  r = y * silu(z),
             groups of H P / G channels (the gate before the norm: Mamba-2's norm_before_gate=False)

   work [N, C_ch] holds the conv outputs (heads of a group share its B and C); out [N, H P] holds
   r between the SSD and the norm phases. */
void lm_mamba2_decode(const float* proj, int64_t ld_proj, const float* conv_w, const float* conv_b,
                      float* conv_state, int64_t cs_slot, int64_t cs_chan, const float* dt_bias, const float* A_log,
                      const float* D, float dt_min, float dt_max, float* state, int64_t s_slot, int64_t s_head,
                      int64_t s_row, const float* norm_w, float eps, int N, int H, int P, int G, int Dn, int K,
                      float* work, float* out, int threads) {
  const int di = H * P, C_ch = di + 2 * G * Dn, per_group = H / G, group = di / G;
  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(static)
    for (int64_t q = 0; q < (int64_t)N * C_ch; q++) {
      int n = (int)(q / C_ch), c = (int)(q % C_ch);
      float acc = conv_tap(conv_state + (ptrdiff_t)n * cs_slot + (ptrdiff_t)c * cs_chan, conv_w + (ptrdiff_t)c * K,
                           proj[(ptrdiff_t)n * ld_proj + di + c], K);
      if (conv_b) acc += conv_b[c];
      work[q] = acc / (1.0f + expf(-acc));
    }
    #pragma omp for schedule(static)
    for (int q = 0; q < N * H; q++) {
      int n = q / H, h = q % H, g = h / per_group;
      const float* row = proj + (ptrdiff_t)n * ld_proj;
      const float* xbc = work + (ptrdiff_t)n * C_ch;
      float dt = softplusf(row[di + C_ch + h] + dt_bias[h]);
      dt = dt < dt_min ? dt_min : dt;
      dt = dt > dt_max ? dt_max : dt;
      float* yp = out + (ptrdiff_t)n * di + (ptrdiff_t)h * P;
      ssd_head(state + (ptrdiff_t)n * s_slot + (ptrdiff_t)h * s_head, s_row, xbc + (ptrdiff_t)h * P,
               xbc + di + (ptrdiff_t)g * Dn, xbc + di + (ptrdiff_t)(G + g) * Dn, dt, -expf(A_log[h]), D[h], P, Dn,
               yp);
      const float* z = row + (ptrdiff_t)h * P;
      for (int p = 0; p < P; p++) yp[p] *= z[p] / (1.0f + expf(-z[p]));
    }
    #pragma omp for schedule(static)
    for (int q = 0; q < N * G; q++) {
      float* r = out + (ptrdiff_t)q * group;
      const float* w = norm_w + (ptrdiff_t)(q % G) * group;
      float ss = 0.0f;
      for (int i = 0; i < group; i++) ss += r[i] * r[i];
      float inv = 1.0f / sqrtf(ss / (float)group + eps);
      for (int i = 0; i < group; i++) r[i] = w[i] * (r[i] * inv);
    }
  }
}

/* exp(x) for x <= 0 without a libm call, so a loop of it vectorizes: x = n ln2 + g with n the
   nearest integer to x / ln2 (the 1.5 * 2^23 rounding trick) and |g| <= ln2 / 2, e^g by the
   degree-6 polynomial of Cephes' expf (S. L. Moshier, Cephes Math Library, 1984-1992; about 1 ulp),
   times 2^n built from the exponent bits. Below -87 the result is exp(-87) ~ 1.6e-38 instead of
   a smaller number or zero: a decay that small leaves a state entry at float32 rounding of zero. */
static inline float expf_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  float r = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float g = x - r * 0.693359375f + r * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * g + 1.3981999507e-3f;
  p = p * g + 8.3334519073e-3f;
  p = p * g + 4.1665795894e-2f;
  p = p * g + 1.6666665459e-1f;
  p = p * g + 5.0000001201e-1f;
  float e = p * g * g + g + 1.0f;
  uint32_t bits = (uint32_t)((int32_t)r + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

/* One decode token of the Mamba-1 selective scan for M sequences x Dd channels, the state updated
   in place (Gu & Dao, "Mamba", 2023, Algorithm 2): per channel d with its state row S [N],
   S <- exp(dt A[d]) * S + dt x B (elementwise: the decay differs per state entry), y = S . C + D[d] x.
   x, dt [M, Dd] and y [M, Dd] contiguous; A [Dd, N] (negative, dt > 0: the exponents are <= 0);
   B, C [M, N]; D [Dd]; state element (m, d, j) at m * s_slot + d * s_chan + j. The update loop has
   no reduction, so it vectorizes; the dot with C then reads the updated row in 16-wide blocks. */
void lm_selective_step(const float* x, const float* dt, const float* A, const float* B, const float* C,
                       const float* D, float* state, int M, int Dd, int N, int64_t s_slot, int64_t s_chan,
                       float* y, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int q = 0; q < M * Dd; q++) {
    int m = q / Dd, d = q % Dd;
    float* S = state + (ptrdiff_t)m * s_slot + (ptrdiff_t)d * s_chan;
    const float* a = A + (ptrdiff_t)d * N;
    const float* b = B + (ptrdiff_t)m * N;
    const float* c = C + (ptrdiff_t)m * N;
    float step = dt[q], u = step * x[q];
    for (int j = 0; j < N; j++) S[j] = S[j] * expf_nonpos(step * a[j]) + b[j] * u;
    v16 acc = (v16){0};
    int j = 0;
    for (; j + 16 <= N; j += 16) acc += load16(S + j) * load16(c + j);
    float tot = hsum16(acc);
    for (; j < N; j++) tot += S[j] * c[j];
    y[q] = tot + D[d] * x[q];
  }
}

/* One decode token of a depthwise causal convolution for N sequences x C channels, the window
   state (the last K - 1 inputs) updated in place: y = act(bias + sum_j w[c, j] window[j]) over the
   window (state, x). x [N, C] (row stride ldx); state element (n, c, j) at n * s_slot + c * s_chan
   + j; weight [C, K]; bias [C] or NULL; y [N, C]; silu != 0 applies x * sigmoid(x). */
void lm_conv_decode_step(const float* x, int64_t ldx, float* state, int64_t s_slot, int64_t s_chan,
                         const float* weight, const float* bias, int N, int C, int K, int silu, float* y,
                         int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int n = 0; n < N; n++) {
    for (int c = 0; c < C; c++) {
      float* s = state + (ptrdiff_t)n * s_slot + (ptrdiff_t)c * s_chan;
      const float* w = weight + (ptrdiff_t)c * K;
      float acc = conv_tap(s, w, x[(ptrdiff_t)n * ldx + c], K);
      if (bias) acc += bias[c];
      y[(ptrdiff_t)n * C + c] = silu ? acc / (1.0f + expf(-acc)) : acc;
    }
  }
}

/* Root-mean-square norm of R rows of D channels: h = x / sqrt(mean(x^2) + eps), then
   out = h * (1 + w) (zero_centered), or w * h, times silu(z) when z is given (the gated form).
   x, z rows at stride ldx, ldz; out [R, D] contiguous. */
void lm_rms_norm(const float* x, int64_t R, int D, int64_t ldx, const float* w, float eps, int zero_centered,
                 const float* z, int64_t ldz, float* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (R * D >= 4096)
  for (int64_t r = 0; r < R; r++) {
    const float* xr = x + r * ldx;
    float* o = out + r * (int64_t)D;
    float ss = 0.0f;
    #pragma omp simd reduction(+:ss)
    for (int c = 0; c < D; c++) ss += xr[c] * xr[c];
    float inv = 1.0f / sqrtf(ss / (float)D + eps);
    if (zero_centered)
      for (int c = 0; c < D; c++) o[c] = xr[c] * inv * (1.0f + w[c]);
    else
      for (int c = 0; c < D; c++) o[c] = w[c] * (xr[c] * inv);
    if (z) {
      const float* zr = z + r * ldz;
      for (int c = 0; c < D; c++) o[c] *= zr[c] / (1.0f + expf(-zr[c]));
    }
  }
}

/* The residual sum and its RMS norm in one pass: sum = x + res, out = rms_norm(sum) as lm_rms_norm
   (zero_centered: times 1 + w, else w). x, res, sum, out [R, D] contiguous. */
void lm_add_rms_norm(const float* x, const float* res, int64_t R, int D, const float* w, float eps, int zero_centered,
                     float* sum, float* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static) if (R * D >= 4096)
  for (int64_t r = 0; r < R; r++) {
    const float* xr = x + r * (int64_t)D;
    const float* rr = res + r * (int64_t)D;
    float* sr = sum + r * (int64_t)D;
    float* o = out + r * (int64_t)D;
    float ss = 0.0f;
    for (int c = 0; c < D; c++) {
      sr[c] = xr[c] + rr[c];
      ss += sr[c] * sr[c];
    }
    float inv = 1.0f / sqrtf(ss / (float)D + eps);
    if (zero_centered)
      for (int c = 0; c < D; c++) o[c] = sr[c] * inv * (1.0f + w[c]);
    else
      for (int c = 0; c < D; c++) o[c] = w[c] * (sr[c] * inv);
  }
}

/* out = a + b (op 0) or a * b (op 1) over n float32 elements, one thread: the decode graph's replay
   of torch's same-shape add and mul. Each element is one IEEE operation, so the result is torch's bit
   for bit; a call costs a few hundred instructions where torch's dispatch costs thousands, which
   miss in every cache when they run right after a product has streamed its weights through them.
   out may be a or b (in place), not a partial overlap. */
void lm_binary_f32(const float* a, const float* b, float* out, int64_t n, int op) {
  if (op == 0)
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
  else
    for (int64_t i = 0; i < n; i++) out[i] = a[i] * b[i];
}

/* The prologue of a decode attention layer with rotary positions and, optionally, per-head q/k
   RMS norms (Qwen3's, Qwen3-Next's gated form, LFM2's; without norms the plain GQA layers of the
   Mamba hybrids), from the packed projection: row t of proj (stride ld) holds [q | k | v], q per
   head [q (D) | gate (D)] when gated, else [q (D)]; k, v [Hkv D].
   Each q and k head, when q_w and k_w are given: h = x / sqrt(mean(x^2) + eps), times (1 + w)
   when zero_centered else w (both NULL: h = x); each k head then times k_scale (Falcon-H1's key
   multiplier; 1 elsewhere); then its first rot channels rotate: x1 * cos - x2 * sin,
   x2 * cos + x1 * sin over the two halves (cos, sin [T, rot]). q_out [T, H, D]; gate_out
   [T, H D] = sigmoid(gate) when gated;
   k and v land in the caches at (blocks[t], offsets[t]): element (b, p, h, c) at
   b * s_block + p * s_pos + h * s_head + c (both caches share the strides). Returns -1 and writes
   nothing when a block id is outside [0, num_blocks) or an offset outside [0, block_size). */
int lm_qk_norm_rope_store(const float* proj, int64_t ld, int T, int H, int Hkv, int D, int gated, const float* q_w,
                           const float* k_w, float eps, int zero_centered, float k_scale, const float* cos,
                           const float* sin, int rot, float* q_out, float* gate_out, float* k_cache, float* v_cache,
                           int64_t s_block, int64_t s_pos, int64_t s_head, const int64_t* blocks,
                           const int64_t* offsets, int64_t num_blocks, int block_size, int threads) {
  const int qw = gated ? 2 * D : D, half = rot / 2;
  for (int t = 0; t < T; t++)
    if (blocks[t] < 0 || blocks[t] >= num_blocks || offsets[t] < 0 || offsets[t] >= block_size) return -1;
  #pragma omp parallel for num_threads(threads) schedule(static) if (T * (H + Hkv) >= 64)
  for (int p = 0; p < T * (H + Hkv); p++) {
    int t = p / (H + Hkv), h = p % (H + Hkv), is_k = h >= H;
    const float* row = proj + (ptrdiff_t)t * ld;
    const float* x;
    float* dst;
    if (is_k) {
      h -= H;
      x = row + (ptrdiff_t)H * qw + (ptrdiff_t)h * D;
      ptrdiff_t at = (ptrdiff_t)blocks[t] * s_block + (ptrdiff_t)offsets[t] * s_pos + (ptrdiff_t)h * s_head;
      dst = k_cache + at;
      memcpy(v_cache + at, x + (ptrdiff_t)Hkv * D, sizeof(float) * D);
    } else {
      x = row + (ptrdiff_t)h * qw;
      dst = q_out + ((ptrdiff_t)t * H + h) * D;
      if (gated)
        for (int c = 0; c < D; c++) gate_out[((ptrdiff_t)t * H + h) * D + c] = 1.0f / (1.0f + expf(-x[D + c]));
    }
    const float* w = is_k ? k_w : q_w;
    float n[D];
    if (w) {
      float ss = 0.0f;
      for (int c = 0; c < D; c++) ss += x[c] * x[c];
      float inv = 1.0f / sqrtf(ss / (float)D + eps);
      for (int c = 0; c < D; c++) n[c] = zero_centered ? x[c] * inv * (1.0f + w[c]) : w[c] * (x[c] * inv);
    } else {
      for (int c = 0; c < D; c++) n[c] = x[c];
    }
    if (is_k && k_scale != 1.0f)
      for (int c = 0; c < D; c++) n[c] *= k_scale;
    const float* cs = cos + (ptrdiff_t)t * rot;
    const float* sn = sin + (ptrdiff_t)t * rot;
    for (int c = 0; c < half; c++) {
      dst[c] = n[c] * cs[c] - n[c + half] * sn[c];
      dst[c + half] = n[c + half] * cs[c + half] + n[c] * sn[c + half];
    }
    for (int c = rot; c < D; c++) dst[c] = n[c];
  }
  return 0;
}

/* One query token per sequence against its paged keys: for each sequence n and KV head, the G =
   H / Hkv query heads of the group read each cached key and value row once, with a running
   (online) softmax: m = max score so far, l = sum exp(score - m), acc = sum exp(score - m) v.
   q, out [N, H, D] contiguous; cache element (block, pos, head, d) at block * s_block + pos *
   s_pos + head * s_head + d; block_table [N, W] (row stride ld_table); kv_seqlens [N]. Returns -1
   (and computes nothing) when a length is outside [1, W * block_size], -2 when a block id the
   lengths reach is outside [0, num_blocks). */
/* One key of an online softmax (Milakov & Gimelshein, "Online normalizer calculation for softmax",
   2018) over value rows of width D: the running max m, sum l and weighted sum acc [D] take the key's
   score and value row. A -inf score while m is still -inf weighs 0 and is skipped; a NaN goes on
   (as torch's attention, it makes the output NaN). */
static inline void online_softmax_key(float score, const float* row, int D, float* m, float* l, float* acc) {
  if (score == -INFINITY && *m == -INFINITY) return;
  if (score > *m) {
    float correction = expf(*m - score);   /* 0 for the first key (m = -inf) */
    *l *= correction;
    for (int d = 0; d < D; d++) acc[d] *= correction;
    *m = score;
  }
  float e = expf(score - *m);
  *l += e;
  for (int d = 0; d < D; d++) acc[d] += e * row[d];
}

int lm_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache, int64_t s_block,
                               int64_t s_pos, int64_t s_head, const int64_t* block_table, int64_t ld_table,
                               const int64_t* kv_seqlens, int N, int H, int Hkv, int D, int block_size, int W,
                               int64_t num_blocks, float scale, float* out, int threads) {
  for (int n = 0; n < N; n++) {
    if (kv_seqlens[n] < 1 || kv_seqlens[n] > (int64_t)W * block_size) return -1;
    for (int64_t b = 0; b < (kv_seqlens[n] + block_size - 1) / block_size; b++) {
      int64_t id = block_table[(ptrdiff_t)n * ld_table + b];
      if (id < 0 || id >= num_blocks) return -2;
    }
  }
  int G = H / Hkv;
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int task = 0; task < N * Hkv; task++) {
    int n = task / Hkv, kh = task % Hkv;
    const float* qn = q + ((ptrdiff_t)n * H + (ptrdiff_t)kh * G) * D;
    float acc[G][D], m[G], l[G];
    for (int g = 0; g < G; g++) {
      m[g] = -INFINITY;
      l[g] = 0.0f;
      for (int d = 0; d < D; d++) acc[g][d] = 0.0f;
    }
    int64_t len = kv_seqlens[n];
    for (int64_t t = 0; t < len; t++) {
      int64_t block = block_table[(ptrdiff_t)n * ld_table + t / block_size];
      ptrdiff_t at = block * s_block + (t % block_size) * s_pos + (ptrdiff_t)kh * s_head;
      const float* kr = k_cache + at;
      const float* vr = v_cache + at;
      for (int g = 0; g < G; g++) {
        const float* qg = qn + (ptrdiff_t)g * D;
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int d = 0; d < D; d++) dot += qg[d] * kr[d];
        float score = dot * scale;
        online_softmax_key(score, vr, D, &m[g], &l[g], acc[g]);
      }
    }
    for (int g = 0; g < G; g++) {
      float* o = out + ((ptrdiff_t)n * H + (ptrdiff_t)kh * G + g) * D;
      float inv = 1.0f / l[g];
      for (int d = 0; d < D; d++) o[d] = acc[g][d] * inv;
    }
  }
  return 0;
}

/* Rotary embedding on interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), written
   de-interleaved: out[i] = x[2i] c[i] - x[2i+1] s[i], out[half + i] = x[2i+1] c[i] + x[2i] s[i]
   for i < half = rot / 2 (c, s: the first half of the cat(f, f) tables). */
static void rotate_interleaved(const float* x, const float* c, const float* s, int rot, float* out) {
  int half = rot / 2;
  for (int i = 0; i < half; i++) {
    out[i] = x[2 * i] * c[i] - x[2 * i + 1] * s[i];
    out[half + i] = x[2 * i + 1] * c[i] + x[2 * i] * s[i];
  }
}

/* The decode step of multi-head latent attention (DeepSeek-V2, 2024) in its absorbed form, for
   N sequences of one new token each, between the layer's projections:
   1. each sequence's cache row: latent[b, p] = [rms_norm(c) w (R) | k_rope (P)], from kv [N, R + P]
      (row stride ld_kv) holding [c | k_rope], k_rope rotated by rotate_interleaved when rot
      (rot = P then, cos, sin [N, P]; rot = 0: copied), written at (blocks[n], offsets[n]);
   2. each query head h of sequence n scores the sequence's rows 0 .. kv_seqlens[n] - 1:
      score = (q_c[h, n] . latent[:R] + q_rope'[n, h] . latent[R:]) * scale, with q_rope' the
      rotated q_rope (q_rope [N, H, P] at row stride ld_q, head stride ld_h, unit channel stride),
      and attends the latent part by an online softmax (Milakov & Gimelshein, 2018):
      out[h, n] = sum softmax(score) latent[:R].
   q_c and out are [H, N, R] contiguous (the layout of a batched product over heads, which
   folds the key up-projection into q_c before and the value up-projection into out after).
   The cache: element (b, p, c) at b * s_block + p * s_pos + c. Heads run in groups of up to 8,
   each group reading a row once. Returns -1 (nothing written) on a write index out of range, -2
   on a length outside [1, W * block_size], -3 on a block id the lengths reach outside
   [0, num_blocks). */
int lm_mla_decode(const float* q_c, const float* q_rope, int64_t ld_q, int64_t ld_h, const float* kv, int64_t ld_kv,
                  const float* norm_w, float eps, const float* cos, const float* sin, int rot, float* cache,
                  int64_t s_block, int64_t s_pos, const int64_t* blocks, const int64_t* offsets,
                  const int64_t* block_table, int64_t ld_table, const int64_t* kv_seqlens, int N, int H, int R,
                  int P, int block_size, int W, int64_t num_blocks, float scale, float* out, int threads) {
  for (int n = 0; n < N; n++)
    if (blocks[n] < 0 || blocks[n] >= num_blocks || offsets[n] < 0 || offsets[n] >= block_size) return -1;
  for (int n = 0; n < N; n++) {
    if (kv_seqlens[n] < 1 || kv_seqlens[n] > (int64_t)W * block_size) return -2;
    for (int64_t b = 0; b < (kv_seqlens[n] + block_size - 1) / block_size; b++) {
      int64_t id = block_table[(ptrdiff_t)n * ld_table + b];
      if (id < 0 || id >= num_blocks) return -3;
    }
  }
  enum { HB = 8 };
  int groups = (H + HB - 1) / HB;
  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
      const float* x = kv + (ptrdiff_t)n * ld_kv;
      float* row = cache + (ptrdiff_t)blocks[n] * s_block + (ptrdiff_t)offsets[n] * s_pos;
      float ss = 0.0f;
      for (int c = 0; c < R; c++) ss += x[c] * x[c];
      float inv = 1.0f / sqrtf(ss / (float)R + eps);
      for (int c = 0; c < R; c++) row[c] = norm_w[c] * (x[c] * inv);
      if (rot)
        rotate_interleaved(x + R, cos + (ptrdiff_t)n * rot, sin + (ptrdiff_t)n * rot, rot, row + R);
      else
        for (int c = 0; c < P; c++) row[R + c] = x[R + c];
    }
    /* the implicit barrier above: every new row is in the cache before any head reads it */
    #pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < N * groups; task++) {
      int n = task / groups, h0 = (task % groups) * HB, G = H - h0 < HB ? H - h0 : HB;
      float qr[HB][P > 0 ? P : 1], acc[HB][R], m[HB], l[HB];
      for (int g = 0; g < G; g++) {
        const float* src = q_rope + (ptrdiff_t)n * ld_q + (ptrdiff_t)(h0 + g) * ld_h;
        if (rot)
          rotate_interleaved(src, cos + (ptrdiff_t)n * rot, sin + (ptrdiff_t)n * rot, rot, qr[g]);
        else
          for (int c = 0; c < P; c++) qr[g][c] = src[c];
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int c = 0; c < R; c++) acc[g][c] = 0.0f;
      }
      int64_t len = kv_seqlens[n];
      for (int64_t t = 0; t < len; t++) {
        int64_t block = block_table[(ptrdiff_t)n * ld_table + t / block_size];
        const float* lr = cache + block * s_block + (t % block_size) * s_pos;
        for (int g = 0; g < G; g++) {
          const float* qc = q_c + ((ptrdiff_t)(h0 + g) * N + n) * R;
          float dot = 0.0f;
          #pragma omp simd reduction(+:dot)
          for (int c = 0; c < R; c++) dot += qc[c] * lr[c];
          for (int c = 0; c < P; c++) dot += qr[g][c] * lr[R + c];
          float score = dot * scale;
          online_softmax_key(score, lr, R, &m[g], &l[g], acc[g]);
        }
      }
      for (int g = 0; g < G; g++) {
        float* o = out + ((ptrdiff_t)(h0 + g) * N + n) * R;
        float il = 1.0f / l[g];
        for (int c = 0; c < R; c++) o[c] = acc[g][c] * il;
      }
    }
  }
  return 0;
}

/* The DeepSeek-V3 router (DeepSeek-V3 technical report, 2024) from its logits: row t of logits
   (stride ld) holds E expert logits; s = sigmoid(logit), choice = s + bias; the topk_group of the
   n_group equal groups with the largest sum of their two best choices are kept, then the k
   experts of the kept groups with the largest choice, in descending choice order (ties: the lower
   id); weights = s of each, divided by (their sum + 1e-20) when norm, times scaling.
   index, weights [T, k]. The caller guarantees groups of at least two experts and
   topk_group * (E / n_group) >= k; 1 <= topk_group <= n_group. */
void lm_group_route(const float* logits, int64_t ld, const float* bias, int T, int E, int n_group, int topk_group,
                    int k, int norm, float scaling, int64_t* index, float* weights, int threads) {
  int per = E / n_group;
  #pragma omp parallel for num_threads(threads) schedule(static) if (T > 1)
  for (int t = 0; t < T; t++) {
    const float* row = logits + (ptrdiff_t)t * ld;
    float s[E], choice[E], gs[n_group];
    unsigned char keep[E], taken[n_group];
    for (int i = 0; i < E; i++) {
      s[i] = 1.0f / (1.0f + expf(-row[i]));
      choice[i] = s[i] + bias[i];
    }
    for (int g = 0; g < n_group; g++) {
      const float* c = choice + (ptrdiff_t)g * per;
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int i = 0; i < per; i++) {
        if (c[i] > b1) {
          b2 = b1;
          b1 = c[i];
        } else if (c[i] > b2) {
          b2 = c[i];
        }
      }
      gs[g] = b1 + b2;
      taken[g] = 0;
    }
    for (int i = 0; i < E; i++) keep[i] = 0;
    for (int j = 0; j < topk_group; j++) {
      int best = -1;
      for (int g = 0; g < n_group; g++)
        if (!taken[g] && (best < 0 || gs[g] > gs[best])) best = g;
      taken[best] = 1;
      for (int i = 0; i < per; i++) keep[best * per + i] = 1;
    }
    float sum = 0.0f;
    int64_t* idx = index + (ptrdiff_t)t * k;
    float* w = weights + (ptrdiff_t)t * k;
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int i = 0; i < E; i++)
        if (keep[i] && (best < 0 || choice[i] > choice[best])) best = i;
      keep[best] = 0;
      idx[j] = best;
      w[j] = s[best];
      sum += s[best];
    }
    for (int j = 0; j < k; j++) w[j] = (norm ? w[j] / (sum + 1e-20f) : w[j]) * scaling;
  }
}

/* A MoE layer of non-gated relu^2 experts (Nemotron-H / Nemotron-3) for T tokens, each routed to
   topk experts: expert e maps a row r to down_e(relu(up_e r)^2), no biases.
   x [T, H]; index, weights [T, topk]; up [E, I, H]; down [E, H, I];
   scratch: pos [T * topk] int64, xs [S, H], h [S, I], ys [S, H] with S = T * topk; out [T, H].
   As lm_swiglu_experts: the (token, slot) pairs are placed by a stable counting sort on the
   expert (pair p = t * topk + j goes to row pos[p] of its expert's run), each expert's rows go
   through both products with matmul_rows_nowait (no barrier between experts), and out[t] is
   weights[t, 0] * y_0 + weights[t, 1] * y_1 + ... summed over the slots in order (the torch
   path's sum over the k choices). Returns -1 (nothing computed) on an expert id out of range. */
int lm_relu2_experts(const float* x, int T, int H, int I, int topk, const int64_t* index, const float* weights,
                     const float* up, const float* down, int E, int64_t* pos, float* xs, float* h, float* ys,
                     float* out, int threads) {
  int S = T * topk;
  int64_t offsets[E + 1];
  if (expert_sort(index, S, E, offsets, pos)) return -1;
  #pragma omp parallel num_threads(threads)
  {
    experts_first_product(x, H, topk, S, pos, xs, offsets, E, up, I, h);
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (ptrdiff_t i = 0; i < (ptrdiff_t)S * I; i++) {
      float r = h[i] < 0.0f ? 0.0f : h[i];   /* torch.square(F.relu(v)), NaN kept: one product */
      h[i] = r * r;
    }
    for (int e = 0; e < E; e++) {
      int rows = (int)(offsets[e + 1] - offsets[e]);
      if (rows)
        matmul_rows_nowait(h + offsets[e] * I, rows, I, I, down + (ptrdiff_t)e * H * I, H, I, ys + offsets[e] * H, H);
    }
    #pragma omp barrier
    experts_weighted_sum(T, H, topk, pos, weights, ys, out);
  }
  return 0;
}

/* Whether index score a ranks before b in the DSA selection: larger first, NaN before any number
   (torch's descending sort); equal scores are not "before", so the earlier pool keeps its place. */
static inline int dsa_before(float a, float b) { return (isnan(a) && !isnan(b)) || a > b; }

/* Checks shared by the DSA decode kernels: -1 a length outside [1, W * block_size], -2 a block id
   the lengths reach outside [0, num_blocks); 0 when fine. */
static int dsa_check(const int64_t* block_table, int64_t ld_table, const int64_t* kv_seqlens, int N, int block_size,
                     int W, int64_t num_blocks) {
  for (int n = 0; n < N; n++) {
    if (kv_seqlens[n] < 1 || kv_seqlens[n] > (int64_t)W * block_size) return -1;
    for (int64_t b = 0; b < (kv_seqlens[n] + block_size - 1) / block_size; b++) {
      int64_t id = block_table[(ptrdiff_t)n * ld_table + b];
      if (id < 0 || id >= num_blocks) return -2;
    }
  }
  return 0;
}

/* The DSA lightning indexer's selection (DeepSeek-V3.2, 2025) for N decode queries, one per
   sequence, at position kv_seqlens[n] - 1. Sequence n's M = kv_seqlens[n] / P complete pools of P
   tokens each (all at or before the query) get
     key_m[c] = sum_j softmax_j(g[mP + j][c] + ape[j][c]) k[mP + j][c]
     score_m  = sum_h w[n, h] relu((q[n, h] . key_m) scale)
   from the cached rows [k (D) | g (D)] (element (block, pos, c) at block * s_block + pos * s_pos +
   c); pools[n] [K] receives the min(K, M) best pools, best first, ties to the lower pool (NaN
   ranks first), then -1. q [N, Hi, D], w [N, Hi] contiguous; scores [N, W * block_size / P]
   scratch. OpenMP over the (sequence, complete pool) pairs for the scores, then over sequences.
   Returns -1 / -2 as dsa_check (nothing written). */
int lm_dsa_select(const float* q, const float* w, const float* keys, int64_t s_block, int64_t s_pos,
                  const float* ape, const int64_t* block_table, int64_t ld_table, const int64_t* kv_seqlens, int N,
                  int Hi, int D, int P, int K, int block_size, int W, int64_t num_blocks, float scale,
                  float* scores, int64_t* pools, int threads) {
  int status = dsa_check(block_table, ld_table, kv_seqlens, N, block_size, W, num_blocks);
  if (status) return status;
  int64_t Mmax = (int64_t)W * block_size / P;
  int64_t first[N + 1];   /* task first[n] + m scores pool m of sequence n: the complete pools only */
  first[0] = 0;
  for (int n = 0; n < N; n++) first[n + 1] = first[n] + kv_seqlens[n] / P;
  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(dynamic, 8)
    for (int64_t task = 0; task < first[N]; task++) {
      int lo = 0, hi = N - 1;   /* the sequence n with first[n] <= task < first[n + 1] */
      while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (first[mid] <= task) lo = mid;
        else hi = mid - 1;
      }
      int n = lo;
      int64_t m = task - first[n];
      float key[D], e[P];
      const float* rows[P];
      for (int j = 0; j < P; j++) {
        int64_t t = m * P + j;
        int64_t block = block_table[(ptrdiff_t)n * ld_table + t / block_size];
        rows[j] = keys + block * s_block + (t % block_size) * s_pos;
      }
      for (int c = 0; c < D; c++) {
        float mx = -INFINITY, sum = 0.0f, acc = 0.0f;
        for (int j = 0; j < P; j++) {
          e[j] = rows[j][D + c] + ape[(ptrdiff_t)j * D + c];
          mx = fmaxf(mx, e[j]);
        }
        for (int j = 0; j < P; j++) {
          e[j] = expf(e[j] - mx);
          sum += e[j];
        }
        for (int j = 0; j < P; j++) acc += (e[j] / sum) * rows[j][c];
        key[c] = acc;
      }
      float s = 0.0f;
      for (int h = 0; h < Hi; h++) {
        const float* qh = q + ((ptrdiff_t)n * Hi + h) * D;
        float dot = 0.0f;
        #pragma omp simd reduction(+:dot)
        for (int c = 0; c < D; c++) dot += qh[c] * key[c];
        float r = dot * scale;
        s += w[(ptrdiff_t)n * Hi + h] * (r > 0.0f ? r : (isnan(r) ? r : 0.0f));
      }
      scores[(ptrdiff_t)n * Mmax + m] = s;
    }
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
      int64_t M = kv_seqlens[n] / P;
      int kept = 0;
      float best[K > 0 ? K : 1];
      int64_t* out = pools + (ptrdiff_t)n * K;
      const float* sc = scores + (ptrdiff_t)n * Mmax;
      for (int64_t m = 0; K && m < M; m++) {  /* insertion into the K best so far, ascending pools */
        float s = sc[m];
        if (kept == K && !dsa_before(s, best[K - 1])) continue;
        int i = kept < K ? kept++ : K - 1;
        while (i > 0 && dsa_before(s, best[i - 1])) {
          best[i] = best[i - 1];
          out[i] = out[i - 1];
          i--;
        }
        best[i] = s;
        out[i] = m;
      }
      for (int i = kept; i < K; i++) out[i] = -1;
    }
  }
  return 0;
}

/* NoPE MLA decode attention in latent space over the DSA selection: head h of sequence n
   (q_c [H, N, R], W_uk folded in) scores the latent rows (cache element (block, pos, c) at block *
   s_block + pos * s_pos + c) of the tokens of its selected pools (pools [N, K] from lm_dsa_select
   or a shared layer's, -1 = none; P tokens each) and, when tail, of the tokens after the last
   complete pool (kv_seqlens[n] / P * P .. kv_seqlens[n] - 1), in position order, by an online
   softmax (Milakov & Gimelshein, 2018): out[h, n] = sum softmax(q_c . latent * scale) latent,
   [H, N, R] (0 when no token is selected; a pool id given twice counts once). OpenMP over
   sequences x groups of up to 8 heads.
   Returns -1 / -2 as dsa_check, -3 on a pool id outside [-1, kv_seqlens[n] / P) (nothing
   written). */
int lm_dsa_attend(const float* q_c, const float* cache, int64_t s_block, int64_t s_pos, const int64_t* block_table,
                  int64_t ld_table, const int64_t* kv_seqlens, const int64_t* pools, int K, int P, int tail, int N,
                  int H, int R, int block_size, int W, int64_t num_blocks, float scale, float* out, int threads) {
  int status = dsa_check(block_table, ld_table, kv_seqlens, N, block_size, W, num_blocks);
  if (status) return status;
  for (int n = 0; n < N; n++)
    for (int i = 0; i < K; i++) {
      int64_t p = pools[(ptrdiff_t)n * K + i];
      if (p < -1 || p >= kv_seqlens[n] / P) return -3;
    }
  enum { HB = 8 };
  int groups = (H + HB - 1) / HB;
  #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int task = 0; task < N * groups; task++) {
    int n = task / groups, h0 = (task % groups) * HB, G = H - h0 < HB ? H - h0 : HB;
    float acc[HB][R], m[HB], l[HB];
    int64_t sel[K > 0 ? K : 1];
    int ns = 0;
    for (int i = 0; i < K; i++) {     /* the selected pools, ascending, each once (insertion sort) */
      int64_t p = pools[(ptrdiff_t)n * K + i];
      if (p < 0) continue;
      int j = ns;
      while (j > 0 && sel[j - 1] > p) j--;
      if (j > 0 && sel[j - 1] == p) continue;   /* a repeated pool id: its tokens are attended once */
      for (int i2 = ns++; i2 > j; i2--) sel[i2] = sel[i2 - 1];
      sel[j] = p;
    }
    for (int g = 0; g < G; g++) {
      m[g] = -INFINITY;
      l[g] = 0.0f;
      for (int c = 0; c < R; c++) acc[g][c] = 0.0f;
    }
    int64_t len = kv_seqlens[n], tail_start = len / P * P;
    int64_t stop = tail && P > 1 ? len - tail_start : 0;
    for (int i = 0; i <= ns; i++) {
      int64_t first = i < ns ? sel[i] * P : tail_start, count = i < ns ? P : stop;
      for (int64_t t = first; t < first + count; t++) {
        int64_t block = block_table[(ptrdiff_t)n * ld_table + t / block_size];
        const float* lr = cache + block * s_block + (t % block_size) * s_pos;
        for (int g = 0; g < G; g++) {
          const float* qc = q_c + ((ptrdiff_t)(h0 + g) * N + n) * R;
          float dot = 0.0f;
          #pragma omp simd reduction(+:dot)
          for (int c = 0; c < R; c++) dot += qc[c] * lr[c];
          float score = dot * scale;
          online_softmax_key(score, lr, R, &m[g], &l[g], acc[g]);
        }
      }
    }
    for (int g = 0; g < G; g++) {
      float* o = out + ((ptrdiff_t)(h0 + g) * N + n) * R;
      float il = l[g] == 0.0f ? 0.0f : 1.0f / l[g];   /* no token selected: 0 (acc is 0) */
      for (int c = 0; c < R; c++) o[c] = acc[g][c] * il;
    }
  }
  return 0;
}
