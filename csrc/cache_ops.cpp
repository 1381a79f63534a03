// Block-table ops on the paged KV cache: fused RoPE + KV write, block copy, and the
// positions / slot mapping of a step.
//
// KV cache layout (one K and one V tensor per layer, contiguous, bf16 or fp32):
//
//   k_cache: [num_blocks, num_kv_heads, block_size, head_dim]
//
// or an int8 cache, [num_blocks, num_kv_heads, block_size, head_dim + 4] int8: each row is
// the token's head (rounded to the model dtype first) as int8 x_q = RNE(x * (127 / amax)) in
// [-127, 127], amax = max |x| over the row, then the fp32 scale amax / 127 (4 bytes, little
// endian; amax = 0: zeros and scale 0). x ~ scale * x_q (csrc/attention.cpp reads it so).
//
// A token at position p of a sequence whose block table is bt lives in block
// bt[p / block_size], row p % block_size; its flat *slot* is
// bt[p / block_size] * block_size + p % block_size. Slot < 0 marks padding (no write).
//
//   positions of seq s:  0 ......... ctx-q_len-1 | ctx-q_len ... ctx-1
//                        cached (not computed)     this step's q_len tokens
//
// Every per-token result depends only on that token's inputs (row-invariant whatever
// the batch or thread partitioning). References: tokenserve/ops/layer_ref.py.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "kernels.h"
#include "parallel.h"
#include "registry.h"
#include "simd.h"

// GCC contracts a*b+c into an FMA in C++ by default (-ffp-contract=fast), also across
// intrinsics; that would make the AVX2 and portable paths (and torch) round differently.
// Where an FMA is wanted it is written explicitly (_mm256_fmadd_ps).
#pragma GCC optimize("fp-contract=off")

namespace {

using at::BFloat16;
using namespace tokenserve;  // load1 / store1, load8 / store8 (bf16 bit-exact): csrc/simd.h

// Test hook: force the portable path on machines with AVX2 (see _cache_ops_force_portable).
std::atomic<bool> g_force_portable{false};

bool use_avx2() { return avx2_enabled(g_force_portable); }

// ---------------------------------------------------------------------------------------
// 1. rotary_embedding_write_kv
// ---------------------------------------------------------------------------------------

// Rotate one head in place: x1 = x[:half], x2 = x[half:];
//   x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin   (fp32, separate mul/add: no FMA, so the
// result is bit-identical to torch's fp32 `x*cos + rotate_half(x)*sin`), rounded once.
// Pairs (x1[i], x2[i]) for i in [begin, end).
template <typename T>
void rope_pairs_scalar(T* x1, T* x2, const float* cos, const float* sin, int64_t begin,
                       int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float a = load1(x1 + i), b = load1(x2 + i);
    float c = cos[i], s = sin[i];
    float ac = a * c, bs = b * s, bc = b * c, as = a * s;
    store1(x1 + i, ac - bs);
    store1(x2 + i, bc + as);
  }
}

template <typename T>
void rope_head_scalar(T* x, const float* cos, const float* sin, int64_t half) {
  rope_pairs_scalar(x, x + half, cos, sin, 0, half);
}

#ifdef TS_X86
template <typename T>
TS_TARGET_AVX2 void rope_head_avx2(T* x, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    __m256 a = load8(x + i), b = load8(x + half + i);
    __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
    __m256 o1 = _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s));
    __m256 o2 = _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s));
    store8(x + i, o1);
    store8(x + half + i, o2);
  }
  rope_pairs_scalar(x, x + half, cos, sin, i, half);  // tail: the same exact ops
}
#endif

// One head row x[0..D) (model dtype) to an int8 cache row dst[0..D + 4) (see the header).
template <typename T>
void quantize_row_scalar(const T* x, int64_t D, int8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(load1(x + d)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float v = std::nearbyint(load1(x + d) * inv);  // round half to even
    dst[d] = int8_t(std::min(127.f, std::max(-127.f, v)));
  }
  const float scale = amax / 127.f;
  std::memcpy(dst + D, &scale, sizeof scale);
}

#ifdef TS_X86
template <typename T>
TS_TARGET_AVX2 void quantize_row_avx2(const T* x, int64_t D, int8_t* dst) {
  if (D % 8 != 0) return quantize_row_scalar(x, D, dst);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) vmax = _mm256_max_ps(_mm256_and_ps(load8(x + d), abs_mask), vmax);
  const float amax = hmax8(vmax);  // max is exact: the same value as the scalar loop's
  const __m256 vinv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int64_t d = 0; d < D; d += 8) {
    __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + d), vinv));  // MXCSR: nearest even
    q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packs_epi16(w, w));
  }
  const float scale = amax / 127.f;
  std::memcpy(dst + D, &scale, sizeof scale);
}
#endif

