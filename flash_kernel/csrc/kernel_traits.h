// Compile-time tile shapes of the FlashAttention-2 kernels, per head dim.
//
// Shared-memory tiles of Q, K, V and dO are row-major (rows x kHeadDim), laid out as SmemTile<kHeadDim>
// (smem_tile.h): rows XOR-swizzled by 16-byte chunk at head dims 64, 128 and 256, padded by 16 bytes at 32 and
// 96; either way ldmatrix is free of bank conflicts, and the swizzled tiles' copies fill whole 128-byte lines.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "smem_tile.h"

namespace flash {

constexpr int kWarpSize = 32;
constexpr int kMmaM = 16;        // mma.sync.m16n8k16
constexpr int kMmaN = 8;
constexpr int kMmaK = 16;
constexpr int kCopyElems = 8;    // one 16-byte cp.async moves 8 bf16/fp16
constexpr int kMaxSmemBytesSm80 = 163 * 1024;  // opt-in dynamic shared memory per block on A100
constexpr int kMaxSmemBytesSm90 = 227 * 1024;  // opt-in dynamic shared memory per block on H100/H200

// The instantiated head dims, in increasing order: one flash_{fwd,bwd}_hdim<D>_{bf16,fp16}.cu each. Any other
// multiple of 8 up to kMaxHeadDim runs the next larger one, its extra columns zero-filled on load and skipped on
// store: round_head_dim gives the choice, FLASH_HEADDIM_SWITCH (static_switch.h) dispatches on it.
// flash_kernel/interface.py's MAX_HEAD_DIM is kMaxHeadDim (tests/test_head_dims.py checks both).
constexpr int kHeadDims[] = {32, 64, 96, 128, 256};
constexpr int kNumHeadDims = static_cast<int>(sizeof(kHeadDims) / sizeof(kHeadDims[0]));
constexpr int kMaxHeadDim = kHeadDims[kNumHeadDims - 1];

constexpr int round_head_dim(int d) {
    for (const int head_dim : kHeadDims) {
        if (d <= head_dim) return head_dim;
    }
    return kMaxHeadDim;
}

// Forward (Alg. 1): kBlockM query rows per thread block, kMTilesPerWarp m16 row tiles per warp (split-Q:
// warps never exchange data; two tiles per warp halve the shared-memory reads of K and V per MMA);
// kBlockN keys per K/V tile, double- or triple-buffered in shared memory (kNStages).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kQInRegs_, int kMinBlocksPerSm_,
          int kNStages_, typename Element_>
struct FwdKernelTraits {
    using Element = Element_;
    static constexpr int kMTilesPerWarp = kBlockM_ / (kMmaM * kNWarps_);  // m16 row tiles per warp
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kNThreads = kNWarps * kWarpSize;
    static constexpr bool kQInRegs = kQInRegs_;  // keep the warp's Q fragments in registers across K/V tiles
    static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
    using Tile = SmemTile<kHeadDim>;  // Q, K and V tiles in shared memory
    // K/V stages: 2 = double buffering (a second barrier per tile guards the stage being refilled);
    // 3 = the tile being refilled was read two iterations ago, so one barrier per tile suffices.
    static constexpr int kNStages = kNStages_;
    static constexpr int kSmemQElems = kBlockM * Tile::kStride;
    static constexpr int kSmemKVTileElems = kBlockN * Tile::kStride;
    static constexpr int kSmemBytes =
        (kSmemQElems + 2 * kNStages * kSmemKVTileElems) * static_cast<int>(sizeof(Element)) + Tile::kAlignSlack;
    static constexpr bool kSteppedCopy = false;  // copy_tile_async (FwdSteppedTraits: copy_tile_async_stepped)

