// flashtx CUDA extension: the torch-free C interface of the kernels in csrc/*.cu.
//
// Every launcher takes a parameter struct and a cudaStream_t, launches asynchronously and returns
// cudaGetLastError() (cudaSuccess, or the launch error; cudaErrorInvalidValue for an
// unsupported dtype/head dim, which the binding refuses before calling). Pointers are device
// pointers; strides are in elements; the last dim of every tensor is contiguous (stride 1) and
// every row start is 16-byte aligned (the binding checks both). Nothing here reads or writes out of
// bounds for any value of cache_seqlens, block_table or cache_batch_idx: out-of-range values are
// guarded in-kernel (see each struct).
#pragma once

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { FTX_FLOAT16 = 0, FTX_BFLOAT16 = 1, FTX_FLOAT32 = 2 } ftx_dtype;

// Strides in elements of the first three dims of a (rows, positions, heads, D) tensor.
typedef struct {
  long long sb, ss, sh;
} ftx_strides;

// Where position `pos` of batch row b lives in a KV cache of (cache_rows, cache_len, Hkv, D):
//   contiguous (cache_rows = B_cache, cache_len = S_cache): row cache_batch_idx[b] (b if NULL),
//                slot pos; capacity cache_len
//   paged      (cache_rows = num_blocks, cache_len = page_size): page
//                block_table[b * bt_sb + pos / page_size] (block_table (B, max_blocks) int32),
//                slot pos % page_size; capacity max_blocks * cache_len
//   cache_seqlens (B,) int32: the keys in use (decode) or where the append starts (rotary)
// block_table and cache_batch_idx are never both set. Out-of-range entries are guarded in the
// kernels (ftx::cache_slot): see each launcher.
typedef struct {
  const int* cache_seqlens;
  const int* block_table;
  const int* cache_batch_idx;
  long long bt_sb;
  int cache_rows, cache_len, max_blocks;
} ftx_cache_map;

// Split-KV decode attention with GQA packing, flash-attn 2's flash_attn_with_kvcache semantics
// (without the append; see ftx_rotary_append).
//   q            (B, Sq, Hq, D), strides q_st
//   k/v cache    (cache_rows, cache_len, Hkv, D), strides k_st / v_st, mapped by `cache`:
//                keys [0, cache_seqlens[b]) of batch row b are attended
//   out          (B, Sq, Hq, D) contiguous, dtype of q
//   lse          (B, Hq, Sq) float32, natural log; -inf (and out = 0) for a row with no key
//   out_partial  (num_splits, B, Hq, Sq, D) float32 and lse_partial (num_splits, B, Hq, Sq)
//                float32 (log2 units): workspace, needed when num_splits > 1, else NULL
// Causal is bottom-right: query i sees keys j <= cache_seqlens[b] - Sq + i.
// Guards: cache_seqlens[b] is clamped to [0, capacity]; a cache_batch_idx outside
// [0, cache_rows) makes that batch row empty (out 0, lse -inf); a block_table entry outside
// [0, cache_rows) masks its keys.
typedef struct {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  float* lse;
  float* out_partial;
  float* lse_partial;
  ftx_strides q_st, k_st, v_st;
  ftx_cache_map cache;
  int B, Sq, Hq, Hkv, D;
  int num_splits;
  float softmax_scale;
  int causal;
  ftx_dtype dtype;
} ftx_decode_params;

// Blocks of the grid a launch uses per split (B * Hkv * row chunks): the Python num_splits
// heuristic computes the same number (flashtx.cuda_ext.decode_ctas).
int ftx_decode_rows_per_cta(int group_rows);
cudaError_t ftx_decode_attention(const ftx_decode_params* p, cudaStream_t stream);

// Fused rotary embedding + KV-cache append (vLLM rotary_embedding + reshape_and_cache_flash).
//   q (B, Sq, Hq, D), strides q_st, or NULL (Hq = 0); q_out (B, Sq, Hq, D) contiguous: q rotated
//   k, v (B, Sq, Hkv, D), strides k_st / v_st: k rotated and v copied into the caches
//   (strides kc_st / vc_st, mapped by `cache`) at position cache_seqlens[b] + i
//   cos, sin (S_rot, rotary_dim / 2) contiguous, float32 (cos_f32 = 1) or the dtype of q;
//   NULL with rotary_dim = 0 to append without rotating
//   interleaved: 0 rotates (x[j], x[j + rotary_dim/2]) (NeoX), 1 rotates (x[2j], x[2j+1]) (GPT-J)
//   q_causal: 1 rotates q at cache_seqlens[b] + i, 0 at cache_seqlens[b] for all i (flash-attn)
// Guards: a position outside [0, capacity) is not written; a block_table entry or
// cache_batch_idx outside [0, cache_rows) is not written; a rotary position outside
// [0, S_rot) rotates by angle 0 (identity). The binding can check all of these (check_values).
typedef struct {
  const void* q;
  const void* k;
  const void* v;
  void* q_out;
  void* k_cache;
  void* v_cache;
  const void* cos;
  const void* sin;
  ftx_strides q_st, k_st, v_st, kc_st, vc_st;
  ftx_cache_map cache;
  int B, Sq, Hq, Hkv, D;
  int rotary_dim, S_rot, cos_f32;
  int interleaved, q_causal;
  ftx_dtype dtype;
} ftx_rotary_append_params;

cudaError_t ftx_rotary_append(const ftx_rotary_append_params* p, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
