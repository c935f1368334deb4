// Sending on pyzmq's own sockets without the GIL: the output thread's per-step
// send. pyzmq bundles libzmq; this file finds that copy among the libraries
// already loaded (dl_iterate_phdr, then dlopen with RTLD_NOLOAD, which never
// loads a second one) and calls its zmq_send on the socket handle pyzmq
// exposes as Socket.underlying. No libzmq found: unavailable, and Python sends
// through pyzmq as before.
#include <pybind11/pybind11.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <dlfcn.h>
#endif

#include "loaded_library.h"
#include "output_encoder.h"

namespace py = pybind11;

namespace enginecore {
namespace {

struct LibZmq {
  int (*send)(void*, const void*, size_t, int) = nullptr;
  int (*errno_fn)() = nullptr;
  const char* (*strerror_fn)(int) = nullptr;
  std::string path;
};

LibZmq find_libzmq() {
  LibZmq z;
#if defined(__linux__)
  std::string path;
  void* handle = find_loaded_library("libzmq", &path);
  if (handle == nullptr) return z;
  z.send = reinterpret_cast<int (*)(void*, const void*, size_t, int)>(dlsym(handle, "zmq_send"));
  z.errno_fn = reinterpret_cast<int (*)()>(dlsym(handle, "zmq_errno"));
  z.strerror_fn = reinterpret_cast<const char* (*)(int)>(dlsym(handle, "zmq_strerror"));
  if (z.send == nullptr || z.errno_fn == nullptr || z.strerror_fn == nullptr) return LibZmq{};
  z.path = path;
#endif
  return z;
}

// Found once, looked for again until then (zmq may be imported later).
// Called with the GIL held, which guards the static.
const LibZmq& libzmq() {
  static LibZmq lib;
  if (lib.send == nullptr) lib = find_libzmq();
  return lib;
}

// The loaded libzmq's path, or None (checked when the output thread starts).
py::object libzmq_path() {
  const LibZmq& z = libzmq();
  if (z.send == nullptr) return py::none();
  return py::str(z.path);
}

// One message: zmq_send copies it into its own message, so `out` is free for
// the next step as soon as this returns. Blocks (without the GIL) while the
// socket is at its high-water mark, like pyzmq's blocking send.
void send_message(uintptr_t socket, const std::string& out) {
  const LibZmq& z = libzmq();
  if (z.send == nullptr) throw std::runtime_error("libzmq is not loaded (import zmq first)");
  int rc, err = 0;
  {
    py::gil_scoped_release release;
    do {
      rc = z.send(reinterpret_cast<void*>(socket), out.data(), out.size(), 0);
      err = rc < 0 ? z.errno_fn() : 0;
    } while (rc < 0 && err == EINTR);
  }
  if (rc < 0) throw std::runtime_error(std::string("zmq_send: ") + z.strerror_fn(err));
}

// Encode one client's columns (with the GIL) into a buffer reused across
// steps, then send it (without). A message over `max_size` bytes is not sent
// (false): the peer would drop the connection (ZMQ_MAXMSGSIZE), and the caller
// splits it instead.
bool send_columnar(uintptr_t socket, long long engine_index, py::list request_ids,
                   py::list new_token_ids, py::list specials, py::object stats_raw,
                   double timestamp, long long max_size) {
  thread_local std::string out;
  write_columnar(out, engine_index, request_ids, new_token_ids, specials, stats_raw, timestamp);
  if (max_size >= 0 && out.size() > static_cast<size_t>(max_size)) return false;
  send_message(socket, out);
  return true;
}

}  // namespace

void bind_zmq_send(py::module_& m) {
  m.def("libzmq_path", &libzmq_path,
        "Path of the libzmq pyzmq loaded (the one send_columnar uses), or None.");
  m.def("send_columnar", &send_columnar, py::arg("socket"), py::arg("engine_index"),
        py::arg("request_ids"), py::arg("new_token_ids"), py::arg("specials"),
        py::arg("stats_raw"), py::arg("timestamp"), py::arg("max_size") = -1,
        "Encode one client's step outputs from columns and send them on the zmq socket "
        "whose handle is `socket` (pyzmq's Socket.underlying), without the GIL; False "
        "(nothing sent) when the message would pass max_size bytes.");
}

}  // namespace enginecore
