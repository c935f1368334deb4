// The synthetic executor's per-request loop, native twin of
// SyntheticExecutor._sample in python/enginecore/executor/synthetic.py. The
// executor is the engine's measuring instrument: with its loop in Python it was
// half of a native engine step at 256 decodes, hiding what the engine costs.
//
// Tokens are splitmix64(seed, position) reduced to the vocabulary; a request in
// the middle of a prefill chunk samples nothing; drafts are accepted while they
// equal the tokens the instrument would have sampled.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>

#include "pyref.h"

namespace py = pybind11;

namespace enginecore {
namespace {

constexpr Py_ssize_t kStateBytes = 16;  // synthetic.py's _STATE: "=Qq"

void check_state(PyObject* st) {
  if (!PyByteArray_CheckExact(st) || PyByteArray_GET_SIZE(st) != kStateBytes) {
    throw py::type_error("synthetic state entries are 16-byte bytearrays (seed, known)");
  }
}

uint64_t splitmix64(uint64_t seed, uint64_t position) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ULL + position + 0x632BE59BD9B4E019ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Returns (req_ids, req_id_to_index, sampled) as ModelRunnerOutput takes them.
// state: req_id -> a 16-byte bytearray (seed uint64, tokens the runner knows
// int64, native byte order), read and updated in place: a Python int per
// request per step to allocate and free was ~6 % of the step at 256 decodes;
// cached_ids / cached_computed: CachedRequestData's parallel lists, which come
// first in `scheduled` in the same order; new_computed: the new requests'.
py::tuple synthetic_sample(py::dict scheduled, py::dict spec, py::dict state,
                           py::list cached_ids, py::list cached_computed, py::dict new_computed,
                           long long vocab_size) {
  if (vocab_size <= 0) throw py::value_error("vocab_size must be positive");
  const auto vocab = static_cast<uint64_t>(vocab_size);
  const Py_ssize_t n = PyDict_GET_SIZE(scheduled.ptr());
  const Py_ssize_t num_cached = PyList_GET_SIZE(cached_ids.ptr());
  py::list req_ids(n), sampled(n);
  py::dict index_of = presized_dict(n);
  const bool any_spec = PyDict_GET_SIZE(spec.ptr()) > 0;
  Py_ssize_t pos = 0, i = 0;
  PyObject *rid, *num;
  while (PyDict_Next(scheduled.ptr(), &pos, &rid, &num)) {
    Py_INCREF(rid);
    PyList_SET_ITEM(req_ids.ptr(), i, rid);
    Ref idx(PyLong_FromSsize_t(i));
    if (PyDict_SetItem(index_of.ptr(), rid, idx.p) != 0) throw py::error_already_set();
    PyObject* st_borrowed = PyDict_GetItemWithError(state.ptr(), rid);
    if (st_borrowed == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, rid);
      throw py::error_already_set();
    }
    // Held: Python code runs below (a draft's __index__, a sequence's items) and
    // could drop it from `state` or resize it.
    Py_INCREF(st_borrowed);
    Ref st(st_borrowed);
    check_state(st.p);
    uint64_t seed;
    long long known;
    std::memcpy(&seed, PyByteArray_AS_STRING(st.p), 8);
    std::memcpy(&known, PyByteArray_AS_STRING(st.p) + 8, 8);
    PyObject* drafts = any_spec ? PyDict_GetItemWithError(spec.ptr(), rid) : nullptr;
    if (drafts == nullptr && PyErr_Occurred()) throw py::error_already_set();
    const Py_ssize_t num_drafts = drafts ? PyObject_Length(drafts) : 0;
    if (num_drafts < 0) throw py::error_already_set();
    PyObject* computed_obj;
    if (i < num_cached && PyList_GET_ITEM(cached_ids.ptr(), i) == rid) {
      computed_obj = PyList_GET_ITEM(cached_computed.ptr(), i);
    } else {
      computed_obj = PyDict_GetItemWithError(new_computed.ptr(), rid);
      if (computed_obj == nullptr) {
        // Not in schedule order after all: look among the cached ones.
        if (PyErr_Occurred()) throw py::error_already_set();
        for (Py_ssize_t k = 0; k < num_cached && computed_obj == nullptr; ++k) {
          const int eq = PyObject_RichCompareBool(PyList_GET_ITEM(cached_ids.ptr(), k), rid,
                                                  Py_EQ);
          if (eq < 0) throw py::error_already_set();
          if (eq) computed_obj = PyList_GET_ITEM(cached_computed.ptr(), k);
        }
        if (computed_obj == nullptr) {
          PyErr_SetObject(PyExc_KeyError, rid);
          throw py::error_already_set();
        }
      }
    }
    // In 128 bits: counts near int64's end compare as the twin's Python ints do.
    if (static_cast<__int128>(as_long(computed_obj)) + as_long(num) - num_drafts < known) {
      PyList_SET_ITEM(sampled.ptr(), i, Ref(PyList_New(0)).release());  // mid-prefill chunk
      ++i;
      continue;
    }
    uint64_t p = static_cast<uint64_t>(known);
    uint64_t tok = splitmix64(seed, p) % vocab;
    Ref tokens(PyList_New(1));
    PyList_SET_ITEM(tokens.p, 0, Ref(PyLong_FromUnsignedLongLong(tok)).release());
    for (Py_ssize_t d = 0; d < num_drafts; ++d) {
      Ref draft(PySequence_GetItem(drafts, d));
      int overflow = 0;
      const long long dv = PyLong_AsLongLongAndOverflow(draft.p, &overflow);
      if (dv == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (overflow || dv < 0 || static_cast<uint64_t>(dv) != tok) break;
      tok = splitmix64(seed, ++p) % vocab;
      Ref t(PyLong_FromUnsignedLongLong(tok));
      if (PyList_Append(tokens.p, t.p) != 0) throw py::error_already_set();
    }
    const Py_ssize_t produced = PyList_GET_SIZE(tokens.p);
    long long known_after;
    if (__builtin_add_overflow(known, static_cast<long long>(produced), &known_after)) {
      throw py::value_error("synthetic state: tokens known past int64");
    }
    check_state(st.p);  // again: the drafts' Python code may have changed it
    std::memcpy(PyByteArray_AS_STRING(st.p) + 8, &known_after, 8);
    PyList_SET_ITEM(sampled.ptr(), i, tokens.release());
    ++i;
  }
  if (i != n) throw py::value_error("scheduled changed size during sampling");
  return py::make_tuple(req_ids, index_of, sampled);
}

}  // namespace

void bind_synthetic_sampler(py::module_& m) {
  m.def("synthetic_sample", &synthetic_sample, py::arg("scheduled"), py::arg("spec"),
        py::arg("state"), py::arg("cached_ids"), py::arg("cached_computed"),
        py::arg("new_computed"), py::arg("vocab_size"),
        "The synthetic executor's per-request loop: (req_ids, req_id_to_index, sampled).");
}

}  // namespace enginecore
