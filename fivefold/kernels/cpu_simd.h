// Pieces shared by the CPU kernels (cpu_paged_decode.cpp, cpu_linear_rows.cpp, cpu_block_ops.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fivefold {

// exp(x) for x <= 0, as arithmetic the compiler vectorizes (a libm call per score cost more than the
// whole kernel): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7 Taylor-like polynomial (Cephes'
// expf coefficients, ~1 ulp), times 2^n built in the exponent bits. Below -87 the result flushes towards
// zero, where a softmax weight no longer matters.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A bfloat16's bits: a float32's upper 16 bits, so widening one to float32 is a shift, exact.
using bf16 = uint16_t;

inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A float32 rounded to the nearest bfloat16, ties to even, as torch rounds (a NaN to its canonical quiet NaN).
inline bf16 narrow(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (f != f) return 0x7FC0;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<bf16>(bits >> 16);
}

// An element of T from a float32 value: itself, or rounded to bfloat16.
template <class T>
inline T to(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return narrow(v);
  }
}

}  // namespace fivefold

#if defined(__AVX2__)
#include <immintrin.h>

namespace fivefold {

// 8 elements as float32 (AVX2), bfloat16 widened.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

}  // namespace fivefold
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

namespace fivefold {

// 16 elements as float32 (AVX-512), bfloat16 widened.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The 16 vectors p[0..16) each summed over its lanes, as one vector: lane t holds the sum of p[t]. A
// transpose tree of ~3 instructions a vector, where reducing each on its own takes ~8. The network is the
// same for every position, so lane t's sum is added in one order whatever the other vectors hold.
inline __m512 sum16(const __m512* p) {
  // Pairs: within each 128-bit lane, [a0+a2, b0+b2, a1+a3, b1+b3].
  __m512 s1[8];
  for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  // Quads: within each 128-bit lane, vectors 4i..4i+3 summed over that lane's four elements.
  __m512 s2[4];
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(s1[2 * i]), b = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across the four 128-bit lanes: 128-bit lane j of the result holds vectors 4j..4j+3.
  __m512 u[2];
  for (int i = 0; i < 2; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

}  // namespace fivefold

#if defined(__AVX512BW__) && defined(__AVX512BF16__)
#define FIVEFOLD_BF16_PAIRS 1

namespace fivefold {

// 32 bfloat16 elements as the 16 pairs _mm512_dpbf16_ps multiplies (AVX512_BF16: Zen 4, Cooper Lake, Sapphire
// Rapids): each pair's two products exact, both added to a float32 lane; subnormal inputs and results read as zero.
// Masked: zeros beyond the mask's elements.
inline __m512bh load_pairs(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_pairs(const bf16* p, __mmask32 mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }

}  // namespace fivefold
#endif
#endif

namespace fivefold {

// Whether this build multiplies bfloat16 pairs (FIVEFOLD_BF16_PAIRS): the rows kernel's bfloat16 rows and the decode
// kernel's bfloat16 queries do, where no caller asks for the widened form.
constexpr bool bf16_pairs() {
#if defined(FIVEFOLD_BF16_PAIRS)
  return true;
#else
  return false;
#endif
}

}  // namespace fivefold
