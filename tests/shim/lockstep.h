// Lockstep GPU threads on one CPU thread, so GPU kernel bodies run here as written.
//
// Every thread of a threadgroup (CUDA: block) is a fiber with its own stack. A fiber runs until
// it reaches a collective: a SIMD-group operation (simd_sum, __shfl_xor_sync, ...) or a
// threadgroup barrier. There it parks. When every lane of its SIMD group has parked in the same
// collective, the collective is computed from all lanes' inputs and the lanes go on; a barrier
// releases when every thread of the threadgroup waits at it. Lanes that diverge around a
// collective (some lanes finished or waiting elsewhere) are an error, not a silent result.
// Threadgroups run one after another; threadgroup memory is shared by the fibers of the one
// running. Fibers start through ucontext and switch with _setjmp/_longjmp (no signal-mask
// system call per switch, which is what makes millions of collectives affordable).
#pragma once
#include <setjmp.h>
#include <ucontext.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace lockstep {

constexpr unsigned kSimdWidth = 32;

struct Lane;
// Computes a collective for the n lanes of one SIMD group (called outside every fiber).
using Resolve = void (*)(Lane* const* lanes, unsigned n);

enum class State { Ready, Simd, Barrier, Done };

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
  unsigned count() const { return x * y * z; }
};

struct Lane {
  unsigned index = 0;     // linear index in the threadgroup
  unsigned simd_lane = 0;  // index in its SIMD group
  unsigned simdgroup = 0;  // SIMD group index in the threadgroup
  Dim3 position;           // thread position in the threadgroup
  State state = State::Ready;
  bool started = false;
  Resolve resolve = nullptr;  // the collective this lane is parked in
  long arg = 0;               // shuffle lane / delta / mask
  alignas(16) unsigned char in[16];
  alignas(16) unsigned char out[16];
  ucontext_t start;
  jmp_buf resume_point;
  std::vector<char> stack;
};

struct Launch {
  Dim3 groups;      // threadgroups per grid
  Dim3 group_size;  // threads per threadgroup
  Dim3 group;       // the running threadgroup
  void (*body)(void* context, const Lane& lane) = nullptr;  // runs the kernel for one thread
  void* context = nullptr;
  std::vector<Lane> lanes;
  Lane* current = nullptr;
  jmp_buf scheduler;
};

inline Launch*& active() {
  static Launch* launch = nullptr;
  return launch;
}

inline Lane& current_lane() { return *active()->current; }

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error(what); }

// --- inside a fiber ---------------------------------------------------------------------

inline void park(Lane* lane) {
  if (_setjmp(lane->resume_point) == 0) {
    _longjmp(active()->scheduler, 1);
  }
}

inline void fiber_main() {
  Launch* launch = active();
  Lane* lane = launch->current;
  launch->body(launch->context, *lane);
  lane->state = State::Done;
  _longjmp(launch->scheduler, 1);
}

// Parks the calling lane in a collective over its SIMD group; returns the lane's result.
template <typename T>
T collective(Resolve resolve, T value, long arg = 0) {
  static_assert(sizeof(T) <= 16, "collective values are at most 16 bytes");
  Lane* lane = active()->current;
  std::memcpy(lane->in, &value, sizeof(T));
  lane->arg = arg;
  lane->resolve = resolve;
  lane->state = State::Simd;
  park(lane);
  T result;
  std::memcpy(&result, lane->out, sizeof(T));
  return result;
}

inline void barrier() {
  Lane* lane = active()->current;
  lane->state = State::Barrier;
  park(lane);
}

// --- collectives (run by the scheduler over one SIMD group) ------------------------------

template <typename T>
T input(const Lane* lane) {
  T v;
  std::memcpy(&v, lane->in, sizeof(T));
  return v;
}

template <typename T>
void output(Lane* lane, T v) {
  std::memcpy(lane->out, &v, sizeof(T));
}

template <typename T, typename Op>
void reduce(Lane* const* lanes, unsigned n) {
  T acc = input<T>(lanes[0]);
  for (unsigned i = 1; i < n; i++) acc = Op{}(acc, input<T>(lanes[i]));
  for (unsigned i = 0; i < n; i++) output(lanes[i], acc);
}

struct Sum {
  template <typename T> T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <typename T> T operator()(T a, T b) const { return a < b ? b : a; }
};
struct Min {
  template <typename T> T operator()(T a, T b) const { return b < a ? b : a; }
};

inline unsigned source_lane(long src, unsigned n) {
  if (src < 0 || src >= long(n)) fail("shuffle reads lane " + std::to_string(src) + " of a " +
                                      std::to_string(n) + "-lane SIMD group");
  return unsigned(src);
}

template <typename T>
void shuffle(Lane* const* lanes, unsigned n) {  // lane i reads lane arg_i
  for (unsigned i = 0; i < n; i++) output(lanes[i], input<T>(lanes[source_lane(lanes[i]->arg, n)]));
}

