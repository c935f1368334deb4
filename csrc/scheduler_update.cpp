// The per-request loop of Scheduler.update_from_output for plain decodes (one
// sampled token, no grammar, no logprobs, no drafts), the twin of the inline
// fast path in python/enginecore/sched/scheduler.py. Requests that are not
// plain go to the Python method the twin uses too (update_request); finished
// ones to emit_finished. State stays in the Python Request objects.
#include <pybind11/pybind11.h>


namespace py = pybind11;

namespace enginecore {
namespace {

// Owned reference, released on scope exit.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {
    if (p == nullptr) throw py::error_already_set();
  }
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;  // immortal for the module's life
}

struct Names {
  PyObject *status, *grammar, *output_token_ids, *all_token_ids, *block_size, *block_hashes,
      *extend_block_hashes, *max_tokens, *min_tokens, *eos_token_id, *ignore_eos,
      *stop_token_ids, *stop_reason, *client_index, *request_ids, *new_token_ids;
  Names()
      : status(intern("status")), grammar(intern("grammar")),
        output_token_ids(intern("output_token_ids")), all_token_ids(intern("all_token_ids")),
        block_size(intern("block_size")), block_hashes(intern("block_hashes")),
        extend_block_hashes(intern("_extend_block_hashes")), max_tokens(intern("max_tokens")),
        min_tokens(intern("min_tokens")), eos_token_id(intern("eos_token_id")),
        ignore_eos(intern("ignore_eos")), stop_token_ids(intern("stop_token_ids")),
        stop_reason(intern("stop_reason")), client_index(intern("client_index")),
        request_ids(intern("request_ids")), new_token_ids(intern("new_token_ids")) {}
};

const Names& names() {
  static const Names n;
  return n;
}

long long attr_int(PyObject* o, PyObject* name) {
  Ref v(PyObject_GetAttr(o, name));
  const long long x = PyLong_AsLongLong(v.p);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  return x;
}

Py_ssize_t attr_len(PyObject* o, PyObject* name) {
  Ref v(PyObject_GetAttr(o, name));
  const Py_ssize_t n = PyObject_Length(v.p);
  if (n < 0) throw py::error_already_set();
  return n;
}

void set_attr(PyObject* o, PyObject* name, PyObject* value) {
  if (PyObject_SetAttr(o, name, value) != 0) throw py::error_already_set();
}

void append(PyObject* list, PyObject* item) {
  if (PyList_Append(list, item) != 0) throw py::error_already_set();
}

// Scheduler._check_stop for a request whose last output token is ``tok``.
bool check_stop(PyObject* req, PyObject* tok, Py_ssize_t n_out, Py_ssize_t n_all,
                long long max_model_len, PyObject* length, PyObject* stopped) {
  const Names& nm = names();
  if (n_all >= max_model_len || n_out >= attr_int(req, nm.max_tokens)) {
    set_attr(req, nm.status, length);
    return true;
  }
  if (n_out < attr_int(req, nm.min_tokens)) return false;
  Ref eos(PyObject_GetAttr(req, nm.eos_token_id));
  int is_eos = PyObject_RichCompareBool(tok, eos.p, Py_EQ);
  if (is_eos < 0) throw py::error_already_set();
  if (is_eos) {
    Ref ignore(PyObject_GetAttr(req, nm.ignore_eos));
    const int ig = PyObject_IsTrue(ignore.p);
    if (ig < 0) throw py::error_already_set();
    if (!ig) {
      set_attr(req, nm.status, stopped);
      return true;
    }
  }
  Ref stop_ids(PyObject_GetAttr(req, nm.stop_token_ids));
  const int hit = PySequence_Contains(stop_ids.p, tok);
  if (hit < 0) throw py::error_already_set();
  if (hit) {
    set_attr(req, nm.status, stopped);
    set_attr(req, nm.stop_reason, tok);
    return true;
  }
  return false;
}

