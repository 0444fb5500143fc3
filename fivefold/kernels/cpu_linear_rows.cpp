// A linear's product at a decode's few rows on a CPU: y (M, N) = x (M, K) w (N, K)^T, float32, for M up to a few
// dozen. Built once per machine with the other CPU kernels by fivefold/kernels/cpu_build.py.
//
// At 4-16 rows MKL's sgemm read smollm2-135m's weights at 6-11 GB/s on the 2-vCPU Intel host, where one row
// read them at 22-32: a decode step of a few sequences paid two to four times its bytes. Here each tile of
// 4 weight rows is read once from memory, in its (out, in) layout as the model keeps it, and multiplied
// against every input row while it sits in the first-level cache: 16 accumulators of 16 lanes (4 input rows x
// 4 weight rows) along K, summed at the end by one transpose tree. The next tile's lines are prefetched into
// the second-level cache spread evenly over this tile's work, so that reading memory and multiplying
// overlap (prefetched all at once, the prefetches stalled the first pass and the two ran in turn).
//
// Every output is its own dot product, summed in one order whatever the row's position, the batch's size
// or the thread that runs it: a row's result does not depend on its batch companions. Where the CPU has no
// AVX-512 (most laptops), tiles of 4 input rows x 3 weight rows in AVX2's 8 lanes do the same.
//
// Weights may be bfloat16 (a bfloat16 engine's): each is widened to float32 as it is loaded (its 16 bits are a
// float32's upper half), and the input rows are float32, so every product is exact and only the float32 sum
// rounds, as in the libraries' bfloat16 products; the weight's bytes, what a decode step streams, are halved.
// Where the CPU multiplies bfloat16 pairs (AVX512_BF16), bfloat16 rows over bfloat16 weights skip the widening:
// one instruction multiplies 32 elements exactly and adds them into 16 float32 lanes (Avx512Dot), which at 8-32
// rows, where the widening tiles had become the bound, reads the weights 1.5-2x as fast.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

using fivefold::bf16;
#if defined(__AVX512F__)
using fivefold::load16;
#endif
using fivefold::load8;

// The last n < L elements of a row, zeros beyond, copied where a full vector can be loaded.
template <int L, class T>
struct Tail {
  alignas(64) T v[L];
  Tail(const T* p, int64_t n) {
    for (int i = 0; i < L; ++i) v[i] = i < n ? p[i] : T(0);
  }
};

// Lines of the next tile, `per_step` of them at each step of the k loop.
struct Prefetch {
  const char* next;
  const char* end;
  int64_t per_step;
  inline void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

#if defined(__AVX512F__)
// A 4 x 4 tile's 16 accumulators (input row i, weight row j at 4 i + j) summed by one transpose tree, whose
// 128-bit lane i holds input row i's outputs, and its MB x NB outputs put in y.
template <int MB, int NB, class Y>
inline void put_tile(const __m512* acc, Y* __restrict y, int64_t ldy) {
  alignas(64) float out[16];
  _mm512_store_ps(out, fivefold::sum16(acc));
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = fivefold::to<Y>(out[i * 4 + j]);  // rounded once, if bfloat16
}

// 16 lanes; a tile of 4 input rows x 4 weight rows, its 16 accumulators summed by one transpose tree.
struct Avx512 {
  using X = float;
  static constexpr int kRows = 4, kCols = 4, kLanes = 16;

  // y[i][j] = x_i . w_j for i < MB input rows, j < NB weight rows (missing ones are zero lanes of the tree).
  template <int MB, int NB, class W, class Y>
  static inline void tile(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw,
                          Y* __restrict y, int64_t ldy, int64_t K, Prefetch& prefetch) {
    __m512 acc[kRows * kCols];
    for (int t = 0; t < kRows * kCols; ++t) acc[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load16(w + j * ldw + k);
      prefetch.step();
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
        for (int j = 0; j < NB; ++j) acc[i * kCols + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * kCols + j]);
      }
    }
    if (k < K) {  // the last K % 16 columns, zeros beyond
      const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load16(Tail<16, W>(w + j * ldw + k, K - k).v);
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * ldx + k);
        for (int j = 0; j < NB; ++j) acc[i * kCols + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * kCols + j]);
      }
    }
    put_tile<MB, NB>(acc, y, ldy);
  }
};
#endif

#if defined(FIVEFOLD_BF16_PAIRS)
// bfloat16 rows over bfloat16 weights where the CPU multiplies bfloat16 pairs (AVX512_BF16: Zen 4, Cooper Lake,
// Sapphire Rapids): one instruction takes 32 weights of a row, multiplies each pair of elements exactly and adds
// both products to a float32 lane, where Avx512 widens 16 weights in two instructions and fuses 16 products.
// Its tiles are Avx512's: the same 4 x 4 accumulators and transpose tree, 32 elements a step. Each output is
// still one dot product in a fixed order, in float32; the instruction treats subnormal inputs and results as zero.
struct Avx512Dot {
  using X = bf16;
  static constexpr int kRows = 4, kCols = 4, kLanes = 32;

