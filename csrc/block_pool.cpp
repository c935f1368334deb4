// The KV block pool, twin of python/enginecore/sched/block_pool.py (PyBlockPool).
#include "block_pool.h"

#include "pyref.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace enginecore {

BlockPool::BlockPool(int64_t num_blocks, bool enable_caching)
    : enable_caching_(enable_caching) {
  if (num_blocks <= 0) {
    throw std::invalid_argument("the KV cache needs at least one block, got " +
                                std::to_string(num_blocks));
  }
  if (num_blocks > (1LL << 30)) throw std::invalid_argument("too many KV blocks");
  num_blocks_ = static_cast<int32_t>(num_blocks);
  num_free_ = num_blocks;
  head_ = num_blocks_;
  tail_ = num_blocks_ + 1;
  ref_.assign(num_blocks_, 0);
  hash_.resize(num_blocks_);
  has_hash_.assign(num_blocks_, 0);
  next_.resize(num_blocks_ + 2);
  prev_.resize(num_blocks_ + 2);
  for (int32_t i = 0; i < num_blocks_; ++i) {
    next_[i] = i + 1;
    prev_[i] = i - 1;
  }
  next_[num_blocks_ - 1] = tail_;
  prev_[0] = head_;
  next_[head_] = 0;
  prev_[head_] = -1;
  prev_[tail_] = num_blocks_ - 1;
  next_[tail_] = -1;
}

void BlockPool::check(int64_t block) const {
  if (block < 0 || block >= num_blocks_) {
    throw py::index_error("block id " + std::to_string(block) + " out of range [0, " +
                          std::to_string(num_blocks_) + ")");
  }
}

int32_t BlockPool::lookup(const Hash32& h) const {
  return cached_.find(h, hash_.data());
}

std::vector<int32_t> BlockPool::free_ids() const {
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(num_free_));
  for (int32_t b = next_[head_]; b != tail_; b = next_[b]) out.push_back(b);
  return out;
}

void BlockPool::take(int64_t n, std::vector<int32_t>& out) {
  if (n < 0) throw std::invalid_argument("asked for " + std::to_string(n) + " blocks");
  if (n > num_free_) {
    throw std::invalid_argument("asked for " + std::to_string(n) + " free blocks, " +
                                std::to_string(num_free_) + " left");
  }
  int32_t b = next_[head_];
  for (int64_t k = 0; k < n; ++k) {
    out.push_back(b);
    const int32_t following = next_[b];
    next_[b] = prev_[b] = -1;
    if (has_hash_[b]) {
      cached_.erase(b, hash_.data());
      has_hash_[b] = 0;
      ++num_evictions_;
    }
    ref_[b] = 1;
    b = following;
  }
  next_[head_] = b;
  prev_[b] = head_;
  num_free_ -= n;
}

void BlockPool::unlink(int32_t block) {
  const int32_t p = prev_[block], n = next_[block];
  if (p < 0 || n < 0) {
    throw std::runtime_error("block " + std::to_string(block) + " is not in the free queue");
  }
  next_[p] = n;
  prev_[n] = p;
  prev_[block] = next_[block] = -1;
  --num_free_;
}

void BlockPool::touch(int32_t block) {
  if (ref_[block] == 0) unlink(block);
  ++ref_[block];
}

void BlockPool::release(int32_t block) {
  if (ref_[block] <= 0) throw std::runtime_error("double free of block " + std::to_string(block));
  if (--ref_[block] == 0) {
    const int32_t last = prev_[tail_];
    next_[last] = block;
    prev_[block] = last;
    next_[block] = tail_;
    prev_[tail_] = block;
    ++num_free_;
  }
}

void BlockPool::cache(int32_t block, const Hash32& h) {
  if (has_hash_[block]) return;
  // The index reads the key from hash_; without has_hash_ nothing reads it.
  hash_[block] = h;
  if (cached_.insert(block, hash_.data())) has_hash_[block] = 1;
}

void BlockPool::uncache(int32_t block) {
  if (!has_hash_[block]) return;
  cached_.erase(block, hash_.data());
  has_hash_[block] = 0;
}

bool BlockPool::reset() {
  if (num_free_ != num_blocks_) return false;
  std::fill(has_hash_.begin(), has_hash_.end(), 0);
  cached_.clear();
  return true;
}

