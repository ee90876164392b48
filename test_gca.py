"""
Tests of the model and its kernel (Hu et al., ICML 2025, arXiv 2410.01651), in the order the paper
builds DRT: the landmarks and chunks -> positions (ALiBi) and sliding-window attention (fused.py's
FlexAttention too) -> the chunk encoder -> retrieval (Eq. 1 scores, Gumbel top-k, Eq. 3 weights) -> GCA's
reference (Eq. 2) -> the FlashGCA kernel (gca_kernel.py) against it -> the model end to end (the loss without
logits, fused.py's) -> the streaming state (decoding, prefill, offload). The other test_*.py files hold training, sampling and tasks, evaluation, data
preparation and the benchmarks; conftest.py their shared helpers.

    python -m pytest -q -rs                        # every test file; -rs: why tests skip (CUDA, tokenizer)
    python -m pytest -q test_gca.py -k "cuda or flash_gca"  # on a GPU: the kernel natively (and in bf16), the GPU paths

Every test draws fresh random inputs; models are tiny so the files run in minutes on 2 cores.
Tokenizer tests need GPT-2's BPE: offline, DRT_GPT2_RANKS=/path/to/r50k_base.tiktoken (see
prepare_pg19.py), else tiktoken downloads it; without either they skip.
"""

import dataclasses
import math
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F

import common
import fused
import gca_kernel
import model as drt
from conftest import DEVICE, all_logits, cuda, rel_err, retrievals, spy_retrieval, tiny_config, tiny_model, tokens
from gca_kernel import flash_gca
from model import (
    DRT,
    ChunkStore,
    DRTConfig,
    alibi_slopes,
    gca_reference,
    insert_landmarks,
    retrieval_weights,
    softmax_off_by_one,
    topk_earlier,
    window_attention,
)

# -----------------------------------------------------------------------------
# landmarks (§3.1): text ids in order, a landmark closing every chunk of S-1 of them


def test_insert_landmarks():
    """insert_landmarks (§3.1): the landmark id at every stream position p with p % S == S-1, the text
    ids in order at every other; a chunk whose last text token arrives gets its landmark in the
    same call; a stream given in pieces is laid out as in one call, each piece at offset n0 % S."""
    cfg = tiny_config()
    S = cfg.chunk_size
    idx = tokens(cfg, 2, 3 * (S - 1) + 2, seed=18)
    ids, offset = insert_landmarks(idx, cfg)
    is_landmark = torch.arange(3 * S + 2) % S == S - 1
    assert offset == 0 and ids.shape == (2, 3 * S + 2)
    assert (ids[:, is_landmark] == cfg.landmark_id).all() and torch.equal(ids[:, ~is_landmark], idx)
    n0, parts = 0, []
    for a, b in [(0, 5), (5, 7), (7, 8), (8, 3 * (S - 1) + 2)]:  # (5, 7) ends on a chunk's last text token
        part, offset = insert_landmarks(idx[:, a:b], cfg, n0)
        assert offset == n0 % S
        parts.append(part)
        n0 += part.size(1)
    assert parts[1][0, -1] == cfg.landmark_id and torch.equal(torch.cat(parts, 1), ids)


def test_landmark_id_default():
    """DRTConfig(vocab_size=V) just works: the landmark is the first id after GPT-2's where the
    vocabulary has room (the PG19 layout), else the last id."""
    assert DRTConfig().landmark_id == 50257 and DRTConfig(vocab_size=128).landmark_id == 127
    model = DRT(DRTConfig(vocab_size=128, n_embd=32, n_head=4, n_lower=1, groups=(1,), n_enc=1, chunk_size=8,
                          window=16, topk=2))
    logits, _ = model(torch.randint(0, 127, (1, 30)))
    assert logits.shape == (1, 30, 128)


# -----------------------------------------------------------------------------
# positions (ALiBi) and sliding-window attention: blocked SDPA and FlexAttention against a dense softmax


def band(L, W, slopes):
    """(H, L, L): -slope * (i - j) where 0 <= i - j < W, else -inf; W=None: -slope * |i - j| everywhere."""
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    if W is None:
        return -slopes[:, None, None] * (i - j).abs()
    return torch.where((i - j >= 0) & (i - j < W), -slopes[:, None, None] * (i - j), float("-inf"))


def test_alibi_slopes():
    """Press et al.'s slopes: 2^(-8/n), 2^(-16/n), ... for n a power of two; otherwise those of the power of
    two below, then every other slope of the one above (6 heads: 4's, then 8's first and third)."""
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(4).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    want = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -(i / 2) for i in (1, 3, 5, 7)]  # 12: 8's, then 16's odd ones
    assert alibi_slopes(12).tolist() == pytest.approx(want, rel=1e-6)


def test_encoder_attention_is_bidirectional_alibi():
    """The chunk encoder's attention: every position of a chunk sees every other, biased by -slope * |i - j|."""
    from model import SelfAttention
    torch.manual_seed(0)
    cfg = tiny_config(n_embd=32, n_head=4)
    att = SelfAttention(cfg, causal=False).double()
    x = torch.randn(3, 8, 32, dtype=torch.float64)  # (chunks, S, C)
    q, k, v = att.c_attn(x).view(3, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
    y = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8) + band(8, None, alibi_slopes(4).double()), -1) @ v
    torch.testing.assert_close(att(x), att.c_proj(y.transpose(1, 2).reshape(3, 8, 32)))


