// Just enough of the Metal Shading Language, declared as C++, to type-check kernel bodies
// with g++ -fsyntax-only. It proves nothing about running on a GPU.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#define device
#define thread
#define threadgroup
#define constant
#define kernel
#define MSL_ATTR(x)

using uint = unsigned int;
struct uint3 { uint x, y, z; };

struct half {
  half() = default;
  half(float) {}
  operator float() const { return 0.0f; }
};
struct bfloat16_t {
  bfloat16_t() = default;
  bfloat16_t(float) {}
  operator float() const { return 0.0f; }
};

float simd_sum(float);

namespace metal {
float exp(float);
float max(float, float);
}  // namespace metal
