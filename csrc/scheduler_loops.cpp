// The scheduler's per-request loops as whole functions over the request table
// and the block pool; twins of python/enginecore/sched/scheduler_loops.py
// (schedule_running_py, update_decodes_py): same signatures, same results.
//
// The only attribute read from a Python object is Request.slot; everything else
// is in the table's rows. Python objects are touched only to read the inputs
// (request ids, sampled token lists) and to build the results the runner and
// the clients get.
#include <pybind11/pybind11.h>
#include <structmember.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "pyref.h"
#include "request_table.h"

namespace py = pybind11;

namespace enginecore {
namespace {

// A slot or list index as Python's list indexing takes it: through __index__
// (TypeError otherwise), IndexError past Py_ssize_t (the twins index lists).
Py_ssize_t as_index(PyObject* o) {
  const Py_ssize_t v = PyNumber_AsSsize_t(o, PyExc_IndexError);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Where Request.slot lives in a request of one type: the offset of its
// __slots__ member, valid while the type's version tag is (any change to the
// type, say a property put in the member's place, gives it a new tag).
struct SlotMember {
  PyTypeObject* type = nullptr;  // strong reference once set
  unsigned int tag = 0;
  Py_ssize_t offset = 0;
};

// Remembers `slot`'s member for `tp` when reading it straight from the instance
// is what attribute access does: generic getattr, and the name resolves on the
// type to a __slots__ object member (a data descriptor: nothing shadows it).
void remember_slot_member(PyTypeObject* tp, PyObject* name, SlotMember& m) {
  if (tp->tp_getattro != PyObject_GenericGetAttr) return;
  PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(tp), name);  // the descriptor
  if (d == nullptr) {
    PyErr_Clear();
    return;
  }
  const bool member = Py_TYPE(d) == &PyMemberDescr_Type &&
                      reinterpret_cast<PyMemberDescrObject*>(d)->d_member->type == T_OBJECT_EX;
  const Py_ssize_t offset = member ? reinterpret_cast<PyMemberDescrObject*>(d)->d_member->offset : 0;
  Py_DECREF(d);
  if (!member || !(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)) return;
  Py_INCREF(tp);
  Py_XDECREF(m.type);
  m.type = tp;
  m.tag = tp->tp_version_tag;
  m.offset = offset;
}

// Request.slot as `request.slot` reads it. Requests of the remembered type are
// read in place (the call was ~4 % of a step at 256 decodes); anything else,
// or a slot that is not a small int, takes the attribute call.
SlotMember& slot_member() {
  static SlotMember member;
  return member;
}

int64_t slot_of_request(PyObject* request) {
  static PyObject* name = PyUnicode_InternFromString("slot");  // immortal for the module
  SlotMember& member = slot_member();
  PyTypeObject* tp = Py_TYPE(request);
  if (tp == member.type && (tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) &&
      tp->tp_version_tag == member.tag) {
    PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(request) + member.offset);
    long long slot;
    if (v != nullptr && PyLong_CheckExact(v) && compact_long(v, slot)) return slot;
  }
  Ref v(PyObject_GetAttr(request, name));
  if (tp != member.type || tp->tp_version_tag != member.tag) remember_slot_member(tp, name, member);
  return as_index(v.p);
}

// Request.slot when slot_of_request can read it in place, else -1: never
// calls out or raises (for hints, which must not change what a loop does).
int64_t peek_slot(PyObject* request) {
  const SlotMember& member = slot_member();
  PyTypeObject* tp = Py_TYPE(request);
  if (tp != member.type || !(tp->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) ||
      tp->tp_version_tag != member.tag) {
    return -1;
  }
  PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(request) + member.offset);
  long long slot;
  return v != nullptr && PyLong_CheckExact(v) && compact_long(v, slot) ? slot : -1;
}

PyObject* new_int(long long v) {
  PyObject* o = PyLong_FromLongLong(v);
  if (o == nullptr) throw py::error_already_set();
  return o;
}

void append(PyObject* list, PyObject* item) {
  if (PyList_Append(list, item) != 0) throw py::error_already_set();
}

