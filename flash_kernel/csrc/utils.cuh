// PTX wrappers for the sm80+ data path: cp.async (global -> shared, zero-fill), ldmatrix
// (shared -> mma fragments) and mma.sync.m16n8k16 with fp32 accumulation.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16", .row.col), g = lane / 4, t = lane % 4:
//   A 16x16: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8 : b0 (k=2t..2t+1, n=g)  b1 (k=2t+8.., n=g)
//   C 16x8 : c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
// so the C fragments of two adjacent n8 tiles are exactly the A fragment of one k16 step: the FA2
// trick that feeds P (and P^T, dS^T) from registers into the next matmul without shared memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "smem_tile.h"

namespace flash {

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Compiler barriers: launder(x) is x, made opaque, so that a loop recomputes what derives from it rather than keeping
// it live. For the shared-memory lane addresses that a main loop's ldmatrix walks start from, laundered at the top of
// each iteration: without it the compiler finds the walks' addresses loop-invariant and keeps more of them in
// registers across the loop (sm_90a, hd128 backward, non-causal: 16 B of spill without it, none with it).
__device__ __forceinline__ uint32_t launder(uint32_t x) {
    asm volatile("" : "+r"(x));
    return x;
}
// The same for a global pointer: the sm80 backward's dQ rows of a query block, so that its adds address them as one
// register pair plus immediate offsets, not as a dozen loop-invariant pointer pairs (sm_90a, hd64: 24 registers).
template <typename T>
__device__ __forceinline__ T* launder(T* p) {
    asm volatile("" : "+l"(p));
    return p;
}

// The dynamic shared-memory base rounded up to kAlign bytes (SmemTile::kAlign; the Hopper kernels' swizzle atom).
template <int kAlign>
__device__ __forceinline__ unsigned char* align_smem(unsigned char* smem_raw) {
    const uint32_t addr = smem_addr(smem_raw);
    return smem_raw + ((kAlign - addr % kAlign) % kAlign);
}

// 16-byte async copy; when pred is false nothing is read and the 16 destination bytes are zeroed
// (src-size 0), which is how rows past the sequence end and head-dim columns past d become zeros. gmem_src is
// then never dereferenced, so callers pass the out-of-range address as it is (as CUTLASS's zero-fill copy does)
// instead of spending a SEL per chunk on selecting a valid one. cp_async_4 likewise.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool pred) {
    const int src_bytes = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes));
}
// 4-byte async copy (per-row fp32 statistics), zero-filled when pred is false.
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src, bool pred) {
    const int src_bytes = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes));
}
// dst[0..1] += v in global memory, no result wanted: one 8-byte vector red.global.add on sm_90 (CUDA's
// atomicAdd(float2*) returns a value, and behind a laundered address the compiler keeps it an ATOM, which is
// slower), two 4-byte adds before sm_90.
__device__ __forceinline__ void red_add_f32x2(float* dst, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(v.x), "f"(v.y) : "memory");
#else
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
#endif
}
// dst[0..3] += v in global memory, no result wanted: one 16-byte vector red.global.add on sm_90, four 4-byte adds
// before sm_90. dst must be 16-byte aligned.
__device__ __forceinline__ void red_add_f32x4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
#else
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#endif
}
// dst[0..n) += v by a plain load and store: the deterministic backward's adds into a dq_accum split its thread block
// owns, the ordered counterparts of red_add_f32x2 / red_add_f32x4.
__device__ __forceinline__ void add_ordered(float* dst, float2 v) {
    const float2 old = *reinterpret_cast<float2*>(dst);
    *reinterpret_cast<float2*>(dst) = make_float2(old.x + v.x, old.y + v.y);
}
__device__ __forceinline__ void add_ordered(float* dst, float4 v) {
    const float4 old = *reinterpret_cast<float4*>(dst);
    *reinterpret_cast<float4*>(dst) = make_float4(old.x + v.x, old.y + v.y, old.z + v.z, old.w + v.w);
}
// 8 bytes to, 16 bytes from a shared-memory address (the 32-bit form that smem_addr returns; 8- / 16-byte aligned).
__device__ __forceinline__ void st_shared_f32x2(uint32_t addr, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ float4 ld_shared_f32x4(uint32_t addr) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// ldmatrix_x4's inverse: matrix i of the four (this thread's part r[i], the m16n8 C layout's pair) goes to the 8
// rows whose addresses lanes 8i..8i+7 give.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}

// ldmatrix.x4 (kTrans: .trans) at (addr + add) ^ x, the add and the XOR inside the asm statement, so that the
// compiler can neither hoist nor share the XORed addresses of a loop's ldmatrix walk: it recomputes them for every
// load (two instructions each), but keeps none of them live (sm_90a, hd128 backward: as plain code, it spills).
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4_xor(uint32_t (&r)[4], uint32_t addr, uint32_t add, uint32_t x) {
    if constexpr (kTrans) {
        asm volatile("{\n .reg .b32 a;\n add.u32 a, %4, %5;\n xor.b32 a, a, %6;\n"
                     " ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [a];\n}\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr), "r"(add), "r"(x));
    } else {
        asm volatile("{\n .reg .b32 a;\n add.u32 a, %4, %5;\n xor.b32 a, a, %6;\n"
                     " ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [a];\n}\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr), "r"(add), "r"(x));
    }
}

// ldmatrix.x4 (kTrans: .trans) of the 8x8 matrices at Tile::step(at, dr, dc) (smem_tile.h). As plain code the
// compiler computes a walk's XOR once per k-step and puts the row offsets in the instruction's immediate, which
// takes about a tenth of the instructions out of the hd128 forward's main loop. kAddrInAsm (swizzled tiles)
// computes every address inside the asm instead (ldmatrix_x4_xor), with fewer registers live: the backwards other
// than hd64's keep it (BwdTiledTraits::kLdsmAddrInAsm), hd128's being slower with plain addresses.
template <typename Tile, bool kTrans = false, bool kAddrInAsm = false>
__device__ __forceinline__ void ldmatrix_tile(uint32_t (&r)[4], uint32_t at, int dr, int dc) {
    if constexpr (Tile::kSwizzled && kAddrInAsm) {
        ldmatrix_x4_xor<kTrans>(r, at, Tile::step_add(dr, dc), Tile::step_xor(dc));
    } else if constexpr (kTrans) {
        ldmatrix_x4_trans(r, Tile::step(at, dr, dc));
    } else {
        ldmatrix_x4(r, Tile::step(at, dr, dc));
    }
}

template <typename Element> struct Mma;
template <> struct Mma<__nv_bfloat16> {
    __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct Mma<__half> {
    __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <typename Element> __device__ __forceinline__ uint32_t pack2(float x, float y);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <typename Element> __device__ __forceinline__ float2 unpack2(uint32_t v);
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
}

// 2^x on the SFU (ex2.approx): exp2(-inf) = 0, which the masking relies on.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Reduce over the 4 lanes (t = lane % 4) that share one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Copy a (kRows x Tile::kCols) tile from global rows [0, valid_rows) and columns [0, d) into shared memory laid
// out as Tile (smem_tile.h) with 16-byte cp.async; everything outside is zero-filled.
template <int kRows, typename Tile, int kNThreads, typename Element>
__device__ __forceinline__ void copy_tile_async(Element* smem, const Element* gmem, int64_t row_stride,
                                                int valid_rows, int d) {
    constexpr int kChunksPerRow = Tile::kCols / 8;
    constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
    for (int c0 = 0; c0 < kChunks; c0 += kNThreads) {
        const int c = c0 + static_cast<int>(threadIdx.x);
        if (kChunks % kNThreads == 0 || c < kChunks) {
            const int row = c / kChunksPerRow;
            const int col = (c % kChunksPerRow) * 8;
            const bool pred = row < valid_rows && col < d;
            cp_async_16(smem_addr(smem + Tile::index(row, col)), gmem + row * row_stride + col, pred);
        }
    }
}

// The same copy with one source pointer per thread, advanced by a fixed row step: a thread always copies
// column chunk thread % kChunksPerRow, of rows kRowsPerStep = kNThreads / kChunksPerRow apart (the
// kNThreads % kChunksPerRow threads left over idle, e.g. 4 of 256 at head dim 96). copy_tile_async's
// per-chunk 64-bit offsets (row * row_stride) are loop-invariant in the kernels' main loops, so ptxas hoists
// them out and, at 255 registers, spills them (4 warps x 2 m16 tiles at hd128: ~430 B of spill, 48 LDL per
// K/V tile; the 8-warp backward at hd96 on sm_90: 28-48 B); here only the pointer, its step and the row
// index stay live.
template <int kRows, typename Tile, int kNThreads, typename Element>
__device__ __forceinline__ void copy_tile_async_stepped(Element* smem, const Element* gmem, int64_t row_stride,
                                                        int valid_rows, int d) {
    constexpr int kChunksPerRow = Tile::kCols / 8;
    constexpr int kRowsPerStep = kNThreads / kChunksPerRow;
    static_assert(kRowsPerStep > 0, "a step must cover at least one row");
    const int row0 = static_cast<int>(threadIdx.x) / kChunksPerRow;
    const int col = (static_cast<int>(threadIdx.x) % kChunksPerRow) * 8;
    if (kNThreads % kChunksPerRow != 0 && row0 >= kRowsPerStep) return;  // a left-over thread
    const uint32_t dst = smem_addr(smem + Tile::index(row0, col));
    const Element* src = gmem + row0 * row_stride + col;
#pragma unroll
    for (int step = 0; step < ceil_div(kRows, kRowsPerStep); ++step) {
        const int row = row0 + step * kRowsPerStep;
        if (kRows % kRowsPerStep == 0 || row < kRows) {
            const bool pred = row < valid_rows && col < d;
            // A step of a multiple of 8 rows keeps the row's swizzle (SmemTile::step).
            const uint32_t dst_step = kRowsPerStep % 8 == 0 ? Tile::step(dst, step * kRowsPerStep, 0)
                                                            : smem_addr(smem + Tile::index(row, col));
            cp_async_16(dst_step, src, pred);
        }
        src += kRowsPerStep * row_stride;
    }
}

// kStepped picks copy_tile_async_stepped (the forward configs of FwdSteppedTraits) or copy_tile_async.
template <bool kStepped, int kRows, typename Tile, int kNThreads, typename Element>
__device__ __forceinline__ void copy_tile(Element* smem, const Element* gmem, int64_t row_stride, int valid_rows,
                                          int d) {
    if constexpr (kStepped) {
        copy_tile_async_stepped<kRows, Tile, kNThreads>(smem, gmem, row_stride, valid_rows, d);
    } else {
        copy_tile_async<kRows, Tile, kNThreads>(smem, gmem, row_stride, valid_rows, d);
    }
}

// A query block whose rows all see no key (causal with Tq > Tk): O = 0 and LSE = +inf, which makes the
// backward's P = exp(S - LSE) = 0 for those rows.
template <int kRows, int kHeadDim, int kNThreads, typename Element>
__device__ __forceinline__ void write_rows_without_keys(Element* o, int64_t o_row_stride, float* lse, int valid_rows,
                                                        int d) {
    constexpr int kChunksPerRow = kHeadDim / 8;
    for (int c = static_cast<int>(threadIdx.x); c < kRows * kChunksPerRow; c += kNThreads) {
        const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
        if (row < valid_rows && col < d) *reinterpret_cast<uint4*>(o + row * o_row_stride + col) = make_uint4(0, 0, 0, 0);
    }
    for (int row = static_cast<int>(threadIdx.x); row < valid_rows; row += kNThreads) lse[row] = INFINITY;
}

// Write columns [0, kCols) of a (kRows x Tile::kCols) shared-memory tile laid out as Tile to global rows
// [0, valid_rows), columns [0, d), 16 bytes per thread per step so each row segment is a coalesced run.
template <int kRows, int kCols, typename Tile, int kNThreads, typename Element>
__device__ __forceinline__ void store_tile(Element* gmem, const Element* smem, int64_t row_stride, int valid_rows,
                                           int d) {
    constexpr int kChunksPerRow = kCols / 8;
    constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
    for (int c0 = 0; c0 < kChunks; c0 += kNThreads) {
        const unsigned c = c0 + threadIdx.x;  // unsigned: the divisions below are shifts or multiplies, no sign fix
        if (kChunks % kNThreads == 0 || c < kChunks) {
            const int row = static_cast<int>(c / kChunksPerRow);
            const int col = static_cast<int>(c % kChunksPerRow) * 8;
            if (row < valid_rows && col < d) {
                *reinterpret_cast<uint4*>(gmem + row * row_stride + col) =
                    *reinterpret_cast<const uint4*>(smem + Tile::index(row, col));
            }
        }
    }
}

}  // namespace flash
