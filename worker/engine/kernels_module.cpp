// The Python module of the engine's CPU kernels (kernels.h). Each call runs without the GIL:
// none touches a Python object once its arguments are converted, and a worker whose engine is a
// thread keeps its Redis I/O going during a product or a whole step.
#include "kernels.h"

namespace py = pybind11;
using namespace llm_stream;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("q4_linear", &q4_linear, "x @ w.T for 4-bit weights, activations rounded to 8 bits per group", nogil);
  m.def("q8_linear", &q8_linear, "x @ w.T for 8-bit weights, activations rounded to 8 bits per group", nogil);
  m.def("instruction_set", &instruction_set, "the integer dot product this CPU runs");
  m.def("set_instruction_set", &set_instruction_set, "avx2: use the AVX2 path even where VNNI is there; best: undo");
  m.def("rms_norm", &rms_norm, "LlamaRMSNorm of each row of x, in one pass", nogil);
  m.def("rope_store", &rope_store, "q and k rotated, the new k and v written to their pool rows; returns q", nogil);
  m.def("decode_attention", &decode_attention, "one query token a row against its paged keys/values, read in place",
        nogil);
  py::class_<DecodeLayers>(m, "DecodeLayers", "every decoder layer of a step of decode rows, one call")
      .def(py::init<>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("__len__", &DecodeLayers::size)
      .def("forward", &DecodeLayers::forward, nogil);
}
