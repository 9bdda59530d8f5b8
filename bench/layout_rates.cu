// What a shared-memory layout costs on Hopper: the tensor cores' rate on wgmma operands in each swizzle (SW128, SW64,
// SW32), and how fast TMA lands 64-row tiles of a (T, H, d) bf16 tensor in boxes of each width. Our kernels store Q,
// K, V and dO of head dims 65-96 in SW128 tiles 128 columns wide or in SW64 tiles 96 wide (hopper_kernel_traits.h,
// hopper_bwd_traits.h); FlashAttention-4's sm90 kernels use SW32 at hd80. This says which of those the hardware
// favours, apart from any kernel (docs/results.md, section 47).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I flash_kernel/csrc bench/layout_rates.cu \
//       -o /tmp/layout_rates && /tmp/layout_rates
//
// wgmma: every SM runs 2 or 3 warpgroups, each issuing m64nNk16 wgmmas over K = 16 x k-steps from shared-memory
// tiles (A: its own 64 rows, K-major; B: shared, K-major or N-major), one group in flight behind another. Printed:
// FLOP per SM-cycle over each warpgroup's timed loop (the peak is 4096 for bf16) and TFLOP/s from the launch's time.
// TMA: one thread per SM loads 64-row tiles (rows of head blockIdx % 16, an L2-resident tensor) through 4 stages, each
// tile as boxes of the layout's width (a box partly past d still writes its whole width, zeros past d). Every SM loads
// at once, so the rates are what the GPU's L2 sustains into all SMs together, per SM.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "hopper_tma.h"  // the kernels' TMA, mbarrier and wgmma helpers, and the runtime's tensor-map encoder
#include "wgmma.cuh"

namespace {

#define CHECK(call)                                                                                   \
    do {                                                                                              \
        const cudaError_t e = (call);                                                                 \
        if (e != cudaSuccess) {                                                                       \
            std::fprintf(stderr, "layout_rates: %s: %s\n", #call, cudaGetErrorString(e));             \
            std::exit(1);                                                                             \
        }                                                                                             \
    } while (0)

constexpr int kSmemBytes = 200 * 1024;

// kBytes: the swizzle's row (128, 64 or 32 bytes: column blocks of kBytes / 2 elements); N: wgmma's N; kKSteps: k16
// steps per group; kTransB 0: B K-major (N rows of K, like K in Q K^T), 1: N-major (K rows of N, like V in P V).
template <int kBytes, int N, int kKSteps, int kTransB>
__global__ void __launch_bounds__(384, 1) wgmma_loop(long long* cycles, float* sink, int iters) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = flash::align_smem<1024>(smem_raw);
    constexpr int kElems = kBytes / 2;  // elements per row of a column block
    constexpr int kK = 16 * kKSteps;
    const int warpgroups = blockDim.x / 128, wg = threadIdx.x / 128;
    const uint32_t a_block_bytes = 64 * warpgroups * kBytes;  // A: 64 rows per warpgroup x kK
    const int a_blocks = (kK + kElems - 1) / kElems;
    const int b_bytes = kTransB == 0 ? (kK + kElems - 1) / kElems * N * kBytes : (N + kElems - 1) / kElems * kK * kBytes;
    for (int i = threadIdx.x; i < (a_blocks * static_cast<int>(a_block_bytes) + b_bytes) / 2; i += blockDim.x) {
        reinterpret_cast<__nv_bfloat16*>(smem)[i] = __float2bfloat16(0.001f * ((i * 37) % 101 - 50));
    }
    flash::fence_view_async_shared();  // the tensor cores read what the threads wrote
    __syncthreads();
    const uint32_t a = flash::smem_addr(smem) + wg * 64 * kBytes;
    const uint32_t b = flash::smem_addr(smem) + a_blocks * a_block_bytes;
    uint64_t desc_a[kKSteps], desc_b[kKSteps];
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
        const int col = 16 * kk;
        desc_a[kk] = flash::make_smem_desc<kBytes>(a + col / kElems * a_block_bytes + col % kElems * 2, 16, 8 * kBytes);
        const uint32_t b_kk = kTransB == 0 ? b + col / kElems * (N * kBytes) + col % kElems * 2 : b + kk * 16 * kBytes;
        desc_b[kk] = flash::make_smem_desc<kBytes>(b_kk, kTransB == 0 ? 16 : kK * kBytes, 8 * kBytes);
    }
    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
    __syncthreads();
    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        flash::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKSteps; ++kk) flash::Wgmma<__nv_bfloat16, N>::template ss<kTransB>(acc, desc_a[kk], desc_b[kk], 1);
        flash::wgmma_commit();
        flash::wgmma_wait<1>();
    }
    flash::wgmma_wait<0>();
    const long long t1 = clock64();
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) sum += acc[i];
    if (sum == 12345.f) sink[threadIdx.x] = sum;  // keeps the accumulators, never true
    if (threadIdx.x % 128 == 0) cycles[blockIdx.x * warpgroups + wg] = t1 - t0;
}

