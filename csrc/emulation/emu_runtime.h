// emu_runtime.h: a tiny CUDA execution emulator for checking csrc/ops/*/cuda/ without a GPU.
//
// Developer tool only (see build.py beside this file); never part of the extension. It runs the
// kernels of csrc/ops/*/cuda/*.cu, compiled as plain C++, with CUDA's execution semantics where
// they matter to those kernels:
//   * blocks run one after another; the threads of a block are fibers (ucontext) scheduled round
//     robin, so __syncthreads is a real block barrier (threads that have returned count as arrived);
//   * __shfl_xor_sync(mask, v, off, width) exchanges values among the lanes named in `mask` of one
//     warp (32 consecutive linear thread ids) and waits for exactly those lanes, so a wrong mask
//     deadlocks here (reported and aborted) as it would hang or misbehave on a GPU;
//   * dynamic shared memory (the launch's byte count) and static __shared__ arrays are per block
//     and filled with a NaN-ish garbage byte pattern, so reads of unwritten memory show up.
// Threads, blocks and grids are 1-D in x and 2-D in (x, y) blocks, which is all the kernels use.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <map>
#include <memory>
#include <utility>
#include <vector>

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace emu {

struct MaskBarrier {
  int count = 0;
  unsigned gen = 0;
};

struct Thread {
  dim3 idx;
  ucontext_t ctx;
  bool done = false;
};

struct Block {
  dim3 idx, dim, grid;
  std::vector<Thread> threads;
  std::vector<unsigned char> smem;                      // dynamic shared memory
  std::map<const void*, std::vector<unsigned char>> statics;  // static __shared__ arrays by call site
  int live = 0;
  int bar_count = 0;
  unsigned bar_gen = 0;
  std::map<std::pair<int, unsigned>, MaskBarrier> mask_bars;
  std::vector<std::vector<uint64_t>> warp_buf;          // one slot per lane
  std::function<void()> body;
  ucontext_t sched;
  int current = -1;
  bool progressed = false;
};

inline Block*& block_ptr() {
  static Block* b = nullptr;
  return b;
}
inline Block& block() { return *block_ptr(); }
inline Thread& thread() { return block().threads[block().current]; }
inline int linear_tid() { return static_cast<int>(thread().idx.y * block().dim.x + thread().idx.x); }

inline void yield() { swapcontext(&thread().ctx, &block().sched); }

inline void syncthreads() {
  Block& b = block();
  const unsigned gen = b.bar_gen;
  b.progressed = true;
  if (++b.bar_count == b.live) {
    b.bar_count = 0;
    ++b.bar_gen;
    return;
  }
  while (b.bar_gen == gen) yield();
}

inline void mask_barrier(int warp, unsigned mask) {
  Block& b = block();
  MaskBarrier& mb = b.mask_bars[{warp, mask}];
  const unsigned gen = mb.gen;
  b.progressed = true;
  if (++mb.count == __builtin_popcount(mask)) {
    mb.count = 0;
    ++mb.gen;
    return;
  }
  while (mb.gen == gen) yield();
}

template <typename T>
T shfl_xor_sync(unsigned mask, T v, int off, int width) {
  static_assert(sizeof(T) <= sizeof(uint64_t), "emulated shuffles move at most 8 bytes");
  const int t = linear_tid(), warp = t / 32, lane = t % 32;
  if (!(mask & (1u << lane))) {
    std::fprintf(stderr, "emu: lane %d calls __shfl_xor_sync with a mask 0x%08x that excludes it\n", lane, mask);
    std::abort();
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0 || off >= width) {
    std::fprintf(stderr, "emu: bad shuffle width %d / offset %d\n", width, off);
    std::abort();
  }
  auto& buf = block().warp_buf[warp];
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  buf[lane] = bits;
  mask_barrier(warp, mask);
  const int src = (lane & ~(width - 1)) | ((lane & (width - 1)) ^ off);
  if (!(mask & (1u << src))) {
    std::fprintf(stderr, "emu: lane %d reads lane %d, outside the shuffle mask 0x%08x\n", lane, src, mask);
    std::abort();
  }
  T r;
  std::memcpy(&r, &buf[src], sizeof(T));
  mask_barrier(warp, mask);
  return r;
}

template <typename T>
T* static_shared(const void* site, size_t n) {
  auto& v = block().statics[site];
  if (v.empty()) v.assign(n * sizeof(T) + 16, 0xff);
  return reinterpret_cast<T*>(v.data());
}

inline unsigned char* dynamic_shared() { return block().smem.data(); }

inline void trampoline() {
  block().body();
  Block& b = block();
  thread().done = true;
  --b.live;
  b.progressed = true;
  // Threads that return count as arrived at a pending __syncthreads.
  if (b.bar_count > 0 && b.bar_count == b.live) {
    b.bar_count = 0;
    ++b.bar_gen;
  }
  swapcontext(&thread().ctx, &b.sched);
}

struct Launch {
  dim3 grid, blk;
  size_t smem;
  Launch(dim3 g, dim3 b, size_t s = 0, void* /*stream*/ = nullptr) : grid(g), blk(b), smem(s) {}

  template <typename... KArgs, typename... Args>
  void operator()(void (*kernel)(KArgs...), Args&&... args) const {
    const size_t nthreads = static_cast<size_t>(blk.x) * blk.y * blk.z;
    if (nthreads == 0 || nthreads > 1024 || grid.x == 0 || grid.y != 1 || grid.z != 1 || blk.z != 1) {
      std::fprintf(stderr, "emu: invalid launch grid (%u,%u,%u) block (%u,%u,%u)\n", grid.x, grid.y, grid.z, blk.x,
                   blk.y, blk.z);
      std::abort();
    }
    if (smem > 48 * 1024) {
      std::fprintf(stderr, "emu: %zu bytes of dynamic shared memory need an opt-in\n", smem);
      std::abort();
    }
    constexpr size_t kStack = 256 * 1024;
    std::tuple<std::decay_t<KArgs>...> held(std::forward<Args>(args)...);
    std::vector<std::unique_ptr<char[]>> stacks(nthreads);
    for (auto& st : stacks) st.reset(new char[kStack]);
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      Block b;
      b.idx = dim3(bx);
      b.dim = blk;
      b.grid = grid;
      b.smem.assign(smem + 16, 0xff);
      b.warp_buf.assign((nthreads + 31) / 32, std::vector<uint64_t>(32, 0));
      b.body = [&] { std::apply(kernel, held); };
      b.threads.resize(nthreads);
      b.live = static_cast<int>(nthreads);
      block_ptr() = &b;
      for (size_t t = 0; t < nthreads; ++t) {
        Thread& th = b.threads[t];
        th.idx = dim3(static_cast<unsigned>(t % blk.x), static_cast<unsigned>(t / blk.x));
        getcontext(&th.ctx);
        th.ctx.uc_stack.ss_sp = stacks[t].get();
        th.ctx.uc_stack.ss_size = kStack;
        th.ctx.uc_link = nullptr;
        makecontext(&th.ctx, &trampoline, 0);
      }
      while (b.live > 0) {
        b.progressed = false;
        for (size_t t = 0; t < nthreads; ++t) {
          if (b.threads[t].done) continue;
          b.current = static_cast<int>(t);
          swapcontext(&b.sched, &b.threads[t].ctx);
        }
        if (!b.progressed && b.live > 0) {
          std::fprintf(stderr, "emu: deadlock in block %u (%d threads waiting)\n", bx, b.live);
          std::abort();
        }
      }
      block_ptr() = nullptr;
    }
  }
};

}  // namespace emu

// The CUDA built-ins the kernels use.
#define threadIdx (::emu::thread().idx)
#define blockIdx (::emu::block().idx)
#define blockDim (::emu::block().dim)
#define gridDim (::emu::block().grid)
#define __syncthreads() ::emu::syncthreads()
#define __shfl_xor_sync(mask, v, off, width) ::emu::shfl_xor_sync(mask, v, off, width)
