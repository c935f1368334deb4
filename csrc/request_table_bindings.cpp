// Python <-> RequestTable: argument conversion, export/import of rows (moves between
// tables of either kind) and the pybind11 binding; the table itself is request_table.cpp.
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>

#include "pyref.h"
#include "request_table.h"
#include "sha256.h"
#include "sha256_chain.h"

namespace py = pybind11;

namespace enginecore {

namespace {

// The ids of a list or tuple from index `from` on into out (resized to what was
// read), as Python's list iteration reads them: compact ints in place; any
// other item held while its __index__ runs (TypeError / OverflowError as
// PyLong_AsLongLong raises them), and the length and item array read again
// after it, since that code may have changed the list (freed its items).
void read_ints(PyObject* seq, size_t from, std::vector<int64_t>& out) {
  size_t i = from;
  for (; i < static_cast<size_t>(PySequence_Fast_GET_SIZE(seq)); ++i) {
    PyObject* o = PySequence_Fast_ITEMS(seq)[i];
    long long v;
    if (!compact_long(o, v)) {
      Py_INCREF(o);
      const Ref hold(o);
      v = PyLong_AsLongLong(o);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    }
    if (i >= out.size()) {
      out.resize(std::max(i + 1, static_cast<size_t>(PySequence_Fast_GET_SIZE(seq))));
    }
    out[i] = v;
  }
  out.resize(i);
}

std::vector<int64_t> int_vector(py::handle seq) {
  std::vector<int64_t> out;
  if (PyList_Check(seq.ptr()) || PyTuple_Check(seq.ptr())) {
    out.resize(static_cast<size_t>(PySequence_Fast_GET_SIZE(seq.ptr())));
    read_ints(seq.ptr(), 0, out);
    return out;
  }
  // Any other iterable: each item through __index__ (TypeError, OverflowError as
  // for a list), never pybind11's cast_error (RuntimeError).
  for (py::handle h : py::reinterpret_borrow<py::iterable>(seq)) out.push_back(as_long(h.ptr()));
  return out;
}

// A prompt's ids into its row. With SHA-NI, a list or tuple and no per-block
// keys, the full blocks are hashed while the ids are copied (the chain reads
// them between its rounds, sha256_chain.h: the copy was ~20 % of adding a long
// prompt); whatever that does not take is copied here and hashed by
// extend_hashes, as every other row is. The chain reads compact ints only, so
// no Python code runs (and the list cannot change) until read_ints.
void take_prompt(RequestTable& t, Row& r, py::handle prompt) {
#ifdef ENGINECORE_X86
  PyObject* seq = prompt.ptr();
  if (r.hash_blocks && r.block_extra_keys.empty() && t.block_size() > 0 && sha256_uses_shani() &&
      (PyList_Check(seq) || PyTuple_Check(seq))) {
    const size_t n = static_cast<size_t>(PySequence_Fast_GET_SIZE(seq));
    PyObject** items = PySequence_Fast_ITEMS(seq);
    const size_t bs = static_cast<size_t>(t.block_size());
    r.tokens.resize(n);
    int64_t* ids = r.tokens.data();
    r.hashes.reserve(n / bs);  // each digest stays put: the chain reads it back
    uint8_t root[32] = {0}, last[32];
    const size_t done = sha256_chain_reading(
        n / bs, bs, root, reinterpret_cast<const uint8_t*>(r.extra_keys.data()),
        r.extra_keys.size(),
        [&](size_t b, size_t i, uint32_t& id) {
          const size_t k = b * bs + i;
          long long v = 0;
          const bool ok = compact_long(items[k], v) && v >= 0 && v <= 0xFFFFFFFFLL;
          ids[k] = v;
          id = static_cast<uint32_t>(v);
          return ok;
        },
        [&](size_t) {
          r.hashes.emplace_back();
          return r.hashes.back().b;
        },
        last);
    // The rest as int_vector reads it (Python code may run from here on: no
    // `items` / `ids` pointers past this line).
    read_ints(seq, done * bs, r.tokens);
    return;
  }
#endif
  r.tokens = int_vector(prompt);
}

// A row state field through pybind11's caster: TypeError when it does not fit,
// as the same value passed to `add` would be refused.
template <class T>
T field(py::handle h, const char* name) {
  try {
    return h.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error(std::string("row state field ") + name + " has the wrong type (" +
                         std::string(py::str(py::type::handle_of(h).attr("__name__"))) + ")");
  }
}

py::list int_list(const int64_t* begin, const int64_t* end) {
  py::list out(end - begin);
  for (Py_ssize_t i = 0; begin != end; ++begin, ++i) {
    PyObject* v = PyLong_FromLongLong(*begin);
    if (v == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), i, v);
  }
  return out;
}

py::list hash_list(const std::vector<Hash32>& hashes) {
  py::list out(hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) {
    PyObject* b = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(hashes[i].b), 32);
    if (b == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), b);
  }
  return out;
}

