// flash_kernel._C: the torch binding of the FlashAttention-2 kernels (the only file of theirs that includes torch)
// and of the GELU MLP's cuBLASLt matmuls (gelu_gemm.cu).
//
// fwd(q, k, v, o, lse, softmax_scale, causal, window_left=-1, window_right=-1)
// bwd(do, q, k, v, o, lse, dq, dk, dv, softmax_scale, causal, deterministic, window_left=-1, window_right=-1)
// varlen_fwd(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
//            window_left, window_right)
// varlen_bwd(do, q, k, v, o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
//            softmax_scale, causal, deterministic, window_left, window_right)
// The varlen pair takes packed (total, H, D) tensors and lse (Hq, total_q) (flash_params.h); it checks cu_seqlens'
// dtype, device and shape, not their values (flash_kernel.interface does, once per tensor).
// All write into caller-allocated outputs (which may be poisoned; every element is written), validate
// every input with an error that names the tensor, refuse a GPU whose thread blocks get less shared memory
// than the kernel asks for (saying what to use instead), and launch on the current CUDA stream.
// set_overrides(fwd_sm80, bwd_sm80, causal_group_heads, max_smem_per_block, bwd_causal_group_heads): the tests' and
// benchmarks' switches (Overrides below); nothing else changes which kernel runs or how its work is ordered.
// linear_gelu(x, weight, bias), linear_dgelu(dy, weight, pre): gelu_gemm.h; they allocate their outputs.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "causal_order.h"
#include "flash_launch.h"
#include "gelu_gemm.h"
#include "kernel_traits.h"

namespace {

constexpr int kAlignElems = 8;    // cp.async moves 16 bytes = 8 bf16/fp16: strides must be multiples of 8
constexpr int kAlignBytes = 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Tensor& q) {
    TORCH_CHECK(t.is_cuda(), "flash_kernel: ", name, " must be a CUDA tensor, got a tensor on ", t.device(),
                "; move it with .cuda()");
    TORCH_CHECK(t.device() == q.device(), "flash_kernel: ", name, " is on ", t.device(), " but q is on ", q.device(),
                "; all tensors must be on one device");
}

// rank 4: (B, T, H, D); rank 3: the varlen layout (total, H, D).
void check_qkv_like(const at::Tensor& t, const char* name, const at::Tensor& q, int64_t rank = 4) {
    check_cuda_tensor(t, name, q);
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flash_kernel: ", name, " has dtype ", t.scalar_type(),
                " but q has dtype ", q.scalar_type(), "; all of q, k, v (and o, do, dq, dk, dv) must share one dtype");
    TORCH_CHECK(t.dim() == rank, "flash_kernel: ", name, " must have rank ", rank,
                rank == 4 ? " (B, T, H, D)" : " (total, H, D)", ", got shape ", t.sizes());
    TORCH_CHECK(t.stride(rank - 1) == 1, "flash_kernel: ", name,
                " must have a contiguous last dim (stride 1), got strides ", t.strides(), "; call .contiguous() on it");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % kAlignBytes == 0, "flash_kernel: ", name,
                " data pointer must be 16-byte aligned");
    for (int dim = 0; dim < rank - 1; ++dim) {
        TORCH_CHECK(t.size(dim) <= 1 || t.stride(dim) % kAlignElems == 0, "flash_kernel: ", name, " stride of dim ",
                    dim, " must be a multiple of 8 elements (16 bytes), got strides ", t.strides(), "; call .contiguous()");
    }
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected) {
    TORCH_CHECK(t.sizes() == expected, "flash_kernel: ", name, " must have shape ", expected, ", got ", t.sizes());
}

// lse: (B, Hq, Tq), or (Hq, total_q) in varlen (`shape`), float32 and contiguous.
void check_lse(const at::Tensor& lse, const at::Tensor& q, at::IntArrayRef shape) {
    check_cuda_tensor(lse, "lse", q);
    TORCH_CHECK(lse.scalar_type() == at::kFloat, "flash_kernel: lse must be float32, got ", lse.scalar_type());
    check_shape(lse, "lse", shape);
    TORCH_CHECK(lse.is_contiguous(), "flash_kernel: lse must be contiguous");
}

// Strides of size-1 dims are meaningless (and can be anything); zero them so the kernels never use them.
int64_t stride_of(const at::Tensor& t, int dim) { return t.size(dim) == 1 ? 0 : t.stride(dim); }

// Batch, row and head strides of a (B, T, H, D) tensor, or of a varlen (total, H, D) one (batch stride 0: its rows
// are placed by cu_seqlens).
void set_strides(const at::Tensor& t, int64_t& batch, int64_t& row, int64_t& head) {
    const int first = t.dim() == 4 ? 1 : 0;
    batch = first == 1 ? stride_of(t, 0) : 0;
    row = stride_of(t, first);
    head = stride_of(t, first + 1);
}