@pytest.mark.parametrize("L,W,ring", [(5, 8, False), (8, 8, False), (29, 8, False), (29, 8, True), (3, 8, True)])
def test_window_attention_matches_dense(L, W, ring):
    """Blocked sliding-window attention == a dense softmax with the band and ALiBi built here."""
    from model import KVRing
    torch.manual_seed(L)
    B, H, D, P = 2, 4, 8, 11  # P: positions before the segment, held in the ring
    slopes = alibi_slopes(H).double()
    q, k, v = (torch.randn(B, H, P + L, D, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(P + L)
    dense = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + band(P + L, W, slopes), -1) @ v
    if ring:
        r = KVRing(W)
        r.write(k[:, :, :P], v[:, :, :P], pos[:P])
        got = window_attention(q[:, :, P:], k[:, :, P:], v[:, :, P:], P, W, slopes, r)
        torch.testing.assert_close(got, dense[:, :, P:])
    else:
        got = window_attention(q[:, :, :L], k[:, :, :L], v[:, :, :L], 0, W, slopes)
        dense = torch.softmax(q[:, :, :L] @ k[:, :, :L].transpose(-1, -2) / math.sqrt(D) + band(L, W, slopes), -1) @ v[:, :, :L]
        torch.testing.assert_close(got, dense)


def block_classes(L, W, block):
    """(nq, nq) ideal FlexAttention classes of the window's blocks: 0 none, 1 partial, 2 full."""
    pos = torch.arange(L)
    d = pos[:, None] - pos[None, :]
    vis = ((d >= 0) & (d < W)).float()
    nq = -(-L // block)
    vis = F.pad(vis, (0, nq * block - L, 0, nq * block - L), value=-1)  # -1: outside the sequence
    tiles = vis.view(nq, block, nq, block).transpose(1, 2).flatten(2)  # (nq, nq, block^2)
    some, inside = (tiles == 1).any(-1), tiles >= 0
    every = ((tiles == 1) | ~inside).all(-1)
    return some.long() + (some & every).long()


@pytest.mark.parametrize("L,W,block", [(100, 16, 16), (100, 24, 16), (130, 48, 16), (77, 8, 16), (300, 64, 128),
                                       (200, 256, 128), (513, 128, 128), (700, 512, 128), (1000, 200, 64)])
def test_flex_window_attention(L, W, block):
    """The FlexAttention path of window attention: its block mask is exactly the window's
    (full blocks skip the mask on a GPU, so a wrongly 'full' block would leak), and its output
    equals the blocked-SDPA path and a dense reference (FlexAttention runs unfused on a CPU)."""
    from fused import flex_window_attention, window_block_mask
    bm = window_block_mask(L, W, "cpu", block)
    nq = -(-L // block)
    got = torch.zeros(nq, nq, dtype=torch.long)
    for n, j, cls in [(bm.kv_num_blocks, bm.kv_indices, 1), (bm.full_kv_num_blocks, bm.full_kv_indices, 2)]:
        if n is not None:
            for i in range(nq):
                got[i, j[0, 0, i, : n[0, 0, i]]] = cls
    want = block_classes(L, W, block)
    assert torch.equal(got > 0, want > 0) and not (got == 2)[want != 2].any()  # every block needed, none wrongly full
    assert torch.equal(got[:-1], want[:-1])  # and all full blocks skip the mask (the ragged last row may not)
    torch.manual_seed(L + W)
    B, H, D = 2, 4, 8
    q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
    slopes = alibi_slopes(H)
    dense = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + band(L, W, slopes), -1) @ v
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        flex = flex_window_attention(q, k, v, W, slopes, tile=block)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window_attention(q, k, v, 0, W, slopes), dense, rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_flex_window_attention(dtype):
    """On a GPU, window attention over a whole sequence runs through compiled FlexAttention:
    output and gradients equal a dense fp32 reference (sequences of several 128-blocks, a
    window that is and one that is not a multiple of the block)."""
    from model import window_attention
    for L, W in [(1000, 512), (777, 192)]:
        torch.manual_seed(L)
        q, k, v = (torch.randn(2, 4, L, 64, device="cuda") for _ in range(3))
        do = torch.randn_like(q)
        slopes = alibi_slopes(4).cuda()
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = torch.softmax(ins[0] @ ins[1].transpose(-1, -2) / 8 + band(L, W, slopes.cpu()).cuda(), -1) @ ins[2]
        ref_grads = torch.autograd.grad(ref, ins, do)
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = window_attention(*ins, 0, W, slopes)
        grads = torch.autograd.grad(out, ins, do.to(dtype))
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert rel_err(out.float(), ref) < tol
        assert all(rel_err(g.float(), r) < tol for g, r in zip(grads, ref_grads))


def test_sliding_window_is_a_window():
    """Baseline (groups=()): the logits at position p see at most n_layers * W positions back."""
    model = tiny_model(groups=(), n_lower=2).eval()
    idx = tokens(model.config, 1, 200, seed=8)
    reach = 2 * model.config.window  # in positions; text tokens are fewer
    with torch.no_grad():
        ref = all_logits(model, idx)
        changed = idx.clone()
        changed[:, :50] = tokens(model.config, 1, 50, seed=9)
        out = all_logits(model, changed)
    assert torch.equal(out[:, 50 + reach :], ref[:, 50 + reach :])
    assert not torch.equal(out[:, 50 : 50 + reach // 2], ref[:, 50 : 50 + reach // 2])


def test_length_agnostic():
    """A model trained on short sequences runs at 8x and 64x that length (no position table,
    attention per token is constant), and its logits do not change when the absolute
    positions shift by 2^24 (ALiBi from int64 position differences)."""
    model = tiny_model().eval()
    train_T = 4 * 7
    with torch.no_grad():
        for mult in (8, 64):
            idx = tokens(model.config, 1, mult * train_T, seed=mult)
            logits = all_logits(model, idx)
            assert logits.shape[1] == mult * train_T and torch.isfinite(logits).all()
        idx = tokens(model.config, 2, 8 * train_T, seed=7)
        ref = all_logits(model, idx)
        for shift in (2**24, 2**24 + 3, 2**40):
            out = all_logits(model, idx, state=model.new_state(start_pos=shift))
            assert rel_err(out, ref) <= 1e-5, f"shift {shift}"


# -----------------------------------------------------------------------------
# chunk encoder (§3.1): each chunk's memory keys/values and landmark; the landmark slot a zero sink


def test_encoder_landmark_is_a_zero_sink():
    """The chunk encoder zeroes the landmark slot's memory key and value (§3.1): in every picked
    chunk that slot is a key with logit 0 and value 0, so GCA over one chunk is a softmax-off-
    by-one over its S-1 text tokens (Eq. 3 inside the chunk): a query matching none of them
    takes little from the chunk, instead of being forced to average its values."""
    model = tiny_model()
    cfg, S, H = model.config, model.config.chunk_size, model.config.n_head
    D = cfg.n_embd // H
    torch.manual_seed(19)
    kv, l = model.encoder(torch.randn(2, 3, S, cfg.n_embd, dtype=torch.float64))
    assert kv.shape == (2, 3, S, 2, H, D) and l.shape == (2, 3, cfg.n_embd)
    assert (kv[:, :, S - 1] == 0).all() and (kv[:, :, : S - 1] != 0).all()
    k_mem, v_mem = kv.unbind(3)  # (B, M, S, H, D)
    q = 3 * torch.randn(2, 1, S, H, D, dtype=torch.float64)
    idx, w = torch.tensor([1, 2]).view(2, 1, 1), torch.ones(2, 1, 1, dtype=torch.float64)
    o = gca_reference(q, k_mem, v_mem, idx, w)[:, 0]  # (B, S, H, D)
    k, v = k_mem[[0, 1], [1, 2], : S - 1], v_mem[[0, 1], [1, 2], : S - 1]  # the text tokens of each pick
    p = softmax_off_by_one(torch.einsum("bshd,bthd->bhst", q[:, 0], k) / math.sqrt(D))
    torch.testing.assert_close(o, torch.einsum("bhst,bthd->bshd", p, v))


# -----------------------------------------------------------------------------
# retrieval (§3.1-3.2): Eq. 1 scores, Gumbel top-k, Eq. 3 weights; chunk c+1 reads chunk c's picks


def test_topk_blockwise_equals_full():
    torch.manual_seed(5)
    q, landmarks = torch.randn(2, 40, 16), torch.randn(2, 100, 16)
    ids = torch.randint(0, 100, (40,))
    full = topk_earlier(q, [landmarks], ids, 6)
    for block in (7, 33):
        got = topk_earlier(q, landmarks.split(block, 1), ids, 6)
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
    s = (q @ landmarks.transpose(1, 2)).masked_fill(torch.arange(100)[None, None] >= ids[None, :, None], -1e30)
    want = s.topk(6, -1).indices
    elig = full[1]
    assert torch.equal(full[0][elig], want[elig])


def test_gumbel_only_in_training():
    model = tiny_model(dtype=torch.float32)
    idx = tokens(model.config, 2, 12 * 7, seed=3)
    model.eval()
    with torch.no_grad():
        assert torch.equal(all_logits(model, idx), all_logits(model, idx)), "eval must be deterministic"
    model.train()
    with torch.no_grad():  # with noise, two training forwards pick different chunks
        assert not torch.equal(all_logits(model, idx), all_logits(model, idx))
        model.config.gumbel = False
        assert torch.equal(all_logits(model, idx), all_logits(model, idx))


def test_softmax_off_by_one():
    r = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = softmax_off_by_one(r)
    torch.testing.assert_close(w, r.exp() / (1 + r.exp().sum(-1, keepdim=True)))
    assert (w.sum(-1) < 1).all()
    big = softmax_off_by_one(torch.tensor([[1000.0, 999.0]]))  # stable
    torch.testing.assert_close(big, torch.softmax(torch.tensor([[1000.0, 999.0]]), -1))
    masked = torch.tensor([[0.5, float("-inf")], [float("-inf"), float("-inf")]], requires_grad=True)
    for off in (True, False):
        w = softmax_off_by_one(masked, off)
        w.sum().backward()
        assert w[1].abs().sum() == 0 and w[0, 1] == 0 and torch.isfinite(masked.grad).all()
        masked.grad = None
    torch.testing.assert_close(softmax_off_by_one(r, False), torch.softmax(r, -1))


def test_retrieval_weights_use_clean_scores():
    """Training: picks come from noisy scores, weights from the clean ones (Eq. 1, 3)."""
    torch.manual_seed(4)
    cfg = tiny_config(topk=4)
    B, M, C = 2, 30, cfg.n_embd
    landmarks, q = torch.randn(B, M, C), torch.randn(B, M, C)
    chunk_ids = torch.arange(M)
    idx, eligible = topk_earlier(q, [landmarks], chunk_ids, cfg.topk, noise=True)
    clean_idx, _ = topk_earlier(q, [landmarks], chunk_ids, cfg.topk)
    assert not torch.equal(idx, clean_idx), "Gumbel noise changed no pick"
    b = torch.arange(B)[:, None, None]
    w = retrieval_weights(q, landmarks[b, idx], eligible, cfg)
    r = (q[:, :, None] * landmarks[b, idx]).sum(-1) / math.sqrt(C)
    eligible = (torch.arange(cfg.topk)[None, None, :] < chunk_ids[None, :, None]).expand(B, -1, -1)  # t earlier chunks
    expect = softmax_off_by_one(r.masked_fill(~eligible, float("-inf")))
    torch.testing.assert_close(w, expect)
    assert (idx[eligible] < chunk_ids[None, :, None].expand_as(idx)[eligible]).all(), "picked a later chunk"
    assert (w[~eligible] == 0).all() and (w[:, :2].sum(-1) <= 1).all()


def test_retriever_learns():
    """After one backward every parameter has a non-zero gradient, including the retrieval
    norms RMSNorm_g, which act on the loss only through the GCA weights w."""
    model = tiny_model(groups=(1, 1), dtype=torch.float32).train()
    idx = tokens(model.config, 2, 12 * 7, seed=2)
    _, loss = model(idx, torch.roll(idx, -1, 1))
    loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not dead, f"parameters with no gradient: {dead}"
    assert all(model.ret_norm[g].weight.grad.abs().sum() > 0 for g in range(2))


@pytest.mark.parametrize("option", [dict(code_read=True), dict(code_read=True, softmax_off_by_one=False, gumbel=False)],
                         ids=["code_read", "code_teacher"])
def test_retrieval_options_stream_and_train(option):
    """The departures from the paper's form (code_read), alone and with config/code_teacher.py's scoring: a stream cut
    into segments computes what one forward does, and training reaches every parameter."""
    model = tiny_model(groups=(1, 1), **option)
    idx = tokens(model.config, 2, 97, seed=3)
    _, loss = model(idx, idx)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.eval()
    state, outs = model.new_state(), []
    for s in range(0, 97, 23):
        outs.append(all_logits(model, idx[:, s : s + 23], state))
    assert rel_err(torch.cat(outs, 1), all_logits(model, idx)) < 1e-10


def test_exact_ties_fall_to_the_earliest_chunk():
    """Chunks repeated word for word tie exactly in Eq. 1. rank_key orders by score, then the earlier chunk, for
    every float (negative, zero, -inf); so a stream picks what one forward picks, also where a pick j decides which
    chunk j+1 GCA reads (code_read). Without it, topk broke such ties by where a chunk sat in its page."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4000, generator=g).round(decimals=1)  # many exact ties
    s[::97], s[::89], s[::83] = float("-inf"), 0.0, -0.0
    j = torch.randperm(4000, generator=g)
    order = drt.rank_key(s, j).argsort(descending=True)
    want = sorted(range(4000), key=lambda i: (-s[i].item(), j[i].item()))  # -0.0 == 0.0, a tie
    assert order.tolist() == want
    model = tiny_model(groups=(1, 1), code_read=True, gumbel=False, softmax_off_by_one=False).eval()  # code_teacher.py's
    other = tokens(model.config, 2, 12 * 7, seed=4).view(2, 12, 7)
    idx = torch.stack([other[:, i // 2] if i % 2 else other[:, 0, :] for i in range(24)], 1).flatten(1)  # (2, 168)
    state = model.new_state()
    stream = torch.cat([all_logits(model, idx[:, t : t + 1], state) for t in range(idx.size(1))], 1)
    assert rel_err(stream, all_logits(model, idx)) < 1e-10


def test_code_read_centres_memory():
    """code_read: GCA's keys/values come from the encoder's states minus their chunk's mean over its
    text positions, then normalised, so that a part every position shares (which dominates trained
    states) no longer shrinks what tells them apart; the landmark l (Eq. 1's key) is unchanged."""
    torch.manual_seed(0)
    c, noise = torch.randn(32, dtype=torch.float64), torch.randn(2, 3, 8, 32, dtype=torch.float64)
    x = 10 * c + 0.1 * noise  # (B, n, S, C): a shared part 100x the positions' own
    outs = {}
    for code in (False, True):
        enc = tiny_model(n_enc=0, code_read=code).encoder
        kv, l = enc(x)
        h = enc.ln_in(x)
        h_mem = h - h[:, :, :-1].mean(2, keepdim=True) if code else h
        want = enc.kv_mem(enc.ln_f(h_mem)).unflatten(-1, (2, 4, 8))
        assert rel_err(kv[:, :, :-1], want[:, :, :-1]) < 1e-12 and rel_err(l, enc.ln_f(h)[:, :, -1]) < 1e-12
        k = F.normalize(kv[:, :, :-1, 0].flatten(-2), dim=-1)  # (B, n, S-1, C) text keys
        outs[code] = (k @ k.transpose(-1, -2)).mean().item()  # mean cosine between a chunk's keys
    assert outs[False] > 0.99 and outs[True] < 0.5, outs


def test_code_read_pools_eq1_and_reads_next():
    """code_read: Eq. 1's query is chunk t's mean text embedding minus the mean of those over chunks 0..t
    (in pieces as at once), its key chunk j's mean embedding; GCA of chunk t+1 reads chunk j+1
    for each pick j of landmark t (read_shift), weighted by j's score."""
    from types import SimpleNamespace
    x = torch.randn(2, 5, 8, 32, dtype=torch.float64)  # (B, n, S, C)
    l, q = drt.pooled_eq1(x, torch.nn.Identity())
    m = x[:, :, :-1].mean(2)
    want = torch.stack([m[:, t] - m[:, : t + 1].mean(1) for t in range(5)], 1)
    assert rel_err(q, want) < 1e-12 and rel_err(l, m) < 1e-12
    state = SimpleNamespace(pool_total=None, pool_count=0)  # a stream's, in two pieces
    q1, q2 = (drt.pooled_eq1(part, torch.nn.Identity(), state)[1] for part in (x[:, :2], x[:, 2:]))
    assert rel_err(torch.cat([q1, q2], 1), q) < 1e-12 and rel_err(state.pool_total, m.sum(1)) < 1e-12
    assert state.pool_count == 5

    model = tiny_model(code_read=True).eval()
    assert drt.read_shift(model.config) == 1
    idx = tokens(model.config, 2, 7 * 9, seed=5)  # 9 chunks
    read = []
    gca = drt.gca
    drt.gca = lambda q, k, v, i, w: read.append(i) or gca(q, k, v, i, w)
    try:
        with torch.no_grad(), model.recording() as record:
            model(idx, idx)
    finally:
        drt.gca = gca
    t, picks, w = retrievals(record)[0]  # (n,), (B, n, K), (B, n, K)
    with torch.no_grad():
        e = model.wte(drt.insert_landmarks(idx, model.config)[0]).view(2, 9, 8, 32)  # (B, n, S, C)
        m = e[:, :, :-1].mean(2)  # (B, n, C)
        centred = m - m.cumsum(1) / torch.arange(1, 10, dtype=m.dtype)[:, None]
        r = model.ret_norm[0](centred) @ model.encoder.ln_f(m).transpose(1, 2)
    r = r.masked_fill(t[None, None, :] >= t[None, :, None], float("-inf"))  # (B, n, n)
    assert torch.equal(picks[:, 3:, 0], r.argmax(-1)[:, 3:])  # Eq. 1 of the pooled query and keys
    assert torch.equal(read[0][:, 3:9], (picks[:, 2:8] + 1).minimum(t[2:8, None]))  # chunk c+1 reads j+1


def test_code_read_has_no_sink():
    """The paper's read path (default): the landmark slot's key and value are zero, GCA's sink; code_read: a key like
    the others."""
    x = torch.randn(2, 3, 8, 32, dtype=torch.float64)
    for code in (False, True):
        kv, _ = tiny_model(code_read=code).encoder(x)  # (B, n, S, 2, H, D)
        assert bool((kv[:, :, -1] == 0).all()) is not code and kv[:, :, :-1].abs().sum() > 0


def test_sink_share():
    """sink_share: with every memory key zero, each of the S keys (the sink among them) gets 1/S; the
    weights scale it; retrieval_stats divides by them."""
    B, N, S, H, D, K = 2, 3, 8, 2, 4, 2
    q = torch.randn(B, N, S, H, D, dtype=torch.float64)
    k = torch.zeros(B, 5, S, H, D, dtype=torch.float64)
    w = torch.full((B, N, K), 0.5, dtype=torch.float64)
    share, total = common.sink_share(q, k, k, torch.randint(0, 5, (B, N, K)), w)
    assert share.item() == pytest.approx(total.item() / S) and total.item() == pytest.approx(B * N)
    k[:, :, :-1] = -10.0  # with positive queries, every other key's logit lies far below the sink's 0
    share, total = common.sink_share(q.abs() + 0.1, k, k, torch.zeros(B, N, K, dtype=torch.long), w)
    assert share.item() / total.item() > 0.99
    t = torch.arange(3)
    stats = common.retrieval_stats([("picks", t, torch.zeros(1, 3, K, dtype=torch.long), torch.ones(1, 3, K) / K),
                                    ("sink", share, total)], K)
    assert stats["sink"] == pytest.approx(share.item() / total.item())


def test_picks_read_one_chunk_later():
    """The picks made at the landmark of chunk c are what chunk c+1 reads: a segment's chunks read
    the picks carried from before it, then those of its own landmarks, the last of which (if the
    segment ends on a landmark) serves the next segment; at a stream's start, weight-0 picks."""
    from model import read_one_chunk_later
    carried = (torch.full((2, 1, 3), 7), torch.rand(2, 1, 3))
    made = (torch.randint(0, 7, (2, 4, 3)), torch.rand(2, 4, 3))
    for n_chunks in (4, 5):  # the segment ends on its 4th landmark, or goes on into a 5th chunk
        idx, w = read_one_chunk_later(carried, made, n_chunks)
        assert torch.equal(idx, torch.cat([carried[0], made[0]], 1)[:, :n_chunks])
        assert torch.equal(w[:, 1:], made[1][:, : n_chunks - 1]) and torch.equal(w[:, :1], carried[1])
    idx, w = read_one_chunk_later(None, made, 5)
    assert torch.equal(idx[:, 1:], made[0]) and (w[:, 0] == 0).all() and torch.equal(w[:, 1:], made[1])
    assert read_one_chunk_later(carried, None, 1) is carried


def test_group_2_queries_after_group_1_reads():
    """Why a second hop needs the question a chunk ahead: group 2's query (Eq. 1) at the landmark of chunk t is the
    state group 1 leaves there, which has read what group 1 picked at landmark t-1, not what it picks at landmark t
    (read by chunk t+1). Chunks a and b lie far outside every window: changing a, picked at t-1, moves group 2's
    query at t; changing b, picked at t, does not; group 1's query at t, from the lower layers, moves with neither."""
    model = tiny_model(groups=(1, 1), topk=1).eval()  # S=8: 7 tokens a chunk; windows of 2 chunks, 3 layers
    T, t, a, b, n = 7, 12, 1, 2, 14
    picks = torch.zeros(n, 1, dtype=torch.long)  # every landmark picks chunk 0, but for these two
    picks[t - 1], picks[t] = a, b
    queries = {}
    for g, norm in enumerate(model.ret_norm):
        norm.register_forward_hook(lambda m, inp, out, g=g: queries.__setitem__(g, inp[0][0, t].clone()))

    def at_t(idx):  # the groups' queries at landmark t: (group 1's, group 2's)
        with torch.no_grad():
            model(idx, picks=picks)
        return queries[0], queries[1]

    idx = tokens(model.config, 1, n * T, seed=0)
    base = at_t(idx)
    for chunk, moves in ((a, True), (b, False)):
        changed = idx.clone()
        changed[0, chunk * T : (chunk + 1) * T] = tokens(model.config, 1, T, seed=chunk + 1)[0]
        g1, g2 = at_t(changed)
        assert torch.equal(g1, base[0])  # the lower layers' state: beyond their windows
        assert (not torch.equal(g2, base[1])) == moves, chunk


# -----------------------------------------------------------------------------
# GCA (Eq. 2): the reference against a loop over every (batch, chunk, pick, head, query)


def gca_loops(q, k_mem, v_mem, idx, w):
    B, C, S, H, D = q.shape
    o = torch.zeros_like(q)
    for b in range(B):
        for c in range(C):
            for i in range(idx.size(-1)):
                m = idx[b, c, i]
                for h in range(H):
                    for s in range(S):
                        p = torch.softmax(k_mem[b, m, :, h] @ q[b, c, s, h] / math.sqrt(D), 0)  # (S,)
                        o[b, c, s, h] += w[b, c, i] * (p @ v_mem[b, m, :, h])
    return o


def test_gca_reference_equals_loops():
    torch.manual_seed(10)
    B, C, M, S, H, D, K = 2, 3, 5, 4, 2, 8, 3
    q = torch.randn(B, C, S, H, D, dtype=torch.float64)
    k_mem, v_mem = torch.randn(2, B, M, S, H, D, dtype=torch.float64)
    idx = torch.randint(0, M, (B, C, K))
    idx[0, 1] = 2  # the same chunk picked repeatedly in one row
    w = torch.rand(B, C, K, dtype=torch.float64)
    w[1, 2, 0] = 0
    torch.testing.assert_close(gca_reference(q, k_mem, v_mem, idx, w), gca_loops(q, k_mem, v_mem, idx, w))


# -----------------------------------------------------------------------------
# FlashGCA (gca_kernel.py) against the reference: output and all four gradients; the model's dispatch to it

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # max relative error

# (B, C, M, S, H, D, K, dtype, features)
#   rep:  each batch's first query chunk picks one chunk twice
#   w0:   about a quarter of the picks get weight 0 (their dw must still be right)
#   free: memory chunk M-1 is picked by nobody (its dk, dv must be exactly 0)
#   hot:  every query chunk picks memory chunk 0 in slot 0 (dk/dv accumulation)
#   view: q and k_mem are non-contiguous views
#   wq:   w in q's dtype (it is usually fp32)
CASES = [
    (2, 5, 7, 16, 2, 32, 3, torch.float32, "rep-w0-free"),
    (1, 4, 3, 32, 2, 64, 1, torch.float32, "free"),
    (1, 3, 19, 16, 1, 16, 16, torch.float32, "rep-w0-free"),
    (1, 12, 4, 16, 1, 32, 2, torch.float32, "hot-w0"),
    (2, 3, 5, 16, 3, 32, 2, torch.float32, "view-rep"),
    (2, 5, 7, 16, 2, 32, 3, torch.float16, "rep-w0-free-wq"),
    (1, 3, 5, 64, 1, 64, 3, torch.float16, "hot-free"),
    (1, 2, 3, 128, 1, 16, 2, torch.float16, "view"),
    (1, 2, 3, 16, 1, 128, 2, torch.float32, "w0"),
    (1, 6, 7, 64, 2, 64, 8, torch.float16, "rep-w0-free-hot"),  # the model's tile and top-k
]
if DEVICE == "cuda":  # natively: the model's tile, bigger shapes, and bf16
    CASES += [(2, 33, 40, 64, 4, 64, 8, dt, "rep-w0-free-hot")
              for dt in (torch.float32, torch.float16, torch.bfloat16)]
    CASES += [(2, 9, 11, 64, 2, d, k, torch.bfloat16, "rep-w0-free-view")
              for d, k in ((32, 1), (64, 16), (128, 3))]


def case_id(case):
    B, C, M, S, H, D, K, dtype, feat = case
    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return f"B{B}-C{C}-M{M}-S{S}-H{H}-D{D}-K{K}-{name}-{feat}"


def make_inputs(case, seed):
    B, C, M, S, H, D, K, dtype, feat = case
    g = torch.Generator().manual_seed(seed)
    feat = feat.split("-")
    n_pick = M - 1 if "free" in feat else M
    idx = torch.randint(0, n_pick, (B, C, K), generator=g)
    if "rep" in feat and K >= 2:
        idx[:, 0, 1] = idx[:, 0, 0]
    if "hot" in feat:
        idx[:, :, 0] = 0
    w = torch.rand(B, C, K, generator=g)
    if "w0" in feat:
        w[torch.rand(B, C, K, generator=g) < 0.25] = 0.0
        w[0, 0, 0] = 0.0
    if "wq" in feat:
        w = w.to(dtype)
    q = torch.randn(B, C, S, H, D, generator=g)
    k = torch.randn(B, M, S, H, D, generator=g)
    v = torch.randn(B, M, S, H, D, generator=g)
    do = torch.randn(B, C, S, H, D, generator=g)
    q, k, v, do = (x.to(DEVICE, dtype) for x in (q, k, v, do))
    if "view" in feat:  # q: last dim sliced out of a wider tensor; k: chunks and positions swapped
        q = torch.zeros(B, C, S, H, 2 * D, dtype=dtype, device=DEVICE)[..., :D].copy_(q)
        k = torch.zeros(B, S, M, H, D, dtype=dtype, device=DEVICE).transpose(1, 2).copy_(k)
    return q, k, v, idx.to(DEVICE), w.to(DEVICE), do


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_flash_gca_matches_naive(case, monkeypatch):
    monkeypatch.setattr(gca_kernel, "DEBUG_POISON", True)  # unwritten outputs read as NaN
    B, C, M, S, H, D, K, dtype, feat = case
    q, k, v, idx, w, do = make_inputs(case, seed=zlib.crc32(case_id(case).encode()))
    if "view" in feat:
        assert not q.is_contiguous() and not k.is_contiguous() and q.stride(-1) == 1
    ins = [x.detach().requires_grad_() for x in (q, k, v, w)]
    o = flash_gca(ins[0], ins[1], ins[2], idx, ins[3])
    grads = torch.autograd.grad(o, ins, do)
    ref_ins = [x.detach().float().requires_grad_() for x in (q, k, v, w)]
    o_ref = gca_reference(ref_ins[0], ref_ins[1], ref_ins[2], idx, ref_ins[3])
    ref_grads = torch.autograd.grad(o_ref, ref_ins, do.float())

    assert o.dtype == dtype and o.shape == (B, C, S, H, D)
    errs = {"o": rel_err(o, o_ref)}
    for name, x, g, r in zip(("dq", "dk", "dv", "dw"), ins, grads, ref_grads):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        errs[name] = rel_err(g, r)
    zero_w = w == 0
    if zero_w.any():  # dw_i = <dO, O_i> whatever w_i is
        errs["dw[w=0]"] = rel_err(grads[3][zero_w], ref_grads[3][zero_w])
    msg = ", ".join(f"{n} {e:.2e}" for n, e in errs.items())
    assert all(e < TOL[dtype] for e in errs.values()), f"relative errors: {msg}"
    if "free" in feat:  # nobody picked chunk M-1: its gradients are exactly 0
        assert grads[1][:, M - 1].eq(0).all() and grads[2][:, M - 1].eq(0).all()


def test_flash_gca_grads_subset():
    """Only some inputs need grad (the model's k_mem/v_mem may be frozen); int32 idx."""
    case = (1, 3, 4, 16, 1, 16, 2, torch.float32, "w0")
    q, k, v, idx, w, do = make_inputs(case, seed=7)
    q.requires_grad_()
    o = flash_gca(q, k, v, idx.int(), w)
    (dq,) = torch.autograd.grad(o, (q,), do)
    q_ref = q.detach().requires_grad_()
    (dq_ref,) = torch.autograd.grad(gca_reference(q_ref, k, v, idx, w), (q_ref,), do)
    assert rel_err(dq, dq_ref) < 1e-4


def test_flash_gca_deterministic():
    """No atomics: two backward passes agree bit for bit; no_grad gives the same o."""
    case = (2, 6, 4, 16, 2, 16, 3, torch.float16, "hot-w0")
    q, k, v, idx, w, do = make_inputs(case, seed=3)
    ins = [x.requires_grad_() for x in (q, k, v, w)]
    o1 = flash_gca(*ins[:3], idx, ins[3])
    o2 = flash_gca(*ins[:3], idx, ins[3])
    g1 = torch.autograd.grad(o1, ins, do)
    g2 = torch.autograd.grad(o2, ins, do)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    with torch.no_grad():
        assert torch.equal(flash_gca(*ins[:3], idx, ins[3]), o1)


def test_flash_gca_input_errors():
    case = (1, 2, 3, 16, 1, 16, 2, torch.float32, "")
    q, k, v, idx, w, _ = make_inputs(case, seed=0)
    bad = [
        ((q[0], k, v, idx, w), ValueError, "must be \\(B, C, S, H, D\\)"),
        ((q, k[:, :, :, :, :8], v, idx, w), ValueError, "to match q"),
        ((q, k, v[:, :2], idx, w), ValueError, "v_mem .* shape of k_mem"),
        ((q, k, v, idx[:, :1], w), ValueError, "idx .* must be \\(B, C, K\\)"),
        ((q, k, v, idx, w[..., :1]), ValueError, "w .* shape of idx"),
        ((q.double(), k.double(), v.double(), idx, w), TypeError, "fp16, bf16 or fp32"),
        ((q, k.half(), v, idx, w), TypeError, "share one dtype"),
        ((q, k, v, idx.float(), w), TypeError, "idx must be an integer"),
        ((q, k, v, idx, (w > 0.5).long()), TypeError, "w must be a float"),
        ((q, k, v, idx + 3, w), ValueError, "idx must lie in \\[0, M=3\\)"),
        ((q, k, v, idx - 1, w), ValueError, "idx must lie in"),
        ((q[..., :8], k[..., :8], v[..., :8], idx, w), ValueError, "head dim D=8"),
        ((q[:, :, :8], k[:, :, :8], v[:, :, :8], idx, w), ValueError, "chunk size S=8"),
    ]
    big = torch.zeros(1, 2, 128, 1, 128, device=DEVICE)  # fp32 128 x 128 tiles: too big
    bad.append(((big, big, big, idx[:1], w[:1]), ValueError, "do not fit in shared memory"))
    for args, err, pattern in bad:
        with pytest.raises(err, match=pattern):
            flash_gca(*args)


def test_kernel_fits():
    """The shapes model.gca sends to FlashGCA are exactly those flash_gca accepts."""
    for S, D, dtype in [(64, 64, torch.bfloat16), (64, 48, torch.bfloat16), (24, 64, torch.float16),
                        (128, 128, torch.float32), (64, 128, torch.float32), (64, 64, torch.float64)]:
        fits = gca_kernel.kernel_fits(S, D, dtype)
        x = torch.zeros(1, 1, S, 1, D, dtype=dtype, device=DEVICE)
        idx, w = torch.zeros(1, 1, 1, dtype=torch.long, device=DEVICE), torch.ones(1, 1, 1, device=DEVICE)
        try:
            flash_gca(x, x, x, idx, w)
            accepted = True
        except (ValueError, TypeError):
            accepted = False
        assert fits == accepted, (S, D, dtype)


def test_model_kernel_equals_reference(monkeypatch):
    """The whole model, forward and every gradient, with FlashGCA vs the PyTorch GCA (on a CPU
    the kernel runs in Triton's interpreter: the model's dispatch to it is the GPU's)."""
    torch.manual_seed(13)
    n_embd, T = (128, 20 * 15) if DEVICE == "cuda" else (32, 8 * 15)  # D = 64 or 16
    m = DRT(tiny_config(n_embd=n_embd, n_head=2, chunk_size=16, window=32, groups=(1, 1))).to(DEVICE)
    idx = tokens(m.config, 2, T, seed=13).to(DEVICE)
    out = {}
    for impl in ("triton", "torch"):
        monkeypatch.setattr(drt, "GCA_IMPL", impl)
        torch.manual_seed(14)  # the same Gumbel noise for both
        logits, _ = m(idx)
        m.zero_grad()
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        out[impl] = [logits] + [p.grad.clone() for p in m.parameters()]
    for a, b in zip(out["triton"], out["torch"]):
        assert rel_err(a, b) < 1e-4


@cuda
def test_cuda_gca_falls_back_outside_the_kernel():
    """Head width 48 (768 / 16 heads) or chunks of 24 are not FlashGCA tiles: the model runs the
    PyTorch GCA there instead of failing inside the kernel."""
    for kw in (dict(n_embd=96, n_head=2), dict(chunk_size=24, window=48)):
        torch.manual_seed(0)
        m = DRT(tiny_config(**{"n_embd": 64, "n_head": 2, "chunk_size": 16, "window": 32, **kw})).cuda()
        idx = tokens(m.config, 2, 12 * (m.config.chunk_size - 1), seed=0).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = m(idx, idx)
        loss.backward()
        assert torch.isfinite(loss)


# -----------------------------------------------------------------------------
# the model end to end: the 146M config, input errors, causality, every configuration trains, the loss


def test_default_config_is_146M():
    """The default config builds the paper's 146M DRT; groups=() is the baseline of the same depth."""
    n = DRT(DRTConfig()).num_params()
    assert 145.5e6 < n < 146.5e6, n
    assert len(DRT(DRTConfig(n_lower=12, groups=())).lower) == 12


def test_bad_input_errors():
    model = tiny_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="T=0"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[1, 2, 96]]))
    with pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="landmark"):
        model(torch.tensor([[1, 95, 2]]))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    for state in (None, model.new_state()):  # a row's chunked loss would read -100 as token 0
        with pytest.raises(ValueError, match=r"targets must be token ids in \[0, 96\) or -1"):
            model(torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), -100), state=state)
    for bad, msg in [(dict(chunk_size=1), "chunk_size"), (dict(window=12), "window"), (dict(n_head=5), "n_head"),
                     (dict(landmark_id=96), "landmark_id"), (dict(topk=0), "topk"), (dict(groups=(2, 0)), "groups"),
                     (dict(n_head=0), "n_head=0"), (dict(groups=(1.5,)), r"groups=\(1.5,\): .* whole number"),
                     (dict(mlp_hidden=-5), "mlp_hidden")]:
        with pytest.raises(ValueError, match=msg):
            tiny_config(**bad)