// Launches `kernel` on every SM `rounds` times: the fastest round's milliseconds and the cycles it recorded.
template <typename Kernel, typename... Args>
float time_launch(Kernel kernel, int sms, int threads, int rounds, Args... args) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    float best = 1e30f;
    for (int r = 0; r < rounds; ++r) {
        CHECK(cudaEventRecord(start));
        kernel<<<sms, threads, kSmemBytes>>>(args...);
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        CHECK(cudaGetLastError());
        float ms = 0.f;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (ms < best) best = ms;
    }
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    return best;
}

double mean_of(const long long* device, int n) {
    long long host[3 * 1024];
    CHECK(cudaMemcpy(host, device, sizeof(long long) * n, cudaMemcpyDeviceToHost));
    double sum = 0;
    for (int i = 0; i < n; ++i) sum += static_cast<double>(host[i]);
    return sum / n;
}

template <int kBytes, int N, int kKSteps, int kTransB>
void wgmma_row(int warpgroups, int sms, long long* cycles, float* sink) {
    constexpr int kIters = 4000;
    auto kernel = wgmma_loop<kBytes, N, kKSteps, kTransB>;
    time_launch(kernel, sms, 128 * warpgroups, 1, cycles, sink, 50);  // warm-up
    const float ms = time_launch(kernel, sms, 128 * warpgroups, 5, cycles, sink, kIters);
    const double flops = 2.0 * 64 * N * 16 * kKSteps * kIters * warpgroups * sms;
    std::printf("| %s | SW%d | %d | %d | %d | %.0f | %.1f |\n", kTransB ? "N-major" : "K-major", kBytes, N, 16 * kKSteps,
                warpgroups, flops / sms / mean_of(cycles, sms * warpgroups), flops / ms / 1e9);
}

// TMA: tiles of kRows rows of a (kT, kH, d) tensor, each tile as boxes of kBox0 columns (in swizzle kSwz0) from
// column 0 and kBoxes1 boxes of kBox1 columns (kSwz1) from column kBox0 * kBoxes0, one copy per box.
constexpr int kRows = 64, kStages = 4, kT = 4096, kH = 16;

struct TileMaps {
    CUtensorMap first, rest;
};

