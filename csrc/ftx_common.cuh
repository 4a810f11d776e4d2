// Device helpers shared by the flashtx kernels: dtype conversion and 16-byte vector loads/stores.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

#include "flashtx_cuda.h"

namespace ftx {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Elements in one 16-byte vector.
template <typename T> __host__ __device__ constexpr int vec16() { return 16 / (int)sizeof(T); }

template <int BYTES> struct RawVec;
template <> struct RawVec<4> { using type = unsigned int; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<16> { using type = uint4; };

// N elements of T moved as chunks of up to 16 bytes: PER elements in one raw R load/store.
template <typename T, int N>
struct VecChunks {
  static constexpr int BYTES = N * (int)sizeof(T);
  static constexpr int CHUNK = BYTES < 16 ? BYTES : 16;
  static constexpr int PER = CHUNK / (int)sizeof(T);
  static constexpr int COUNT = N / PER;
  using R = typename RawVec<CHUNK>::type;
};

// Load N elements of T from p (aligned to min(N * sizeof(T), 16) bytes) as floats, with loads of
// up to 16 bytes.
template <typename T, int N>
__device__ __forceinline__ void load_float(const T* p, float (&out)[N]) {
  using V = VecChunks<T, N>;
#pragma unroll
  for (int c = 0; c < V::COUNT; ++c) {
    typename V::R raw = reinterpret_cast<const typename V::R*>(p)[c];
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < V::PER; ++i) out[c * V::PER + i] = to_float(e[i]);
  }
}

// Store N floats to p as T, with stores of up to 16 bytes.
template <typename T, int N>
__device__ __forceinline__ void store_float(T* p, const float (&in)[N]) {
  using V = VecChunks<T, N>;
#pragma unroll
  for (int c = 0; c < V::COUNT; ++c) {
    typename V::R raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < V::PER; ++i) e[i] = from_float<T>(in[c * V::PER + i]);
    reinterpret_cast<typename V::R*>(p)[c] = raw;
  }
}

// Element offset of (row, pos, head) in a tensor with strides st.
__host__ __device__ __forceinline__ long long offset(const ftx_strides& st, long long row, long long pos,
                                                     long long head) {
  return row * st.sb + pos * st.ss + head * st.sh;
}

// 16-byte asynchronous global -> shared copy (sm_80+); zero-fills the 16 bytes when !pred
// (src-size 0: nothing is read from gmem, which must still be a valid address).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int src_size = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The cache capacity of a batch row: max_blocks pages when paged, else cache_len.
__device__ __forceinline__ int cache_capacity(const ftx_cache_map& c) {
  return c.block_table != nullptr ? c.max_blocks * c.cache_len : c.cache_len;
}

// The cache row (contiguous: batch row or cache_batch_idx[b]; paged: block_table page) and slot
// of position `pos` of batch row b; row = -1 when anything is out of range (pos outside
// [0, capacity), a cache_batch_idx or block_table entry outside [0, cache_rows)).
__device__ __forceinline__ void cache_slot(int b, long long pos, const ftx_cache_map& c, int& row, int& slot) {
  row = -1;
  slot = 0;
  if (pos < 0) return;
  if (c.block_table != nullptr) {
    const long long blk = pos / c.cache_len;
    if (blk >= c.max_blocks) return;
    const int page = c.block_table[(long long)b * c.bt_sb + blk];
    if (page < 0 || page >= c.cache_rows) return;
    row = page;
    slot = (int)(pos - blk * c.cache_len);
  } else {
    if (pos >= c.cache_len) return;
    const int r = c.cache_batch_idx != nullptr ? c.cache_batch_idx[b] : b;
    if (r < 0 || r >= c.cache_rows) return;
    row = r;
    slot = (int)pos;
  }
}

}  // namespace ftx
