/* Entry points of the native CPU Kimi Delta Attention kernel (lmdeploy/pytorch/kernels/kda_native.py
 * binds them). Kept apart from cpu_native.h/.c: a library of its own, built and loaded the same
 * way, so the two sources change independently.
 *
 * Every exported function is declared here and only here; kda_native.c includes this header, so
 * the compiler checks each definition against its prototype, and tests/test_kda_native.py checks
 * each prototype against the ctypes argument types kda_native.py binds (_ARGTYPES).
 * Types used: pointers (const or not), int, int64_t, float; results void or int.
 */
#ifndef LMDEPLOY_KDA_NATIVE_H
#define LMDEPLOY_KDA_NATIVE_H

#include <stdint.h>

/* one decode token of KDA (a decay per key channel), state updated in place */
void lm_kda_step(const float* kq, const float* v, const float* decay, const float* beta, float* state, int N,
                 int H, int dk, int dv, int64_t s_slot, int64_t s_head, int64_t s_row, float* out, int threads);

#endif
