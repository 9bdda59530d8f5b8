"""FlashAttention-2 in plain PyTorch: the tiled algorithm of the CUDA kernel, runnable on CPU.

Follows Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (2023):
Algorithm 1 (forward) and Algorithm 2 (backward), with the same names and steps as flash_kernel/csrc so
that the kernel can be read against it line by line. One Python loop iteration here is one thread
block's tile step there; the (batch, head) grid dimensions are vectorised instead of launched.

Conventions shared with the kernel (docs/CONTRACTS.md):
- layout (B, T, H, D); k/v may have fewer heads (GQA/MQA): query head h reads kv head h // (Hq / Hkv);
- causal masking is aligned bottom-right as in flash-attn: query i sees keys j <= i + Tk - Tq, so with
  Tq > Tk the first Tq - Tk rows see nothing; those rows give o = 0, lse = +inf and zero gradients;
- scores are kept raw (unscaled) and the softmax scale is folded into exp2 with log2(e), as the kernel
  does, so one FMA per score does both the scale and the max subtraction;
- accumulation in float32 (float64 when the inputs are float64, for tight CPU tests); o/dq/dk/dv come
  back in the input dtype, lse in float32 (B, Hq, Tq).

Varlen (packed sequences) and sliding windows: `naive_attention_varlen` and naive_attention's `window_size` are
their per-sequence dense oracle (the tiled functions here cover the dense causal and full cases).

Not the fast path: use it as the executable specification and as the attention of the CPU model tests.
"""

from __future__ import annotations

import math

import torch

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E); exp2 is the native SFU instruction on the GPU.


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 inputs stay float64 so the CPU tests can compare against a float64 oracle tightly.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _default_scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _to_bhtd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.transpose(1, 2).to(dtype)  # (B, T, H, D) -> (B, H, T, D)


def _expand_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # GQA: query head h uses kv head h // n_rep; the kernel indexes the kv head instead of copying.
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)  # (B, Hq, Tk, D)


def _causal_mask(m0: int, m1: int, n0: int, n1: int, seqlen_q: int, seqlen_k: int, device) -> torch.Tensor:
    """True where key j is NOT visible to query i for rows [m0, m1) x cols [n0, n1) (bottom-right aligned)."""
    rows = torch.arange(m0, m1, device=device)[:, None]
    cols = torch.arange(n0, n1, device=device)[None, :]
    return cols > rows + (seqlen_k - seqlen_q)  # (m1 - m0, n1 - n0)


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool, window_size: tuple[int, int] = (-1, -1),
                 device=None) -> torch.Tensor:
    """True where query i may see key j: FlashAttention's rule, after bottom-right alignment (i' = i + Tk - Tq),
    i' - left <= j <= i' + right with -1 unbounded, and causal making right 0. (Tq, Tk) bool."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    cols = torch.arange(seqlen_k, device=device)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= cols <= rows + right
    if left >= 0:
        visible &= cols >= rows - left
    return visible


def _n_block_max(m1: int, seqlen_q: int, seqlen_k: int, block_n: int, causal: bool) -> int:
    """Number of K/V blocks a Q block whose last row is m1 - 1 must visit (causal: blocks above the diagonal skipped)."""
    n_blocks = math.ceil(seqlen_k / block_n)
    if not causal:
        return n_blocks
    last_visible_key = (m1 - 1) + (seqlen_k - seqlen_q)
    return max(0, min(n_blocks, math.ceil((last_visible_key + 1) / block_n)))


def _m_block_min(n0: int, seqlen_q: int, seqlen_k: int, block_m: int, causal: bool) -> int:
    """First Q block that sees key n0 (causal); Q blocks before it are skipped by the backward's inner loop."""
    if not causal:
        return 0
    first_row = n0 - (seqlen_k - seqlen_q)  # the first query i with n0 <= i + Tk - Tq
    return max(0, first_row // block_m)


def _needs_mask(m0: int, n1: int, seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    # Only tiles that cross the diagonal are masked; the last key of the tile is past the first row's limit.
    return causal and (n1 - 1) > m0 + (seqlen_k - seqlen_q)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"reference: q, k, v must be (B, T, H, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"reference: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"reference: q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch and head dim")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"reference: q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")


