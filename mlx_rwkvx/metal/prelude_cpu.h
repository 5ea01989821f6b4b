// Kernel vocabulary, CPU C++ flavour (C++20): every GPU thread is a std::thread, a threadgroup
// barrier a std::barrier, threadgroup memory one arena per group. kcpu::launch runs a grid; the
// tests compile this with the kernel bodies into a shared library and check them on every CI run.
#ifndef MLX_RWKVX_PRELUDE_CPU_H
#define MLX_RWKVX_PRELUDE_CPU_H
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace kcpu {
// bfloat16 storage: float conversion rounds to nearest even, as Metal and CUDA do.
struct bf16 {
    std::uint16_t bits;
    bf16() = default;
    explicit bf16(float f) {
        std::uint32_t u;
        std::memcpy(&u, &f, 4);
        bits = (u & 0x7fffffffu) > 0x7f800000u
                   ? static_cast<std::uint16_t>((u >> 16) | 0x40u)  // NaN stays NaN
                   : static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    explicit operator float() const {
        std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};
using f16 = _Float16;  // IEEE half; GCC >= 12 and Clang convert with round-to-nearest-even

struct Group {
    std::barrier<>* barrier;
    unsigned char* arena;
};
inline thread_local const Group* group = nullptr;
inline thread_local unsigned tid_x = 0, gid_x = 0, gid_y = 0;
inline thread_local std::size_t arena_used = 0;
// Metal gives a threadgroup 32 KiB; twice that leaves room and still catches runaway requests.
constexpr std::size_t ARENA_BYTES = 64 * 1024;

// Each thread makes the same sequence of requests, so each gets the group's same region.
template <typename T>
T* shared_alloc(std::size_t n) {
    std::size_t offset = (arena_used + alignof(T) - 1) / alignof(T) * alignof(T);
    arena_used = offset + n * sizeof(T);
    if (arena_used > ARENA_BYTES) {
        std::fprintf(stderr, "kcpu: threadgroup memory request of %zu bytes\n", arena_used);
        std::abort();
    }
    return reinterpret_cast<T*>(group->arena + offset);
}

// Runs `body` on `threads` threads for each of `groups` threadgroups along x, one group at a
// time (the kernels' groups are independent, and one group already fills this machine). The
// same threads serve every group: a barrier ends each, so the next may reuse the arena.
template <typename F>
void launch(unsigned groups, unsigned threads, F&& body) {
    std::vector<unsigned char> arena(ARENA_BYTES);
    std::barrier<> barrier(threads);
    Group grp{&barrier, arena.data()};
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            group = &grp;
            tid_x = t;
            gid_y = 0;
            for (unsigned g = 0; g < groups; ++g) {
                gid_x = g;
                arena_used = 0;
                body();
                barrier.arrive_and_wait();
            }
        });
    }
    for (auto& th : pool) th.join();
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
#define FLOG(x) std::log(x)
#define FMA(a, b, c) std::fma(a, b, c)
#define TO_F32(x) static_cast<float>(x)
#define FROM_F32(type, x) static_cast<type>(x)

#endif
