// One-token (decode) attention over the paged KV pool on a CPU, reading keys and values in place through
// the block tables: the CPU counterpart of the Triton kernel's decode rows (fivefold/kernels/
// paged_attention_triton.py). Built once per machine with the other CPU kernels by fivefold/kernels/cpu_build.py.
//
// Each work item is one sequence (or one of its key/value heads when there are few sequences): a block's
// keys are scored against every query head reading them, an online softmax (Milakov & Gimelshein 2018)
// folds the block in, and its values are accumulated, so the pool is read once and nothing is gathered.
// Work items are independent, so a sequence's output does not depend on its batch companions.
//
// The pool is float32 or bfloat16 (a bfloat16 engine's): bfloat16 keys and values are widened to float32 as
// they are read (a bfloat16 is a float32's upper 16 bits), half the bytes, the query and all arithmetic float32;
// where the CPU multiplies bfloat16 pairs (AVX512_BF16), a bfloat16 query scores bfloat16 keys as pairs instead,
// each product still exact and summed in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using fivefold::bf16;
using fivefold::widen;
#if defined(__AVX512F__)
using fivefold::load16;
#endif
#if defined(FIVEFOLD_BF16_PAIRS)
using fivefold::load_pairs;
#endif

// A dot product of D floats in 16 lanes, reduced as a tree (a serial sum of the lanes was the kernel's
// bottleneck).
template <int D, class T>
inline float dot(const float* __restrict a, const T* __restrict b) {
  static_assert(D % 16 == 0, "head size must be a multiple of 16");
  float lane[16] = {0};
  for (int d0 = 0; d0 < D; d0 += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) lane[j] += a[d0 + j] * widen(b[d0 + j]);
  }
  for (int j = 0; j < 8; ++j) lane[j] += lane[j + 8];
  for (int j = 0; j < 4; ++j) lane[j] += lane[j + 4];
  return (lane[0] + lane[2]) + (lane[1] + lane[3]);
}

#if defined(__AVX512F__)
// scores[t] for n <= 16 keys from `products(t)`, key t's products in 16 lanes: the 16 vectors summed as a transpose
// (reducing each vector on its own was the kernel's bottleneck).
template <class Products>
__attribute__((always_inline)) inline void sum_keys16(int64_t n, float* __restrict scores, Products products) {
  __m512 p[16];
  for (int t = 0; t < 16; ++t) p[t] = t < n ? products(t) : _mm512_setzero_ps();
  _mm512_mask_storeu_ps(scores, static_cast<__mmask16>((1u << n) - 1u), fivefold::sum16(p));
}
#endif

// scores[t] = q . k_t for the n <= 16 keys of k (row stride `stride`), into scores[0..n).
// `wide`: the AVX-512 form where it is compiled; else (and on CPUs without AVX-512) one dot product a key.
template <int D, class T>
inline void scores16(const float* __restrict q, const T* __restrict k, int64_t stride, int64_t n,
                     float* __restrict scores, bool wide) {
#if defined(__AVX512F__)
  if (!wide) {
    for (int64_t t = 0; t < n; ++t) scores[t] = dot<D>(q, k + t * stride);
    return;
  }
  __m512 qv[D / 16];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  sum_keys16(n, scores, [&](int t) {
    const T* kt = k + t * stride;
    __m512 acc = _mm512_mul_ps(qv[0], load16(kt));
    for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(qv[c], load16(kt + 16 * c), acc);
    return acc;
  });
#else
  (void)wide;
  for (int64_t t = 0; t < n; ++t) scores[t] = dot<D>(q, k + t * stride);
#endif
}