// Dense: q (b, tq, h, d), k and v (b, tk, h_k, d). Varlen: b sequences, tq / tk their max_seqlen, total_q / total_k
// the packed rows (q (total_q, h, d), k and v (total_k, h_k, d)); varlen is false and the totals 0 when dense.
struct Sizes {
    int64_t b, tq, tk, h, h_k, d;
    bool varlen = false;
    int64_t total_q = 0, total_k = 0;
};

// q, k, v on one sm80+ GPU, of one supported dtype, each of `rank` dims with kernel-friendly strides.
void check_qkv_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t rank) {
    TORCH_CHECK(q.is_cuda(), "flash_kernel: q must be a CUDA tensor, got a tensor on ", q.device(),
                "; move it with .cuda()");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                "flash_kernel: q must be bfloat16 or float16, got ", q.scalar_type(), "; cast with .to(torch.bfloat16)");
    check_qkv_like(q, "q", q, rank);
    check_qkv_like(k, "k", q, rank);
    check_qkv_like(v, "v", q, rank);
    const auto cc = at::cuda::getDeviceProperties(q.device().index());
    TORCH_CHECK(cc->major >= 8, "flash_kernel: needs an sm80+ GPU (A100, H100, ...), got compute capability ",
                cc->major, ".", cc->minor);
}

// The head dim and head counts of s, and the grid limits.
void check_heads(const Sizes& s) {
    TORCH_CHECK(s.d % kAlignElems == 0 && s.d > 0 && s.d <= flash::kMaxHeadDim, "flash_kernel: head dim (q.shape[-1]) ",
                s.d, " unsupported: it must be a positive multiple of 8 and at most ", flash::kMaxHeadDim);
    TORCH_CHECK(s.h_k > 0 && s.h % s.h_k == 0, "flash_kernel: the number of query heads (q.shape[-2] = ", s.h,
                ") must be a multiple of the number of key/value heads (k.shape[-2] = ", s.h_k, ")");
    TORCH_CHECK(s.b <= 65535 && s.h <= 65535, "flash_kernel: batch (or sequence count) and head count must be <= 65535 "
                "(grid limits)");
}

// Validation shared by fwd and bwd; returns the sizes.
Sizes check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    check_qkv_common(q, k, v, 4);
    Sizes s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
    check_shape(k, "k", {s.b, s.tk, s.h_k, s.d});
    check_shape(v, "v", {s.b, s.tk, s.h_k, s.d});
    check_heads(s);
    TORCH_CHECK(s.tq >= 1 && s.tk >= 1, "flash_kernel: sequence lengths must be >= 1, got Tq = ", s.tq, ", Tk = ", s.tk);
    return s;
}

// Validation shared by varlen_fwd and varlen_bwd: q (total_q, Hq, D), k and v (total_k, Hk, D), cu_seqlens int32
// (b + 1,) on q's device. Their values (0 first, non-decreasing, the totals last, no sequence longer than its
// max_seqlen) are the caller's to check (flash_kernel.interface): reading them here would wait for the GPU.
Sizes check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                          const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
    check_qkv_common(q, k, v, 3);
    for (const auto& [name, cu] : {std::pair{"cu_seqlens_q", &cu_seqlens_q}, std::pair{"cu_seqlens_k", &cu_seqlens_k}}) {
        check_cuda_tensor(*cu, name, q);
        TORCH_CHECK(cu->scalar_type() == at::kInt, "flash_kernel: ", name, " must be int32, got ", cu->scalar_type(),
                    "; pass it .to(torch.int32)");
        TORCH_CHECK(cu->dim() == 1 && cu->size(0) >= 2 && cu->is_contiguous(), "flash_kernel: ", name,
                    " must be a contiguous 1-D tensor (batch + 1,), got shape ", cu->sizes());
    }
    TORCH_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), "flash_kernel: cu_seqlens_q and cu_seqlens_k must have "
                "one length (batch + 1), got ", cu_seqlens_q.size(0), " and ", cu_seqlens_k.size(0));
    Sizes s{cu_seqlens_q.size(0) - 1, max_seqlen_q, max_seqlen_k, q.size(1), k.size(1), q.size(2), true, q.size(0), k.size(0)};
    check_shape(k, "k", {s.total_k, s.h_k, s.d});
    check_shape(v, "v", {s.total_k, s.h_k, s.d});
    check_heads(s);
    TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0 && max_seqlen_q <= std::numeric_limits<int>::max() &&
                    max_seqlen_k <= std::numeric_limits<int>::max(),
                "flash_kernel: max_seqlen_q and max_seqlen_k must be in [0, 2^31), got ", max_seqlen_q, " and ", max_seqlen_k);
    TORCH_CHECK((s.total_q == 0 || max_seqlen_q >= 1) && (s.total_k == 0 || max_seqlen_k >= 1),
                "flash_kernel: max_seqlen_q / max_seqlen_k is 0 but q / k has rows");
    TORCH_CHECK(s.total_q <= std::numeric_limits<int>::max() && s.total_k <= std::numeric_limits<int>::max(),
                "flash_kernel: at most 2^31 - 1 packed rows (int32 cu_seqlens)");
    return s;
}