template <typename T>
void rope_write_kv_impl(const torch::Tensor& qkv, const torch::Tensor& positions,
                        const torch::Tensor& cos_sin, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                        int64_t H, int64_t Hkv, int64_t D) {
  const int64_t T_ = qkv.size(0);
  const int64_t row_stride = qkv.stride(0);
  const int64_t block_size = k_cache.size(2);
  const int64_t R = cos_sin.size(1);  // rotated dims of a head: D, or fewer (partial rotary)
  const int64_t half = R / 2;
  T* qkv_p = qkv.data_ptr<T>();
  const bool kv_i8 = k_cache.scalar_type() == at::kChar;
  const int64_t ld = k_cache.size(3);  // cache row, elements: D, or D + 4 for int8
  const int64_t row_bytes = ld * int64_t(k_cache.element_size());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const float* cs = cos_sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const bool avx2 = use_avx2();
  const int64_t work = (H + 2 * Hkv) * D;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(work, 1));

  parallel_for_stealing(T_, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv_p + t * row_stride;
      const float* cos = cs + pos[t] * R;
      const float* sin = cos + half;
      for (int64_t h = 0; h < H + Hkv; ++h) {  // q heads, then k heads
#ifdef TS_X86
        if (avx2) {
          rope_head_avx2(row + h * D, cos, sin, half);
          continue;
        }
#endif
        rope_head_scalar(row + h * D, cos, sin, half);
      }
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t blk = slot / block_size, r = slot % block_size;
      const T* k = row + H * D;
      const T* v = row + (H + Hkv) * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t off = ((blk * Hkv + h) * block_size + r) * row_bytes;
        if (!kv_i8) {
          std::memcpy(kc + off, k + h * D, D * sizeof(T));
          std::memcpy(vc + off, v + h * D, D * sizeof(T));
          continue;
        }
        int8_t* kd = reinterpret_cast<int8_t*>(kc + off);
        int8_t* vd = reinterpret_cast<int8_t*>(vc + off);
#ifdef TS_X86
        if (avx2) {
          quantize_row_avx2(k + h * D, D, kd);
          quantize_row_avx2(v + h * D, D, vd);
          continue;
        }
#endif
        quantize_row_scalar(k + h * D, D, kd);
        quantize_row_scalar(v + h * D, D, vd);
      }
    }
  });
}

}  // namespace

namespace tokenserve {

// qkv:          [T, (H + 2*Hkv) * D]  bf16/fp32, rows contiguous (stride(1) == 1); rotated in place
// positions:    [T] int64, 0 <= p < max_pos
// cos_sin:      [max_pos, R] fp32 contiguous; [:, :R/2] = cos(p*inv_freq), [:, R/2:] = sin;
//               R = D, or R < D (partial rotary: the first R dims of a head rotate, the rest
//               pass through)
// k/v_cache:    [num_blocks, Hkv, block_size, D] contiguous, qkv's dtype, or
//               [num_blocks, Hkv, block_size, D + 4] int8 (quantised rows, see the header)
// slot_mapping: [T] int64, slot < num_blocks*block_size, < 0 = skip (padding); the
//               non-negative slots must be distinct (tokens are written in parallel)
void rotary_embedding_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_sin,
                               torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slot_mapping, int64_t num_heads,
                               int64_t num_kv_heads) {
  TORCH_CHECK(qkv.device().is_cpu(), "rotary_embedding_write_kv: CPU tensors only");
  TORCH_CHECK(qkv.dim() == 2 && (qkv.numel() == 0 || qkv.stride(1) == 1),
              "qkv must be [T, (H+2*Hkv)*D] with contiguous rows");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kFloat,
              "qkv must be bfloat16 or float32, got ", qkv.scalar_type());
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "num_heads and num_kv_heads must be > 0");
  const int64_t T_ = qkv.size(0);
  const int64_t heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(qkv.size(1) % heads == 0, "qkv width ", qkv.size(1),
              " is not a multiple of num_heads + 2*num_kv_heads = ", heads);
  const int64_t D = qkv.size(1) / heads;
  TORCH_CHECK(D % 2 == 0 && D > 0, "head_dim must be even, got ", D);
  TORCH_CHECK(qkv.size(0) <= 1 || qkv.stride(0) >= qkv.size(1), "qkv rows overlap");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(1) > 0 && cos_sin.size(1) <= D &&
                  cos_sin.size(1) % 2 == 0 && cos_sin.is_contiguous() &&
                  cos_sin.scalar_type() == at::kFloat,
              "cos_sin must be a contiguous float32 [max_pos, R], R even and <= ", D);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T_ &&
                  positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be a contiguous int64 [T]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T_ &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 [T]");
  for (const auto* c : {&k_cache, &v_cache}) {
    const bool i8 = c->scalar_type() == at::kChar;
    TORCH_CHECK(c->dim() == 4 && c->size(1) == num_kv_heads &&
                    c->size(3) == D + (i8 ? kKvScaleBytes : 0) && c->is_contiguous() &&
                    (i8 || c->scalar_type() == qkv.scalar_type()) && c->device().is_cpu(),
                "k_cache/v_cache must be contiguous [num_blocks, ", num_kv_heads,
                ", block_size, ", D, "] of qkv's dtype, or [num_blocks, ", num_kv_heads,
                ", block_size, ", D + kKvScaleBytes, "] int8");
  }
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(k_cache.size(2) > 0, "block_size must be > 0");
  const int64_t max_pos = cos_sin.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) {  // validate first: no half-written cache on error
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " of token ", t,
                " outside cos_sin's [0, ", max_pos, ")");
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " of token ", t,
                " outside the cache's ", num_slots, " slots");
  }
  if (T_ == 0) return;
  if (qkv.scalar_type() == at::kBFloat16)
    rope_write_kv_impl<BFloat16>(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                 num_heads, num_kv_heads, D);
  else
    rope_write_kv_impl<float>(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping,
                              num_heads, num_kv_heads, D);
}

}  // namespace tokenserve