#if defined(FIVEFOLD_BF16_PAIRS)
// scores16 for a bfloat16 query over bfloat16 keys, multiplied as bfloat16 pairs: one instruction takes 32 of a
// key's elements, where widening takes 16 in three (a head size of 16 more than a multiple of 32 ends in a masked
// load, zeros beyond). The same transpose tree; each score one float32 sum in a fixed order.
template <int D>
inline void scores16_pairs(const bf16* __restrict q, const bf16* __restrict k, int64_t stride, int64_t n,
                           float* __restrict scores) {
  constexpr int C = (D + 31) / 32;
  constexpr __mmask32 tail = static_cast<__mmask32>(D % 32 ? (1u << (D % 32)) - 1u : 0xFFFFFFFFu);
  const auto chunk = [](const bf16* row, int c) {
    return c + 1 < C ? load_pairs(row + 32 * c) : load_pairs(row + 32 * c, tail);
  };
  __m512bh qv[C];
  for (int c = 0; c < C; ++c) qv[c] = chunk(q, c);
  sum_keys16(n, scores, [&](int t) {
    const bf16* kt = k + t * stride;
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], chunk(kt, 0));
    for (int c = 1; c < C; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], chunk(kt, c));
    return acc;
  });
}
#endif

// The scores of n <= 16 keys against one query row: a float32 query as scores16 does, a bfloat16 one (only over
// bfloat16 keys, where FIVEFOLD_BF16_PAIRS) as pairs.
template <int D, class T, class Q>
__attribute__((always_inline)) inline void score_keys(const Q* __restrict q, const T* __restrict k, int64_t stride,
                                                      int64_t n, float* __restrict scores, bool wide) {
  if constexpr (std::is_same_v<Q, float>) {
    scores16<D, T>(q, k, stride, n, scores, wide);
  } else {
#if defined(FIVEFOLD_BF16_PAIRS)
    static_assert(std::is_same_v<T, bf16>, "a bfloat16 query reads bfloat16 keys");
    scores16_pairs<D>(q, k, stride, n, scores);
#endif
  }
}

// scores[0..n) *= scale, and the largest of them and `start`: 16 lanes at a time where AVX-512 is built, the same
// values as the scalar loop (a maximum is exact). Where it replaced that loop's chain of maxima, float32's whole
// kernel took 0.88-0.99 of its time with the pools in the caches (bench/cpu_kernels_ab.py --bytes 1).
inline float scale_and_max(float* __restrict scores, int64_t n, float scale, float start) {
  int64_t t = 0;
  float out = start;
#if defined(__AVX512F__)
  const __m512 factor = _mm512_set1_ps(scale);
  __m512 top = _mm512_set1_ps(start);
  for (; t < n; t += 16) {
    const __mmask16 mask = static_cast<__mmask16>(n - t >= 16 ? 0xFFFFu : (1u << (n - t)) - 1u);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, scores + t), factor);
    _mm512_mask_storeu_ps(scores + t, mask, v);
    top = _mm512_mask_max_ps(top, mask, top, v);
  }
  out = _mm512_reduce_max_ps(top);
#endif
  for (; t < n; ++t) {
    scores[t] *= scale;
    out = std::max(out, scores[t]);
  }
  return out;
}

// Every 64-byte line of `n` rows of `stride` elements, from `offset` for `width` elements.
template <class T>
inline void prefetch_rows(const T* base, int64_t n, int64_t stride, int64_t offset, int64_t width) {
  constexpr int64_t line = 64 / sizeof(T);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < width; c += line) __builtin_prefetch(base + t * stride + offset + c);
}

struct Scratch {
  std::vector<float> acc, scores, max, sum, rescale;
  Scratch(int64_t rows, int64_t block_size, int64_t d)
      : acc(rows * d), scores(rows * block_size), max(rows), sum(rows), rescale(rows) {}
};

// One row's running output acc (D) rescaled, then each of the block's n values added with its weight p[t]:
// acc = acc * rescale + sum_t p[t] v_t, the terms added in t's order.
template <int D, class T>
inline void add_values(const T* __restrict v, int64_t stride, int64_t n, const float* __restrict p, float rescale,
                       float* __restrict acc) {
  alignas(64) float a[D];
#pragma omp simd
  for (int d = 0; d < D; ++d) a[d] = acc[d] * rescale;
  for (int64_t t = 0; t < n; ++t) {
    const float w = p[t];
    const T* vt = v + t * stride;
#pragma omp simd
    for (int d = 0; d < D; ++d) a[d] += w * widen(vt[d]);
  }
#pragma omp simd
  for (int d = 0; d < D; ++d) acc[d] = a[d];
}

