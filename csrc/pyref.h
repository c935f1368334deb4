// Small C-API helpers shared by the native loops: owned references and ints
// that turn a Python error into a C++ exception pybind11 hands back.
#pragma once
#include <pybind11/pybind11.h>

namespace enginecore {

// Owned reference, released on scope exit; a null result (a Python error) throws.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {
    if (p == nullptr) throw pybind11::error_already_set();
  }
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  // Hands the reference over (to a list slot, a return value).
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
};

// An int as long long (OverflowError/TypeError thrown as they are).
inline long long as_long(PyObject* o) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
  return v;
}

// An int that fits one machine word in CPython's own layout (|v| < 2**30 on
// 3.11, compact on 3.12+), read without a call; false for anything else
// (bigger ints, subclasses' __index__, non-ints): the caller takes the general
// path. A call per token id was most of the cost of reading long prompts.
inline bool compact_long(PyObject* o, long long& out) {
  if (!PyLong_Check(o)) return false;
#if PY_VERSION_HEX >= 0x030C0000
  PyLongObject* v = reinterpret_cast<PyLongObject*>(o);
  if (!PyUnstable_Long_IsCompact(v)) return false;
  out = PyUnstable_Long_CompactValue(v);
  return true;
#else
  const Py_ssize_t size = Py_SIZE(o);
  if (size < -1 || size > 1) return false;
  out = size * static_cast<long long>(reinterpret_cast<PyLongObject*>(o)->ob_digit[0]);
  return true;
#endif
}

// An empty dict with room for `n` items without a resize (a dict grown item by
// item to a step's 256 requests resized ~6 times: ~2 % of an engine step).
inline pybind11::dict presized_dict(Py_ssize_t n) {
#if PY_VERSION_HEX < 0x030D0000
  PyObject* d = _PyDict_NewPresized(n);
#else
  (void)n;  // private since 3.13: plain growth there
  PyObject* d = PyDict_New();
#endif
  if (d == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::dict>(d);
}

}  // namespace enginecore
