// Row-wise CPU kernels for the few-row steps of decoding: RMSNorm and decode attention, each one
// call instead of the 8-12 tensor operations (and, for attention, the KV gather and the fixed
// setup of torch's flash kernel) that a step of one or a few rows otherwise pays per layer.
//
// Batch invariance: every output row is computed from its own inputs alone, with the same
// operations in the same order whatever the other rows, the thread count or how rows are split
// between threads (rows go to threads whole). So a request's tokens do not depend on who shares
// its step, and `generate` (which calls the same kernels: row_kernels.py) gets the same bits.
//
// Attention (decode rows: one query token each): query row r attends to key positions
// [starts[r], ends[r]) of its request, position p living at pool row table[r][p / block_size] *
// block_size + p % block_size; keys/values are read where they lie (no gather). Per KV head, the
// query heads sharing it (grouped-query attention) are done together so each key is loaded once.
// Scores are kept in a per-thread buffer, then softmax (max, exp, sum) and the weighted sum of
// values, all in float32; bf16 inputs are widened on load, the output rounded once at the end.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#define TARGET_AVX2 __attribute__((target("avx2,fma")))

TARGET_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TARGET_AVX2 inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store1(float* p, float v) { *p = v; }
inline void store1(at::BFloat16* p, float v) { *p = static_cast<at::BFloat16>(v); }   // round to nearest even

TARGET_AVX2 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
TARGET_AVX2 inline void store8(at::BFloat16* p, __m256 v) {
  float tmp[8];
  _mm256_storeu_ps(tmp, v);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<at::BFloat16>(tmp[i]);
}

TARGET_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TARGET_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0 (a score minus its row's maximum): Cephes' range reduction x = n ln2 + r and
// its degree-5 polynomial for exp(r), ~1 ulp; below -87.3 it returns 0 (float's exp underflows there).
TARGET_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, ln2 in two parts so the product is exact
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}

// ---- RMSNorm -------------------------------------------------------------------------------
// y = weight * dtype(x * rsqrt(mean(x^2) + eps)): LlamaRMSNorm's order (statistics in float32,
// the normalized row rounded to the input's dtype, then the weight's product in that dtype).
template <typename T>
TARGET_AVX2 void rms_norm_rows(const T* x, const T* weight, T* out, int64_t begin, int64_t end, int64_t K,
                               float eps) {
  for (int64_t m = begin; m < end; ++m) {
    const T* row = x + m * K;
    T* dst = out + m * K;
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 v = load8(row + k);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum(acc);
    for (; k < K; ++k) {
      const float v = static_cast<float>(row[k]);
      sum += v * v;
    }
    const float scale = 1.f / std::sqrt(sum / static_cast<float>(K) + eps);
    for (int64_t j = 0; j < K; ++j) {
      // the normalized value rounded to T, then times the weight, rounded to T
      const T normed = static_cast<T>(static_cast<float>(row[j]) * scale);
      store1(dst + j, static_cast<float>(weight[j]) * static_cast<float>(normed));
    }
  }
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "row kernels need AVX2 and FMA");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  const int64_t K = x.size(-1), M = x.numel() / K;
  TORCH_CHECK(weight.numel() == K, "weight must have x's last size");
  auto out = torch::empty_like(x);
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));   // small steps: one thread
  if (x.scalar_type() == at::kBFloat16) {
    auto* xp = x.data_ptr<at::BFloat16>();
    auto* wp = weight.data_ptr<at::BFloat16>();
    auto* op = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, M, grain, [&](int64_t b, int64_t e2) { rms_norm_rows(xp, wp, op, b, e2, K, e); });
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be bf16 or float32");
    auto* xp = x.data_ptr<float>();
    auto* wp = weight.data_ptr<float>();
    auto* op = out.data_ptr<float>();
    at::parallel_for(0, M, grain, [&](int64_t b, int64_t e2) { rms_norm_rows(xp, wp, op, b, e2, K, e); });
  }
  return out;
}

// ---- RoPE, and the new keys/values into their pool rows -----------------------------------
// The decoder's `rotate` (x * cos + roll(x, D/2) * signed_sin, three tensor operations, each
// rounded to the dtype: the same roundings here, so the same bits; decoder.py checks it on
// samples before using this) on q and k of the fused projection's output, then k and v written to
// their pool rows (what `index_copy_` did). One call a layer instead of about ten.