namespace {

// ---------------------------------------------------------------------------------------
// 2. copy_blocks
// ---------------------------------------------------------------------------------------

// k_caches, v_caches: L tensors each [num_blocks, Hkv, block_size, D] contiguous (per layer)
// block_mapping:      [N, 2] int64 (src, dst); destinations distinct and never a source
void copy_blocks(std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                 torch::Tensor block_mapping) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "k_caches and v_caches lengths differ");
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2 &&
                  block_mapping.scalar_type() == at::kLong && block_mapping.device().is_cpu(),
              "block_mapping must be an int64 [N, 2] CPU tensor");
  const auto bm = block_mapping.contiguous();
  const int64_t N = bm.size(0);
  const int64_t* m = bm.data_ptr<int64_t>();
  std::vector<torch::Tensor> caches;
  caches.reserve(2 * k_caches.size());
  for (size_t l = 0; l < k_caches.size(); ++l) {
    caches.push_back(k_caches[l]);
    caches.push_back(v_caches[l]);
  }
  for (const auto& c : caches) {
    TORCH_CHECK(c.dim() >= 1 && c.is_contiguous() && c.device().is_cpu(),
                "caches must be contiguous CPU tensors [num_blocks, ...]");
    for (int64_t i = 0; i < N; ++i)
      TORCH_CHECK(m[2 * i] >= 0 && m[2 * i] < c.size(0) && m[2 * i + 1] >= 0 &&
                      m[2 * i + 1] < c.size(0),
                  "block pair (", m[2 * i], ", ", m[2 * i + 1], ") outside [0, ", c.size(0), ")");
  }
  {  // the copies run in parallel: a block written must be neither read nor written twice
    std::vector<int64_t> dst(N), src(N);
    for (int64_t i = 0; i < N; ++i) src[i] = m[2 * i], dst[i] = m[2 * i + 1];
    std::sort(dst.begin(), dst.end());
    std::sort(src.begin(), src.end());
    TORCH_CHECK(std::adjacent_find(dst.begin(), dst.end()) == dst.end(),
                "copy_blocks: a destination block appears twice");
    for (int64_t d : dst)
      TORCH_CHECK(!std::binary_search(src.begin(), src.end(), d), "copy_blocks: block ", d,
                  " is both a source and a destination");
  }
  const int64_t C = int64_t(caches.size());
  if (N == 0 || C == 0) return;
  at::parallel_for(0, C * N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const auto& c = caches[j / N];
      const int64_t i = j % N;
      const int64_t bytes = c.stride(0) * c.element_size();
      char* base = static_cast<char*>(c.data_ptr());
      std::memcpy(base + m[2 * i + 1] * bytes, base + m[2 * i] * bytes, bytes);
    }
  });
}

// ---------------------------------------------------------------------------------------
// 3. positions_and_slots
// ---------------------------------------------------------------------------------------