// Switches for tests and benchmarks, set by set_overrides (flash_kernel.interface.set_kernel_overrides) and read by
// every call; the defaults are what every other caller gets.
struct Overrides {
    // The kernels a Hopper GPU runs, per pass: the sm_90a wgmma kernel where one is built for the head dim, or (true)
    // the mma.sync kernel every sm80+ GPU runs (tests and benchmarks compare the two).
    bool fwd_sm80 = false;
    bool bwd_sm80 = false;
    // The groups of the causal forward's block order (causal_order.h): 0 sizes them to L2 from the K and V bytes of
    // a query head; N >= 1 makes them N (batch, head) pairs (tests of short last groups, tuning).
    int64_t causal_group_heads = 0;
    // 0, or N bytes: the sm80 kernels choose their variant and are checked as on a GPU whose thread blocks get
    // at most N (set_smem_limits).
    int64_t max_smem_per_block = 0;
    // The Hopper causal backward's block order (bwd_causal_order_group_heads): 0 takes the default; N >= 1 makes
    // the groups N (batch, head) pairs at every length (1 is the grid's own order: each head's blocks in turn).
    int64_t bwd_causal_group_heads = 0;
};
Overrides g_overrides;

// Called only through flash_kernel.interface.set_kernel_overrides, which checks every value and names a bad one
// before it gets here; a negative value reads as 0 (the default).
void set_overrides(bool fwd_sm80, bool bwd_sm80, int64_t causal_group_heads, int64_t max_smem_per_block,
                   int64_t bwd_causal_group_heads) {
    auto count = [](int64_t n) { return std::max<int64_t>(n, 0); };
    g_overrides = Overrides{fwd_sm80, bwd_sm80, count(causal_group_heads), count(max_smem_per_block),
                            count(bwd_causal_group_heads)};
}

// The buffer that FLASH_BWD_TRACE builds of the Hopper backward write their blocks' stamps into (block_trace.h):
// rows x kBlockTraceCols int64 on the device, set by bench/block_trace.py; rows = 0 (the default) writes none.
struct BlockTraceBuffer {
    int64_t ptr = 0;
    int64_t rows = 0;
};
BlockTraceBuffer g_block_trace;
void set_block_trace(int64_t ptr, int64_t rows) { g_block_trace = BlockTraceBuffer{ptr, std::max<int64_t>(rows, 0)}; }

bool is_sm90(int device_index) {
    const auto* prop = at::cuda::getDeviceProperties(device_index);
    return prop->major == 9 && prop->minor == 0;
}
bool sm90_forward_allowed(int device_index) { return is_sm90(device_index) && !g_overrides.fwd_sm80; }
bool sm90_backward_allowed(int device_index) { return is_sm90(device_index) && !g_overrides.bwd_sm80; }

// The groups of the causal forward's block order (causal_order.h): sized to L2 from the K and V bytes of a
// query head, unless the causal_group_heads override sets them.
int causal_order_group_heads(int64_t kv_bytes_per_head, int64_t all_heads) {
    const int64_t n = g_overrides.causal_group_heads;
    if (n == 0) return flash::causal_group_heads(kv_bytes_per_head, all_heads);
    return static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(1, all_heads)));
}

// The Hopper causal backward's groups (causal_order.h, bwd_tile_scheduler.h): from kBwdCausalOrderMinKeys keys, sized to
// kBwdCausalGroupBytes from the bytes of Q, dO (input dtype) and dq_accum (fp32) that a (batch, head) pair's blocks
// read; below, the grid's own order (0): at 1k keys it ran 8-10% faster at hd64 (the same at hd128) on an H100, the
// grouped order spreading the blocks that run together over more heads' Q and dO. The override sets the groups at
// every length.
int bwd_causal_order_group_heads(const flash::BwdParams& p, int64_t elem_bytes) {
    const int64_t pairs = static_cast<int64_t>(p.b) * p.h;
    const int64_t n = g_overrides.bwd_causal_group_heads;
    if (n > 0) return static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(1, pairs)));
    if (p.seqlen_k < flash::kBwdCausalOrderMinKeys) return 0;
    const int64_t bytes = static_cast<int64_t>(p.seqlen_q) * (2 * p.d * elem_bytes + 4 * p.d_rounded);
    return flash::causal_group_heads(bytes, pairs, flash::kBwdCausalGroupBytes);
}

