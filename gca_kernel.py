"""
FlashGCA: Grouped Cross-Attention (Eq. 2; §3.1 and Appendix B of the paper) as fused Triton kernels,
forward and backward, reading the retrieved chunks straight from the memory.

    o[b, c] = sum_i w[b, c, i] * softmax(q[b, c] @ k_mem[b, m_i]^T / sqrt(D)) @ v_mem[b, m_i]
              with m_i = idx[b, c, i], one softmax per (query chunk, pick, head)

Algorithm. One program per (query chunk c, batch b, head h) owns the [S, D]
query tile and loops over the K picks: load idx and w, load the picked chunk's
[S, D] key and value tiles by index (no gathered copy of K/V is ever made),
s = q k^T, full-row softmax, o_i = p v / l, acc += w_i o_i. A chunk's S keys
fit one tile, so there is no online softmax. Scores are kept in log2 units
(the scale carries 1/ln 2) so the kernels use exp2. The forward saves one
log-sum-exp per (query, pick, head): lse of shape (B, C, H, K, S), fp32, in
log2 units. That is the only extra tensor; o is not saved. Grid (C, B*H):
query chunks vary fastest, so the neighbouring chunks of one (b, h), which
pick largely the same memory chunks, run together and share K/V in L2.

Memory layout. q, o: (B, C, S, H, D); k_mem, v_mem: (B, M, S, H, D); any
strides with the last dim contiguous (o, dq, dk, dv are allocated contiguous).
In the model q is a view of a (B, T, H*D) projection, so a query tile is S rows
H*D apart. idx, w: (B, C, K), made contiguous here.

Backward, deterministic, no atomics, recomputing P from the lse:
  1. dq/dw kernel, one program per (c, b, h), same grid as the forward:
     dP'_i = dO v_i^T (the gradient of P_i before the weight), delta_i =
     rowsum(P_i * dP'_i) = rowsum(dO * O_i), dS_i = w_i P_i (dP'_i - delta_i),
     dq = scale sum_i dS_i k_i. dw_i = <dO, O_i> = sum_s delta_i[s] falls out
     (also where w_i = 0); it is written per head, (B, C, H, K) fp32, and summed
     over heads in torch. delta itself is stored, (B, C, H, K, S) fp32 like lse,
     for kernel 2: there it would be a column sum across warps, a shared-memory
     round trip in every iteration.
  2. dk/dv kernel over the INVERTED selection: for each memory chunk, the
     (query chunk, slot) pairs that picked it with w != 0, as CSR built in
     torch (stable argsort + bincount) by the backward formula, outside the
     op: all layers of a retrieval group share idx and w, so torch.compile
     builds it once per group. One program per (memory chunk, head) loops over
     its pairs with the same recomputation, transposed (keys x queries), and
     writes dk, dv once. Chunks nobody picked get zeros. Chunks
     run busiest first, all heads of one chunk together (a hot chunk may be
     picked by hundreds of query chunks while the mean is K), so the long
     programs do not straggle at the end.
  Extra memory: dq, dk, dv themselves, delta, dw partials (B, C, H, K) and the CSR
  (about 3 * B*C*K int64); nothing of size K x the output.

Precision. Dots take the input dtype (tensor cores for fp16/bf16) and
accumulate in fp32; p and dS are cast to the input dtype before their dots,
as in flash attention. fp32 inputs use input_precision="ieee" (exact fp32
dots, slower: fp32 is the checking path, not the fast one).

Limits. D in {16, 32, 64, 128}; S a power of 2 in [16, 128]; q, k_mem, v_mem
share one dtype in {fp16, bf16, fp32}, and in fp32 S * D <= 8192 (a 128 x 128
fp32 tile set overflows shared memory); no masking inside a chunk (the model's
zero landmark row acts as a sink key through the data, not through the
kernel). Validation costs one host sync (the range check of idx; skip it
with check_idx=False). Launch parameters live in FWD_CONFIG / DQ_CONFIG /
DKDV_CONFIG.
Without a GPU, run under TRITON_INTERPRET=1 (set before triton is imported).
"""

import os

import torch
import triton
import triton.language as tl

# Launch parameters per kernel (bench.py --kernel --sweep tries others). None picks by
# tile size: up to 8 KiB tiles (S = D = 64 in bf16) 4 warps and 4 stages (the
# sweep's best for all three kernels on an H200), else 8 warps (at 4, larger
# tiles spill registers on sm_90) and 2 stages (shared memory).
FWD_CONFIG = dict(num_warps=None, num_stages=None)
DQ_CONFIG = dict(num_warps=None, num_stages=None)
DKDV_CONFIG = dict(num_warps=None, num_stages=None)

