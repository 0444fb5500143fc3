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
// or the thread that runs it: a row's result does not depend on its batch companions.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu_simd.h"

#if defined(__AVX512F__)
namespace {

constexpr int kRows = 4;  // input rows a tile multiplies at once
constexpr int kCols = 4;  // weight rows (outputs) in a tile

// Lines of the next tile, `per_step` of them at each step of the k loop.
struct Prefetch {
  const char* next;
  const char* end;
  int64_t per_step;
  inline void step() {
    for (int64_t i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

// y[i][j] = x_i . w_j for i < MB input rows, j < NB weight rows; MB, NB <= 4 (missing ones are zero lanes of
// the same tree).
template <int MB, int NB>
inline void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t ldw, float* __restrict y,
                 int64_t ldy, int64_t K, Prefetch& prefetch) {
  __m512 acc[kRows * kCols];
  for (int t = 0; t < kRows * kCols; ++t) acc[t] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + k);
    prefetch.step();
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i * kCols + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * kCols + j]);
    }
  }
  if (k < K) {  // the last K % 16 columns, zeros beyond
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * ldw + k);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i * kCols + j] = _mm512_fmadd_ps(xv, wv[j], acc[i * kCols + j]);
    }
  }
  const __m512 sums = fivefold::sum16(acc);  // 128-bit lane i holds input row i's NB outputs
  alignas(64) float out[kRows * kCols];
  _mm512_store_ps(out, sums);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) y[i * ldy + j] = out[i * kCols + j];
}

// Every input row against one tile of NB weight rows, prefetching the next tile (up to `end`) meanwhile.
template <int NB>
void column_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int64_t M,
                 int64_t K, const float* end) {
  const int64_t passes = (M + kRows - 1) / kRows, steps = passes * (K / 16);
  Prefetch prefetch{nullptr, nullptr, 0};
  const char* next = reinterpret_cast<const char*>(w + NB * ldw);
  const char* stop = std::min(reinterpret_cast<const char*>(w + 2 * NB * ldw), reinterpret_cast<const char*>(end));
  if (next < stop && steps > 0) prefetch = Prefetch{next, stop, ((stop - next + 63) / 64 + steps - 1) / steps};
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) tile<kRows, NB>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch);
  switch (M - m) {
    case 1: tile<1, NB>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch); break;
    case 2: tile<2, NB>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch); break;
    case 3: tile<3, NB>(x + m * ldx, ldx, w, ldw, y + m * ldy, ldy, K, prefetch); break;
    default: break;
  }
}

}  // namespace
#endif

bool linear_rows_compiled() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// x (M, K) float32 with unit stride along K; w (N, K) float32 with unit stride along K. -> (M, N).
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(linear_rows_compiled(), "the rows kernel needs AVX-512");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x (M, K) and w (N, K)");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "x and w need unit stride along K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX512F__)
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(0), tiles = (N + kCols - 1) / kCols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const float* stop = wp + std::min(end * kCols, N) * ldw;  // this thread's last weight row
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kCols;
      const float* wt = wp + n * ldw;
      switch (std::min<int64_t>(kCols, N - n)) {
        case 4: column_tile<4>(xp, ldx, wt, ldw, yp + n, N, M, K, stop); break;
        case 3: column_tile<3>(xp, ldx, wt, ldw, yp + n, N, M, K, stop); break;
        case 2: column_tile<2>(xp, ldx, wt, ldw, yp + n, N, M, K, stop); break;
        default: column_tile<1>(xp, ldx, wt, ldw, yp + n, N, M, K, stop); break;
      }
    }
  });
#endif
  return y;
}