@pytest.mark.parametrize("groups", [(1,), (1, 1)], ids=["G1", "G2"])
def test_no_future_leakage(groups):
    """Eval mode: changing tokens at positions >= t leaves logits at positions < t bit-identical,
    with >= 10 chunks so that retrieval is active, t at chunk boundaries and inside chunks."""
    model = tiny_model(groups=groups).eval()
    S1 = model.config.chunk_size - 1  # text tokens per chunk
    T = 12 * S1
    idx = tokens(model.config, 2, T, seed=1)
    with torch.no_grad():
        ref = all_logits(model, idx)
        for t in [3 * S1, 5 * S1 + 3, 9 * S1, 10 * S1 + 1, T - 1]:
            changed = idx.clone()
            changed[:, t:] = tokens(model.config, 2, T - t, seed=t)
            out = all_logits(model, changed)
            assert torch.equal(out[:, :t], ref[:, :t]), f"logits before t={t} changed"
            assert not torch.equal(out[:, t:], ref[:, t:])  # the change is visible where it should be


@pytest.mark.parametrize("groups", [(2,), (1, 1), ()], ids=["G1", "G2", "baseline"])
def test_configs_train(groups):
    model = tiny_model(groups=groups, dtype=torch.float32).train()
    idx = tokens(model.config, 2, 10 * 7 + 3, seed=6)
    logits, _ = model(idx)
    none, loss = model(idx, idx)
    assert logits.shape == (2, 73, 96) and none is None and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())  # every layer reads its GCA
    if not groups:
        assert model.encoder is None and len(model.upper) == 0


