// The Python module of the CPU kernels (built by fivefold/kernels/cpu_build.py): one extension, so one build.
#include <torch/extension.h>

#include "cpu_simd.h"

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale, int64_t splits, bool portable, bool widened,
                               std::optional<torch::Tensor> owners);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, int64_t width, std::optional<torch::Tensor> bias);
int64_t linear_rows_width();
torch::Tensor decode_blocks(torch::Tensor x, std::vector<torch::Tensor> params, std::vector<double> eps,
                            std::vector<int64_t> products, int64_t q_heads, torch::Tensor cos, torch::Tensor signed_sin,
                            std::vector<torch::Tensor> k_pools, std::vector<torch::Tensor> v_pools, torch::Tensor slots,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t splits,
                            int64_t width);
torch::Tensor rms_norm_rows(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul_rows(torch::Tensor gate_up);
std::vector<torch::Tensor> add_rms_norm_rows(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor rotary_decode_attention(torch::Tensor heads, int64_t q_heads, torch::Tensor cos, torch::Tensor signed_sin,
                                      torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                                      torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t splits,
                                      bool portable);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged one-token attention, float32 or bfloat16", py::arg("q"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("splits"),
        py::arg("portable") = false, py::arg("widened") = false,
        py::arg("owners") = py::none());
  m.def("linear_rows", &linear_rows, "x w^T + bias at a few rows: x float32 or bfloat16, w float32 or bfloat16",
        py::arg("x"), py::arg("w"), py::arg("width") = 0, py::arg("bias") = py::none());
  m.def("rms_norm_rows", &rms_norm_rows, "RMSNorm of each row, float32", py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("add_rms_norm_rows", &add_rms_norm_rows, "(x + delta, RMSNorm(x + delta)), float32", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul_rows", &silu_mul_rows, "silu(gate) * up from the fused gate/up product, float32",
        py::arg("gate_up"));
  m.def("rotary_decode_attention", &rotary_decode_attention, "RoPE, the KV store and paged decode attention, float32",
        py::arg("heads"), py::arg("q_heads"), py::arg("cos"), py::arg("signed_sin"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("splits"), py::arg("portable") = false);
  m.def("decode_blocks", &decode_blocks, "every block of a decode-only step as one call, float32", py::arg("x"),
        py::arg("params"), py::arg("eps"), py::arg("products"), py::arg("q_heads"), py::arg("cos"),
        py::arg("signed_sin"), py::arg("k_pools"), py::arg("v_pools"), py::arg("slots"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("splits"), py::arg("width") = 0);
  m.def("linear_rows_width", &linear_rows_width, "the rows kernel's widest instruction set here: 512, 256 or 0");
  m.def("bf16_pairs", &fivefold::bf16_pairs,
        "whether bfloat16 rows and queries multiply as bfloat16 pairs here (AVX512_BF16)");
}