// x rounded to bf16 (nearest even; NaN to bf16's quiet NaN), as a float: c10's rounding.
TARGET_AVX2 inline __m256 round_bf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                           _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}
TARGET_AVX2 inline __m256 round_to(__m256 x, const float*) { return x; }
TARGET_AVX2 inline __m256 round_to(__m256 x, const at::BFloat16*) { return round_bf16(x); }

TARGET_AVX2 inline void store_rounded(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
TARGET_AVX2 inline void store_rounded(at::BFloat16* p, __m256 v) {   // v already holds bf16 values
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

template <typename T>
TARGET_AVX2 void rotate_head(const T* x, const T* cos, const T* sin, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; d += 8) {
    const int64_t other = d < half ? d + half : d - half;
    const __m256 a = round_to(_mm256_mul_ps(load8(x + d), load8(cos + d)), x);
    const __m256 b = round_to(_mm256_mul_ps(load8(x + other), load8(sin + d)), x);
    store_rounded(out + d, round_to(_mm256_add_ps(a, b), x));
  }
}

template <typename T>
TARGET_AVX2 void copy_head(const T* x, T* out, int64_t D) { std::memcpy(out, x, sizeof(T) * D); }

template <typename T>
void rope_store_rows(const T* qkv, const T* cos, const T* sin, const int64_t* rows, T* keys, T* values, T* q_out,
                     int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D) {
  const int64_t width = (heads + 2 * kv_heads) * D;
  const int64_t grain = std::max<int64_t>(1, 64 / std::max<int64_t>(heads + kv_heads, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x = qkv + t * width;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) rotate_head(x + h * D, c, s, q_out + (t * heads + h) * D, D);
      T* k_row = keys + rows[t] * kv_heads * D;
      T* v_row = values + rows[t] * kv_heads * D;
      for (int64_t h = 0; h < kv_heads; ++h) rotate_head(x + (heads + h) * D, c, s, k_row + h * D, D);
      copy_head(x + (heads + kv_heads) * D, v_row, kv_heads * D);
    }
  });
}

torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& rows, const torch::Tensor& keys, const torch::Tensor& values,
                         int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "row kernels need AVX2 and FMA");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "qkv: contiguous [tokens, (heads + 2 kv_heads) * D]");
  const int64_t tokens = qkv.size(0), D = keys.size(-1);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * D && D % 16 == 0, "qkv's width, head_dim a multiple of 16");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * D && sin.numel() == tokens * D,
              "cos, sin: contiguous [tokens, D]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 3 && keys.size(1) == kv_heads &&
              keys.sizes() == values.sizes(), "pools: contiguous [pool rows, kv_heads, D]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == tokens, "rows: long [tokens]");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && keys.scalar_type() == dtype &&
              values.scalar_type() == dtype, "one dtype");
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t pool_rows = keys.size(0);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(0 <= r[t] && r[t] < pool_rows, "a pool row out of range");
  auto q = torch::empty({tokens, heads, D}, qkv.options());
  if (dtype == at::kBFloat16) {
    rope_store_rows(qkv.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(), r,
                    keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(),
                    tokens, heads, kv_heads, D);
  } else {
    TORCH_CHECK(dtype == at::kFloat, "bf16 or float32");
    rope_store_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), r, keys.data_ptr<float>(),
                    values.data_ptr<float>(), q.data_ptr<float>(), tokens, heads, kv_heads, D);
  }
  return q;
}

// ---- decode attention ----------------------------------------------------------------------
constexpr int MAX_GROUPS = 8;    // query heads per KV head
constexpr int MAX_DIM = 256;     // head_dim

struct AttnArgs {
  int64_t heads, kv_heads, dim, block_size;
  int64_t q_row, q_head;          // strides of q
  int64_t kv_pos, kv_head;        // strides of the key/value pools: per pool row, per KV head
  const int64_t* table;           // [rows, table_width]
  int64_t table_width;
  const int64_t* starts;
  const int64_t* ends;
  float scale;
};

