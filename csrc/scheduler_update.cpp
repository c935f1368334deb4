// The scheduler's per-request loops, native twins of python/enginecore/sched/scheduler.py:
//
// * update_decodes: Scheduler.update_from_output for plain decodes (one
//   sampled token, no grammar, no logprobs, no drafts). Requests that are not
//   plain go to the Python method the twin uses too (update_request); finished
//   ones to emit_finished.
// * schedule_running: the running-request loop of Scheduler.schedule() up to
//   the first request that needs more than the common case (drafts, a
//   preemption); Python continues the loop from there.
//
// State stays in the Python objects (Request, KVCacheManager): these loops
// save the interpreter's per-request overhead, not the data structures.
#include <pybind11/pybind11.h>
#include <structmember.h>

#include <array>
#include <stdexcept>
#include <utility>
#include <string>

#include "block_hash.h"
#include "pyref.h"


namespace py = pybind11;

namespace enginecore {
namespace {

PyObject* intern(const char* s) {
  PyObject* o = PyUnicode_InternFromString(s);
  if (o == nullptr) throw py::error_already_set();
  return o;  // immortal for the module's life
}

// An attribute name and the (type, slot offset) it was last read on: each
// name is read on one type almost always (status on Request, block_hash on
// KVCacheBlock), so a type compare replaces the table lookup below.
struct Attr {
  PyObject* name;
  PyTypeObject* type = nullptr;  // a reference held
  Py_ssize_t offset = -1;
  explicit Attr(const char* s) : name(intern(s)) {}
};

struct Names {
  Attr status{"status"}, grammar{"grammar"}, output_token_ids{"output_token_ids"},
      all_token_ids{"all_token_ids"}, block_size{"block_size"}, block_hashes{"block_hashes"},
      extend_block_hashes{"_extend_block_hashes"}, max_tokens{"max_tokens"},
      min_tokens{"min_tokens"}, eos_token_id{"eos_token_id"}, ignore_eos{"ignore_eos"},
      stop_token_ids{"stop_token_ids"}, stop_reason{"stop_reason"},
      client_index{"client_index"}, request_ids{"request_ids"},
      new_token_ids{"new_token_ids"}, request_id{"request_id"},
      num_computed_tokens{"num_computed_tokens"}, spec_token_ids{"spec_token_ids"},
      allocate_slots{"allocate_slots"}, cache_full_blocks{"cache_full_blocks"},
      block_id{"block_id"}, hash_algo{"hash_algo"}, extra_bytes{"_extra_bytes"},
      cached_block_hash_to_block{"cached_block_hash_to_block"}, block_hash{"block_hash"},
      free_block_queue{"free_block_queue"}, num_free_blocks{"num_free_blocks"}, head{"_head"},
      next_free{"next_free"}, prev_free{"prev_free"}, ref_cnt{"ref_cnt"},
      num_evictions{"num_evictions"}, max_model_len{"max_model_len"};
};

// Only touched with the GIL held.
Names& names() {
  static Names n;
  return n;
}

// __slots__ attributes read and written at their offset: the generic getattr
// (type lookup, descriptor call) is most of the cost of these loops otherwise.
// Only for plain member slots of types with the generic getattr; anything else
// (a property, a custom __getattribute__, an unset slot) takes PyObject_GetAttr.
struct SlotEntry {
  PyTypeObject* type;
  PyObject* name;
  Py_ssize_t offset;  // -1: not a plain slot
};

// Open addressing on (type, name): these loops look up ~20 attributes per
// request, so the lookup itself must be a hash and a compare or two.
constexpr size_t kSlotTableSize = 256;  // at most half full
constexpr size_t kSlotTableMax = kSlotTableSize / 2;

size_t slot_hash(PyTypeObject* t, PyObject* name) {
  const auto h = (reinterpret_cast<uintptr_t>(t) >> 4) * 0x9E3779B97F4A7C15ULL ^
                 (reinterpret_cast<uintptr_t>(name) >> 4);
  return static_cast<size_t>(h ^ (h >> 29)) & (kSlotTableSize - 1);
}

Py_ssize_t slot_offset(PyTypeObject* t, PyObject* name) {
  static std::array<SlotEntry, kSlotTableSize> table{};
  static size_t used = 0;
  size_t i = slot_hash(t, name);
  for (; table[i].type != nullptr; i = (i + 1) & (kSlotTableSize - 1)) {
    if (table[i].type == t && table[i].name == name) return table[i].offset;
  }
  Py_ssize_t offset = -1;
  if (t->tp_getattro == PyObject_GenericGetAttr && t->tp_setattro == PyObject_GenericSetAttr) {
    PyObject* d = PyObject_GetAttr(reinterpret_cast<PyObject*>(t), name);
    if (d == nullptr) {
      PyErr_Clear();
    } else {
      if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READONLY)) offset = m->offset;
      }
      Py_DECREF(d);
    }
  }
  if (used < kSlotTableMax) {
    // Probe again: the getattr above may have run Python code that added entries.
    for (i = slot_hash(t, name); table[i].type != nullptr; i = (i + 1) & (kSlotTableSize - 1)) {
      if (table[i].type == t && table[i].name == name) return table[i].offset;
    }
    Py_INCREF(t);  // the table keeps the type (and so the offset) valid
    table[i] = SlotEntry{t, name, offset};
    ++used;
  }
  return offset;
}