// Whether `set` (a set, or None) contains `key`.
bool contains(PyObject* set, PyObject* key) {
  if (set == Py_None) return false;
  const int hit = PySet_Contains(set, key);
  if (hit < 0) throw py::error_already_set();
  return hit != 0;
}

// `key in container` for any container (TypeError for None or a non-container).
bool sequence_contains(PyObject* container, PyObject* key) {
  const int hit = PySequence_Contains(container, key);
  if (hit < 0) throw py::error_already_set();
  return hit != 0;
}

// in_flight is a set (update_decodes discards from it) or None; anything else
// would reach PySet_* as a bad internal call (SystemError).
void check_in_flight(PyObject* in_flight, bool mutable_set) {
  if (in_flight == Py_None) return;
  if (mutable_set ? PySet_Check(in_flight) : PyAnySet_Check(in_flight)) return;
  throw py::type_error(std::string("in_flight must be a ") + (mutable_set ? "set" : "set or frozenset") +
                       " or None, got " + Py_TYPE(in_flight)->tp_name);
}

py::list int_list(const std::vector<int32_t>& v) {
  py::list out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), new_int(v[i]));
  }
  return out;
}

// schedule_running's victim: the last running request not in flight (FCFS:
// read from the end, the first that may go), or the first with the greatest
// (priority, arrival time) (priority); -1: none.
Py_ssize_t pick_victim(RequestTable& t, PyObject* running, PyObject* in_flight, bool priority) {
  const Py_ssize_t n = PyList_GET_SIZE(running);
  if (!priority) {
    for (Py_ssize_t j = n - 1; j >= 0; --j) {
      const Row& r = t.row(slot_of_request(PyList_GET_ITEM(running, j)));
      if (!contains(in_flight, r.request_id.ptr())) return j;
    }
    return -1;
  }
  Py_ssize_t best = -1;
  int64_t best_prio = 0;
  double best_arrival = 0.0;
  for (Py_ssize_t j = 0; j < n; ++j) {
    Row& r = t.row(slot_of_request(PyList_GET_ITEM(running, j)));
    if (contains(in_flight, r.request_id.ptr())) continue;
    if (best < 0 || r.priority > best_prio ||
        (r.priority == best_prio && r.arrival_time > best_arrival)) {
      best = j;
      best_prio = r.priority;
      best_arrival = r.arrival_time;
    }
  }
  return best;
}

// How many requests ahead schedule_running asks for the prefix-cache slot a
// request's next full block will take: the index is megabytes, and at a block
// boundary every decoding request caches one (each insert a cache miss).
constexpr Py_ssize_t kPrefetchAhead = 8;

// A hint only: reads nothing it cannot read safely, raises nothing.
void prefetch_next_block(RequestTable& t, PyObject* running, Py_ssize_t j) {
  if (j >= PyList_GET_SIZE(running)) return;
  const int64_t s = peek_slot(PyList_GET_ITEM(running, j));
  if (s < 0 || static_cast<size_t>(s) >= t.capacity()) return;
  const Row* r = t.maybe_row(static_cast<size_t>(s));
  if (r == nullptr || r->num_cached_blocks < 0) return;
  const size_t next = static_cast<size_t>(r->num_cached_blocks);
  if (next < r->hashes.size()) t.pool().prefetch(r->hashes[next]);
}