Hash32 to_hash32(py::handle h) {
  if (!PyBytes_Check(h.ptr()) || PyBytes_GET_SIZE(h.ptr()) != 32) {
    throw py::value_error("block hashes are 32 bytes");
  }
  Hash32 out;
  std::memcpy(out.b, PyBytes_AS_STRING(h.ptr()), 32);
  return out;
}

std::vector<int32_t> block_ids(RequestTable& t, py::handle seq) {
  std::vector<int32_t> out;
  for (int64_t b : int_vector(seq)) {
    t.pool().check(b);
    out.push_back(static_cast<int32_t>(b));
  }
  return out;
}

py::list bytes_list(const std::vector<std::string>& items) {
  py::list out;
  for (const std::string& item : items) out.append(py::bytes(item));
  return out;
}

// A sequence of bytes objects (TypeError otherwise, as the twin).
std::vector<std::string> bytes_vector(py::handle seq, const char* what) {
  PyObject* it = PyObject_GetIter(seq.ptr());
  if (it == nullptr) {
    PyErr_Clear();
    throw py::type_error(std::string(what) + " must be a sequence of bytes");
  }
  py::object iter = py::reinterpret_steal<py::object>(it);
  std::vector<std::string> out;
  while (PyObject* raw = PyIter_Next(it)) {
    py::object item = py::reinterpret_steal<py::object>(raw);
    if (!PyBytes_Check(raw)) throw py::type_error(std::string(what) + " must be bytes");
    out.emplace_back(PyBytes_AS_STRING(raw), static_cast<size_t>(PyBytes_GET_SIZE(raw)));
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  return out;
}

py::tuple export_row(RequestTable& t, int64_t slot) {
  Row& r = t.row(slot);
  const int64_t* tok = r.tokens.data();
  return py::make_tuple(
      r.request_id, int_list(tok, tok + r.tokens.size()), r.num_prompt, r.num_computed,
      r.status, r.client_index, r.max_tokens, r.min_tokens, r.eos_token_id, r.ignore_eos,
      int_list(r.stop_token_ids.data(), r.stop_token_ids.data() + r.stop_token_ids.size()),
      r.has_grammar, int_list(r.spec.data(), r.spec.data() + r.spec.size()), r.priority,
      r.arrival_time, py::bytes(r.extra_keys), r.hash_blocks, hash_list(r.hashes),
      py::list(py::cast(r.blocks)), r.num_cached_blocks, bytes_list(r.block_extra_keys));
}

int64_t import_row(RequestTable& t, py::handle state_obj) {
  py::tuple s = py::tuple(py::reinterpret_borrow<py::object>(state_obj));
  if (s.size() != 21) {
    throw py::value_error("a row state has 21 fields, got " + std::to_string(s.size()));
  }
  if (py::len(s[18]) != 0) {
    throw py::value_error("a request that holds KV blocks cannot move to another table");
  }
  // Checked as `add` checks its arguments, and for consistency: a state no
  // export makes would leave a row the loops read out of bounds.
  auto r = std::make_unique<Row>();
  if (!PyUnicode_Check(s[0].ptr())) throw py::type_error("row state field request_id is a str");
  r->request_id = s[0];
  r->tokens = int_vector(s[1]);
  r->num_prompt = field<int64_t>(s[2], "num_prompt");
  r->num_computed = field<int64_t>(s[3], "num_computed");
  r->status = field<int32_t>(s[4], "status");
  r->client_index = field<int64_t>(s[5], "client_index");
  r->max_tokens = field<int64_t>(s[6], "max_tokens");
  r->min_tokens = field<int64_t>(s[7], "min_tokens");
  r->eos_token_id = field<int64_t>(s[8], "eos_token_id");
  r->ignore_eos = field<bool>(s[9], "ignore_eos");
  r->stop_token_ids = int_vector(s[10]);
  std::sort(r->stop_token_ids.begin(), r->stop_token_ids.end());
  r->has_grammar = field<bool>(s[11], "has_grammar");
  r->spec = int_vector(s[12]);
  r->priority = field<int64_t>(s[13], "priority");
  r->arrival_time = field<double>(s[14], "arrival_time");
  if (!PyBytes_Check(s[15].ptr())) throw py::type_error("row state field extra_keys is bytes");
  r->extra_keys = s[15].cast<std::string>();
  r->hash_blocks = field<bool>(s[16], "hash_blocks");
  for (py::handle h : py::reinterpret_borrow<py::iterable>(s[17])) {
    r->hashes.push_back(to_hash32(h));
  }
  r->num_cached_blocks = field<int64_t>(s[19], "num_cached_blocks");
  r->block_extra_keys = bytes_vector(s[20], "row state field block_extra_keys");
  const int64_t n_tok = static_cast<int64_t>(r->tokens.size());
  if (r->num_prompt < 0 || r->num_prompt > n_tok) {
    throw py::value_error("row state: num_prompt " + std::to_string(r->num_prompt) +
                          " outside [0, " + std::to_string(n_tok) + "]");
  }
  if (r->num_computed < 0) throw py::value_error("row state: num_computed < 0");
  if (r->num_cached_blocks != 0) {
    throw py::value_error("row state: a row without blocks has no cached blocks");
  }
  if (static_cast<int64_t>(r->hashes.size()) > n_tok / t.block_size()) {
    throw py::value_error("row state: more block hashes than full blocks");
  }
  if (r->hash_blocks) check_hashable(r->tokens.data(), r->tokens.data() + n_tok);
  return t.put(std::move(r));
}

int64_t add_row(RequestTable& t, py::str request_id, py::handle prompt, int64_t client_index,
                int64_t max_tokens, int64_t min_tokens, int64_t eos_token_id, bool ignore_eos,
                py::handle stop_token_ids, int64_t priority, double arrival_time,
                py::bytes extra_keys, bool hash_blocks, py::handle block_extra_keys) {
  auto r = std::make_unique<Row>();
  r->request_id = request_id;
  r->extra_keys = extra_keys;
  r->hash_blocks = hash_blocks;
  r->block_extra_keys = bytes_vector(block_extra_keys, "block_extra_keys");
  take_prompt(t, *r, prompt);
  r->num_prompt = static_cast<int64_t>(r->tokens.size());
  r->client_index = client_index;
  r->max_tokens = max_tokens;
  r->min_tokens = min_tokens;
  r->eos_token_id = eos_token_id;
  r->ignore_eos = ignore_eos;
  r->stop_token_ids = int_vector(stop_token_ids);
  std::sort(r->stop_token_ids.begin(), r->stop_token_ids.end());
  r->priority = priority;
  r->arrival_time = arrival_time;
  // Every prompt token, the tail's too: a bad one is refused now, not when
  // a later token fills its block.
  if (hash_blocks) check_hashable(r->tokens.data(), r->tokens.data() + r->tokens.size());
  t.extend_hashes(*r);
  return t.put(std::move(r));
}

}  // namespace

