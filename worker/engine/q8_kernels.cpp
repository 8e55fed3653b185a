// Products of bf16/float32 activations with 4-bit (Q4_1-like) and 8-bit (Q8_0) weights, the way
// llama.cpp's CPU backend computes them: each activation row is rounded to 8-bit integers per
// group of 32 (one float scale a group), and the integer dot products run on the CPU's u8 x s8
// instructions (AVX512-VNNI `vpdpbusd`, or AVX2's `vpmaddubsw` + `vpmaddwd`), then each group's
// sum is scaled in float32. A decode step of a few rows is bound by the bytes of weights it
// reads: this reads each weight byte once, as packed, with no unpacking to bf16 in between.
//
// Why here (worker/engine/q8_kernels.py): torch's own 4-bit CPU kernel converts every weight to
// bf16/float before it multiplies, which holds one core well below what it can read from memory.
//
// Layouts (row-major, one output row after another), by pairs of groups (64 inputs):
//   4-bit: packed [N, K/2] u8; a pair's 32 bytes hold its first group (inputs 0..31) in their
//          low nibbles and its second (32..63) in their high ones; w = (q - 8) * scale + zero,
//          with scale, zero [N, K/32] bf16 (the same numbers as quantize.Int4Linear's).
//   8-bit: packed [N, K] u8 = s + 128 (s in -127..127); w = s * scale, scale [N, K/32] bf16.
// So a 512-bit dot product of a pair has its first group in 32-bit lanes 0..7, its second in 8..15.
// Each output row is computed from its own activation row alone (batch-invariant), and rows are
// split between threads whole, so the result does not depend on the thread count either.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int GROUP = 32;
constexpr int MAX_ROWS = 4;     // activation rows a weight row is dotted with per pass
constexpr int PREFETCH_ROWS = 32;  // weight rows ahead to prefetch (past the end: harmless hints)

// ---- activations to 8 bits ------------------------------------------------------------------
// q = round(x / d) (half to even), d = max|x| / 127 per group (0 for an all-zero group);
// gx = d * sum(q). Buffers are per thread and reused: a decode step makes ~120 of these calls.
struct QuantizedRows {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K/32]
  std::vector<float> gx;      // [M, K/32]
};

#define TARGET_VNNI __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#define TARGET_AVX2 __attribute__((target("avx2,fma")))

TARGET_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
TARGET_AVX2 inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

TARGET_AVX2 inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename T>
TARGET_AVX2 void quantize_rows(const T* x, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / GROUP;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.gx.resize(M * nb);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < M * nb; ++g) {
    const T* src = x + g * GROUP;   // rows are contiguous: group g of the whole [M, K]
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(src + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float d = hmax(amax) / 127.f;
    const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));   // nearest, ties to even
    // |x| / d <= 127 up to rounding: clamp, then pack 32 int32 to 32 int8 in order
    const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
    __m256i total = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_max_epi32(neg, _mm256_min_epi32(lim, q[i]));
      total = _mm256_add_epi32(total, q[i]);
    }
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i bytes = _mm256_packs_epi16(w01, w23);
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + g * GROUP), bytes);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    out.d[g] = d;
    out.gx[g] = d * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

TARGET_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

TARGET_AVX2 inline __m256 bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The per-group scales of C weight rows times R activation rows' (scale[(r*C + c)*nb + b]), and
// each pair's constant part: a group's offset (4-bit: w = (q - 8) d + z adds (z - 8 d) gx;
// 8-bit: w = (u - 128) d adds -128 d gx) is a dot product over groups.
template <int BITS, int R, int C, bool OFFSET = true>
TARGET_AVX2 void group_scales(const uint16_t* d, const uint16_t* z, const float* const* dx, const float* const* gx,
                              int64_t nb, float* scale, float* constant) {
  for (int c = 0; c < C; ++c) {
    const uint16_t* dc = d + c * nb;
    const uint16_t* zc = BITS == 4 ? z + c * nb : nullptr;
    __m256 off[R];
    float tail[R];
    for (int r = 0; r < R; ++r) off[r] = _mm256_setzero_ps(), tail[r] = 0.f;
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      const __m256 dv = bf16x8(dc + b);
      const __m256 o = BITS == 4 ? _mm256_fnmadd_ps(_mm256_set1_ps(8.f), dv, bf16x8(zc + b))
                                 : _mm256_mul_ps(_mm256_set1_ps(-128.f), dv);
      for (int r = 0; r < R; ++r) {
        off[r] = _mm256_fmadd_ps(o, _mm256_loadu_ps(gx[r] + b), off[r]);
        _mm256_storeu_ps(scale + (r * C + c) * nb + b, _mm256_mul_ps(dv, _mm256_loadu_ps(dx[r] + b)));
      }
    }
    for (; b < nb; ++b) {
      const float db = bf16_to_float(dc[b]);
      const float o = BITS == 4 ? bf16_to_float(zc[b]) - 8.f * db : -128.f * db;
      for (int r = 0; r < R; ++r) {
        tail[r] += o * gx[r][b];
        scale[(r * C + c) * nb + b] = db * dx[r][b];
      }
    }
    for (int r = 0; r < R; ++r) constant[r * C + c] = OFFSET ? hsum(off[r]) + tail[r] : 0.f;
  }
}