py::tuple schedule_running(RequestTable& t, py::list running_list, py::object skip_obj,
                           py::object in_flight_obj, int64_t token_budget, int64_t threshold,
                           int64_t max_len_1, int64_t max_model_len, bool priority) {
  PyObject* running = running_list.ptr();
  PyObject* skip = skip_obj.ptr();
  PyObject* in_flight = in_flight_obj.ptr();
  check_in_flight(in_flight, false);
  const bool skip_is_set = PyAnySet_Check(skip);
  // Nothing to pass over (the common step): no lookup per request.
  const bool skip_none = skip_is_set && PySet_GET_SIZE(skip) == 0;
  const int64_t bs = t.block_size();
  const bool caching = t.caching();
  py::list scheduled, new_block_ids, preempted;
  py::dict num_scheduled = presized_dict(PyList_GET_SIZE(running)), spec_tokens;
  std::vector<int64_t> scheduled_slots, scheduled_tokens;  // beside `scheduled`
  std::vector<int32_t> fresh;
  Py_ssize_t i = 0;
  while (i < PyList_GET_SIZE(running) && token_budget > 0) {
    if (caching) prefetch_next_block(t, running, i + kPrefetchAhead);
    PyObject* request = PyList_GET_ITEM(running, i);
    const int64_t s = slot_of_request(request);
    Row& r = t.row(s);
    PyObject* rid = r.request_id.ptr();
    if (!skip_none &&
        (skip_is_set ? contains(skip, rid) : sequence_contains(skip, rid))) {
      ++i;
      continue;
    }
    const int64_t computed = r.num_computed;
    const int64_t n_tok = static_cast<int64_t>(r.tokens.size());
    int64_t num_new = n_tok + static_cast<int64_t>(r.spec.size()) - computed;
    if (threshold && num_new > threshold) num_new = threshold;
    if (num_new > token_budget) num_new = token_budget;
    if (num_new > max_len_1 - computed) num_new = max_len_1 - computed;
    if (num_new <= 0) {
      ++i;
      continue;
    }
    const int64_t end = computed + num_new;
    fresh.clear();
    bool allocated = true;
    if (!r.blocks.empty() && end <= static_cast<int64_t>(r.blocks.size()) * bs) {
      // The common decode: the tokens fit the blocks the request has.
      if (caching && !r.hashes.empty() && std::min(end, n_tok) / bs > r.num_cached_blocks) {
        t.cache_full(r, end);
      }
    } else {
      py::object req_ref = py::reinterpret_borrow<py::object>(request);  // survives pops
      while (true) {
        allocated = t.allocate(r, num_new, 0, {}, 0, max_model_len, fresh);
        if (allocated) break;
        const Py_ssize_t v = pick_victim(t, running, in_flight, priority);
        if (v < 0) break;
        PyObject* victim = PyList_GET_ITEM(running, v);
        Py_INCREF(victim);
        Ref victim_ref(victim);
        if (PySequence_DelItem(running, v) != 0) throw py::error_already_set();
        const int64_t vs = slot_of_request(victim);
        Row& vr = t.row(vs);
        if (v < i) --i;
        const int was_scheduled = PyDict_Contains(num_scheduled.ptr(), vr.request_id.ptr());
        if (was_scheduled < 0) throw py::error_already_set();
        if (was_scheduled) {
          // Already scheduled this step (so before `i`): give its budget back.
          const Py_ssize_t undo = PySequence_Index(scheduled.ptr(), victim);
          if (undo < 0) throw py::error_already_set();
          if (PySequence_DelItem(scheduled.ptr(), undo) != 0 ||
              PySequence_DelItem(new_block_ids.ptr(), undo) != 0) {
            throw py::error_already_set();
          }
          scheduled_slots.erase(scheduled_slots.begin() + undo);
          scheduled_tokens.erase(scheduled_tokens.begin() + undo);
          PyObject* n = PyDict_GetItemWithError(num_scheduled.ptr(), vr.request_id.ptr());
          if (n == nullptr) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, vr.request_id.ptr());
            throw py::error_already_set();
          }
          token_budget += as_long(n);
          if (PyDict_DelItem(num_scheduled.ptr(), vr.request_id.ptr()) != 0) {
            throw py::error_already_set();
          }
          if (PyDict_Contains(spec_tokens.ptr(), vr.request_id.ptr()) == 1 &&
              PyDict_DelItem(spec_tokens.ptr(), vr.request_id.ptr()) != 0) {
            throw py::error_already_set();
          }
        }
        // The row's part of a preemption; the scheduler does the rest.
        t.free_blocks(vr);
        vr.status = kPreempted;
        vr.num_computed = 0;
        vr.spec.clear();
        append(preempted.ptr(), victim);
        if (victim == request) break;
      }
      if (!allocated) break;
    }
    append(scheduled.ptr(), request);
    scheduled_slots.push_back(s);
    scheduled_tokens.push_back(num_new);
    if (fresh.empty()) {
      append(new_block_ids.ptr(), Py_None);
    } else {
      append(new_block_ids.ptr(), int_list(fresh).ptr());
    }
    {
      Ref n(new_int(num_new));
      if (PyDict_SetItem(num_scheduled.ptr(), rid, n.p) != 0) throw py::error_already_set();
    }
    token_budget -= num_new;
    if (!r.spec.empty()) {
      const int64_t n_spec = end - n_tok;
      if (n_spec > 0) {
        py::list drafts(n_spec);
        for (int64_t k = 0; k < n_spec; ++k) PyList_SET_ITEM(drafts.ptr(), k, new_int(r.spec[k]));
        if (PyDict_SetItem(spec_tokens.ptr(), rid, drafts.ptr()) != 0) {
          throw py::error_already_set();
        }
      }
      r.spec.clear();
    }
    ++i;
  }
  // The runner's lists; the scheduled tokens count as computed from now on.
  const size_t n = scheduled_slots.size();
  py::list req_ids(n), before(n);
  bool any_grammar = false;
  for (size_t k = 0; k < n; ++k) {
    Row& r = t.row(scheduled_slots[k]);
    PyObject* rid = r.request_id.ptr();
    Py_INCREF(rid);
    PyList_SET_ITEM(req_ids.ptr(), static_cast<Py_ssize_t>(k), rid);
    PyList_SET_ITEM(before.ptr(), static_cast<Py_ssize_t>(k), new_int(r.num_computed));
    r.num_computed += scheduled_tokens[k];
    any_grammar = any_grammar || r.has_grammar;
  }
  return py::make_tuple(token_budget, scheduled, new_block_ids, num_scheduled, spec_tokens,
                        preempted, req_ids, before, any_grammar);
}