# Tests set this: freshly allocated outputs start as NaN, so an element a
# kernel forgot to write fails the comparison instead of passing by luck.
DEBUG_POISON = False

LOG2E = 1.44269504  # 1/ln 2: exp(x) = exp2(x * LOG2E)


@triton.jit
def _tile(base, stride_s, S: tl.constexpr, D: tl.constexpr):
    """Pointers of an [S, D] tile whose rows are stride_s apart (last dim contiguous)."""
    o_s = tl.arange(0, S)
    o_d = tl.arange(0, D)
    return base + o_s[:, None] * stride_s + o_d[None, :]  # [S, D]


@triton.jit
def _gca_fwd_kernel(
    Q, K, V, IDX, W, O, LSE,
    sq_b, sq_c, sq_s, sq_h,  # strides of q (B, C, S, H, D); the last one is 1
    sk_b, sk_m, sk_s, sk_h,  # k_mem (B, M, S, H, D)
    sv_b, sv_m, sv_s, sv_h,  # v_mem (B, M, S, H, D)
    so_b, so_c, so_s, so_h,  # o (B, C, S, H, D)
    C, H, NK,
    qk_scale: tl.constexpr,  # 1/sqrt(D) * 1/ln 2; constexpr: a Python float argument would be fp64 under Inductor
    S: tl.constexpr, D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tl.static_assert(S >= 16 and D >= 16, "tl.dot needs tiles of at least 16 x 16")
    tl.static_assert((S & (S - 1)) == 0 and (D & (D - 1)) == 0, "tl.arange needs powers of 2")
    # query chunks vary fastest: neighbouring chunks of one (b, h) run together
    # and share their (largely the same) picked K/V tiles in L2
    i_c, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_s = tl.arange(0, S)
    o_pick = (i_b * C + i_c) * NK  # row (b, c) of idx and w
    o_lse = ((i_b * C + i_c) * H + i_h) * NK * S  # lse[b, c, h]
    b_q = tl.load(_tile(Q + i_b * sq_b + i_c * sq_c + i_h * sq_h, sq_s, S, D))  # [S, D]
    p_k = K + i_b * sk_b + i_h * sk_h
    p_v = V + i_b * sv_b + i_h * sv_h
    b_acc = tl.zeros([S, D], dtype=tl.float32)  # [S, D] sum_i w_i o_i
    for i in range(NK):
        i_m = tl.load(IDX + o_pick + i)  # memory chunk of pick i (int64)
        b_w = tl.load(W + o_pick + i).to(tl.float32)
        b_k = tl.load(_tile(p_k + i_m * sk_m, sk_s, S, D))  # [S, D]
        b_v = tl.load(_tile(p_v + i_m * sv_m, sv_s, S, D))  # [S, D]
        # -- scores in log2 units --
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale  # [S, S]
        # -- softmax over the S keys of this chunk: one tile, no rescaling --
        b_mx = tl.max(b_s, 1)  # [S]
        b_p = tl.exp2(b_s - b_mx[:, None])  # [S, S]
        b_l = tl.sum(b_p, 1)  # [S]
        # -- o_i = p v / l, weighted into the accumulator --
        b_o = tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)  # [S, D]
        b_acc += b_o * (b_w / b_l)[:, None]
        tl.store(LSE + o_lse + i * S + o_s, b_mx + tl.log2(b_l))  # [S]
    p_o = _tile(O + i_b * so_b + i_c * so_c + i_h * so_h, so_s, S, D)
    tl.store(p_o, b_acc.to(O.dtype.element_ty))