Py_ssize_t offset_of(PyTypeObject* t, Attr& a) {
  if (a.type != t) {
    a.offset = slot_offset(t, a.name);
    Py_INCREF(t);  // the offset is only valid while this type lives
    Py_XDECREF(reinterpret_cast<PyObject*>(a.type));
    a.type = t;
  }
  return a.offset;
}

// New reference (throws on error).
PyObject* get(PyObject* o, Attr& a) {
  const Py_ssize_t off = offset_of(Py_TYPE(o), a);
  if (off >= 0) {
    PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
    if (v != nullptr) {
      Py_INCREF(v);
      return v;
    }
  }
  PyObject* v = PyObject_GetAttr(o, a.name);
  if (v == nullptr) throw py::error_already_set();
  return v;
}

long long attr_int(PyObject* o, Attr& a) {
  Ref v(get(o, a));
  return as_long(v.p);
}

Py_ssize_t attr_len(PyObject* o, Attr& a) {
  Ref v(get(o, a));
  const Py_ssize_t n = PyObject_Length(v.p);
  if (n < 0) throw py::error_already_set();
  return n;
}

void set_attr(PyObject* o, Attr& a, PyObject* value) {
  const Py_ssize_t off = offset_of(Py_TYPE(o), a);
  if (off >= 0) {
    PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + off);
    PyObject* old = *slot;
    Py_INCREF(value);
    *slot = value;
    Py_XDECREF(old);
    return;
  }
  if (PyObject_SetAttr(o, a.name, value) != 0) throw py::error_already_set();
}

void append(PyObject* list, PyObject* item) {
  if (PyList_Append(list, item) != 0) throw py::error_already_set();
}

// Scheduler._check_stop for a request whose last output token is ``tok``.
bool check_stop(PyObject* req, PyObject* tok, Py_ssize_t n_out, Py_ssize_t n_all,
                long long max_model_len, PyObject* length, PyObject* stopped) {
  Names& nm = names();
  if (n_all >= max_model_len || n_out >= attr_int(req, nm.max_tokens)) {
    set_attr(req, nm.status, length);
    return true;
  }
  if (n_out < attr_int(req, nm.min_tokens)) return false;
  Ref eos(get(req, nm.eos_token_id));
  int is_eos = PyObject_RichCompareBool(tok, eos.p, Py_EQ);
  if (is_eos < 0) throw py::error_already_set();
  if (is_eos) {
    Ref ignore(get(req, nm.ignore_eos));
    const int ig = PyObject_IsTrue(ignore.p);
    if (ig < 0) throw py::error_already_set();
    if (!ig) {
      set_attr(req, nm.status, stopped);
      return true;
    }
  }
  Ref stop_ids(get(req, nm.stop_token_ids));
  const int hit = PySequence_Contains(stop_ids.p, tok);
  if (hit < 0) throw py::error_already_set();
  if (hit) {
    set_attr(req, nm.status, stopped);
    set_attr(req, nm.stop_reason, tok);
    return true;
  }
  return false;
}