// Positions [lo, hi) of a row, in order, block by block (no division per position): `p` the
// position, `row` its key/value row at KV head g of `pool`. (A loop, not a lambda: a lambda
// would not inherit the AVX2 target of the function it is in.)
#define FOR_EACH_POSITION(pool, p, row)                                                          \
  for (int64_t blk_ = lo / a.block_size, p = lo; p < hi; ++blk_)                                \
    for (const T* row = (pool) + (blocks[blk_] * a.block_size + (p - blk_ * a.block_size)) * a.kv_pos + g * a.kv_head, \
                * stop_ = row + (std::min(hi, (blk_ + 1) * a.block_size) - p) * a.kv_pos;         \
         row < stop_; ++p, row += a.kv_pos)

// The KV rows of this head a few positions on (past a block's end: a harmless hint): a row's
// heads lie side by side, so the hardware prefetcher, which follows whole lines, fetches what
// this head needs late; these loads are what a decode step's attention waits on.
constexpr int AHEAD = 8;
template <typename T>
inline void prefetch_ahead(const T* row, int64_t kv_pos, int64_t D) {
  const char* at = reinterpret_cast<const char*>(row + AHEAD * kv_pos);
  for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64) _mm_prefetch(at + off, _MM_HINT_T0);
}

// One decode row r, KV head g, with its G query heads (G a compile-time count, so the G running
// sums stay in registers).
template <int G, typename T>
TARGET_AVX2 void attend_item(const AttnArgs& a, const T* q, const T* keys, const T* values, T* out, int64_t r,
                             int64_t g, std::vector<float>& scores) {
  const int64_t D = a.dim, chunks = D / 8;
  const int64_t lo = a.starts[r], hi = a.ends[r], L = hi - lo;
  const int64_t* blocks = a.table + r * a.table_width;
  const int64_t stride = (L + 7) / 8 * 8;   // a head's scores, the last vector padded
  scores.resize(static_cast<size_t>(G * stride));
  float* sc = scores.data();
  // the query heads of this KV head, in float32
  alignas(32) float qf[G][MAX_DIM];
  for (int h = 0; h < G; ++h) {
    const T* src = q + r * a.q_row + (g * G + h) * a.q_head;
    for (int64_t c = 0; c < chunks; ++c) _mm256_store_ps(qf[h] + 8 * c, load8(src + 8 * c));
  }
  // scores: q . k * scale, each a sum over D in 8 lanes then the same horizontal sum
  FOR_EACH_POSITION(keys, p, k) {
    prefetch_ahead(k, a.kv_pos, D);
    __m256 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256 kv = load8(k + 8 * c);
      for (int h = 0; h < G; ++h) acc[h] = _mm256_fmadd_ps(_mm256_load_ps(qf[h] + 8 * c), kv, acc[h]);
    }
    for (int h = 0; h < G; ++h) sc[h * stride + (p - lo)] = hsum(acc[h]) * a.scale;
  }
  // softmax per head: max, exp(s - max), sum; the padding is -inf (exp gives 0)
  float inv_sum[G];
  for (int h = 0; h < G; ++h) {
    float* s = sc + h * stride;
    for (int64_t j = L; j < stride; ++j) s[j] = -INFINITY;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < stride; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    const __m256 m = _mm256_set1_ps(hmax(mx));
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < stride; j += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
      _mm256_storeu_ps(s + j, e);
      total = _mm256_add_ps(total, e);
    }
    inv_sum[h] = 1.f / hsum(total);
  }
  // out = sum_p weight_p v_p / sum, positions in order; 16 of the D values a pass
  for (int64_t c = 0; c < chunks; c += 2) {
    const bool two = c + 1 < chunks;
    __m256 acc0[G], acc1[G];
    for (int h = 0; h < G; ++h) acc0[h] = acc1[h] = _mm256_setzero_ps();
    FOR_EACH_POSITION(values, p, v) {
      if (c == 0) prefetch_ahead(v, a.kv_pos, D);
      const __m256 v0 = load8(v + 8 * c);
      const __m256 v1 = two ? load8(v + 8 * c + 8) : _mm256_setzero_ps();
      for (int h = 0; h < G; ++h) {
        const __m256 w = _mm256_broadcast_ss(sc + h * stride + (p - lo));
        acc0[h] = _mm256_fmadd_ps(w, v0, acc0[h]);
        acc1[h] = _mm256_fmadd_ps(w, v1, acc1[h]);
      }
    }
    for (int h = 0; h < G; ++h) {
      T* dst = out + (r * a.heads + g * G + h) * D;
      const __m256 inv = _mm256_set1_ps(inv_sum[h]);
      store8(dst + 8 * c, _mm256_mul_ps(acc0[h], inv));
      if (two) store8(dst + 8 * c + 8, _mm256_mul_ps(acc1[h], inv));
    }
  }
}