// C consecutive weight rows (w, each row_bytes long) dotted with R activation rows, whole.
// AVX512-VNNI: one 512-bit product per pair of groups (its 64 values).
template <int BITS, int R, int C>
TARGET_VNNI void rows_dot_vnni(const uint8_t* w, const int8_t* const* xq, const float* scale, const float* constant,
                               int64_t K, float* dots) {
  const int64_t nb = K / GROUP, row_bytes = K * BITS / 8;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t p = 0; p < K / 64; ++p) {
    __m512i x[R];
    for (int r = 0; r < R; ++r) x[r] = _mm512_loadu_si512(xq[r] + p * 64);
    for (int c = 0; c < C; ++c) {
      // the rows PREFETCH_ROWS ahead, as far into them as this pass is into its own: the
      // hardware's prefetcher alone left one core at ~5 GB/s of the ~9 it reads sequentially
      _mm_prefetch(reinterpret_cast<const char*>(w + (c + PREFETCH_ROWS) * row_bytes + p * (BITS * 8)), _MM_HINT_T0);
      __m512i wv;
      if (BITS == 4) {
        // the 32 bytes twice; the upper copy's high nibbles shifted down, then both masked
        const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * row_bytes + p * 32)));
        wv = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF0000u, raw, 4), low);
      } else {
        wv = _mm512_loadu_si512(w + c * row_bytes + p * 64);
      }
      for (int r = 0; r < R; ++r) {
        const float* sp = scale + (r * C + c) * nb + 2 * p;
        const __m512 pair_scale = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sp[0]), _mm512_set1_ps(sp[1]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, x[r])),
                                    pair_scale, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) dots[r * C + c] = _mm512_reduce_add_ps(acc[r][c]) + constant[r * C + c];
}

// The same with AVX2 (no VNNI): u8 x s8 pairs to 16 bits, then pairs of those to 32 bits. 4-bit
// values cannot saturate the 16 bits (2 * 15 * 127). 8-bit ones as stored (u = s + 128) could,
// so they go as llama.cpp's AVX2 q8_0 product does: s = u - 128, then |s| (unsigned) times x
// with s's sign (2 * 128 * 127 fits), which is the product with s itself: no offset to add back
// (`group_scales<8, ..., false>`).
template <int BITS>
TARGET_AVX2 inline __m256i dot_u8s8(__m256i w, __m256i x, __m256i ones) {
  if (BITS == 4) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  const __m256i s = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(s, s), _mm256_sign_epi8(x, s)), ones);
}

template <int BITS, int R, int C>
TARGET_AVX2 void rows_dot_avx2(const uint8_t* w, const int8_t* const* xq, const float* scale, const float* constant,
                               int64_t K, float* dots) {
  const int64_t nb = K / GROUP, row_bytes = K * BITS / 8;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < K / 64; ++p) {
    for (int c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (c + PREFETCH_ROWS) * row_bytes + p * (BITS * 8)), _MM_HINT_T0);
      __m256i w0, w1;
      if (BITS == 4) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * row_bytes + p * 32));
        w0 = _mm256_and_si256(raw, low);
        w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      } else {
        w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * row_bytes + p * 64));
        w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * row_bytes + p * 64 + 32));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + p * 64));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + p * 64 + 32));
        const float* sp = scale + (r * C + c) * nb + 2 * p;
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8<BITS>(w0, x0, ones)),
                                    _mm256_broadcast_ss(sp), acc[r][c]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8<BITS>(w1, x1, ones)),
                                    _mm256_broadcast_ss(sp + 1), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) dots[r * C + c] = hsum(acc[r][c]) + constant[r * C + c];
}

bool avx2_only = false;   // set_instruction_set("avx2"): the AVX2 path on a VNNI CPU (tests, benches)

