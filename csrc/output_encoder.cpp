// msgpack of one step's outputs for one client, written straight from columns
// (request ids, new token lists) into a reused bytearray. The bytes equal
// msgspec's encoding of the EngineCoreOutputs the Python twin builds
// (python/enginecore/sched/columnar_outputs.py, python/enginecore/serial.py):
//
//   EngineCoreOutputs = [engine_index, [output...], scheduler_stats, timestamp,
//                        utility_output, finished_requests, wave_complete, start_wave]
//   plain output      = [request_id, [token...], nil, nil, nil, 0, nil]
//
// Outputs that are not plain (finished, with logprobs, pooled, owed) arrive
// pre-encoded by msgspec and are copied in place; so does scheduler_stats.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <string>

#include "output_encoder.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// Appends to a std::string through a raw cursor: callers reserve() an upper
// bound first, so each byte is a store, not a capacity check.
class Writer {
 public:
  explicit Writer(std::string& out) : out_(out) { out_.clear(); }

  void reserve(size_t more) {
    const size_t used = size();
    if (out_.size() < used + more) out_.resize(std::max(used + more, 2 * out_.size()));
    p_ = &out_[0] + used;
  }

  size_t size() const { return p_ == nullptr ? 0 : static_cast<size_t>(p_ - out_.data()); }

  void byte(uint8_t b) { *p_++ = static_cast<char>(b); }

  void be(uint64_t v, int n) {
    for (int i = n - 1; i >= 0; --i) *p_++ = static_cast<char>(v >> (8 * i));
  }

  void nil() { byte(0xc0); }

  // msgspec: the smallest form; non-negative values as unsigned. At most 9 bytes.
  void integer(long long v) {
    if (v >= 0) {
      const auto u = static_cast<uint64_t>(v);
      if (u <= 0x7f) {
        byte(static_cast<uint8_t>(u));
      } else if (u <= 0xff) {
        byte(0xcc), be(u, 1);
      } else if (u <= 0xffff) {
        byte(0xcd), be(u, 2);
      } else if (u <= 0xffffffffULL) {
        byte(0xce), be(u, 4);
      } else {
        byte(0xcf), be(u, 8);
      }
    } else if (v >= -32) {
      byte(static_cast<uint8_t>(v));
    } else if (v >= -128) {
      byte(0xd0), be(static_cast<uint64_t>(v), 1);
    } else if (v >= -32768) {
      byte(0xd1), be(static_cast<uint64_t>(v), 2);
    } else if (v >= -2147483648LL) {
      byte(0xd2), be(static_cast<uint64_t>(v), 4);
    } else {
      byte(0xd3), be(static_cast<uint64_t>(v), 8);
    }
  }

  // At most 5 bytes.
  void array_header(size_t n) {
    if (n <= 15) {
      byte(static_cast<uint8_t>(0x90 | n));
    } else if (n <= 0xffff) {
      byte(0xdc), be(n, 2);
    } else {
      byte(0xdd), be(n, 4);
    }
  }

  // At most 5 + n bytes.
  void str(const char* s, size_t n) {
    if (n <= 31) {
      byte(static_cast<uint8_t>(0xa0 | n));
    } else if (n <= 0xff) {
      byte(0xd9), be(n, 1);
    } else if (n <= 0xffff) {
      byte(0xda), be(n, 2);
    } else {
      byte(0xdb), be(n, 4);
    }
    std::memcpy(p_, s, n);
    p_ += n;
  }

  void float64(double d) {
    uint64_t bits;
    std::memcpy(&bits, &d, sizeof bits);
    byte(0xcb), be(bits, 8);
  }

  void raw(const char* s, size_t n) {
    reserve(n);
    std::memcpy(p_, s, n);
    p_ += n;
  }

 private:
  std::string& out_;
  char* p_ = nullptr;
};

long long as_int(PyObject* o, const char* what) {
  if (!PyLong_Check(o)) throw py::type_error(std::string(what) + " must be an int");
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow) throw py::value_error(std::string(what) + " does not fit in 64 bits");
  return v;
}

}  // namespace