  template <int MB, int NB, class W, class Y>
  static inline void tile(const bf16* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw,
                          Y* __restrict y, int64_t ldy, int64_t K, Prefetch& prefetch) {
    static_assert(sizeof(W) == 2, "bfloat16 weights only");
    __m512 acc[kRows * kCols];
    for (int t = 0; t < kRows * kCols; ++t) acc[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = fivefold::load_pairs(w + j * ldw + k);
      prefetch.step();
      for (int i = 0; i < MB; ++i) {
        const __m512bh xv = fivefold::load_pairs(x + i * ldx + k);
        for (int j = 0; j < NB; ++j) acc[i * kCols + j] = _mm512_dpbf16_ps(acc[i * kCols + j], xv, wv[j]);
      }
    }
    if (k < K) {  // the last K % 32 columns: masked loads, zeros beyond
      const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
      __m512bh wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = fivefold::load_pairs(w + j * ldw + k, mask);
      for (int i = 0; i < MB; ++i) {
        const __m512bh xv = fivefold::load_pairs(x + i * ldx + k, mask);
        for (int j = 0; j < NB; ++j) acc[i * kCols + j] = _mm512_dpbf16_ps(acc[i * kCols + j], xv, wv[j]);
      }
    }
    put_tile<MB, NB>(acc, y, ldy);
  }
};
#endif

// 8 lanes in 16 registers: a tile of 4 input rows x 3 weight rows (12 accumulators, 3 weight vectors), each
// accumulator summed on its own in one fixed order.
struct Avx2 {
  using X = float;
  static constexpr int kRows = 4, kCols = 3, kLanes = 8;

  static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }

  template <int MB, int NB, class W, class Y>
  static inline void tile(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t ldw,
                          Y* __restrict y, int64_t ldy, int64_t K, Prefetch& prefetch) {
    __m256 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load8(w + j * ldw + k);
      prefetch.step();
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    if (k < K) {  // the last K % 8 columns, zeros beyond
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(K - k)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = load8(Tail<8, W>(w + j * ldw + k, K - k).v);
      for (int i = 0; i < MB; ++i) {
        const __m256 xv = _mm256_maskload_ps(x + i * ldx + k, mask);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) y[i * ldy + j] = fivefold::to<Y>(sum8(acc[i][j]));
  }
};

// Every input row against one tile of NB weight rows, prefetching the next tile (up to `end`) meanwhile.
template <class Arch, int NB, class W, class Y>
void column_tile(const typename Arch::X* x, int64_t ldx, const W* w, int64_t ldw, Y* y, int64_t ldy, int64_t M,
                 int64_t K, const W* end) {
  constexpr int R = Arch::kRows;
  const int64_t passes = (M + R - 1) / R, steps = passes * (K / Arch::kLanes);
  Prefetch prefetch{nullptr, nullptr, 0};
  const char* next = reinterpret_cast<const char*>(w + NB * ldw);
  const char* stop = std::min(reinterpret_cast<const char*>(w + 2 * NB * ldw), reinterpret_cast<const char*>(end));
  if (next < stop && steps > 0) prefetch = Prefetch{next, stop, ((stop - next + 63) / 64 + steps - 1) / steps};
  int64_t m = 0;
  for (; m + R <= M; m += R) Arch::template tile<R, NB, W, Y>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch);
  switch (M - m) {
    case 1: Arch::template tile<1, NB, W, Y>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch); break;
    case 2: Arch::template tile<2, NB, W, Y>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch); break;
    case 3: Arch::template tile<3, NB, W, Y>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch); break;
    default: break;
  }
}

// column_tile for a tile of `nb` <= NB weight rows (the last tile of a weight may be narrower).
template <class Arch, class W, int NB = Arch::kCols, class Y>
void column_tile_of(int64_t nb, const typename Arch::X* x, int64_t ldx, const W* w, int64_t ldw, Y* y, int64_t ldy,
                    int64_t M, int64_t K, const W* end) {
  if (nb == NB) {
    column_tile<Arch, NB, W, Y>(x, ldx, w, ldw, y, ldy, M, K, end);
  } else if constexpr (NB > 1) {
    column_tile_of<Arch, W, NB - 1, Y>(nb, x, ldx, w, ldw, y, ldy, M, K, end);
  }
}