// The message of the exception being handled, "Type: message" (GIL held).
std::string describe(py::error_already_set& e) {
  std::string type = py::str(e.type().attr("__name__"));
  std::string value = py::str(e.value());
  return type + ": " + value;
}

// One request of update_decodes; columns are (ids, toks) of the current client.
void update_one(RequestTable& t, PyObject* rid, Py_ssize_t k, PyObject* slot_of,
                PyObject* sampled, PyObject* req_ids, PyObject* index_of, PyObject* in_flight,
                int64_t max_model_len, PyObject* plain, PyObject* deferred, PyObject* finished,
                int64_t& last_client, PyObject*& col_ids, PyObject*& col_toks) {
  if (in_flight != Py_None && PySet_Discard(in_flight, rid) < 0) throw py::error_already_set();
  PyObject* slot_obj = PyDict_GetItemWithError(slot_of, rid);  // borrowed
  if (slot_obj == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return;
  }
  Row& r = t.row(as_index(slot_obj));
  if (r.status != kRunning) return;  // aborted or preempted while its batch ran
  Py_ssize_t i = k;
  if (k >= PyList_GET_SIZE(req_ids) || PyList_GET_ITEM(req_ids, k) != rid) {
    int eq = 0;
    if (k < PyList_GET_SIZE(req_ids)) {
      eq = PyObject_RichCompareBool(PyList_GET_ITEM(req_ids, k), rid, Py_EQ);
      if (eq < 0) throw py::error_already_set();
    }
    if (!eq) {
      PyObject* idx = PyDict_GetItemWithError(index_of, rid);
      if (idx == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return;  // nothing sampled
      }
      i = as_index(idx);
    }
  }
  if (i < 0 || i >= PyList_GET_SIZE(sampled)) throw py::index_error("list index out of range");
  PyObject* toks_p = PyList_GET_ITEM(sampled, i);
  Py_INCREF(toks_p);
  Ref toks(toks_p);
  const Py_ssize_t n_new = PyList_Check(toks_p) ? PyList_GET_SIZE(toks_p) : PyObject_Length(toks_p);
  if (n_new < 0) throw py::error_already_set();
  if (n_new == 0) return;  // a prefill chunk
  if (n_new != 1 || r.has_grammar) {
    Ref entry(PyTuple_Pack(2, rid, toks.p));
    append(deferred, entry.p);
    return;
  }
  Ref tok(PySequence_GetItem(toks.p, 0));  // a list's item, or any sequence's
  const int64_t token = as_long(tok.p);
  if (r.hash_blocks) check_hashable(&token, &token + 1);  // refused before it is kept
  r.tokens.push_back(token);
  t.extend_hashes(r);
  const int32_t why = t.check_stop(r, max_model_len);
  if (why != kNotStopped) {
    Ref entry(PyTuple_Pack(3, rid, toks.p, why == kStopToken ? tok.p : Py_None));
    append(finished, entry.p);
    return;
  }
  if (r.client_index != last_client || col_ids == nullptr) {
    Ref key(new_int(r.client_index));
    PyObject* col = PyDict_GetItemWithError(plain, key.p);  // borrowed
    if (col == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      Ref ids(PyList_New(0)), tks(PyList_New(0));
      Ref fresh(PyTuple_Pack(2, ids.p, tks.p));
      if (PyDict_SetItem(plain, key.p, fresh.p) != 0) throw py::error_already_set();
      col = fresh.p;  // plain holds it now
    }
    col_ids = PyTuple_GET_ITEM(col, 0);
    col_toks = PyTuple_GET_ITEM(col, 1);
    last_client = r.client_index;
  }
  append(col_ids, rid);
  append(col_toks, toks.p);
}

