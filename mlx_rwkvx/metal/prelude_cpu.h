// Kernel vocabulary, CPU C++ flavour: every GPU thread is a std::thread, a threadgroup barrier is
// a std::barrier, and threadgroup memory is one arena per group. The harness (kernel_cpu.h)
// sets the thread-local ids and arena before it calls the entry body on each thread.
#pragma once
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kcpu {
struct Group {
    std::barrier<>* barrier;
    unsigned char* arena;
};
inline thread_local const Group* group = nullptr;
inline thread_local unsigned tid_x = 0, gid_x = 0, gid_y = 0;
inline thread_local std::size_t arena_used = 0;

// Each thread makes the same sequence of requests, so each gets the group's same region.
template <typename T>
T* shared_alloc(std::size_t n) {
    std::size_t offset = (arena_used + alignof(T) - 1) / alignof(T) * alignof(T);
    arena_used = offset + n * sizeof(T);
    return reinterpret_cast<T*>(group->arena + offset);
}
}  // namespace kcpu

#define KFN inline
#define GMEM
#define SMEM
#define SHARED_ARRAY(type, name, n) type* name = kcpu::shared_alloc<type>(n)
#define BARRIER() kcpu::group->barrier->arrive_and_wait()
#define TID_X (kcpu::tid_x)
#define GID_X (kcpu::gid_x)
#define GID_Y (kcpu::gid_y)
#define FEXP(x) std::exp(x)
#define TO_F32(x) static_cast<float>(x)
