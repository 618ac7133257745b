// LogFMT-10 round trip (DeepEP's low-latency combine format): encode each 128-channel BF16 group and decode it back.
// The format and the exact arithmetic are those of ep_dispatcher/logfmt.py (the reference); see logfmt.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ep {
namespace logfmt {

constexpr int kGroupSize = 128;  // channels sharing one (amax, amin) pair

// out[g * 128 + i] = decode(encode(x[g * 128 + i])) for num_groups groups of BF16 values; out may equal x (in
// place). void pointers: the bindings (compiled by the host compiler) need no CUDA BF16 header.
void roundtrip(const void* x, void* out, int64_t num_groups, cudaStream_t stream);

}  // namespace logfmt
}  // namespace ep
