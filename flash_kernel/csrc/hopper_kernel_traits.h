// Tile shapes of the Hopper (sm_90a, wgmma) forward, per head dim.
//
// A thread block is two or three consumer warpgroups of 64 query rows each (kBlockM = 128 or 192) and one producer
// warpgroup. Each consumer computes its S = Q K^T (64 x kBlockN) with wgmma from shared memory, its softmax in
// registers, and O += P V with P as the register A operand (kPSmem: from a P tile in shared memory). The producer
// streams K and V tiles of kBlockN keys into kNStages stages each by TMA (hopper_tma.h), on full/empty mbarriers per
// stage. Shared memory holds Q, the K/V stages and the P tiles in the 128B-swizzled layout of hopper_utils.cuh, then
// the mbarriers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "hopper_utils.cuh"
#include "kernel_traits.h"  // kWarpSize, the m16n8k16 tile constants, kMaxSmemBytesSm90

namespace flash {

constexpr int kWarpgroupThreads = 128;
constexpr int kWarpgroupRows = 64;               // wgmma's M
constexpr int kMaxFwdWarpgroups = 3;             // the forward's turn barriers (flash_fwd_hopper_kernel.cuh)

// FLASH_FWD_EXP_SPLIT (percent, 50; docs/kernel_design.md, "Build switches"): under the intra-warpgroup overlap, the
// share of S_j's exponentials that run before the wait for the warpgroup's own P_{j-1} V_{j-1}. The rest run after
// it, where ptxas interleaves them with O's rescale and P_j's packing (FA4's order), which otherwise follow the last
// exponential one after another on the warpgroup's path to its next turn. 100: all before the wait.
#ifndef FLASH_FWD_EXP_SPLIT
#define FLASH_FWD_EXP_SPLIT 50
#endif
constexpr int kFwdExpSplitPct = FLASH_FWD_EXP_SPLIT;
static_assert(kFwdExpSplitPct >= 0 && kFwdExpSplitPct <= 100, "FLASH_FWD_EXP_SPLIT is a percentage");

// A switch read as -1 (by kernel), 0 (off) or 1 (on in every kernel it reaches): whether it is on in a kernel whose
// own rule (the switch's default) says by_kernel.
constexpr bool fwd_switch_valid(int setting) { return setting >= -1 && setting <= 1; }
constexpr bool fwd_switch_on(int setting, bool by_kernel) { return setting >= 0 ? setting == 1 : by_kernel; }

// FLASH_FWD_NARROW_LAST_BLOCK (docs/kernel_design.md, "Build switches"; docs/results.md, section 53): a tile's last
// key block runs its S = Q K^T, softmax and O += P V only over the keys up to the last one that some row of the tile
// sees, in whole 64-key steps (an n64 or n128 wgmma instead of n192 where 1-64 or 65-128 of a 192-key block's keys
// are visible), instead of over the whole block with the rest masked. At T = 4096 on 192-key blocks the last of 22
// blocks holds 64 keys: a third of a turn's work instead of a whole turn; causal tiles' diagonal blocks narrow the
// same way. 0: off; 1: every Hopper forward kernel; -1 (the default): the masked kernels (causal, varlen, windowed)
// and the dense non-causal ones on 144- or 192-key blocks, where T a multiple of 128 leaves a partial last block
// (from 2k keys, non-causal 1.01-1.04 x at hd80 and 0.99-1.03 x at hd128, causal 0.98-1.03 x); not the dense
// non-causal ones on 128-key blocks, which such T fills (0.99-1.00 x at 1k keys: the extra code moves ptxas's
// schedule of their main loop).
#ifndef FLASH_FWD_NARROW_LAST_BLOCK
#define FLASH_FWD_NARROW_LAST_BLOCK -1
#endif
constexpr int kFwdNarrowLastBlock = FLASH_FWD_NARROW_LAST_BLOCK;
static_assert(fwd_switch_valid(kFwdNarrowLastBlock), "FLASH_FWD_NARROW_LAST_BLOCK: -1 (by kernel), 0 (off) or 1 (on)");
// Whether a forward kernel on kBlockN-key blocks narrows its tiles' last block; masked: causal, or the varlen / local
// kernel.
constexpr bool fwd_narrow_last_block(int block_n, bool masked) {
    return fwd_switch_on(kFwdNarrowLastBlock, masked || block_n % 128 != 0);
}
// The narrowest step of a narrowed last block: S's n8 tiles in 64 keys.
constexpr int kFwdNarrowStepTiles = 8;

// kIntraWgOverlap: of a turn's `tiles` n8 column tiles of S_j, those whose exponentials run before the wait for
// P_{j-1} V_{j-1}, whole k16 steps (FLASH_FWD_EXP_SPLIT). Head dims up to 64 (three warpgroups on 128-key blocks) run
// them all before: split there, the forward timed 0.97-1.00 x, 0.99 x over six cells (docs/results.md, section 32).
constexpr int fwd_exp_tiles_before_wait(int head_dim, int tiles) {
    return head_dim <= 64 ? tiles : tiles * kFwdExpSplitPct / 100 / 2 * 2;
}

// FLASH_FWD_RESCALE_BEFORE_PV (docs/kernel_design.md, "Build switches"): under the intra-warpgroup overlap, O's
// rescale by the factors of S_{j-1}'s softmax runs at turn j between the issue of S_j and that of P_{j-1} V_{j-1},
// while S_j is on the tensor cores (FA3's RescaleOBeforeGemm), instead of after the wait for that P V, on the
// warpgroup's path to its next turn. 0: off; 1: every overlap kernel without a rescale threshold; -1 (the default):
// where it is timed faster, the dense non-causal hd128 kernel on 192-key blocks (1.01-1.02 x from 2k keys), and off
// elsewhere (hd80 and hd96 0.97-1.01 x, causal hd128 0.99-1.01 x, hd128's 128-key blocks 0.97 x, causal hd64
// 0.99-1.00 x; docs/results.md, section 51).
#ifndef FLASH_FWD_RESCALE_BEFORE_PV
#define FLASH_FWD_RESCALE_BEFORE_PV -1
#endif
constexpr int kFwdRescaleBeforePv = FLASH_FWD_RESCALE_BEFORE_PV;
static_assert(fwd_switch_valid(kFwdRescaleBeforePv), "FLASH_FWD_RESCALE_BEFORE_PV: -1 (by kernel), 0 (off) or 1 (on)");

// Whether an overlap kernel without a rescale threshold rescales O before its P V is issued: O kVDim columns wide,
// on kBlockN-key blocks; masked: causal, or the varlen / local kernel.
constexpr bool fwd_rescale_before_pv(int v_dim, int block_n, bool masked) {
    return fwd_switch_on(kFwdRescaleBeforePv, v_dim == 128 && block_n == 192 && !masked);
}

// FLASH_FWD_RESCALE_THRESHOLD (powers of two; docs/kernel_design.md, "Build switches"): the online softmax keeps a
// row's running max m_i until the row max of S passes it by more than this many powers of two, the rescale threshold
// of FlashAttention-4's Blackwell forward. P's entries then stay below 2^threshold (exact in bf16 and fp16: the
// rounding is relative), and O's rescale runs only on turns where some row of the warp moved its max, behind a
// warp-uniform branch. 0: off; N: N in every Hopper forward kernel; -1 (the default): kAutoRescaleThreshold where it
// is timed faster, the dense non-causal kernels of head dims up to 64 (1.02-1.04 x), and off elsewhere (0.94-1.02 x;
// the varlen / local kernel, untimed, off).
#ifndef FLASH_FWD_RESCALE_THRESHOLD
#define FLASH_FWD_RESCALE_THRESHOLD -1
#endif
constexpr int kFwdRescaleThreshold = FLASH_FWD_RESCALE_THRESHOLD;
constexpr int kAutoRescaleThreshold = 8;
static_assert(kFwdRescaleThreshold >= -1 && kFwdRescaleThreshold <= 14,
              "FLASH_FWD_RESCALE_THRESHOLD: -1 (by kernel), 0 (off) or 1 to 14 powers of two (P below fp16's 65504)");

// The rescale threshold of a forward kernel with head-dim tile head_dim; masked: causal, or the varlen / local kernel.
constexpr int fwd_rescale_threshold(int head_dim, bool masked) {
    if (kFwdRescaleThreshold >= 0) return kFwdRescaleThreshold;
    return head_dim <= 64 && !masked ? kAutoRescaleThreshold : 0;
}

// kHeadDim is the tile width (whole 64-column blocks); kQKDim <= kHeadDim is the instantiated head dim
// (d_rounded) that Q K^T sums over. Head dims 65-96 run the 128-wide tiles: TMA fills the columns past d with
// zeros, Q K^T skips the k16 steps past kQKDim, and O's extra columns (zeros) are not stored.
// kIntraWgOverlap (FA3 paper, section 3.2): a turn commits S_j and O += P_{j-1} V_{j-1} as two wgmma groups and
// runs the softmax of S_j (mask, m_i, exponentials, l_i) while its own P V is still on the tensor cores; only O's
// rescale and P_j's packing wait for it. P_{j-1}, S_j and acc_o are then live at once.
// kVDim <= kHeadDim: the columns of V that O += P V computes (wgmma's N), and acc_o's width; the tile's columns past
// it (zeros from TMA) are not read.
// kPSmem: each consumer stores P_j (16-bit) into its own 64 x kBlockN tile of shared memory, K-major like Q, and
// O += P V reads it there through a descriptor (FA3's and FA4's "not RS" P V). Under the intra-warpgroup overlap
// P_{j-1} then needs no registers beside S_j and acc_o, which lets three warpgroups' 160 registers hold the overlap
// at 128-key blocks up to head dim 96 (FA4's sm90 tile there, 192 x 128).
// kSpanBytes: Q, K and V in the SW128 layout (128, column blocks of 64) or SW64 (64, column blocks of 32:
// hopper_utils.cuh), which tiles head dims 65-96 at 96 columns instead of 128. P tiles stay SW128.
// kVWidth, kVSpanBytes: V's tiles where they differ from Q's and K's (kHeadDim wide in kSpanBytes): a P V that reads
// P from shared memory reads it once per wgmma, so V keeps whole column blocks where Q and K end in a narrower one.
template <int kHeadDim_, int kBlockN_, int kNStages_, typename Element_, int kQKDim_ = kHeadDim_, int kNWarpgroups_ = 2,
          bool kIntraWgOverlap_ = false, int kVDim_ = kHeadDim_, bool kPSmem_ = false,
          int kSpanBytes_ = kSwizzleRowBytes, int kVWidth_ = kHeadDim_, int kVSpanBytes_ = kSpanBytes_>
struct HopperFwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    static constexpr int kQKDim = kQKDim_;
    static constexpr int kVDim = kVDim_;
    static constexpr int kBlockN = kBlockN_;
    static constexpr int kNStages = kNStages_;
    static constexpr int kMinBlocksPerSm = 1;  // the launch bound that lets ptxas honour setmaxnreg
    static constexpr int kNWarpgroups = kNWarpgroups_;  // consumers, 64 query rows each
    static constexpr int kBlockM = kNWarpgroups * kWarpgroupRows;
    static constexpr int kNConsumerThreads = kNWarpgroups * kWarpgroupThreads;
    static constexpr int kNThreads = kNConsumerThreads + kWarpgroupThreads;  // + the producer
    static constexpr bool kIntraWgOverlap = kIntraWgOverlap_;
    static constexpr bool kPSmem = kPSmem_;
    static constexpr int kSpanBytes = kSpanBytes_;  // the Q and K tiles' SwizzleSpan (and V's by default)
    static constexpr int kBlockElems = SwizzleSpan<kSpanBytes>::kBlockElems;
    static constexpr int kVWidth = kVWidth_;
    static constexpr int kVSpanBytes = kVSpanBytes_;
    // Two smaller changes that ride with the overlap: each consumer warp's lane 0 releases a K, V or Q stage (one
    // mbarrier arrival per warp, after __syncwarp, instead of one per thread), and the row max of S_j runs as
    // kRowMaxChains independent fmaxf chains combined at the end instead of one chain through every column.
    static constexpr bool kArrivePerWarp = kIntraWgOverlap;
    static constexpr int kRowMaxChains = kIntraWgOverlap ? 4 : 1;
    static constexpr int kEmptyArrivals = kArrivePerWarp ? kNConsumerThreads / kWarpSize : kNConsumerThreads;
    // setmaxnreg moves registers between the block's warpgroups, from the launch bound's even split (kEntryRegs per
    // thread: 168 for 384 threads, 128 for 512): the producer keeps 24 (its loop spills 4-12 bytes) and the consumers
    // share the rest, 240 each for two (hd128's consumers need about 234) and 160 for three (hd64: about 154). More
    // for the producer would leave the consumers' inc waiting for registers that never come free.
    static constexpr int kEntryRegs = 65536 / kNThreads / 8 * 8;
    static constexpr int kProducerRegs = 24;
    static constexpr int kConsumerRegs = (kEntryRegs * (kNWarpgroups + 1) - kProducerRegs) / kNWarpgroups / 8 * 8;
    // kIntraWgOverlap keeps three register arrays live through the softmax of S_j: acc_o, S_j (both fp32) and P_{j-1}
    // (16-bit pairs, the in-flight P V's A operand), 128 registers at hd64 with 128-key blocks, 208 at hd128 with 192.
    // The rest of the consumer (m_i, l_i, O's correction factors, row limits, addresses, loop state) takes 24-30 more:
    // the consumers' highest register is 151-153 of 160 at hd64 and 231-237 of 240 at hd128, without spills. With
    // 32 for the rest, the bound admits at most those two's live arrays at their budgets (128 of 160, 208 of 240).
    // kPSmem: P_{j-1} is in shared memory, not registers.
    static constexpr int kOverlapLiveRegs = kVDim / 2 + kBlockN / 2 + (kPSmem ? 0 : kBlockN / 4);
    static constexpr int kOverlapOtherRegs = 32;
    static constexpr int kSmemQBytes = kBlockM * kHeadDim * static_cast<int>(sizeof(Element));
    // A K or V stage: the tile's bytes rounded up to whole swizzle atoms (a 144-key tile 80 columns wide is 22.5 KiB),
    // so that every stage starts 1024-aligned.
    static constexpr int kSmemKTileBytes =
        ceil_div(kBlockN * kHeadDim * static_cast<int>(sizeof(Element)), kSwizzleAtomBytes) * kSwizzleAtomBytes;
    static constexpr int kSmemVTileBytes =
        ceil_div(kBlockN * kVWidth * static_cast<int>(sizeof(Element)), kSwizzleAtomBytes) * kSwizzleAtomBytes;
    // A P tile is whole 64-key column blocks (144 keys: three, the last a quarter used).
    static constexpr int kPTileCols = (kBlockN + kSwizzleBlockElems - 1) / kSwizzleBlockElems * kSwizzleBlockElems;
    static constexpr int kSmemPTileBytes = kPSmem ? kWarpgroupRows * kPTileCols * static_cast<int>(sizeof(Element)) : 0;
    static constexpr int kSmemTileBytes =
        kSmemQBytes + kNStages * (kSmemKTileBytes + kSmemVTileBytes) + kNWarpgroups * kSmemPTileBytes;
    // K full, V full, K empty, V empty per stage; Q full, empty; full and empty per tile slot (the producer's tiles
    // to the consumers, two ahead at most).
    static constexpr int kNTileSlots = 2;
    static constexpr int kNMbarriers = 4 * kNStages + 2 + 2 * kNTileSlots;
    // + the tile slots + one swizzle atom of slack: the kernel rounds the dynamic shared-memory base up to 1024 bytes.
    static constexpr int kSmemBytes = kSmemTileBytes + kNMbarriers * 8 + 4 * kNTileSlots + kSwizzleAtomBytes;

