// Host-check launchers (csrc/host_check/README.md): built with binding.cpp -DFTX_HOST_CHECK in place of
// the .cu files. They launch nothing. Each checks what the kernels assume of their parameters
// (flashtx_cuda.h: pointers, 16-byte alignment, strides in whole vectors, sizes, the cache map) and
// returns cudaErrorInvalidValue naming the first assumption broken, which the binding raises as
// "kernel launch failed: ...". Whatever the binding lets through must pass here.
//
// Also the op flashtx_host_check::call_with_undefined: the binding's ops called through the dispatcher
// with undefined tensors, which Python cannot pass (None there is an empty optional).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>

#include "flashtx_cuda.h"

namespace {

thread_local std::string last_error = "no error";

cudaError_t fail(const std::string& what) {
  last_error = "host check: " + what;
  return cudaErrorInvalidValue;
}

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

int vec_of(ftx_dtype dt) { return dt == FTX_FLOAT32 ? 4 : 8; }  // elements in 16 bytes

bool known_dtype(ftx_dtype dt) { return dt == FTX_FLOAT16 || dt == FTX_BFLOAT16 || dt == FTX_FLOAT32; }

// The first three dims of a (n0, n1, n2, D) tensor: non-negative strides of whole 16-byte vectors
// (a dim of one entry is never stepped along: any stride).
bool strides_ok(const ftx_strides& st, long long n0, long long n1, long long n2, int vec) {
  const auto ok = [vec](long long s, long long n) { return n <= 1 || (s >= 0 && s % vec == 0); };
  return ok(st.sb, n0) && ok(st.ss, n1) && ok(st.sh, n2);
}

std::string check_map(const ftx_cache_map& c, int B) {
  if (B > 0 && c.cache_seqlens == nullptr) return "cache_seqlens is NULL";
  if (c.cache_rows <= 0 || c.cache_len <= 0) return "an empty cache (cache_rows or cache_len <= 0)";
  if (c.block_table != nullptr && c.cache_batch_idx != nullptr) return "block_table and cache_batch_idx both set";
  if (c.block_table != nullptr) {
    if (c.max_blocks <= 0) return "block_table with max_blocks <= 0";
    if (c.bt_sb < 0) return "block_table row stride < 0";
  }
  const long long cap = c.block_table != nullptr ? (long long)c.max_blocks * c.cache_len : c.cache_len;
  if (cap > (1LL << 30)) return "capacity > 2**30 (the kernels' positions are ints)";
  return "";
}

}  // namespace

extern "C" int ftx_decode_rows_per_cta(int group_rows) { return group_rows <= 8 ? 8 : 32; }

extern "C" cudaError_t ftx_decode_attention(const ftx_decode_params* p, cudaStream_t) {
  if (p == nullptr) return fail("params NULL");
  if (!known_dtype(p->dtype)) return fail("dtype");
  if (p->D != 64 && p->D != 128) return fail("head dim " + std::to_string(p->D));
  if (p->Hkv <= 0 || p->Hq < 0 || p->Hq % p->Hkv != 0) return fail("Hq not a multiple of Hkv >= 1");
  if (p->num_splits < 1 || p->num_splits > 128) return fail("num_splits outside [1, 128]");
  if (p->B < 0 || p->Sq < 0 || p->B > 65535 || p->Sq > 65535 || p->Hq > 65535) return fail("B, Sq or Hq");
  const std::string map = check_map(p->cache, p->B);
  if (!map.empty()) return fail(map);
  if (p->B == 0 || p->Sq == 0 || p->Hq == 0) return cudaSuccess;  // the real launcher returns here too
  const long long rows = (long long)(p->Hq / p->Hkv) * p->Sq, per = ftx_decode_rows_per_cta((int)rows);
  if ((long long)p->Hkv * ((rows + per - 1) / per) > 65535) return fail("grid: Hkv x row chunks > 65535");
  for (const void* ptr : std::initializer_list<const void*>{p->q, p->k_cache, p->v_cache, p->out})
    if (ptr == nullptr || !aligned16(ptr)) return fail("q, k_cache, v_cache or out NULL or not 16-byte aligned");
  if (p->lse == nullptr) return fail("lse NULL");
  if (p->num_splits > 1 && (p->out_partial == nullptr || p->lse_partial == nullptr || !aligned16(p->out_partial)))
    return fail("split workspace NULL or not 16-byte aligned");
  const int vec = vec_of(p->dtype);
  if (!strides_ok(p->q_st, p->B, p->Sq, p->Hq, vec)) return fail("q strides not whole 16-byte vectors");
  if (!strides_ok(p->k_st, p->cache.cache_rows, p->cache.cache_len, p->Hkv, vec) ||
      !strides_ok(p->v_st, p->cache.cache_rows, p->cache.cache_len, p->Hkv, vec))
    return fail("cache strides not whole 16-byte vectors");
  return cudaSuccess;
}