@triton.jit
def _gca_bwd_dq_kernel(
    Q, K, V, IDX, W, DO, LSE, DELTA, DQ, DW,
    sq_b, sq_c, sq_s, sq_h,  # q
    sk_b, sk_m, sk_s, sk_h,  # k_mem
    sv_b, sv_m, sv_s, sv_h,  # v_mem
    so_b, so_c, so_s, so_h,  # do and dq (both contiguous (B, C, S, H, D))
    C, H, NK, qk_scale: tl.constexpr, sm_scale: tl.constexpr,
    S: tl.constexpr, D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    i_c, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_s = tl.arange(0, S)
    o_pick = (i_b * C + i_c) * NK
    o_lse = ((i_b * C + i_c) * H + i_h) * NK * S
    o_dw = ((i_b * C + i_c) * H + i_h) * NK  # dw_part[b, c, h]
    b_q = tl.load(_tile(Q + i_b * sq_b + i_c * sq_c + i_h * sq_h, sq_s, S, D))  # [S, D]
    b_do = tl.load(_tile(DO + i_b * so_b + i_c * so_c + i_h * so_h, so_s, S, D))  # [S, D]
    p_k = K + i_b * sk_b + i_h * sk_h
    p_v = V + i_b * sv_b + i_h * sv_h
    b_dq = tl.zeros([S, D], dtype=tl.float32)  # [S, D]
    for i in range(NK):
        i_m = tl.load(IDX + o_pick + i)
        b_w = tl.load(W + o_pick + i).to(tl.float32)
        b_k = tl.load(_tile(p_k + i_m * sk_m, sk_s, S, D))  # [S, D]
        b_v = tl.load(_tile(p_v + i_m * sv_m, sv_s, S, D))  # [S, D]
        b_lse = tl.load(LSE + o_lse + i * S + o_s)  # [S]
        # -- recompute P_i from the saved lse --
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale  # [S, S]
        b_p = tl.exp2(b_s - b_lse[:, None])  # [S, S]
        # -- dP'_i = dO v_i^T: the gradient of P_i, before the weight w_i --
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)  # [S, S]
        # -- delta_i = rowsum(P_i * dP'_i) = rowsum(dO * O_i); dw_i is its sum --
        b_delta = tl.sum(b_p * b_dp, 1)  # [S]
        tl.store(DELTA + o_lse + i * S + o_s, b_delta)  # for the dk/dv kernel, laid out like lse
        tl.store(DW + o_dw + i, tl.sum(b_delta, 0))
        # -- dS_i = w_i P_i (dP'_i - delta_i); dq += dS_i k_i --
        b_ds = b_p * (b_w * (b_dp - b_delta[:, None]))  # [S, S]
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)  # [S, D]
    p_dq = _tile(DQ + i_b * so_b + i_c * so_c + i_h * so_h, so_s, S, D)
    tl.store(p_dq, (b_dq * sm_scale).to(DQ.dtype.element_ty))


@triton.jit
def _gca_bwd_dkdv_kernel(
    Q, K, V, W, DO, LSE, DELTA, DK, DV, ORDER, OFFSETS, PAIRS,
    sq_b, sq_c, sq_s, sq_h,  # q
    sk_b, sk_m, sk_s, sk_h,  # k_mem
    sv_b, sv_m, sv_s, sv_h,  # v_mem
    so_b, so_c, so_s, so_h,  # do (contiguous (B, C, S, H, D))
    sd_b, sd_m, sd_s, sd_h,  # dk and dv (both contiguous (B, M, S, H, D))
    C, M, H, NK, qk_scale: tl.constexpr, sm_scale: tl.constexpr,
    S: tl.constexpr, D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # heads vary fastest, so all heads of the busiest memory chunk start first
    i_pid = tl.program_id(0).to(tl.int64)
    i_r, i_h = i_pid // H, i_pid % H
    i_bm = tl.load(ORDER + i_r)  # flat memory chunk b * M + m, by decreasing pick count
    i_b, i_m = i_bm // M, i_bm % M
    j_start = tl.load(OFFSETS + i_bm)
    j_end = tl.load(OFFSETS + i_bm + 1)
    o_s = tl.arange(0, S)
    b_k = tl.load(_tile(K + i_b * sk_b + i_m * sk_m + i_h * sk_h, sk_s, S, D))  # [S, D]
    b_v = tl.load(_tile(V + i_b * sv_b + i_m * sv_m + i_h * sv_h, sv_s, S, D))  # [S, D]
    b_dk = tl.zeros([S, D], dtype=tl.float32)  # [S, D]
    b_dv = tl.zeros([S, D], dtype=tl.float32)  # [S, D]
    for j in range(j_start, j_end):
        i_p = tl.load(PAIRS + j)  # flat index (b * C + c) * NK + i of a pick of this chunk
        i_c, i_i = (i_p // NK) % C, i_p % NK
        b_w = tl.load(W + i_p).to(tl.float32)
        b_q = tl.load(_tile(Q + i_b * sq_b + i_c * sq_c + i_h * sq_h, sq_s, S, D))  # [S, D]
        b_do = tl.load(_tile(DO + i_b * so_b + i_c * so_c + i_h * so_h, so_s, S, D))  # [S, D]
        o_lse = (((i_b * C + i_c) * H + i_h) * NK + i_i) * S
        b_lse = tl.load(LSE + o_lse + o_s)  # [S] queries
        b_delta = tl.load(DELTA + o_lse + o_s)  # [S] rowsum(dO * O_i), from the dq kernel
        # -- recompute P^T (keys x queries) --
        b_st = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION) * qk_scale  # [S, S]
        b_pt = tl.exp2(b_st - b_lse[None, :])  # [S, S]
        # -- dv += w P^T dO --
        b_dv += tl.dot((b_pt * b_w).to(b_do.dtype), b_do, input_precision=DOT_PRECISION)
        # -- dP'^T = v dO^T --
        b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)  # [S, S]
        # -- dS^T = w P^T (dP'^T - delta); dk += dS^T q --
        b_dst = b_pt * (b_w * (b_dpt - b_delta[None, :]))  # [S, S]
        b_dk += tl.dot(b_dst.to(b_q.dtype), b_q, input_precision=DOT_PRECISION)  # [S, D]
    o_d = i_b * sd_b + i_m * sd_m + i_h * sd_h
    tl.store(_tile(DK + o_d, sd_s, S, D), (b_dk * sm_scale).to(DK.dtype.element_ty))
    tl.store(_tile(DV + o_d, sd_s, S, D), b_dv.to(DV.dtype.element_ty))


