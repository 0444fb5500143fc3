// A decode block's small ops on a CPU as one call each (serve.cpu_kernel): RMSNorm over rows, the residual add
// followed by the next RMSNorm, SwiGLU's silu(gate) * up, and RoPE + the store of keys and values + the paged
// decode attention; and every block of a decode-only step through them and its products, as one call. Built
// once per machine with the other CPU kernels by fivefold/kernels/cpu_build.py.
//
// At a batch-1 decode each of these moves a few kilobytes; as torch ops they are ~10 calls each (F.rms_norm is
// pow, mean, add, rsqrt, two muls and their casts), 30-40 us a norm and ~60 us of rotation, slicing and
// stores a layer on the 2-vCPU test host: ~4 ms of a 24 ms smollm2-135m token outside its products. Here
// each is one call of a few microseconds.
//
// Exactness: the rotation is x * cos + roll(x) * signed_sin with each product and the sum rounded on its own,
// as torch's three elementwise ops round them, so the rotated keys stored in the pool equal the torch path's
// bit for bit (contraction into fused multiply-adds is switched off for this file). A norm's sum of squares
// is summed in another order than torch's reduction: it equals F.rms_norm to float32 rounding, not bit for bit.
//
// Every call also takes bfloat16 (a bfloat16 engine's), rounded where RMSNorm.forward and torch's bfloat16 ops
// round: the residual sum, the normalised row before its weight, the product by the weight, silu's result and its
// product by up, each of the rotation's products and their sum; all arithmetic between in float32. The rotated
// keys stored are then the torch path's bit for bit in bfloat16 too.
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "cpu_simd.h"

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale, int64_t splits, bool portable, bool widened,
                               std::optional<torch::Tensor> owners);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, int64_t width, std::optional<torch::Tensor> bias);

namespace {

using fivefold::bf16;
using fivefold::to;
using fivefold::widen;

// out = x * rsqrt(mean(x^2) + eps) * w for one row of n, the product by x's factor rounded before the weight's
// (RMSNorm.forward's order; in bfloat16 it rounds to bfloat16 there, as its cast back does).
template <class T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += widen(x[i]) * widen(x[i]);
  const float factor = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = to<T>(widen(to<T>(widen(x[i]) * factor)) * widen(w[i]));
}

// A pointer to a float32 or bfloat16 tensor's elements as T.
template <class T>
inline T* elements(const torch::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight, const char* name) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": float32 or bfloat16 only, x and the weight alike");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), name, ": x must be contiguous (rows, width)");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), name,
              ": the weight must be contiguous (width,)");
}

// Rows per thread's share below which one thread does them all: a decode's rows are microseconds of work.
constexpr int64_t kGrain = 16;

}  // namespace

// x (T, h) float32 contiguous, weight (h,) -> RMSNorm of each row.
template <class T>
void norm_rows(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& out, double eps) {
  const int64_t n = x.size(1);
  const T* xp = elements<T>(x);
  const T* wp = elements<T>(weight);
  T* op = elements<T>(out);
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
}

torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight, "rms_norm_rows");
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16) {
    norm_rows<bf16>(x, weight, out, eps);
  } else {
    norm_rows<float>(x, weight, out, eps);
  }
  return out;
}

// The residual add and the norm after it: (x + delta, RMSNorm(x + delta)), x and delta (T, h) contiguous.
template <class T>
void add_norm_rows(const torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& weight,
                   const torch::Tensor& sum, const torch::Tensor& out, double eps) {
  const int64_t n = x.size(1);
  const T* xp = elements<T>(x);
  const T* dp = elements<T>(delta);
  const T* wp = elements<T>(weight);
  T* sp = elements<T>(sum);
  T* op = elements<T>(out);
  at::parallel_for(0, x.size(0), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) sp[r * n + i] = to<T>(widen(xp[r * n + i]) + widen(dp[r * n + i]));
      norm_row(sp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

std::vector<torch::Tensor> add_rms_norm_rows(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(x, weight, "add_rms_norm_rows");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type() && delta.is_contiguous() && delta.sizes() == x.sizes(),
              "add_rms_norm_rows: delta must be contiguous, of x's dtype and shape");
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16) {
    add_norm_rows<bf16>(x, delta, weight, sum, out, eps);
  } else {
    add_norm_rows<float>(x, delta, weight, sum, out, eps);
  }
  return {sum, out};
}