// Request._extend_block_hashes: hash the blocks the request's tokens filled.
void extend_block_hashes(PyObject* req, PyObject* all_ids, Py_ssize_t n_all) {
  Names& nm = names();
  const long long bs = attr_int(req, nm.block_size);
  if (bs <= 0) return;
  Ref hashes(get(req, nm.block_hashes));
  if (!PyList_Check(hashes.p)) {
    Ref r(PyObject_CallMethodObjArgs(req, nm.extend_block_hashes.name, nullptr));
    return;
  }
  const Py_ssize_t done = PyList_GET_SIZE(hashes.p);
  if (n_all < (done + 1) * bs) return;
  Ref algo(get(req, nm.hash_algo));
  Ref extra(get(req, nm.extra_bytes));
  if (!PyUnicode_Check(algo.p) || PyUnicode_CompareWithASCIIString(algo.p, "sha256") != 0 ||
      !PyBytes_Check(extra.p)) {
    Ref r(PyObject_CallMethodObjArgs(req, nm.extend_block_hashes.name, nullptr));
    return;
  }
  uint8_t parent[32];
  parent_bytes(done ? PyList_GET_ITEM(hashes.p, done - 1) : Py_None, parent);
  const std::string extra_s(PyBytes_AS_STRING(extra.p),
                            static_cast<size_t>(PyBytes_GET_SIZE(extra.p)));
  append_block_hashes(all_ids, static_cast<size_t>(done * bs),
                      static_cast<size_t>(n_all / bs - done), static_cast<size_t>(bs), parent,
                      extra_s, hashes.p);
}

// BlockPool.cache_full_blocks: register blocks[start:end], now full, under
// their hashes (a block whose hash another block holds stays uncached).
void cache_full_blocks(PyObject* block_pool, PyObject* blocks, PyObject* hashes,
                       long long start, long long end) {
  Names& nm = names();
  if (!PyList_Check(blocks) || !PyList_Check(hashes)) {
    Ref a(PyLong_FromLongLong(start)), b(PyLong_FromLongLong(end));
    Ref r(PyObject_CallMethodObjArgs(block_pool, nm.cache_full_blocks.name, blocks, hashes, a.p, b.p,
                                     nullptr));
    return;
  }
  Ref cached(get(block_pool, nm.cached_block_hash_to_block));
  for (long long i = start; i < end; ++i) {
    if (i >= PyList_GET_SIZE(blocks) || i >= PyList_GET_SIZE(hashes)) {
      throw py::index_error("list index out of range");
    }
    PyObject* block = PyList_GET_ITEM(blocks, i);
    {
      Ref current(get(block, nm.block_hash));
      if (current.p != Py_None) continue;
    }
    PyObject* h = PyList_GET_ITEM(hashes, i);
    const int known = PyDict_Contains(cached.p, h);
    if (known < 0) throw py::error_already_set();
    if (!known) {
      set_attr(block, nm.block_hash, h);
      if (PyDict_SetItem(cached.p, h, block) != 0) throw py::error_already_set();
    }
  }
}

// The message of the exception being handled, "Type: message" (GIL held).
std::string describe(py::error_already_set& e) {
  std::string type = py::str(e.type().attr("__name__"));
  std::string value = py::str(e.value());
  return type + ": " + value;
}