template <typename T>
void shuffle_xor(Lane* const* lanes, unsigned n) {
  for (unsigned i = 0; i < n; i++)
    output(lanes[i], input<T>(lanes[source_lane(long(i ^ unsigned(lanes[i]->arg)), n)]));
}

template <typename T>
void shuffle_down(Lane* const* lanes, unsigned n) {  // lanes past the end keep their value
  for (unsigned i = 0; i < n; i++) {
    long src = long(i) + lanes[i]->arg;
    output(lanes[i], input<T>(lanes[src < long(n) ? src : i]));
  }
}

template <typename T>
void shuffle_up(Lane* const* lanes, unsigned n) {  // lanes before the start keep their value
  for (unsigned i = 0; i < n; i++) {
    long src = long(i) - lanes[i]->arg;
    output(lanes[i], input<T>(lanes[src >= 0 ? src : i]));
  }
}

inline void no_data(Lane* const*, unsigned) {}  // simdgroup_barrier / __syncwarp

// --- the scheduler -------------------------------------------------------------------------

inline void resume(Launch* launch, Lane* lane) {
  launch->current = lane;
  if (_setjmp(launch->scheduler) == 0) {
    if (!lane->started) {
      lane->started = true;
      ucontext_t from;
      swapcontext(&from, &lane->start);
    } else {
      _longjmp(lane->resume_point, 1);
    }
  }
}

inline std::string where(const Launch& launch) {
  return "threadgroup (" + std::to_string(launch.group.x) + ", " + std::to_string(launch.group.y) +
         ", " + std::to_string(launch.group.z) + ")";
}

// Resolves every SIMD group whose lanes all wait in one collective; true if any did.
inline bool resolve_simdgroups(Launch& launch) {
  bool any = false;
  std::vector<Lane*> group;
  for (unsigned first = 0; first < launch.lanes.size(); first += kSimdWidth) {
    group.clear();
    unsigned waiting = 0;
    for (unsigned i = first; i < launch.lanes.size() && i < first + kSimdWidth; i++) {
      group.push_back(&launch.lanes[i]);
      waiting += launch.lanes[i].state == State::Simd;
    }
    if (waiting == 0) continue;
    if (waiting != group.size())
      fail(where(launch) + ", SIMD group " + std::to_string(first / kSimdWidth) + ": " +
           std::to_string(waiting) + " of " + std::to_string(group.size()) +
           " lanes wait in a SIMD collective, the others finished or wait at a barrier");
    for (Lane* lane : group)
      if (lane->resolve != group[0]->resolve)
        fail(where(launch) + ": lanes of one SIMD group wait in different collectives");
    group[0]->resolve(group.data(), unsigned(group.size()));
    for (Lane* lane : group) lane->state = State::Ready;
    any = true;
  }
  return any;
}

inline void run_threadgroup(Launch& launch) {
  for (Lane& lane : launch.lanes) {
    lane.state = State::Ready;
    lane.started = false;
    getcontext(&lane.start);
    lane.start.uc_stack.ss_sp = lane.stack.data();
    lane.start.uc_stack.ss_size = lane.stack.size();
    lane.start.uc_link = nullptr;
    makecontext(&lane.start, fiber_main, 0);
  }
  for (;;) {
    for (Lane& lane : launch.lanes)
      if (lane.state == State::Ready) resume(&launch, &lane);
    if (resolve_simdgroups(launch)) continue;
    unsigned at_barrier = 0, done = 0;
    for (const Lane& lane : launch.lanes) {
      at_barrier += lane.state == State::Barrier;
      done += lane.state == State::Done;
    }
    if (done == launch.lanes.size()) return;
    if (done > 0)
      fail(where(launch) + ": " + std::to_string(at_barrier) + " threads wait at a barrier that " +
           std::to_string(done) + " finished threads never reach");
    for (Lane& lane : launch.lanes) lane.state = State::Ready;
  }
}

// Runs body(lane) once per thread of every threadgroup, in lockstep within each threadgroup.
template <typename Body>
void run(Dim3 groups, Dim3 group_size, Body& body, size_t stack_bytes = 64 * 1024) {
  Launch launch;
  launch.groups = groups;
  launch.group_size = group_size;
  launch.body = [](void* context, const Lane& lane) { (*static_cast<Body*>(context))(lane); };
  launch.context = &body;
  launch.lanes.resize(group_size.count());
  for (unsigned i = 0; i < launch.lanes.size(); i++) {
    Lane& lane = launch.lanes[i];
    lane.index = i;
    lane.simd_lane = i % kSimdWidth;
    lane.simdgroup = i / kSimdWidth;
    lane.position = {i % group_size.x, (i / group_size.x) % group_size.y,
                     i / (group_size.x * group_size.y)};
    lane.stack.resize(stack_bytes);
  }
  active() = &launch;
  for (unsigned z = 0; z < groups.z; z++)
    for (unsigned y = 0; y < groups.y; y++)
      for (unsigned x = 0; x < groups.x; x++) {
        launch.group = {x, y, z};
        run_threadgroup(launch);
      }
  active() = nullptr;
}

}  // namespace lockstep