// SwiGLU's product from the fused gate/up product: gate_up (T, 2F) contiguous, gate the first F columns, up the
// last -> silu(gate) * up (T, F). silu(g) = g / (1 + exp(-g)), taken through exp of -|g| (exact to a few ulp,
// and never overflowing): g / (1 + e) for g >= 0, g e / (1 + e) below, e = exp(-|g|).
// In bfloat16 silu's result is rounded before its product by up, as torch's two bfloat16 ops round.
template <class T>
void silu_mul(const torch::Tensor& gate_up, const torch::Tensor& out, int64_t width) {
  const T* gp = elements<T>(gate_up);
  T* op = elements<T>(out);
  at::parallel_for(0, gate_up.size(0), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * width;
      const T* u = g + width;
      T* o = op + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float x = widen(g[i]);
        const float e = fivefold::exp_nonpositive(x < 0.f ? x : -x);
        o[i] = to<T>(widen(to<T>((x < 0.f ? x * e : x) / (1.f + e))) * widen(u[i]));
      }
    }
  });
}

torch::Tensor silu_mul_rows(torch::Tensor gate_up) {
  TORCH_CHECK((gate_up.scalar_type() == torch::kFloat32 || gate_up.scalar_type() == torch::kBFloat16) &&
                  gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul_rows: gate_up must be contiguous float32 or bfloat16 (rows, 2 x width)");
  const int64_t width = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), width}, gate_up.options());
  if (gate_up.scalar_type() == torch::kBFloat16) {
    silu_mul<bf16>(gate_up, out, width);
  } else {
    silu_mul<float>(gate_up, out, width);
  }
  return out;
}

// RoPE on each row's queries (into q) and keys, and the store of its keys and values at its slot (< 0: none).
template <class T>
void rotate_and_store(const torch::Tensor& heads, int64_t q_heads, const torch::Tensor& cos,
                      const torch::Tensor& signed_sin, const torch::Tensor& k_pool, const torch::Tensor& v_pool,
                      const torch::Tensor& slots, const torch::Tensor& q) {
  const int64_t tokens = heads.size(0), dim = heads.size(2), kv_heads = k_pool.size(2);
  const int64_t slot_count = k_pool.size(0) * k_pool.size(1), half = dim / 2;
  const T* hp = elements<T>(heads);
  const T* cp = elements<T>(cos);
  const T* sp = elements<T>(signed_sin);
  const int32_t* slot = slots.data_ptr<int32_t>();
  T* qp = elements<T>(q);
  T* kp = elements<T>(k_pool);
  T* vp = elements<T>(v_pool);
  const int64_t row_stride = heads.stride(0), head_stride = heads.stride(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] < slot_count, "rotary_decode_attention: slot ", slot[t], " is past the pool's ", slot_count);
    const T* c = cp + t * dim;
    const T* s = sp + t * dim;
    auto rotate = [&](const T* x, T* out) {
      for (int64_t i = 0; i < dim; ++i) {
        const T a = to<T>(widen(x[i]) * widen(c[i]));
        const T b = to<T>(widen(x[i < half ? i + half : i - half]) * widen(s[i]));
        out[i] = to<T>(widen(a) + widen(b));
      }
    };
    const T* row = hp + t * row_stride;
    for (int64_t h = 0; h < q_heads; ++h) rotate(row + h * head_stride, qp + (t * q_heads + h) * dim);
    if (slot[t] < 0) continue;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = (static_cast<int64_t>(slot[t]) * kv_heads + h) * dim;
      rotate(row + (q_heads + h) * head_stride, kp + at);
      const T* v = row + (q_heads + kv_heads + h) * head_stride;
      for (int64_t i = 0; i < dim; ++i) vp[at + i] = v[i];
    }
  }
}

