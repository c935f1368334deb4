// Chained prefix-cache block hashes, the twin of python/enginecore/sched/block_hash.py.
// Bytes per block (docs/architecture.md): parent (32) || token ids as uint32 LE || extra keys.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "pyref.h"
#include "sha256.h"
#include "sha256_chain.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// The common id (a small non-negative int), read without a call; false where
// it needs the general path (token_id), which validates and raises.
inline bool small_token_id(PyObject* item, uint32_t& out) {
  long long v = 0;
  const bool ok = compact_long(item, v) && v >= 0 && v <= 0xFFFFFFFFLL;
  out = static_cast<uint32_t>(v);
  return ok;
}

// Thrown where an id is not an int (a numpy scalar, an object with __index__):
// block_hashes converts the ids as the twin's array('I', ...) does and starts
// again, so no id's code runs while the chain reads the ids in place.
struct NotAnInt {};

// An int id, validated as the Python twin does.
inline uint32_t int_token_id(PyObject* item) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
  if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
    throw py::value_error("token ids must be in [0, 2**32)");
  }
  return static_cast<uint32_t>(v);
}

// One token id of a list, tuple or converted iterable.
inline uint32_t token_id(PyObject* item) {
  uint32_t id;
  if (small_token_id(item, id)) return id;
  if (!PyLong_Check(item)) throw NotAnInt{};
  return int_token_id(item);
}

// The ids as the twin's array('I', ids) reads them: in order, each through
// __index__ (TypeError where it has none), each range-checked as it comes, so
// the first bad id decides the error as it does there. `seq` is a list or
// tuple; its items are held by a copy while their code runs.
py::list ids_through_index(py::handle seq) {
  const py::list items = py::reinterpret_steal<py::list>(PySequence_List(seq.ptr()));
  if (!items) throw py::error_already_set();
  // Held here while the ids' code runs: no half-built list is ever visible to
  // it (gc.get_objects() would hand it NULL items).
  std::vector<py::object> ids;
  ids.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    PyObject* item = items[i].ptr();
    py::object id = py::reinterpret_borrow<py::object>(item);
    if (!PyLong_Check(item)) {
      id = py::reinterpret_steal<py::object>(PyNumber_Index(item));
      if (!id) {
        // As the twin maps array()'s errors: TypeError / OverflowError.
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
          PyErr_Clear();
          throw py::type_error("token ids must be ints");
        }
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
          PyErr_Clear();
          throw py::value_error("token ids must be in [0, 2**32)");
        }
        throw py::error_already_set();
      }
    }
    int_token_id(id.ptr());
    ids.push_back(std::move(id));
  }
  py::list out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), ids[i].release().ptr());
  }
  return out;
}

// Where the token ids come from: the items of a list or tuple, or a uint32
// buffer (array('I'), numpy); any other iterable goes through a list first.
class TokenSource {
 public:
  explicit TokenSource(py::handle obj) : obj_(obj) {
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

  // The list or tuple the ids are read from (not for a uint32 buffer).
  py::handle items() const { return owned_ ? py::handle(owned_) : obj_; }

  // Id i into out without a call; false where it needs the general path.
  bool small_at(size_t i, uint32_t& out) const {
    if (!buffer_) return small_token_id(items_[i], out);
    std::memcpy(&out, data_ + i * stride_, 4);
    return true;
  }

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

  py::handle obj_;
  py::object owned_;
  py::buffer_info info_;
  bool buffer_ = false;
  const uint8_t* data_ = nullptr;
  size_t stride_ = 0;
  PyObject** items_ = nullptr;
  size_t size_ = 0;
};

// A new 32-byte bytes object (its contents are written later).
py::object new_digest() {
  py::object d = py::reinterpret_steal<py::object>(PyBytes_FromStringAndSize(nullptr, 32));
  if (!d) throw py::error_already_set();
  return d;
}

// The general chain (any id, any CPU): block b+1's ids are read before block b hashes.
void chain_portable(const TokenSource& source, size_t first_token, size_t num_blocks,
                    size_t block_size, const uint8_t parent[32], const std::string& extra,
                    PyObject* out) {
  Sha256Chain chain(parent, 4 * block_size, reinterpret_cast<const uint8_t*>(extra.data()),
                    extra.size());
  // Token ids go in as the host's uint32 bytes: little endian, as the format says.
  std::vector<uint32_t> cur(block_size), ahead(block_size);
  size_t begin = first_token;
  if (num_blocks) source.read(begin, begin + block_size, cur.data());
  for (size_t b = 0; b < num_blocks; ++b, begin += block_size) {
    if (b + 1 < num_blocks) source.read(begin + block_size, begin + 2 * block_size, ahead.data());
    py::object digest = new_digest();
    chain.next(reinterpret_cast<const uint8_t*>(cur.data()),
               reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(digest.ptr())));
    if (PyList_Append(out, digest.ptr()) != 0) throw py::error_already_set();
    cur.swap(ahead);
  }
}