@pytest.mark.parametrize("ce_rows", [4096, 16])
def test_loss_without_logits(ce_rows, monkeypatch):
    """A whole row with targets (training, validation) gives the cross-entropy of its full logits, and its gradients,
    without making them, whether the rows fit one chunk of LinearCrossEntropy or take several."""
    monkeypatch.setattr(fused, "CE_ROWS", ce_rows)  # 16: 70 rows in 5 chunks, the last one partial
    model = tiny_model(dtype=torch.float64).train()
    model.config.gumbel = False
    idx = tokens(model.config, 2, 5 * 7, seed=16)
    targets = torch.roll(idx, -1, 1)
    targets[:, ::3] = -1
    logits, _ = model(idx)
    full = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
    full.backward()
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    none, loss = model(idx, targets)
    loss.backward()
    assert none is None and logits.shape == (2, 35, 96)
    torch.testing.assert_close(loss, full)
    for a, b in zip(g_full, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b)


def test_targets_of_the_row_end_score_it_alone():
    """Targets (B, A) score the row's last A positions alone (train.py's task rows, whose answer ends the row): the loss
    and every gradient of the full targets, -1 elsewhere; an answer cut by the row's end, a row without targets; a
    stream's segment gives the logits of those positions; torch.compile takes it as one graph."""
    model = tiny_model(dtype=torch.float64, gumbel=False).train()
    idx = tokens(model.config, 3, 5 * 7, seed=18)
    targets = torch.full_like(idx, -1)
    targets[0, 28:32], targets[1, 33:] = idx[0, 29:33], idx[1, :2]  # 4 answer tokens; 2 at the row's end; none
    _, full = model(idx, targets)
    full.backward()
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, loss = model(idx, targets[:, -8:])
    loss.backward()
    torch.testing.assert_close(loss, full)
    for a, p in zip(g_full, model.parameters()):
        torch.testing.assert_close(p.grad, a)
    with torch.no_grad():
        logits, streamed = model.eval()(idx, targets[:, -8:], state=model.new_state())
    assert logits.shape == (3, 8, 96)
    torch.testing.assert_close(logits, model(idx)[0][:, -8:])
    torch.testing.assert_close(streamed, full)
    torch._dynamo.reset()
    compiled = torch.compile(model.train(), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(idx, targets[:, -8:])[1], full)