// A decode-only step's attention from the fused q/k/v product: heads (T, Hq + 2 Hkv, D), unit stride along D,
// the first Hq heads queries, then keys, then values, not yet rotated. Rotates queries and keys by RoPE (cos,
// signed_sin (T, D) contiguous: x * cos + roll(x, D / 2) * signed_sin), stores each row's key and value at its
// slot of the pools (blocks, block_size, Hkv, D) (slot < 0: a padding row, stored nowhere) and attends as
// decode_attention does. -> (T, Hq, D).
torch::Tensor rotary_decode_attention(torch::Tensor heads, int64_t q_heads, torch::Tensor cos, torch::Tensor signed_sin,
                                      torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t splits,
                                      bool portable) {
  const auto dtype = heads.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && cos.scalar_type() == dtype &&
                  signed_sin.scalar_type() == dtype && k_pool.scalar_type() == dtype &&
                  v_pool.scalar_type() == dtype,
              "rotary_decode_attention: float32 or bfloat16 only, every tensor alike");
  TORCH_CHECK(heads.dim() == 3 && heads.stride(2) == 1, "heads must be (T, heads, D) with unit stride along D");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.dim() == 4,
              "the pools must be contiguous (blocks, block_size, Hkv, D) and of one shape");
  const int64_t tokens = heads.size(0), dim = heads.size(2), kv_heads = k_pool.size(2);
  TORCH_CHECK(heads.size(1) == q_heads + 2 * kv_heads && k_pool.size(3) == dim && dim % 2 == 0,
              "heads must hold q_heads queries, then the pool's key and value heads, of its head size");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == tokens * dim &&
                  signed_sin.numel() == tokens * dim,
              "cos and signed_sin must be contiguous (T, D)");
  TORCH_CHECK(slots.scalar_type() == torch::kInt32 && slots.is_contiguous() && slots.numel() == tokens,
              "slots: contiguous int32, one a row");
  auto q = torch::empty({tokens, q_heads, dim}, heads.options());
  if (dtype == torch::kBFloat16) {
    rotate_and_store<bf16>(heads, q_heads, cos, signed_sin, k_pool, v_pool, slots, q);
  } else {
    rotate_and_store<float>(heads, q_heads, cos, signed_sin, k_pool, v_pool, slots, q);
  }
  return decode_attention(q, k_pool, v_pool, block_tables, seq_lens, scale, splits, portable, false, std::nullopt);
}

// Every block of a decode-only step whose four products run on the rows kernel (cpu_linear_rows.cpp) or torch's
// linear, as one call: the lean loop's ops in its order, each the call above or the product the loop would
// run, so the result equals the loop calling them one by one bit for bit, without the Python and dispatch
// between them. x (T, h) the embedded rows; per layer 7 params (attn norm weight, q/k/v weight, its bias or an
// empty tensor, o weight, mlp norm weight, gate/up weight, down weight), 2 eps and 4 products (q/k/v, o,
// gate/up, down: 0 the rows kernel, 1 torch's linear); k_pools, v_pools each layer's (blocks, block_size, Hkv,
// D); the rest as rotary_decode_attention takes them. -> x after the last block.
torch::Tensor decode_blocks(torch::Tensor x, std::vector<torch::Tensor> params, std::vector<double> eps,
                            std::vector<int64_t> products, int64_t q_heads, torch::Tensor cos, torch::Tensor signed_sin,
                            std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools, torch::Tensor slots,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t splits,
                            int64_t width) {
  const int64_t layers = static_cast<int64_t>(k_pools.size()), tokens = x.size(0);
  TORCH_CHECK(layers > 0 && v_pools.size() == k_pools.size() && params.size() == 7 * k_pools.size() &&
                  eps.size() == 2 * k_pools.size() && products.size() == 4 * k_pools.size(),
              "decode_blocks: 7 params, 2 eps and 4 products a layer, and a key and a value pool each");
  // A product as the loop runs it: 0 the rows kernel (its bias added to its float32 sums), 1 torch's linear
  // (F.linear's op, the bias inside).
  auto product = [&](const torch::Tensor& in, const torch::Tensor& w, const torch::Tensor& bias, int64_t kind) {
    if (kind == 1) return bias.numel() ? at::linear(in, w, bias) : at::linear(in, w);
    return linear_rows(in, w, width, bias);
  };
  const torch::Tensor none;
  torch::Tensor delta, normed;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* p = params.data() + 7 * l;
    const int64_t* kind = products.data() + 4 * l;
    if (!delta.defined()) {
      normed = rms_norm_rows(x, p[0], eps[2 * l]);
    } else {
      auto both = add_rms_norm_rows(x, delta, p[0], eps[2 * l]);
      x = both[0];
      normed = both[1];
    }
    auto qkv = product(normed, p[1], p[2], kind[0]);
    auto out = rotary_decode_attention(qkv.view({tokens, -1, k_pools[l].size(3)}), q_heads, cos, signed_sin,
                                       k_pools[l], v_pools[l], slots, block_tables, seq_lens, scale, splits, false);
    qkv = torch::Tensor();
    auto both = add_rms_norm_rows(x, product(out.view({tokens, -1}), p[3], none, kind[1]), p[4], eps[2 * l + 1]);
    x = both[0];
    normed = both[1];
    delta = product(silu_mul_rows(product(normed, p[5], none, kind[2])), p[6], none, kind[3]);
  }
  return x + delta;
}
