"""Native CPU kernels for float32 decode steps.

Why: a decode step of a few sequences is memory-bound on CPU (the weights stream from memory
once per step; this machine reads 27-28 GB/s with both cores) and pays a few microseconds per
torch op, of which a hybrid MoE layer issues dozens. MKL's single-precision GEMM reads a weight
at full speed for 1-3 input rows but at 14-17 GB/s from 4 to 48 rows (it packs the weight
first), and each MoE expert costs a dozen small torch ops around its two products. The kernels
here, each one call per layer per step:

- :func:`matmul_rows`: ``x W^T`` as blocked dot products that read each weight row once for all
  input rows (4 weight rows x 4 input rows per register block), used by
  :func:`~.linear.linear` for :data:`NATIVE_ROWS`;
- :func:`swiglu_experts_native`: a whole MoE layer (sort by expert, gate/up, SwiGLU, down,
  weighted sum per token) in one OpenMP region with no barrier between experts;
- :func:`gated_delta_step_native`: the delta-rule decode step in one pass over the state;
- :func:`conv_decode_step_native`: the causal-conv decode step (window shift in place);
- :func:`rms_norm_native`: RMS norm, plain, zero-centred or gated, in one pass;
- :func:`paged_decode_attention_native`: decode attention reading each cached key/value row
  once per KV head group, online softmax, no gathered copy.

Measured on the 2-core benchmark machine (weights streamed from memory, not cache, best of 3):

    dense decode projections of the 99M benchmark model, 185 MB, by input rows:
        rows     1     2     3     4     8    16    32
        torch  6.5   6.8   6.9  10.6  11.8  12.6  16.0 ms   (MKL, in the faster orientation)
        native 6.5   6.9   7.5   7.5   8.5  11.7  17.4 ms
    MoE experts of a batch-16 step (8 layers, 16 experts, top-2; ~670 MB): torch 33.5, native 29.0 ms
    a whole batch-16 decode step: torch kernels 67 ms, native 55 ms (same process, interleaved)

so :func:`~.linear.linear` uses it for 4-24 rows (:data:`NATIVE_ROWS`) (MKL keeps 1-3 and more).

Built from the C source below with the system C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``; ``-O3 -march=native -fopenmp``) when a CPU engine starts (and on first use elsewhere),
into ``kernels`` under :func:`~lmdeploy.pytorch.config.cache_root` (``$LMDEPLOY_CACHE_DIR``, else
``$XDG_CACHE_HOME/lmdeploy``, else ``~/.cache/lmdeploy``), else a folder of the user's in the
system temporary folder; one file per source and CPU. The library runs in
this process, so only a :func:`_trusted_folder` is used and only a private file is loaded
(:func:`_load`). It links the OpenMP runtime by its standard name, so in a process where
``torch`` is imported it shares torch's own thread pool. Without a compiler, on a build error,
or with ``LMDEPLOY_CPU_KERNELS=0`` the torch implementations run (:func:`native_library`
returns ``None``; the reason is logged once at INFO). float32 only, except the delta-rule step,
whose state is float32 in every model dtype.

The dot products sum in a different order than MKL: results agree with the torch path to
float32 rounding (relative ~1e-7), not bit for bit.
"""
from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading

import torch

from ..config import cache_root

__all__ = ['CALLS', 'native_library', 'matmul_rows', 'swiglu_experts_native', 'NATIVE_ROWS',
           'NATIVE_EXPERT_TOKENS', 'gated_delta_step_native',
           'conv_decode_step_native', 'rms_norm_native',
           'paged_decode_attention_native']

logger = logging.getLogger('lmdeploy')

# input rows for which linear() uses the native product (float32, CPU); see the module docstring
NATIVE_ROWS = range(4, 25)
# tokens up to which a MoE layer runs the native experts kernel (decode steps; prefill chunks
# have many rows per expert, where MKL's packed GEMM is the faster one)
NATIVE_EXPERT_TOKENS = 64

_SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>
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

#define DOT_CASE(n, m) case (n) * 8 + (m): dot_block_nm(x, ldx, w, ldw, K, y, ldy, n, m); break;
#define DOT_ROW(n) DOT_CASE(n, 1) DOT_CASE(n, 2) DOT_CASE(n, 3) DOT_CASE(n, 4)