extern "C" cudaError_t ftx_rotary_append(const ftx_rotary_append_params* p, cudaStream_t) {
  if (p == nullptr) return fail("params NULL");
  if (!known_dtype(p->dtype)) return fail("dtype");
  if (p->D != 64 && p->D != 128) return fail("head dim " + std::to_string(p->D));
  const int vec = vec_of(p->dtype);
  if (p->rotary_dim < 0 || p->rotary_dim > p->D || p->rotary_dim % (2 * vec) != 0) return fail("rotary_dim");
  if (p->rotary_dim > 0 && (p->cos == nullptr || p->sin == nullptr || !aligned16(p->cos) || !aligned16(p->sin)))
    return fail("cos/sin NULL or not 16-byte aligned with rotary_dim > 0");
  if (p->S_rot < 0) return fail("S_rot < 0");
  if (p->B < 0 || p->Sq < 0 || p->Hq < 0 || p->Hkv < 0) return fail("negative size");
  if ((long long)p->B * p->Sq > 2147483647LL) return fail("B * Sq > 2**31 - 1 (the grid)");
  if ((long long)(p->Hq + 2LL * p->Hkv) * p->D > 2147483647LL) return fail("(Hq + 2 Hkv) * D > 2**31 - 1");
  const std::string map = check_map(p->cache, p->B);
  if (!map.empty()) return fail(map);
  if ((long long)p->B * p->Sq == 0) return cudaSuccess;
  if (p->Hq > 0 && (p->q == nullptr || p->q_out == nullptr || !aligned16(p->q) || !aligned16(p->q_out)))
    return fail("q or q_out NULL or not 16-byte aligned");
  for (const void* ptr : std::initializer_list<const void*>{p->k, p->v, p->k_cache, p->v_cache})
    if (ptr == nullptr || !aligned16(ptr)) return fail("k, v or a cache NULL or not 16-byte aligned");
  if (!strides_ok(p->q_st, p->B, p->Sq, p->Hq, vec) || !strides_ok(p->k_st, p->B, p->Sq, p->Hkv, vec) ||
      !strides_ok(p->v_st, p->B, p->Sq, p->Hkv, vec))
    return fail("q, k or v strides not whole 16-byte vectors");
  if (!strides_ok(p->kc_st, p->cache.cache_rows, p->cache.cache_len, p->Hkv, vec) ||
      !strides_ok(p->vc_st, p->cache.cache_rows, p->cache.cache_len, p->Hkv, vec))
    return fail("cache strides not whole 16-byte vectors");
  return cudaSuccess;
}

extern "C" const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaSuccess ? "no error" : last_error.c_str();
}

namespace {

using DecodeFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const std::optional<at::Tensor>&,
                                                    const std::optional<at::Tensor>&, double, bool, int64_t, bool);
using RotaryFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, bool, bool);

// decode_attention with block_table and cache_batch_idx undefined tensors inside their optionals, and
// (which = "q", "k_cache", "v_cache", "cache_seqlens") that required argument undefined too ("optionals": none);
// or rotary_append with block_table and cache_batch_idx so, and (which = "cos_sin") both rotary tables, ("cos")
// cos alone or ("k") the required k undefined. check_values on. Returns the op's output (q's shape).
at::Tensor call_with_undefined(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& cache_seqlens, const at::Tensor& k, const at::Tensor& cos,
                               c10::string_view which) {
  const at::Tensor none;
  const auto pick = [&](const char* name, const at::Tensor& t) -> const at::Tensor& {
    return which == name ? none : t;
  };
  auto& dispatcher = c10::Dispatcher::singleton();
  if (which == "cos_sin" || which == "cos" || which == "k") {
    static auto op = dispatcher.findSchemaOrThrow("flashtx_cuda::rotary_append", "").typed<RotaryFn>();
    at::Tensor kc = k_cache, vc = v_cache;
    const std::optional<at::Tensor> c(which == "cos_sin" || which == "cos" ? none : cos);
    const std::optional<at::Tensor> s(which == "cos_sin" ? none : cos);
    return op.call(q, pick("k", k), k, kc, vc, c, s, cache_seqlens, std::optional<at::Tensor>(none),
                   std::optional<at::Tensor>(none), false, true, true);
  }
  static auto op = dispatcher.findSchemaOrThrow("flashtx_cuda::decode_attention", "").typed<DecodeFn>();
  const auto out = op.call(pick("q", q), pick("k_cache", k_cache), pick("v_cache", v_cache),
                           pick("cache_seqlens", cache_seqlens),
                           std::optional<at::Tensor>(none), std::optional<at::Tensor>(none), 0.125, true, 1, true);
  return std::get<0>(out);
}

}  // namespace

TORCH_LIBRARY(flashtx_host_check, m) {
  m.def("call_with_undefined(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor k, Tensor cos, "
        "str which) -> Tensor");
  m.impl("call_with_undefined", c10::DispatchKey::CompositeExplicitAutograd, TORCH_FN(call_with_undefined));
}