@torch.no_grad()
def reference_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float | None,
    block_m: int = 64,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FA2 Algorithm 1. q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D) -> o (B, Tq, Hq, D) in q.dtype, lse (B, Hq, Tq) float32."""
    _check(q, k, v)
    B, seqlen_q, Hq, D = q.shape
    seqlen_k, Hkv = k.shape[1], k.shape[2]
    softmax_scale = _default_scale(softmax_scale, D)
    scale_log2 = softmax_scale * LOG2E
    acc = _acc_dtype(q.dtype)
    q_ = _to_bhtd(q, acc)  # (B, Hq, Tq, D)
    k_ = _expand_kv(_to_bhtd(k, acc), Hq // Hkv)  # (B, Hq, Tk, D)
    v_ = _expand_kv(_to_bhtd(v, acc), Hq // Hkv)  # (B, Hq, Tk, D)
    o = torch.empty(B, Hq, seqlen_q, D, dtype=acc, device=q.device)
    lse = torch.empty(B, Hq, seqlen_q, dtype=torch.float32, device=q.device)

    for m0 in range(0, seqlen_q, block_m):  # one thread block per Q block (and per batch, head)
        m1 = min(m0 + block_m, seqlen_q)
        q_i = q_[:, :, m0:m1]  # (B, Hq, bm, D), loaded once, stays in registers
        m_i = torch.full((B, Hq, m1 - m0), -math.inf, dtype=acc, device=q.device)  # running row max of raw scores
        l_i = torch.zeros(B, Hq, m1 - m0, dtype=acc, device=q.device)  # running row sum of exp2, not yet divided
        acc_o = torch.zeros(B, Hq, m1 - m0, D, dtype=acc, device=q.device)  # unnormalised output
        for n0 in range(0, block_n * _n_block_max(m1, seqlen_q, seqlen_k, block_n, causal), block_n):
            n1 = min(n0 + block_n, seqlen_k)  # the tail block is short: that is the kernel's seqlen_k mask
            s = q_i @ k_[:, :, n0:n1].transpose(-1, -2)  # S = Q K^T, raw, (B, Hq, bm, bn)
            if _needs_mask(m0, n1, seqlen_q, seqlen_k, causal):
                s = s.masked_fill(_causal_mask(m0, m1, n0, n1, seqlen_q, seqlen_k, q.device), -math.inf)
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            # A row with every key masked so far has m_new = -inf; subtracting 0 instead keeps exp2(-inf) = 0
            # rather than exp2(-inf - -inf) = NaN (the kernel's `max == -INF ? 0 : max * scale`).
            m_scaled = torch.where(m_new == -math.inf, 0.0, m_new * scale_log2)
            p = torch.exp2(s * scale_log2 - m_scaled[..., None])  # (B, Hq, bm, bn)
            correction = torch.exp2(m_i * scale_log2 - m_scaled)  # rescales what earlier tiles accumulated
            l_i = l_i * correction + p.sum(dim=-1)
            # The kernel casts P to the input dtype before the PV mma; with fp32 here that is a no-op.
            acc_o = acc_o * correction[..., None] + p @ v_[:, :, n0:n1]
            m_i = m_new
        # Deferred normalisation: one division per row at the end instead of one per tile.
        # l_i == 0 means no visible key: o = 0, lse = +inf, so the backward's exp(s - lse) is 0 there.
        empty = l_i == 0
        o[:, :, m0:m1] = acc_o / torch.where(empty, 1.0, l_i)[..., None]
        lse_i = m_i * softmax_scale + torch.log(torch.where(empty, 1.0, l_i))
        lse[:, :, m0:m1] = torch.where(empty, math.inf, lse_i).float()
    return o.transpose(1, 2).to(q.dtype), lse  # (B, Tq, Hq, D), (B, Hq, Tq)


@torch.no_grad()
def reference_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float | None,
    block_m: int = 64,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA2 Algorithm 2. Recomputes P from lse (no T x T tensor kept); returns dq, dk, dv shaped and typed like q, k, v."""
    _check(q, k, v)
    B, seqlen_q, Hq, D = q.shape
    seqlen_k, Hkv = k.shape[1], k.shape[2]
    n_rep = Hq // Hkv
    softmax_scale = _default_scale(softmax_scale, D)
    scale_log2 = softmax_scale * LOG2E
    acc = _acc_dtype(q.dtype)
    q_ = _to_bhtd(q, acc)  # (B, Hq, Tq, D)
    k_ = _expand_kv(_to_bhtd(k, acc), n_rep)  # (B, Hq, Tk, D)
    v_ = _expand_kv(_to_bhtd(v, acc), n_rep)  # (B, Hq, Tk, D)
    do_ = _to_bhtd(do, acc)  # (B, Hq, Tq, D)
    lse_log2 = lse.to(acc) * LOG2E  # (B, Hq, Tq); +inf on empty rows makes every p there exp2(-inf) = 0

    # Preprocess: delta_i = rowsum(dO_i * O_i), read in the input dtype as the kernel does.
    delta = (do_ * _to_bhtd(o, acc)).sum(dim=-1)  # (B, Hq, Tq)
    dq_accum = torch.zeros(B, Hq, seqlen_q, D, dtype=acc, device=q.device)  # float32 across K/V blocks
    dk = torch.empty(B, Hq, seqlen_k, D, dtype=acc, device=q.device)
    dv = torch.empty(B, Hq, seqlen_k, D, dtype=acc, device=q.device)

    for n0 in range(0, seqlen_k, block_n):  # one thread block per K/V block: acc_dk, acc_dv stay on chip
        n1 = min(n0 + block_n, seqlen_k)
        k_j, v_j = k_[:, :, n0:n1], v_[:, :, n0:n1]  # (B, Hq, bn, D)
        acc_dk = torch.zeros(B, Hq, n1 - n0, D, dtype=acc, device=q.device)
        acc_dv = torch.zeros(B, Hq, n1 - n0, D, dtype=acc, device=q.device)
        for m0 in range(block_m * _m_block_min(n0, seqlen_q, seqlen_k, block_m, causal), seqlen_q, block_m):
            m1 = min(m0 + block_m, seqlen_q)
            q_i, do_i = q_[:, :, m0:m1], do_[:, :, m0:m1]  # (B, Hq, bm, D)
            s = q_i @ k_j.transpose(-1, -2)  # (B, Hq, bm, bn), recomputed
            if _needs_mask(m0, n1, seqlen_q, seqlen_k, causal):
                s = s.masked_fill(_causal_mask(m0, m1, n0, n1, seqlen_q, seqlen_k, q.device), -math.inf)
            p = torch.exp2(s * scale_log2 - lse_log2[:, :, m0:m1, None])  # P = exp(scale * S - LSE)
            acc_dv += p.transpose(-1, -2) @ do_i  # dV_j += P^T dO_i
            dp = do_i @ v_j.transpose(-1, -2)  # dP = dO_i V_j^T, (B, Hq, bm, bn)
            ds = p * (dp - delta[:, :, m0:m1, None])  # dS = P o (dP - D_i); the softmax scale is applied below
            acc_dk += ds.transpose(-1, -2) @ q_i  # dK_j += dS^T Q_i
            dq_accum[:, :, m0:m1] += ds @ k_j  # dQ_i += dS K_j (atomicAdd in the kernel, or a separate pass)
        # d(scale * S) = dS, so dK and dQ each pick up the softmax scale once, at the end.
        dk[:, :, n0:n1] = acc_dk * softmax_scale
        dv[:, :, n0:n1] = acc_dv
    dq = dq_accum * softmax_scale

    def _sum_groups(x: torch.Tensor) -> torch.Tensor:
        # GQA: a kv head's gradient is the sum over the query heads that read it.
        return x.view(B, Hkv, n_rep, seqlen_k, D).sum(dim=2)  # (B, Hkv, Tk, D)

    dq = dq.transpose(1, 2).to(q.dtype)  # (B, Tq, Hq, D)
    dk = _sum_groups(dk).transpose(1, 2).to(k.dtype)  # (B, Tk, Hkv, D)
    dv = _sum_groups(dv).transpose(1, 2).to(v.dtype)  # (B, Tk, Hkv, D)
    return dq, dk, dv


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    upcast: bool = True,
    window_size: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook oracle: materialises S = scale * Q K^T, masks, softmaxes, multiplies by V; differentiable.

    Same conventions as the kernel (GQA, bottom-right causal, the sliding window of visible_keys, empty rows ->
    o = 0, lse = +inf, zero gradients). upcast=True computes in float32 (float64 for float64 inputs): the accuracy reference.
    upcast=False computes in the input dtype: "what PyTorch gets in low precision", the error yardstick of
    the flash-attn test criterion. Returns o (B, Tq, Hq, D) and lse (B, Hq, Tq) in the compute dtype
    (lse at least float32).
    """
    _check(q, k, v)
    B, seqlen_q, Hq, D = q.shape
    seqlen_k, Hkv = k.shape[1], k.shape[2]
    softmax_scale = _default_scale(softmax_scale, D)
    dtype = _acc_dtype(q.dtype) if upcast else q.dtype
    q_ = _to_bhtd(q, dtype)  # (B, Hq, Tq, D)
    k_ = _expand_kv(_to_bhtd(k, dtype), Hq // Hkv)  # (B, Hq, Tk, D)
    v_ = _expand_kv(_to_bhtd(v, dtype), Hq // Hkv)  # (B, Hq, Tk, D)
    scores = (q_ * softmax_scale) @ k_.transpose(-1, -2)  # (B, Hq, Tq, Tk)
    if causal or window_size != (-1, -1) or seqlen_k == 0:
        mask = ~visible_keys(seqlen_q, seqlen_k, causal, window_size, q.device)  # (Tq, Tk)
        empty = mask.all(dim=-1)  # (Tq,) rows that see no key
        # Empty rows get finite scores (then a zero P), so neither forward nor autograd sees -inf - -inf.
        scores = scores.masked_fill(mask, -math.inf).masked_fill(empty[:, None], 0.0)
    else:
        empty = torch.zeros(seqlen_q, dtype=torch.bool, device=q.device)
    lse_dtype = torch.promote_types(scores.dtype, torch.float32)
    lse = torch.logsumexp(scores.to(lse_dtype), dim=-1).masked_fill(empty, math.inf)  # (B, Hq, Tq)
    p = torch.softmax(scores, dim=-1) * (~empty)[:, None].to(dtype)  # (B, Hq, Tq, Tk)
    o = p @ v_  # (B, Hq, Tq, D)
    return o.transpose(1, 2), lse  # (B, Tq, Hq, D), (B, Hq, Tq)


class _ReferenceAttnFunction(torch.autograd.Function):
    """Autograd over reference_fwd / reference_bwd, saving what the kernel saves: q, k, v, o, lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, softmax_scale: float | None, block_m: int, block_n: int):
        o, lse = reference_fwd(q, k, v, causal, softmax_scale, block_m, block_n)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.softmax_scale, ctx.block_m, ctx.block_n = causal, softmax_scale, block_m, block_n
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = reference_bwd(do, q, k, v, o, lse, ctx.causal, ctx.softmax_scale, ctx.block_m, ctx.block_n)
        return dq, dk, dv, None, None, None, None