/* dot_block_nm for 1 <= nb, mb <= 4, one specialised body per shape */
static void dot_block(const float* x, ptrdiff_t ldx, int mb, const float* w, ptrdiff_t ldw, int nb, int K,
                      float* y, ptrdiff_t ldy) {
  switch (nb * 8 + mb) {
    DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4)
  }
}

/* inside a parallel region: y [M, N] = x [M, K] w[N, K]^T, weight rows split over the threads,
   no barrier at the end */
static void matmul_rows_nowait(const float* x, int M, int K, ptrdiff_t ldx, const float* w, int N, ptrdiff_t ldw,
                               float* y, ptrdiff_t ldy) {
  #pragma omp for schedule(static) nowait
  for (int n0 = 0; n0 < N; n0 += NB) {
    int nb = N - n0 < NB ? N - n0 : NB;
    for (int m0 = 0; m0 < M; m0 += MB) {
      int mb = M - m0 < MB ? M - m0 : MB;
      dot_block(x + m0 * ldx, ldx, mb, w + n0 * ldw, ldw, nb, K, y + m0 * ldy + n0, ldy);
    }
  }
}

void lm_matmul_rows(const float* x, int M, int K, int64_t ldx, const float* w, int N, int64_t ldw,
                    float* y, int64_t ldy, int threads) {
  #pragma omp parallel num_threads(threads)
  matmul_rows_nowait(x, M, K, ldx, w, N, ldw, y, ldy);
}

/* A MoE layer of SwiGLU experts for T tokens, each routed to topk experts.
   x [T, H]; index, weights [T, topk]; gate_up [E, 2I, H] (gate rows first); down [E, H, I];
   scratch: pos [T * topk] int64, xs [S, H], h [S, 2I], ys [S, H] with S = T * topk; out [T, H].
   Pairs (token, slot) are placed by a stable counting sort on the expert; out[t] is the sum over
   the slots in order of weights[t, j] * expert_j(x[t]). Returns -1 on an expert id out of range. */
