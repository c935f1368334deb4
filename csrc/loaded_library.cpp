// dl_iterate_phdr walks the objects already mapped; dlopen(RTLD_NOLOAD) then
// hands back a handle to that same copy, or nothing (it never loads one).
#include "loaded_library.h"

#include <cstring>

#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#endif

namespace enginecore {
namespace {

#if defined(__linux__)
struct Search {
  const char* part;
  std::string found;
};

int match(struct dl_phdr_info* info, size_t, void* data) {
  auto* s = static_cast<Search*>(data);
  const char* name = info->dlpi_name;
  if (name != nullptr && std::strstr(name, s->part) != nullptr) {
    s->found.assign(name);
    return 1;
  }
  return 0;
}
#endif

}  // namespace

void* find_loaded_library(const char* name_part, std::string* path) {
#if defined(__linux__)
  Search s{name_part, {}};
  dl_iterate_phdr(match, &s);
  if (s.found.empty()) return nullptr;
  void* handle = dlopen(s.found.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle != nullptr && path != nullptr) *path = s.found;
  return handle;
#else
  (void)name_part;
  (void)path;
  return nullptr;
#endif
}

}  // namespace enginecore