    static_assert(kBlockM == kMmaM * kNWarps * kMTilesPerWarp, "forward: each warp owns whole m16 row tiles of Q");
    static_assert(kHeadDim % (2 * kMmaN) == 0, "head dim must be a multiple of 16: ldmatrix.x4 covers two n8 tiles");
    static_assert(kBlockN % (2 * kMmaN) == 0, "kBlockN must be a multiple of 16: P is re-used as an A operand of k16");
    static_assert((kBlockM * kHeadDim / kCopyElems) % kNThreads == 0, "Q tile copy must split evenly over threads");
    static_assert((kBlockN * kHeadDim / kCopyElems) % kNThreads == 0, "K/V tile copy must split evenly over threads");
    static_assert(kNStages == 2 || kNStages == 3, "forward K/V pipeline is double or triple buffered");
    static_assert(kSmemBytes <= kMaxSmemBytesSm80, "forward tiles must fit A100 shared memory");
};

// Backward (Alg. 2): a thread block owns kBlockN = 16 kNWarps keys and walks the query blocks of kBlockM
// rows. This is the block shape; BwdTiledTraits below sets how flash_bwd_tiled_kernel tiles its matmul
// phases over the warps. S^T = K Q^T is computed key-major so that P^T and dS^T are already in the
// A-operand layout of dV += P^T dO and dK += dS^T Q.
// kColSplits > 1 (head dim 256): dK/dV/dQ columns are split over kColSplits thread blocks per K/V
// block, each recomputing the full-width S^T and dP^T, so that a warp's dK/dV accumulators
// (2 x kOutCols floats per thread) still fit in registers.
template <int kHeadDim_, int kBlockM_, int kNWarps_, int kColSplits_, typename Element_>
struct BwdKernelTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kColSplits = kColSplits_;
    static constexpr int kOutCols = kHeadDim / kColSplits;  // dK/dV/dQ columns per thread block
    static constexpr int kBlockM = kBlockM_;
    static constexpr int kNWarps = kNWarps_;
    static constexpr int kBlockN = kMmaM * kNWarps;
    static constexpr int kNThreads = kNWarps * kWarpSize;
    using Tile = SmemTile<kHeadDim>;                                // K, V, Q and dO tiles in shared memory
    using DsTile = SmemTile<kBlockM, false>;                        // dS^T and P^T: kBlockN x kBlockM, padded rows
    static constexpr int kSmemDsStride = DsTile::kStride;
    static constexpr int kNStages = 2;                              // Q/LSE/delta double buffering (dO: kDoStages)
    static constexpr int kSmemKVElems = kBlockN * Tile::kStride;
    static constexpr int kSmemQTileElems = kBlockM * Tile::kStride;
    static constexpr int kSmemDsElems = kBlockN * kSmemDsStride;

    static_assert(kHeadDim % (2 * kMmaN) == 0, "head dim must be a multiple of 16: ldmatrix.x4 covers two n8 tiles");
    static_assert(kBlockM % (2 * kMmaN) == 0, "kBlockM must be a multiple of 16 (k16 steps of dV += P^T dO)");
    static_assert(kHeadDim % kColSplits == 0 && kOutCols % (2 * kMmaN) == 0,
                  "column splits must leave a multiple of 16 output columns per thread block");
    static_assert(kBlockM <= kNThreads, "one thread per query row loads LSE and delta");
};

// A forward config whose tile copies are copy_tile_async_stepped (utils.cuh), which keeps fewer address registers live.
template <typename Base>
struct FwdSteppedTraits : Base {
    static constexpr bool kSteppedCopy = true;
};

// Backward: Base's block shape run by flash_bwd_tiled_kernel (flash_bwd_tiled_kernel.cuh), whose warp tiling
// of the matmul phases is set here, with the dQ tiling and the shared-memory size that follow from it.
// dS^T always goes through shared memory: dK_j += dS^T Q_i runs after the barrier that completes it, on its own
// (keys x columns) warp tile.
template <typename Base, int kSdpWarpsQ_, int kDqWarpsM_, int kDkvWarpsD_, int kDoStages_>
struct BwdTiledTraits : Base {
    using Element = typename Base::Element;
    static constexpr int kSdpWarpsQ = kSdpWarpsQ_;    // S^T, dP^T: warps along queries (1: a warp owns all queries)
    static constexpr int kDkvWarpsD = kDkvWarpsD_;    // dK/dV from shared memory: warps along head-dim columns
    static constexpr int kDoStages = kDoStages_;      // dO tiles in shared memory
    static constexpr int kDqWarpsM = kDqWarpsM_;
    static constexpr bool kDqFirst = false;       // dQ_i (and its adds) before dK_j (BwdDqFirstTraits)
    static constexpr bool kLdsmAddrInAsm = true;  // ldmatrix_tile's kAddrInAsm for the swizzled tiles
    static constexpr bool kDqStaged = false;      // dQ_i's adds through shared memory (BwdDqStagedTraits)
    static constexpr bool kDqStageInP = false;
    static constexpr int kDqWarpsN = Base::kNWarps / kDqWarpsM;
    static constexpr int kDqCols = Base::kOutCols / kDqWarpsN;
    static constexpr int kSmemPElems = kSdpWarpsQ > 1 ? Base::kSmemDsElems : 0;  // P^T tile
    static constexpr int kSmemBytes =
        (2 * Base::kSmemKVElems + (Base::kNStages + kDoStages) * Base::kSmemQTileElems + Base::kSmemDsElems +
         kSmemPElems) * static_cast<int>(sizeof(Element)) +
        2 * Base::kNStages * Base::kBlockM * static_cast<int>(sizeof(float)) + Base::Tile::kAlignSlack;

