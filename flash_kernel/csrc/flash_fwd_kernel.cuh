// FlashAttention-2 forward (Dao, 2023, "FlashAttention-2", Algorithm 1), mma.sync on sm80+.
//
// Algorithm 1 (one thread block per query block Q_i, head and batch; the paper's line numbers):
//   3  for each query block i (the grid)
//   4    load Q_i (kBlockM x d) into shared memory
//   5    O_i = 0, l_i = 0, m_i = -inf                      (registers, per row)
//   6    for each K/V block j (skipping j above the diagonal when causal):
//   7      load K_j, V_j into shared memory (cp.async, 2-3 stages: j+1 loads while j computes)
//   8      S_ij = Q_i K_j^T                                 (mma.sync m16n8k16, fp32 accumulators)
//   9      m_new = max(m_i, rowmax(S_ij)); P_ij = exp(S_ij - m_new); l_i = e^{m_i - m_new} l_i + rowsum(P_ij)
//  10      O_i = diag(e^{m_i - m_new}) O_i + P_ij V_j       (P_ij goes from C to A fragments in registers)
//  12    O_i = diag(l_i)^-1 O_i                              (deferred normalisation, once)
//  13    L_i = m_i + log(l_i)                                (natural-log LSE, stored in fp32)
//  14-15 write O_i and L_i
//
// Softmax runs in base 2: exp(scale*(s - m)) = exp2(s*scale*log2e - m*scale*log2e), one FFMA + EX2 per
// score. Split-Q: warp w owns query rows [16*kMTiles*w, 16*kMTiles*(w+1)) of the block, so rows never
// cross warps and the row max/sum need only 2 shuffles inside a quad. Causal (bottom-right aligned, as flash-attn):
// query i sees key j iff j <= i + Tk - Tq; K/V blocks wholly above the diagonal are never loaded and
// only tiles that cross the diagonal or the sequence end pay for masking. A row with no visible key
// (Tq > Tk, causal) gets O = 0 and LSE = +inf, which makes the backward's P = exp(S - LSE) = 0.
//
// kVarlenWindow (its own instantiation; the dense ones compile without its branches): per-sequence lengths and row
// offsets from cu_seqlens (grid.z runs over sequences, grid.x over max_seqlen_q's blocks; a block past its
// sequence's end exits without writing), and the sliding window read at run time, causal as window_right = 0
// (seq_bounds, flash_params.h): query i sees key j iff i + off - left <= j <= i + off + right, off = Tk - Tq of
// the sequence. Only key blocks [n_block_min, n_block_max) that hold a visible key are visited, so the cost
// falls with the window; tiles that cross a window edge or the sequence end are masked. Rows that see no key at
// all (a window past the sequence's keys, a sequence without keys) get O = 0 and LSE = +inf, as above.
#pragma once

#include <cmath>

#include "causal_order.h"
#include "flash_params.h"
#include "kernel_traits.h"
#include "utils.cuh"

