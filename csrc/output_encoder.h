// msgpack of one client's step outputs from columns (output_encoder.cpp).
#pragma once
#include <pybind11/pybind11.h>

#include <string>

namespace enginecore {

// The EngineCoreOutputs msgpack into `out` (its capacity is kept for reuse);
// holds the GIL: it reads the Python lists.
void write_columnar(std::string& out, long long engine_index, pybind11::list request_ids,
                    pybind11::list new_token_ids, pybind11::list specials,
                    pybind11::object stats_raw, double timestamp);

}  // namespace enginecore
