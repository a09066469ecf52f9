// The process around one emulated kernel launch: read the launch description, give every
// buffer guard pages, run the kernel's threadgroups, write the outputs back.
//
// Launch file (whitespace separated, written by tests/gpu_emulation.py):
//   groups gx gy gz
//   group_size tx ty tz
//   in  <path> <bytes> <ndim> <shape...> <strides in elements...>
//   out <path> <bytes> <ndim> <shape...> <strides in elements...>
// Each buffer ends right at a page the process may not touch and starts after another, so a
// kernel that reads or writes past a buffer dies with SIGSEGV instead of reading a neighbour.
// Outputs start as all-ones bytes (NaN for floats), so elements a kernel never writes show.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "lockstep.h"

namespace driver {

struct Buffer {
  bool output = false;
  std::string path;
  size_t bytes = 0;
  std::vector<int32_t> shape;
  std::vector<int64_t> strides;
  void* data = nullptr;
};

inline void* guarded_alloc(size_t bytes) {
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  size_t body = (bytes + 7) / 8 * 8;
  size_t span = (body + page - 1) / page * page;
  char* base = static_cast<char*>(
      mmap(nullptr, span + 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) lockstep::fail("mmap failed");
  mprotect(base, page, PROT_NONE);
  mprotect(base + page + span, page, PROT_NONE);
  return base + page + span - body;
}

struct File {
  FILE* f;
  File(const std::string& path, const char* how) : f(std::fopen(path.c_str(), how)) {
    if (!f) lockstep::fail("cannot open " + path);
  }
  ~File() { std::fclose(f); }
};

inline std::vector<Buffer> read_launch(const char* path, lockstep::Dim3& groups,
                                       lockstep::Dim3& group_size) {
  File launch(path, "r");
  char key[32], file[4096];
  std::vector<Buffer> buffers;
  while (std::fscanf(launch.f, "%31s", key) == 1) {
    std::string k = key;
    if (k == "groups") {
      std::fscanf(launch.f, "%u %u %u", &groups.x, &groups.y, &groups.z);
    } else if (k == "group_size") {
      std::fscanf(launch.f, "%u %u %u", &group_size.x, &group_size.y, &group_size.z);
    } else if (k == "in" || k == "out") {
      Buffer b;
      b.output = k == "out";
      int ndim = 0;
      if (std::fscanf(launch.f, "%4095s %zu %d", file, &b.bytes, &ndim) != 3)
        lockstep::fail("bad buffer line");
      b.path = file;
      b.shape.resize(ndim);
      b.strides.resize(ndim);
      for (auto& s : b.shape) std::fscanf(launch.f, "%d", &s);
      for (auto& s : b.strides) std::fscanf(launch.f, "%ld", &s);
      buffers.push_back(b);
    } else {
      lockstep::fail("unknown launch key " + k);
    }
  }
  for (Buffer& b : buffers) {
    b.data = guarded_alloc(b.bytes);
    if (b.output) {
      std::memset(b.data, 0xff, b.bytes);
    } else {
      File in(b.path, "rb");
      if (std::fread(b.data, 1, b.bytes, in.f) != b.bytes) lockstep::fail("short read " + b.path);
    }
  }
  return buffers;
}

inline void write_outputs(const std::vector<Buffer>& buffers) {
  for (const Buffer& b : buffers) {
    if (!b.output) continue;
    File out(b.path, "wb");
    if (std::fwrite(b.data, 1, b.bytes, out.f) != b.bytes) lockstep::fail("short write " + b.path);
  }
}

}  // namespace driver

// Defined by the generated translation unit: calls the kernel for every thread.
void launch_kernel(std::vector<driver::Buffer>& buffers, lockstep::Dim3 groups,
                   lockstep::Dim3 group_size);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s LAUNCH_FILE\n", argv[0]);
    return 2;
  }
  try {
    lockstep::Dim3 groups, group_size;
    std::vector<driver::Buffer> buffers = driver::read_launch(argv[1], groups, group_size);
    launch_kernel(buffers, groups, group_size);
    driver::write_outputs(buffers);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "emulated kernel failed: %s\n", e.what());
    return 3;
  }
  return 0;
}
