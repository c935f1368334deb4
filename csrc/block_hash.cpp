// Chained prefix-cache block hashes, the twin of python/enginecore/sched/block_hash.py.
// Bytes per block (docs/architecture.md): parent (32) || token ids as uint32 LE || extra keys.
#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_hash.h"
#include "sha256.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// One token id. Ids below 2**30 are one-digit ints in CPython: read that digit
// straight from the object (a function call per id cost ~1 ns of the ~7 ns
// per token the whole hash takes); the rest take the general path.
inline uint32_t token_id(PyObject* item) {
  if (!PyLong_Check(item)) throw py::type_error("token ids must be ints");
#if PY_VERSION_HEX >= 0x030C0000
  if (PyUnstable_Long_IsCompact(reinterpret_cast<PyLongObject*>(item))) {
    const Py_ssize_t v = PyUnstable_Long_CompactValue(reinterpret_cast<PyLongObject*>(item));
    if (v >= 0 && v <= 0xFFFFFFFFLL) return static_cast<uint32_t>(v);
    throw py::value_error("token ids must be in [0, 2**32)");
  }
#else
  const Py_ssize_t size = Py_SIZE(item);
  if (size == 0) return 0;
  if (size == 1) return static_cast<uint32_t>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]);
#endif
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
    throw py::value_error("token ids must be in [0, 2**32)");
  }
  return static_cast<uint32_t>(v);
}

// Where the token ids come from: the items of a list or tuple, or a uint32
// buffer (array('I'), numpy); any other iterable goes through a list first.
class TokenSource {
 public:
  explicit TokenSource(py::handle obj) {
    PyObject* o = obj.ptr();
    if (!PyList_Check(o) && !PyTuple_Check(o) && !take_buffer(obj)) {
      owned_ = py::list(py::reinterpret_borrow<py::iterable>(obj));
      o = owned_.ptr();
    }
    if (!buffer_) {
      items_ = PySequence_Fast_ITEMS(o);
      size_ = static_cast<size_t>(PySequence_Fast_GET_SIZE(o));
    }
  }

  size_t size() const { return size_; }

  // Ids [begin, end) into out, validated as the Python twin does.
  void read(size_t begin, size_t end, uint32_t* out) const {
    if (buffer_) {
      for (size_t i = begin; i < end; ++i) std::memcpy(out++, data_ + i * stride_, 4);
      return;
    }
    for (size_t i = begin; i < end; ++i) *out++ = token_id(items_[i]);
  }

 private:
  bool take_buffer(py::handle obj) {
    try {
      info_ = py::reinterpret_borrow<py::buffer>(obj).request();
    } catch (const std::exception&) {
      return false;
    }
    if (info_.ndim != 1 || info_.itemsize != 4 ||
        (info_.format != "I" && info_.format != "L" && info_.format != "=I" &&
         info_.format != "<I")) {
      return false;
    }
    buffer_ = true;
    data_ = static_cast<const uint8_t*>(info_.ptr);
    stride_ = static_cast<size_t>(info_.strides[0]);
    size_ = static_cast<size_t>(info_.shape[0]);
    return true;
  }

  py::object owned_;
  py::buffer_info info_;
  bool buffer_ = false;
  const uint8_t* data_ = nullptr;
  size_t stride_ = 0;
  PyObject** items_ = nullptr;
  size_t size_ = 0;
};

}  // namespace

// Holds the GIL throughout (~4.5 us per 1k tokens): block b+1's ids are read
// from their Python ints while block b hashes, and the CPU overlaps the two
// (the chain is latency-bound); each digest is written straight into its bytes.
void append_block_hashes(py::handle token_ids, size_t first_token, size_t num_blocks,
                         size_t block_size, const uint8_t parent[32], const std::string& extra,
                         py::handle out) {
  const TokenSource source(token_ids);
  if (first_token + num_blocks * block_size > source.size()) {
    throw py::value_error("fewer token ids than the blocks to hash");
  }
  Sha256Chain chain(parent, 4 * block_size, reinterpret_cast<const uint8_t*>(extra.data()),
                    extra.size());
  // Token ids go in as the host's uint32 bytes: little endian, as the format says.
  std::vector<uint32_t> cur(block_size), ahead(block_size);
  size_t begin = first_token;
  if (num_blocks) source.read(begin, begin + block_size, cur.data());
  for (size_t b = 0; b < num_blocks; ++b, begin += block_size) {
    if (b + 1 < num_blocks) source.read(begin + block_size, begin + 2 * block_size, ahead.data());
    py::object digest = py::reinterpret_steal<py::object>(PyBytes_FromStringAndSize(nullptr, 32));
    if (!digest) throw py::error_already_set();
    chain.next(reinterpret_cast<const uint8_t*>(cur.data()),
               reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(digest.ptr())));
    if (PyList_Append(out.ptr(), digest.ptr()) != 0) throw py::error_already_set();
    cur.swap(ahead);
  }
}

void parent_bytes(py::handle parent, uint8_t out[32]) {
  std::memset(out, 0, 32);
  if (parent.is_none()) return;
  if (!PyBytes_Check(parent.ptr()) || PyBytes_GET_SIZE(parent.ptr()) != 32) {
    throw py::value_error("parent hash must be 32 bytes");
  }
  std::memcpy(out, PyBytes_AS_STRING(parent.ptr()), 32);
}

namespace {

py::list block_hashes(py::handle token_ids, size_t block_size, py::object parent,
                      py::bytes extra) {
  if (block_size == 0) throw py::value_error("block_size must be positive");
  uint8_t root[32];
  parent_bytes(parent, root);
  // A list or tuple is read in place; anything else becomes a list once.
  py::object seq = py::reinterpret_borrow<py::object>(token_ids);
  const bool in_place = PyList_Check(seq.ptr()) || PyTuple_Check(seq.ptr()) ||
                        PyObject_CheckBuffer(seq.ptr());
  if (!in_place) seq = py::list(py::reinterpret_borrow<py::iterable>(token_ids));
  const TokenSource source(seq);
  const size_t num_blocks = source.size() / block_size;
  py::list out;
  append_block_hashes(seq, 0, num_blocks, block_size, root, extra, out);
  // Every id is validated (as the Python twin does), even those past the last full block.
  std::vector<uint32_t> tail(source.size() - num_blocks * block_size);
  source.read(num_blocks * block_size, source.size(), tail.data());
  return out;
}

}  // namespace

void bind_block_hash(py::module_& m) {
  m.def("block_hashes", &block_hashes, py::arg("token_ids"), py::arg("block_size"),
        py::arg("parent"), py::arg("extra"),
        "Chained sha256 of every full block (see docs/architecture.md).");
  m.def("sha256", [](py::bytes data) {
    std::string s = data;
    uint8_t out[32];
    sha256(reinterpret_cast<const uint8_t*>(s.data()), s.size(), out);
    return py::bytes(reinterpret_cast<char*>(out), 32);
  }, py::arg("data"), "One-shot SHA-256 (for tests of the compression function).");
  m.def("sha256_impl", &sha256_impl_name, "Which compression runs: 'sha-ni' or 'portable'.");
  m.def("sha256_force_portable", &sha256_force_portable, py::arg("force"),
        "Use the portable compression even where SHA-NI exists (tests).");
}

}  // namespace enginecore