def _new(shape, dtype, device):
    if DEBUG_POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _strides(x):
    assert x.stride(-1) == 1, "the kernels need the head dim contiguous"
    return x.stride()[:4]


def _launch(config, x):
    """Launch kwargs for a kernel whose tiles are [S, D] slices of x."""
    small = x.shape[2] * x.shape[4] * x.element_size() <= 8192
    return dict(num_warps=config["num_warps"] or (4 if small else 8),
                num_stages=config["num_stages"] or (4 if small else 2))


def _dot_precision(dtype):
    # exact fp32 dots for fp32 inputs (else tf32); irrelevant for fp16/bf16
    return "ieee" if dtype == torch.float32 else "tf32"


def _invert_selection(idx, w, M):
    """Who picked each memory chunk: CSR over the B*M flat chunks b * M + m.

    Returns order (B*M,) the chunks by decreasing pick count, offsets (B*M+1,)
    and pairs (P,) the flat pick indices (b * C + c) * K + i grouped by chunk
    (pairs[offsets[r]:offsets[r+1]] picked chunk r). Picks with w == 0 are
    dropped: their dk/dv contribution is exactly zero. No host sync (bincount
    would read the max back to size its output; the size is known: B*M+1)."""
    B = idx.shape[0]
    key = idx + M * torch.arange(B, device=idx.device)[:, None, None]  # (B, C, K)
    key = key.masked_fill(w == 0, B * M).flatten()  # dropped picks go to a bucket past the end
    pairs = torch.argsort(key, stable=True)  # (B*C*K,)
    counts = torch.zeros(B * M + 1, dtype=torch.long, device=idx.device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[: B * M]  # (B*M,)
    offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))  # (B*M+1,)
    order = torch.argsort(counts, descending=True, stable=True)  # longest first
    return order, offsets, pairs


# The kernels as two custom ops, forward and backward, so that torch.compile treats FlashGCA
# as one opaque op (it never traces into the launches) and autograd pairs them.