template <class Arch, class W, class Y>
void run(const typename Arch::X* xp, int64_t ldx, const W* wp, int64_t ldw, Y* yp, int64_t M, int64_t N, int64_t K) {
  constexpr int C = Arch::kCols;
  if (M == 1) {
    // One row (a batch-1 decode): nothing to share between weight rows, so each is streamed whole, in memory
    // order (one stream a thread, where the 4-row tiles interleave four), the row 4 ahead prefetched over its
    // work. Against the tiles, both builds timed in turn (bench/cpu_kernels_ab.py, smollm2-135m's shapes in huge
    // pages, two runs): 0.89-1.05 of the time in float32 (even, within this host's noise), 0.75-1.0 in bfloat16;
    // without the prefetch, float32 took 0.99-1.11. The tile's sum is the same network as at any position of a
    // full tile, so the row's result is the one it gets in a batch.
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      const char* stop = reinterpret_cast<const char*>(wp + end * ldw);
      const int64_t steps = std::max<int64_t>(1, K / Arch::kLanes), lines = (ldw * sizeof(W) + 63) / 64;
      for (int64_t n = begin; n < end; ++n) {
        Prefetch ahead{reinterpret_cast<const char*>(wp + (n + 4) * ldw), stop, (lines + steps - 1) / steps};
        Arch::template tile<1, 1, W, Y>(xp, ldx, wp + n * ldw, ldw, yp + n, N, K, ahead);
      }
    });
    return;
  }
  at::parallel_for(0, (N + C - 1) / C, 1, [&](int64_t begin, int64_t end) {
    const W* stop = wp + std::min(end * C, N) * ldw;  // this thread's last weight row
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * C;
      column_tile_of<Arch, W, Arch::kCols, Y>(std::min<int64_t>(C, N - n), xp, ldx, wp + n * ldw, ldw, yp + n, N, M, K, stop);
    }
  });
}

// The tiles of `width` (0: the widest built) over every weight row.
template <class W, class Y>
void dispatch(int64_t width, const float* xp, int64_t ldx, const W* wp, int64_t ldw, Y* yp, int64_t M,
              int64_t N, int64_t K) {
#if defined(__AVX512F__)
  if (width != 256) {
    run<Avx512, W, Y>(xp, ldx, wp, ldw, yp, M, N, K);
    return;
  }
#endif
  run<Avx2, W, Y>(xp, ldx, wp, ldw, yp, M, N, K);
}

}  // namespace
#endif

// The widest instruction set the rows kernel was built with here: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (none:
// the engine keeps the libraries' products).
int64_t linear_rows_width() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__) && defined(__FMA__)
  return 256;
#else
  return 0;
#endif
}

// x (M, K) with unit stride along K; w (N, K) float32 or bfloat16 with unit stride along K; x float32, or bfloat16
// over a bfloat16 w; `bias` (N) or none (also an empty tensor). -> x w^T + bias, (M, N) in x's dtype: a bfloat16 y
// is the float32 sums, with the bias added in float32, rounded once. bfloat16 rows are multiplied as bfloat16 pairs
// where fivefold::bf16_pairs() (Avx512Dot; not at width 256), else widened first, exactly.
// `width` 0: the widest built; 256: the AVX2 tiles (which an AVX-512 build has too; its tests run them).
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, int64_t width, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(linear_rows_width() > 0, "the rows kernel needs AVX2 and FMA");
  TORCH_CHECK(width == 0 || width == 256 || width == linear_rows_width(), "no rows kernel of width ", width);
  TORCH_CHECK(w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16, "w: float32 or bfloat16 only");
  TORCH_CHECK(x.dtype() == torch::kFloat32 || (x.dtype() == torch::kBFloat16 && w.dtype() == torch::kBFloat16),
              "x: float32, or bfloat16 over a bfloat16 w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K) and w (N, K)");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "x and w need unit stride along K");
  const bool rounded = x.dtype() == torch::kBFloat16;
  const bool dot = rounded && width != 256 && fivefold::bf16_pairs();
  const bool biased = bias.has_value() && bias->numel();
  TORCH_CHECK(!biased || (bias->dim() == 1 && bias->size(0) == w.size(0)), "bias: (N)");
  if (rounded && !dot) x = x.to(torch::kFloat32);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  // Rounded in the tiles, unless a bias is to join the float32 sums first.
  auto y = torch::empty({M, N}, x.options().dtype(rounded && !biased ? torch::kBFloat16 : torch::kFloat32));
#if defined(__AVX2__) && defined(__FMA__)
  if (M == 0 || N == 0) return rounded ? y.to(torch::kBFloat16) : y;
  auto go = [&](auto* yp) {
    if (w.dtype() == torch::kBFloat16) {
      const bf16* wp = reinterpret_cast<const bf16*>(w.data_ptr<at::BFloat16>());
#if defined(FIVEFOLD_BF16_PAIRS)
      if (dot) {
        const bf16* xp = reinterpret_cast<const bf16*>(x.data_ptr<at::BFloat16>());
        run<Avx512Dot, bf16>(xp, x.stride(0), wp, w.stride(0), yp, M, N, K);
        return;
      }
#endif
      dispatch(width, x.data_ptr<float>(), x.stride(0), wp, w.stride(0), yp, M, N, K);
    } else {
      dispatch(width, x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), w.stride(0), yp, M, N, K);
    }
  };
  if (y.scalar_type() == torch::kBFloat16) {
    go(reinterpret_cast<bf16*>(y.data_ptr<at::BFloat16>()));
  } else {
    go(y.data_ptr<float>());
  }
#endif
  if (biased) return rounded ? (y + bias->to(torch::kFloat32)).to(torch::kBFloat16) : y + *bias;
  return y;
}