    static constexpr int kSdpWarpsK = Base::kNWarps / kSdpWarpsQ;
    static constexpr int kDkvWarpsK = Base::kNWarps / kDkvWarpsD;
    static_assert(Base::kNWarps % kSdpWarpsQ == 0 && Base::kBlockN % (kMmaM * kSdpWarpsK) == 0 &&
                      Base::kBlockM % (2 * kMmaN * kSdpWarpsQ) == 0,
                  "S^T/dP^T: warps must tile keys in m16 tiles and queries in pairs of n8 tiles");
    static_assert(Base::kNWarps % kDkvWarpsD == 0 && Base::kBlockN % (kMmaM * kDkvWarpsK) == 0 &&
                      Base::kOutCols % (2 * kMmaN * kDkvWarpsD) == 0,
                  "dK/dV from shared memory: warps must tile keys in m16 tiles and columns in pairs of n8 tiles");
    static_assert(Base::kNWarps % kDqWarpsM == 0 && Base::kBlockM % (kMmaM * kDqWarpsM) == 0 &&
                      kDqCols % (2 * kMmaN) == 0,
                  "dQ = dS K: warps must tile queries in m16 tiles and columns in pairs of n8 tiles");
    static_assert(kDoStages == 1 || kDoStages == 2, "dO is single or double buffered");
    // A config's Traits may need Hopper's shared memory if it names SmallSmemTraits that fit A100's (BwdConfig).
    static_assert(kSmemBytes <= kMaxSmemBytesSm90, "backward tiles must fit Hopper shared memory");
};

// The same backward with FA2's order at the end of a query block: dQ_i = dS K_j and its adds into dq_accum, then
// dK_j += dS^T Q_i, so the adds leave while dK's matmuls run; and the swizzled tiles' ldmatrix addresses as plain code
// (ldmatrix_tile), one XOR per k-step instead of two instructions per load. The two pay off together at hd64 (causal
// most); either alone, or both at hd128, is slower.
template <typename Base>
struct BwdDqFirstTraits : Base {
    static constexpr bool kDqFirst = true;
    static constexpr bool kLdsmAddrInAsm = false;
};

// The same backward adding dQ_i into dq_accum through shared memory: each warp writes its dQ_i tile's fp32 C
// fragments, one m16 tile at a time, into a swizzled staging tile of its own, then reads back whole 16-byte row chunks
// for 16-byte adds (red_add_f32x4). From the C fragments, each add instruction touches 8 rows of 32 bytes, one
// L2 request per row: 4 x FA2's requests for the same bytes, and the adds wait on the SM's global-memory queue (ncu's
// "lg throttle" stall). From rows, an instruction covers 4 rows of whole 128-byte lines. The staging tiles (16 x 32
// floats per warp) take the P^T buffer where it is free, which it is only behind the barrier after dV_j += P^T dO_i
// that one dO stage has; else shared memory of their own.
template <typename Base>
struct BwdDqStagedTraits : Base {
    static_assert(Base::kDqCols == 32, "a warp's staged dQ rows are one 128-byte line: 8 lanes per row, 4 rows per read");
    static constexpr bool kDqStaged = true;
    static constexpr int kDqStageBytes = Base::kNWarps * kMmaM * Base::kDqCols * static_cast<int>(sizeof(float));
    static constexpr bool kDqStageInP =
        Base::kSdpWarpsQ > 1 && Base::kDoStages == 1 &&
        kDqStageBytes <= Base::kSmemPElems * static_cast<int>(sizeof(typename Base::Element));
    static constexpr int kSmemBytes = Base::kSmemBytes + (kDqStageInP ? 0 : kDqStageBytes);
    static_assert(kSmemBytes <= kMaxSmemBytesSm90, "backward tiles must fit Hopper shared memory");
};