// One request's update: the loop body of update_decodes.
void update_one(PyObject* rid, Py_ssize_t k, PyObject* requests, PyObject* index_of,
                PyObject* sampled, PyObject* req_ids, Py_ssize_t num_answered,
                PyObject* in_flight_set, long long max_model_len, PyObject* running,
                PyObject* length, PyObject* stopped, PyObject* output_type,
                PyObject* columnar_type, bool columnar, PyObject* outputs, PyObject* cols,
                PyObject* stopped_list, PyObject* emit_finished, PyObject* update_request,
                PyObject*& last, PyObject*& col_ids, PyObject*& col_toks) {
  Names& nm = names();
  if (in_flight_set != nullptr && PySet_Discard(in_flight_set, rid) < 0) {
    throw py::error_already_set();
  }
  PyObject* req = PyDict_GetItemWithError(requests, rid);  // borrowed
  if (req == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return;
  }
  Py_INCREF(req);
  Ref req_ref(req);
  {
    Ref status(get(req, nm.status));
    const int ne = PyObject_RichCompareBool(status.p, running, Py_NE);
    if (ne < 0) throw py::error_already_set();
    if (ne) return;  // aborted or preempted while its batch ran
  }
  Py_ssize_t i = k;
  if (k >= num_answered || PyList_GET_ITEM(req_ids, k) != rid) {
    PyObject* idx = PyDict_GetItemWithError(index_of, rid);
    if (idx == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      return;  // nothing sampled
    }
    i = PyLong_AsSsize_t(idx);
    if (i == -1 && PyErr_Occurred()) throw py::error_already_set();
  }
  if (i < 0 || i >= PyList_GET_SIZE(sampled)) throw py::index_error("sampled index");
  PyObject* toks = PyList_GET_ITEM(sampled, i);  // borrowed
  if (!PyList_Check(toks)) throw py::type_error("sampled token ids must be lists");
  const Py_ssize_t n_new = PyList_GET_SIZE(toks);
  if (n_new == 0) return;  // a prefill chunk: nothing sampled
  Ref grammar(get(req, nm.grammar));
  if (n_new != 1 || grammar.p != Py_None) {
    Ref r(PyObject_CallFunctionObjArgs(update_request, req, rid, toks, Py_None,
                                       outputs, columnar ? cols : Py_None,
                                       stopped_list, nullptr));
    return;
  }
  PyObject* tok = PyList_GET_ITEM(toks, 0);
  // Request.append_output_token_ids
  Ref out_ids(get(req, nm.output_token_ids));
  Ref all_ids(get(req, nm.all_token_ids));
  append(out_ids.p, tok);
  append(all_ids.p, tok);
  const Py_ssize_t n_out = PyList_GET_SIZE(out_ids.p);
  const Py_ssize_t n_all = PyList_GET_SIZE(all_ids.p);
  extend_block_hashes(req, all_ids.p, n_all);
  if (check_stop(req, tok, n_out, n_all, max_model_len, length, stopped)) {
    append(stopped_list, req);
    Ref r(PyObject_CallFunctionObjArgs(emit_finished, req, rid, toks, outputs,
                                       columnar ? cols : Py_None, nullptr));
    return;
  }
  Ref client(get(req, nm.client_index));
  if (columnar) {
    int same = 0;
    if (last != nullptr) {
      same = PyObject_RichCompareBool(client.p, last, Py_EQ);
      if (same < 0) throw py::error_already_set();
    }
    if (!same) {
      PyObject* col = PyDict_GetItemWithError(cols, client.p);  // borrowed
      if (col == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        Ref fresh(PyObject_CallNoArgs(columnar_type));
        if (PyDict_SetItem(cols, client.p, fresh.p) != 0) throw py::error_already_set();
        col = fresh.p;  // cols holds it now
      }
      Ref ids(get(col, nm.request_ids));
      Ref tks(get(col, nm.new_token_ids));
      col_ids = ids.p;  // the column lists live as long as their ColumnarOutputs
      col_toks = tks.p;
      Py_XDECREF(last);
      last = client.p;
      Py_INCREF(last);
    }
    append(col_ids, rid);
    append(col_toks, toks);
    return;
  }
  // EngineCoreOutput(rid, toks, None), then Scheduler._emit.
  PyObject* args[3] = {rid, toks, Py_None};
  Ref out(PyObject_Vectorcall(output_type, args, 3, nullptr));
  PyObject* lst = PyDict_GetItemWithError(outputs, client.p);
  if (lst == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    Ref fresh(PyList_New(1));
    Py_INCREF(out.p);
    PyList_SET_ITEM(fresh.p, 0, out.p);
    if (PyDict_SetItem(outputs, client.p, fresh.p) != 0) throw py::error_already_set();
  } else {
    append(lst, out.p);
  }
}

