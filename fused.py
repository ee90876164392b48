"""
Two of model.py's computations in fused form, each the same function as its plain form with less time or memory,
and tested against it (test_gca.py):

  flex_window_attention   the sliding window of a whole sequence through FlexAttention, on a GPU: a BlockMask
                          built from the band's structure, so only the tiles the window touches are computed, and
                          ALiBi as a score_mod (plain form: model.window_attention's tiled SDPA, which streams use)
  LinearCrossEntropy      the output layer's mean cross-entropy without the (N, vocab) logits, CE_ROWS rows at a
                          time (plain form: F.cross_entropy of lm_head(x)); training and validation rows use it

Imports nothing of ours; model.py imports it. Not run on its own.
"""

import functools

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5: model.py's tiled SDPA everywhere
    flex_attention = None

# -----------------------------------------------------------------------------
# The sliding window through FlexAttention (a whole sequence, no ring)

FLEX_TILE = 128  # the BlockMask's tile (FlexAttention's BLOCK_SIZE)
FLEX_OPTIONS = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64,
                "num_warps": 4, "num_stages": 3}  # CUDA kernel tiles for bf16/fp16, tuned at the training shape


def window_block_mask(L, W, device, tile=FLEX_TILE):
    """The causal window 0 <= i - j < W over L positions as a BlockMask, never an L x L mask: query tile i meets
    key tiles i - t, t = 0 .. n; t = 1 .. f lie wholly inside the window ('full')."""
    f = max(0, (W - tile) // tile)  # t * tile + tile - 1 < W: every pair inside the window
    n = (W + tile - 2) // tile  # t * tile - tile + 1 <= W - 1: some pair inside
    nq = -(-L // tile)  # query tiles, the last one partial
    i = torch.arange(nq, device=device, dtype=torch.int32)[:, None]  # (nq, 1) query tiles

    def key_tiles(t):  # key tiles i - t, the valid ones (>= 0) first: t ascends, so they are
        j = i - torch.tensor(t, device=device, dtype=torch.int32)  # (nq, len(t))
        j = F.pad(j, (0, nq - len(t)), value=-1) if len(t) < nq else j[:, :nq]  # BlockMask wants (nq, nq)
        return (j >= 0).sum(1, dtype=torch.int32)[None, None], j.clamp(min=0)[None, None]

    def visible(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < W)

    partial = key_tiles([0] + list(range(f + 1, n + 1)))
    full = key_tiles(list(range(1, f + 1))) if f else (None, None)
    return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=tile, mask_mod=visible, seq_lengths=(L, L))


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)  # uncompiled, FlexAttention is a dense reference


def flex_window_attention(q, k, v, window, slopes, tile=FLEX_TILE):
    """window_attention of a whole sequence, q, k, v (B, H, L, D): compiled on a GPU (under the model's
    torch.compile, that compile covers it), the unfused reference on a CPU."""
    def alibi(score, b, h, q_idx, kv_idx):  # q_idx, kv_idx: positions in the sequence, exact
        return score - slopes[h] * (q_idx - kv_idx)
    attend = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
    options = FLEX_OPTIONS if q.is_cuda and q.element_size() == 2 else None
    return attend(q, k, v, score_mod=alibi, block_mask=window_block_mask(q.size(2), window, q.device, tile),
                  kernel_options=options)


# -----------------------------------------------------------------------------
# The loss without the logits

CE_ROWS = 4096  # rows of logits LinearCrossEntropy holds at a time


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of softmax(x @ weight^T) against targets (-1: ignored), CE_ROWS rows at a time,
    never the (N, V) logits: x (N, C), weight (V, C), targets (N,) -> a scalar. The forward makes the
    gradients a backward will use (none under no_grad); the backward scales them."""

    @staticmethod
    def forward(ctx, x, weight, targets, grad_enabled):  # grad_enabled: torch.is_grad_enabled() outside (inside: off)
        want_dx, want_dw = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        acc = torch.promote_types(weight.dtype, torch.float32)  # sums in fp32 (fp64 in the tests)
        n = (targets != -1).sum().clamp(min=1)  # a tensor: no host sync
        loss = x.new_zeros((), dtype=acc)
        dx = torch.empty_like(x) if want_dx else None
        dw = torch.zeros_like(weight, dtype=acc) if want_dw else None
        for s in range(0, x.size(0), CE_ROWS):
            xs, ts = x[s : s + CE_ROWS], targets[s : s + CE_ROWS]
            logits = xs @ weight.t()  # (rows, V), bf16 under autocast
            z = logits.to(acc)
            valid, hit = (ts != -1).to(acc)[:, None], ts.clamp(min=0)[:, None]  # (rows, 1) each
            lse = z.logsumexp(-1, keepdim=True)  # (rows, 1)
            loss += ((lse - z.gather(1, hit)) * valid).sum()
            if not (want_dx or want_dw):
                continue
            if torch.compiler.is_compiling():  # the one-hot as a comparison: one fused pass, cast included
                onehot = torch.arange(z.size(1), device=z.device) == hit  # (rows, V)
                g = ((z - lse).exp() - onehot.to(acc)) * valid
            else:  # eager: in place, one (rows, V) buffer
                g = (z - lse).exp_().scatter_add_(1, hit, -valid).mul_(valid)
            g = g.to(logits.dtype)  # d loss_sum / d logits: softmax - onehot
            if want_dx:
                dx[s : s + CE_ROWS] = g @ weight
            if want_dw:
                dw += g.t() @ xs
        ctx.save_for_backward(dx, dw, n)
        ctx.weight_dtype = weight.dtype
        return loss / n

    @staticmethod
    def backward(ctx, grad):
        dx, dw, n = ctx.saved_tensors
        scale = grad / n
        return (None if dx is None else dx * scale.to(dx.dtype),
                None if dw is None else (dw * scale).to(ctx.weight_dtype), None, None)