namespace flash {

template <typename Traits, bool kIsCausal, bool kVarlenWindow = false>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocksPerSm)
    flash_fwd_kernel(const FwdParams params) {
    static_assert(!(kIsCausal && kVarlenWindow), "kVarlenWindow reads causal as window_right = 0");
    using Element = typename Traits::Element;
    constexpr int kBlockM = Traits::kBlockM;
    constexpr int kBlockN = Traits::kBlockN;
    constexpr int kHeadDim = Traits::kHeadDim;
    constexpr int kNThreads = Traits::kNThreads;
    using Tile = typename Traits::Tile;  // shared-memory layout of Q, K, V (smem_tile.h)
    constexpr int kNTilesN = kBlockN / kMmaN;    // n8 tiles of S per warp
    constexpr int kNTilesD = kHeadDim / kMmaN;   // n8 tiles of O per warp
    constexpr int kKStepsD = kHeadDim / kMmaK;   // k16 steps of Q K^T
    constexpr int kKStepsN = kBlockN / kMmaK;    // k16 steps of P V
    constexpr int kMTiles = Traits::kMTilesPerWarp;
    constexpr int kWarpRows = kMTiles * kMmaM;   // query rows per warp (split-Q)
    constexpr bool kStepped = Traits::kSteppedCopy;  // copy_tile_async_stepped (FwdSteppedTraits) or copy_tile_async

    extern __shared__ __align__(16) unsigned char smem_raw[];
    Element* sQ = reinterpret_cast<Element*>(align_smem<Tile::kAlign>(smem_raw));  // [kBlockM][kHeadDim] as Tile
    Element* sK = sQ + Traits::kSmemQElems;                         // [kNStages][kBlockN][kHeadDim] as Tile
    Element* sV = sK + Traits::kNStages * Traits::kSmemKVTileElems;  // [kNStages][kBlockN][kHeadDim] as Tile

    // Causal: longest blocks first, heads in L2-sized groups (causal_order.h). kVarlenWindow: the last query blocks
    // first (the longest ones when causal).
    const BlockCoord coord = kVarlenWindow ? BlockCoord{static_cast<int>(gridDim.x - 1 - blockIdx.x),
                                                        static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)}
                                           : fwd_block_coord<kIsCausal>(params.causal_group_heads, params.num_sms);
    const int m_block = coord.block, bidh = coord.head, bidb = coord.batch;
    const int tid = threadIdx.x;
    const int warp = tid / kWarpSize;
    const int lane = tid % kWarpSize;
    const SeqBounds seq = kVarlenWindow ? seq_bounds(params, bidb)
                                        : SeqBounds{params.seqlen_q, params.seqlen_k, 0, 0, -1, -1};
    const int seqlen_q = seq.seqlen_q;
    const int seqlen_k = seq.seqlen_k;
    const int causal_offset = seqlen_k - seqlen_q;  // query i sees keys j <= i + causal_offset
    const int row0 = m_block * kBlockM;
    if (kVarlenWindow && row0 >= seqlen_q) return;  // past this sequence's queries: nothing to write
    const int valid_rows = min(kBlockM, seqlen_q - row0);

    const Element* q = static_cast<const Element*>(params.q_ptr) + bidb * params.q_batch_stride +
                       bidh * params.q_head_stride + (seq.q_row0 + row0) * params.q_row_stride;
    const int bidh_k = bidh / params.h_h_k_ratio;  // GQA/MQA: the kv head of this query head
    const Element* k = static_cast<const Element*>(params.k_ptr) + bidb * params.k_batch_stride +
                       bidh_k * params.k_head_stride + seq.k_row0 * params.k_row_stride;
    const Element* v = static_cast<const Element*>(params.v_ptr) + bidb * params.v_batch_stride +
                       bidh_k * params.v_head_stride + seq.k_row0 * params.v_row_stride;
    Element* o = static_cast<Element*>(params.o_ptr) + bidb * params.o_batch_stride + bidh * params.o_head_stride +
                 (seq.q_row0 + row0) * params.o_row_stride;
    float* lse = params.lse_ptr + (kVarlenWindow ? lse_row0(params, seq, bidb, bidh)
                                                 : (static_cast<int64_t>(bidb) * params.h + bidh) * seqlen_q) + row0;

    int n_block_min = 0;
    int n_block_max = ceil_div(seqlen_k, kBlockN);
    if (kIsCausal) {
        // Blocks whose first key is beyond the last visible key of this block's last row are skipped.
        n_block_max = min(n_block_max, ceil_div(row0 + kBlockM + causal_offset, kBlockN));
    }
    if constexpr (kVarlenWindow) {
        // Key blocks wholly right of the last row's window, or left of the first row's, are skipped.
        if (seq.window_right >= 0) {
            n_block_max = min(n_block_max, floor_div(row0 + valid_rows - 1 + causal_offset + seq.window_right, kBlockN) + 1);
        }
        if (seq.window_left >= 0) n_block_min = max(0, floor_div(row0 + causal_offset - seq.window_left, kBlockN));
    }
    if (n_block_max <= n_block_min) {  // every row of this block sees no key (causal with Tq > Tk, a window, Tk = 0)
        write_rows_without_keys<kBlockM, kHeadDim, kNThreads>(o, params.o_row_stride, lse, valid_rows, params.d);
        return;
    }

    // Alg. 1 line 4: Q_i -> shared memory; line 7 for the first j: K_j, V_j -> stage 0. One commit group.
    copy_tile<kStepped, kBlockM, Tile, kNThreads>(sQ, q, params.q_row_stride, valid_rows, params.d);
    const int first_key = n_block_min * kBlockN;
    copy_tile<kStepped, kBlockN, Tile, kNThreads>(sK, k + first_key * params.k_row_stride, params.k_row_stride,
                                                  seqlen_k - first_key, params.d);
    copy_tile<kStepped, kBlockN, Tile, kNThreads>(sV, v + first_key * params.v_row_stride, params.v_row_stride,
                                                  seqlen_k - first_key, params.d);
    cp_async_commit();

    // Alg. 1 line 5. Warp w owns kMTiles m16 row tiles: rows warp * kWarpRows + mt * 16 + {g, g + 8}
    // (g = lane / 4). Each K/V fragment read from shared memory feeds kMTiles MMAs.
    float acc_o[kMTiles][kNTilesD][4];
    // m_i: the rows' max of the raw scores; l_i: this thread's partial row sums, quad-reduced at the end.
    float m_i[kMTiles][2], l_i[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int i = 0; i < kNTilesD; ++i) acc_o[mt][i][0] = acc_o[mt][i][1] = acc_o[mt][i][2] = acc_o[mt][i][3] = 0.f;
        m_i[mt][0] = m_i[mt][1] = -INFINITY;
        l_i[mt][0] = l_i[mt][1] = 0.f;
    }

    // Q fragments for all k16 steps, loaded once (kQInRegs). When they do not fit, the array shrinks to one
    // entry and the `kQInRegs ? i : 0` indices below stay compile-time constants and in range.
    uint32_t q_frag[Traits::kQInRegs ? kMTiles : 1][Traits::kQInRegs ? kKStepsD : 1][4];

    // ldmatrix lane addressing (see utils.cuh): A / non-transposed B tiles and transposed B tiles.
    const int a_row = (lane % 8) + ((lane / 8) % 2) * 8, a_col = (lane / 16) * 8;   // A: 16x16 from row-major
    const int b_row = (lane % 8) + (lane / 16) * 8, b_col = ((lane / 8) % 2) * 8;   // B from [n][k] rows
    const int bt_row = (lane % 8) + ((lane / 8) % 2) * 8, bt_col = (lane / 16) * 8; // B^T from [k][n] rows
    // Lane addresses of this warp's first ldmatrix in sQ, and in stage 0 of sK / sV; Tile::step walks from them.
    const uint32_t sQ_warp = smem_addr(sQ + Tile::index(warp * kWarpRows + a_row, a_col));
    const uint32_t sK_lane = smem_addr(sK + Tile::index(b_row, b_col));
    const uint32_t sV_lane = smem_addr(sV + Tile::index(bt_row, bt_col));
    constexpr uint32_t kKVTileBytes = Traits::kSmemKVTileElems * sizeof(Element);

    const float scale_log2 = params.scale_softmax_log2;
    const int g = lane / 4, t = lane % 4;

    for (int n_block = n_block_min; n_block < n_block_max; ++n_block) {
        // Stages count from the first visited block. The dense kernels keep `n_block` itself: written as
        // n_block - 0, ptxas allocates the hd128 kernel's registers differently (20 more bytes of spill).
        const int stage = (kVarlenWindow ? n_block - n_block_min : n_block) % Traits::kNStages;
        if (n_block + 1 < n_block_max) {
            // Alg. 1 line 7, prefetch of j+1 into the next stage while j computes. That stage was last
            // read in iteration j+1-kNStages: with 2 stages that is j-1, which ended with a barrier; with 3
            // it is j-2, and every warp has since passed the barrier at the top of iteration j-1.
            const int next = ((kVarlenWindow ? n_block - n_block_min : n_block) + 1) % Traits::kNStages;
            const int key0 = (n_block + 1) * kBlockN;
            copy_tile<kStepped, kBlockN, Tile, kNThreads>(
                sK + next * Traits::kSmemKVTileElems, k + key0 * params.k_row_stride, params.k_row_stride,
                seqlen_k - key0, params.d);
            copy_tile<kStepped, kBlockN, Tile, kNThreads>(
                sV + next * Traits::kSmemKVTileElems, v + key0 * params.v_row_stride, params.v_row_stride,
                seqlen_k - key0, params.d);
        }
        cp_async_commit();  // possibly empty, so that wait<1> below always means "stage j has landed"
        cp_async_wait<1>();
        __syncthreads();

        if (Traits::kQInRegs && n_block == n_block_min) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
                for (int kk = 0; kk < kKStepsD; ++kk) {
                    ldmatrix_tile<Tile>(q_frag[Traits::kQInRegs ? mt : 0][Traits::kQInRegs ? kk : 0], sQ_warp,
                                        mt * kMmaM, kk * kMmaK);
                }
            }
        }

        // Alg. 1 line 8: S = Q_i K_j^T, (kWarpRows x kBlockN) per warp.
        const uint32_t sK_stage = sK_lane + stage * kKVTileBytes;
        const uint32_t sV_stage = sV_lane + stage * kKVTileBytes;
        float s[kMTiles][kNTilesN][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int i = 0; i < kNTilesN; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < kKStepsD; ++kk) {
            uint32_t a[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                if (Traits::kQInRegs) {
#pragma unroll
                    for (int r = 0; r < 4; ++r) a[mt][r] = q_frag[Traits::kQInRegs ? mt : 0][Traits::kQInRegs ? kk : 0][r];
                } else {
                    ldmatrix_tile<Tile>(a[mt], sQ_warp, mt * kMmaM, kk * kMmaK);
                }
            }
#pragma unroll
            for (int np = 0; np < kNTilesN / 2; ++np) {
                uint32_t b[4];
                ldmatrix_tile<Tile>(b, sK_stage, np * 16, kk * kMmaK);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    Mma<Element>::run(s[mt][2 * np], a[mt], b[0], b[1]);
                    Mma<Element>::run(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                }
            }
        }

        // Masking only where the tile crosses the sequence end, (causal) the diagonal or (kVarlenWindow) an edge of
        // the window of some row.
        const int key0 = n_block * kBlockN;
        bool need_mask = key0 + kBlockN > seqlen_k || (kIsCausal && key0 + kBlockN - 1 > row0 + causal_offset);
        if constexpr (kVarlenWindow) {
            need_mask = need_mask ||
                        (seq.window_right >= 0 && key0 + kBlockN - 1 > row0 + causal_offset + seq.window_right) ||
                        (seq.window_left >= 0 && key0 < row0 + kBlockM - 1 + causal_offset - seq.window_left);
        }
        if (need_mask) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const int qrow = row0 + warp * kWarpRows + mt * kMmaM + g;
