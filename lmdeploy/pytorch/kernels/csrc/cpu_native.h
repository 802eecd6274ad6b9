/* Entry points of the native CPU kernels (lmdeploy/pytorch/kernels/cpu_native.py binds them).
 *
 * Every exported function is declared here and only here; cpu_native.c includes this header, so
 * the compiler checks each definition against its prototype, and tests/test_cpu_native.py
 * checks each prototype against the ctypes argument types cpu_native.py binds (_ARGTYPES).
 * Types used: pointers (const or not), int, int64_t, float; results void or int.
 * Each function's contract is documented at its definition in cpu_native.c.
 */
#ifndef LMDEPLOY_CPU_NATIVE_H
#define LMDEPLOY_CPU_NATIVE_H

#include <stdint.h>

/* y [M, N] = x [M, K] w [N, K]^T */
void lm_matmul_rows(const float* x, int M, int K, int64_t ldx, const float* w, int N, int64_t ldw,
                    float* y, int64_t ldy, int threads);

/* y [M, N] = x [M, K] w [N, K]^T in the broadcast form, 1 <= M <= lm_bcast_rows_max(); -1 (y
   untouched) outside that or when the transposed copy of x cannot be allocated */
int lm_matmul_bcast(const float* x, int M, int K, int64_t ldx, const float* w, int N, int64_t ldw, float* y,
                    int64_t ldy, int threads);

/* the most input rows lm_matmul_bcast takes in this build: 64, or 0 in an AVX-512 build */
int lm_bcast_rows_max(void);

/* a whole MoE layer of SwiGLU experts; -1 on an expert id out of range */
int lm_swiglu_experts(const float* x, int T, int H, int I, int topk, const int64_t* index, const float* weights,
                      const float* gate_up, const float* down, int E, int64_t* pos, float* xs, float* h, float* ys,
                      float* out, int threads);

/* lm_swiglu_experts with a limited activation (act 0 plain, 1 clipped, 2 clamped), summed in slot
   order; -1 on an expert id out of range or an unknown act */
int lm_limited_swiglu_experts(const float* x, int T, int H, int I, int topk, const int64_t* index,
                              const float* weights, const float* gate_up, const float* down, int E, int act,
                              float limit, int64_t* pos, float* xs, float* h, float* ys, float* out, int threads);

/* a softmax top-k router and a sigmoid-gated shared expert's activation from one fused product */
void lm_moe_route(const float* proj, int64_t ld, int T, int E, int k, int norm, int I, int64_t* index,
                  float* weights, float* act, int threads);

/* one decode token of the gated delta rule (a decay per head) or KDA (per key channel), state updated in place */
void lm_delta_step(const float* kq, const float* v, const float* decay, int per_channel, const float* beta,
                   float* state, int N, int H, int dk, int dv, int64_t s_slot, int64_t s_head, int64_t s_row,
                   float* out, int threads);

/* the decode step of a Gated DeltaNet layer between its projections (conv, gates, delta rule, gated norm) */
void lm_gdn_decode(const float* proj, int64_t ld_proj, const int64_t* cols, const float* conv_w, float* conv_state,
                   int64_t cs_slot, int64_t cs_chan, const float* A_log, const float* dt_bias, float beta_scale,
                   float* state, int64_t s_slot, int64_t s_head, int64_t s_row, const float* norm_w, float eps,
                   int N, int Hk, int Hv, int dk, int dv, int K, float* work, float* out, int threads);

/* the decode step of a Kimi Delta Attention layer between its projections (convs, gates, delta rule, gated norm) */
void lm_kda_decode(const float* qkv, int64_t ld_qkv, const float* f, int64_t ld_f, const float* b, int64_t ld_b,
                   const float* gate, int64_t ld_gate, const float* q_conv_w, const float* k_conv_w,
                   const float* v_conv_w, float* q_conv, float* k_conv, float* v_conv, int64_t cs_slot,
                   int64_t cs_chan, const float* A_log, const float* dt_bias, int safe_gate, float lower_bound,
                   float* state, int64_t s_slot, int64_t s_head, int64_t s_row, const float* norm_w, float eps,
                   int N, int H, int d, int K, float* out, int threads);

/* lm_gdn_decode over a flat batch of sequences of any lengths, each continuing its state slot */
void lm_gdn_varlen(const float* proj, int64_t ld_proj, const int64_t* cols, const float* conv_w, float* conv_cache,
                   int64_t cs_slot, int64_t cs_chan, const float* A_log, const float* dt_bias, float beta_scale,
                   float* state_cache, int64_t s_slot, int64_t s_head, int64_t s_row, const float* norm_w, float eps,
                   const int64_t* cu, const int64_t* slots, const uint8_t* fresh, int N, int Hk, int Hv, int dk,
                   int dv, int K, float* work, float* out, int threads);

/* one decode token of the Mamba-2 (SSD) recurrence, state updated in place */
void lm_ssd_step(const float* x, const float* dt, const float* A, const float* B, const float* C, const float* D,
                 float* state, int N, int H, int P, int G, int Dn, int64_t s_slot, int64_t s_head, int64_t s_row,
                 float* y, int threads);