template <int kBox0, int kBoxes0, int kBox1, int kBoxes1>
__global__ void tma_loop(const __grid_constant__ TileMaps maps, long long* cycles, int iters) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = flash::align_smem<1024>(smem_raw);
    constexpr int kBytes0 = kRows * kBox0 * 2, kBytes1 = kRows * kBox1 * 2;  // one box of each map
    constexpr int kStageBytes = kBoxes0 * kBytes0 + kBoxes1 * kBytes1;
    static_assert(kStageBytes % 1024 == 0 && kBytes0 % 1024 == 0, "boxes at their swizzle's alignment");
    __shared__ __align__(8) uint64_t full[kStages];
    if (threadIdx.x != 0) return;
    for (int s = 0; s < kStages; ++s) flash::mbarrier_init(flash::smem_addr(&full[s]), 1);
    flash::fence_mbarrier_init();
    const int head = blockIdx.x % kH;
    // One 3-D copy per box (the kernels' tma_load_tile takes a 4-D map's batch too).
    auto load = [&](const CUtensorMap* map, uint32_t dst, int col, int row, uint32_t bar) {
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
            ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(bar) : "memory");
    };
    auto issue = [&](int it) {
        const int s = it % kStages;
        const uint32_t bar = flash::smem_addr(&full[s]), dst = flash::smem_addr(smem + s * kStageBytes);
        flash::mbarrier_arrive_expect_tx(bar, kStageBytes);
        const int row = (it + 7 * static_cast<int>(blockIdx.x)) * kRows % kT;
        for (int c = 0; c < kBoxes0; ++c) load(&maps.first, dst + c * kBytes0, c * kBox0, row, bar);
        for (int c = 0; c < kBoxes1; ++c) {
            load(&maps.rest, dst + kBoxes0 * kBytes0 + c * kBytes1, kBoxes0 * kBox0 + c * kBox1, row, bar);
        }
    };
    // Until stage it % kStages has landed: try_wait polled from C++ (hopper_utils.cuh's mbarrier_wait, a PTX loop,
    // compiles the kernel to about twice the instructions).
    auto wait = [&](int it) {
        const uint32_t bar = flash::smem_addr(&full[it % kStages]), phase = (it / kStages) & 1;
        uint32_t done = 0;
        while (!done) {
            asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                         : "=r"(done) : "r"(bar), "r"(phase) : "memory");
        }
    };
    for (int it = 0; it < kStages; ++it) issue(it);
    const long long t0 = clock64();
    for (int it = 0; it < iters; ++it) {
        wait(it);
        if (it + kStages < iters) issue(it + kStages);
    }
    cycles[blockIdx.x] = clock64() - t0;
}

CUtensorMapSwizzle swizzle_of(int box_cols) {
    return box_cols == 64   ? CU_TENSOR_MAP_SWIZZLE_128B
           : box_cols == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                            : CU_TENSOR_MAP_SWIZZLE_32B;
}

// A (d, T, H) map in boxes of box_cols x kRows: hopper_tma.h's make_tile_map, 3-D, with SW32 boxes too.
CUtensorMap tile_map(void* tensor, int d, int box_cols) {
    const flash::TensorMapEncodeTiled encode = flash::tensor_map_encoder();
    CUtensorMap map;
    const cuuint64_t dims[3] = {cuuint64_t(d), cuuint64_t(kT), cuuint64_t(kH)};
    const cuuint64_t strides[2] = {cuuint64_t(kH) * d * 2, cuuint64_t(d) * 2};  // (T, H, d): rows H d apart
    const cuuint32_t box[3] = {cuuint32_t(box_cols), kRows, 1};
    const cuuint32_t element_strides[3] = {1, 1, 1};
    if (encode == nullptr || encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, tensor, dims, strides, box, element_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle_of(box_cols), CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        std::fprintf(stderr, "layout_rates: no tensor map for d %d, box %d (cuTensorMapEncodeTiled)\n", d, box_cols);
        std::exit(1);
    }
    return map;
}

