// Fused rotary embedding + KV-cache append (vLLM's rotary_embedding + reshape_and_cache_flash,
// flash-attn's flash_attn_with_kvcache with k, v, rotary_cos, rotary_sin). Torch-free; launched
// through ftx_rotary_append (flashtx_cuda.h).
//
// One block of 128 threads per new token (b, i). Its threads walk 16-byte vectors of the token's
// q heads (rotated -> q_out), k heads (rotated -> cache) and v heads (copied -> cache), one vector
// per step. NeoX style: the thread of a vector in the first half of the rotary dims also reads and
// writes its partner rotary_dim / 2 columns on; interleaved: the pairs sit inside the vector.
// Columns past rotary_dim pass through. Math in fp32, cos/sin read as float32 or the input dtype.
#include "ftx_common.cuh"

namespace ftx {

template <typename T, typename CT>
__global__ void __launch_bounds__(128) rotary_append_kernel(const ftx_rotary_append_params p) {
  constexpr int VEC = vec16<T>();
  const int tok = blockIdx.x, b = tok / p.Sq, i = tok % p.Sq;
  const int DV = p.D / VEC, half_rd = p.rotary_dim / 2;
  const int base = p.cache.cache_seqlens[b];
  const long long pos = (long long)base + i;  // where the new k/v go, and k's rotary position
  int row, slot;
  cache_slot(b, pos, p.cache, row, slot);
  const long long qpos = p.q_causal ? pos : (long long)base;
  const int n_q = p.Hq * DV, n_k = p.Hkv * DV;
  const CT* cos_t = static_cast<const CT*>(p.cos);
  const CT* sin_t = static_cast<const CT*>(p.sin);

  for (int e = threadIdx.x; e < n_q + 2 * n_k; e += blockDim.x) {
    const T* src;
    T* dst;
    long long rp;
    const bool is_v = e >= n_q + n_k;
    const int idx = e < n_q ? e : (is_v ? e - n_q - n_k : e - n_q);
    const int h = idx / DV, col = (idx % DV) * VEC;
    if (e < n_q) {
      src = static_cast<const T*>(p.q) + offset(p.q_st, b, i, h);
      dst = static_cast<T*>(p.q_out) + (((long long)b * p.Sq + i) * p.Hq + h) * p.D;  // (B, Sq, Hq, D)
      rp = qpos;
    } else {
      if (row < 0) continue;  // out-of-range position/page/cache row: nothing is written
      if (is_v) {
        src = static_cast<const T*>(p.v) + offset(p.v_st, b, i, h);
        dst = static_cast<T*>(p.v_cache) + offset(p.vc_st, row, slot, h);
      } else {
        src = static_cast<const T*>(p.k) + offset(p.k_st, b, i, h);
        dst = static_cast<T*>(p.k_cache) + offset(p.kc_st, row, slot, h);
      }
      rp = pos;
    }
    if (is_v || col >= p.rotary_dim) {  // pass through
      *reinterpret_cast<uint4*>(dst + col) = *reinterpret_cast<const uint4*>(src + col);
      continue;
    }
    const bool angle_ok = rp >= 0 && rp < p.S_rot;  // else angle 0 (guard; the binding can check)
    const long long crow = angle_ok ? rp * half_rd : 0;
    if (!p.interleaved) {
      if (col >= half_rd) continue;  // written by the thread of column col - half_rd
      float x1[VEC], x2[VEC], c[VEC], s[VEC], o1[VEC], o2[VEC];
      load_float<T, VEC>(src + col, x1);
      load_float<T, VEC>(src + col + half_rd, x2);
      if (angle_ok) {
        load_float<CT, VEC>(cos_t + crow + col, c);
        load_float<CT, VEC>(sin_t + crow + col, s);
      } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) c[j] = 1.f, s[j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        o1[j] = x1[j] * c[j] - x2[j] * s[j];
        o2[j] = x2[j] * c[j] + x1[j] * s[j];
      }
      store_float<T, VEC>(dst + col, o1);
      store_float<T, VEC>(dst + col + half_rd, o2);
    } else {
      constexpr int H = VEC / 2;
      float x[VEC], c[H], s[H], o[VEC];
      load_float<T, VEC>(src + col, x);
      if (angle_ok) {
        load_float<CT, H>(cos_t + crow + col / 2, c);
        load_float<CT, H>(sin_t + crow + col / 2, s);
      } else {
#pragma unroll
        for (int j = 0; j < H; ++j) c[j] = 1.f, s[j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < H; ++j) {
        o[2 * j] = x[2 * j] * c[j] - x[2 * j + 1] * s[j];
        o[2 * j + 1] = x[2 * j + 1] * c[j] + x[2 * j] * s[j];
      }
      store_float<T, VEC>(dst + col, o);
    }
  }
}

template <typename T, typename CT>
cudaError_t launch_rotary(const ftx_rotary_append_params& p, cudaStream_t stream) {
  rotary_append_kernel<T, CT><<<(unsigned)((long long)p.B * p.Sq), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ftx

extern "C" cudaError_t ftx_rotary_append(const ftx_rotary_append_params* p, cudaStream_t stream) {
  if (p == nullptr || (p->D != 64 && p->D != 128) || p->cache.cache_len <= 0 || p->rotary_dim < 0 ||
      p->rotary_dim > p->D || (p->rotary_dim > 0 && (p->cos == nullptr || p->sin == nullptr)) ||
      (p->Hq > 0 && (p->q == nullptr || p->q_out == nullptr)) ||
      (p->cache.block_table != nullptr && p->cache.cache_batch_idx != nullptr))
    return cudaErrorInvalidValue;
  const int vec = p->dtype == FTX_FLOAT32 ? 4 : 8;
  if (p->rotary_dim % (2 * vec) != 0) return cudaErrorInvalidValue;
  if ((long long)p->B * p->Sq == 0 || p->Hq + p->Hkv == 0) return cudaSuccess;
  if ((long long)p->B * p->Sq > 2147483647LL) return cudaErrorInvalidConfiguration;
  switch (p->dtype) {
    case FTX_FLOAT16:
      return p->cos_f32 ? ftx::launch_rotary<__half, float>(*p, stream)
                        : ftx::launch_rotary<__half, __half>(*p, stream);
    case FTX_BFLOAT16:
      return p->cos_f32 ? ftx::launch_rotary<__nv_bfloat16, float>(*p, stream)
                        : ftx::launch_rotary<__nv_bfloat16, __nv_bfloat16>(*p, stream);
    case FTX_FLOAT32: return ftx::launch_rotary<float, float>(*p, stream);
  }
  return cudaErrorInvalidValue;
}