void bind_request_table(py::module_& m) {
  using T = RequestTable;
  py::class_<T>(m, "RequestTable",
                "Per-request hot state by slot: tokens, counts, stops, block tables, block "
                "hashes (twin: enginecore.sched.request_table.PyRequestTable).")
      .def(py::init<py::object, int64_t>(), py::arg("block_pool"), py::arg("block_size"))
      .def_property_readonly("block_pool", &T::pool_object)
      .def_property_readonly("block_size", &T::block_size)
      .def("add", &add_row, py::arg("request_id"), py::arg("prompt_token_ids"),
           py::arg("client_index"), py::arg("max_tokens"), py::arg("min_tokens"),
           py::arg("eos_token_id"), py::arg("ignore_eos"), py::arg("stop_token_ids"),
           py::arg("priority"), py::arg("arrival_time"), py::arg("extra_keys"),
           py::arg("hash_blocks"), py::arg("block_extra_keys") = py::tuple())
      .def("export_row", &export_row, py::arg("slot"))
      .def("import_row", &import_row, py::arg("state"))
      .def("release", &T::release, py::arg("slot"))
      .def("__len__", &T::live)
      .def("block_tables", [](T& t) {
        py::dict out;
        for (size_t s = 0; s < t.capacity(); ++s) {
          Row* r = t.maybe_row(s);
          if (r != nullptr && !r->request_id.is_none() && !r->blocks.empty()) {
            out[r->request_id] = py::cast(r->blocks);
          }
        }
        return out;
      })
      .def("get_request_id", [](T& t, int64_t s) { return t.row(s).request_id; },
           py::arg("slot"))
      .def("get_status", [](T& t, int64_t s) { return t.row(s).status; }, py::arg("slot"))
      .def("set_status", [](T& t, int64_t s, int32_t v) { t.row(s).status = v; },
           py::arg("slot"), py::arg("status"))
      .def("get_num_computed_tokens", [](T& t, int64_t s) { return t.row(s).num_computed; },
           py::arg("slot"))
      .def("set_num_computed_tokens", [](T& t, int64_t s, int64_t n) {
        Row& r = t.row(s);
        if (n < 0) throw py::value_error("num_computed_tokens must be >= 0, got " +
                                         std::to_string(n));
        r.num_computed = n;
      }, py::arg("slot"), py::arg("n"))
      .def("get_num_tokens", [](T& t, int64_t s) { return t.row(s).tokens.size(); },
           py::arg("slot"))
      .def("get_num_prompt_tokens", [](T& t, int64_t s) { return t.row(s).num_prompt; },
           py::arg("slot"))
      .def("get_token_ids", [](T& t, int64_t s) {
        Row& r = t.row(s);
        return int_list(r.tokens.data(), r.tokens.data() + r.tokens.size());
      }, py::arg("slot"))
      .def("get_output_token_ids", [](T& t, int64_t s) {
        Row& r = t.row(s);
        return int_list(r.tokens.data() + r.num_prompt, r.tokens.data() + r.tokens.size());
      }, py::arg("slot"))
      .def("get_client_index", [](T& t, int64_t s) { return t.row(s).client_index; },
           py::arg("slot"))
      .def("get_spec_token_ids", [](T& t, int64_t s) {
        Row& r = t.row(s);
        return int_list(r.spec.data(), r.spec.data() + r.spec.size());
      }, py::arg("slot"))
      .def("set_spec_token_ids", [](T& t, int64_t s, py::handle ids) {
        t.row(s).spec = int_vector(ids);
      }, py::arg("slot"), py::arg("token_ids"))
      .def("set_has_grammar", [](T& t, int64_t s, bool g) { t.row(s).has_grammar = g; },
           py::arg("slot"), py::arg("has_grammar"))
      .def("get_block_hashes", [](T& t, int64_t s) { return hash_list(t.row(s).hashes); },
           py::arg("slot"))
      .def("get_num_block_hashes", [](T& t, int64_t s) { return t.row(s).hashes.size(); },
           py::arg("slot"))
      .def("get_block_ids", [](T& t, int64_t s) { return py::list(py::cast(t.row(s).blocks)); },
           py::arg("slot"))
      .def("get_num_cached_blocks", [](T& t, int64_t s) { return t.row(s).num_cached_blocks; },
           py::arg("slot"))
      .def("append_token_ids", [](T& t, int64_t s, py::handle ids) {
        Row& r = t.row(s);
        const std::vector<int64_t> v = int_vector(ids);
        if (r.hash_blocks) check_hashable(v.data(), v.data() + v.size());  // before any is kept
        r.tokens.insert(r.tokens.end(), v.begin(), v.end());
        t.extend_hashes(r);
      }, py::arg("slot"), py::arg("token_ids"))
      .def("check_stop", [](T& t, int64_t s, int64_t max_model_len) {
        return t.check_stop(t.row(s), max_model_len);
      }, py::arg("slot"), py::arg("max_model_len"))
      .def("get_computed_blocks", [](T& t, int64_t s, int64_t max_hit_blocks) {
        Row& r = t.row(s);
        BlockPool& p = t.pool();
        std::vector<int32_t> hits;
        const int64_t n = std::min<int64_t>(std::max<int64_t>(max_hit_blocks, 0),
                                            static_cast<int64_t>(r.hashes.size()));
        for (int64_t i = 0; i < n; ++i) {
          const int32_t b = p.lookup(r.hashes[i]);
          if (b < 0) break;
          hits.push_back(b);
        }
        return hits;
      }, py::arg("slot"), py::arg("max_hit_blocks"))
      .def("allocate_slots", [](T& t, int64_t s, int64_t num_new_tokens,
                                int64_t num_new_computed_tokens, py::handle new_computed_blocks,
                                int64_t num_lookahead_tokens, int64_t max_model_len) -> py::object {
        Row& r = t.row(s);
        const std::vector<int32_t> computed = block_ids(t, new_computed_blocks);
        std::vector<int32_t> fresh;
        if (!t.allocate(r, num_new_tokens, num_new_computed_tokens, computed,
                        num_lookahead_tokens, max_model_len, fresh)) {
          return py::none();
        }
        return py::list(py::cast(fresh));
      }, py::arg("slot"), py::arg("num_new_tokens"), py::arg("num_new_computed_tokens"),
         py::arg("new_computed_blocks"), py::arg("num_lookahead_tokens"),
         py::arg("max_model_len"))
      .def("free_blocks", [](T& t, int64_t s) { t.free_blocks(t.row(s)); }, py::arg("slot"))
      .def("uncache_from", [](T& t, int64_t s, int64_t num_tokens) {
        Row& r = t.row(s);
        if (r.blocks.empty()) return;
        const int64_t first = std::max<int64_t>(num_tokens, 0) / t.block_size();
        BlockPool& p = t.pool();
        for (size_t i = static_cast<size_t>(first); i < r.blocks.size(); ++i) {
          p.uncache(r.blocks[i]);
        }
        if (r.num_cached_blocks > first) r.num_cached_blocks = first;
      }, py::arg("slot"), py::arg("num_tokens"));
}

}  // namespace enginecore