def test_loss_without_grad_makes_no_gradients(monkeypatch):
    """LinearCrossEntropy makes only the gradients a backward will use: under no_grad (evaluation)
    one matmul per chunk of rows, the same loss; dw alone (x needs no grad) two; both three."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
            return func(*args, **(kwargs or {}))

    def matmuls(x, w, grad=True):
        with torch.set_grad_enabled(grad), CountMatmuls() as count:
            loss = fused.LinearCrossEntropy.apply(x, w, targets, torch.is_grad_enabled())
        return count.n, loss

    monkeypatch.setattr(fused, "CE_ROWS", 16)  # 40 rows: 3 chunks
    x, w = torch.randn(40, 8, dtype=torch.float64), torch.randn(96, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 96, (40,))
    (n_eval, eval_loss), (n_dw, _), (n_both, loss) = matmuls(x, w, False), matmuls(x, w), matmuls(x.requires_grad_(), w)
    assert (n_eval, n_dw, n_both) == (3, 6, 9)
    torch.testing.assert_close(eval_loss, loss)
    torch.testing.assert_close(eval_loss, F.cross_entropy(x @ w.t(), targets))


@pytest.mark.parametrize("form", ["paper", "code_teacher"])
def test_compile_whole_model(form):
    """torch.compile takes the whole training step as one graph (fullgraph: a break raises) with no
    warning from the compiler, and computes what eager computes: the paper's form, and the code recipe's
    with a teacher's picks handed in. backend="aot_eager" traces and differentiates as on the GPU,
    without needing a C++ compiler."""
    import teacher
    torch._dynamo.reset()
    code = dict(code_read=True, softmax_off_by_one=False)
    model = tiny_model(dtype=torch.float32, gumbel=False, **(code if form == "code_teacher" else {})).train()  # same picks
    idx = tokens(model.config, 2, 5 * 7 + 3, seed=17)
    targets, picks = torch.roll(idx, -1, 1), None
    if form == "code_teacher":
        picks = teacher.teacher_picks(idx, model.config)
        assert (picks >= 0).any()
    _, ref = model(idx, targets, picks=picks)
    ref.backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, loss = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, targets, picks=picks)
        loss.backward()
    assert not [f"{w.filename}: {w.message}" for w in caught if "torch" in w.filename]
    torch.testing.assert_close(loss, ref)
    for a, p in zip(g_ref, model.parameters()):
        torch.testing.assert_close(p.grad, a)


@pytest.mark.parametrize("groups", [(3,), (2, 2)], ids=["G3", "G2+2"])
def test_compile_inverts_selection_once_per_group(groups, monkeypatch):
    """FlashGCA's backward needs the inverted selection (who picked each memory chunk: two argsorts),
    which depends on idx and w alone. All layers of a group share them, so the compiled backward
    builds it once per group, not once per layer. Traced as Inductor traces: AOTAutograd with the
    min-cut partitioner, whose common-subexpression pass merges the layers' copies."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    monkeypatch.setattr(drt, "GCA_IMPL", "triton")  # the kernel, also where the model would pick PyTorch
    counts = {}

    def backend(gm, example_inputs):
        def bw(graph, _):
            targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
            counts["sort"] = sum("sort" in t for t in targets)
            counts["gca_bwd"] = sum("flash_gca_bwd" in t for t in targets)
            return make_boxed_func(graph)
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=bw,
                                     partition_fn=min_cut_rematerialization_partition)

    torch._dynamo.reset()
    model = tiny_model(dtype=torch.float32, groups=groups, n_embd=64, chunk_size=16, window=32)  # D = 16
    model = model.to(DEVICE).train()  # the kernel: natively on a GPU, interpreted on a CPU
    idx = tokens(model.config, 1, 6 * 15, seed=5).to(DEVICE)
    _, loss = torch.compile(model, backend=backend, fullgraph=True)(idx, idx)
    loss.backward()
    assert counts["gca_bwd"] == sum(groups)  # one kernel call per upper layer
    assert counts["sort"] == 2 * len(groups)  # two argsorts per group