template <typename T>
void attend_one(int groups, const AttnArgs& a, const T* q, const T* keys, const T* values, T* out, int64_t r,
                int64_t g, std::vector<float>& scores) {
  switch (groups) {
    case 1: return attend_item<1>(a, q, keys, values, out, r, g, scores);
    case 2: return attend_item<2>(a, q, keys, values, out, r, g, scores);
    case 3: return attend_item<3>(a, q, keys, values, out, r, g, scores);
    case 4: return attend_item<4>(a, q, keys, values, out, r, g, scores);
    case 5: return attend_item<5>(a, q, keys, values, out, r, g, scores);
    case 6: return attend_item<6>(a, q, keys, values, out, r, g, scores);
    case 7: return attend_item<7>(a, q, keys, values, out, r, g, scores);
    default: return attend_item<8>(a, q, keys, values, out, r, g, scores);   // checked: at most MAX_GROUPS
  }
}

template <typename T>
void attend_rows(const AttnArgs& a, const T* q, const T* keys, const T* values, T* out, int64_t rows) {
  // work per item ~ its positions: a step of one or a few short rows stays on one thread
  int64_t positions = 0;
  for (int64_t r = 0; r < rows; ++r) positions += a.ends[r] - a.starts[r];
  const int64_t items = rows * a.kv_heads;
  const int groups = static_cast<int>(a.heads / a.kv_heads);
  const int64_t per_item = std::max<int64_t>(1, positions / std::max<int64_t>(rows, 1));
  const int64_t grain = std::max<int64_t>(1, 4096 / per_item);
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) attend_one(groups, a, q, keys, values, out, i / a.kv_heads, i % a.kv_heads, scores);
  });
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& table, const torch::Tensor& starts, const torch::Tensor& ends,
                               int64_t block_size, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "row kernels need AVX2 and FMA");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "q [rows, heads, D], pools [rows, kv_heads, D]");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(), "one dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "bf16 or float32");
  const int64_t rows = q.size(0), heads = q.size(1), D = q.size(2), kv_heads = keys.size(1);
  TORCH_CHECK(D % 8 == 0 && D <= MAX_DIM, "head_dim must be a multiple of 8, at most 256");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUPS, "at most 8 query heads per KV head");
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(keys.strides() == values.strides() && keys.sizes() == values.sizes(), "keys and values alike");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2 && table.size(0) == rows,
              "table: long [rows, blocks]");
  TORCH_CHECK(starts.scalar_type() == at::kLong && ends.scalar_type() == at::kLong && starts.is_contiguous() &&
              ends.is_contiguous() && starts.numel() == rows && ends.numel() == rows, "starts, ends: long [rows]");
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* e = ends.data_ptr<int64_t>();
  const int64_t width = table.size(1);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(0 <= s[r] && s[r] < e[r] && (e[r] + block_size - 1) / block_size <= width,
                "each row needs a non-empty range its table covers");
  AttnArgs a{heads, kv_heads, D, block_size, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
             table.data_ptr<int64_t>(), width, s, e, static_cast<float>(scale)};
  auto out = torch::empty({rows, heads, D}, q.options());
  if (q.scalar_type() == at::kBFloat16) {
    attend_rows(a, q.data_ptr<at::BFloat16>(), keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(),
                out.data_ptr<at::BFloat16>(), rows);
  } else {
    attend_rows(a, q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), out.data_ptr<float>(), rows);
  }
  return out;
}

}  // namespace

namespace llm_stream {   // kernels.h; bound in kernels_module.cpp

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return ::rms_norm(x, weight, eps);
}

torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& rows, const torch::Tensor& keys, const torch::Tensor& values,
                         int64_t heads, int64_t kv_heads) {
  return ::rope_store(qkv, cos, sin, rows, keys, values, heads, kv_heads);
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& table, const torch::Tensor& starts, const torch::Tensor& ends,
                               int64_t block_size, double scale) {
  return ::decode_attention(q, keys, values, table, starts, ends, block_size, scale);
}

}  // namespace llm_stream