bool has_vnni() {
  if (avx2_only) return false;
  static const bool yes = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  return yes;
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

// Every weight row in [begin, end) times R activation rows, into out [R, N] rows (+ bias).
template <int BITS, int R, bool VNNI, typename T>
void rows_tile(int64_t begin, int64_t end, const uint8_t* w, const uint16_t* d, const uint16_t* z,
               const int8_t* const* xq, const float* const* dx, const float* const* gx, int64_t K,
               const float* bias, T* out, int64_t N) {
  constexpr int C = R <= 2 ? 4 : 2;   // weight rows a pass (N is a multiple of 64)
  const int64_t nb = K / GROUP, row_bytes = K * BITS / 8;
  thread_local std::vector<float> scale;
  scale.resize(R * C * nb);
  float constant[R * C], dots[R * C];
  for (int64_t n = begin; n < end; n += C) {
    // the AVX2 8-bit product is with s itself (dot_u8s8): no 128 offset to take back
    group_scales<BITS, R, C, BITS == 4 || VNNI>(d + n * nb, z ? z + n * nb : nullptr, dx, gx, nb, scale.data(), constant);
    if (VNNI) {
      rows_dot_vnni<BITS, R, C>(w + n * row_bytes, xq, scale.data(), constant, K, dots);
    } else {
      rows_dot_avx2<BITS, R, C>(w + n * row_bytes, xq, scale.data(), constant, K, dots);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) out[r * N + n + c] = static_cast<T>(dots[r * C + c] + (bias ? bias[n + c] : 0.f));
  }
}

template <int BITS, bool VNNI, typename T>
void rows(int R, int64_t begin, int64_t end, const uint8_t* w, const uint16_t* d, const uint16_t* z,
          const int8_t* const* xq, const float* const* dx, const float* const* gx, int64_t K,
          const float* bias, T* out, int64_t N) {
  switch (R) {
    case 1: return rows_tile<BITS, 1, VNNI>(begin, end, w, d, z, xq, dx, gx, K, bias, out, N);
    case 2: return rows_tile<BITS, 2, VNNI>(begin, end, w, d, z, xq, dx, gx, K, bias, out, N);
    case 3: return rows_tile<BITS, 3, VNNI>(begin, end, w, d, z, xq, dx, gx, K, bias, out, N);
    default: return rows_tile<BITS, 4, VNNI>(begin, end, w, d, z, xq, dx, gx, K, bias, out, N);
  }
}

template <int BITS, typename T>
void run(const QuantizedRows& xq, int64_t M, int64_t K, int64_t N, const uint8_t* w, const uint16_t* d,
         const uint16_t* z, const float* bias, T* out) {
  const int64_t nb = K / GROUP;
  const bool vnni = has_vnni();
  at::parallel_for(0, N / 64, 1, [&](int64_t begin64, int64_t end64) {
    const int64_t begin = begin64 * 64, end = end64 * 64;   // whole blocks of 64 rows a thread
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int R = static_cast<int>(std::min<int64_t>(MAX_ROWS, M - m0));
      const int8_t* xrows[MAX_ROWS];
      const float* dxrows[MAX_ROWS];
      const float* gxrows[MAX_ROWS];
      for (int r = 0; r < R; ++r) {
        xrows[r] = xq.q.data() + (m0 + r) * K;
        dxrows[r] = xq.d.data() + (m0 + r) * nb;
        gxrows[r] = xq.gx.data() + (m0 + r) * nb;
      }
      if (vnni) {
        rows<BITS, true>(R, begin, end, w, d, z, xrows, dxrows, gxrows, K, bias, out + m0 * N, N);
      } else {
        rows<BITS, false>(R, begin, end, w, d, z, xrows, dxrows, gxrows, K, bias, out + m0 * N, N);
      }
    }
  });
}

template <int BITS>
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& zeros, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(has_avx2(), "the 8-bit activation kernels need AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "x must be bf16 or float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), "scales must be contiguous bf16");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), nb = K / GROUP;
  TORCH_CHECK(K % 64 == 0, "K must be a multiple of 64");
  TORCH_CHECK(N % 64 == 0, "N must be a multiple of 64 (rows go to threads in blocks of 64)");
  TORCH_CHECK(packed.size(1) == K * BITS / 8, "packed does not match x's K");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == nb, "scales must be [N, K/32]");
  if (BITS == 4) {
    TORCH_CHECK(zeros.has_value() && zeros->scalar_type() == at::kBFloat16 && zeros->is_contiguous() &&
                zeros->size(0) == N && zeros->size(1) == nb, "4-bit weights need zeros [N, K/32] bf16");
  }
  thread_local QuantizedRows xq;
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, xq);
  } else {
    quantize_rows(x.data_ptr<float>(), M, K, xq);
  }
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* d = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const uint16_t* z = BITS == 4 ? reinterpret_cast<const uint16_t*>(zeros->data_ptr<at::BFloat16>()) : nullptr;
  torch::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "bias must have N values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, N}, x.options());   // rounded once, from float32, to x's dtype
  if (x.scalar_type() == at::kBFloat16) {
    run<BITS>(xq, M, K, N, w, d, z, b, out.data_ptr<at::BFloat16>());
  } else {
    run<BITS>(xq, M, K, N, w, d, z, b, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

namespace llm_stream {   // kernels.h; bound in kernels_module.cpp

torch::Tensor q4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                        const torch::Tensor& zeros, const c10::optional<torch::Tensor>& bias) {
  return linear<4>(x, packed, scales, zeros, bias);
}

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  return linear<8>(x, packed, scales, c10::nullopt, c10::nullopt);
}

std::string instruction_set() { return has_vnni() ? "avx512-vnni" : has_avx2() ? "avx2" : "none"; }

void set_instruction_set(const std::string& name) {
  TORCH_CHECK(name == "avx2" || name == "best", "instruction set: avx2 or best");
  avx2_only = name == "avx2";
}

}  // namespace llm_stream