void update_decodes(py::dict requests, py::dict scheduled, py::list sampled, py::list req_ids,
                    py::dict index_of,
                    py::object in_flight, long long max_model_len, py::tuple statuses,
                    py::dict outputs, py::object cols, py::list stopped_list, py::tuple types,
                    py::object emit_finished, py::object update_request, py::list failed) {
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
  // The runner answers in schedule order as a rule: req_ids[k] is the k-th
  // scheduled request, and its index needs no dict lookup.
  const Py_ssize_t num_answered = PyList_GET_SIZE(req_ids.ptr());
  for (Py_ssize_t k = 0; PyDict_Next(scheduled.ptr(), &pos, &rid, &value); ++k) {
    // One request that makes this loop raise fails alone: it is handed back
    // (id, "Type: message") and the scheduler ends it with ERROR.
    try {
      update_one(rid, k, requests.ptr(), index_of.ptr(), sampled.ptr(), req_ids.ptr(),
                 num_answered, in_flight_set, max_model_len, running, length, stopped,
                 output_type, columnar_type, columnar, outputs.ptr(), cols.ptr(),
                 stopped_list.ptr(), emit_finished.ptr(), update_request.ptr(), last.p, col_ids,
                 col_toks);
    } catch (py::error_already_set& e) {
      // Only an Exception is that request's failure; a BaseException (the
      // engine's SIGTERM shutdown, KeyboardInterrupt, SystemExit) ends the loop
      // as the Python twin's `except Exception` (sched/scheduler_update.py) does.
      if (!e.matches(PyExc_Exception)) throw;
      failed.append(py::make_tuple(py::handle(rid), describe(e)));
      Py_XDECREF(last.p);  // the column cursor may be half set: start afresh
      last.p = nullptr;
    } catch (const std::exception& e) {
      failed.append(py::make_tuple(py::handle(rid), std::string("RuntimeError: ") + e.what()));
      Py_XDECREF(last.p);
      last.p = nullptr;
    }
  }
}