namespace {

Hash32 to_hash(py::handle h) {
  if (!PyBytes_Check(h.ptr())) throw py::type_error("block hashes are bytes");
  if (PyBytes_GET_SIZE(h.ptr()) != 32) {
    throw py::value_error("block hashes are 32 bytes, got " +
                          std::to_string(PyBytes_GET_SIZE(h.ptr())));
  }
  Hash32 out;
  std::memcpy(out.b, PyBytes_AS_STRING(h.ptr()), 32);
  return out;
}

py::object hash_or_none(const BlockPool& p, int32_t b) {
  if (!p.has_hash(b)) return py::none();
  return py::bytes(reinterpret_cast<const char*>(p.hash(b).b), 32);
}

}  // namespace

int64_t block_id_of(py::handle h) {
  // TypeError for a non-int or one past int64, as pybind11's int64_t argument
  // (and PyBlockPool); never the cast_error (RuntimeError) of h.cast<int64_t>().
  Ref v(PyNumber_Index(h.ptr()));
  int overflow = 0;
  const long long b = PyLong_AsLongLongAndOverflow(v.p, &overflow);
  if (overflow != 0) throw py::type_error("block id must fit in int64");
  if (b == -1 && PyErr_Occurred()) throw py::error_already_set();
  return b;
}

namespace {

// Every id checked before any is used: a bad one changes nothing.
std::vector<int32_t> ids_of(py::iterable ids, const BlockPool& p) {
  std::vector<int32_t> out;
  for (py::handle h : ids) {
    const int64_t b = block_id_of(h);
    p.check(b);
    out.push_back(static_cast<int32_t>(b));
  }
  return out;
}

}  // namespace

void bind_block_pool(py::module_& m) {
  py::class_<BlockPool>(m, "BlockPool",
                        "KV blocks by id: ref counts, LRU free queue, hash -> block "
                        "(twin: enginecore.sched.block_pool.PyBlockPool).")
      .def(py::init<int64_t, bool>(), py::arg("num_blocks"), py::arg("enable_caching"))
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("enable_caching", &BlockPool::enable_caching)
      .def_property_readonly("num_free_blocks", &BlockPool::num_free)
      .def_property_readonly("num_evictions", &BlockPool::num_evictions)
      .def("get_num_free_blocks", &BlockPool::num_free)
      .def("get_usage", [](const BlockPool& p) {
        return 1.0 - static_cast<double>(p.num_free()) / p.num_blocks();
      })
      .def("get_cached_block", [](const BlockPool& p, py::handle h) -> py::object {
        const int32_t b = p.lookup(to_hash(h));
        if (b < 0) return py::none();
        return py::int_(b);
      }, py::arg("block_hash"))
      .def("ref_cnt", [](const BlockPool& p, int64_t b) {
        p.check(b);
        return p.ref_cnt(static_cast<int32_t>(b));
      }, py::arg("block_id"))
      .def("block_hash", [](const BlockPool& p, int64_t b) {
        p.check(b);
        return hash_or_none(p, static_cast<int32_t>(b));
      }, py::arg("block_id"))
      .def("num_cached_blocks", [](const BlockPool& p) { return p.num_cached(); })
      .def("free_block_ids", &BlockPool::free_ids)
      .def("get_new_blocks", [](BlockPool& p, int64_t n) {
        std::vector<int32_t> out;
        p.take(n, out);
        return out;
      }, py::arg("num_blocks"))
      .def("touch", [](BlockPool& p, py::iterable ids) {
        for (int32_t b : ids_of(ids, p)) p.touch(b);
      }, py::arg("block_ids"))
      .def("free_blocks", [](BlockPool& p, py::iterable ids) {
        for (int32_t b : ids_of(ids, p)) p.release(b);
      }, py::arg("ordered_block_ids"))
      .def("cache_full_blocks", [](BlockPool& p, py::sequence ids, py::sequence hashes,
                                   int64_t start, int64_t end) {
        if (start < 0 || end > static_cast<int64_t>(ids.size()) ||
            end > static_cast<int64_t>(hashes.size())) {
          throw py::index_error("blocks [" + std::to_string(start) + ", " +
                                std::to_string(end) + ") out of range");
        }
        for (int64_t i = start; i < end; ++i) {
          const int64_t b = block_id_of(ids[i]);
          p.check(b);
          if (p.has_hash(static_cast<int32_t>(b))) continue;
          p.cache(static_cast<int32_t>(b), to_hash(hashes[i]));
        }
      }, py::arg("block_ids"), py::arg("block_hashes"), py::arg("start"), py::arg("end"))
      .def("uncache", [](BlockPool& p, py::iterable ids) {
        for (int32_t b : ids_of(ids, p)) p.uncache(b);
      }, py::arg("block_ids"))
      .def("reset_prefix_cache", &BlockPool::reset);
}

}  // namespace enginecore