// block_tables:    [S, max_blocks] int32 (stride(1) == 1), entries >= 0 where used
// query_start_loc: [S+1] int32, qsl[0] == 0, non-decreasing; T = qsl[S]
// context_lens:    [S] int32, q_len <= ctx_len <= max_blocks * block_size
// returns (positions [T] int64, slot_mapping [T] int64)
std::tuple<torch::Tensor, torch::Tensor> positions_and_slots(torch::Tensor block_tables,
                                                             torch::Tensor query_start_loc,
                                                             torch::Tensor context_lens,
                                                             int64_t block_size) {
  TORCH_CHECK(block_size > 0, "block_size must be > 0");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.device().is_cpu(),
              "block_tables must be an int32 [S, max_blocks] CPU tensor");
  const int64_t S = block_tables.size(0);
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) == S + 1 &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.device().is_cpu(),
              "query_start_loc must be an int32 [S+1] CPU tensor");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == S &&
                  context_lens.scalar_type() == at::kInt && context_lens.device().is_cpu(),
              "context_lens must be an int32 [S] CPU tensor");
  const auto bt_c = block_tables.stride(1) == 1 || block_tables.size(1) <= 1
                        ? block_tables : block_tables.contiguous();
  const auto qsl_c = query_start_loc.contiguous();
  const auto ctx_c = context_lens.contiguous();
  const int32_t* bt = bt_c.data_ptr<int32_t>();
  const int64_t bt_stride = bt_c.stride(0);
  const int64_t max_blocks = bt_c.size(1);
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* ctx = ctx_c.data_ptr<int32_t>();
  TORCH_CHECK(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q = int64_t(qsl[s + 1]) - qsl[s];
    TORCH_CHECK(q >= 0, "query_start_loc decreases at sequence ", s);
    TORCH_CHECK(q <= ctx[s], "sequence ", s, ": q_len ", q, " > context_len ", ctx[s]);
    TORCH_CHECK(int64_t(ctx[s]) <= max_blocks * block_size, "sequence ", s, ": context_len ",
                ctx[s], " needs more than the block table's ", max_blocks, " blocks");
    if (q == 0) continue;
    for (int64_t b = (ctx[s] - q) / block_size; b <= (ctx[s] - 1) / block_size; ++b)
      TORCH_CHECK(bt[s * bt_stride + b] >= 0, "sequence ", s, ": block ", b,
                  " of its table is missing (", bt[s * bt_stride + b], ")");
  }
  const int64_t T_ = S ? qsl[S] : 0;
  auto opts = torch::TensorOptions().dtype(torch::kLong);
  auto positions = torch::empty({T_}, opts);
  auto slots = torch::empty({T_}, opts);
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* sl = slots.data_ptr<int64_t>();
  at::parallel_for(0, S, 64, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t start = qsl[s], q = int64_t(qsl[s + 1]) - qsl[s];
      const int64_t p0 = int64_t(ctx[s]) - q;
      const int32_t* row = bt + s * bt_stride;
      for (int64_t i = 0; i < q; ++i) {
        const int64_t p = p0 + i;
        pos[start + i] = p;
        sl[start + i] = int64_t(row[p / block_size]) * block_size + p % block_size;
      }
    }
  });
  return {positions, slots};
}

}  // namespace

TOKENSERVE_REGISTER(cache_ops) {
  m.def("rotary_embedding_write_kv", &tokenserve::rotary_embedding_write_kv,
        "rotary_embedding_write_kv(qkv [T,(H+2Hkv)*D], positions int64 [T], cos_sin f32 "
        "[max_pos,R] (R <= D: the first R dims of a head rotate), k_cache, v_cache [blocks,Hkv,block_size,D], slot_mapping int64 [T], "
        "num_heads, num_kv_heads) -> None. In place: rotate-half RoPE on q and k in fp32 "
        "(rounded once), then K and V of each token written to its cache slot (slot < 0: "
        "skipped). RuntimeError on bad shapes/dtypes or out-of-range positions/slots.",
        pybind11::arg("qkv"), pybind11::arg("positions"), pybind11::arg("cos_sin"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slot_mapping"),
        pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"));
  m.def("copy_blocks", &copy_blocks,
        "copy_blocks(k_caches list[[blocks,...]], v_caches list, block_mapping int64 [N,2]) "
        "-> None. Copies block src -> dst in every layer's K and V cache. RuntimeError on "
        "out-of-range blocks, a repeated destination or a destination that is also a source.",
        pybind11::arg("k_caches"), pybind11::arg("v_caches"), pybind11::arg("block_mapping"));
  m.def("positions_and_slots", &positions_and_slots,
        "positions_and_slots(block_tables int32 [S,max_blocks], query_start_loc int32 [S+1], "
        "context_lens int32 [S], block_size) -> (positions int64 [T], slot_mapping int64 [T]), "
        "T = query_start_loc[S]; seq s's tokens are positions ctx_len-q_len .. ctx_len-1. "
        "RuntimeError when a needed block is missing (< 0 or past the table) or q_len > ctx_len.",
        pybind11::arg("block_tables"), pybind11::arg("query_start_loc"),
        pybind11::arg("context_lens"), pybind11::arg("block_size"));
  m.def("_cache_ops_force_portable", [](bool on) { return g_force_portable.exchange(on); },
        "Test hook: True forces the portable (non-AVX2) paths of cache_ops; returns the old "
        "value.");
}
