"""
DRT: the Differentiable Retrieval-based Transformer with Grouped Cross-Attention (GCA), in one
file of PyTorch. Hu, Teng, Zhao, Wu, Tu: "Efficient Length-Generalizable Attention via Causal
Retrieval for Long-Context Language Modeling", ICML 2025 (arXiv 2410.01651).

The token stream is cut into chunks of S positions: S-1 text tokens and a landmark token. Lower
layers are a sliding-window transformer. A small bidirectional encoder turns each finished chunk
into memory: per-token keys/values and a landmark vector l. In the upper layers the landmark of
chunk t scores every earlier chunk (Eq. 1), keeps the top-k, and every token of chunk t+1 attends
to each pick separately; the k outputs are mixed with weights from the scores (GCA, Eq. 2 and 3),
which carry the next-token loss back to the retriever ("causal retrieval"). Attention per token is
constant (window + k*S), so the model runs at any length.

Sections in the order of §3: config -> ALiBi and window attention -> chunks and their encoder ->
retrieval -> GCA -> blocks -> the model (DRT.run: training and streaming) -> streams -> code_read's departures.
Fused forms of the same functions: fused.py (the window through FlexAttention, the loss without the
logits) and gca_kernel.py (GCA in Triton), each behind the plain form written here.

    from model import DRTConfig, DRT
    model = DRT(DRTConfig())                 # the paper's 146M DRT (groups=() -> baseline)
    _, loss = model(idx, targets)            # a training row (B, T) -> its loss; model(idx): logits (B, T, vocab)
    state = model.new_state()                # inference at any length (sample.generate):
    logits, _ = model(prompt, state=state)   #   prefill (B, 1, vocab_size) ...
    logits, _ = model(next_ids, state=state) #   ... and continue the same stream
    with model.recording() as record: ...    # what retrieval and GCA did (common.retrieval_stats)
"""

import itertools
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fused  # the window through FlexAttention and the loss without logits: the same functions, fused

try:  # FlashGCA, the fused Triton kernels of GCA; without Triton the PyTorch reference serves
    import gca_kernel
except ImportError:
    gca_kernel = None