py::tuple update_decodes(RequestTable& t, py::dict slot_of, py::dict scheduled, py::list sampled,
                         py::list req_ids, py::dict index_of, py::object in_flight,
                         int64_t max_model_len) {
  check_in_flight(in_flight.ptr(), true);
  py::dict plain;
  py::list deferred, finished, failed;
  int64_t last_client = -1;
  PyObject* col_ids = nullptr;  // borrowed from plain's tuples
  PyObject* col_toks = nullptr;
  PyObject *rid, *value;
  Py_ssize_t pos = 0;
  for (Py_ssize_t k = 0; PyDict_Next(scheduled.ptr(), &pos, &rid, &value); ++k) {
    // One request that makes this loop raise fails alone: it is handed back
    // (id, "Type: message") and the scheduler ends it with ERROR.
    try {
      update_one(t, rid, k, slot_of.ptr(), sampled.ptr(), req_ids.ptr(), index_of.ptr(),
                 in_flight.ptr(), max_model_len, plain.ptr(), deferred.ptr(), finished.ptr(),
                 last_client, col_ids, col_toks);
    } catch (py::error_already_set& e) {
      // Only an Exception is that request's failure; a BaseException (the
      // engine's SIGTERM shutdown, KeyboardInterrupt, SystemExit) ends the loop
      // as the Python twin's `except Exception` does.
      if (!e.matches(PyExc_Exception)) throw;
      failed.append(py::make_tuple(py::handle(rid), describe(e)));
      col_ids = col_toks = nullptr;
    } catch (const py::builtin_exception& e) {
      e.set_error();  // IndexError, ValueError... as Python, for its name
      py::error_already_set err;
      failed.append(py::make_tuple(py::handle(rid), describe(err)));
      col_ids = col_toks = nullptr;
    } catch (const std::exception& e) {
      failed.append(py::make_tuple(py::handle(rid), std::string("RuntimeError: ") + e.what()));
      col_ids = col_toks = nullptr;
    }
  }
  return py::make_tuple(plain, deferred, finished, failed);
}

}  // namespace

void bind_scheduler_loops(py::module_& m) {
  m.def("schedule_running", &schedule_running, py::arg("table"), py::arg("running"),
        py::arg("skip"), py::arg("in_flight"), py::arg("token_budget"), py::arg("threshold"),
        py::arg("max_len_1"), py::arg("max_model_len"), py::arg("priority"),
        "Scheduler.schedule()'s running loop (twin: sched/scheduler_loops.py).");
  m.def("update_decodes", &update_decodes, py::arg("table"), py::arg("slot_of"),
        py::arg("scheduled"), py::arg("sampled"), py::arg("req_ids"), py::arg("index_of"),
        py::arg("in_flight"), py::arg("max_model_len"),
        "The plain-decode loop of Scheduler.update_from_output (twin: "
        "sched/scheduler_loops.py).");
}

}  // namespace enginecore