template <int kBox0, int kBoxes0, int kBox1 = 16, int kBoxes1 = 0>
void tma_row(void* tensor, int d, int sms, long long* cycles) {
    constexpr int kIters = 20000;
    const CUtensorMap first = tile_map(tensor, d, kBox0);
    const TileMaps maps{first, kBoxes1 > 0 ? tile_map(tensor, d, kBox1) : first};
    auto kernel = tma_loop<kBox0, kBoxes0, kBox1, kBoxes1>;
    time_launch(kernel, sms, 32, 1, maps, cycles, 200);  // warm-up: the tensor into L2
    const float ms = time_launch(kernel, sms, 32, 5, maps, cycles, kIters);
    const double per_tile = mean_of(cycles, sms) / kIters;
    const double tensor_bytes = double(kRows) * d * 2, written = double(kRows) * (kBox0 * kBoxes0 + kBox1 * kBoxes1) * 2;
    char boxes[48];
    const int used = std::snprintf(boxes, sizeof boxes, "%d x %d SW%d", kBoxes0, kBox0, 2 * kBox0);
    if (kBoxes1 > 0) std::snprintf(boxes + used, sizeof boxes - used, " + %d x %d SW%d", kBoxes1, kBox1, 2 * kBox1);
    std::printf("| %d | %s | %.0f | %.1f | %.1f | %.0f |\n", d, boxes, per_tile, tensor_bytes / per_tile,
                written / per_tile, tensor_bytes * kIters * sms / (ms * 1e-3) / 1e9);
}

}  // namespace

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("%s, %d SMs\n\n", prop.name, sms);
    long long* cycles;
    float* sink;
    CHECK(cudaMalloc(&cycles, sizeof(long long) * 3 * sms));
    CHECK(cudaMalloc(&sink, 384 * sizeof(float)));

    std::printf("wgmma m64nNk16, A K-major; FLOP per SM-cycle (peak 4096) over the warpgroups' loops\n\n");
    std::printf("| B | layout | N | K | warpgroups | FLOP / SM-cycle | TFLOP/s |\n|---|---|---|---|---|---|---|\n");
    for (int warpgroups = 2; warpgroups <= 3; ++warpgroups) {
        // S^T and dP^T of the backward (N: 64 queries) and S of the forward (N: keys) over head dims 64, 80, 96
        wgmma_row<128, 64, 4, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<64, 64, 4, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<32, 64, 4, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<128, 64, 5, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<64, 64, 5, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<32, 64, 5, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<128, 64, 6, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<64, 64, 6, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<128, 128, 5, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<64, 128, 5, 0>(warpgroups, sms, cycles, sink);
        wgmma_row<32, 128, 5, 0>(warpgroups, sms, cycles, sink);
        // O += P V, dV += P^T dO, dK += dS^T Q: B N-major, N the head dim, K 64 rows
        wgmma_row<128, 64, 4, 1>(warpgroups, sms, cycles, sink);
        wgmma_row<64, 64, 4, 1>(warpgroups, sms, cycles, sink);
        wgmma_row<128, 80, 4, 1>(warpgroups, sms, cycles, sink);
        wgmma_row<64, 80, 4, 1>(warpgroups, sms, cycles, sink);
        wgmma_row<32, 80, 4, 1>(warpgroups, sms, cycles, sink);
        wgmma_row<128, 96, 4, 1>(warpgroups, sms, cycles, sink);
        wgmma_row<64, 96, 4, 1>(warpgroups, sms, cycles, sink);
    }

    void* tensor;
    const size_t bytes = size_t{kT} * kH * 128 * 2;
    CHECK(cudaMalloc(&tensor, bytes));
    CHECK(cudaMemset(tensor, 0, bytes));
    std::printf("\nTMA, 64-row tiles of a (%d, %d, d) bf16 tensor, every SM loading; bytes per SM-cycle\n\n", kT, kH);
    std::printf("| d | boxes | cycles per tile | tensor bytes / SM-cycle | written bytes / SM-cycle | tensor GB/s |\n"
                "|---|---|---|---|---|---|\n");
    tma_row<64, 1>(tensor, 64, sms, cycles);
    tma_row<32, 2>(tensor, 64, sms, cycles);
    tma_row<16, 4>(tensor, 64, sms, cycles);
    tma_row<64, 2>(tensor, 80, sms, cycles);       // hd80's 128-wide SW128 tiles
    tma_row<32, 3>(tensor, 80, sms, cycles);       // 96-wide SW64
    tma_row<16, 5>(tensor, 80, sms, cycles);       // 80-wide SW32 (FlashAttention-4's)
    tma_row<64, 1, 16, 1>(tensor, 80, sms, cycles);  // 64 columns in SW128, the last 16 in SW32
    tma_row<64, 2>(tensor, 96, sms, cycles);
    tma_row<32, 3>(tensor, 96, sms, cycles);
    tma_row<16, 6>(tensor, 96, sms, cycles);
    tma_row<64, 1, 32, 1>(tensor, 96, sms, cycles);  // 64 columns in SW128, the last 32 in SW64
    tma_row<64, 2>(tensor, 128, sms, cycles);
    CHECK(cudaFree(tensor));
    CHECK(cudaFree(cycles));
    CHECK(cudaFree(sink));
    return 0;
}