#pragma unroll
                for (int i = 0; i < kNTilesN; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = key0 + i * kMmaN + 2 * t + (e & 1);
                        const int row = qrow + (e >= 2 ? 8 : 0);
                        bool masked = col >= seqlen_k || (kIsCausal && col > row + causal_offset);
                        if constexpr (kVarlenWindow) {
                            masked = masked ||
                                     (seq.window_right >= 0 && col > row + causal_offset + seq.window_right) ||
                                     (seq.window_left >= 0 && col < row + causal_offset - seq.window_left);
                        }
                        if (masked) s[mt][i][e] = -INFINITY;
                    }
                }
            }
        }

        // Alg. 1 line 9: online softmax. r = 0 for row g (c0, c1), r = 1 for row g + 8 (c2, c3).
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = m_i[mt][r];
#pragma unroll
                for (int i = 0; i < kNTilesN; ++i) mx = fmaxf(mx, fmaxf(s[mt][i][2 * r], s[mt][i][2 * r + 1]));
                mx = quad_max(mx);
                // A row with nothing visible yet keeps max -inf; using 0 as its offset gives exp2(-inf) = 0
                // instead of exp2(-inf - -inf) = NaN.
                const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
                const float correction = fast_exp2(m_i[mt][r] * scale_log2 - max_scaled);
                m_i[mt][r] = mx;
                l_i[mt][r] *= correction;