    static_assert(sizeof(Element) == 2, "16-bit inputs: 64 elements per 128-byte row (32 per 64-byte row in SW64)");
    static_assert(TileLayout<kBlockM, kHeadDim, kSpanBytes>::kTailCols == 0 || kSpanBytes == kSwizzleRowBytes,
                  "the tile width: whole column blocks (of 64, or 32 for SW64), or SW128 blocks and a last one "
                  "of 16 or 32 columns (TileLayout)");
    static_assert(kQKDim % 16 == 0 && kQKDim <= kHeadDim && kQKDim > kHeadDim - kBlockElems,
                  "Q K^T's head dim: whole k16 steps in the tile's last column block");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN is wgmma's N for S (a multiple of 16 <= 256)");
    static_assert(TileLayout<kBlockN, kVWidth, kVSpanBytes>::kTailCols == 0 || kVSpanBytes == kSwizzleRowBytes,
                  "V's tile width: whole column blocks, or SW128 blocks and a narrower last one (TileLayout)");
    static_assert(kVDim % 16 == 0 && kVDim <= kVWidth && kVDim > kVWidth - SwizzleSpan<kVSpanBytes>::kBlockElems,
                  "P V's N: whole n16 tiles of O that reach into V's last column block");
    static_assert(kNStages >= 2, "the producer loads K_{j+1} and V_j while turn j computes");
    static_assert(kNWarpgroups >= 2 && kNWarpgroups <= kMaxFwdWarpgroups, "ping-pong needs 2 or 3 warpgroups");
    static_assert(!kIntraWgOverlap || kOverlapLiveRegs + kOverlapOtherRegs <= kConsumerRegs,
                  "intra-warpgroup overlap: acc_o, S_j and P_{j-1} live together, plus the rest of the consumer, must "
                  "fit its registers (three warpgroups' 160 hold hd64's 128-key blocks, not 192)");
    static_assert(kBlockN / kMmaN >= kRowMaxChains, "the row max's chains take at least one n8 tile of S each");
    static_assert(kSmemBytes <= kMaxSmemBytesSm90, "forward tiles must fit Hopper shared memory");
    static_assert(kConsumerRegs <= 256 && kProducerRegs + kNWarpgroups * kConsumerRegs <= kEntryRegs * (kNWarpgroups + 1),
                  "setmaxnreg: the warpgroups' registers must fit what the block was launched with");
};

