// 16-bit floats for emulated kernels: IEEE half and bfloat16 stored as bits, converted to and
// from float with round-to-nearest-even (what GPUs do for float -> half / bfloat16 casts).
// Arithmetic goes through float, which is what the tree-attention kernels do anyway.
#pragma once
#include <cstdint>
#include <cstring>

namespace halfs {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t x = bits_of(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t exp = (x >> 23) & 0xffu;
  uint32_t mant = x & 0x7fffffu;
  if (exp == 0xffu) return uint16_t(sign | 0x7c00u | (mant ? 0x200u : 0u));  // inf / nan
  int e = int(exp) - 127 + 15;
  if (e >= 31) return uint16_t(sign | 0x7c00u);  // overflow to inf
  if (e <= 0) {                                  // subnormal half (or zero)
    if (e < -10) return uint16_t(sign);
    mant |= 0x800000u;
    int shift = 14 - e;
    uint32_t half_mant = mant >> shift;
    uint32_t rest = mant & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half_mant & 1u))) half_mant++;
    return uint16_t(sign | half_mant);
  }
  uint32_t h = sign | (uint32_t(e) << 10) | (mant >> 13);
  uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;  // may carry into the exponent
  return uint16_t(h);
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return float_of(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    float v = float(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
    return sign ? -v : v;
  }
  return float_of(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

inline uint16_t float_to_bfloat(float f) {
  uint32_t x = bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

inline float bfloat_to_float(uint16_t b) { return float_of(uint32_t(b) << 16); }

struct Half {
  uint16_t bits = 0;
  Half() = default;
  Half(float f) : bits(float_to_half(f)) {}
  operator float() const { return half_to_float(bits); }
};

struct BFloat {
  uint16_t bits = 0;
  BFloat() = default;
  BFloat(float f) : bits(float_to_bfloat(f)) {}
  operator float() const { return bfloat_to_float(bits); }
};

}  // namespace halfs
