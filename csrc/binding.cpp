// torch.library binding of the flashtx CUDA kernels: ops flashtx_cuda::decode_attention and
// flashtx_cuda::rotary_append, loaded with torch.ops.load_library (no pybind11). Their fake
// (meta) implementations are registered from Python (flashtx/cuda_ext.py), so torch.compile
// traces them. The schemas must match flashtx.cuda_ext.SCHEMAS (tests/test_cuda_ext.py checks).
//
// What is checked where:
//   here, always (shapes and metadata, no device sync): defined, device, dtype, rank, sizes,
//     last-dim contiguity, 16-byte alignment of pointers and strides, head dim, GQA divisibility,
//     block_table / cache_batch_idx shapes, rotary table length >= cache capacity, and (append)
//     written caches whose slots share memory or that overlap each other or q/k/v.
//   here, only with check_values=true (one device->host sync): cache_seqlens in
//     [0, capacity] (decode) or [0, capacity - Sq] (append), the block_table entries a row uses
//     in [0, num_blocks), cache_batch_idx in [0, B_cache).
//   in the kernels, always: every index derived from those values is guarded (flashtx_cuda.h),
//     so bad values give masked keys / dropped writes, never an out-of-bounds access.
// Every tensor argument is checked before anything reads it: a required one must be defined, an
// optional one that holds an undefined tensor counts as None (ATen's convention; Python passes None).
//
// FTX_HOST_CHECK: the same checks for CPU tensors, without CUDA: tests/test_cuda_ext_binding_host.py
// builds this file with csrc/host_check/ (stub launchers that check what the kernels assume, a
// stand-in cuda_runtime_api.h) and runs every check on a machine without a GPU.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#ifndef FTX_HOST_CHECK
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "flashtx_cuda.h"

namespace {

#ifdef FTX_HOST_CHECK
constexpr c10::DeviceType kDevice = c10::DeviceType::CPU;
constexpr const char* kDeviceName = "CPU (host check)";
struct DeviceGuard {
  explicit DeviceGuard(c10::Device) {}
};
cudaStream_t current_stream(const at::Tensor&) { return nullptr; }
#else
constexpr c10::DeviceType kDevice = c10::DeviceType::CUDA;
constexpr const char* kDeviceName = "CUDA";
using DeviceGuard = c10::cuda::OptionalCUDAGuard;
cudaStream_t current_stream(const at::Tensor& q) {
  return c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
}
#endif

// An optional tensor argument as the checks see it: an undefined tensor inside counts as None.
using OptTensor = std::optional<at::Tensor>;
OptTensor present(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? OptTensor(*t) : std::nullopt;
}

constexpr int64_t MAX_SPLITS = 128;
constexpr int64_t MAX_CAPACITY = int64_t(1) << 30;  // cache positions (check_cache)

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

ftx_dtype to_ftx(const char* op, const at::Tensor& q) {
  switch (q.scalar_type()) {
    case at::kHalf: return FTX_FLOAT16;
    case at::kBFloat16: return FTX_BFLOAT16;
    case at::kFloat: return FTX_FLOAT32;
    default: break;
  }
  TORCH_CHECK(false, op, ": q must be float16, bfloat16 or float32; got ", q.scalar_type());
  return FTX_FLOAT32;  // unreachable
}

void check_defined(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a ", kDeviceName, " tensor; got an undefined tensor");
}

// A tensor the kernels dereference: defined and on q's device. (Sparse, nested and quantized tensors never get
// here: their dispatch keys have no kernel of these ops, so the dispatcher refuses them.)
void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q) {
  check_defined(op, name, t);
  TORCH_CHECK(t.device().type() == kDevice, op, ": ", name, " must be a ", kDeviceName, " tensor; got device ",
              t.device());
  TORCH_CHECK(t.device() == q.device(), op, ": ", name, " must be on ", q.device(), " like q; got ", t.device());
}

// A (.., D) tensor the kernels read or write with 16-byte vectors.
void check_vec_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q, int64_t dim) {
  check_device(op, name, t, q);
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dims; got shape ", shape_str(t));
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ", q.scalar_type(),
              "; got ", t.scalar_type());
  TORCH_CHECK(t.stride(-1) == 1, op, ": ", name, " must be contiguous in its last dim (stride 1); got strides ",
              c10::str(t.strides()));
  const int64_t vec = 16 / (int64_t)t.element_size();
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    TORCH_CHECK(t.stride(d) % vec == 0 || t.size(d) == 1, op, ": ", name, "'s strides must be multiples of ", vec,
                " elements (16 bytes) for vector loads; got strides ", c10::str(t.strides()), " (call .contiguous())");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              "'s data must be 16-byte aligned (a view at an odd offset?); call .contiguous()");
}