// Which head dims have a Hopper forward. The kernels exist only when the build includes sm_90a
// (build.py defines FLASH_KERNEL_SM90A); otherwise every head dim runs the sm80 kernels.
// A config runs Traits from kLongKeys keys up and ShortTraits below; dense non-causal calls run the one whose turns
// cost less (wider_blocks_pay). Wider key blocks (192 at hd65-80, hd128) cut the turns per key by a third, and with
// them each turn's fixed work (barriers, the rows' max and sum, O's rescale), which in causal calls pays from 2k keys
// up. Below, where a tile has few key blocks, the causal diagonal's masked block grows with them, and they are slower.
// HopperFwdTraits<head dim, Bc, K/V stages, element, kQKDim, consumer warpgroups, intra-warpgroup overlap>:
// The intra-warpgroup overlap, one build switch per tile (docs/kernel_design.md, "Build switches"):
//   FLASH_FWD_INTRA_WG_OVERLAP (on): hd128's 192-key blocks, where it is faster;
//   FLASH_FWD_INTRA_WG_OVERLAP_BC128 (on): the 128-key blocks of two warpgroups (hd65-80, hd128);
//   FLASH_FWD_INTRA_WG_OVERLAP_HD64 (on): hd64's three warpgroups.
// FLASH_FWD_NARROW_PV (on): head dims 65-96 (the 128-wide tiles with kQKDim = 96) compute O += P V over 96 columns
// (kVDim, an n96 wgmma reading 1.5 of V's 64-column blocks) instead of 128, a quarter less P V work, and keep O in
// 48 registers instead of 64.
// FLASH_NARROW_HD80 (on; the forward's and the backward's hd96 configs): head dims 65-80 (GPT3-2.7B's 80) run
// twins of hd96's kernels whose products over the head dim take 80 columns instead of 96: Q K^T (S^T and dP^T in the
// backward) in 5 k16 steps instead of 6, O += P V (dV, dK) as n80 wgmmas reading 1.25 of the operand's 64-column
// blocks. The columns skipped are zeros past d (TMA fills them), so every sum is the same.
// FLASH_FWD_HD96_BC192 (on): head dims 65-80 (65-96 without FLASH_FWD_HD96_P_SMEM) from 2k keys (dense non-causal
// calls: where their turns cost less, FLASH_FWD_TURN_KEYS) on hd128's long tile (192-key blocks, 2 stages, the
// intra-warpgroup overlap) instead of 128-key blocks: a third fewer turns per key, each turn's fixed work (barriers,
// row max and sum, O's rescale) spread over more keys.
// FLASH_FWD_HD96_P_SMEM (on): head dims 81-96 at every length on FA4's sm90 tile there: three consumer warpgroups
// (192 query rows) x 128-key blocks on 2 stages, P through shared memory (kPSmem) and the intra-warpgroup overlap,
// 181 KB (224 KB in SW128). Three warpgroups with P in registers cannot hold the overlap in 160 registers, and
// without it ran slower than two; a turn's matmuls at hd96 are 3/4 of hd128's against the same softmax, which a ring
// of three hides.
// FLASH_NARROW_HD80's twins keep the two-warpgroup tiles: on this one they were no faster.
// FLASH_FWD_HD96_BC144 (on; with FLASH_FWD_HD96_P_SMEM and FLASH_FWD_HD96_SW64): dense non-causal calls at head dims
// 81-96 on that tile with 144-key blocks (FA4's non-causal tile there; the config's DenseTraits, 216 KB) where their
// turns cost less than 128-key ones' (wider_blocks_pay): a ninth fewer turns per key. Non-causal hd96 forward
// 1.01-1.03 x at 8k-16k keys in three runs (docs/results.md, section 58). Causal calls keep the 128-key blocks:
// on 144 they ran 0.97-1.03 x at 2k-16k keys (one run).
// FLASH_HD80_TAIL (on; the forward's and the backward's hd80 twins, FLASH_NARROW_HD80): Q, K and V (and dO) tiles 80
// columns wide, 64 in SW128 and the last 16 in SW32 (TileLayout, hopper_utils.cuh), instead of 96 in SW64 (forward)
// or 128 in SW128 (backward): TMA lands a 64-row tile in 342 cycles against 509 and 443 with every SM loading
// (bench/layout_rates.cu), its last box no longer half or three quarters past d. Q K^T (S^T, dP^T) takes its fifth
// k16 step from the SW32 block, O += P V (dV, dK) and the backward's second dQ warpgroup an n16 wgmma over it. The
// forward's causal tile from kLongKeys (FLASH_FWD_HD80_CAUSAL_3WG) takes Q and K on these tiles and keeps V on SW64's
// 96-wide ones: its P comes from shared memory, which an n16 wgmma would read again (docs/results.md, 48-49).
// FLASH_FWD_HD96_SW64 (on): the hd96 configs' Q, K and V tiles 96 columns wide in the SW64 layout instead of 128
// in SW128: TMA writes a quarter fewer bytes per stage (the quarter it drops holds only zeros), and the tiles take
// 3/4 of the shared memory (169 KB for the two-warpgroup tiles, 225 KB in SW128). The forward at head dims 81-96 runs
// 2% faster, at 65-80 about 1% (docs/results.md, section 29). The freed shared memory admits 144-key blocks on the
// three-warpgroup tile (FA3's and FA4's tile there): non-causal hd81-96 (FLASH_FWD_HD96_BC144 above) and causal
// hd65-80 from kLongKeys keys (FLASH_FWD_HD80_CAUSAL_3WG below) run them; on non-causal hd65-80 they gain nothing
// beyond the noise.
#ifndef FLASH_FWD_INTRA_WG_OVERLAP
#define FLASH_FWD_INTRA_WG_OVERLAP 1
#endif
#ifndef FLASH_FWD_INTRA_WG_OVERLAP_BC128
#define FLASH_FWD_INTRA_WG_OVERLAP_BC128 1
#endif
#ifndef FLASH_FWD_INTRA_WG_OVERLAP_HD64
#define FLASH_FWD_INTRA_WG_OVERLAP_HD64 1
#endif
#ifndef FLASH_FWD_NARROW_PV
#define FLASH_FWD_NARROW_PV 1
#endif
#ifndef FLASH_FWD_HD96_BC192
#define FLASH_FWD_HD96_BC192 1
#endif
#ifndef FLASH_NARROW_HD80
#define FLASH_NARROW_HD80 1
#endif
#ifndef FLASH_FWD_HD96_P_SMEM
#define FLASH_FWD_HD96_P_SMEM 1
#endif
#ifndef FLASH_FWD_HD96_BC144
#define FLASH_FWD_HD96_BC144 1
#endif
#ifndef FLASH_FWD_HD96_SW64
#define FLASH_FWD_HD96_SW64 1
#endif
#ifndef FLASH_FWD_HD80_CAUSAL_3WG
#define FLASH_FWD_HD80_CAUSAL_3WG 1
#endif
#ifndef FLASH_HD80_TAIL
#define FLASH_HD80_TAIL 1
#endif
// FLASH_FWD_TURN_KEYS (24): which of a config's two tiles its dense non-causal calls run over T keys (causal, varlen
// and windowed calls: the wider key blocks from kLongKeys, 2048). A turn costs its block's keys plus a fixed part,
// about 24 keys' worth (barriers, the rows' max and sum, O's rescale), and a partial last block costs as much as a
// whole one, so the 192-key blocks run where ceil(T / 192) (192 + 24) < ceil(T / 128) (128 + 24)
// (bench/turn_model.py): of the multiples of 128 keys, all but 128, 256, 512, 640, 896, 1024, 1408, 1792 and 2176,
// and every length above 2176. At hd128 and hd80 this picks the faster tile, or one within 1.5% of it, at each of the
// 41 lengths timed from 512 to 8192 keys (docs/results.md, sections 38 and 39). The model counts a partial last block
// whole, also where FLASH_FWD_NARROW_LAST_BLOCK narrows the 192-key blocks' last one: against 192-key blocks at every
// such length, its choice of 128-key blocks ran 1.01-1.04 x at 512 and 1024 keys and 0.97-0.99 x at 1792 and 2176
// (docs/results.md, section 53). A large value runs the wider blocks wherever they take fewer turns (129-192 keys and
// from 257).
#ifndef FLASH_FWD_TURN_KEYS
#define FLASH_FWD_TURN_KEYS 24
#endif
constexpr bool kFwdIntraWgOverlap = FLASH_FWD_INTRA_WG_OVERLAP != 0;
constexpr bool kFwdIntraWgOverlapBc128 = FLASH_FWD_INTRA_WG_OVERLAP_BC128 != 0;
constexpr bool kFwdIntraWgOverlapHd64 = FLASH_FWD_INTRA_WG_OVERLAP_HD64 != 0;
constexpr bool kFwdNarrowPv = FLASH_FWD_NARROW_PV != 0;
constexpr bool kFwdHd96Bc192 = FLASH_FWD_HD96_BC192 != 0;
constexpr bool kFwdHd96PSmem = FLASH_FWD_HD96_P_SMEM != 0;
constexpr int kFwdHd96Span = FLASH_FWD_HD96_SW64 != 0 ? 64 : 128;  // the hd96 configs' Q, K, V SwizzleSpan
// Their tile width: head dim 96 rounded up to whole column blocks of that span (96 in SW64, 128 in SW128).
constexpr int kFwdHd96Block = SwizzleSpan<kFwdHd96Span>::kBlockElems;
constexpr int kFwdHd96Width = (96 + kFwdHd96Block - 1) / kFwdHd96Block * kFwdHd96Block;
// FLASH_FWD_HD96_P_SMEM's tile for hd96's config with Q K^T over kQK columns: head dims 81-96 (kQK = 96) only.
constexpr bool fwd_hd96_p_smem(int qk_dim) { return kFwdHd96PSmem && qk_dim == 96; }
constexpr int kNarrowHd80Dim = FLASH_NARROW_HD80 != 0 ? 80 : 0;  // the hd96 configs' kNarrowDim
// FLASH_HD80_TAIL: the width and SwizzleSpan of the hd96 configs' two-warpgroup tiles with Q K^T over qk_dim columns:
// 80 in SW128 (64 columns, then 16 in SW32) at qk_dim 80, else FLASH_FWD_HD96_SW64's.
constexpr bool kHd80Tail = FLASH_HD80_TAIL != 0;
constexpr int fwd_hd96_width(int qk_dim) { return kHd80Tail && qk_dim == 80 ? 80 : kFwdHd96Width; }
constexpr int fwd_hd96_span(int qk_dim) { return kHd80Tail && qk_dim == 80 ? kSwizzleRowBytes : kFwdHd96Span; }