// Holds the GIL throughout (the ids are read from their Python ints).
void append_block_hashes(py::handle token_ids, size_t first_token, size_t num_blocks,
                         size_t block_size, const uint8_t parent[32], const std::string& extra,
                         py::handle out) {
  const TokenSource source(token_ids);
  if (first_token + num_blocks * block_size > source.size()) {
    throw py::value_error("fewer token ids than the blocks to hash");
  }
  if (num_blocks == 0) return;  // nothing sized by block_size (it may be huge)
#ifdef ENGINECORE_X86
  if (sha256_uses_shani()) {
    // Ids read between the rounds (sha256_chain.h); the rest on the general chain.
    uint8_t last[32];
    const size_t done = sha256_chain_reading(
        num_blocks, block_size, parent, reinterpret_cast<const uint8_t*>(extra.data()),
        extra.size(),
        [&](size_t b, size_t i, uint32_t& id) {
          return source.small_at(first_token + b * block_size + i, id);
        },
        [&](size_t) {
          py::object digest = new_digest();
          if (PyList_Append(out.ptr(), digest.ptr()) != 0) throw py::error_already_set();
          return reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(digest.ptr()));  // the list holds it
        },
        last);
    chain_portable(source, first_token + done * block_size, num_blocks - done, block_size, last,
                   extra, out.ptr());
    return;
  }
#endif
  chain_portable(source, first_token, num_blocks, block_size, parent, extra, out.ptr());
}

// None (the root) or 32 bytes of any bytes-like object (bytes, bytearray,
// memoryview), as the twin's parent_bytes takes them.
void parent_bytes(py::handle parent, uint8_t out[32]) {
  std::memset(out, 0, 32);
  if (parent.is_none()) return;
  if (PyBytes_Check(parent.ptr())) {
    if (PyBytes_GET_SIZE(parent.ptr()) != 32) throw py::value_error("parent hash must be 32 bytes");
    std::memcpy(out, PyBytes_AS_STRING(parent.ptr()), 32);
    return;
  }
  if (!PyObject_CheckBuffer(parent.ptr())) {
    throw py::type_error("parent hash must be bytes, got " +
                         std::string(py::str(py::type::handle_of(parent).attr("__name__"))));
  }
  Py_buffer view;
  if (PyObject_GetBuffer(parent.ptr(), &view, PyBUF_FULL_RO) != 0) throw py::error_already_set();
  const bool ok = view.len == 32 && PyBuffer_ToContiguous(out, &view, 32, 'C') == 0;
  PyBuffer_Release(&view);
  if (PyErr_Occurred()) throw py::error_already_set();
  if (!ok) throw py::value_error("parent hash must be 32 bytes");
}

// Every full block of seq, and every id validated (as the Python twin does),
// even those past the last full block.
py::list hash_all(py::handle seq, size_t block_size, const uint8_t root[32],
                  const std::string& extra) {
  // `out` first: a GC-tracked allocation may run a collection, and a finalizer
  // may change `seq`; from the TokenSource on, only untracked objects (bytes)
  // are made, so no Python code runs while it reads the items in place.
  py::list out;
  const TokenSource source(seq);
  const size_t num_blocks = source.size() / block_size;
  append_block_hashes(seq, 0, num_blocks, block_size, root, extra, out);
  std::vector<uint32_t> tail(source.size() - num_blocks * block_size);
  source.read(num_blocks * block_size, source.size(), tail.data());
  return out;
}

py::list block_hashes(py::handle token_ids, size_t block_size, py::object parent,
                      py::bytes extra) {
  if (block_size == 0) throw py::value_error("block_size must be positive");
  uint8_t root[32];
  parent_bytes(parent, root);
  // A list or tuple is read in place; anything else becomes a list once.
  py::object seq = py::reinterpret_borrow<py::object>(token_ids);
  const bool in_place = PyList_Check(seq.ptr()) || PyTuple_Check(seq.ptr()) ||
                        PyObject_CheckBuffer(seq.ptr());
  if (PyBytes_Check(seq.ptr()) || PyByteArray_Check(seq.ptr())) {
    // Not ids (one per byte? raw uint32s?): refused by both paths.
    throw py::type_error("token ids must be a sequence of ints, not bytes");
  }
  if (PyUnicode_Check(seq.ptr())) throw py::type_error("token ids must be ints, not str");
  if (!in_place) seq = py::list(py::reinterpret_borrow<py::iterable>(token_ids));
  const std::string extra_keys = extra;
  try {
    return hash_all(seq, block_size, root, extra_keys);
  } catch (const NotAnInt&) {
    // An id that is not an int (numpy scalars, __index__ objects; a numpy
    // int64 array reads as those): converted once, as the twin reads them.
    const TokenSource source(seq);  // a list of a buffer's items, or seq itself
    return hash_all(ids_through_index(source.items()), block_size, root, extra_keys);
  }
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