#if defined(__AVX512F__)
// add_values for the G query heads that share a key/value head at once: each value vector loaded (and widened) once
// for all of them, and G x D / 16 independent accumulators in registers where one row had D / 16 in a chain; each
// row's terms still added in t's order, as fused multiply-adds. On smollm2-135m's heads (3 a group), the two builds
// of the kernel loaded in one process and timed in turn (bench/cpu_kernels_ab.py): 1.06-1.14x over 256 MB of pools
// at 1 row of 200-600 tokens and 8-32 rows of 300, both dtypes alike.
template <int D, int G, class T>
inline void add_values_shared(const T* __restrict v, int64_t stride, int64_t n, const float* __restrict p,
                              int64_t p_stride, const float* __restrict rescale, float* __restrict acc) {
  __m512 a[G][D / 16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c)
      a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), _mm512_set1_ps(rescale[g]));
  for (int64_t t = 0; t < n; ++t) {
    const T* vt = v + t * stride;
    __m512 vv[D / 16];
    for (int c = 0; c < D / 16; ++c) vv[c] = load16(vt + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * p_stride + t]);
      for (int c = 0; c < D / 16; ++c) a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// add_values_shared for a runtime group size of 2-8; false for others (each row then on its own).
template <int D, class T>
inline bool add_values_group(int64_t groups, const T* v, int64_t stride, int64_t n, const float* p, int64_t p_stride,
                             const float* rescale, float* acc) {
  switch (groups) {
    case 2: add_values_shared<D, 2, T>(v, stride, n, p, p_stride, rescale, acc); return true;
    case 3: add_values_shared<D, 3, T>(v, stride, n, p, p_stride, rescale, acc); return true;
    case 4: add_values_shared<D, 4, T>(v, stride, n, p, p_stride, rescale, acc); return true;
    case 5: add_values_shared<D, 5, T>(v, stride, n, p, p_stride, rescale, acc); return true;
    case 6: add_values_shared<D, 6, T>(v, stride, n, p, p_stride, rescale, acc); return true;
    case 7: add_values_shared<D, 7, T>(v, stride, n, p, p_stride, rescale, acc); return true;
    case 8: add_values_shared<D, 8, T>(v, stride, n, p, p_stride, rescale, acc); return true;
    default: return false;
  }
}
#endif

