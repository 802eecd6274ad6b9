/* Native CPU decode step of Kimi Delta Attention; why: the docstring of
 * lmdeploy/pytorch/kernels/kda_native.py. Prototype and the binding rule: kda_native.h.
 * Built with the flags of cpu_native.c (-O3 -march=native -fopenmp -Wall -Wextra). */
#include "kda_native.h"

#include <stddef.h>
#include <stdint.h>

/* One decode token of KDA for N sequences x H heads, the state updated in place (Kimi Team,
   "Kimi Linear: An Expressive, Efficient Attention Architecture", 2025). Per (sequence, head),
   with a = decay [dk] (exp of the per-channel log decay), state S [dk, dv]:

       S' = diag(a) S + k delta^T,   delta = beta (v - (diag(a) S)^T k),   o = S'^T q
          = (diag(a) S)^T q + (q . k) delta

   so S is read twice (both products in one pass, the decay folded into k and q there) and
   written once. kq [N, H, 2, dk]: the key, then the scaled query; v, out [N, H, dv];
   decay [N, H, dk]; beta [N, H]; state element (n, h, i, c) at n * s_slot + h * s_head +
   i * s_row + c. */
void lm_kda_step(const float* kq, const float* v, const float* decay, const float* beta, float* state, int N,
                 int H, int dk, int dv, int64_t s_slot, int64_t s_head, int64_t s_row, float* out, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int p = 0; p < N * H; p++) {
    float* S = state + (ptrdiff_t)(p / H) * s_slot + (ptrdiff_t)(p % H) * s_head;
    const float* k = kq + (ptrdiff_t)p * 2 * dk;
    const float* q = k + dk;
    const float* a = decay + (ptrdiff_t)p * dk;
    const float* vp = v + (ptrdiff_t)p * dv;
    float* o = out + (ptrdiff_t)p * dv;
    float b = beta[p];
    float kv[dv], qv[dv], delta[dv];
    for (int c = 0; c < dv; c++) kv[c] = qv[c] = 0.0f;
    float qk = 0.0f;
    for (int i = 0; i < dk; i++) {
      const float* row = S + (ptrdiff_t)i * s_row;
      float ai = a[i], ki = ai * k[i], qi = ai * q[i];   /* (diag(a) S)^T x = S^T (a * x) */
      qk += q[i] * k[i];
      for (int c = 0; c < dv; c++) {
        kv[c] += row[c] * ki;
        qv[c] += row[c] * qi;
      }
    }
    for (int c = 0; c < dv; c++) delta[c] = b * (vp[c] - kv[c]);
    for (int i = 0; i < dk; i++) {
      float* row = S + (ptrdiff_t)i * s_row;
      float ai = a[i], ki = k[i];
      for (int c = 0; c < dv; c++) row[c] = ai * row[c] + ki * delta[c];
    }
    for (int c = 0; c < dv; c++) o[c] = qv[c] + qk * delta[c];
  }
}