void check_int_vec(const char* op, const char* name, const at::Tensor& t, const at::Tensor& q, int64_t B) {
  check_device(op, name, t, q);
  TORCH_CHECK(t.scalar_type() == at::kInt, op, ": ", name, " must be int32; got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.stride(0) == 1, op, ": ", name,
              " must be a contiguous (B,) = (", B, ",) tensor; got shape ", shape_str(t));
}

struct CacheInfo {
  ftx_cache_map map;  // the kernels' view of the cache (pointers, sizes)
  int64_t capacity;
};

ftx_strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// q (B, Sq, Hq, D), as both ops take it: a CUDA tensor of a supported dtype and head dim.
struct QInfo {
  ftx_dtype dtype;
  int64_t B, Sq, Hq, D;
};

QInfo check_q(const char* op, const at::Tensor& q) {
  check_device(op, "q", q, q);
  const ftx_dtype dt = to_ftx(op, q);
  check_vec_tensor(op, "q", q, q, 4);
  const QInfo info{dt, q.size(0), q.size(1), q.size(2), q.size(3)};
  TORCH_CHECK(info.D == 64 || info.D == 128, op, ": head dim must be 64 or 128; got q of shape ", shape_str(q));
  return info;
}

// k_cache/v_cache (B_cache, S_cache, Hkv, D) or paged (num_blocks, page_size, Hkv, D) + block_table.
CacheInfo check_cache(const char* op, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& cache_seqlens, const OptTensor& block_table, const OptTensor& cache_batch_idx,
                      int64_t B) {
  check_vec_tensor(op, "k_cache", k_cache, q, 4);
  check_vec_tensor(op, "v_cache", v_cache, q, 4);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), op, ": k_cache and v_cache must have the same shape; got ",
              shape_str(k_cache), " and ", shape_str(v_cache));
  TORCH_CHECK(k_cache.size(3) == q.size(-1), op, ": the caches' head dim must be q's (", q.size(-1), "); got ",
              shape_str(k_cache));
  TORCH_CHECK(k_cache.size(0) > 0 && k_cache.size(1) > 0 && k_cache.size(2) > 0, op,
              ": the caches must not be empty (rows, positions and heads >= 1); got ", shape_str(k_cache));
  TORCH_CHECK(k_cache.size(0) <= INT32_MAX && k_cache.size(1) <= INT32_MAX, op, ": cache too large");
  check_int_vec(op, "cache_seqlens", cache_seqlens, q, B);
  CacheInfo c{{cache_seqlens.data_ptr<int>(), nullptr, nullptr, 0, (int)k_cache.size(0), (int)k_cache.size(1), 0},
              k_cache.size(1)};
  if (block_table.has_value()) {
    const at::Tensor& bt = *block_table;
    check_device(op, "block_table", bt, q);
    TORCH_CHECK(bt.scalar_type() == at::kInt, op, ": block_table must be int32; got ", bt.scalar_type());
    TORCH_CHECK(bt.dim() == 2 && bt.size(0) == B && bt.size(1) > 0 && bt.stride(1) == 1, op,
                ": block_table must be (B, max_blocks) = (", B, ", >0) with a contiguous last dim; got shape ",
                shape_str(bt), " strides ", c10::str(bt.strides()));
    TORCH_CHECK(!cache_batch_idx.has_value(), op, ": cache_batch_idx cannot be used with a paged cache "
                "(block_table); index the block_table rows instead");
    TORCH_CHECK(bt.size(1) * k_cache.size(1) <= INT32_MAX, op, ": max_blocks * page_size must fit int32");
    c.map.block_table = bt.data_ptr<int>();
    c.map.bt_sb = bt.stride(0);
    c.map.max_blocks = (int)bt.size(1);
    c.capacity = bt.size(1) * k_cache.size(1);
  } else if (cache_batch_idx.has_value()) {
    check_int_vec(op, "cache_batch_idx", *cache_batch_idx, q, B);
    c.map.cache_batch_idx = cache_batch_idx->data_ptr<int>();
  } else {
    TORCH_CHECK(k_cache.size(0) >= B, op, ": k_cache has ", k_cache.size(0), " batch rows but q has B = ", B,
                "; pass cache_batch_idx to map batch rows to cache rows");
  }
  // positions and key tiles are ints in the kernels (a key loop near 2**31 would overflow); Triton's MAX_SEQ is 2**29
  TORCH_CHECK(c.capacity <= MAX_CAPACITY, op, ": the cache capacity (", c.capacity, " positions) must be <= 2**30");
  return c;
}