// Query heads [h0 * G, h1 * G) of one sequence, against its key/value heads [h0, h1).
template <int D, class T, class Q>
void attend_sequence(const Q* q, int64_t q_head_stride, const T* k_pool, const T* v_pool,
                     const int32_t* table, int64_t length, int64_t block_size, int64_t kv_heads, int64_t groups,
                     int64_t h0, int64_t h1, float scale, float* out, Scratch& s, bool wide) {
  const int64_t rows = (h1 - h0) * groups, token_stride = kv_heads * D;
  float* acc = s.acc.data();
  float* scores = s.scores.data();
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(s.max.begin(), s.max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.begin() + rows, 0.0f);
  // Blocks lie anywhere in the pool, and a hardware prefetcher learns a new stream too late for one block's few
  // kilobytes: ask for a block's keys and values a block ahead, so that their reads overlap the arithmetic (~1.2x
  // the kernel's speed over prefetching nothing; both a block ahead, where the values were asked for at their own
  // block's start, 0.96-0.985 of the time over 256 MB of pools, bench/cpu_kernels_ab.py).
  const auto prefetch_block = [&](int64_t block) {
    const int64_t at = static_cast<int64_t>(table[block]) * block_size * token_stride;
    const int64_t n = std::min(block_size, length - block * block_size);
    prefetch_rows(k_pool + at, n, token_stride, h0 * D, (h1 - h0) * D);
    prefetch_rows(v_pool + at, n, token_stride, h0 * D, (h1 - h0) * D);
  };
  prefetch_block(0);
  for (int64_t block = 0; block * block_size < length; ++block) {
    const int64_t n = std::min(block_size, length - block * block_size);
    const int64_t base = static_cast<int64_t>(table[block]) * block_size * token_stride;
    if ((block + 1) * block_size < length) prefetch_block(block + 1);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = h0 + r / groups;
      const Q* qr = q + (h0 * groups + r) * q_head_stride;
      const T* k = k_pool + base + head * D;
      float* sr = scores + r * block_size;
      for (int64_t t0 = 0; t0 < n; t0 += 16)
        score_keys<D, T, Q>(qr, k + t0 * token_stride, token_stride, std::min<int64_t>(16, n - t0), sr + t0, wide);
      const float block_max = scale_and_max(sr, n, scale, s.max[r]);
      const float rescale = fivefold::exp_nonpositive(s.max[r] - block_max);
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < n; ++t) {
        sr[t] = fivefold::exp_nonpositive(sr[t] - block_max);
        total += sr[t];
      }
      s.sum[r] = s.sum[r] * rescale + total;
      s.max[r] = block_max;
      s.rescale[r] = rescale;
    }
    // The values: a key/value head's query heads together where the AVX-512 form runs, else row by row.
    for (int64_t head = h0; head < h1; ++head) {
      const int64_t r0 = (head - h0) * groups;
      const T* v = v_pool + base + head * D;
#if defined(__AVX512F__)
      if (wide && add_values_group<D, T>(groups, v, token_stride, n, scores + r0 * block_size, block_size,
                                         s.rescale.data() + r0, acc + r0 * D))
        continue;
#endif
      for (int64_t r = r0; r < r0 + groups; ++r)
        add_values<D, T>(v, token_stride, n, scores + r * block_size, s.rescale[r], acc + r * D);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.0f / s.sum[r];
    float* o = out + (h0 * groups + r) * D;
    for (int d = 0; d < D; ++d) o[d] = acc[r * D + d] * inverse;
  }
}

template <int D, class T, class Q>
torch::Tensor decode_attention_d(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                 const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                 int64_t splits, bool wide, const int32_t* owners) {
  const int64_t batch = q.size(0), heads = q.size(1);
  const int64_t block_size = k_pool.size(1), kv_heads = k_pool.size(2), groups = heads / kv_heads;
  const int64_t table_stride = block_tables.stride(0), q_stride = q.stride(0), q_head_stride = q.stride(1);
  auto out = torch::zeros({batch, heads, D}, q.options().dtype(torch::kFloat32));
  const Q* qp = static_cast<const Q*>(q.data_ptr());
  const T* kp = static_cast<const T*>(k_pool.data_ptr());
  const T* vp = static_cast<const T*>(v_pool.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t per_item = kv_heads / splits;
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(per_item * groups, block_size, D);
    for (int64_t item = begin; item < end; ++item) {
      // Rows taken from both ends in turn (0, B-1, 1, B-2, ...): the threads' even shares of the items then hold
      // alike work where lengths rise along the rows, as a prompt chunk's tokens do.
      const int64_t turn = item / splits, part = item % splits;
      const int64_t b = turn % 2 == 0 ? turn / 2 : batch - 1 - turn / 2;
      if (lens[b] <= 0) continue;  // a padding row reads nothing and stays zero
      attend_sequence<D, T, Q>(qp + b * q_stride, q_head_stride, kp, vp, tables + (owners ? owners[b] : b) * table_stride, lens[b], block_size,
                         kv_heads, groups, part * per_item, (part + 1) * per_item, static_cast<float>(scale),
                         op + b * heads * D, scratch, wide);
    }
  });
  return out;
}