// The shared memory one thread block, and one SM, of this GPU may have: the device's, or less under the
// max_smem_per_block override. The sm80 kernels then choose their variant and are checked as on a GPU whose blocks
// get that many bytes (A100: 166912; sm_86 / sm_89: 101376), so an H100 runs and tests what those GPUs run; with
// fwd and bwd "sm80", as the Hopper kernels ignore it. Every sm80+ GPU's SM holds one block's driver reserve more
// than a block may have (A100: 164 / 163 KiB).
void set_smem_limits(flash::FwdParams& p, const cudaDeviceProp* props) {
    int per_block = static_cast<int>(props->sharedMemPerBlockOptin);
    if (g_overrides.max_smem_per_block > 0) {
        per_block = static_cast<int>(std::min<int64_t>(g_overrides.max_smem_per_block, per_block));
    }
    p.smem_per_block_optin = per_block;
    p.smem_per_sm =
        std::min(static_cast<int>(props->sharedMemPerMultiprocessor), per_block + flash::kReservedSmemPerBlock);
}

// Empty where the sm80 kernel of this pass (the one that runs for p.d_rounded on a GPU with p's limits) fits one
// thread block; else why not, and what to use instead. Every config has a variant for 99 KiB (sm_86 / sm_89), so
// on a real sm80+ GPU this refuses only under the max_smem_per_block override.
std::string sm80_smem_shortfall(const flash::FwdParams& p, bool backward, int device_index) {
    const int need = backward ? flash::sm80_bwd_smem_bytes(p) : flash::sm80_fwd_smem_bytes(p);
    if (need <= p.smem_per_block_optin) return "";
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(device_index);
    const auto kib = [](int bytes) { return std::to_string(bytes / 1024) + "." + std::to_string(bytes % 1024 * 10 / 1024); };
    std::string msg = std::string("flash_kernel: the ") + (backward ? "backward" : "forward") + " kernel at head dim " +
                      std::to_string(p.d_rounded) + " needs " + kib(need) + " KiB of shared memory per thread block, but " +
                      props->name + " (sm_" + std::to_string(props->major) + std::to_string(props->minor) +
                      ") gives a block at most " + kib(p.smem_per_block_optin) + " KiB";
    if (p.smem_per_block_optin < static_cast<int>(props->sharedMemPerBlockOptin)) {
        msg += " under the max_smem_per_block override";
    }
    // Where no config fits, `need` is the smallest one's (fwd_variant / bwd_variant fall back to it).
    return msg + ". Use PyTorch's scaled_dot_product_attention (attention=sdpa in train.py) on this GPU instead.";
}

// The window and causal flag of a call. FlashAttention's semantics: causal is window_right = 0, so a causal call's
// right bound is 0 whatever was passed, and a window that adds nothing to causal or to full attention (both sides
// -1, or only a right side on a causal call) stays -1, -1: those calls keep the dense kernels (is_varlen_or_local).
void set_window(flash::FwdParams& p, bool causal, int64_t window_left, int64_t window_right) {
    TORCH_CHECK(window_left >= -1 && window_right >= -1, "flash_kernel: window_size must be >= -1 on both sides "
                "(-1: unbounded), got (", window_left, ", ", window_right, ")");
    constexpr int64_t kMaxWindow = std::numeric_limits<int>::max() / 2;  // i + offset +- window stays in int
    const bool local = window_left >= 0 || (!causal && window_right >= 0);
    p.is_causal = causal;
    p.window_left = local ? static_cast<int>(std::min(window_left, kMaxWindow)) : -1;
    p.window_right = !local ? -1 : causal ? 0 : static_cast<int>(std::min(window_right, kMaxWindow));
}