def cdiv(a, b):
    return -(-a // b)


def upcast(x):
    """fp32 for half types, fp64 stays fp64 (tests run the model in double)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# -----------------------------------------------------------------------------
# Config


@dataclass
class DRTConfig:
    # the shape
    vocab_size: int = 50304      # GPT-2's 50257 ids + 1 landmark id, padded to a multiple of 64 (fast matmuls)
    landmark_id: int = None      # the id closing every chunk, never an input, above the text ids; None: 50257 if the vocabulary has room, else vocab_size - 1
    n_embd: int = 768            # model width d
    n_head: int = 12             # attention heads; head width n_embd // n_head
    n_lower: int = 6             # lower decoder layers: sliding-window self-attention + SwiGLU
    groups: tuple = (6,)         # upper layers per retrieval group, each group retrieves once; () = sliding-window baseline
    n_enc: int = 2               # bidirectional chunk-encoder layers that make the memory of a finished chunk
    chunk_size: int = 64         # S, positions per chunk: S-1 text tokens + 1 landmark
    window: int = 512            # W, self-attention window in positions (landmarks count); a multiple of chunk_size
    topk: int = 8                # K, chunks retrieved per chunk; attention field = W + K*S positions
    mlp_hidden: int = 0          # SwiGLU hidden width; 0 -> 8/3 * n_embd rounded up to a multiple of 64
    # the paper's switches (Table 4's ablations)
    softmax_off_by_one: bool = True  # Eq. 3 as exp(r_i) / (1 + sum_j exp(r_j)): a group may ignore useless picks; False = plain softmax (the release)
    gumbel: bool = True          # training only: top-k of Gumbel-perturbed scores, to explore; weights use the clean scores
    retriever: str = "learned"   # "learned": top-k of Eq. 1; "random": uniform earlier chunks, weighted by Eq. 3; "none": weights 0
    # departures from the paper, config/code_teacher.py's read path, with which GCA learned to copy on code: four changes
    # under one switch, as every run had all or none. GCA's memory has no zero sink and is centred on each chunk's mean
    # (what tells tokens apart), a pick j is read as chunk j+1 (the text that followed a chunk like the query), and
    # Eq. 1 compares chunks' mean token embeddings (the query's centred over the chunks so far), not landmark states
    code_read: bool = False      # True: all four (config/code_teacher.py); False: the paper's read path

    def __post_init__(self):
        groups, self.groups = self.groups, tuple(int(g) for g in self.groups)  # checkpoints store JSON lists
        if self.landmark_id is None:
            self.landmark_id = min(50257, self.vocab_size - 1)
        S, W = self.chunk_size, self.window
        checks = [
            (self.n_head >= 1 and self.n_embd >= 1 and self.n_embd % self.n_head == 0,
             f"n_embd={self.n_embd} must be a positive multiple of n_head={self.n_head} >= 1"),
            (S >= 2, f"chunk_size={S}: a chunk needs at least one text token and the landmark"),
            (S < 2 or (W >= S and W % S == 0), f"window={W} must be a positive multiple of chunk_size={S}"),
            (0 <= self.landmark_id < self.vocab_size, f"landmark_id={self.landmark_id} is outside [0, {self.vocab_size})"),
            (all(g == int(g) >= 1 for g in groups), f"groups={tuple(groups)}: every group needs a whole number >= 1 of layers"),
            (self.topk >= 1, f"topk={self.topk} must be >= 1"),
            (self.retriever in ("learned", "random", "none"), f"retriever={self.retriever!r}: 'learned', 'random' or 'none'"),
            (min(self.n_lower, self.n_enc, self.mlp_hidden) >= 0, "n_lower, n_enc and mlp_hidden must be >= 0"),
        ]
        if bad := [message for ok, message in checks if not ok]:
            raise ValueError("bad DRTConfig: " + "; ".join(bad))

    @property
    def n_upper(self):
        return sum(self.groups)


def window_reach(cfg, exact=False):
    """How far back the stacked windows carry a token, in positions (retrieval reaches further); cfg: any with their
    fields. Each of L windows sees W-1 back: L x (W-1), exactly; L x W, a bound, sizes margins, spans and depths."""
    return (cfg.n_lower + sum(cfg.groups)) * (cfg.window - 1 if exact else cfg.window)


def skim_margin(cfg):
    """Positions before an output beyond which no upper-layer state reaches it (DRT.skim): the windows' reach and,
    per group, the two chunks back to the landmark whose picks a chunk reads."""
    return window_reach(cfg) + 2 * cfg.chunk_size * len(cfg.groups)


# -----------------------------------------------------------------------------
# Positions: ALiBi, bias = -slope * (i - j), from int64 positions: exact at any absolute position.
# Sliding-window self-attention without a T x T mask: queries in tiles of W, each tile attends to the
# keys of its own and the previous tile (2W keys) under one shared bias. Memory O(T * W).


def alibi_slopes(n_head):
    """Per-head slopes (Press et al., 2022): 2^(-8/n), 2^(-16/n), ...; for n not a power of two, those of the power
    of two below plus every other one of the next (2^(-8(i+1)/n) for every n keeps fewer steep, local heads: at 6
    heads, 7-18% higher perplexity on code, dev/LOG.md)."""
    def geometric(n):
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]
    p = 2 ** int(math.log2(n_head))
    return torch.tensor(geometric(p) + geometric(2 * p)[0::2][: n_head - p])


def alibi_bias(q_pos, k_pos, slopes, window=None):
    """Additive bias (H, Lq, Lk) from int64 positions (Lq,), (Lk,). window=W: causal, key j visible
    to query i iff 0 <= i - j < W; None: bidirectional (inside a chunk), -slope * |i - j|."""
    d = q_pos[:, None] - k_pos[None, :]  # (Lq, Lk) int64: differences first, so exact at any position
    if window is None:
        return -slopes[:, None, None] * d.abs().float()
    visible = (d >= 0) & (d < window)
    return torch.where(visible, -slopes[:, None, None] * d.clamp(0, window).float(), float("-inf"))


def window_attention(q, k, v, pos0, window, slopes, ring=None):
    """q, k, v (B, H, L, D) at positions pos0 .. pos0+L-1, ring: a stream's KVRing of the W positions before, or
    None -> (B, H, L, D). FlexAttention (fused.py) on a GPU without a ring, else tiled SDPA."""
    if ring is None and q.is_cuda and fused.flex_attention is not None:
        return fused.flex_window_attention(q, k, v, window, slopes)
    B, L, W, dev = q.size(0), q.size(2), window, q.device
    # tile 0: the first L0 queries see the ring (the previous W positions) and the segment's start
    L0 = min(L, W)
    q_pos = pos0 + torch.arange(L0, device=dev)
    k0, v0, k_pos = k[:, :, :L0], v[:, :, :L0], q_pos
    if ring is not None and ring.k is not None:
        k0, v0 = torch.cat([ring.k, k0], 2), torch.cat([ring.v, v0], 2)  # (B, H, W + L0, D)
        k_pos = torch.cat([ring.pos, q_pos])
    mask = alibi_bias(q_pos, k_pos, slopes, W).to(q.dtype)  # (H, L0, Lk)
    y = F.scaled_dot_product_attention(q[:, :, :L0], k0, v0, attn_mask=mask)
    if L <= W:
        return y
    # tiles 1..nt: tile t holds queries [tW, tW+W) and keys [tW-W, tW+W), all inside the segment
    nt = cdiv(L - W, W)
    pad = (nt + 1) * W - L  # future positions at the end: causally invisible to every real query
    qt, kt, vt = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))  # (B, H, (nt+1)W, D)
    qt = qt[:, :, W:].unflatten(2, (nt, W))  # (B, H, nt, W, D)
    kt, vt = (t.unfold(2, 2 * W, W).transpose(-1, -2) for t in (kt, vt))  # (B, H, nt, 2W, D)
    qt, kt, vt = (t.transpose(1, 2).flatten(0, 1) for t in (qt, kt, vt))  # (B*nt, H, ., D)
    pos1 = pos0 + W  # the bias is the same for every tile: build it from tile 1's positions
    mask = alibi_bias(pos1 + torch.arange(W, device=dev), pos0 + torch.arange(2 * W, device=dev), slopes, W)
    yt = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask.to(q.dtype))  # (B*nt, H, W, D)
    yt = yt.unflatten(0, (B, nt)).transpose(1, 2).flatten(2, 3)[:, :, : L - W]  # (B, H, L-W, D)
    return torch.cat([y, yt], 2)


# -----------------------------------------------------------------------------
# Chunks (§3.1). Position p lies in chunk p // S at slot p % S; slot S-1 holds the landmark. A segment
# of a stream may begin inside a chunk: `offset` counts the slots earlier segments filled (0 in training).


def to_chunks(x, offset, S):
    """(B, L, ...) -> (B, n_chunks, S, ...): the segment on whole chunks, zeros in the empty slots."""
    n_chunks = cdiv(offset + x.size(1), S)
    back = n_chunks * S - offset - x.size(1)
    if offset or back:
        x = torch.cat([x.new_zeros(x.size(0), offset, *x.shape[2:]), x, x.new_zeros(x.size(0), back, *x.shape[2:])], 1)
    return x.unflatten(1, (n_chunks, S))


def from_chunks(x, offset, L):
    """Inverse of to_chunks: (B, n_chunks, S, ...) -> (B, L, ...)."""
    return x.flatten(1, 2)[:, offset : offset + L]


def insert_landmarks(idx, cfg, n0=0):
    """idx (B, T) text ids continuing a stream of n0 positions -> (ids (B, L), offset n0 % S): the landmark id after
    every S-1 text tokens, eagerly (a chunk's last text token closes it at once)."""
    S, (B, T) = cfg.chunk_size, idx.shape
    offset = n0 % S
    n_chunks = cdiv(offset + T, S - 1)
    grid = torch.full((B, n_chunks * (S - 1)), cfg.landmark_id, dtype=idx.dtype, device=idx.device)
    grid[:, offset : offset + T] = idx
    grid = torch.cat([grid.view(B, n_chunks, S - 1), grid.new_full((B, n_chunks, 1), cfg.landmark_id)], 2)
    n_full, rem = divmod(offset + T, S - 1)  # finished chunks (landmark included) and leftover tokens
    return grid.view(B, n_chunks * S)[:, offset : n_full * S + rem], offset


class ChunkEncoder(nn.Module):
    """Bidirectional encoder of finished chunks (§3.1) -> per-token keys/values (one projection for all upper layers)
    and the landmark vector l, Eq. 1's key."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_in, self.ln_f = RMSNorm(cfg.n_embd), RMSNorm(cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, causal=False) for _ in range(cfg.n_enc))
        self.kv_mem = nn.Linear(cfg.n_embd, 2 * cfg.n_embd, bias=False)  # W_k and W_v in one matmul
        self.n_head, self.code_read = cfg.n_head, cfg.code_read

    def forward(self, x):  # x (B, n, S, C) last-lower-layer states -> kv (B, n, S, 2, H, D), l (B, n, C)
        B, n, S, C = x.shape
        h = self.ln_in(x.reshape(B * n, S, C))
        for block in self.blocks:
            h = block(h)
        h = h.view(B, n, S, C)
        l = self.ln_f(h[:, :, -1])  # (B, n, C) the landmark's state
        h = centred(h) if self.code_read else h  # departure (the block at the end)
        kv = self.kv_mem(self.ln_f(h)).unflatten(-1, (2, self.n_head, C // self.n_head))  # (B, n, S, 2, H, D)
        if not self.code_read:  # the landmark slot's key/value zero: a logit-0 sink for queries that match nothing
            kv = kv.masked_fill(torch.arange(S, device=kv.device).view(-1, 1, 1, 1) == S - 1, 0)  # (S, 1, 1, 1)
        return kv, l


# -----------------------------------------------------------------------------
# Retrieval (§3.1-3.2). Per group g, the state h_t at chunk t's landmark, as it enters the group, scores every
# strictly earlier chunk j: r_j = RMSNorm_g(h_t) . l_j / sqrt(d) (Eq. 1); top-k (Gumbel-noised in training), Eq. 3.


@torch.no_grad()
def topk_earlier(q, pages, chunk_ids, k, noise=False, uniform=False):
    """Eq. 1: for the query q (B, n, C) of each chunk t in chunk_ids (n,), the k best-scoring chunks j < t, a running
    top-k over pages of landmarks l_j ((B, m, C) each), never n x M scores -> (idx, eligible) (B, n, k).
    noise: + Gumbel(0, 1); uniform: random scores."""
    B, n, C = q.shape
    q = upcast(q)
    best_s = q.new_full((B, n, k), float("-inf"))
    best_i = torch.zeros(B, n, k, dtype=torch.long, device=q.device)
    m0 = 0
    for lm in pages:  # (B, m, C)
        # fp32 under any autocast: in bf16, rounding decides near-ties, and a stream would pick other chunks than a row
        with torch.autocast(q.device.type, enabled=False):
            s = q @ upcast(lm).transpose(1, 2) / math.sqrt(C)  # (B, n, m)
        if uniform:
            s = torch.rand_like(s)
        elif noise:
            s = s - torch.empty_like(s).exponential_().log()  # -log(Exp(1)) ~ Gumbel(0, 1)
        j = m0 + torch.arange(lm.size(1), device=q.device)
        s = s.masked_fill(j[None, None, :] >= chunk_ids[None, :, None], float("-inf"))  # strictly earlier
        s, i = torch.cat([best_s, s], -1), torch.cat([best_i, j.expand(B, n, -1)], -1)
        pos = rank_key(s, i).topk(k, -1).indices
        best_s, best_i = s.gather(-1, pos), i.gather(-1, pos)
        m0 += lm.size(1)
    eligible = best_s > float("-inf")  # k > number of earlier chunks leaves empty picks
    return best_i.masked_fill(~eligible, 0), eligible


def rank_key(s, j):
    """int64 keys that order chunks by score s, then, at an exact tie (chunks repeated word for word), the earlier
    chunk j first, not by where topk finds it in a page, which differs between one forward and a stream: s's float32
    bits as an int that orders like s (negatives' magnitude bits flipped; + 0.0 makes -0.0 +0.0), above ~j."""
    b = (s.float() + 0.0).view(torch.int32).long()
    b = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    return (b << 32) | (0xFFFFFFFF - j)


def softmax_off_by_one(r, off_by_one=True):
    """Eq. 3: w_i = exp(r_i) / (1 + sum_j exp(r_j)) over the last dim, -inf entries 0; the 1, a virtual chunk of score
    0 and empty output, lets a group ignore poor picks. False: plain softmax."""
    m = r.amax(-1, keepdim=True)
    m = m.clamp(min=0) if off_by_one else torch.where(torch.isfinite(m), m, 0)
    e = torch.exp(r - m.detach())  # stable: subtract max(m, 0)
    denom = e.sum(-1, keepdim=True) + (torch.exp(-m.detach()) if off_by_one else 0)
    return e / torch.where(denom > 0, denom, 1)


def retrieval_weights(q, picked, eligible, cfg):
    """Eq. 3 of the picks' clean Eq. 1 scores (no Gumbel noise), the retriever's gradient path: q (B, n, C), picked
    landmarks (B, n, K, C), eligible (B, n, K) -> w (B, n, K); 0 if retriever="none"."""
    r = (upcast(q).unsqueeze(2) * upcast(picked)).sum(-1) / math.sqrt(q.size(-1))  # (B, n, K) Eq. 1, fp32
    w = softmax_off_by_one(r.masked_fill(~eligible, float("-inf")), cfg.softmax_off_by_one)
    return w * (cfg.retriever != "none")


def read_one_chunk_later(carried, made, n_chunks):
    """Causal retrieval (§3.1): chunk c's picks are read by chunk c+1 (chunk c lies in the window). made: (idx, w)
    (B, n, K) at a segment's n landmarks, or None; carried: (B, 1, K) of the landmark before it, None at the start
    (weight 0) -> (idx, w) (B, n_chunks, K)."""
    if made is None:  # no landmark here: the segment lies inside one chunk
        return carried
    if carried is None:
        carried = tuple(torch.zeros_like(t[:, :1]) for t in made)
    return tuple(torch.cat([before, here], 1)[:, :n_chunks] for before, here in zip(carried, made))


class RowMemory:
    """A whole row's chunk memory, in the autograd graph, with a ChunkStore's three reads."""

    def __init__(self, kv, l):
        self.kv, self.l, self.pages = kv, l, [l]  # (B, n, S, 2, H, D), (B, n, C); pages: for topk_earlier

    def landmarks_at(self, idx):  # l_j of the picks idx (B, n, K) -> (B, n, K, C)
        return self.l[torch.arange(idx.size(0), device=idx.device)[:, None, None], idx]

    def gather(self, idx):  # GCA's memory: k_mem, v_mem (B, n, S, H, D) and the picks idx into them
        return *self.kv.unbind(3), idx


# -----------------------------------------------------------------------------
# Grouped cross-attention (Eq. 2). For the S queries of a chunk and its K retrieved chunks:
#     o = sum_i w_i * softmax(q K_i^T / sqrt(D)) V_i
# Each pick gets its own softmax and w_i scales its whole output, so the loss reaches the retriever (one softmax
# over all picks, as in chunked cross-attention, would not).

GCA_IMPL = os.environ.get("DRT_GCA", "auto")  # "auto": Triton FlashGCA on CUDA, PyTorch elsewhere; "triton" / "torch" force one


def gca_attention(q, k_mem, idx):
    """Eq. 2's softmax per pick, one at a time (memory O(output), not O(K * output)), for gca_reference and the
    statistics (common.sink_share): yields (i, pick i's memory rows, softmax(q K_i^T / sqrt(D)) (B, N, H, S, S))."""
    b, q = torch.arange(q.size(0), device=q.device)[:, None], upcast(q)  # b (B, 1): batch index to gather by idx
    for i in range(idx.size(-1)):
        rows = (b, idx[..., i])
        k = upcast(k_mem[rows])  # (B, N, S, H, D)
        yield i, rows, (torch.einsum("bnshd,bnthd->bnhst", q, k) / math.sqrt(q.size(-1))).softmax(-1)


def gca_reference(q, k_mem, v_mem, idx, w):
    """The readable GCA, gca_kernel.flash_gca's signature: q (B, N, S, H, D) of N chunks; k_mem, v_mem
    (B, M, S, H, D); idx (B, N, K) int64 picks in [0, M), their weights w (B, N, K) -> (B, N, S, H, D)."""
    o = torch.zeros_like(upcast(q))
    for i, rows, att in gca_attention(q, k_mem, idx):
        o = o + w[..., i, None, None, None] * torch.einsum("bnhst,bnthd->bnshd", att, upcast(v_mem[rows]))
    return o.to(q.dtype)


def gca(q, k_mem, v_mem, idx, w):
    """GCA through the fused Triton kernel where it applies (CUDA, a tile it is built for), else the
    PyTorch reference: the same function either way."""
    if GCA_IMPL == "triton" and gca_kernel is None:
        raise ImportError("DRT_GCA=triton, but gca_kernel (Triton) cannot be imported")
    if GCA_IMPL == "triton" or (GCA_IMPL != "torch" and gca_kernel is not None and q.is_cuda and k_mem.dtype ==
                                v_mem.dtype == q.dtype and gca_kernel.kernel_fits(q.size(2), q.size(4), q.dtype)):
        return gca_kernel.flash_gca(q, k_mem, v_mem, idx, w, check_idx=False)  # idx comes from topk: always in range
    return gca_reference(q, k_mem, v_mem, idx, w)


# -----------------------------------------------------------------------------
# Blocks


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # in fp32: the residual stream may be bf16 under autocast
        return (F.rms_norm(upcast(x), (x.size(-1),), eps=1e-6) * self.weight).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        width = cfg.mlp_hidden or 64 * math.ceil(8 * cfg.n_embd / 3 / 64)  # 8/3 d: a 4d MLP's parameters
        self.c_fc = nn.Linear(cfg.n_embd, 2 * width, bias=False)  # gate and up, one matmul
        self.c_proj = nn.Linear(width, cfg.n_embd, bias=False)

    def forward(self, x):
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.c_proj(F.silu(gate) * up)


class SelfAttention(nn.Module):
    """Causal sliding-window attention (decoder) or attention inside each chunk (encoder), ALiBi."""

    def __init__(self, cfg, causal):
        super().__init__()
        self.causal, self.n_head, self.window = causal, cfg.n_head, cfg.window
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.register_buffer("slopes", alibi_slopes(cfg.n_head), persistent=False)

    def forward(self, x, pos0=0, ring=None):  # x (B, L, C); for the encoder B = batch * chunks, L = S
        B, L, C = x.shape
        q, k, v = self.c_attn(x).view(B, L, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # each (B, H, L, D)
        if self.causal:
            y = window_attention(q, k, v, pos0, self.window, self.slopes, ring)
            if ring is not None:
                ring.write(k, v, pos0 + torch.arange(L, device=x.device))
        else:
            pos = torch.arange(L, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(pos, pos, self.slopes).to(q.dtype))
        return self.c_proj(y.transpose(1, 2).reshape(B, L, C))


class Block(nn.Module):
    """Pre-norm transformer block: lower decoder layers and chunk-encoder layers."""

    def __init__(self, cfg, causal=True):
        super().__init__()
        self.ln_1, self.ln_2 = RMSNorm(cfg.n_embd), RMSNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg, causal)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, pos0=0, ring=None):
        x = x + self.attn(self.ln_1(x), pos0, ring)
        return x + self.mlp(self.ln_2(x))


class UpperBlock(Block):
    """Upper decoder layer (§3.1): sliding-window self-attention, then GCA over the retrieved chunks
    into the MLP's input, not the residual stream (as in the authors' release):
    h1 = x + SelfAttn(norm(x));  o = GCA(q_proj(norm(h1)));  out = h1 + MLP(norm(h1 + o))"""

    def __init__(self, cfg):
        super().__init__(cfg, causal=True)
        self.ln_q = RMSNorm(cfg.n_embd)
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.S, self.n_head = cfg.chunk_size, cfg.n_head
        self.record = None  # a list while DRT.recording() runs

    def forward(self, x, mem, pos0=0, ring=None, offset=0):  # x (B, L, C); mem: (k_mem, v_mem, idx, w) or None
        h1 = x + self.attn(self.ln_1(x), pos0, ring)
        if mem is None:  # nothing retrievable yet (the first two chunks of a stream)
            return h1 + self.mlp(self.ln_2(h1))
        B, L, C = x.shape
        q = to_chunks(self.q_proj(self.ln_q(h1)), offset, self.S).unflatten(-1, (self.n_head, C // self.n_head))  # (B, n_chunks, S, H, D)
        o = gca(q, *mem)  # (B, n_chunks, S, H, D)
        if self.record is not None:  # what GCA read with, for the statistics (common.retrieval_stats)
            self.record.append(("gca", q.detach(), *(t.detach() for t in mem)))
        o = from_chunks(o.flatten(-2), offset, L)  # (B, L, C)
        return h1 + self.mlp(self.ln_2(h1 + self.o_proj(o)))


# -----------------------------------------------------------------------------
# The model


class DRT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.lower = nn.ModuleList(Block(cfg) for _ in range(cfg.n_lower))
        self.encoder = ChunkEncoder(cfg) if cfg.groups else None
        self.ret_norm = nn.ModuleList(RMSNorm(cfg.n_embd) for _ in cfg.groups)  # RMSNorm_g of Eq. 1
        self.upper = nn.ModuleList(UpperBlock(cfg) for _ in range(cfg.n_upper))
        self.ln_f = RMSNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the 146M of the paper counts them once
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
        for name, p in self.named_parameters():  # GPT-2: scale residual-branch outputs by depth
            if name.endswith(("c_proj.weight", "o_proj.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * (cfg.n_lower + cfg.n_upper)))
        self.record = None  # a list while recording() runs

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # tied embedding counted once

    def new_state(self, offload=False, start_pos=0):
        """A fresh stream (batch size: its first forward's); offload=True keeps chunk keys/values on the host."""
        return StreamState(self.config, self.wte.weight.device, offload, start_pos)

    def check_input(self, idx, targets):
        cfg = self.config
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32) or idx.size(1) == 0:  # T=0: nothing to read
            raise ValueError(f"idx must be a (B, T) integer tensor of token ids, T >= 1 (not T=0), got {tuple(idx.shape)} {idx.dtype}")
        if targets is not None and (targets.dim() != 2 or targets.size(0) != idx.size(0) or not 1 <= targets.size(1) <= idx.size(1)):
            raise ValueError(f"targets {tuple(targets.shape)} must be (B, T') for idx's last T' positions, idx {tuple(idx.shape)}")
        if not torch.compiler.is_compiling():
            bad = (idx < 0) | (idx >= cfg.vocab_size) | (idx == cfg.landmark_id)
            if bad.any():
                v = idx[bad][0].item()
                why = "the landmark id, reserved" if v == cfg.landmark_id else f"outside [0, {cfg.vocab_size})"
                raise ValueError(f"token id {v} in idx is {why}: inputs are text token ids")
            if targets is not None and ((targets < -1) | (targets >= cfg.vocab_size)).any():  # -100 would read as 0
                raise ValueError(f"targets must be token ids in [0, {cfg.vocab_size}) or -1 (ignored)")

    def forward(self, idx, targets=None, state=None, picks=None):
        """idx (B, T) text ids -> (logits, loss). targets (B, T'): the next ids at idx's last T' positions, -1: not
        scored. state: a StreamState to continue, else a whole row. picks (n, K) or (B, n, K): chunks the row's n
        landmarks pick instead of Eq. 1's (-1: Eq. 1's), from a teacher or an oracle; (B, G, n, K): per group.
            a whole row          logits (B, T, vocab), loss None     with targets: logits None, the mean cross-entropy
            a stream's segment   logits (B, 1, vocab), loss None     with targets: logits (B, T', vocab), the loss"""
        self.check_input(idx, targets)
        if picks is not None and state is not None:
            raise ValueError("picks are handed in for a whole row (state=None), not for a stream")
        x, offset = self.run(idx, state, picks)
        return self.logits_and_loss(x, offset, idx.size(1), targets, stream=state is not None)

    @contextmanager
    def recording(self):
        """Collect what retrieval and GCA do in the block into the list it yields (the model never reads it): per group
        ("eq1", q, l), Eq. 1's queries and a whole row's landmarks (B, n, C), in the graph (teacher.needle_loss), and
        ("picks", chunk ids (n,), idx, w (B, n, K)); per upper layer ("gca", q, k_mem, v_mem, idx, w)."""
        record, parts = [], [self, *self.upper]
        for part in parts:
            part.record = record
        try:
            yield record
        finally:
            for part in parts:
                part.record = None

    @torch.no_grad()
    def skim(self, idx, state):
        """Stream idx (B, T) into state as memory only: the lower layers and the chunk store. Upper-layer
        states reach an output from at most skim_margin positions back, so outputs that far past idx's end
        are forward's (tested): a long prompt read only at its end need not run the upper layers over it."""
        self.check_input(idx, None)
        self.run(idx, state, memory_only=True)

    def run(self, idx, state=None, picks=None, memory_only=False):
        """The pipeline of §3 over idx (B, T): one training row (state None), or the next segment of a stream,
        continuing and updating state -> the last layer's states (B, L, C) and the offset of the segment in
        its first chunk. memory_only (skim): the lower layers and the chunk memory alone -> (None, offset)."""
        cfg, S, G = self.config, self.config.chunk_size, len(self.config.groups)
        n0, pos0 = (state.n, state.n + state.start_pos) if state else (0, 0)  # positions before idx; the first's
        ids, offset = insert_landmarks(idx, cfg, n0)  # (B, L): a landmark closes every S-1 text tokens
        x = e = self.wte(ids)  # (B, L, C)
        rings = iter(state.rings if state else [None] * (cfg.n_lower + cfg.n_upper))  # lower layers', then upper
        for block in self.lower:
            x = block(x, pos0, next(rings))
        L = x.size(1)
        n, n_chunks = (offset + L) // S, cdiv(offset + L, S)  # chunks finished here (landmark in), chunks touched
        memory, pooled = self.remember(x, e, n, state) if G else (None, None)
        if memory_only:  # the next full segment's first chunk reads no picks: inside the margin
            state.picks, state.prefetched, state.n = [None] * G, [None] * G, n0 + L
            return None, offset
        c0, upper = n0 // S, iter(self.upper)  # the segment touches chunks c0 .. c0 + n_chunks - 1
        chunk_ids = c0 + torch.arange(n, device=x.device)  # (n,) the chunk of each landmark here
        for g, size in enumerate(cfg.groups):
            made, carried, mem = None, state.picks[g] if state else None, None  # carried: picks made before idx
            if n:  # the group's input at the landmarks (Eq. 1's query), or under code_read the centred means
                h = pooled if cfg.code_read else x[:, S - 1 - offset : n * S - offset : S]  # (B, n, C)
                handed = picks[:, g] if picks is not None and picks.dim() == 4 else picks  # per group, or for all
                made = self.retrieve(g, h, chunk_ids, memory, handed)  # (idx, w) (B, n, K)
            if c0 + n_chunks > 2 and (made is not None or carried is not None):  # chunks 0, 1 have nothing to read
                sel, w = read_one_chunk_later(carried, made, n_chunks)  # (B, n_chunks, K)
                decoding = n_chunks == 1 and carried is not None  # a stream's picks were gathered last call
                mem = (*(state.prefetched[g] if decoding else memory.gather(sel)), w)
            for block in itertools.islice(upper, size):
                x = block(x, mem, pos0, next(rings), offset)  # self-attention, then GCA (Eq. 2)
            if state and made is not None:  # the last landmark's picks serve the next chunk
                state.picks[g] = (made[0][:, -1:], made[1][:, -1:].detach())
                state.prefetched[g] = memory.gather(state.picks[g][0])  # from the host: overlaps the rest
        if state:
            state.n = n0 + L
        return x, offset

    def remember(self, x, e, n, state):
        """The memory (§3.1): the encoder over the n chunks whose landmark is in x (B, L, C) (a stream's first
        slots may come from earlier segments; e: the embeddings) -> the memory retrieval reads (RowMemory in
        training, else the state's ChunkStore) and code_read's queries (B, n, C) (else None)."""
        cfg, S, pooled = self.config, self.config.chunk_size, None
        if state:  # the unfinished chunk's slots wait in the state: copies, not views of x
            x = x if state.chunk_buf is None else torch.cat([state.chunk_buf, x], 1)  # (B, offset + L, C)
            e = e if state.emb_buf is None else torch.cat([state.emb_buf, e], 1)
            state.chunk_buf = x[:, n * S :].detach().clone()
            state.emb_buf = e[:, n * S :].detach().clone() if cfg.code_read else None
        if not n:
            return (state.store if state else None), None
        kv, l = self.encoder(x[:, : n * S].unflatten(1, (n, S)))  # (B, n, S, 2, H, D), (B, n, C)
        if cfg.code_read:  # departure (the block at the end): Eq. 1 between mean token embeddings, on both sides
            l, pooled = pooled_eq1(e[:, : n * S].unflatten(1, (n, S)), self.encoder.ln_f, state)
        if not state:
            return RowMemory(kv, l), pooled
        state.store.kv.append(kv.detach())  # the store holds no autograd graph
        state.store.lm.append(l.detach())
        return state.store, pooled

    def retrieve(self, g, h, chunk_ids, memory, picks=None):
        """Eq. 1 and 3 for group g at the states h (B, n, C) of the landmarks of chunks chunk_ids (n,), over
        memory (RowMemory or ChunkStore); picks: see forward -> idx, w (B, n, K)."""
        cfg = self.config
        q = self.ret_norm[g](h)  # (B, n, C)
        idx, eligible = topk_earlier(q, memory.pages, chunk_ids, cfg.topk, self.training and cfg.gumbel,
                                     cfg.retriever == "random")  # (B, n, K): top-k of Eq. 1 (+ Gumbel)
        if picks is not None:  # handed in: each < its chunk id, or -1
            idx, eligible = torch.where(picks >= 0, picks, idx), eligible | (picks >= 0)
            twice = (idx[..., :, None] == idx[..., None, :]) & eligible[..., :, None]  # (B, n, K, K)
            eligible = eligible & ~twice.triu(1).any(-2)  # a chunk both Eq. 1 and picks hold is read once
        w = retrieval_weights(q, memory.landmarks_at(idx), eligible, cfg)  # (B, n, K): Eq. 3
        if self.record is not None:  # see recording
            if isinstance(memory, RowMemory):
                self.record.append(("eq1", q, memory.l))
            self.record.append(("picks", chunk_ids, idx, w.detach()))
        idx = read_next(idx, chunk_ids) if cfg.code_read else idx  # departure (the block at the end): j read as j+1
        return idx, w

    def logits_and_loss(self, x, offset, T, targets, stream):
        """The last layer's states x (B, L, C) -> forward's (logits, loss) at the T text positions. Logits are made where
        they are read, which the call tells: a whole row with targets trains or validates, its loss from the targets'
        positions alone without the (B, T, vocab) logits (3.3 GB a 16K-token row in bf16); a stream's segment is a
        prefill (64K positions) or a decoded token, whose next token is all sampling reads, unless it is scored."""
        S = self.config.chunk_size
        x = from_chunks(to_chunks(self.ln_f(x), offset, S)[:, :, : S - 1], offset, T)  # (B, T, C): landmarks predict nothing
        if targets is None:
            return self.lm_head(x[:, -1:] if stream else x), None
        x = x[:, T - targets.size(1) :]  # (B, T', C)
        if not stream:
            return None, fused.LinearCrossEntropy.apply(x.flatten(0, 1), self.lm_head.weight, targets.flatten(), torch.is_grad_enabled())
        logits = self.lm_head(x)
        return logits, F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten(), ignore_index=-1)

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; weight decay on matrices only (not on norm gains)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


# -----------------------------------------------------------------------------
# Streaming (§3.2): a stream run segment by segment (prefills, then token by token) computes what one forward would.
# Each self-attention layer keeps its last W keys/values (a ring); encoded chunks go into a store (its keys/values on
# the host with offload=True); picks carry over.


class KVRing:
    """The last W keys/values of one self-attention layer; slot = position % W."""

    EMPTY = -(2**62)  # position of a slot never written: farther than any window, so never visible

    def __init__(self, window):
        self.window = window
        self.k = self.v = self.pos = None  # (B, H, W, D), (B, H, W, D), (W,) int64

    def write(self, k, v, pos):  # k, v (B, H, L, D) at positions pos (L,)
        W = self.window
        if self.k is None:
            self.k = k.new_zeros(*k.shape[:2], W, k.size(3))
            self.v = torch.zeros_like(self.k)
            self.pos = torch.full((W,), self.EMPTY, dtype=torch.long, device=k.device)
        n = min(W, k.size(2))
        slots = pos[-n:] % W
        self.k[:, :, slots], self.v[:, :, slots], self.pos[slots] = k[:, :, -n:].detach(), v[:, :, -n:].detach(), pos[-n:]


class PagedTensor:
    """A (B, n, ...) tensor growing along dim 1 without copying what it holds: pages that double from `first` rows
    up to `cap`, on `device` (pinned host memory for 'cpu' when CUDA is there)."""

    def __init__(self, first, cap, device):
        self.first, self.cap, self.device = first, cap, torch.device(device)
        self.pin = self.device.type == "cpu" and torch.cuda.is_available()
        self.pages, self.starts, self.n = [], [], 0  # starts[i]: the first row of pages[i]

    def append(self, x):  # x (B, m, ...); device -> pinned host copies run asynchronously
        j = 0
        while j < x.size(1):
            if not self.pages or self.n == self.starts[-1] + self.pages[-1].size(1):  # the last page is full
                size = min(self.first * 2 ** len(self.pages), self.cap)
                self.pages.append(torch.empty(x.size(0), size, *x.shape[2:], dtype=x.dtype, device=self.device,
                                              pin_memory=self.pin))
                self.starts.append(self.n)
            off = self.n - self.starts[-1]
            m = min(x.size(1) - j, self.pages[-1].size(1) - off)
            self.pages[-1][:, off : off + m].copy_(x[:, j : j + m], non_blocking=True)
            j, self.n = j + m, self.n + m

    def views(self):  # the stored rows, page by page: [(B, rows, ...)]
        return [page[:, : self.n - start] for page, start in zip(self.pages, self.starts)]

    def take(self, rows):  # rows (U,) int64 on the pages' device -> (B, U, ...), one copy per page touched
        at_page = torch.searchsorted(torch.tensor(self.starts, device=rows.device), rows, right=True) - 1  # (U,)
        first = self.pages[0]
        out = first.new_empty(first.size(0), len(rows), *first.shape[2:], pin_memory=self.pin)
        for i in at_page.unique().tolist():
            at = (at_page == i).nonzero().squeeze(1)
            out[:, at] = self.pages[i].index_select(1, rows[at] - self.starts[i])
        return out


class ChunkStore:
    """A stream's encoded chunks, paged: keys/values kv (B, M, S, 2, H, D), landmarks (B, M, C). offload=True keeps
    the keys/values in host memory and moves only the picked chunks to the device: GPU memory grows by the landmarks."""

    LM_PAGES, KV_PAGES = (256, 65536), (64, 16384)  # rows of the first page and of the largest: landmarks, keys/values

    def __init__(self, device, offload=False):
        self.kv = PagedTensor(*self.KV_PAGES, "cpu" if offload else device)
        self.lm = PagedTensor(*self.LM_PAGES, device)

    @property
    def pages(self):  # the landmarks for topk_earlier, page by page
        return self.lm.views()

    def landmarks_at(self, idx):  # l_j of the picks idx (B, n, K) -> (B, n, K, C)
        uniq, inv = torch.unique(idx, return_inverse=True)
        return self.lm.take(uniq)[torch.arange(idx.size(0), device=idx.device)[:, None, None], inv]

    def gather(self, idx):  # GCA's memory, on idx's device: k_mem, v_mem (B, U, S, H, D) of the U distinct picks, idx into them
        """From the host, copied in without blocking."""
        uniq, inv = torch.unique(idx.to(self.kv.device), return_inverse=True)  # (U,); .cpu() waits for append's copies
        kv = self.kv.take(uniq).to(idx.device, non_blocking=True)  # (B, U, S, 2, H, D)
        return *kv.unbind(3), inv.to(idx.device)

    def nbytes(self):  # of the chunk keys/values held (host or device), not the last page's spare rows
        kv = self.kv
        return kv.n * kv.pages[0][:, :1].numel() * kv.pages[0].element_size() if kv.pages else 0


class StreamState:
    """A stream in progress: made by DRT.new_state, passed to each of its forwards (prompts in one batch share their
    length). Detached tensors only, so memory stays O(W + chunks)."""

    def __init__(self, cfg, device, offload=False, start_pos=0):
        self.n = 0  # positions processed so far, landmarks included; chunk c holds n in [cS, cS+S)
        self.start_pos = start_pos  # absolute position of the first slot: ALiBi uses only differences
        self.rings = [KVRing(cfg.window) for _ in range(cfg.n_lower + cfg.n_upper)]
        self.chunk_buf = None  # (B, n % S, C) last-lower-layer states of the unfinished chunk
        self.emb_buf = None  # (B, n % S, C) code_read: its embeddings
        self.store = ChunkStore(device, offload)
        self.picks = [None] * len(cfg.groups)  # per group: (idx, w) (B, 1, K) serving the current chunk
        self.prefetched = [None] * len(cfg.groups)  # per group: picks[g]'s keys/values, gathered to the device
        self.pool_total, self.pool_count = None, 0  # code_read: (B, C) sum of the finished chunks' means, their number


# -----------------------------------------------------------------------------
# Departures: code_read's read path (DRTConfig), called where it differs from the paper's; no sink: ChunkEncoder's.


def centred(h):
    """GCA's memory h (B, n, S, C) less what a chunk's text states share, which RMSNorm would keep, shrinking the rest."""
    return h - h[:, :, :-1].mean(2, keepdim=True)


def pooled_eq1(e, ln_f, state=None):
    """code_read's Eq. 1: e (B, n, S, C), the next n finished chunks' embeddings -> keys ln_f(mean text embedding) and
    queries: the mean less the mean of the chunks so far (else what all share ranks the same chunks for all), (B, n, C)
    each; a stream's running sum waits in state."""
    m = e[:, :, :-1].mean(2)  # (B, n, C)
    total, count = (state.pool_total, state.pool_count) if state else (None, 0)
    run = upcast(m).cumsum(1) + (0 if total is None else total[:, None])  # (B, n, C) sums over chunks 0..t
    if state:
        state.pool_total, state.pool_count = run[:, -1].detach(), count + m.size(1)
    cnt = count + torch.arange(1, m.size(1) + 1, device=m.device, dtype=run.dtype)  # (n,)
    return ln_f(m), upcast(m) - run / cnt[:, None]


def read_next(idx, chunk_ids):
    """Picks j (B, n, K) of chunks chunk_ids' (n,) landmarks -> j+1, finished, and earlier than the chunk t+1 reading it."""
    return (idx + 1).minimum(chunk_ids[None, :, None])


def read_shift(cfg):
    """GCA reads chunk j + read_shift(cfg) for a pick j: the pick itself (the paper), or under code_read the next."""
    return int(cfg.code_read)