// Per-head-dim choices (bf16, B*T = 16k; docs/kernel_design.md has the table with shared memory and registers).
// Forward: 128 query rows per block either as 4 warps x 2 m16 tiles (small head dims: each K/V fragment feeds two
// MMAs) or 8 warps x 1 tile (head dim 96, where two tiles' accumulators would spill); Q fragments stay in registers
// at 32 and 96. At 64 they would make the kernel spill at 255 registers, so Q is re-read from shared memory, which
// runs faster. Head dim 128 runs 4 warps x 2 tiles on two K/V stages (96 KiB, so that two blocks share an H100 SM)
// with stepped tile copies; where two blocks do not fit an SM (A100), OneBlockTraits: 8 warps x 1 tile on three
// stages (128 KiB). Head dim 96 names Smem99KiBTraits, what GPUs that give a thread block 99 KiB (sm_86, sm_89) run:
// two K/V stages instead of three (fwd_variant). Backward: see BwdConfig below.
//                                                                       hd   Br   Bc warps Q-regs minBlk stages
template <int kHeadDim, typename Element> struct FwdConfig;
template <typename E> struct FwdConfig<32, E>  { using Traits = FwdKernelTraits<32, 128, 64, 4, true, 2, 3, E>; };
template <typename E> struct FwdConfig<64, E>  { using Traits = FwdKernelTraits<64, 128, 64, 4, false, 1, 3, E>; };
template <typename E> struct FwdConfig<96, E>  {
    using Traits = FwdKernelTraits<96, 128, 64, 8, true, 1, 3, E>;          // 104 KB
    using Smem99KiBTraits = FwdKernelTraits<96, 128, 64, 8, true, 1, 2, E>;  // 78 KB: two K/V stages
};
template <typename E> struct FwdConfig<128, E> {
    using Traits = FwdSteppedTraits<FwdKernelTraits<128, 128, 64, 4, false, 2, 2, E>>;  // 96 KiB: 2 blocks per SM
    using OneBlockTraits = FwdKernelTraits<128, 128, 64, 8, false, 1, 3, E>;             // 128 KiB: 1 block per SM
};
template <typename E> struct FwdConfig<256, E> { using Traits = FwdKernelTraits<256, 64, 16, 4, false, 2, 2, E>; };