// The append writes k_cache and v_cache in place, from many blocks at once: slots that share memory would race
// (which value lands depends on scheduling). Refused as far as the metadata tells without a sync (an expanded
// cache; the caches, or q, k, v and a cache, overlapping where ATen can tell); flashtx.cuda_ext.rotary_append
// also refuses the views ATen finds too hard (eager calls).
void check_writes(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const std::pair<const char*, const at::Tensor*> caches[] = {{"k_cache", &k_cache}, {"v_cache", &v_cache}};
  const std::pair<const char*, const at::Tensor*> reads[] = {{"q", &q}, {"k", &k}, {"v", &v}};
  for (const auto& [name, t] : caches) {
    TORCH_CHECK(at::has_internal_overlap(*t) != at::MemOverlap::Yes, op, ": ", name,
                " has slots that share memory (stride 0 along a dim of size > 1: an expanded view?); got shape ",
                shape_str(*t), " strides ", c10::str(t->strides()), ": the append writes it in place");
  }
  const auto overlap = [](const at::Tensor& a, const at::Tensor& b) {
    const auto s = at::get_overlap_status(a, b);
    return s == at::MemOverlapStatus::Full || s == at::MemOverlapStatus::Partial;
  };
  TORCH_CHECK(!overlap(k_cache, v_cache), op, ": k_cache and v_cache share memory: the append writes both in place");
  for (const auto& [rname, r] : reads)
    for (const auto& [cname, t] : caches)
      TORCH_CHECK(!overlap(*r, *t), op, ": ", rname, " shares memory with ", cname,
                  ", which the append writes in place (pass a copy)");
}

// check_values: the values behind the in-kernel guards, at the cost of one device sync.
void check_cache_values(const char* op, const CacheInfo& c, const at::Tensor& cache_seqlens,
                        const OptTensor& block_table, const OptTensor& cache_batch_idx, int64_t extra) {
  const int64_t max_len = c.capacity - extra;
  const auto lens = cache_seqlens.to(at::kLong);
  const int64_t lo = lens.min().item<int64_t>(), hi = lens.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi <= max_len, op, ": cache_seqlens must lie in [0, ", max_len, "] (cache capacity ",
              c.capacity, extra ? " minus the Sq new tokens" : "", "); got values in [", lo, ", ", hi, "]");
  if (block_table.has_value()) {
    const int64_t page = c.map.cache_len;
    const auto used_blocks = (lens + extra + page - 1).div(page, "floor");             // (B,)
    const auto cols = at::arange(c.map.max_blocks, lens.options()).unsqueeze(0);       // (1, max_blocks)
    const auto used = cols < used_blocks.unsqueeze(1);                                 // (B, max_blocks)
    const auto bad = used & ((*block_table < 0) | (*block_table >= c.map.cache_rows));
    TORCH_CHECK(!bad.any().item<bool>(), op, ": block_table has entries outside [0, num_blocks = ", c.map.cache_rows,
                ") in the blocks that cache_seqlens uses");
  }
  if (cache_batch_idx.has_value()) {
    const int64_t a = cache_batch_idx->min().item<int64_t>(), b = cache_batch_idx->max().item<int64_t>();
    TORCH_CHECK(a >= 0 && b < c.map.cache_rows, op, ": cache_batch_idx must lie in [0, ", c.map.cache_rows,
                "); got [", a, ", ", b, "]");
  }
}

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                                    const c10::optional<at::Tensor>& block_table_arg,
                                                    const c10::optional<at::Tensor>& cache_batch_idx_arg,
                                                    double softmax_scale, bool causal, int64_t num_splits,
                                                    bool check_values) {
  const char* op = "flashtx_cuda::decode_attention";
  const OptTensor block_table = present(block_table_arg), cache_batch_idx = present(cache_batch_idx_arg);
  const QInfo qi = check_q(op, q);
  const int64_t B = qi.B, Sq = qi.Sq, Hq = qi.Hq, D = qi.D;
  const CacheInfo c = check_cache(op, q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, B);
  const int64_t Hkv = k_cache.size(2);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, op, ": q's heads (", Hq, ") must be a multiple of the caches' heads (",
              Hkv, ")");
  TORCH_CHECK(num_splits >= 1 && num_splits <= MAX_SPLITS, op, ": num_splits must be in [1, ", MAX_SPLITS,
              "]; got ", num_splits);
  TORCH_CHECK(B <= 65535 && Hq <= 65535 && Sq <= 65535, op, ": B, Sq and Hq must be <= 65535 (grid); got q ",
              shape_str(q));
  const int64_t group_rows = (Hq / Hkv) * Sq;
  const int64_t rows = ftx_decode_rows_per_cta((int)std::min<int64_t>(group_rows, INT32_MAX));
  const int64_t chunks = (group_rows + rows - 1) / rows;  // blocks of `rows` query rows per KV head
  TORCH_CHECK(Hkv * chunks <= 65535, op, ": Hkv x row chunks = ", Hkv, " x ", chunks, " passes the grid's 65535 ",
              "(chunks of ", rows, " of the (Hq / Hkv) * Sq = ", group_rows, " query rows per KV head): pass fewer "
              "queries per call");
  const DeviceGuard guard(q.device());
  if (check_values && B > 0) check_cache_values(op, c, cache_seqlens, block_table, cache_batch_idx, 0);

  auto out = at::empty({B, Sq, Hq, D}, q.options());                    // (B, Sq, Hq, D)
  auto lse = at::empty({B, Hq, Sq}, q.options().dtype(at::kFloat));     // (B, Hq, Sq)
  if (B == 0 || Sq == 0 || Hq == 0) return {out, lse};
  at::Tensor out_partial, lse_partial;
  if (num_splits > 1) {
    out_partial = at::empty({num_splits, B, Hq, Sq, D}, lse.options());  // (splits, B, Hq, Sq, D)
    lse_partial = at::empty({num_splits, B, Hq, Sq}, lse.options());     // (splits, B, Hq, Sq)
  }
  ftx_decode_params p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.out_partial = num_splits > 1 ? out_partial.data_ptr<float>() : nullptr;
  p.lse_partial = num_splits > 1 ? lse_partial.data_ptr<float>() : nullptr;
  p.q_st = strides_of(q), p.k_st = strides_of(k_cache), p.v_st = strides_of(v_cache);
  p.cache = c.map;
  p.B = (int)B, p.Sq = (int)Sq, p.Hq = (int)Hq, p.Hkv = (int)Hkv, p.D = (int)D;
  p.num_splits = (int)num_splits;
  p.softmax_scale = (float)softmax_scale;
  p.causal = causal ? 1 : 0;
  p.dtype = qi.dtype;
  const cudaError_t err = ftx_decode_attention(&p, current_stream(q));
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

