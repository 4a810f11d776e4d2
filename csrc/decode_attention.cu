// Split-KV decode attention over a contiguous or paged KV cache, with GQA packing, plus the LSE
// combine of the splits. Torch-free; launched through ftx_decode_attention (flashtx_cuda.h).
//
// One block of 128 threads serves (split, KV head, row chunk, batch row). Its rows are the
// (query head of that KV head, query position) pairs, ROWS of them (8 or 32): every query head of
// a KV head shares each K/V tile the block loads, so K/V are read once per KV head, not per query
// head. Per tile of BN keys (BN * D * sizeof(T) = 8 KB):
//   1. slots:  the cache row/slot of each key (block_table or cache_batch_idx), -1 if out of range
//   2. load:   K and V tiles into shared memory with 16-byte cp.async (zero-filled when masked).
//              Double-buffered (STAGES = 2, where two K/V buffers fit the 48 KB of static shared
//              memory: DecodeSmem): the next tile's slots and loads are issued before this tile is
//              computed, so a block keeps 16 KB more in flight (the H100 of 2026-12-06 ran the
//              one-tile-at-a-time kernel 3.2x slower than the Triton one). With one buffer, V lands
//              while the scores are computed.
//   3. scores: S = Q K^T * scale * log2(e) (fp32 accumulation), masked to -inf
//   4. online softmax per row (a warp per row): running max M, sum L, rescale factor A
//   5. O = A * O + P V in registers, 8 contiguous columns per thread
// Splits divide each batch row's own keys [0, cache_seqlens[b]) into num_splits ranges of whole
// tiles; with num_splits > 1 the blocks write fp32 partials and the combine kernel merges them
// by their LSE (as flash-attn's split-KV and vLLM's paged_attention_v2).
#include "ftx_common.cuh"

