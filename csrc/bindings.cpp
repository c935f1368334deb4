// Python bindings of enginecore._C. Each hot path lives in its own file
// named after its Python twin; this file only wires them into the module.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace enginecore {
void bind_bf16_gemm(py::module_& m);
void bind_bf16_gemv(py::module_& m);
void bind_block_hash(py::module_& m);
void bind_blocking_queue(py::module_& m);
void bind_cpu_info(py::module_& m);
void bind_fused_ops(py::module_& m);
void bind_greedy_sampler(py::module_& m);
void bind_output_encoder(py::module_& m);
void bind_paged_attention(py::module_& m);
void bind_random_sampler(py::module_& m);
void bind_logprobs(py::module_& m);
void bind_block_pool(py::module_& m);
void bind_request_table(py::module_& m);
void bind_scheduler_loops(py::module_& m);
void bind_synthetic_sampler(py::module_& m);
void bind_zmq_send(py::module_& m);
}  // namespace enginecore

#ifndef ENGINECORE_VERSION
#define ENGINECORE_VERSION "0.0.0"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "enginecore native hot paths";
  m.def("version", [] { return std::string(ENGINECORE_VERSION); },
        "Version of the package the extension was built for.");
  enginecore::bind_bf16_gemm(m);
  enginecore::bind_bf16_gemv(m);
  enginecore::bind_block_hash(m);
  enginecore::bind_blocking_queue(m);
  enginecore::bind_cpu_info(m);
  enginecore::bind_fused_ops(m);
  enginecore::bind_greedy_sampler(m);
  enginecore::bind_output_encoder(m);
  enginecore::bind_paged_attention(m);
  enginecore::bind_random_sampler(m);
  enginecore::bind_logprobs(m);
  enginecore::bind_block_pool(m);
  enginecore::bind_request_table(m);
  enginecore::bind_scheduler_loops(m);
  enginecore::bind_synthetic_sampler(m);
  enginecore::bind_zmq_send(m);
}
