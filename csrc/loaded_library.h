// Finding a shared library the process has already loaded (pyzmq's libzmq,
// torch's libgomp) without ever loading a second copy.
#pragma once

#include <string>

namespace enginecore {

// A handle (dlopen with RTLD_NOLOAD) of the first loaded object whose path
// contains `name_part`, or nullptr; `path` gets its path. Linux only.
void* find_loaded_library(const char* name_part, std::string* path);

}  // namespace enginecore
