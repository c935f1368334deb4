// A FIFO queue of Python objects whose blocking get waits with the GIL released;
// the twin of python/enginecore/blocking_queue.py. The engine's input and output
// queues and its batch queue use it.
#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>

namespace py = pybind11;

namespace enginecore {
namespace {

class BlockingQueue {
 public:
  explicit BlockingQueue(size_t maxsize) : maxsize_(maxsize) {}

  // Called with the GIL held: py::object refcounts change only under the GIL.
  void put(py::object item) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (maxsize_ && items_.size() >= maxsize_) throw_full();
      items_.push_back(std::move(item));
    }
    cv_.notify_one();
  }

  py::object get_nowait() {
    py::object item;
    if (!try_pop(item)) throw_empty();
    return item;
  }

  // Blocks (GIL released) until an item arrives or `timeout` seconds pass
  // (None: forever). Wakes every 100 ms to let Python signal handlers run.
  py::object get(py::object timeout) {
    const bool forever = timeout.is_none();
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(forever ? 0.0 : timeout.cast<double>()));
    while (true) {
      // Fast path: an item is there; keep the GIL (giving it up costs a switch).
      py::object item;
      if (try_pop(item)) return item;
      bool ready;
      {
        py::gil_scoped_release nogil;
        std::unique_lock<std::mutex> lk(mu_);
        auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
        if (!forever && deadline < until) until = deadline;
        ready = cv_.wait_until(lk, until, [this] { return !items_.empty(); });
      }
      if (ready && try_pop(item)) return item;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (!forever && std::chrono::steady_clock::now() >= deadline) throw_empty();
    }
  }

  py::object peek() {
    std::lock_guard<std::mutex> lk(mu_);
    if (items_.empty()) throw_empty();
    return items_.front();
  }

  size_t size() {
    std::lock_guard<std::mutex> lk(mu_);
    return items_.size();
  }

  size_t maxsize() const { return maxsize_; }

 private:
  // Pops the oldest item into `out`; the GIL must be held (refcounts change).
  bool try_pop(py::object& out) {
    std::lock_guard<std::mutex> lk(mu_);
    if (items_.empty()) return false;
    out = std::move(items_.front());
    items_.pop_front();
    return true;
  }

  [[noreturn]] static void throw_empty() {
    PyErr_SetNone(py::module_::import("queue").attr("Empty").ptr());
    throw py::error_already_set();
  }
  [[noreturn]] static void throw_full() {
    PyErr_SetNone(py::module_::import("queue").attr("Full").ptr());
    throw py::error_already_set();
  }

  size_t maxsize_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<py::object> items_;
};

}  // namespace

void bind_blocking_queue(py::module_& m) {
  py::class_<BlockingQueue>(m, "BlockingQueue")
      .def(py::init<size_t>(), py::arg("maxsize") = 0)
      .def("put", &BlockingQueue::put, py::arg("item"))
      .def("put_nowait", &BlockingQueue::put, py::arg("item"))
      .def("get", &BlockingQueue::get, py::arg("timeout") = py::none())
      .def("get_nowait", &BlockingQueue::get_nowait)
      .def("peek", &BlockingQueue::peek)
      .def("qsize", &BlockingQueue::size)
      .def("empty", [](BlockingQueue& q) { return q.size() == 0; })
      .def("__len__", &BlockingQueue::size)
      .def("__bool__", [](BlockingQueue& q) { return q.size() != 0; })
      .def_property_readonly("maxsize", &BlockingQueue::maxsize);
}

}  // namespace enginecore