void write_columnar(std::string& out, long long engine_index, py::list request_ids,
                    py::list new_token_ids, py::list specials, py::object stats_raw,
                    double timestamp) {
  const Py_ssize_t n = PyList_GET_SIZE(request_ids.ptr());
  if (PyList_GET_SIZE(new_token_ids.ptr()) != n) {
    throw py::value_error("request_ids and new_token_ids differ in length");
  }
  Writer w(out);
  w.reserve(64);
  w.byte(0x98);
  w.integer(engine_index);
  w.array_header(static_cast<size_t>(n));
  Py_ssize_t next_special = 0;
  const Py_ssize_t num_specials = PyList_GET_SIZE(specials.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* rid = PyList_GET_ITEM(request_ids.ptr(), i);
    if (rid == Py_None) {
      if (next_special >= num_specials) throw py::value_error("too few special outputs");
      PyObject* raw = PyList_GET_ITEM(specials.ptr(), next_special++);
      if (!PyBytes_Check(raw)) throw py::type_error("special outputs must be bytes");
      w.raw(PyBytes_AS_STRING(raw), static_cast<size_t>(PyBytes_GET_SIZE(raw)));
      continue;
    }
    if (!PyUnicode_Check(rid)) throw py::type_error("request ids must be str");
    Py_ssize_t len = 0;
    const char* s = PyUnicode_AsUTF8AndSize(rid, &len);
    if (s == nullptr) throw py::error_already_set();
    PyObject* toks = PyList_GET_ITEM(new_token_ids.ptr(), i);
    if (!PyList_Check(toks)) throw py::type_error("new token ids must be lists");
    const Py_ssize_t m = PyList_GET_SIZE(toks);
    w.reserve(1 + 5 + static_cast<size_t>(len) + 5 + 9 * static_cast<size_t>(m) + 7);
    w.byte(0x9a);  // EngineCoreOutput's 10 fields
    w.str(s, static_cast<size_t>(len));
    w.array_header(static_cast<size_t>(m));
    for (Py_ssize_t j = 0; j < m; ++j) w.integer(as_int(PyList_GET_ITEM(toks, j), "token id"));
    // new_logprobs, finish_reason, stop_reason, num_cached_tokens = 0, pooling_output, events,
    // new_prompt_logprobs, kv_transfer_params
    w.nil(), w.nil(), w.nil(), w.byte(0x00), w.nil(), w.nil(), w.nil(), w.nil();
  }
  if (next_special != num_specials) throw py::value_error("too many special outputs");
  w.reserve(1);
  if (stats_raw.is_none()) {
    w.nil();
  } else {
    if (!PyBytes_Check(stats_raw.ptr())) throw py::type_error("stats_raw must be bytes");
    w.raw(PyBytes_AS_STRING(stats_raw.ptr()), static_cast<size_t>(PyBytes_GET_SIZE(stats_raw.ptr())));
  }
  w.reserve(13);
  w.float64(timestamp);
  w.nil(), w.nil(), w.nil(), w.nil();  // utility_output .. start_wave
  out.resize(w.size());
}

namespace {

// Encode into ``buf`` (resized; BufferError while a zmq frame still holds it).
void encode_columnar(long long engine_index, py::list request_ids, py::list new_token_ids,
                     py::list specials, py::object stats_raw, double timestamp,
                     py::bytearray buf) {
  thread_local std::string out;
  write_columnar(out, engine_index, request_ids, new_token_ids, specials, stats_raw, timestamp);
  if (PyByteArray_Resize(buf.ptr(), static_cast<Py_ssize_t>(out.size())) != 0) {
    throw py::error_already_set();
  }
  std::memcpy(PyByteArray_AS_STRING(buf.ptr()), out.data(), out.size());
}

}  // namespace

void bind_output_encoder(py::module_& m) {
  m.def("encode_columnar", &encode_columnar, py::arg("engine_index"), py::arg("request_ids"),
        py::arg("new_token_ids"), py::arg("specials"), py::arg("stats_raw"),
        py::arg("timestamp"), py::arg("buf"),
        "msgpack of one client's step outputs from columns into buf (bytes equal "
        "msgspec's encoding of the equivalent EngineCoreOutputs).");
}

}  // namespace enginecore
