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

}  // namespace enginecore