// q (B, H, D) float32 with unit stride along D; k_pool, v_pool (blocks, block_size, Hkv, D) contiguous, float32
// or bfloat16; block_tables int32 (B, max_blocks); seq_lens int32 (B,), each row's context including its own
// token; `splits` divides Hkv: the work items per sequence. `wide` false: score keys as a CPU without AVX-512
// does (for testing that form here). q is float32, or bfloat16 over a bfloat16 pool where FIVEFOLD_BF16_PAIRS.
// -> (B, H, D) float32; rows of length 0 are zeros.
template <class T, class Q>
torch::Tensor decode_attention_t(const torch::Tensor& q, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                                 const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale,
                                 int64_t splits, bool wide, const int32_t* owners) {
  switch (q.size(2)) {
    case 16: return decode_attention_d<16, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    case 32: return decode_attention_d<32, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    case 48: return decode_attention_d<48, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    case 64: return decode_attention_d<64, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    case 80: return decode_attention_d<80, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    case 96: return decode_attention_d<96, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    case 128: return decode_attention_d<128, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    case 256: return decode_attention_d<256, T, Q>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owners);
    default: TORCH_CHECK(false, "head size ", q.size(2), " is not compiled (16, 32, 48, 64, 80, 96, 128, 256)");
  }
}

}  // namespace

// The entry: decode_attention_t's arguments, and a bfloat16 q over a bfloat16 pool, answered in bfloat16 (the float32
// output rounded once). Such a q scores the keys as bfloat16 pairs where the CPU has them, unless `widened` or
// `portable`; else it is widened to float32, exactly. `portable`: scoring as a CPU without AVX-512 does. `owners`
// (int32, one a row of q), where given: the block table each row reads (a prompt chunk's tokens, rows of their own,
// share their sequence's); else row b reads table b.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale, int64_t splits, bool portable, bool widened,
                               std::optional<torch::Tensor> owners) {
  TORCH_CHECK(k_pool.dtype() == v_pool.dtype() &&
                  (k_pool.dtype() == torch::kFloat32 || k_pool.dtype() == torch::kBFloat16),
              "the pools: float32 or bfloat16, both alike");
  TORCH_CHECK(q.dtype() == torch::kFloat32 || q.dtype() == k_pool.dtype(), "q: float32, or the pools' dtype");
  const bool pairs = q.dtype() == torch::kBFloat16 && !portable && !widened && fivefold::bf16_pairs();
  if (q.dtype() == torch::kBFloat16 && !pairs)
    return decode_attention(q.to(torch::kFloat32), k_pool, v_pool, block_tables, seq_lens, scale, splits, portable,
                            widened, owners)
        .to(torch::kBFloat16);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be (B, H, D) with unit stride along D");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "the pools must be contiguous and of one shape");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && block_tables.stride(1) == 1, "block_tables: int32 rows");
  const bool owned = owners.has_value() && owners->defined();
  TORCH_CHECK(!owned || (owners->dtype() == torch::kInt32 && owners->is_contiguous() && owners->numel() == q.size(0)),
              "owners: contiguous int32, one a row of q");
  if (owned) {  // every row's table must exist: a wrong index would read anywhere
    const int32_t* o = owners->data_ptr<int32_t>();
    for (int64_t b = 0; b < q.size(0); ++b)
      TORCH_CHECK(o[b] >= 0 && o[b] < block_tables.size(0), "owners: row ", b, " names table ", o[b], " of ",
                  block_tables.size(0));
  }
  const int32_t* owner_rows = owned ? owners->data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(seq_lens.dtype() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens: contiguous int32");
  TORCH_CHECK(q.size(1) % k_pool.size(2) == 0 && k_pool.size(2) % splits == 0, "heads do not divide");
  TORCH_CHECK(q.size(2) == k_pool.size(3), "head sizes differ");
  const bool wide = !portable;
#if defined(FIVEFOLD_BF16_PAIRS)
  if (pairs)
    return decode_attention_t<bf16, bf16>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owner_rows)
        .to(torch::kBFloat16);
#endif
  if (k_pool.dtype() == torch::kBFloat16)
    return decode_attention_t<bf16, float>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owner_rows);
  return decode_attention_t<float, float>(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, wide, owner_rows);
}