#pragma unroll
                for (int i = 0; i < kNTilesD; ++i) {
                    acc_o[mt][i][2 * r] *= correction;
                    acc_o[mt][i][2 * r + 1] *= correction;
                }
#pragma unroll
                for (int i = 0; i < kNTilesN; ++i) {
                    s[mt][i][2 * r] = fast_exp2(fmaf(s[mt][i][2 * r], scale_log2, -max_scaled));
                    s[mt][i][2 * r + 1] = fast_exp2(fmaf(s[mt][i][2 * r + 1], scale_log2, -max_scaled));
                    l_i[mt][r] += s[mt][i][2 * r] + s[mt][i][2 * r + 1];
                }
            }
        }

        // Alg. 1 line 10: O += P V. The C fragments of S tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
        for (int kk = 0; kk < kKStepsN; ++kk) {
            uint32_t a[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                a[mt][0] = pack2<Element>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                a[mt][1] = pack2<Element>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                a[mt][2] = pack2<Element>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                a[mt][3] = pack2<Element>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dp = 0; dp < kNTilesD / 2; ++dp) {
                uint32_t b[4];
                ldmatrix_tile<Tile, true>(b, sV_stage, kk * kMmaK, dp * 16);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    Mma<Element>::run(acc_o[mt][2 * dp], a[mt], b[0], b[1]);
                    Mma<Element>::run(acc_o[mt][2 * dp + 1], a[mt], b[2], b[3]);
                }
            }
        }
        if (Traits::kNStages == 2) __syncthreads();  // stage j is refilled by the prefetch of iteration j+1
    }

    // Alg. 1 lines 12-15: O = O / l, LSE = m * scale + log(l), written out. O is staged through this warp's own rows
    // of sQ (only this warp ever read them, so no block barrier is needed before overwriting them) so
    // the global stores are 16-byte and row-contiguous. Where Q is re-read from shared memory every K/V tile
    // (!kQInRegs) and no barrier ends the loop (3 stages), a lane's O stores may hit rows that other lanes of the
    // warp addressed in the last ldmatrix of Q: __syncwarp orders them (racecheck flagged the hd64 forward).
    if constexpr (!Traits::kQInRegs) __syncwarp();
    Element* sO = sQ;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
        float inv_sum[2];
        const int r0 = warp * kWarpRows + mt * kMmaM + g;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float l = quad_sum(l_i[mt][r]);
            const bool empty = l == 0.f || l != l;  // no visible key: O stays 0, LSE = +inf
            inv_sum[r] = empty ? 0.f : 1.f / l;
            const float lse_row = empty ? INFINITY : m_i[mt][r] * params.scale_softmax + logf(l);
            if (t == 0 && r0 + 8 * r < valid_rows) lse[r0 + 8 * r] = lse_row;
        }
#pragma unroll
        for (int i = 0; i < kNTilesD; ++i) {
            const int col = i * kMmaN + 2 * t;
            *reinterpret_cast<uint32_t*>(sO + Tile::index(r0, col)) =
                pack2<Element>(acc_o[mt][i][0] * inv_sum[0], acc_o[mt][i][1] * inv_sum[0]);
            *reinterpret_cast<uint32_t*>(sO + Tile::index(r0 + 8, col)) =
                pack2<Element>(acc_o[mt][i][2] * inv_sum[1], acc_o[mt][i][3] * inv_sum[1]);
        }
    }
    __syncthreads();
    store_tile<kBlockM, kHeadDim, Tile, kNThreads>(o, sO, params.o_row_stride, valid_rows, params.d);
}

}  // namespace flash
