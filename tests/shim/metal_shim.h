// Enough of the Metal Shading Language, as C++, to run kernel bodies written for
// mx.fast.metal_kernel on the CPU (tests/gpu_emulation.py generates the signature the way MLX
// does and calls it for every thread; tests/shim/lockstep.h runs the threads).
//
// Address spaces vanish, except `threadgroup`, which makes a declaration a function-local
// static: one copy shared by every thread of the (one) running threadgroup. So kernels declare
// threadgroup arrays, never threadgroup-qualified pointers (a static pointer would be
// initialised once, by the first thread).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "halfs.h"
#include "lockstep.h"

#define device
#define thread
#define constant
#define threadgroup static
#define kernel
#define METAL_FUNC inline

using uint = unsigned int;
struct uint3 {
  uint x, y, z;
};
using half = halfs::Half;
using float16_t = halfs::Half;
using bfloat16_t = halfs::BFloat;

enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };

inline void threadgroup_barrier(mem_flags) { lockstep::barrier(); }
inline void simdgroup_barrier(mem_flags) { lockstep::collective<int>(lockstep::no_data, 0); }

template <typename T>
T simd_sum(T x) {
  return lockstep::collective<T>(lockstep::reduce<T, lockstep::Sum>, x);
}
template <typename T>
T simd_max(T x) {
  return lockstep::collective<T>(lockstep::reduce<T, lockstep::Max>, x);
}
template <typename T>
T simd_min(T x) {
  return lockstep::collective<T>(lockstep::reduce<T, lockstep::Min>, x);
}
template <typename T>
T simd_shuffle(T x, uint lane) {
  return lockstep::collective<T>(lockstep::shuffle<T>, x, long(lane));
}
template <typename T>
T simd_broadcast(T x, uint lane) {
  return simd_shuffle(x, lane);
}
template <typename T>
T simd_shuffle_xor(T x, uint mask) {
  return lockstep::collective<T>(lockstep::shuffle_xor<T>, x, long(mask));
}
template <typename T>
T simd_shuffle_down(T x, uint delta) {
  return lockstep::collective<T>(lockstep::shuffle_down<T>, x, long(delta));
}
template <typename T>
T simd_shuffle_up(T x, uint delta) {
  return lockstep::collective<T>(lockstep::shuffle_up<T>, x, long(delta));
}

namespace metal {
inline float exp(float x) { return std::exp(x); }  // MLX's default "safe" math: exp(-inf) == 0
inline float log(float x) { return std::log(x); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline int max(int a, int b) { return a < b ? b : a; }
inline int min(int a, int b) { return a < b ? a : b; }
namespace fast {
inline float exp(float x) { return std::exp(x); }
}  // namespace fast
}  // namespace metal

// The attribute variables mx.fast.metal_kernel passes when the body names them.
namespace metal_attributes {
inline uint3 u3(lockstep::Dim3 d) { return {d.x, d.y, d.z}; }
inline uint thread_index_in_simdgroup(const lockstep::Lane& l) { return l.simd_lane; }
inline uint simdgroup_index_in_threadgroup(const lockstep::Lane& l) { return l.simdgroup; }
inline uint thread_index_in_threadgroup(const lockstep::Lane& l) { return l.index; }
inline uint3 thread_position_in_threadgroup(const lockstep::Lane& l) { return u3(l.position); }
inline uint3 threadgroup_position_in_grid(const lockstep::Lane&) {
  return u3(lockstep::active()->group);
}
inline uint3 thread_position_in_grid(const lockstep::Lane& l) {
  const lockstep::Launch& a = *lockstep::active();
  return {a.group.x * a.group_size.x + l.position.x, a.group.y * a.group_size.y + l.position.y,
          a.group.z * a.group_size.z + l.position.z};
}
inline uint3 threads_per_threadgroup(const lockstep::Lane&) {
  return u3(lockstep::active()->group_size);
}
inline uint3 threadgroups_per_grid(const lockstep::Lane&) { return u3(lockstep::active()->groups); }
inline uint3 threads_per_grid(const lockstep::Lane&) {
  const lockstep::Launch& a = *lockstep::active();
  return {a.groups.x * a.group_size.x, a.groups.y * a.group_size.y, a.groups.z * a.group_size.z};
}
inline uint simdgroups_per_threadgroup(const lockstep::Lane&) {
  return (lockstep::active()->group_size.count() + lockstep::kSimdWidth - 1) /
         lockstep::kSimdWidth;
}
inline uint threads_per_simdgroup(const lockstep::Lane&) { return lockstep::kSimdWidth; }
inline uint thread_execution_width(const lockstep::Lane&) { return lockstep::kSimdWidth; }
}  // namespace metal_attributes