// A Hopper config's kNarrowDim (> 0: head dims up to it run its NarrowTraits, and in the forward its
// NarrowShortTraits), or 0 where it names none.
template <typename Config, typename = void>
struct NarrowDimOf { static constexpr int value = 0; };
template <typename Config>
struct NarrowDimOf<Config, std::void_t<decltype(Config::kNarrowDim)>> {
    static constexpr int value = Config::kNarrowDim;
};
// The tile of causal dense calls with head dims up to a Hopper config's kNarrowDim from kLongKeys keys up: its
// CausalNarrowTraits where it names one, else its NarrowTraits.
template <typename Config, typename = void>
struct CausalNarrowOf { using type = typename Config::NarrowTraits; };
template <typename Config>
struct CausalNarrowOf<Config, std::void_t<typename Config::CausalNarrowTraits>> {
    using type = typename Config::CausalNarrowTraits;
};
// The tile of dense non-causal calls with head dims above a Hopper config's kNarrowDim, where its turns cost less
// than ShortTraits': its DenseTraits where it names one, else its Traits.
template <typename Config, typename = void>
struct DenseLongOf { using type = typename Config::Traits; };
template <typename Config>
struct DenseLongOf<Config, std::void_t<typename Config::DenseTraits>> { using type = typename Config::DenseTraits; };
// Whether a dense non-causal call over seqlen_k keys runs Long's wider key blocks rather than Short's: where Long's
// turns cost less, each its block's keys plus FLASH_FWD_TURN_KEYS, a partial last block as much as a whole one.
template <typename Long, typename Short>
constexpr bool wider_blocks_pay(int seqlen_k) {
    const auto turns_cost = [seqlen_k](int block_keys) {
        return static_cast<int64_t>(ceil_div(seqlen_k, block_keys)) * (block_keys + FLASH_FWD_TURN_KEYS);
    };
    return turns_cost(Long::kBlockN) < turns_cost(Short::kBlockN);
}
template <int kHeadDim, typename Element> struct HopperFwdConfig { static constexpr bool kAvailable = false; };
#ifdef FLASH_KERNEL_SM90A
template <typename E> struct HopperFwdConfig<64, E> {
    static constexpr bool kAvailable = true;
    // Three warpgroups (192 query rows) on 128-key blocks, causal or not: at hd64 a warpgroup's softmax takes about
    // as long as its turn on the tensor cores (64 exponentials per thread against two 64x128x64 matmuls), and in a
    // ring of three it hides behind two other warpgroups' turns instead of one: faster than two warpgroups on
    // 256-key blocks, causal too, since causal blocks end at Tq (fwd_tile_scheduler.h) and the short block is the
    // one with the fewest keys.
    // The intra-warpgroup overlap keeps P_{j-1} beside S_j (FA3's and FA4's hd64 tile, 192 x 128 with P in
    // registers): 121 KB, the consumers' highest register 151-153 of 160 (S of 256 keys would not fit). Every
    // exponential runs on the SFU, which is not this tile's limit: FA4's hd64 forward, all on the SFU too, keeps it
    // at 65% of its peak rate (Nsight Compute on one H200).
    using Traits = HopperFwdTraits<64, 128, 3, E, 64, 3, kFwdIntraWgOverlapHd64>;
    using ShortTraits = Traits;
    static constexpr int kLongKeys = 0;
};
template <typename E> struct HopperFwdConfig<96, E> {
    static constexpr bool kAvailable = true;
    // hd128's tiles, 6 of 8 k16 steps in Q K^T and O over 96 columns. 192-key blocks without the narrow P V and
    // the overlap were slower here (hd80 causal at 4k-8k); with both, FLASH_FWD_HD96_BC192 runs them (from 2k keys in
    // causal calls).
    // The tiles with Q K^T over kQK columns and P V over kV: 128-key blocks (two warpgroups, 3 stages; 169 KB) and
    // 192-key blocks (two warpgroups, 2 stages, the intra-warpgroup overlap; 169 KB). Three warpgroups on 192 query
    // rows x 128 keys, P in registers and no overlap, ran 4-18% slower than these.
    // FLASH_FWD_HD96_SW64: every tile 96 columns wide (SW64), else 128 (SW128).
    static constexpr int kW = kFwdHd96Width, kSpan = kFwdHd96Span;
    // FLASH_HD80_TAIL: those with Q K^T over 80 columns are 80 wide, 64 columns in SW128 and 16 in SW32.
    template <int kQK, int kV>
    using Tile128 = HopperFwdTraits<fwd_hd96_width(kQK), 128, 3, E, kQK, 2, kFwdIntraWgOverlapBc128, kV, false,
                                    fwd_hd96_span(kQK)>;
    template <int kQK, int kV>
    using Tile192 = HopperFwdTraits<fwd_hd96_width(kQK), 192, 2, E, kQK, 2, kFwdIntraWgOverlap, kV, false,
                                    fwd_hd96_span(kQK)>;
    // FLASH_FWD_HD96_P_SMEM: 192 x 128 on three warpgroups, P through shared memory, at every length, for Q K^T over
    // 96 columns (head dims 81-96) only.
    template <int kQK, int kV, int kBlockN = 128>
    using Tile3Wg = HopperFwdTraits<kW, kBlockN, 2, E, kQK, 3, true, kV, true, kSpan>;
    template <int kQK, int kV>
    using Short = std::conditional_t<fwd_hd96_p_smem(kQK), Tile3Wg<kQK, kV>, Tile128<kQK, kV>>;
    template <int kQK, int kV>
    using Long = std::conditional_t<kFwdHd96Bc192 && !fwd_hd96_p_smem(kQK), Tile192<kQK, kV>, Short<kQK, kV>>;
    static constexpr int kVDim = kFwdNarrowPv ? 96 : kW;
    using ShortTraits = Short<96, kVDim>;
    using Traits = Long<96, kVDim>;
#if FLASH_FWD_HD96_BC144 && FLASH_FWD_HD96_P_SMEM && FLASH_FWD_HD96_SW64
    // FLASH_FWD_HD96_BC144 (above): dense non-causal calls on Tile3Wg's 144-key blocks, 216 KiB in SW64's tiles.
    using DenseTraits = Tile3Wg<96, kVDim, 144>;
#endif
    static constexpr int kLongKeys = 2048;  // causal, varlen, windowed calls: Long from here (launch_fwd_hopper_tiles)
    // FLASH_NARROW_HD80: the same tiles with Q K^T and P V over 80 columns, for head dims up to 80.
    static constexpr int kNarrowDim = kNarrowHd80Dim;
    using NarrowShortTraits = Short<80, 80>;
    using NarrowTraits = Long<80, 80>;
    // FLASH_FWD_HD80_CAUSAL_3WG: causal calls at head dims 65-80 from kLongKeys keys up on FA4's tile there, 192 query
    // rows x 144 keys on three consumer warpgroups, P through shared memory: in SW64's 96-column tiles only (SW128's
    // take 270 KiB), 216 KiB. FLASH_HD80_TAIL: Q and K on 80-wide tiles, V on the 96-wide SW64 ones (202 KiB), whose
    // whole column blocks take O += P V in one wgmma: on 80-wide tiles it would be two, each reading P from shared
    // memory, and ran 0.97-0.99 x (docs/results.md, section 48). Below kLongKeys it runs 4% slower than
    // NarrowShortTraits at 1024 keys.
#if FLASH_FWD_HD80_CAUSAL_3WG && FLASH_FWD_HD96_SW64
    using CausalNarrowTraits = HopperFwdTraits<fwd_hd96_width(80), 144, 2, E, 80, 3, true, 80, true,
                                               fwd_hd96_span(80), kW, kSpan>;
#endif
};
template <typename E> struct HopperFwdConfig<128, E> {
    static constexpr bool kAvailable = true;
    // Two consumer warpgroups: O alone is 64 registers of the 160 that three would leave.
    using Traits = HopperFwdTraits<128, 192, 2, E, 128, 2, kFwdIntraWgOverlap>;       // 225 KB of shared memory
    using ShortTraits = HopperFwdTraits<128, 128, 3, E, 128, 2, kFwdIntraWgOverlapBc128>;  // 225 KB
    static constexpr int kLongKeys = 2048;
};
#endif

}  // namespace flash