namespace ftx {

constexpr int DECODE_THREADS = 128;

template <typename T, int D>
struct DecodeTile {
  static constexpr int BN = 8192 / (D * (int)sizeof(T));  // keys per tile: 16..64
  static constexpr int VEC = vec16<T>();                  // elements per 16-byte vector
  static constexpr int LDK = D + VEC;                     // padded smem row: conflict-free 16 B reads
  static_assert(BN >= 16 && BN <= 64, "tile must have 16..64 keys");
  static_assert(D % 8 == 0, "head dim must be a multiple of 8");
};

// The keys [begin, end) of split `split` of a batch row with `seqlen` keys: whole tiles of BN.
__device__ __forceinline__ void split_range(int seqlen, int num_splits, int split, int bn, int& begin, int& end) {
  int tiles = (seqlen + bn - 1) / bn;
  int per = (tiles + num_splits - 1) / num_splits;
  begin = min(split * per * bn, seqlen);
  end = min(begin + per * bn, seqlen);
}

// Static shared memory of decode_attention_kernel<T, D, ROWS> with `stages` K/V buffers (bytes; csrc/RESOURCES.md
// records what nvcc allocates, and flashtx/cuda_ext.py's decode_smem_bytes mirrors this for the split count).
template <typename T, int D, int ROWS>
struct DecodeSmem {
  using Tile = DecodeTile<T, D>;
  static constexpr int bytes(int stages) {
    return stages * (2 * Tile::BN * Tile::LDK * (int)sizeof(T) + 2 * Tile::BN * (int)sizeof(int)) +
           ROWS * D * (int)sizeof(T) + ROWS * Tile::BN * (int)sizeof(float) + 3 * ROWS * (int)sizeof(float);
  }
  static constexpr int STATIC_LIMIT = 48 * 1024;  // static __shared__ bytes a block may have
  static constexpr int STAGES = bytes(2) <= STATIC_LIMIT ? 2 : 1;
};

// One tile of BN keys of KV head kvh into smem (the caller commits the cp.async group): key n from
// cache row key_row[n], slot key_slot[n]; zeros where key_row[n] < 0 (masked: nothing is read).
template <typename T, int D>
__device__ __forceinline__ void load_tile_async(T (&dst)[DecodeTile<T, D>::BN][DecodeTile<T, D>::LDK],
                                                const T* __restrict__ cache, const ftx_strides& st, int kvh,
                                                const int* key_row, const int* key_slot) {
  using Tile = DecodeTile<T, D>;
  constexpr int DV = D / Tile::VEC;
  for (int e = threadIdx.x; e < Tile::BN * DV; e += DECODE_THREADS) {
    const int n = e / DV, c = e % DV, row = key_row[n];
    const T* src = cache + offset(st, row, key_slot[n], kvh) + c * Tile::VEC;
    cp_async16(&dst[n][c * Tile::VEC], row >= 0 ? src : cache, row >= 0);
  }
}

template <typename T, int D, int ROWS>
__global__ void __launch_bounds__(DECODE_THREADS)
decode_attention_kernel(const ftx_decode_params p, int n_chunks) {
  using Tile = DecodeTile<T, D>;
  constexpr int BN = Tile::BN, VEC = Tile::VEC, LDK = Tile::LDK, NT = DECODE_THREADS;
  constexpr int RG = NT / BN, RPT = (ROWS + RG - 1) / RG;      // score phase: rows per thread
  constexpr int CG = D / 8, RG2 = NT / CG, RPT2 = (ROWS + RG2 - 1) / RG2;  // PV phase
  constexpr int DV = D / VEC;                                  // 16-byte vectors per row
  constexpr int STAGES = DecodeSmem<T, D, ROWS>::STAGES;       // K/V buffers: 2 = the next tile loads meanwhile

  __shared__ __align__(16) T Ks[STAGES][BN][LDK];   // (BN, D) + pad, a buffer per stage
  __shared__ __align__(16) T Vs[STAGES][BN][LDK];   // (BN, D) + pad
  __shared__ __align__(16) T Qs[ROWS][D];           // (ROWS, D), as given (scale applied to the scores)
  __shared__ float Ss[ROWS][BN];                    // scores, then probabilities
  __shared__ float Mrow[ROWS], Lrow[ROWS], Arow[ROWS];
  __shared__ int key_row[STAGES][BN], key_slot[STAGES][BN];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / n_chunks, chunk = blockIdx.y % n_chunks;
  const int b = blockIdx.z;
  const int G = p.Hq / p.Hkv, Sq = p.Sq, rows_total = G * Sq, row0 = chunk * ROWS;
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ kc = static_cast<const T*>(p.k_cache);
  const T* __restrict__ vc = static_cast<const T*>(p.v_cache);

  const int seqlen = min(max(p.cache.cache_seqlens[b], 0), cache_capacity(p.cache));
  int n_begin, n_end;
  split_range(seqlen, p.num_splits, split, BN, n_begin, n_end);
  const float scale_log2 = p.softmax_scale * LOG2E;

  for (int r = tid; r < ROWS; r += NT) {
    Mrow[r] = -INFINITY;
    Lrow[r] = 0.f;
    Arow[r] = 1.f;
  }
  float acc_o[RPT2][8];
#pragma unroll
  for (int k = 0; k < RPT2; ++k)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc_o[k][j] = 0.f;

  // 1. the cache row/slot of the keys [n0, n0 + BN) into buffer st (threads 0 .. BN - 1)
  auto slots = [&](int st, int n0) {
    if (tid < BN) {
      int row = -1, slot = 0;
      if (n0 + tid < n_end) cache_slot(b, n0 + tid, p.cache, row, slot);
      key_row[st][tid] = row;
      key_slot[st][tid] = slot;
    }
  };

  if (n_begin < n_end) {
    // Q rows of this block -> smem (zeros for rows past rows_total): the first cp.async group
    for (int e = tid; e < ROWS * DV; e += NT) {
      int r = e / DV, c = e % DV, R = row0 + r;
      bool ok = R < rows_total;
      int g = ok ? R / Sq : 0, i = ok ? R % Sq : 0;
      const T* src = q + offset(p.q_st, b, i, kvh * G + g) + c * VEC;
      cp_async16(&Qs[r][c * VEC], ok ? src : q, ok);
    }
    cp_async_commit();
    if constexpr (STAGES > 1) {  // the first tile's K and V: one group, into buffer 0
      slots(0, n_begin);
      __syncthreads();
      load_tile_async<T, D>(Ks[0], kc, p.k_st, kvh, key_row[0], key_slot[0]);
      load_tile_async<T, D>(Vs[0], vc, p.v_st, kvh, key_row[0], key_slot[0]);
      cp_async_commit();
    }
  }

  for (int t = 0, n0 = n_begin; n0 < n_end; ++t, n0 += BN) {
    const int cur = STAGES > 1 ? (t & 1) : 0;  // this tile's buffer
    if constexpr (STAGES > 1) {
      // 2. the next tile's slots and K/V into the other buffer, then wait for this tile's group only. That buffer
      // was the previous iteration's: its slots were last read in that iteration's scores (barriers since), its
      // K/V in its scores and PV, which every thread has finished at the barrier below, before the loads
      const int nn = n0 + BN;
      if (nn < n_end) slots(cur ^ 1, nn);
      __syncthreads();
      if (nn < n_end) {
        load_tile_async<T, D>(Ks[cur ^ 1], kc, p.k_st, kvh, key_row[cur ^ 1], key_slot[cur ^ 1]);
        load_tile_async<T, D>(Vs[cur ^ 1], vc, p.v_st, kvh, key_row[cur ^ 1], key_slot[cur ^ 1]);
        cp_async_commit();
        cp_async_wait<1>();  // every group but the one just issued: Q and this tile's K and V have landed
      } else {
        cp_async_wait<0>();
      }
    } else {
      slots(0, n0);
      __syncthreads();
      // 2. K then V tiles (two cp.async groups)
      load_tile_async<T, D>(Ks[0], kc, p.k_st, kvh, key_row[0], key_slot[0]);
      cp_async_commit();
      load_tile_async<T, D>(Vs[0], vc, p.v_st, kvh, key_row[0], key_slot[0]);
      cp_async_commit();
      cp_async_wait<1>();  // Q (first tile) and K have landed
    }
    __syncthreads();

    // 3. scores: thread (n, rg) computes rows rg, rg + RG, ... for key n
    {
      const int n = tid % BN, rg = tid / BN;
      float acc[RPT];
#pragma unroll
      for (int k = 0; k < RPT; ++k) acc[k] = 0.f;
#pragma unroll 4
      for (int c = 0; c < D / 8; ++c) {
        float kf[8];
        load_float<T, 8>(&Ks[cur][n][c * 8], kf);
#pragma unroll
        for (int k = 0; k < RPT; ++k) {
          const int r = rg + k * RG;
          if (r < ROWS) {
            float qf[8];
            load_float<T, 8>(&Qs[r][c * 8], qf);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[k] = fmaf(qf[j], kf[j], acc[k]);
          }
        }
      }
      const int pos = n0 + n;
      const bool key_ok = key_row[cur][n] >= 0;
#pragma unroll
      for (int k = 0; k < RPT; ++k) {
        const int r = rg + k * RG, R = row0 + r;
        if (r < ROWS) {
          // bottom-right causal: query i of Sq sees keys <= seqlen - Sq + i
          const int lim = p.causal ? seqlen - Sq + (R % Sq) + 1 : seqlen;
          const bool ok = key_ok && R < rows_total && pos < lim;
          Ss[r][n] = ok ? acc[k] * scale_log2 : -INFINITY;
        }
      }
    }
    __syncthreads();

    // 4. online softmax, a warp per row
    for (int r = warp; r < ROWS; r += NT / 32) {
      const float s0 = lane < BN ? Ss[r][lane] : -INFINITY;
      const float s1 = lane + 32 < BN ? Ss[r][lane + 32] : -INFINITY;
      const float m_old = Mrow[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(s0, s1)));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: avoid inf - inf
      const float p0 = exp2f(s0 - m_use), p1 = exp2f(s1 - m_use);
      if (lane < BN) Ss[r][lane] = p0;
      if (lane + 32 < BN) Ss[r][lane + 32] = p1;
      const float sum = warp_sum(p0 + p1);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_use);
        Arow[r] = alpha;
        Lrow[r] = Lrow[r] * alpha + sum;
        Mrow[r] = m_new;
      }
    }
    if constexpr (STAGES == 1) cp_async_wait<0>();  // V has landed
    __syncthreads();

    // 5. O = A * O + P V: thread (cg, rg2) owns columns cg*8 .. cg*8+7 of rows rg2, rg2 + RG2, ...
    {
      const int cg = tid % CG, rg2 = tid / CG;
#pragma unroll
      for (int k = 0; k < RPT2; ++k) {
        const int r = rg2 + k * RG2;
        if (r < ROWS) {
          const float a = Arow[r];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc_o[k][j] *= a;
        }
      }
#pragma unroll 4
      for (int n = 0; n < BN; ++n) {
        float vf[8];
        load_float<T, 8>(&Vs[cur][n][cg * 8], vf);
#pragma unroll
        for (int k = 0; k < RPT2; ++k) {
          const int r = rg2 + k * RG2;
          if (r < ROWS) {
            const float pr = Ss[r][n];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc_o[k][j] = fmaf(pr, vf[j], acc_o[k][j]);
          }
        }
      }
    }
    // (no barrier here: the next iteration writes only its slot buffer, which no thread reads after this tile's
    // scores, before the barrier that precedes its loads into this buffer and its scores into Ss)
  }
  __syncthreads();  // the softmax's Mrow/Lrow (or their initial values when no tile ran) for every thread

  // Epilogue: normalise; write the final output or this split's fp32 partial
  const int cg = tid % CG, rg2 = tid / CG;