int lm_swiglu_experts(const float* x, int T, int H, int I, int topk, const int64_t* index, const float* weights,
                      const float* gate_up, const float* down, int E, int64_t* pos, float* xs, float* h, float* ys,
                      float* out, int threads) {
  int S = T * topk;
  int64_t offsets[E + 1];
  for (int e = 0; e <= E; e++) offsets[e] = 0;
  for (int p = 0; p < S; p++) {
    if (index[p] < 0 || index[p] >= E) return -1;
    offsets[index[p] + 1]++;
  }
  for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
  int64_t fill[E];
  for (int e = 0; e < E; e++) fill[e] = offsets[e];
  for (int p = 0; p < S; p++) pos[p] = fill[index[p]]++;
  ptrdiff_t H2 = 2 * (ptrdiff_t)I;
  #pragma omp parallel num_threads(threads)
  {
    #pragma omp for schedule(static)
    for (int p = 0; p < S; p++) memcpy(xs + pos[p] * H, x + (ptrdiff_t)(p / topk) * H, sizeof(float) * H);
    for (int e = 0; e < E; e++) {
      int rows = (int)(offsets[e + 1] - offsets[e]);
      if (rows)
        matmul_rows_nowait(xs + offsets[e] * H, rows, H, H, gate_up + (ptrdiff_t)e * H2 * H, (int)H2, H,
                           h + offsets[e] * H2, H2);
    }
    #pragma omp barrier
    #pragma omp for schedule(static)
    for (int s = 0; s < S; s++) {
      float* row = h + s * H2;
      for (int i = 0; i < I; i++) {
        float g = row[i];
        row[i] = g / (1.0f + expf(-g)) * row[I + i];
      }
    }
    for (int e = 0; e < E; e++) {
      int rows = (int)(offsets[e + 1] - offsets[e]);
      if (rows)
        matmul_rows_nowait(h + offsets[e] * H2, rows, I, H2, down + (ptrdiff_t)e * H * I, H, I,
                           ys + offsets[e] * H, H);
    }
    #pragma omp barrier
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
  return 0;
}

/* One decode token of the gated delta rule for each of N sequences x H heads, state updated in
   place: S <- g S + k (beta (v - g S^T k))^T, o = (g S + k delta^T)^T q = g S^T q + (q . k) delta.
   kq [N, H, 2, dk]: the key row, then the (scaled) query row; v, out [N, H, dv]; decay (= exp(g)),
   beta [N, H]; state element (n, h, i, c) at n * s_slot + h * s_head + i * s_row + c. The state is
   read once from memory; the update pass finds it in cache (one head's dk x dv block). */
void lm_gated_delta_step(const float* kq, const float* v, const float* decay, const float* beta, float* state,
                         int N, int H, int dk, int dv, int64_t s_slot, int64_t s_head, int64_t s_row, float* out,
                         int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < N * H; p++) {
    float* S = state + (ptrdiff_t)(p / H) * s_slot + (ptrdiff_t)(p % H) * s_head;
    const float* k = kq + (ptrdiff_t)p * 2 * dk;
    const float* q = k + dk;
    const float* vp = v + (ptrdiff_t)p * dv;
    float* o = out + (ptrdiff_t)p * dv;
    float g = decay[p], b = beta[p];
    float kv[dv], qv[dv], delta[dv];
    for (int c = 0; c < dv; c++) kv[c] = qv[c] = 0.0f;
    float qk = 0.0f;
    for (int i = 0; i < dk; i++) {
      const float* row = S + (ptrdiff_t)i * s_row;
      float ki = k[i], qi = q[i];
      qk += qi * ki;
      for (int c = 0; c < dv; c++) {
        kv[c] += row[c] * ki;
        qv[c] += row[c] * qi;
      }
    }
    for (int c = 0; c < dv; c++) delta[c] = b * (vp[c] - g * kv[c]);
    for (int i = 0; i < dk; i++) {
      float* row = S + (ptrdiff_t)i * s_row;
      float ki = k[i];
      for (int c = 0; c < dv; c++) row[c] = g * row[c] + ki * delta[c];
    }
    for (int c = 0; c < dv; c++) o[c] = g * qv[c] + qk * delta[c];
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
      float xv = x[(ptrdiff_t)n * ldx + c];
      float acc = 0.0f;
      for (int j = 0; j < K - 1; j++) acc += w[j] * s[j];
      acc += w[K - 1] * xv;
      for (int j = 0; j + 1 < K - 1; j++) s[j] = s[j + 1];
      if (K > 1) s[K - 2] = xv;
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

/* One query token per sequence against its paged keys: for each sequence n and KV head, the G =
   H / Hkv query heads of the group read each cached key and value row once, with a running
   (online) softmax: m = max score so far, l = sum exp(score - m), acc = sum exp(score - m) v.
   q, out [N, H, D] contiguous; cache element (block, pos, head, d) at block * s_block + pos *
   s_pos + head * s_head + d; block_table [N, W] (row stride ld_table); kv_seqlens [N]. Returns -1
   (and computes nothing) when a length is outside [1, W * block_size], -2 when a block id the
   lengths reach is outside [0, num_blocks). */
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
    float acc[G][D], m[G], l[G], sc[G];
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
        if (fmaxf(m[g], score) == -INFINITY) continue;   /* weight exp(-inf) = 0 so far: skip it (no -inf - -inf) */
        if (score > m[g]) {
          float correction = expf(m[g] - score);   /* 0 for the first key (m = -inf) */
          l[g] *= correction;
          for (int d = 0; d < D; d++) acc[g][d] *= correction;
          m[g] = score;
        }
        sc[g] = expf(score - m[g]);
        l[g] += sc[g];
        for (int d = 0; d < D; d++) acc[g][d] += sc[g] * vr[d];
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
"""

# native kernel calls made in this process, by kernel (the benchmark's op profile reads it)
CALLS: collections.Counter = collections.Counter()

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _trusted_folder(path: str) -> bool:
    """True when ``path`` is a real folder (not a symlink) owned by this user that nobody else
    can write, below ancestors that no other user can rename it out of (each ancestor is owned
    by this user or root, or is not writable by others, or has the sticky bit). A library loaded
    from it runs in this process, so nobody else may be able to put one there."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return False
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            pst = os.stat(parent)
        except OSError:
            return False
        if pst.st_uid not in (0, os.getuid()) and pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            return False
        up = os.path.dirname(parent)
        if up == parent:
            return True
        parent = up


def _candidate_folders():
    """Yield ``kernels`` under :func:`~lmdeploy.pytorch.config.cache_root`, then a folder of
    this user's in the system temporary folder — created (mode 0700) only when the caller asks
    for it, that is when the first one did not serve, so a normal run leaves nothing in /tmp —
    each kept only when :func:`_trusted_folder`."""
    for path in (str(cache_root() / 'kernels'), os.path.join(tempfile.gettempdir(), f'lmdeploy-kernels-{os.getuid()}')):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError:
            pass
        if _trusted_folder(path):
            yield path


def _cpu_flags() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith(('flags', 'Features')):
                    return line
    except OSError:
        pass
    return platform.processor()


_ARGTYPES = {   # C signature of each entry point: (argument types, result type)
    'lm_matmul_rows': ('p i32 i32 i64 p i32 i64 p i64 i32', None),
    'lm_swiglu_experts': ('p i32 i32 i32 i32 p p p p i32 p p p p p i32', 'i32'),
    'lm_gated_delta_step': ('p p p p p i32 i32 i32 i32 i64 i64 i64 p i32', None),
    'lm_conv_decode_step': ('p i64 p i64 i64 p p i32 i32 i32 i32 p i32', None),
    'lm_rms_norm': ('p i64 i32 i64 p f32 i32 p i64 p i32', None),
    'lm_paged_decode_attention': ('p p p i64 i64 i64 p i64 p i32 i32 i32 i32 i32 i32 i64 f32 p i32', 'i32'),
}
_CTYPES = {'p': ctypes.c_void_p, 'i32': ctypes.c_int, 'i64': ctypes.c_int64, 'f32': ctypes.c_float}
_FLAGS = ['-O3', '-march=native', '-fopenmp', '-shared', '-fPIC', '-std=gnu11']


def _library_name() -> str:
    """File name of this source's library: it depends on the source, the flags and the CPU it is
    tuned for, not on which compiler built it."""
    key = hashlib.sha256('\0'.join([_SOURCE, ' '.join(_FLAGS), platform.machine(), _cpu_flags()]).encode())
    return f'cpu_native_{key.hexdigest()[:20]}.so'


def _compile(path: str) -> str | None:
    """Compile the source to ``path`` (atomically: concurrent builders each install a whole
    file); the reason on failure, None on success. Other versions' libraries in the folder are
    removed (a process that loaded one keeps its mapping)."""
    cc = os.environ.get('CC') or next((c for c in ('cc', 'gcc', 'clang') if shutil.which(c)), None)
    if cc is None:
        return 'no C compiler: set CC or install gcc'
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(suffix='.so', dir=folder)
    os.close(fd)
    src = tmp[:-3] + '.c'
    try:
        with open(src, 'w') as f:
            f.write(_SOURCE)
        try:
            done = subprocess.run([cc, *_FLAGS, src, '-o', tmp, '-lm'], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            return f'{cc}: {err}'
        if done.returncode != 0:
            return f'{cc} failed: {done.stderr.strip()[:800]}'   # the first errors are the telling ones
        os.chmod(tmp, 0o700)
        os.replace(tmp, path)
    finally:
        for leftover in (src, tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)
    for name in os.listdir(folder):
        if name.startswith('cpu_native_') and name.endswith('.so') and name != os.path.basename(path):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass
    return None


def _load(path: str) -> ctypes.CDLL:
    """Load ``path`` when it is a regular file (not a symlink) of this user's that nobody else
    can write; it lies in a :func:`_trusted_folder`, so nobody else can replace it between this
    check and the load."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f'{path} is not a private file of this user')
    lib = ctypes.CDLL(path)
    for name, (args, result) in _ARGTYPES.items():
        fn = getattr(lib, name)    # AttributeError: a library of another version
        fn.argtypes = [_CTYPES[a] for a in args.split()]
        fn.restype = _CTYPES[result] if result else None
    return lib


def _build() -> ctypes.CDLL | None:
    """Load the library from the first cache folder that has it, else compile it into the first
    folder where it then loads (a folder mounted noexec does not); None with the reasons logged
    once at INFO."""
    if os.environ.get('LMDEPLOY_CPU_KERNELS', '1') == '0':
        logger.info('native CPU kernels unavailable (switched off: LMDEPLOY_CPU_KERNELS=0): torch kernels run')
        return None
    reasons, tried = [], False
    for folder in _candidate_folders():
        tried = True
        path = os.path.join(folder, _library_name())
        try:
            if os.path.exists(path):
                lib = _load(path)
            elif not os.access(folder, os.W_OK):
                reasons.append(f'{folder}: not writable')
                continue
            else:
                failure = _compile(path)
                if failure is not None:
                    reasons.append(failure)
                    break          # a compiler problem: another folder would not help
                lib = _load(path)
        except Exception as err:   # noqa: BLE001  (a broken or foreign library: next folder, then torch)
            reasons.append(f'{path}: {err}')
            continue
        logger.info('native CPU kernels loaded from %s%s', path,
                    f' (passed over: {"; ".join(reasons)})' if reasons else '')
        return lib
    if not tried:
        logger.info('native CPU kernels unavailable (no private cache folder: set LMDEPLOY_CACHE_DIR to a folder '
                    'only you can write): torch kernels run')
        return None
    logger.info('native CPU kernels unavailable (%s): torch kernels run', '; '.join(reasons))
    return None


def native_library() -> ctypes.CDLL | None:
    """The loaded native library, built on the first call (thread-safe); ``None`` when it
    cannot be built or ``LMDEPLOY_CPU_KERNELS=0`` (decided once per process)."""
    global _LIB, _TRIED
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                try:
                    _LIB = _build()
                except Exception as err:   # noqa: BLE001  (never fail the engine over an optional speed-up)
                    logger.info('native CPU kernels unavailable (%s): torch kernels run', err)
                    _LIB = None
                _TRIED = True
    return _LIB


def _plain(t: torch.Tensor) -> bool:
    """float32 on CPU, not part of an autograd graph."""
    return t.dtype == torch.float32 and t.device.type == 'cpu' and not (torch.is_grad_enabled() and t.requires_grad)


def matmul_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight^T`` by the native kernel, or ``None`` when it does not apply.

    Args:
        x: float32 ``[M, K]``, unit stride along K (any row stride).
        weight: float32 ``[N, K]``, unit stride along K.

    Returns:
        float32 ``[M, N]``, contiguous; ``None`` for other dtypes, devices, shapes or strides,
        inside autograd, or without the library.
    """
    if not (x.dim() == 2 and weight.dim() == 2 and _plain(x) and _plain(weight) and x.stride(1) == 1
            and weight.stride(1) == 1 and x.shape[1] == weight.shape[1]):
        return None
    lib = native_library()
    if lib is None:
        return None
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if M and N:
        CALLS['matmul_rows'] += 1
        lib.lm_matmul_rows(x.data_ptr(), M, K, x.stride(0), weight.data_ptr(), N, weight.stride(0), y.data_ptr(),
                           N, torch.get_num_threads())
    return y


def swiglu_experts_native(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor | None:
    """A whole MoE expert layer in one native call, or ``None`` when it does not apply.

    ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
    ``e = index[t, j]``, summed over ``j`` in order (the order of the torch path).

    Args:
        x: ``[T, H]``.
        index: int64 ``[T, k]`` expert ids in ``[0, E)``.
        weights: ``[T, k]`` routing weights.
        gate_up: ``[E, 2I, H]`` gate rows first, then up rows.
        down: ``[E, H, I]``.

    Returns:
        float32 ``[T, H]``; ``None`` unless every tensor is float32 on CPU outside autograd,
        ``1 <= T <= NATIVE_EXPERT_TOKENS``, and the library is available.

    Raises:
        ValueError: an expert id out of range, or inconsistent shapes.
    """
    T = x.shape[0]
    if not (1 <= T <= NATIVE_EXPERT_TOKENS and all(_plain(t) for t in (x, weights, gate_up, down))
            and index.dtype == torch.int64 and index.device.type == 'cpu'):
        return None
    lib = native_library()
    if lib is None:
        return None
    E, two_i, H = gate_up.shape
    topk = index.shape[1] if index.dim() == 2 else 0
    if (x.shape != (T, H) or index.shape != (T, topk) or weights.shape != (T, topk) or not topk or two_i % 2
            or down.shape != (E, H, two_i // 2)):
        raise ValueError(f'expected x [T, H], index and weights [T, k], gate_up [E, 2I, H], down [E, H, I]; got '
                         f'{tuple(x.shape)}, {tuple(index.shape)}, {tuple(weights.shape)}, {tuple(gate_up.shape)}, '
                         f'{tuple(down.shape)}')
    x, index, weights, gate_up, down = (t.contiguous() for t in (x, index, weights, gate_up, down))
    S = T * topk
    pos = torch.empty(S, dtype=torch.int64)
    xs = torch.empty(S, H, dtype=torch.float32)
    h = torch.empty(S, two_i, dtype=torch.float32)
    ys = torch.empty(S, H, dtype=torch.float32)
    out = torch.empty(T, H, dtype=torch.float32)
    CALLS['swiglu_experts'] += 1
    if lib.lm_swiglu_experts(x.data_ptr(), T, H, two_i // 2, topk, index.data_ptr(), weights.data_ptr(),
                             gate_up.data_ptr(), down.data_ptr(), E, pos.data_ptr(), xs.data_ptr(), h.data_ptr(),
                             ys.data_ptr(), out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f'expert index out of range [0, {E})')
    return out


def gated_delta_step_native(kq: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor) -> torch.Tensor | None:
    """One decode token of the gated delta rule for ``N`` sequences, the state updated in place,
    or ``None`` when the native kernel does not apply (the caller runs torch).

    ``S <- decay S + k delta^T`` with ``delta = beta (v - decay S^T k)``; the output
    ``decay S^T q + (q . k) delta`` equals ``q`` read against the updated state (gated delta
    rule: Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, eq. 10).

    Args:
        kq: float32 ``[N, H, 2, dk]``: L2-normalised key, then the scaled query.
        v: ``[N, H, dv]``.
        decay: ``[N, H]`` state multipliers ``exp(g)``.
        beta: ``[N, H]`` write strengths.
        state: float32 ``[N, H, dk, dv]`` with unit stride along ``dv`` (a view of the cache's
            rows is fine); updated in place.

    Returns:
        float32 ``o [N, H, dv]``, or ``None`` (dtype, device, strides, autograd, or no library).
    """
    N, H, dk, dv = state.shape
    if not (all(_plain(t) for t in (kq, v, decay, beta, state)) and state.stride(-1) == 1
            and kq.shape == (N, H, 2, dk) and v.shape == (N, H, dv) and decay.shape == beta.shape == (N, H)):
        return None
    lib = native_library()
    if lib is None:
        return None
    kq, v, decay, beta = (t.contiguous() for t in (kq, v, decay, beta))
    out = torch.empty(N, H, dv, dtype=torch.float32)
    if N:
        CALLS['gated_delta_step'] += 1
        lib.lm_gated_delta_step(kq.data_ptr(), v.data_ptr(), decay.data_ptr(), beta.data_ptr(), state.data_ptr(), N,
                                H, dk, dv, state.stride(0), state.stride(1), state.stride(2), out.data_ptr(),
                                torch.get_num_threads())
    return out


def conv_decode_step_native(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            silu: bool) -> torch.Tensor | None:
    """One decode token of a depthwise causal convolution for ``N`` sequences, the window
    state updated in place, or ``None`` when the native kernel does not apply.

    Args:
        x: float32 ``[N, C]`` (unit stride along C).
        state: float32 ``[N, C, K - 1]``, the last ``K - 1`` inputs per channel, unit stride
            along the window (a view of the cache's rows is fine); becomes the window shifted
            by ``x``.
        weight: float32 ``[C, K]``; bias: float32 ``[C]`` or ``None``.
        silu: apply ``y * sigmoid(y)``.

    Returns:
        float32 ``y [N, C]``, or ``None`` (dtype, device, strides, autograd, or no library).
    """
    N, C = x.shape
    K = weight.shape[1]
    tensors = (x, state, weight) + (() if bias is None else (bias,))
    if not (all(_plain(t) for t in tensors) and x.stride(1) == 1 and state.shape == (N, C, K - 1)
            and (K == 1 or state.stride(2) == 1) and weight.shape == (C, K) and (bias is None or bias.shape == (C,))):
        return None
    lib = native_library()
    if lib is None:
        return None
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty(N, C, dtype=torch.float32)
    if N and C:
        CALLS['conv_decode_step'] += 1
        lib.lm_conv_decode_step(x.data_ptr(), x.stride(0), state.data_ptr(), state.stride(0), state.stride(1),
                                weight.data_ptr(), None if bias is None else bias.data_ptr(), N, C, K, int(silu),
                                y.data_ptr(), torch.get_num_threads())
    return y


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool,
                    gate: torch.Tensor | None = None) -> torch.Tensor | None:
    """Root-mean-square norm (Zhang & Sennrich, 2019) over the last dim in one native pass, or
    ``None`` when it does not apply.

    ``h = x / sqrt(mean(x^2) + eps)``; the result is ``h * (1 + weight)`` when ``zero_centered``
    (Qwen3-Next's stored ``w - 1``), else ``weight * h``; times ``silu(gate)`` when a gate is given
    (the gated norm of Gated DeltaNet's output).

    Args:
        x: float32 ``[..., D]``.
        weight: float32 ``[D]``.
        eps: added to the mean square.
        zero_centered: the weight convention above.
        gate: float32, the shape of ``x``, or ``None``.

    Returns:
        float32 tensor of ``x``'s shape (contiguous), or ``None`` (dtype, device, autograd, shape,
        or no library).
    """
    D = x.shape[-1]
    if not (x.dim() >= 1 and D and weight.shape == (D,) and _plain(x) and _plain(weight)
            and (gate is None or (gate.shape == x.shape and _plain(gate)))):
        return None
    lib = native_library()
    if lib is None:
        return None
    x2 = x.reshape(-1, D)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    g2 = None
    if gate is not None:
        g2 = gate.reshape(-1, D)
        if g2.stride(1) != 1:
            g2 = g2.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    if x2.shape[0]:
        CALLS['rms_norm'] += 1
        lib.lm_rms_norm(x2.data_ptr(), x2.shape[0], D, x2.stride(0), weight.data_ptr(), eps, int(zero_centered),
                        None if g2 is None else g2.data_ptr(), 0 if g2 is None else g2.stride(0), out.data_ptr(),
                        torch.get_num_threads())
    return out


def paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_table: torch.Tensor, kv_seqlens: torch.Tensor,
                                  scale: float) -> torch.Tensor | None:
    """One query token per sequence against its paged keys (softmax attention with an online
    softmax, Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018), or
    ``None`` when the native kernel does not apply.

    Args:
        q: float32 ``[N, H, D]``.
        k_cache, v_cache: float32 ``[num_blocks, block_size, Hkv, D]`` with unit stride along D
            and equal strides (views into the cache's byte rows are fine).
        block_table: int64 ``[N, W]``; kv_seqlens: int64 ``[N]``, each in ``[1, W * block_size]``.
        scale: softmax scale.

    Returns:
        float32 ``[N, H, D]``, or ``None`` (dtype, device, strides, shapes, or no library).

    Raises:
        ValueError: a ``kv_seqlens`` entry outside ``[1, W * block_size]``, or a block id outside
            ``[0, num_blocks)`` among the blocks the lengths reach.
    """
    N, H, D = q.shape
    nb, bs, Hkv, Dk = k_cache.shape
    if not (all(_plain(t) for t in (q, k_cache, v_cache)) and Dk == D and v_cache.shape == k_cache.shape
            and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and Hkv and H % Hkv == 0
            and block_table.dtype == kv_seqlens.dtype == torch.int64 and block_table.dim() == 2
            and block_table.shape[0] == N and kv_seqlens.shape == (N,) and block_table.device.type == 'cpu'
            and kv_seqlens.device.type == 'cpu'):
        return None
    lib = native_library()
    if lib is None:
        return None
    q, block_table, kv_seqlens = q.contiguous(), block_table.contiguous(), kv_seqlens.contiguous()
    out = torch.empty(N, H, D, dtype=torch.float32)
    CALLS['paged_decode_attention'] += bool(N)
    status = N and lib.lm_paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                                 block_table.data_ptr(), block_table.stride(0), kv_seqlens.data_ptr(),
                                                 N, H, Hkv, D, bs, block_table.shape[1], nb, scale, out.data_ptr(),
                                                 torch.get_num_threads())
    if status == -1:
        raise ValueError(f'kv_seqlens must be in [1, {block_table.shape[1] * bs}]; got {kv_seqlens.tolist()}')
    if status == -2:
        raise ValueError(f'block_table holds a block id outside [0, {nb}) within kv_seqlens')
    return out