// Backward: BwdTiledTraits<BwdKernelTraits<hd, Br, warps, colSplits>, kSdpWarpsQ, kDqWarpsM, kDkvWarpsD, kDoStages>;
// Bc = 16 x warps keys. Warp tiles: FA2's sm80 choice per head dim (the atom layouts of its Flash_bwd_kernel_traits
// for S/dP, dK/dV and dQ; one exception at 64); dO double-buffered where that fits A100's 163 KB (not at 64 and
// 128). A config may name SmallSmemTraits: what GPUs whose thread blocks get less shared memory than its Traits need
// run instead (the launch compares the device's opt-in limit, in the params; they must fit A100's 163 KB). Each
// names Smem99KiBTraits, for GPUs that give a block 99 KiB (sm_86, sm_89): smaller query blocks (Br 64 at head dims
// 32 and 64, 32 at 128, 16 at 256), 4 warps (Bc 64) at 96 and 128, and one dO stage, with FA2's warp tiles where
// they divide. They are not tuned: no such GPU has measured them, and the H100 runs them only for the tests
// (flash_kernel.interface.set_kernel_overrides, max_smem_per_block).
// hd128 double-buffers dO and stages dQ's adds in 16 KB of their own where the GPU allows 181 KB (the H100); A100s
// run SmallSmemTraits, with neither. At hd64 a second dO stage gains nothing.
// Head dim 256 splits the columns over 2 thread blocks: FA2's 8 warps x Bc 64 would need Bc = 128 here (K and V
// alone 132 KB), and without splits dK/dV would need 256 accumulator floats per thread.
template <int kHeadDim, typename Element> struct BwdConfig;
//   hd 32: Br 128; S^T/dP^T warp 64 keys x 32 queries, dK/dV 32 keys x 16 cols, dQ 32 queries x 16 cols.
template <typename E> struct BwdConfig<32, E>  {
    using Traits = BwdTiledTraits<BwdKernelTraits<32, 128, 8, 1, E>, 4, 4, 2, 2>;
    using Smem99KiBTraits = BwdTiledTraits<BwdKernelTraits<32, 64, 8, 1, E>, 2, 4, 2, 2>;  // Br 64
};
//   hd 64: Br 128; S^T/dP^T 32 keys x 64 queries, dK/dV 32 keys x 32 cols, dQ 32 queries x 32 cols. FA2
//   splits S^T 2 x 4 (64 keys x 32 queries): the same ldmatrix count, but 20-36 B of spill on both archs
//   here, against 16-28 B on sm_90 only for 4 x 2. dQ before dK (BwdDqFirstTraits); dQ's adds staged in the P^T
//   buffer (BwdDqStagedTraits).
template <typename E> struct BwdConfig<64, E>  {
    using Traits = BwdDqStagedTraits<BwdDqFirstTraits<BwdTiledTraits<BwdKernelTraits<64, 128, 8, 1, E>, 2, 4, 2, 1>>>;
    using Smem99KiBTraits = BwdTiledTraits<BwdKernelTraits<64, 64, 8, 1, E>, 2, 4, 2, 1>;  // Br 64
};
//   hd 96: Br 64; S^T/dP^T 32 keys x 32 queries, dK/dV 32 keys x 48 cols, dQ 16 queries x 48 cols.
template <typename E> struct BwdConfig<96, E>  {
    using Traits = BwdTiledTraits<BwdKernelTraits<96, 64, 8, 1, E>, 2, 4, 2, 2>;
    using Smem99KiBTraits = BwdTiledTraits<BwdKernelTraits<96, 64, 4, 1, E>, 2, 2, 2, 1>;  // Bc 64, 1 dO stage
};
//   hd 128: Br 64; S^T/dP^T 32 keys x 32 queries, dK/dV 32 keys x 64 cols, dQ 32 queries x 32 cols.
template <typename E> struct BwdConfig<128, E> {
    using Traits = BwdDqStagedTraits<BwdTiledTraits<BwdKernelTraits<128, 64, 8, 1, E>, 2, 2, 2, 2>>;  // 181 KB
    using SmallSmemTraits = BwdTiledTraits<BwdKernelTraits<128, 64, 8, 1, E>, 2, 2, 2, 1>;  // 149 KB
    // Br 32, Bc 64, one dO stage: Br 64 would need 99 KiB and the tiles' alignment slack on top.
    using Smem99KiBTraits = BwdTiledTraits<BwdKernelTraits<128, 32, 4, 1, E>, 2, 2, 2, 1>;
};
//   hd 256: Br 32, Bc 64 (4 warps), 2 column splits of 128; S^T/dP^T 32 keys x 16 queries, dK/dV 32 keys x
//   64 cols (FA2's warp tiles), dQ 16 queries x 64 cols.
template <typename E> struct BwdConfig<256, E> {
    using Traits = BwdTiledTraits<BwdKernelTraits<256, 32, 4, 2, E>, 2, 2, 2, 2>;
    using Smem99KiBTraits = BwdTiledTraits<BwdKernelTraits<256, 16, 4, 2, E>, 1, 1, 2, 1>;  // Br 16, 1 dO stage
};

// A forward config's OneBlockTraits (what runs where the SM's shared memory cannot hold the kMinBlocksPerSm thread
// blocks its Traits are tuned for, or a block cannot have Traits' bytes), or its Traits where it names none.
template <typename Config, typename = void>
struct OneBlockTraitsOf { using type = typename Config::Traits; };
template <typename Config>
struct OneBlockTraitsOf<Config, std::void_t<typename Config::OneBlockTraits>> { using type = typename Config::OneBlockTraits; };