#pragma unroll
  for (int k = 0; k < RPT2; ++k) {
    const int r = rg2 + k * RG2, R = row0 + r;
    if (r >= ROWS || R >= rows_total) continue;
    const int g = R / Sq, i = R % Sq, h = kvh * G + g;
    const float l = Lrow[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse2 = l > 0.f ? Mrow[r] + log2f(l) : -INFINITY;
    float o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = acc_o[k][j] * inv;
    const long long row_id = ((long long)b * p.Hq + h) * Sq + i;  // (B, Hq, Sq)
    if (p.out_partial != nullptr) {
      const long long prow = (long long)split * p.B * p.Hq * Sq + row_id;  // (splits, B, Hq, Sq)
      store_float<float, 8>(p.out_partial + prow * D + cg * 8, o);
      if (cg == 0) p.lse_partial[prow] = lse2;
    } else {
      T* dst = static_cast<T*>(p.out) + (((long long)b * Sq + i) * p.Hq + h) * D + cg * 8;  // (B, Sq, Hq, D)
      store_float<T, 8>(dst, o);
      if (cg == 0) p.lse[row_id] = l > 0.f ? lse2 * LN2 : -INFINITY;
    }
  }
}

// Merge the splits of each (b, h, i) row by their LSE: a warp per row, D / 32 columns per lane.
template <typename T, int D>
__global__ void __launch_bounds__(128) decode_combine_kernel(const ftx_decode_params p) {
  constexpr int PER = D / 32;
  const int lane = threadIdx.x & 31;
  const long long rows = (long long)p.B * p.Hq * p.Sq;
  const long long row_id = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);  // (B, Hq, Sq) flat
  if (row_id >= rows) return;
  const int i = (int)(row_id % p.Sq);
  const long long bh = row_id / p.Sq;
  const int h = (int)(bh % p.Hq), b = (int)(bh / p.Hq);
  const int ns = p.num_splits;

  float mx = -INFINITY;
  for (int s = lane; s < ns; s += 32) mx = fmaxf(mx, p.lse_partial[s * rows + row_id]);
  mx = warp_max(mx);
  float o[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) o[j] = 0.f;
  float lse = -INFINITY;
  if (mx != -INFINITY) {
    float sum = 0.f;
    for (int s = lane; s < ns; s += 32) sum += exp2f(p.lse_partial[s * rows + row_id] - mx);
    const float lse2 = mx + log2f(warp_sum(sum));
    for (int s = 0; s < ns; ++s) {
      const float w = exp2f(p.lse_partial[s * rows + row_id] - lse2);
      if (w == 0.f) continue;  // an empty split (its partial is 0 anyway)
      float part[PER];
      load_float<float, PER>(p.out_partial + (s * rows + row_id) * D + lane * PER, part);
#pragma unroll
      for (int j = 0; j < PER; ++j) o[j] = fmaf(w, part[j], o[j]);
    }
    lse = lse2 * LN2;
  }
  T* dst = static_cast<T*>(p.out) + (((long long)b * p.Sq + i) * p.Hq + h) * D + lane * PER;  // (B, Sq, Hq, D)
  store_float<T, PER>(dst, o);
  if (lane == 0) p.lse[row_id] = lse;
}