@torch.library.custom_op("drt::flash_gca_fwd", mutates_args=())
def _gca_fwd(q: torch.Tensor, k_mem: torch.Tensor, v_mem: torch.Tensor, idx: torch.Tensor,
             w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, C, S, H, D = q.shape
    NK = idx.shape[-1]
    o = _new((B, C, S, H, D), q.dtype, q.device)
    lse = _new((B, C, H, NK, S), torch.float32, q.device)  # log2 units
    if o.numel() > 0:
        _gca_fwd_kernel[(C, B * H)](
            q, k_mem, v_mem, idx, w, o, lse,
            *_strides(q), *_strides(k_mem), *_strides(v_mem), *_strides(o),
            C, H, NK, D ** -0.5 * LOG2E,
            S=S, D=D, DOT_PRECISION=_dot_precision(q.dtype), **_launch(FWD_CONFIG, q),
        )
    return o, lse


@_gca_fwd.register_fake
def _(q, k_mem, v_mem, idx, w):
    B, C, S, H, D = q.shape
    return q.new_empty(B, C, S, H, D), q.new_empty(B, C, H, idx.shape[-1], S, dtype=torch.float32)


@torch.library.custom_op("drt::flash_gca_bwd", mutates_args=())
def _gca_bwd(do: torch.Tensor, q: torch.Tensor, k_mem: torch.Tensor, v_mem: torch.Tensor, idx: torch.Tensor,
             w: torch.Tensor, lse: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
             pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, C, S, H, D = q.shape
    M, NK = k_mem.shape[1], idx.shape[-1]
    do = do.to(q.dtype).contiguous()  # (B, C, S, H, D)
    sm_scale = D ** -0.5
    args = dict(S=S, D=D, DOT_PRECISION=_dot_precision(q.dtype))
    # 1. dq, dw and delta_i = rowsum(dO * O_i), which the dk/dv kernel reads like lse
    dq = _new((B, C, S, H, D), q.dtype, q.device)
    dw_part = _new((B, C, H, NK), torch.float32, q.device)  # per-head partials
    delta = _new((B, C, H, NK, S), torch.float32, q.device)
    if dq.numel() > 0:
        _gca_bwd_dq_kernel[(C, B * H)](
            q, k_mem, v_mem, idx, w, do, lse, delta, dq, dw_part,
            *_strides(q), *_strides(k_mem), *_strides(v_mem), *_strides(do),
            C, H, NK, sm_scale * LOG2E, sm_scale, **args, **_launch(DQ_CONFIG, q),
        )
    dw = dw_part.sum(2).to(w.dtype)  # (B, C, K): sum over heads
    # 2. dk, dv over the inverted selection
    dk = _new(k_mem.shape, k_mem.dtype, k_mem.device)
    dv = _new(v_mem.shape, v_mem.dtype, v_mem.device)
    if dk.numel() > 0:
        _gca_bwd_dkdv_kernel[(B * M * H,)](
            q, k_mem, v_mem, w, do, lse, delta, dk, dv, order, offsets, pairs,
            *_strides(q), *_strides(k_mem), *_strides(v_mem), *_strides(do),
            *_strides(dk), C, M, H, NK, sm_scale * LOG2E, sm_scale,
            **args, **_launch(DKDV_CONFIG, q),
        )
    return dq, dk, dv, dw


@_gca_bwd.register_fake
def _(do, q, k_mem, v_mem, idx, w, lse, order, offsets, pairs):
    return (q.new_empty(q.shape), k_mem.new_empty(k_mem.shape), v_mem.new_empty(v_mem.shape),
            w.new_empty(w.shape))


def _setup_context(ctx, inputs, output):
    q, k_mem, v_mem, idx, w = inputs
    ctx.save_for_backward(q, k_mem, v_mem, idx, w, output[1])  # output[1]: lse; o is not kept


def _backward(ctx, do, _dlse):
    q, k_mem, v_mem, idx, w, lse = ctx.saved_tensors
    # The inverted selection depends on idx and w alone, which all layers of a retrieval group
    # share: built here, outside the opaque op, torch.compile computes it once per group
    # (common subexpressions) instead of once per layer.
    order, offsets, pairs = _invert_selection(idx, w, k_mem.shape[1])
    dq, dk, dv, dw = _gca_bwd(do, q, k_mem, v_mem, idx, w, lse, order, offsets, pairs)
    return dq, dk, dv, None, dw


_gca_fwd.register_autograd(_backward, setup_context=_setup_context)


TILE_SIZES = (16, 32, 64, 128)  # chunk sizes S and head widths D the kernels are built for
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP32_TILE_LIMIT = 64 * 128  # S * D: larger fp32 tile sets overflow shared memory


def kernel_fits(S, D, dtype):
    """Whether the kernels take chunks of S positions, heads of width D and this dtype
    (model.py runs the PyTorch reference of GCA for anything else)."""
    return (S in TILE_SIZES and D in TILE_SIZES and dtype in DTYPES
            and not (dtype == torch.float32 and S * D > FP32_TILE_LIMIT))


def _check_inputs(q, k_mem, v_mem, idx, w, check_idx=True):
    for name, x in (("q", q), ("k_mem", k_mem), ("v_mem", v_mem), ("idx", idx), ("w", w)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"flash_gca: {name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 5 or k_mem.dim() != 5:
        raise ValueError(f"flash_gca: q must be (B, C, S, H, D) and k_mem (B, M, S, H, D), "
                         f"got q {tuple(q.shape)}, k_mem {tuple(k_mem.shape)}")
    B, C, S, H, D = q.shape
    if k_mem.shape[0] != B or k_mem.shape[2:] != q.shape[2:]:
        raise ValueError(f"flash_gca: k_mem {tuple(k_mem.shape)} must be (B, M, S, H, D) = "
                         f"({B}, M, {S}, {H}, {D}) to match q {tuple(q.shape)}")
    if v_mem.shape != k_mem.shape:
        raise ValueError(f"flash_gca: v_mem {tuple(v_mem.shape)} must have the shape of "
                         f"k_mem {tuple(k_mem.shape)}")
    if idx.dim() != 3 or idx.shape[:2] != (B, C) or idx.shape[2] < 1:
        raise ValueError(f"flash_gca: idx {tuple(idx.shape)} must be (B, C, K) = ({B}, {C}, K) "
                         f"with K >= 1, to match q {tuple(q.shape)}")
    if w.shape != idx.shape:
        raise ValueError(f"flash_gca: w {tuple(w.shape)} must have the shape of idx {tuple(idx.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"flash_gca: q must be fp16, bf16 or fp32, got {q.dtype}")
    if k_mem.dtype != q.dtype or v_mem.dtype != q.dtype:
        raise TypeError(f"flash_gca: q, k_mem, v_mem must share one dtype, got {q.dtype}, "
                        f"{k_mem.dtype}, {v_mem.dtype}: cast them (e.g. k_mem.to(q.dtype))")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"flash_gca: idx must be an integer tensor (int64), got {idx.dtype}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"flash_gca: w must be a float tensor, got {w.dtype}")
    if D not in TILE_SIZES:
        raise ValueError(f"flash_gca: head dim D={D} is not supported: use 16, 32, 64 or 128")
    if S not in TILE_SIZES:
        raise ValueError(f"flash_gca: chunk size S={S} is not supported: use a power of 2 in [16, 128]")
    if q.dtype == torch.float32 and S * D > FP32_TILE_LIMIT:
        raise ValueError(f"flash_gca: fp32 tiles of S x D = {S} x {D} do not fit in shared memory: "
                         "use bf16/fp16, or S * D <= 8192 in fp32")
    devices = {x.device for x in (q, k_mem, v_mem, idx, w)}
    if len(devices) != 1:
        raise ValueError(f"flash_gca: all inputs must be on one device, got {sorted(map(str, devices))}")
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"flash_gca: inputs are on {q.device}: the Triton kernels need CUDA "
                         "tensors (or TRITON_INTERPRET=1 set before triton is imported)")
    if check_idx and idx.numel() > 0:
        lo, hi = torch.aminmax(idx)  # one host sync: an out-of-range pick would read foreign memory
        if lo.item() < 0 or hi.item() >= k_mem.shape[1]:
            raise ValueError(f"flash_gca: idx must lie in [0, M={k_mem.shape[1]}), "
                             f"got values in [{lo.item()}, {hi.item()}]")


def flash_gca(q, k_mem, v_mem, idx, w, *, check_idx=True):
    """Grouped cross-attention, fused: sum_i w_i * softmax(q k_i^T / sqrt(D)) v_i.

    q:     [B, C, S, H, D] queries grouped by chunk (a view of [B, T, H, D] is fine)
    k_mem: [B, M, S, H, D] memory keys of M chunks; v_mem likewise
    idx:   [B, C, K] integer in [0, M): the chunks picked for each query chunk
    w:     [B, C, K] float: their weights (0 for a pick that must not count)
    returns o: [B, C, S, H, D] in q's dtype. Differentiable in q, k_mem, v_mem, w
    (each gradient in its input's dtype). Any strides with the last dim contiguous.
    check_idx=False skips the range check of idx, the one host sync (e.g. for
    CUDA graphs); an out-of-range idx then reads foreign memory.
    """
    _check_inputs(q, k_mem, v_mem, idx, w, check_idx)
    q, k_mem, v_mem = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_mem, v_mem))
    idx = idx.to(torch.int64).contiguous()
    o, _ = _gca_fwd(q, k_mem, v_mem, idx, w.contiguous())
    return o