// The slow path of KVCacheManager.allocate_slots for a running request (no
// prefix hits, no lookahead) with BlockPool.get_new_blocks and
// FreeKVCacheBlockQueue.popleft_n inline: the blocks its tokens need beyond
// those it has come from the front of the free queue (their hashes evicted).
// Appends them to `blocks` and their ids to `new_ids`; false, changing
// nothing, when the pool has too few free blocks (Python then preempts).
bool grow_blocks(PyObject* blocks, long long num_needed, long long block_size, PyObject* pool,
                 PyObject* new_ids) {
  Names& nm = names();
  const long long n = (num_needed + block_size - 1) / block_size - PyList_GET_SIZE(blocks);
  if (n <= 0) return true;
  Ref queue(get(pool, nm.free_block_queue));
  const long long num_free = attr_int(queue.p, nm.num_free_blocks);
  if (n > num_free) return false;
  Ref cached(get(pool, nm.cached_block_hash_to_block));
  Ref head(get(queue.p, nm.head));
  Ref block(get(head.p, nm.next_free));
  Ref one(PyLong_FromLong(1));
  long long evicted = 0;
  for (long long k = 0; k < n; ++k) {
    if (block.p == Py_None) throw std::runtime_error("the free block queue is shorter than its count");
    Ref next(get(block.p, nm.next_free));
    set_attr(block.p, nm.prev_free, Py_None);
    set_attr(block.p, nm.next_free, Py_None);
    Ref h(get(block.p, nm.block_hash));
    if (h.p != Py_None) {
      PyObject* holder = PyDict_GetItemWithError(cached.p, h.p);  // borrowed
      if (holder == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (holder == block.p && PyDict_DelItem(cached.p, h.p) != 0) {
        throw py::error_already_set();
      }
      set_attr(block.p, nm.block_hash, Py_None);
      ++evicted;
    }
    set_attr(block.p, nm.ref_cnt, one.p);
    append(blocks, block.p);
    Ref id(get(block.p, nm.block_id));
    append(new_ids, id.p);
    std::swap(block.p, next.p);  // each Ref releases what it holds at the end
  }
  set_attr(head.p, nm.next_free, block.p);
  set_attr(block.p, nm.prev_free, head.p);
  Ref left(PyLong_FromLongLong(num_free - n));
  set_attr(queue.p, nm.num_free_blocks, left.p);
  if (evicted) {
    Ref total(PyLong_FromLongLong(attr_int(pool, nm.num_evictions) + evicted));
    set_attr(pool, nm.num_evictions, total.p);
  }
  return true;
}

// Returns (index of the first running request left to Python, token budget left).
py::tuple schedule_running(py::list running, py::object in_flight, long long token_budget,
                           long long threshold, long long max_len_1, py::object kv,
                           py::dict req_to_blocks, py::dict num_cached_blocks,
                           long long block_size, bool enable_caching, py::object block_pool,
                           py::list scheduled_running, py::list running_new_blocks,
                           py::dict num_scheduled_tokens) {
  Names& nm = names();
  PyObject* in_flight_set = in_flight.is_none() ? nullptr : in_flight.ptr();
  long long kv_max_len = -1;  // read when first needed
  Py_ssize_t idx = 0;
  for (; idx < PyList_GET_SIZE(running.ptr()) && token_budget > 0; ++idx) {
    PyObject* req = PyList_GET_ITEM(running.ptr(), idx);
    Py_INCREF(req);
    Ref req_ref(req);
    Ref rid(get(req, nm.request_id));
    if (in_flight_set != nullptr) {
      const int busy = PySet_Contains(in_flight_set, rid.p);
      if (busy < 0) throw py::error_already_set();
      if (busy) continue;
    }
    if (attr_len(req, nm.spec_token_ids) != 0) break;  // drafts: Python's loop
    const long long computed = attr_int(req, nm.num_computed_tokens);
    const long long num_tokens = attr_len(req, nm.all_token_ids);
    long long num_new = num_tokens - computed;
    if (threshold && num_new > threshold) num_new = threshold;
    if (num_new > token_budget) num_new = token_budget;
    if (num_new > max_len_1 - computed) num_new = max_len_1 - computed;
    if (num_new <= 0) continue;
    // KVCacheManager.allocate_slots' fast path: the tokens fit the blocks it has.
    PyObject* blocks = PyDict_GetItemWithError(req_to_blocks.ptr(), rid.p);  // borrowed
    if (blocks == nullptr && PyErr_Occurred()) throw py::error_already_set();
    const long long end = computed + num_new;
    Ref new_ids_ref(Py_None);  // the new block ids, or None
    Py_INCREF(Py_None);
    if (blocks != nullptr && PyList_Check(blocks)) {
      if (end > static_cast<long long>(PyList_GET_SIZE(blocks)) * block_size) {
        if (kv_max_len < 0) kv_max_len = attr_int(kv.ptr(), nm.max_model_len);
        Ref ids(PyList_New(0));
        if (!grow_blocks(blocks, end < kv_max_len ? end : kv_max_len, block_size,
                         block_pool.ptr(), ids.p)) {
          break;  // no room: preemption is Python's
        }
        if (PyList_GET_SIZE(ids.p) > 0) std::swap(new_ids_ref.p, ids.p);
      }
      if (enable_caching) {
        const long long num_full = (end < num_tokens ? end : num_tokens) / block_size;
        PyObject* done_obj = PyDict_GetItemWithError(num_cached_blocks.ptr(), rid.p);
        if (done_obj == nullptr) {
          if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, rid.p);
          throw py::error_already_set();
        }
        const long long done = as_long(done_obj);
        if (num_full > done) {
          Ref hashes(get(req, nm.block_hashes));
          cache_full_blocks(block_pool.ptr(), blocks, hashes.p, done, num_full);
          Ref stop(PyLong_FromLongLong(num_full));
          if (PyDict_SetItem(num_cached_blocks.ptr(), rid.p, stop.p) != 0) {
            throw py::error_already_set();
          }
        }
      }
    } else {
      Ref n(PyLong_FromLongLong(num_new));
      Ref got(PyObject_CallMethodObjArgs(kv.ptr(), nm.allocate_slots.name, req, n.p, nullptr));
      if (got.p == Py_None) break;  // no room: preemption is Python's
      const Py_ssize_t k = PyObject_Length(got.p);
      if (k < 0) throw py::error_already_set();
      if (k > 0) {
        Ref ids(PyList_New(k));
        for (Py_ssize_t j = 0; j < k; ++j) {
          Ref b(PySequence_GetItem(got.p, j));
          PyList_SET_ITEM(ids.p, j, PyObject_GetAttr(b.p, nm.block_id.name));
          if (PyList_GET_ITEM(ids.p, j) == nullptr) throw py::error_already_set();
        }
        Py_INCREF(ids.p);
        Py_DECREF(new_ids_ref.p);
        new_ids_ref.p = ids.p;
      }
    }
    append(scheduled_running.ptr(), req);
    append(running_new_blocks.ptr(), new_ids_ref.p);
    Ref n(PyLong_FromLongLong(num_new));
    if (PyDict_SetItem(num_scheduled_tokens.ptr(), rid.p, n.p) != 0) {
      throw py::error_already_set();
    }
    token_budget -= num_new;
  }
  return py::make_tuple(idx, token_budget);
}