at::Tensor rotary_append(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                         at::Tensor& v_cache, const c10::optional<at::Tensor>& cos_arg,
                         const c10::optional<at::Tensor>& sin_arg, const at::Tensor& cache_seqlens,
                         const c10::optional<at::Tensor>& block_table_arg,
                         const c10::optional<at::Tensor>& cache_batch_idx_arg, bool interleaved, bool q_causal,
                         bool check_values) {
  const char* op = "flashtx_cuda::rotary_append";
  const OptTensor cos = present(cos_arg), sin = present(sin_arg);
  const OptTensor block_table = present(block_table_arg), cache_batch_idx = present(cache_batch_idx_arg);
  const QInfo qi = check_q(op, q);
  const int64_t B = qi.B, Sq = qi.Sq, Hq = qi.Hq, D = qi.D;
  check_vec_tensor(op, "k", k, q, 4);
  check_vec_tensor(op, "v", v, q, 4);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == Sq && k.size(3) == D, op,
              ": k and v must be (B, Sq, Hkv, D) with q's B, Sq, D = ", B, ", ", Sq, ", ", D, "; got ", shape_str(k),
              " and ", shape_str(v));
  const CacheInfo c = check_cache(op, q, k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, B);
  TORCH_CHECK(k_cache.size(2) == k.size(2), op, ": the caches' heads (", k_cache.size(2), ") must be k's (",
              k.size(2), ")");
  check_writes(op, q, k, v, k_cache, v_cache);
  int64_t rotary_dim = 0, s_rot = 0;
  bool cos_f32 = false;
  TORCH_CHECK(cos.has_value() == sin.has_value(), op, ": pass both cos and sin, or neither");
  if (cos.has_value()) {
    for (const auto* pair : {&*cos, &*sin}) {
      const char* name = pair == &*cos ? "cos" : "sin";
      check_device(op, name, *pair, q);
      TORCH_CHECK(pair->scalar_type() == at::kFloat || pair->scalar_type() == q.scalar_type(), op, ": ", name,
                  " must be float32 or q's dtype ", q.scalar_type(), "; got ", pair->scalar_type());
      TORCH_CHECK(pair->dim() == 2 && pair->is_contiguous(), op, ": ", name,
                  " must be a contiguous (S_rot, rotary_dim / 2) tensor; got shape ", shape_str(*pair));
      TORCH_CHECK(reinterpret_cast<uintptr_t>(pair->data_ptr()) % 16 == 0, op, ": ", name,
                  "'s data must be 16-byte aligned");
    }
    TORCH_CHECK(cos->sizes() == sin->sizes() && cos->scalar_type() == sin->scalar_type(), op,
                ": cos and sin must have the same shape and dtype; got ", shape_str(*cos), " ", cos->scalar_type(),
                " and ", shape_str(*sin), " ", sin->scalar_type());
    rotary_dim = 2 * cos->size(1);
    s_rot = cos->size(0);
    const int64_t vec = 16 / (int64_t)q.element_size();
    TORCH_CHECK(rotary_dim > 0 && rotary_dim <= D && rotary_dim % (2 * vec) == 0, op,
                ": rotary_dim = 2 * cos.shape[1] must be a multiple of ", 2 * vec, " in [", 2 * vec, ", ", D,
                "] for ", q.scalar_type(), "; got ", rotary_dim);
    TORCH_CHECK(s_rot >= c.capacity, op, ": cos/sin must cover every cache position: ", s_rot,
                " rows for a cache capacity of ", c.capacity);
    TORCH_CHECK(s_rot <= INT32_MAX, op, ": cos/sin have ", s_rot, " rows; at most 2**31 - 1 (int positions)");
    cos_f32 = cos->scalar_type() == at::kFloat;
  }
  TORCH_CHECK((Hq + 2 * k.size(2)) * D <= INT32_MAX, op, ": (Hq + 2 Hkv) * D = (", Hq, " + 2 * ", k.size(2), ") * ",
              D, " elements per token must fit int32");
  const DeviceGuard guard(q.device());
  if (check_values && B > 0) check_cache_values(op, c, cache_seqlens, block_table, cache_batch_idx, Sq);

  auto q_out = at::empty({B, Sq, Hq, D}, q.options());  // (B, Sq, Hq, D)
  if (B == 0 || Sq == 0) return q_out;
  ftx_rotary_append_params p{};
  p.q = q.data_ptr(), p.k = k.data_ptr(), p.v = v.data_ptr(), p.q_out = q_out.data_ptr();
  p.k_cache = k_cache.data_ptr(), p.v_cache = v_cache.data_ptr();
  p.cos = cos.has_value() ? cos->data_ptr() : nullptr;
  p.sin = sin.has_value() ? sin->data_ptr() : nullptr;
  p.q_st = strides_of(q), p.k_st = strides_of(k), p.v_st = strides_of(v);
  p.kc_st = strides_of(k_cache), p.vc_st = strides_of(v_cache);
  p.cache = c.map;
  p.B = (int)B, p.Sq = (int)Sq, p.Hq = (int)Hq, p.Hkv = (int)k.size(2), p.D = (int)D;
  p.rotary_dim = (int)rotary_dim, p.S_rot = (int)s_rot, p.cos_f32 = cos_f32 ? 1 : 0;
  p.interleaved = interleaved ? 1 : 0, p.q_causal = q_causal ? 1 : 0;
  p.dtype = qi.dtype;
  const cudaError_t err = ftx_rotary_append(&p, current_stream(q));
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return q_out;
}

}  // namespace

TORCH_LIBRARY(flashtx_cuda, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? block_table, "
        "Tensor? cache_batch_idx, float softmax_scale, bool causal, int num_splits, bool check_values) "
        "-> (Tensor, Tensor)");
  m.def("rotary_append(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? cos, "
        "Tensor? sin, Tensor cache_seqlens, Tensor? block_table, Tensor? cache_batch_idx, bool interleaved, "
        "bool q_causal, bool check_values) -> Tensor");
}

#ifndef FTX_HOST_CHECK
TORCH_LIBRARY_IMPL(flashtx_cuda, CUDA, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rotary_append", &rotary_append);
}
#else
TORCH_LIBRARY_IMPL(flashtx_cuda, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rotary_append", &rotary_append);
}
// meta tensors stand for "another device": a call mixing them with CPU ones dispatches here and must be refused
TORCH_LIBRARY_IMPL(flashtx_cuda, Meta, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("rotary_append", &rotary_append);
}
#endif
