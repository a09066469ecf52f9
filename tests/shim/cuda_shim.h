// Enough of CUDA, as C++, to run kernel bodies written for mx.fast.cuda_kernel on the CPU
// (tests/gpu_emulation.py generates the signature the way MLX does; tests/shim/lockstep.h runs
// a block's threads as fibers, a warp being one SIMD group of 32 lanes).
//
// `__shared__` makes a declaration a function-local static: one copy shared by the threads of
// the (one) running block.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "halfs.h"
#include "lockstep.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define __grid_constant__

using __half = halfs::Half;
using __nv_bfloat16 = halfs::BFloat;

// mx.fast.cuda_kernel passes shapes and strides by value as fixed-size arrays.
constexpr int MAX_NDIM = 10;
struct Shape {
  int32_t v[MAX_NDIM];
  int32_t operator[](int i) const { return v[i]; }
};
struct Strides {
  int64_t v[MAX_NDIM];
  int64_t operator[](int i) const { return v[i]; }
};

namespace cuda_emulation {
struct Index {
  unsigned x, y, z;
};
inline Index of(lockstep::Dim3 d) { return {d.x, d.y, d.z}; }
inline Index thread_idx() {
  lockstep::Dim3 p = lockstep::current_lane().position;
  return {p.x, p.y, p.z};
}
inline void check_full_warp(unsigned mask, int width = 32) {
  if (mask != 0xffffffffu) lockstep::fail("emulator supports full-warp masks only");
  if (width != 32) lockstep::fail("emulator supports width 32 shuffles only");
}
}  // namespace cuda_emulation

#define threadIdx (cuda_emulation::thread_idx())
#define blockIdx (cuda_emulation::of(lockstep::active()->group))
#define blockDim (cuda_emulation::of(lockstep::active()->group_size))
#define gridDim (cuda_emulation::of(lockstep::active()->groups))
constexpr int warpSize = 32;

inline void __syncthreads() { lockstep::barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_emulation::check_full_warp(mask);
  lockstep::collective<int>(lockstep::no_data, 0);
}

template <typename T>
T __shfl_sync(unsigned mask, T x, int lane, int width = 32) {
  cuda_emulation::check_full_warp(mask, width);
  return lockstep::collective<T>(lockstep::shuffle<T>, x, long(lane));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T x, int lane_mask, int width = 32) {
  cuda_emulation::check_full_warp(mask, width);
  return lockstep::collective<T>(lockstep::shuffle_xor<T>, x, long(lane_mask));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T x, unsigned delta, int width = 32) {
  cuda_emulation::check_full_warp(mask, width);
  return lockstep::collective<T>(lockstep::shuffle_down<T>, x, long(delta));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T x, unsigned delta, int width = 32) {
  cuda_emulation::check_full_warp(mask, width);
  return lockstep::collective<T>(lockstep::shuffle_up<T>, x, long(delta));
}

inline float __expf(float x) { return std::exp(x); }
inline float __half2float(__half h) { return float(h); }
inline __half __float2half(float f) { return __half(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