template <typename T, int D, int ROWS>
cudaError_t launch_decode(const ftx_decode_params& p, cudaStream_t stream) {
  const int rows_total = (p.Hq / p.Hkv) * p.Sq;
  const int n_chunks = (rows_total + ROWS - 1) / ROWS;
  if ((long long)p.Hkv * n_chunks > 65535 || p.B > 65535 || p.num_splits > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid(p.num_splits, p.Hkv * n_chunks, p.B);
  decode_attention_kernel<T, D, ROWS><<<grid, DECODE_THREADS, 0, stream>>>(p, n_chunks);
  if (p.num_splits > 1) {
    const long long rows = (long long)p.B * p.Hq * p.Sq;
    decode_combine_kernel<T, D><<<(unsigned)((rows + 3) / 4), 128, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_decode_rows(const ftx_decode_params& p, cudaStream_t stream) {
  if (ftx_decode_rows_per_cta((p.Hq / p.Hkv) * p.Sq) == 8) return launch_decode<T, D, 8>(p, stream);
  return launch_decode<T, D, 32>(p, stream);
}

template <typename T>
cudaError_t launch_decode_dim(const ftx_decode_params& p, cudaStream_t stream) {
  if (p.D == 64) return launch_decode_rows<T, 64>(p, stream);
  if (p.D == 128) return launch_decode_rows<T, 128>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace ftx

extern "C" int ftx_decode_rows_per_cta(int group_rows) { return group_rows <= 8 ? 8 : 32; }

extern "C" cudaError_t ftx_decode_attention(const ftx_decode_params* p, cudaStream_t stream) {
  if (p == nullptr || p->Hkv <= 0 || p->Hq % p->Hkv != 0 || p->num_splits < 1 || p->cache.cache_len <= 0 ||
      (p->num_splits > 1 && (p->out_partial == nullptr || p->lse_partial == nullptr)) ||
      (p->cache.block_table != nullptr && p->cache.cache_batch_idx != nullptr))
    return cudaErrorInvalidValue;
  if (p->B == 0 || p->Sq == 0 || p->Hq == 0) return cudaSuccess;  // nothing to compute
  switch (p->dtype) {
    case FTX_FLOAT16: return ftx::launch_decode_dim<__half>(*p, stream);
    case FTX_BFLOAT16: return ftx::launch_decode_dim<__nv_bfloat16>(*p, stream);
    case FTX_FLOAT32: return ftx::launch_decode_dim<float>(*p, stream);
  }
  return cudaErrorInvalidValue;
}
