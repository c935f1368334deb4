// Chained prefix-cache block hashes, the twin of python/enginecore/sched/block_hash.py.
// Bytes per block (docs/architecture.md): parent (32) || token ids as uint32 LE || extra keys.
#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "sha256.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Token ids of a list, tuple or uint32 buffer, as uint32 little endian.
// Holds the GIL: it reads Python objects.
std::vector<uint32_t> tokens_from(py::handle obj, size_t limit) {
  std::vector<uint32_t> out;
  PyObject* o = obj.ptr();
  if (PyList_Check(o) || PyTuple_Check(o)) {
    const bool is_list = PyList_Check(o);
    Py_ssize_t n = is_list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
    n = std::min<Py_ssize_t>(n, static_cast<Py_ssize_t>(limit));
    out.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = is_list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
      if (!PyLong_Check(item)) {
        throw py::type_error("token ids must be ints");
      }
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
        throw py::value_error("token ids must be in [0, 2**32)");
      }
      out[static_cast<size_t>(i)] = static_cast<uint32_t>(v);
    }
    return out;
  }
  py::buffer_info info;
  try {
    info = py::reinterpret_borrow<py::buffer>(obj).request();
  } catch (const std::exception&) {
    // Any other iterable: go through a list.
    return tokens_from(py::list(py::reinterpret_borrow<py::iterable>(obj)), limit);
  }
  if (info.ndim != 1 || info.itemsize != 4 ||
      (info.format != "I" && info.format != "L" && info.format != "=I" && info.format != "<I")) {
    return tokens_from(py::list(py::reinterpret_borrow<py::iterable>(obj)), limit);
  }
  const size_t n = std::min<size_t>(static_cast<size_t>(info.shape[0]), limit);
  out.resize(n);
  const auto* src = static_cast<const uint8_t*>(info.ptr);
  const Py_ssize_t stride = info.strides[0];
  for (size_t i = 0; i < n; ++i) std::memcpy(&out[i], src + i * stride, 4);
  return out;
}

}  // namespace

// Hashes of all full blocks; `digests` receives 32 bytes per block. GIL-free.
void chained_block_hashes(const uint32_t* tokens, size_t num_blocks, size_t block_size,
                          const uint8_t parent[32], const uint8_t* extra, size_t extra_len,
                          uint8_t* digests) {
  const size_t msg_len = 32 + 4 * block_size + extra_len;
  const size_t nblocks = (msg_len + 9 + 63) / 64;
  std::vector<uint8_t> buf(nblocks * 64, 0);
  // Padding and length never change between blocks: write them once.
  buf[msg_len] = 0x80;
  const uint64_t bits = uint64_t(msg_len) * 8;
  for (int i = 0; i < 8; ++i) buf[nblocks * 64 - 1 - i] = uint8_t(bits >> (8 * i));
  if (extra_len) std::memcpy(buf.data() + 32 + 4 * block_size, extra, extra_len);
  Sha256CompressFn compress = sha256_compress();
  const uint8_t* prev = parent;
  for (size_t b = 0; b < num_blocks; ++b) {
    std::memcpy(buf.data(), prev, 32);
    std::memcpy(buf.data() + 32, tokens + b * block_size, 4 * block_size);  // LE host
    uint32_t state[8];
    std::memcpy(state, kSha256Init, sizeof(state));
    compress(state, buf.data(), nblocks);
    uint8_t* out = digests + 32 * b;
    for (int i = 0; i < 8; ++i) {
      out[4 * i] = uint8_t(state[i] >> 24);
      out[4 * i + 1] = uint8_t(state[i] >> 16);
      out[4 * i + 2] = uint8_t(state[i] >> 8);
      out[4 * i + 3] = uint8_t(state[i]);
    }
    prev = out;
  }
}

py::list block_hashes(py::handle token_ids, size_t block_size, py::object parent,
                      py::bytes extra) {
  if (block_size == 0) throw py::value_error("block_size must be positive");
  uint8_t root[32] = {0};
  if (!parent.is_none()) {
    std::string p = py::cast<std::string>(py::reinterpret_borrow<py::bytes>(parent));
    if (p.size() != 32) throw py::value_error("parent hash must be 32 bytes");
    std::memcpy(root, p.data(), 32);
  }
  const Py_ssize_t total = PyObject_Length(token_ids.ptr());
  if (total < 0) throw py::error_already_set();
  const size_t num_blocks = static_cast<size_t>(total) / block_size;
  // Every id is validated (as the Python twin does), even those past the last full block.
  std::vector<uint32_t> tokens = tokens_from(token_ids, static_cast<size_t>(total));
  std::string extra_s = extra;
  std::vector<uint8_t> digests(num_blocks * 32);
  {
    py::gil_scoped_release release;
    chained_block_hashes(tokens.data(), num_blocks, block_size, root,
                         reinterpret_cast<const uint8_t*>(extra_s.data()), extra_s.size(),
                         digests.data());
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(num_blocks));
  if (!list) throw py::error_already_set();
  for (size_t b = 0; b < num_blocks; ++b) {
    PyObject* h = PyBytes_FromStringAndSize(reinterpret_cast<char*>(&digests[32 * b]), 32);
    if (!h) {
      Py_DECREF(list);
      throw py::error_already_set();
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(b), h);
  }
  return py::reinterpret_steal<py::list>(list);
}

void bind_block_hash(py::module_& m) {
  m.def("block_hashes", &block_hashes, py::arg("token_ids"), py::arg("block_size"),
        py::arg("parent"), py::arg("extra"),
        "Chained sha256 of every full block (see docs/architecture.md).");
  m.def("sha256", [](py::bytes data) {
    std::string s = data;
    uint8_t out[32];
    sha256(reinterpret_cast<const uint8_t*>(s.data()), s.size(), out);
    return py::bytes(reinterpret_cast<char*>(out), 32);
  }, "One-shot SHA-256 (for tests of the compression function).");
  m.def("sha256_impl", &sha256_impl_name, "Which compression runs: 'sha-ni' or 'portable'.");
  m.def("sha256_force_portable", &sha256_force_portable, py::arg("force"),
        "Use the portable compression even where SHA-NI exists (tests).");
}

}  // namespace enginecore