void update_decodes(py::dict requests, py::dict scheduled, py::list sampled, py::dict index_of,
                    py::object in_flight, long long max_model_len, py::tuple statuses,
                    py::dict outputs, py::object cols, py::list stopped_list, py::tuple types,
                    py::object emit_finished, py::object update_request) {
  const Names& nm = names();
  PyObject* running = statuses[0].ptr();
  PyObject* length = statuses[1].ptr();
  PyObject* stopped = statuses[2].ptr();
  PyObject* output_type = types[0].ptr();
  PyObject* columnar_type = types[1].ptr();
  const bool columnar = !cols.is_none();
  PyObject* in_flight_set = in_flight.is_none() ? nullptr : in_flight.ptr();
  // The current client's columns (columnar).
  struct Holder {
    PyObject* p = nullptr;
    ~Holder() { Py_XDECREF(p); }
  } last;
  PyObject* col_ids = nullptr;  // borrowed from the ColumnarOutputs, kept alive by cols
  PyObject* col_toks = nullptr;

  PyObject *rid, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(scheduled.ptr(), &pos, &rid, &value)) {
    if (in_flight_set != nullptr && PySet_Discard(in_flight_set, rid) < 0) {
      throw py::error_already_set();
    }
    PyObject* req = PyDict_GetItemWithError(requests.ptr(), rid);  // borrowed
    if (req == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;
    }
    Py_INCREF(req);
    Ref req_ref(req);
    {
      Ref status(PyObject_GetAttr(req, nm.status));
      const int ne = PyObject_RichCompareBool(status.p, running, Py_NE);
      if (ne < 0) throw py::error_already_set();
      if (ne) continue;  // aborted or preempted while its batch ran
    }
    PyObject* idx = PyDict_GetItemWithError(index_of.ptr(), rid);
    if (idx == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;  // nothing sampled
    }
    const Py_ssize_t i = PyLong_AsSsize_t(idx);
    if (i == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (i < 0 || i >= PyList_GET_SIZE(sampled.ptr())) throw py::index_error("sampled index");
    PyObject* toks = PyList_GET_ITEM(sampled.ptr(), i);  // borrowed
    if (!PyList_Check(toks)) throw py::type_error("sampled token ids must be lists");
    const Py_ssize_t n_new = PyList_GET_SIZE(toks);
    if (n_new == 0) continue;  // a prefill chunk: nothing sampled
    Ref grammar(PyObject_GetAttr(req, nm.grammar));
    if (n_new != 1 || grammar.p != Py_None) {
      Ref r(PyObject_CallFunctionObjArgs(update_request.ptr(), req, rid, toks, Py_None,
                                         outputs.ptr(), columnar ? cols.ptr() : Py_None,
                                         stopped_list.ptr(), nullptr));
      continue;
    }
    PyObject* tok = PyList_GET_ITEM(toks, 0);
    // Request.append_output_token_ids
    Ref out_ids(PyObject_GetAttr(req, nm.output_token_ids));
    Ref all_ids(PyObject_GetAttr(req, nm.all_token_ids));
    append(out_ids.p, tok);
    append(all_ids.p, tok);
    const Py_ssize_t n_out = PyList_GET_SIZE(out_ids.p);
    const Py_ssize_t n_all = PyList_GET_SIZE(all_ids.p);
    const long long bs = attr_int(req, nm.block_size);
    if (bs > 0 && n_all >= (attr_len(req, nm.block_hashes) + 1) * bs) {
      Ref r(PyObject_CallMethodObjArgs(req, nm.extend_block_hashes, nullptr));
    }
    if (check_stop(req, tok, n_out, n_all, max_model_len, length, stopped)) {
      append(stopped_list.ptr(), req);
      Ref r(PyObject_CallFunctionObjArgs(emit_finished.ptr(), req, rid, toks, outputs.ptr(),
                                         columnar ? cols.ptr() : Py_None, nullptr));
      continue;
    }
    Ref client(PyObject_GetAttr(req, nm.client_index));
    if (columnar) {
      int same = 0;
      if (last.p != nullptr) {
        same = PyObject_RichCompareBool(client.p, last.p, Py_EQ);
        if (same < 0) throw py::error_already_set();
      }
      if (!same) {
        PyObject* col = PyDict_GetItemWithError(cols.ptr(), client.p);  // borrowed
        if (col == nullptr) {
          if (PyErr_Occurred()) throw py::error_already_set();
          Ref fresh(PyObject_CallNoArgs(columnar_type));
          if (PyDict_SetItem(cols.ptr(), client.p, fresh.p) != 0) throw py::error_already_set();
          col = fresh.p;  // cols holds it now
        }
        Ref ids(PyObject_GetAttr(col, nm.request_ids));
        Ref tks(PyObject_GetAttr(col, nm.new_token_ids));
        col_ids = ids.p;  // the column lists live as long as their ColumnarOutputs
        col_toks = tks.p;
        Py_XDECREF(last.p);
        last.p = client.p;
        Py_INCREF(last.p);
      }
      append(col_ids, rid);
      append(col_toks, toks);
      continue;
    }
    // EngineCoreOutput(rid, toks, None), then Scheduler._emit.
    PyObject* args[3] = {rid, toks, Py_None};
    Ref out(PyObject_Vectorcall(output_type, args, 3, nullptr));
    PyObject* lst = PyDict_GetItemWithError(outputs.ptr(), client.p);
    if (lst == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      Ref fresh(PyList_New(1));
      Py_INCREF(out.p);
      PyList_SET_ITEM(fresh.p, 0, out.p);
      if (PyDict_SetItem(outputs.ptr(), client.p, fresh.p) != 0) throw py::error_already_set();
    } else {
      append(lst, out.p);
    }
  }
}

}  // namespace

void bind_scheduler_update(py::module_& m) {
  m.def("update_decodes", &update_decodes,
        "The plain-decode loop of Scheduler.update_from_output (see scheduler.py).");
}

}  // namespace enginecore