// A backward config's SmallSmemTraits, or its Traits where it names none.
template <typename Config, typename = void>
struct SmallSmemTraitsOf { using type = typename Config::Traits; };
template <typename Config>
struct SmallSmemTraitsOf<Config, std::void_t<typename Config::SmallSmemTraits>> {
    using type = typename Config::SmallSmemTraits;
};

// A config's Smem99KiBTraits (what GPUs that give a thread block 99 KiB run: sm_86, sm_89), or Fallback where it
// names none.
template <typename Config, typename Fallback, typename = void>
struct Smem99KiBTraitsOf { using type = Fallback; };
template <typename Config, typename Fallback>
struct Smem99KiBTraitsOf<Config, Fallback, std::void_t<typename Config::Smem99KiBTraits>> {
    using type = typename Config::Smem99KiBTraits;
};

constexpr int kReservedSmemPerBlock = 1024;  // shared memory the driver keeps per thread block (sm80+)

// Which variant of a config a GPU with these shared-memory limits runs (the launch templates choose by these; the
// binding reads the bytes to refuse, with a clear error, a GPU whose blocks get less than the smallest).
// Forward: Traits, tuned for kMinBlocksPerSm blocks per SM, where a block may have their bytes and that many blocks
// fit one SM (else their warps would be alone on it); else OneBlockTraits where a block may have those; else Traits
// where a block may have those (sm_86 / sm_89 at head dim 128: one block per SM, the only config that fits); else
// Smem99KiBTraits where the config names them; else the smaller of the two (refused).
enum FwdVariant { kFwdTraits, kFwdOneBlock, kFwdSmem99KiB };
template <typename Config>
FwdVariant fwd_variant(int smem_per_block_optin, int smem_per_sm) {
    using Traits = typename Config::Traits;
    using OneBlock = typename OneBlockTraitsOf<Config>::type;
    const bool traits_fit = smem_per_block_optin >= Traits::kSmemBytes;
    if constexpr (!std::is_same_v<Traits, OneBlock>) {
        const bool resident = smem_per_sm >= Traits::kMinBlocksPerSm * (Traits::kSmemBytes + kReservedSmemPerBlock);
        if (traits_fit && resident) return kFwdTraits;
        if (smem_per_block_optin >= OneBlock::kSmemBytes) return kFwdOneBlock;
    }
    if (traits_fit) return kFwdTraits;
    if constexpr (!std::is_void_v<typename Smem99KiBTraitsOf<Config, void>::type>) return kFwdSmem99KiB;
    return Traits::kSmemBytes <= OneBlock::kSmemBytes ? kFwdTraits : kFwdOneBlock;
}
template <typename Config>
int fwd_smem_bytes(int smem_per_block_optin, int smem_per_sm) {
    switch (fwd_variant<Config>(smem_per_block_optin, smem_per_sm)) {
        case kFwdTraits: return Config::Traits::kSmemBytes;
        case kFwdOneBlock: return OneBlockTraitsOf<Config>::type::kSmemBytes;
        default: return Smem99KiBTraitsOf<Config, typename OneBlockTraitsOf<Config>::type>::type::kSmemBytes;
    }
}
// Backward: the first of Traits, SmallSmemTraits (A100) and Smem99KiBTraits whose bytes a block may have (the last
// where none fits: refused).
enum BwdVariant { kBwdTraits, kBwdSmallSmem, kBwdSmem99KiB };
template <typename Config>
BwdVariant bwd_variant(int smem_per_block_optin) {
    if (smem_per_block_optin >= Config::Traits::kSmemBytes) return kBwdTraits;
    if (smem_per_block_optin >= SmallSmemTraitsOf<Config>::type::kSmemBytes) return kBwdSmallSmem;
    return kBwdSmem99KiB;
}
template <typename Config>
int bwd_smem_bytes(int smem_per_block_optin) {
    using SmallSmem = typename SmallSmemTraitsOf<Config>::type;
    switch (bwd_variant<Config>(smem_per_block_optin)) {
        case kBwdTraits: return Config::Traits::kSmemBytes;
        case kBwdSmallSmem: return SmallSmem::kSmemBytes;
        default: return Smem99KiBTraitsOf<Config, SmallSmem>::type::kSmemBytes;
    }
}

}  // namespace flash