// Scheduler._finish_running: (request ids, num_computed_tokens before this
// step, whether any has a grammar) of the scheduled running requests, whose
// num_computed_tokens then count this step's tokens.
py::tuple finish_running(py::list scheduled_running, py::dict num_scheduled_tokens) {
  Names& nm = names();
  const Py_ssize_t n = PyList_GET_SIZE(scheduled_running.ptr());
  py::list ids(n), computed(n);
  bool any_grammar = false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* req = PyList_GET_ITEM(scheduled_running.ptr(), i);
    PyObject* rid = get(req, nm.request_id);  // the list takes this reference
    PyList_SET_ITEM(ids.ptr(), i, rid);
    PyObject* before = get(req, nm.num_computed_tokens);
    PyList_SET_ITEM(computed.ptr(), i, before);
    PyObject* num = PyDict_GetItemWithError(num_scheduled_tokens.ptr(), rid);
    if (num == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, rid);
      throw py::error_already_set();
    }
    Ref after(PyNumber_Add(before, num));
    set_attr(req, nm.num_computed_tokens, after.p);
    if (!any_grammar) {
      Ref grammar(get(req, nm.grammar));
      any_grammar = grammar.p != Py_None;
    }
  }
  return py::make_tuple(ids, computed, any_grammar);
}

}  // namespace

void bind_scheduler_update(py::module_& m) {
  m.def("finish_running", &finish_running,
        "Scheduler._finish_running: ids, computed counts, grammar flag; counts advanced.");
  m.def("update_decodes", &update_decodes,
        "The plain-decode loop of Scheduler.update_from_output (see scheduler.py).");
  m.def("schedule_running", &schedule_running,
        "The common-case prefix of Scheduler.schedule()'s running loop (see scheduler.py).");
}

}  // namespace enginecore