/* the decode step of a Mamba-2 layer between its projections (conv, step sizes, SSD, grouped gated norm) */
void lm_mamba2_decode(const float* proj, int64_t ld_proj, const float* conv_w, const float* conv_b,
                      float* conv_state, int64_t cs_slot, int64_t cs_chan, const float* dt_bias, const float* A_log,
                      const float* D, float dt_min, float dt_max, float* state, int64_t s_slot, int64_t s_head,
                      int64_t s_row, const float* norm_w, float eps, int N, int H, int P, int G, int Dn, int K,
                      float* work, float* out, int threads);

/* one decode token of the Mamba-1 selective scan, state updated in place */
void lm_selective_step(const float* x, const float* dt, const float* A, const float* B, const float* C,
                       const float* D, float* state, int M, int Dd, int N, int64_t s_slot, int64_t s_chan,
                       float* y, int threads);

/* one decode token of a depthwise causal convolution, window state updated in place */
void lm_conv_decode_step(const float* x, int64_t ldx, float* state, int64_t s_slot, int64_t s_chan,
                         const float* weight, const float* bias, int N, int C, int K, int silu, float* y,
                         int threads);

/* RMS norm of R rows: plain, zero-centred, or gated by silu(z) */
void lm_rms_norm(const float* x, int64_t R, int D, int64_t ldx, const float* w, float eps, int zero_centered,
                 const float* z, int64_t ldz, float* out, int threads);

/* out = a + b (op 0) or a * b (op 1), n float32 elements (the decode graph's add and mul) */
void lm_binary_f32(const float* a, const float* b, float* out, int64_t n, int op);

/* sum = x + res and the RMS norm of sum in one pass */
void lm_add_rms_norm(const float* x, const float* res, int64_t R, int D, const float* w, float eps, int zero_centered,
                     float* sum, float* out, int threads);

/* q/k RMS norms (optional), a key scale, rotary, the output gate's sigmoid and the K/V store of a
   decode attention layer; -1 (nothing written) on a block id or offset out of range */
int lm_qk_norm_rope_store(const float* proj, int64_t ld, int T, int H, int Hkv, int D, int gated, const float* q_w,
                           const float* k_w, float eps, int zero_centered, float k_scale, const float* cos,
                           const float* sin, int rot, float* q_out, float* gate_out, float* k_cache, float* v_cache,
                           int64_t s_block, int64_t s_pos, int64_t s_head, const int64_t* blocks,
                           const int64_t* offsets, int64_t num_blocks, int block_size, int threads);

/* decode attention over paged keys; -1: a length out of range, -2: a block id out of range */
int lm_paged_decode_attention(const float* q, const float* k_cache, const float* v_cache, int64_t s_block,
                              int64_t s_pos, int64_t s_head, const int64_t* block_table, int64_t ld_table,
                              const int64_t* kv_seqlens, int N, int H, int Hkv, int D, int block_size, int W,
                              int64_t num_blocks, float scale, float* out, int threads);

/* the absorbed decode step of multi-head latent attention: the latent row write (norm, interleaved
   rotary) and the attention in latent space; -1 a write index, -2 a length, -3 a block id out of range */
int lm_mla_decode(const float* q_c, const float* q_rope, int64_t ld_q, int64_t ld_h, const float* kv, int64_t ld_kv,
                  const float* norm_w, float eps, const float* cos, const float* sin, int rot, float* cache,
                  int64_t s_block, int64_t s_pos, const int64_t* blocks, const int64_t* offsets,
                  const int64_t* block_table, int64_t ld_table, const int64_t* kv_seqlens, int N, int H, int R,
                  int P, int block_size, int W, int64_t num_blocks, float scale, float* out, int threads);

/* the DeepSeek-V3 group-limited sigmoid router from its logits */
void lm_group_route(const float* logits, int64_t ld, const float* bias, int T, int E, int n_group, int topk_group,
                    int k, int norm, float scaling, int64_t* index, float* weights, int threads);

/* a whole MoE layer of non-gated relu^2 experts (down(relu(up x)^2)); -1 on an expert id out of range */
int lm_relu2_experts(const float* x, int T, int H, int I, int topk, const int64_t* index, const float* weights,
                     const float* up, const float* down, int E, int64_t* pos, float* xs, float* h, float* ys,
                     float* out, int threads);

/* the DSA lightning indexer's pool selection for decode queries; -1 a length, -2 a block id out of range */
int lm_dsa_select(const float* q, const float* w, const float* keys, int64_t s_block, int64_t s_pos,
                  const float* ape, const int64_t* block_table, int64_t ld_table, const int64_t* kv_seqlens, int N,
                  int Hi, int D, int P, int K, int block_size, int W, int64_t num_blocks, float scale,
                  float* scores, int64_t* pools, int threads);

/* NoPE MLA decode attention in latent space over the DSA selection (pools and the tail); -1 a
   length, -2 a block id, -3 a pool id out of range */
int lm_dsa_attend(const float* q_c, const float* cache, int64_t s_block, int64_t s_pos, const int64_t* block_table,
                  int64_t ld_table, const int64_t* kv_seqlens, const int64_t* pools, int K, int P, int tail, int N,
                  int H, int R, int block_size, int W, int64_t num_blocks, float scale, float* out, int threads);

#endif
