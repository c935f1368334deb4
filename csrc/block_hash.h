// Chained prefix-cache block hashes (block_hash.cpp), for the other native loops.
#pragma once
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace enginecore {

// Appends to the list `out` the hashes of `num_blocks` full blocks of
// `token_ids` (a list, tuple or uint32 buffer) starting at `first_token`,
// chained from `parent`, with the encoded extra keys `extra`.
void append_block_hashes(pybind11::handle token_ids, size_t first_token, size_t num_blocks,
                         size_t block_size, const uint8_t parent[32], const std::string& extra,
                         pybind11::handle out);

// A parent hash (32 bytes, or None for the root: zeros) as raw bytes.
void parent_bytes(pybind11::handle parent, uint8_t out[32]);

}  // namespace enginecore