void fill_fwd_params(flash::FwdParams& p, const Sizes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& o, const at::Tensor& lse, double softmax_scale, bool causal,
                     int64_t window_left = -1, int64_t window_right = -1, const at::Tensor* cu_seqlens_q = nullptr,
                     const at::Tensor* cu_seqlens_k = nullptr) {
    p.q_ptr = q.data_ptr();
    p.k_ptr = k.data_ptr();
    p.v_ptr = v.data_ptr();
    p.o_ptr = o.data_ptr();
    p.lse_ptr = lse.data_ptr<float>();
    set_strides(q, p.q_batch_stride, p.q_row_stride, p.q_head_stride);
    set_strides(k, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
    set_strides(v, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
    set_strides(o, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
    if (s.varlen) {
        p.cu_seqlens_q = cu_seqlens_q->data_ptr<int>();
        p.cu_seqlens_k = cu_seqlens_k->data_ptr<int>();
        p.total_q = static_cast<int>(s.total_q);
        p.total_k = static_cast<int>(s.total_k);
    }
    p.b = static_cast<int>(s.b);
    p.h = static_cast<int>(s.h);
    p.h_k = static_cast<int>(s.h_k);
    p.h_h_k_ratio = static_cast<int>(s.h / s.h_k);
    p.seqlen_q = static_cast<int>(s.tq);
    p.seqlen_k = static_cast<int>(s.tk);
    p.d = static_cast<int>(s.d);
    p.d_rounded = flash::round_head_dim(p.d);
    p.scale_softmax = static_cast<float>(softmax_scale);
    p.scale_softmax_log2 = static_cast<float>(softmax_scale * flash::kLog2eDouble);
    set_window(p, causal, window_left, window_right);
    p.is_bf16 = q.scalar_type() == at::kBFloat16;
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();  // the caller's device guard is set
    // The persistent forward grid leaves torch's SM carve-out to the collectives that overlap it
    // (trainer.strategy.sm_carveout, model/distributed.py), as cuBLASLt's matmuls do.
    const int carveout = at::globalContext()._SMCarveout_EXPERIMENTAL().value_or(0);
    p.num_sms = std::max(1, props->multiProcessorCount - carveout);
    set_smem_limits(p, props);
}

// Whether the sm_90a forward / main backward kernel runs for this head dim on this device (else the sm80 one).
bool fwd_runs_hopper(int d_rounded, int device_index) {
    return sm90_forward_allowed(device_index) && flash::hopper_fwd_built(d_rounded);
}
bool bwd_runs_hopper(int d_rounded, int device_index, bool deterministic) {
    return sm90_backward_allowed(device_index) && flash::hopper_bwd_built(d_rounded) &&
           !deterministic;  // the ordered dq_accum splits are the sm80 kernel's
}

// Which forward / backward main kernel runs for this head dim on this device (benchmark labels, tests).
std::string fwd_kernel_name(int64_t head_dim, int64_t device_index) {
    const int d_rounded = flash::round_head_dim(static_cast<int>(head_dim));
    return fwd_runs_hopper(d_rounded, static_cast<int>(device_index)) ? "sm90a-wgmma" : "sm80-mma";
}
std::string bwd_kernel_name(int64_t head_dim, int64_t device_index, bool deterministic) {
    const int d_rounded = flash::round_head_dim(static_cast<int>(head_dim));
    return bwd_runs_hopper(d_rounded, static_cast<int>(device_index), deterministic) ? "sm90a-wgmma" : "sm80-mma";
}

// The params the sm80 kernels' choice reads (head dim, shared-memory limits) for this head dim on this device.
flash::FwdParams limit_params(int64_t head_dim, int device) {
    flash::FwdParams p{};
    p.d_rounded = flash::round_head_dim(static_cast<int>(head_dim));
    set_smem_limits(p, at::cuda::getDeviceProperties(device));
    return p;
}

// Dynamic shared memory per thread block of the sm80 forward / main backward kernel this device runs for this head
// dim (tests: which variant the limits choose).
int64_t sm80_smem_bytes(int64_t head_dim, int64_t device_index, bool backward) {
    const flash::FwdParams p = limit_params(head_dim, static_cast<int>(device_index));
    return backward ? flash::sm80_bwd_smem_bytes(p) : flash::sm80_fwd_smem_bytes(p);
}

// Refuse, before anything is launched, the sm80 kernel of this pass where it does not fit this device (p: its head
// dim and limits).
void check_sm80_fits(const flash::FwdParams& p, int device, bool backward) {
    const std::string shortfall = sm80_smem_shortfall(p, backward, device);
    TORCH_CHECK(shortfall.empty(), shortfall);
}

// Empty where the forward and backward kernels for this head dim fit this device's thread blocks, else why not
// (sm80_smem_shortfall): lets a trainer refuse before its first step.
std::string unsupported_reason(int64_t head_dim, int64_t device_index, bool deterministic) {
    const int device = static_cast<int>(device_index);
    const flash::FwdParams p = limit_params(head_dim, device);
    if (!fwd_runs_hopper(p.d_rounded, device)) {
        if (std::string why = sm80_smem_shortfall(p, false, device); !why.empty()) return why;
    }
    if (!bwd_runs_hopper(p.d_rounded, device, deterministic)) return sm80_smem_shortfall(p, true, device);
    return "";
}

// The forward on checked inputs (check_inputs or check_varlen_inputs, and o, lse).
void run_fwd(const Sizes& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o, at::Tensor& lse,
             double softmax_scale, bool causal, int64_t window_left, int64_t window_right, const at::Tensor* cu_seqlens_q,
             const at::Tensor* cu_seqlens_k) {
    TORCH_CHECK(std::isfinite(softmax_scale), "flash_kernel: softmax_scale must be finite, got ", softmax_scale);
    const int device = q.device().index();
    const c10::cuda::CUDAGuard device_guard(q.device());
    flash::FwdParams p{};
    fill_fwd_params(p, s, q, k, v, o, lse, softmax_scale, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k);
    if (s.b == 0 || s.h == 0 || s.tq == 0 || (s.varlen && s.total_q == 0)) return;  // no query row to write
    p.use_sm90 = sm90_forward_allowed(device);
    const bool hopper = p.use_sm90 && flash::hopper_fwd_built(p.d_rounded);  // fwd_runs_hopper, from the params
    if (!hopper) check_sm80_fits(p, device, /*backward=*/false);
    // Freed on return: the caching allocator hands its memory only to work queued after the kernel on this stream.
    at::Tensor tile_counter;
    if (p.is_causal || flash::is_varlen_or_local(p)) {  // K and V bytes of a query head (shared by h / h_k of them)
        p.causal_group_heads = causal_order_group_heads(2 * s.tk * s.d * q.element_size() / p.h_h_k_ratio, s.b * s.h);
    }
    if (hopper && (p.is_causal || flash::is_varlen_or_local(p))) {  // its blocks take tiles from a counter
        tile_counter = at::zeros({1}, q.options().dtype(at::kInt));
        p.tile_counter = tile_counter.data_ptr<int>();
    }
    const cudaError_t err = flash::run_mha_fwd(p, at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "flash_kernel: forward launch failed: ", cudaGetErrorString(err));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o, at::Tensor& lse,
         double softmax_scale, bool causal, int64_t window_left, int64_t window_right) {
    const Sizes s = check_inputs(q, k, v);
    check_qkv_like(o, "o", q);
    check_shape(o, "o", q.sizes());
    check_lse(lse, q, {s.b, s.h, s.tq});
    run_fwd(s, q, k, v, o, lse, softmax_scale, causal, window_left, window_right, nullptr, nullptr);
}

void varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& o, at::Tensor& lse,
                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                int64_t max_seqlen_k, double softmax_scale, bool causal, int64_t window_left, int64_t window_right) {
    const Sizes s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    check_qkv_like(o, "o", q, 3);
    check_shape(o, "o", q.sizes());
    check_lse(lse, q, {s.h, s.total_q});
    run_fwd(s, q, k, v, o, lse, softmax_scale, causal, window_left, window_right, &cu_seqlens_q, &cu_seqlens_k);
}

// The backward on checked inputs (check_inputs or check_varlen_inputs, and the rest).
void run_bwd(const Sizes& s, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
             const at::Tensor& o, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
             double softmax_scale, bool causal, bool deterministic, int64_t window_left, int64_t window_right,
             const at::Tensor* cu_seqlens_q, const at::Tensor* cu_seqlens_k) {
    TORCH_CHECK(std::isfinite(softmax_scale), "flash_kernel: softmax_scale must be finite, got ", softmax_scale);
    const int d_rounded = flash::round_head_dim(static_cast<int>(s.d));
    TORCH_CHECK(flash::bwd_head_dim_supported(d_rounded), "flash_kernel: backward supports head dims up to ",
                flash::kMaxHeadDim, ", got ", s.d);
    // Head dim 256 splits each head's columns over 2 thread blocks along grid.y.
    TORCH_CHECK(d_rounded <= 128 || s.h <= 65535 / 2, "flash_kernel: backward with head dim > 128 supports at most ",
                65535 / 2, " query heads, got ", s.h);
    const int device = q.device().index();
    const c10::cuda::CUDAGuard device_guard(q.device());
    flash::BwdParams p{};
    fill_fwd_params(p, s, q, k, v, o, lse, softmax_scale, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k);
    if (s.b == 0 || s.h == 0) return;
    if (s.varlen && (s.total_q == 0 || s.total_k == 0 || s.tq == 0 || s.tk == 0)) {
        // No (query, key) pair at all: every gradient is 0, and the kernels' grids would be empty.
        dq.zero_();
        dk.zero_();
        dv.zero_();
        return;
    }
    p.use_sm90 = sm90_backward_allowed(device);
    const bool hopper = bwd_runs_hopper(d_rounded, device, deterministic);
    if (!hopper) check_sm80_fits(p, device, /*backward=*/true);  // before dq_accum and the rest exist
    // Freed on return, as the forward's: zeroed by the preprocess kernel, taken from by the persistent causal kernel.
    at::Tensor tile_counter;
    if (hopper && p.is_causal && !flash::is_varlen_or_local(p)) {
        p.bwd_causal_group = bwd_causal_order_group_heads(p, q.element_size());
        tile_counter = at::empty({1}, q.options().dtype(at::kInt));
        p.tile_counter = tile_counter.data_ptr<int>();
    }
    if (g_block_trace.rows > 0) {
        p.block_trace = reinterpret_cast<long long*>(g_block_trace.ptr);
        p.block_trace_rows = g_block_trace.rows;
    }
    const auto f32 = q.options().dtype(at::kFloat);

    // Deterministic: one ordered worker per split, about one wave of thread blocks in all.
    const int64_t num_n_blocks = ceil_div(s.tk, flash::bwd_block_n(d_rounded));
    int num_splits = 1;
    if (deterministic) {
        const int64_t heads = s.b * s.h;
        num_splits = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_n_blocks, ceil_div(p.num_sms, heads))));
    }
    // delta like lse: (B, Hq, Tq), or (Hq, total_q). dq_accum (S, B, Hq, Tq, Dr), or (S, Hq, dq_accum_rows, Dr) in
    // varlen (flash_params.h); zeroed by the preprocess kernel, which reads every row anyway.
    at::Tensor delta = at::empty(lse.sizes(), f32);
    const int64_t accum_rows = s.varlen ? flash::dq_accum_rows(static_cast<int>(s.total_q), static_cast<int>(s.b)) : s.tq;
    p.dq_accum_cols = hopper ? flash::hopper_bwd_dq_accum_cols(static_cast<int>(s.d), d_rounded) : d_rounded;
    const int64_t cols = p.dq_accum_cols;
    at::Tensor dq_accum = s.varlen ? at::empty({int64_t{num_splits}, s.h, accum_rows, cols}, f32)
                                   : at::empty({int64_t{num_splits}, s.b, s.h, s.tq, cols}, f32);
    // GQA/MQA: per-query-head dK/dV ((B, Tk, Hq, D), or (total_k, Hq, D)), summed over each group below.
    const bool grouped = s.h != s.h_k;
    std::vector<int64_t> expanded_shape = k.sizes().vec();
    expanded_shape[expanded_shape.size() - 2] = s.h;
    at::Tensor dk_expanded = grouped ? at::empty(expanded_shape, q.options()) : dk;
    at::Tensor dv_expanded = grouped ? at::empty(expanded_shape, q.options()) : dv;

    p.do_ptr = dout.data_ptr();
    p.dq_ptr = dq.data_ptr();
    p.dk_ptr = dk_expanded.data_ptr();
    p.dv_ptr = dv_expanded.data_ptr();
    set_strides(dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
    set_strides(dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride);
    set_strides(dk_expanded, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride);
    set_strides(dv_expanded, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
    p.delta_ptr = delta.data_ptr<float>();
    // The dense Hopper backward's L_i and D_i as matmul operands (flash_params.h), where its build takes them so:
    // rows past Tq zeroed here, the others written by the preprocess kernel.
    at::Tensor ld_mma;
    if (hopper && !flash::is_varlen_or_local(p) && flash::hopper_bwd_ld_in_mma(p.is_bf16)) {
        const int64_t rows = ceil_div(s.tq, int64_t{flash::kLdMmaRowPad}) * flash::kLdMmaRowPad;
        ld_mma = at::empty({s.b, s.h, 2, rows, 8}, q.options());
        if (rows > s.tq) {
            const size_t row_bytes = 8 * ld_mma.element_size();
            C10_CUDA_CHECK(cudaMemset2DAsync(static_cast<char*>(ld_mma.data_ptr()) + s.tq * row_bytes,
                                             rows * row_bytes, 0, (rows - s.tq) * row_bytes, s.b * s.h * 2,
                                             at::cuda::getCurrentCUDAStream().stream()));
        }
        p.ld_mma_ptr = ld_mma.data_ptr();
        p.ld_mma_rows = rows;
    }
    p.dq_accum_ptr = dq_accum.data_ptr<float>();
    p.dq_accum_split_stride = dq_accum.stride(0);
    p.num_splits = num_splits;
    p.deterministic = deterministic;

    const cudaError_t err = flash::run_mha_bwd(p, at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "flash_kernel: backward launch failed: ", cudaGetErrorString(err));
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    if (grouped) {
        // (..., Hkv, group, D) summed over group: a fixed-order reduction, so deterministic too.
        std::vector<int64_t> groups = k.sizes().vec();
        groups.insert(groups.end() - 1, s.h / s.h_k);
        const int64_t group_dim = static_cast<int64_t>(groups.size()) - 2;
        at::sum_out(dk, dk_expanded.view(groups), {group_dim});
        at::sum_out(dv, dv_expanded.view(groups), {group_dim});
    }
}

// dout, o, dq, dk, dv of a backward call like q, k, v (rank 4, or 3 in varlen).
void check_bwd_tensors(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& o, const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
    const int64_t rank = q.dim();
    check_qkv_like(o, "o", q, rank);
    check_shape(o, "o", q.sizes());
    check_qkv_like(dout, "do", q, rank);
    check_shape(dout, "do", q.sizes());
    check_qkv_like(dq, "dq", q, rank);
    check_shape(dq, "dq", q.sizes());
    check_qkv_like(dk, "dk", q, rank);
    check_shape(dk, "dk", k.sizes());
    check_qkv_like(dv, "dv", q, rank);
    check_shape(dv, "dv", v.sizes());
}

void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o,
         const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, double softmax_scale, bool causal,
         bool deterministic, int64_t window_left, int64_t window_right) {
    const Sizes s = check_inputs(q, k, v);
    check_bwd_tensors(dout, q, k, v, o, dq, dk, dv);
    check_lse(lse, q, {s.b, s.h, s.tq});
    run_bwd(s, dout, q, k, v, o, lse, dq, dk, dv, softmax_scale, causal, deterministic, window_left, window_right,
            nullptr, nullptr);
}