def reference_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Differentiable tiled FA2 attention on any device: q (B, Tq, Hq, D), k/v (B, Tk, Hkv, D) -> o (B, Tq, Hq, D)."""
    return _ReferenceAttnFunction.apply(q, k, v, causal, softmax_scale, block_m, block_n)


def naive_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
    window_size: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """naive_attention per packed sequence, the oracle of flash_attn_varlen_func; differentiable.

    q (total_q, Hq, D), k/v (total_k, Hkv, D), cu_seqlens (batch + 1,) -> o (total_q, Hq, D) and lse (Hq, total_q):
    sequence s's rows of q attend to sequence s's rows of k and v alone, causal and window aligned with its own
    lengths. Empty sequences contribute no rows.
    """
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for s in range(len(bounds_q) - 1):
        q_s = q[bounds_q[s]:bounds_q[s + 1]][None]  # (1, Tq_s, Hq, D)
        k_s = k[bounds_k[s]:bounds_k[s + 1]][None]  # (1, Tk_s, Hkv, D)
        v_s = v[bounds_k[s]:bounds_k[s + 1]][None]
        o_s, lse_s = naive_attention(q_s, k_s, v_s, causal, softmax_scale, upcast, window_size)
        outs.append(o_s[0])  # (Tq_s, Hq, D)
        lses.append(lse_s[0])  # (Hq, Tq_s)
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)  # (total_q, Hq, D), (Hq, total_q)