@cuda
def test_cuda_compiled_step_has_no_host_sync():
    """A compiled training step (forward, backward, fused AdamW) never waits for the GPU: no
    .item(), no data-dependent shape, no host-side check on device values."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    raw = DRT(tiny_config(n_embd=64, n_head=2, chunk_size=16, window=32, groups=(2,))).cuda()
    model = torch.compile(raw)
    opt = raw.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cuda")
    idx = tokens(raw.config, 2, 12 * 15, seed=3).cuda()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # compiles (which may synchronise)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call now raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


# -----------------------------------------------------------------------------
# streaming state (§3.2): token-by-token decoding, segmented prefill, offloaded memory

@pytest.mark.parametrize("groups", [(1,), (1, 1)], ids=["G1", "G2"])
def test_incremental_equals_full(groups):
    """Token-by-token decoding (O(W) rings, chunk memory, per-chunk retrieval) gives the full
    forward's logits at every position, across many chunk boundaries."""
    model = tiny_model(groups=groups).eval()
    idx = tokens(model.config, 2, 11 * 7 + 4, seed=11)
    with torch.no_grad():
        full = all_logits(model, idx)
        state = model.new_state()
        steps = [model(idx[:, t : t + 1], state=state)[0] for t in range(idx.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    assert state.rings[0].k.size(2) == model.config.window  # the cache never grows past W


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_segmented_prefill_equals_one_shot(offload):
    """Segments of odd lengths (not multiples of anything) reproduce the one-shot logits:
    no chunk loses its retrieval at a segment boundary; offloaded memory changes nothing."""
    model = tiny_model(groups=(1, 1)).eval()
    idx = tokens(model.config, 1, 150, seed=12)
    with torch.no_grad():
        full = all_logits(model, idx)
        state = model.new_state(offload=offload)
        cuts = [0, 5, 6, 27, 40, 41, 90, 150]
        parts = [all_logits(model, idx[:, a:b], state) for a, b in zip(cuts, cuts[1:])]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


def test_windows_see_w_minus_1_back():
    """Retrieval off, a token reaches the last output through the stacked windows from L x (W-1) positions back
    and no further (each window: 0 <= i - j < W): window_reach(exact=True), what sample.py's `in reach` counts with;
    window_reach, L x W, bounds it."""
    model = tiny_model(retriever="none").eval()
    cfg = model.config
    sight = (cfg.n_lower + cfg.n_upper) * (cfg.window - 1)  # 2 x 15 = 30 positions
    assert sight == drt.window_reach(cfg, exact=True) < drt.window_reach(cfg)
    idx = tokens(cfg, 1, 60, seed=3)
    ids, _ = insert_landmarks(idx, cfg)
    pos = (ids[0] != cfg.landmark_id).nonzero().squeeze(1)  # (60,) the text tokens' stream positions
    with torch.no_grad():
        last = model(idx)[0][0, -1]
        for p in range(60):
            other = idx.clone()
            other[0, p] = (other[0, p] + 1) % cfg.landmark_id
            seen = not torch.equal(model(other)[0][0, -1], last)
            assert seen == (pos[-1] - pos[p] <= sight), p


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("groups, option", [((2,), {}), ((1, 1), {}), ((1, 1), dict(code_read=True))],
                         ids=["G1", "G2", "G2-code_read"])
def test_skim_keeps_the_end(groups, option, offload):
    """A prompt skimmed (DRT.skim, memory only) in all its segments that end skim_margin tokens before its
    end gives the full stream's picks there and its logits after it; skimming up to the end does not (the
    upper layers' states reach that far)."""
    model = tiny_model(groups=groups, **option).eval()
    idx = tokens(model.config, 1, 400, seed=21)
    margin = drt.skim_margin(model.config)
    with torch.no_grad():
        full = all_logits(model, idx)

        def stream(skim):
            state, skims = model.new_state(offload=offload), []
            model.skim = lambda *a: skims.append(DRT.skim(model, *a))
            common.prefill(model, idx[0, :300].tolist(), state, 37, skim=skim)  # 37: segments cut chunks
            del model.skim
            return state, all_logits(model, idx[:, 300:], state), len(skims)

        skimmed, tail, n = stream(margin)
        exact, _, _ = stream(None)
        assert n == (300 - margin) // 37 > 2 and skimmed.store.lm.n == exact.store.lm.n
        for (i, w), (i0, w0) in zip(skimmed.picks, exact.picks):
            assert torch.equal(i, i0) and torch.equal(w, w0)
        torch.testing.assert_close(tail, full[:, 300:], rtol=1e-9, atol=1e-9)
        assert rel_err(stream(0)[1][:, :8], full[:, 300:308]) > 1e-3  # skimmed to the end: not exact


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_store_pages(monkeypatch, offload):
    """Landmarks and keys/values stored in many small growing pages (as at 16M tokens, with
    pages of thousands of chunks) give the same decoding as one page: page boundaries are
    invisible to retrieval and to the gather of the picked chunks."""
    model = tiny_model(groups=(1, 1)).eval()
    idx = tokens(model.config, 2, 120, seed=17)
    with torch.no_grad():
        full = all_logits(model, idx)
        monkeypatch.setattr(ChunkStore, "LM_PAGES", (1, 3))
        monkeypatch.setattr(ChunkStore, "KV_PAGES", (2, 4))
        state = model.new_state(offload=offload)
        parts = [all_logits(model, idx[:, a:b], state) for a, b in [(0, 50), (50, 51), (51, 120)]]
    assert len(state.store.lm.pages) > 4 and len(state.store.kv.pages) > 4
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


def test_state_holds_no_graph():
    """A StreamState used with gradients enabled keeps no autograd graph (memory stays O(W +
    chunks), not O(stream); each segment's backward runs alone), and the unfinished chunk's buffer
    is a copy, not a view that keeps the whole segment alive."""
    model = tiny_model(groups=(1, 1), dtype=torch.float32)
    state = model.new_state()
    for seg in (tokens(model.config, 2, 45, seed=1), tokens(model.config, 2, 30, seed=2)):
        logits, _ = model(seg, state=state)
        assert logits.grad_fn is not None  # the call itself is differentiable
        logits.sum().backward()  # would fail on a graph an earlier segment left in the state
    m = state.store
    held = [t for ring in state.rings for t in (ring.k, ring.v)] + m.lm.pages + m.kv.pages + [state.chunk_buf]
    held += [t for p in state.picks + state.prefetched for t in p]
    assert all(t is not None and t.grad_fn is None and not t.requires_grad for t in held)
    buf = state.chunk_buf
    assert buf.untyped_storage().nbytes() == buf.numel() * buf.element_size()


def stream_picks(model, idx, state=None):
    """The chunks picked at every landmark of idx (1, T), per group: [(n, K) sorted] — from one
    forward (state=None) or token by token through a StreamState."""
    S, G = model.config.chunk_size, len(model.config.groups)
    if state is None:
        with model.recording() as record:  # one ("picks", chunk ids, idx, w) per group
            model(idx)
        records = retrievals(record)
        return [records[g][1][0].sort(-1).values for g in range(G)]
    picks = [[] for _ in range(G)]
    for t in range(idx.size(1)):
        n = state.n
        model(idx[:, t : t + 1], state=state)
        if state.n // S > n // S:  # a landmark went in: new picks
            for g in range(G):
                picks[g].append(state.picks[g][0][0, -1].sort().values)
    return [torch.stack(p) for p in picks]


def test_decode_picks_equal_full_under_bf16():
    """Under bf16 autocast, token-by-token decoding picks exactly the chunks the full forward
    picks: retrieval scores are fp32, so how a stream is cut never decides a near-tie."""
    torch.manual_seed(0)
    model = DRT(tiny_config(n_embd=64, chunk_size=16, window=32, groups=(1, 1))).eval()
    idx = tokens(model.config, 1, 307, seed=1)  # 20 chunks: hundreds of scores, some close
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        full = stream_picks(model, idx)
        decoded = stream_picks(model, idx, model.new_state())
    for g in range(2):
        assert torch.equal(decoded[g], full[g][: len(decoded[g])]), f"group {g} picks differ"


def test_retrieval_scores_are_fp32_under_autocast():
    """Two chunks whose Eq. 1 scores differ by 2^-10, which bf16 rounds to one value (then the tie would go to
    the earlier chunk): under bf16 autocast the better, later one is still picked."""
    C = 64
    q = torch.zeros(1, 1, C)
    q[..., 0] = math.sqrt(C)  # score = l[0]
    lm = torch.zeros(1, 2, C)
    lm[0, :, 0] = torch.tensor([1.0, 1.0 + 2.0 ** -10])
    assert lm[0, 0, 0].bfloat16() == lm[0, 1, 0].bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        idx, ok = topk_earlier(q, [lm], torch.tensor([5]), 1)
    assert idx.item() == 1 and ok.all()


@cuda
def test_cuda_decode_picks_equal_full():
    """bf16 on a GPU: decoding token by token (with and without offload) picks the full forward's chunks."""
    torch.manual_seed(16)
    m = DRT(tiny_config(n_embd=128, n_head=2, chunk_size=16, window=32, groups=(1, 1))).cuda().eval()
    idx = tokens(m.config, 1, 500, seed=16).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        full = stream_picks(m, idx)
        for offload in (False, True):
            decoded = stream_picks(m, idx, m.new_state(offload=offload))
            assert all(torch.equal(d, f[: len(d)]) for d, f in zip(decoded, full)), offload


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_offload_equals_device(dtype):
    """Pinned host memory + non-blocking copies give the full forward's logits, in prefill
    segments (one ending on a chunk boundary) and then token by token, as sample.py decodes."""
    torch.manual_seed(15)
    m = DRT(tiny_config(n_embd=128, n_head=2, chunk_size=16, window=32, groups=(1, 1))).cuda().eval()
    idx = tokens(m.config, 1, 720, seed=15).cuda()
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    with torch.no_grad(), amp:
        full = all_logits(m, idx).float()
        for offload in (False, True):
            state = m.new_state(offload=offload)
            cuts = [0, 100, 101, 330, 600, 690]  # 330 = 22 chunks of 15 tokens: ends on a landmark
            parts = torch.cat([all_logits(m, idx[:, a:b], state) for a, b in zip(cuts, cuts[1:])], 1).float()
            assert rel_err(parts, full[:, :690]) < tol, offload
            steps = torch.cat([m(idx[:, t : t + 1], state=state)[0] for t in range(690, 720)], 1).float()
            assert rel_err(steps, full[:, 690:]) < tol, offload
        assert state.store.kv.pages[0].is_pinned() and state.store.kv.device.type == "cpu"


def test_retriever_random_and_none(monkeypatch):
    """retriever='random' (Table 4's ablation): k distinct, strictly earlier chunks drawn at random,
    weighted by Eq. 3 of their own scores; 'none': every weight 0, the same loss as a model whose
    retrieval weights are zeroed by hand, and not the learned retriever's."""
    model = tiny_model(seed=3).eval()
    cfg, K = model.config, model.config.topk
    idx = tokens(cfg, 2, 12 * (cfg.chunk_size - 1), seed=4)
    seen = spy_retrieval(monkeypatch)
    with model.recording() as record:
        _, learned = model(idx, idx)

    def as_mode(mode):  # the same weights, another retrieval mode
        other = DRT(dataclasses.replace(cfg, retriever=mode)).to(torch.float64).eval()
        other.load_state_dict(model.state_dict())
        return other
    (t, picks_l, _), = retrievals(record)
    for seed in (0, 1):
        seen[:] = []
        torch.manual_seed(seed)
        random_mode = as_mode("random")
        with random_mode.recording() as record:
            random_mode(idx, idx)
        (_, picks, w), (q, lm) = retrievals(record)[0], seen[0]
        ok = torch.arange(K) < t.clamp(max=K)[:, None]  # (n, K) eligible slots
        assert (picks[:, ok] < t[:, None].expand(-1, K)[ok]).all()  # strictly earlier
        assert all(len(set(row[m].tolist())) == int(m.sum()) for row in picks for row, m in zip(row, ok))  # distinct
        r = (q[:, :, None] * lm[torch.arange(2)[:, None, None], picks]).sum(-1) / math.sqrt(cfg.n_embd)
        assert torch.allclose(w, softmax_off_by_one(r.masked_fill(~ok, float("-inf"))), atol=1e-12)  # Eq. 3
        assert not torch.equal(picks[:, 4:], picks_l[:, 4:])  # not the learned top-k
    _, none = as_mode("none")(idx, idx)
    monkeypatch.setattr(drt, "softmax_off_by_one", lambda r, off_by_one=True: torch.zeros_like(r))
    _, zeroed = model(idx, idx)
    assert none.item() == zeroed.item() and abs(none.item() - learned.item()) > 1e-9