void varlen_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& o, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic, int64_t window_left,
                int64_t window_right) {
    const Sizes s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    check_bwd_tensors(dout, q, k, v, o, dq, dk, dv);
    check_lse(lse, q, {s.h, s.total_q});
    run_bwd(s, dout, q, k, v, o, lse, dq, dk, dv, softmax_scale, causal, deterministic, window_left, window_right,
            &cu_seqlens_q, &cu_seqlens_k);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "FlashAttention-2 forward/backward CUDA kernels (mma.sync on sm80+, wgmma on sm90a); see flash_kernel/csrc";
    m.def("fwd", &fwd, "FlashAttention-2 forward into caller-allocated o and lse", py::arg("q"), py::arg("k"),
          py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("softmax_scale"), py::arg("causal"),
          py::arg("window_left") = -1, py::arg("window_right") = -1);
    m.def("bwd", &bwd, "FlashAttention-2 backward into caller-allocated dq, dk, dv", py::arg("dout"), py::arg("q"),
          py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dq"), py::arg("dk"), py::arg("dv"),
          py::arg("softmax_scale"), py::arg("causal"), py::arg("deterministic"), py::arg("window_left") = -1,
          py::arg("window_right") = -1);
    m.def("varlen_fwd", &varlen_fwd,
          "FlashAttention-2 forward on packed (total, H, D) sequences into caller-allocated o and lse (Hq, total_q)",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("cu_seqlens_q"),
          py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"),
          py::arg("causal"), py::arg("window_left") = -1, py::arg("window_right") = -1);
    m.def("varlen_bwd", &varlen_bwd,
          "FlashAttention-2 backward on packed (total, H, D) sequences into caller-allocated dq, dk, dv",
          py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dq"),
          py::arg("dk"), py::arg("dv"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
          py::arg("max_seqlen_k"), py::arg("softmax_scale"), py::arg("causal"), py::arg("deterministic"),
          py::arg("window_left") = -1, py::arg("window_right") = -1);
    m.def("linear_gelu", &linear_gelu,
          "(gelu(x weight^T + bias), x weight^T + bias) by one cuBLASLt matmul with the GELU_AUX_BIAS epilogue",
          py::arg("x"), py::arg("weight"), py::arg("bias"));
    m.def("linear_dgelu", &linear_dgelu,
          "((dy weight) * gelu'(pre), its sum over rows) by a cuBLASLt matmul with the DGELU epilogue and a sum",
          py::arg("dy"), py::arg("weight"), py::arg("pre"));
    m.def("fwd_kernel_name", &fwd_kernel_name,
          "the forward kernel that runs for this head dim on this CUDA device: sm90a-wgmma or sm80-mma",
          py::arg("head_dim"), py::arg("device_index"));
    m.def("bwd_kernel_name", &bwd_kernel_name,
          "the backward main kernel that runs for this head dim on this CUDA device: sm90a-wgmma or sm80-mma",
          py::arg("head_dim"), py::arg("device_index"), py::arg("deterministic"));
    m.def("sm80_smem_bytes", &sm80_smem_bytes,
          "dynamic shared memory per thread block of the sm80 forward (or main backward) kernel for this head dim "
          "on this CUDA device, under the max_smem_per_block override where set",
          py::arg("head_dim"), py::arg("device_index"), py::arg("backward"));
    m.def("set_overrides", &set_overrides,
          "tests' and benchmarks' switches, for every later call (checked by flash_kernel.interface."
          "set_kernel_overrides): the sm80 kernel for the forward / backward on a Hopper GPU, causal_group_heads "
          "(0: sized to L2), max_smem_per_block (bytes; 0: the device's), bwd_causal_group_heads (0: the default)",
          py::arg("fwd_sm80"), py::arg("bwd_sm80"), py::arg("causal_group_heads"), py::arg("max_smem_per_block"),
          py::arg("bwd_causal_group_heads"));
    m.def("set_block_trace", &set_block_trace,
          "the device buffer (its address, its rows of kBlockTraceCols int64) that FLASH_BWD_TRACE builds of the Hopper "
          "backward write each thread block's stamps into, for every later call (bench/block_trace.py); rows 0: none",
          py::arg("ptr"), py::arg("rows"));
    m.def("unsupported_reason", &unsupported_reason,
          "empty where the forward and backward kernels for this head dim fit this CUDA device, else why not",
          py::arg("head_dim"), py::arg("device_index"), py::arg("deterministic"));
}
