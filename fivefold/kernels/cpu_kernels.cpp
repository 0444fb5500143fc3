// The Python module of the CPU kernels (built by fivefold/kernels/cpu_build.py): one extension, so one build.
#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor block_tables,
                               torch::Tensor seq_lens, double scale, int64_t splits, bool portable);
torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w, int64_t width);
int64_t linear_rows_width();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged one-token attention, float32", py::arg("q"), py::arg("k_pool"),
        py::arg("v_pool"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"), py::arg("splits"),
        py::arg("portable") = false);
  m.def("linear_rows", &linear_rows, "x w^T at a few rows, float32", py::arg("x"), py::arg("w"),
        py::arg("width") = 0);
  m.def("linear_rows_width", &linear_rows_width, "the rows kernel's widest instruction set here: 512, 256 or 0");
}
