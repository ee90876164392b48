"""
Tests for DRT (Hu et al., ICML 2025, arXiv 2410.01651), in the order the paper builds the model:
the landmarks and chunks -> positions (ALiBi) and sliding-window attention -> the chunk
encoder -> retrieval (Eq. 1 scores, Gumbel top-k, Eq. 3 weights) -> GCA's reference (Eq. 2) ->
the FlashGCA kernel (gca_kernel.py) against it -> the model end to end -> the streaming state
(decoding, prefill, offload) -> training (train.py) -> long-context tasks and sampling (tasks.py,
sample.py) -> data preparation (prepare_pg19.py) -> the benchmarks (bench.py).

    python -m pytest -q -rs test_gca.py        # CPU: the kernel runs under TRITON_INTERPRET=1; -rs: why tests skip
    python -m pytest -q test_gca.py -k "cuda or flash_gca"  # on a GPU: the kernel natively (and in bf16), the GPU paths

Every test draws fresh random inputs; models are tiny so the file runs in minutes on 2 cores.
Tokenizer tests need GPT-2's BPE: offline, DRT_GPT2_RANKS=/path/to/r50k_base.tiktoken (see
prepare_pg19.py), else tiktoken downloads it; without either they skip. DRT_PG19_SAMPLE=/path/to/
a small PG19-layout folder adds a test on real books.
"""

import glob
import http.server
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton (gca_kernel)

import common  # noqa: E402
import configurator  # noqa: E402
import gca_kernel  # noqa: E402
import model as drt  # noqa: E402
import prepare_pg19  # noqa: E402
import train  # noqa: E402
from gca_kernel import flash_gca  # noqa: E402
from model import DRT, DRTConfig, alibi_bias, alibi_slopes, gca_reference, retrieval_weights, softmax_off_by_one  # noqa: E402
from model import ChunkStore, insert_landmarks, topk_earlier, window_attention  # noqa: E402

# -----------------------------------------------------------------------------
# helpers: tiny models, random text ids, the GPT-2 tokenizer (or a skip)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel tests: natively on a GPU, interpreted on a CPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_config(**kw):
    """A DRT small enough for CPU tests but with every part in it: S=8 (7 tokens + landmark),
    W=16 (2 chunks), K=3, one lower layer, groups of one layer."""
    cfg = dict(vocab_size=96, landmark_id=95, n_embd=32, n_head=4, n_lower=1, groups=(1,), n_enc=1,
               chunk_size=8, window=16, topk=3)
    cfg.update(kw)
    return DRTConfig(**cfg)


def tiny_model(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    return DRT(tiny_config(**kw)).to(dtype)


def tokens(cfg, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.landmark_id, (B, T), generator=g)  # text ids: below the landmark


def all_logits(model, idx, state=None):
    """Logits at every text position (passing targets asks for all of them)."""
    logits, _ = model(idx, torch.zeros_like(idx), state=state)
    return logits


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tokenizer_or_skip(monkeypatch):
    # offline, DRT_GPT2_RANKS names GPT-2's ranks file; without it tiktoken must download 'gpt2'
    # (monkeypatch: unused, kept so that the callers stay as they are)
    try:
        return prepare_pg19.get_tokenizer()
    except (RuntimeError, FileNotFoundError) as e:
        pytest.skip(f"no GPT-2 tokenizer: {e}")


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
    assert logits.shape == (1, 1, 128)


# -----------------------------------------------------------------------------
# positions (ALiBi) and sliding-window attention: blocked SDPA and FlexAttention against a dense softmax


@pytest.mark.parametrize("L,W,ring", [(5, 8, False), (8, 8, False), (29, 8, False), (29, 8, True), (3, 8, True)])
def test_window_attention_matches_dense(L, W, ring):
    """Blocked sliding-window attention == a dense softmax with an explicit band mask."""
    from model import KVRing
    torch.manual_seed(L)
    B, H, D, P = 2, 4, 8, 11  # P: positions before the segment, held in the ring
    slopes = alibi_slopes(H).double()
    q, k, v = (torch.randn(B, H, P + L, D, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(P + L)
    dense = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + alibi_bias(pos, pos, slopes, W), -1) @ v
    if ring:
        r = KVRing(W)
        r.write(k[:, :, :P], v[:, :, :P], pos[:P])
        got = window_attention(q[:, :, P:], k[:, :, P:], v[:, :, P:], P, W, slopes, r)
        torch.testing.assert_close(got, dense[:, :, P:])
    else:
        got = window_attention(q[:, :, :L], k[:, :, :L], v[:, :, :L], 0, W, slopes)
        pos = torch.arange(L)
        dense = torch.softmax(q[:, :, :L] @ k[:, :, :L].transpose(-1, -2) / math.sqrt(D)
                              + alibi_bias(pos, pos, slopes, W), -1) @ v[:, :, :L]
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
    from model import flex_window_attention, window_block_mask
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
    pos = torch.arange(L)
    dense = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D) + alibi_bias(pos, pos, slopes, W), -1) @ v
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
        pos = torch.arange(L, device="cuda")
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = torch.softmax(ins[0] @ ins[1].transpose(-1, -2) / 8 + alibi_bias(pos, pos, slopes, W), -1) @ ins[2]
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


@pytest.mark.parametrize("option", [dict(ret_dim=16), dict(gca_sink=False), dict(enc_rope=True), dict(center_memory=True),
                                    dict(pool_retrieval="states"), dict(read_next=True),
                                    dict(pool_retrieval="states", read_next=True, center_memory=True), dict(pool_retrieval="tokens"),
                                    dict(pool_retrieval="tokens", read_next=True, center_memory=True)],
                         ids=["ret_dim", "no_sink", "enc_rope", "center_memory", "pool", "read_next", "pool_next_cm", "pool_tokens", "tokens_next_cm"])
def test_retrieval_options_stream_and_train(option):
    """Each option off the paper's form: a stream cut into segments computes what one forward does,
    and training reaches every parameter, the new ones too."""
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


def test_retrieval_projection_starts_as_eq1():
    """ret_dim: W_q = W_k at init with E[W^T W] = I, so the query it scores with is Eq. 1's, up to
    a random projection's error (~ sqrt(C / ret_dim)); 0 adds no parameter."""
    assert not any("ret_proj" in n for n, _ in tiny_model().named_parameters())
    proj = drt.RetrievalProjection(tiny_config(ret_dim=4096))
    assert torch.equal(proj.w_q, proj.w_k)
    q = torch.randn(3, 5, 32)
    assert rel_err(proj(q), q) < 0.2


def test_center_memory_option():
    """center_memory: GCA's keys/values come from the encoder's states minus their chunk's mean over its
    text positions, then normalised, so that a part every position shares (which dominates trained
    states) no longer shrinks what tells them apart; the landmark l (Eq. 1's key) is unchanged."""
    torch.manual_seed(0)
    c, noise = torch.randn(32, dtype=torch.float64), torch.randn(2, 3, 8, 32, dtype=torch.float64)
    x = 10 * c + 0.1 * noise  # (B, n, S, C): a shared part 100x the positions' own
    outs = {}
    for center in (False, True):
        enc = tiny_model(n_enc=0, center_memory=center).encoder
        kv, l = enc(x)
        h = enc.ln_in(x)
        h_mem = h - h[:, :, :-1].mean(2, keepdim=True) if center else h
        want = enc.kv_mem(enc.ln_f(h_mem)).unflatten(-1, (2, 4, 8)).masked_fill(enc.is_landmark, 0)
        assert rel_err(kv, want) < 1e-12 and rel_err(l, enc.ln_f(h)[:, :, -1]) < 1e-12
        k = F.normalize(kv[:, :, :-1, 0].flatten(-2), dim=-1)  # (B, n, S-1, C) text keys
        outs[center] = (k @ k.transpose(-1, -2)).mean().item()  # mean cosine between a chunk's keys
    assert outs[False] > 0.99 and outs[True] < 0.5, outs


@pytest.mark.parametrize("pool", ["states", "tokens"])
def test_pool_retrieval_and_read_next(pool):
    """pool_retrieval: Eq. 1's query is chunk t's mean text state ("states": last lower layer; "tokens":
    embedding) minus the mean of those over chunks 0..t (in pieces as at once), its key chunk j's mean
    encoder state (or embedding); read_next: GCA of chunk t+1 reads chunk j+1 for each pick j of
    landmark t, weighted by j's score."""
    x = torch.randn(2, 5, 8, 32, dtype=torch.float64)  # (B, n, S, C)
    q, total = drt.centred_chunk_means(x, None, 0)
    m = x[:, :, :-1].mean(2)
    want = torch.stack([m[:, t] - m[:, : t + 1].mean(1) for t in range(5)], 1)
    assert rel_err(q, want) < 1e-12 and rel_err(total, m.sum(1)) < 1e-12
    q1, t1 = drt.centred_chunk_means(x[:, :2], None, 0)
    q2, t2 = drt.centred_chunk_means(x[:, 2:], t1, 2)
    assert rel_err(torch.cat([q1, q2], 1), q) < 1e-12 and rel_err(t2, total) < 1e-12

    model = tiny_model(pool_retrieval=pool, read_next=True).eval()
    idx = tokens(model.config, 2, 7 * 9, seed=5)  # 9 chunks
    read = []
    gca = drt.gca
    drt.gca = lambda q, k, v, i, w: read.append(i) or gca(q, k, v, i, w)
    try:
        model.record = []
        with torch.no_grad():
            model(idx, idx)
    finally:
        drt.gca = gca
    t, picks, w = model.record[0]  # (n,), (B, n, K), (B, n, K)
    with torch.no_grad():
        e = h = model.wte(drt.insert_landmarks(idx, model.config)[0]).view(2, 9, 8, 32)  # (B, n, S, C)
        for block in model.lower:
            h = block(h.flatten(1, 2)).view(2, 9, 8, 32)
        enc = model.encoder
        mean_state = enc.ln_f(run_encoder_blocks(enc, h)[:, :, :-1].mean(2))
        l = enc.ln_f(e[:, :, :-1].mean(2)) if pool == "tokens" else mean_state  # (B, n, C)
        assert rel_err(enc(h, e[:, :, :-1].mean(2) if pool == "tokens" else None)[1], l) < 1e-12
        r = model.ret_norm[0](drt.centred_chunk_means(e if pool == "tokens" else h, None, 0)[0]) @ l.transpose(1, 2)
    r = r.masked_fill(t[None, None, :] >= t[None, :, None], float("-inf"))  # (B, n, n)
    assert torch.equal(picks[:, 3:, 0], r.argmax(-1)[:, 3:])  # Eq. 1 of the pooled query and keys
    assert torch.equal(read[0][:, 3:9], (picks[:, 2:8] + 1).minimum(t[2:8, None]))  # chunk c+1 reads j+1


def run_encoder_blocks(enc, x):
    """The chunk encoder's states before its final norm: x (B, n, S, C) -> (B, n, S, C)."""
    h = enc.ln_in(x.flatten(0, 1))
    for block in enc.blocks:
        h = block(h)
    return h.view(x.shape)


def test_gca_sink_option():
    """gca_sink=True (default): the landmark slot's key and value are zero, GCA's sink; False: a key like the others."""
    x = torch.randn(2, 3, 8, 32, dtype=torch.float64)
    for sink in (True, False):
        kv, _ = tiny_model(gca_sink=sink).encoder(x)  # (B, n, S, 2, H, D)
        assert bool((kv[:, :, -1] == 0).all()) is sink and kv[:, :, :-1].abs().sum() > 0


def test_enc_rope_tells_left_from_right():
    """The symmetric ALiBi encoder cannot tell a chunk from its mirror image (reversed in, reversed
    out); RoPE can (enc_rope=True, the release's)."""
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    for rope in (False, True):
        block = tiny_model(enc_rope=rope).encoder.blocks[0]
        mirrored = torch.allclose(block(x.flip(1)), block(x).flip(1), atol=1e-10)
        assert mirrored is not rope


def test_sink_share():
    """sink_share: with every memory key zero, each of the S keys (the sink among them) gets 1/S; the
    weights scale it; retrieval_stats divides by them."""
    B, N, S, H, D, K = 2, 3, 8, 2, 4, 2
    q = torch.randn(B, N, S, H, D, dtype=torch.float64)
    k = torch.zeros(B, 5, S, H, D, dtype=torch.float64)
    w = torch.full((B, N, K), 0.5, dtype=torch.float64)
    share, total = drt.sink_share(q, k, k, torch.randint(0, 5, (B, N, K)), w)
    assert share.item() == pytest.approx(total.item() / S) and total.item() == pytest.approx(B * N)
    k[:, :, :-1] = -10.0  # with positive queries, every other key's logit lies far below the sink's 0
    share, total = drt.sink_share(q.abs() + 0.1, k, k, torch.zeros(B, N, K, dtype=torch.long), w)
    assert share.item() / total.item() > 0.99
    t = torch.arange(3)
    stats = drt.retrieval_stats([(t, torch.zeros(1, 3, K, dtype=torch.long), torch.ones(1, 3, K) / K), ("sink", (share, total))], K)
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
        logits, loss = m(idx, idx)
        m.zero_grad()
        loss.backward()
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
    for bad, msg in [(dict(chunk_size=1), "chunk_size"), (dict(window=12), "window"), (dict(n_head=5), "n_head"),
                     (dict(landmark_id=96), "landmark_id"), (dict(topk=0), "topk"), (dict(groups=(2, 0)), "groups")]:
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
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 73, 96) and torch.isfinite(loss)
    loss.backward()
    if not groups:
        assert model.encoder is None and len(model.upper) == 0


@pytest.mark.parametrize("ce_rows", [4096, 16])
def test_loss_without_logits(ce_rows, monkeypatch):
    """return_logits=False (training) gives the same loss, and its gradients, from the targeted
    positions only, whether the rows fit one chunk of LinearCrossEntropy or take several."""
    monkeypatch.setattr(drt, "CE_ROWS", ce_rows)  # 16: 70 rows in 5 chunks, the last one partial
    model = tiny_model(dtype=torch.float64).train()
    model.config.gumbel = False
    idx = tokens(model.config, 2, 5 * 7, seed=16)
    targets = torch.roll(idx, -1, 1)
    targets[:, ::3] = -1
    logits, full = model(idx, targets)
    full.backward()
    g_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    none, loss = model(idx, targets, return_logits=False)
    loss.backward()
    assert none is None and logits.shape == (2, 35, 96)
    torch.testing.assert_close(loss, full)
    for a, b in zip(g_full, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b)


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
            loss = drt.linear_cross_entropy(x, w, targets)
        return count.n, loss

    monkeypatch.setattr(drt, "CE_ROWS", 16)  # 40 rows: 3 chunks
    x, w = torch.randn(40, 8, dtype=torch.float64), torch.randn(96, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 96, (40,))
    (n_eval, eval_loss), (n_dw, _), (n_both, loss) = matmuls(x, w, False), matmuls(x, w), matmuls(x.requires_grad_(), w)
    assert (n_eval, n_dw, n_both) == (3, 6, 9)
    torch.testing.assert_close(eval_loss, loss)
    torch.testing.assert_close(eval_loss, F.cross_entropy(x @ w.t(), targets))


def test_compile_whole_model():
    """torch.compile takes the whole training step as one graph (fullgraph: a break raises) with no
    warning from the compiler, and computes what eager computes. backend="aot_eager" traces and
    differentiates as on the GPU, without needing a C++ compiler."""
    torch._dynamo.reset()
    model = tiny_model(dtype=torch.float32).train()
    model.config.gumbel = False  # the same picks in both runs
    idx = tokens(model.config, 2, 5 * 7 + 3, seed=17)
    targets = torch.roll(idx, -1, 1)
    _, ref = model(idx, targets, return_logits=False)
    ref.backward()
    g_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, loss = torch.compile(model, backend="aot_eager", fullgraph=True)(idx, targets, return_logits=False)
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
    _, loss = torch.compile(model, backend=backend, fullgraph=True)(idx, idx, return_logits=False)
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
            _, loss = model(idx, idx, return_logits=False)
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
# streaming state (§3.2): token-by-token decoding, segmented prefill, offloaded memory, generate

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


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("groups, option", [((2,), {}), ((1, 1), {}), ((1, 1), dict(pool_retrieval="states", read_next=True)), ((1, 1), dict(pool_retrieval="tokens"))],
                         ids=["G1", "G2", "G2-pool-next", "G2-tokens"])
def test_skim_keeps_the_end(groups, option, offload):
    """A prompt skimmed (DRT.skim, memory only) in all its segments that end skim_margin tokens before its
    end gives the full stream's picks there and its logits after it; skimming up to the end does not (the
    upper layers' states reach that far)."""
    import sample

    model = tiny_model(groups=groups, **option).eval()
    idx = tokens(model.config, 1, 400, seed=21)
    margin = drt.skim_margin(model.config)
    with torch.no_grad():
        full = all_logits(model, idx)

        def stream(skim):
            state, skims = model.new_state(offload=offload), []
            model.skim = lambda *a: skims.append(DRT.skim(model, *a))
            sample.prefill(model, idx[0, :300].tolist(), state, 37, skim=skim)  # 37: segments cut chunks
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


def retrievals(record):
    """DRT.record's retrievals (chunk ids, idx, w), without the upper blocks' ("sink", ...) entries."""
    return [r for r in record if not isinstance(r[0], str)]


def stream_picks(model, idx, state=None):
    """The chunks picked at every landmark of idx (1, T), per group: [(n, K) sorted] — from one
    forward (state=None) or token by token through a StreamState."""
    S, G = model.config.chunk_size, len(model.config.groups)
    if state is None:
        model.record = []  # one (chunk ids, idx, w) per group
        model(idx)
        records, model.record = retrievals(model.record), None
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


def test_generate_odd_prompt():
    model = tiny_model(dtype=torch.float32).eval()
    for T in (1, 13, 50):
        out = model.generate(tokens(model.config, 1, T, seed=T), 10, temperature=1.0, top_k=5, prefill_segment=9)
        assert out.shape == (1, 10) and (out < model.config.landmark_id).all()


# -----------------------------------------------------------------------------
# training (train.py, configurator.py): the config block, errors, resume, fine-tuning, tasks, DDP, Ctrl-C, dying ranks

HERE = os.path.dirname(os.path.abspath(__file__))

# a DRT with every part in it (S=8: 7 tokens + landmark, W=16, K=3), on 5 chunks of 7 tokens
TINY = ["--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1", "--chunk_size=8", "--window=16",
        "--topk=3", "--vocab_size=96", "--landmark_id=95", "--block_size=35", "--batch_size=2", "--tokens_per_step=0",
        "--max_iters=6", "--eval_interval=3", "--eval_iters=2", "--log_interval=1", "--learning_rate=1e-2",
        "--min_lr=1e-3", "--warmup_frac=0.2", "--device=cpu"]


def tiny_dataset(folder, vocab=95):
    """train.bin / val.bin of random uint16 ids and the meta.json that marks them complete. The ids
    use 16 of the vocab's values, so the loss has something to learn at once."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in [("train", 5000), ("val", 1000)]:
        rng.integers(vocab - 16, vocab, n, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"tokenizer": "random", "vocab_size": vocab, "splits": {}}, f)
    return str(folder)


def tiny_args(tmp_path, run, *extra):
    return [*TINY, f"--data_dir={tiny_dataset(tmp_path / 'data')}", f"--out_dir={tmp_path / run}", *extra]


def load_ckpt(path):
    return torch.load(os.path.join(path, "ckpt.pt"), map_location="cpu")


def parse(argv):
    return configurator.configure(argv, train.DEFAULTS, train.KINDS)


def test_copy_rows(tmp_path):
    """copy_frac: that share of training rows become a random span repeated to the end (past the
    first pass every target is the token one span back), near (24-100 tokens) or past the windows'
    reach (only retrieval can copy those); the other rows are the ones copy_frac=0 draws, and
    evaluation batches stay text."""
    import random
    import types
    config, _ = parse(tiny_args(tmp_path, "run", "--block_size=300", "--batch_size=32", "--window=64"))
    reach = (config["n_lower"] + sum(config["groups"])) * config["window"]  # 2 layers x 64 positions: far > 100
    text = train.Data(types.SimpleNamespace(**config), torch.device("cpu"))
    copy = train.Data(types.SimpleNamespace(**{**config, "copy_frac": 0.5}), torch.device("cpu"))
    x0, _ = text.batch("train", random.Random(1), training=True)
    x, y = copy.batch("train", random.Random(1), training=True)
    period = [next((L for L in range(1, 200) if torch.equal(x[b, L:], x[b, :-L])), 0) for b in range(32)]
    near, far = [L for L in period if 24 <= L <= 100], [L for L in period if reach < L < 300 - 100]
    assert len(near) + len(far) == sum(L > 0 for L in period) and 8 <= len(near) + len(far) <= 24
    assert len(near) >= 3 and len(far) >= 3
    assert all(L > 0 or torch.equal(x[b], x0[b]) for b, L in enumerate(period))
    assert x.max() < copy.vocab and torch.equal(x[:, 1:], y[:, :-1])
    for split in ("train", "val"):  # evaluation never copies
        assert torch.equal(copy.batch(split, random.Random(2))[0], text.batch(split, random.Random(2))[0])


def test_config_block_and_help(capsys):
    """--help prints the hyperparameter block, every key with a why-comment, and DRTConfig's fields as
    model.py writes them (their one home: train.py does not repeat them); the shipped config files
    parse and check."""
    import inspect
    assert set(train.MODEL_KEYS) <= set(train.DEFAULTS)
    assert DRTConfig(**{k: train.DEFAULTS[k] for k in train.MODEL_KEYS}) == DRTConfig()
    assert train.main(["--help"]) == []
    out = capsys.readouterr().out
    for key in train.DEFAULTS:
        if key in train.MODEL_KEYS:
            assert re.search(rf"^    {key}: \w+ = .+  # \S", out, re.M), key
            assert not re.search(rf"^{key} = ", Path(train.__file__).read_text(), re.M), key
        else:
            assert re.search(rf"^{key} = .+  # \S", out, re.M), key
    assert inspect.getsource(DRTConfig).split("\n    def ")[0].rstrip() in out
    configs = sorted(glob.glob(os.path.join(HERE, "config", "*.py")))
    assert len(configs) >= 4
    for path in configs:
        c, explicit = parse([path])
        train.check_config(c)
        DRTConfig(**{k: c[k] for k in train.MODEL_KEYS})
        assert explicit


def test_config_files_layer():
    """Config files run in order: config/code_teacher.py changes config/code_lm.py's run into the README's
    teacher run, and the two together are a valid run."""
    c, explicit = parse([os.path.join(HERE, "config", f) for f in ("code_lm.py", "code_teacher.py")])
    train.check_config(c)
    cfg = DRTConfig(**{k: c[k] for k in train.MODEL_KEYS})
    assert (c["block_size"], cfg.n_embd, cfg.topk) == (8190, 384, 4)  # code_lm's shape stays
    assert 0 < c["teacher_iters"] < c["max_iters"] and cfg.read_next and not cfg.softmax_off_by_one
    assert {"teacher_iters", "pool_retrieval", "block_size"} <= explicit


def test_overrides():
    c, explicit = parse(["--groups=3,3", "--learning_rate=1", "--out_dir=out-x", "--dataset=passkey",
                                      "--compile=True", "--groups=()"])
    assert c["groups"] == () and c["learning_rate"] == 1.0 and type(c["learning_rate"]) is float
    assert c["out_dir"] == "out-x" and c["dataset"] == "passkey" and c["compile"] is True
    assert explicit == {"groups", "learning_rate", "out_dir", "dataset", "compile"}


@pytest.mark.parametrize("argv, message", [
    (["--lerning_rate=1e-3"], r"unknown key 'lerning_rate' \(did you mean learning_rate\?\)"),
    (["--max_iters=1.5"], r"max_iters must be of type int like its default 60000, got 1.5"),
    (["--groups=3"], r"groups must be of type tuple"),
    (["--compile=1"], r"compile must be of type bool"),
    (["--batch_size"], r"write overrides as --key=value"),
    (["--block_size=0"], r"block_size=0 must be a positive int"),
    (["config/nothing.py"], r"config file config/nothing.py not found"),
    (["--dataset=passkey", "--copy_frac=0.5"], r"copy_frac and repeat_frac mix rows into a text dataset; --dataset=passkey"),
    (["--device=tpu"], r"^device='tpu' must be 'auto', 'cpu', 'cuda' or 'cuda:N'$"),
    (["--dataset=passkey,nope"], r"^dataset='passkey,nope': a comma list is of synthetic tasks, each one of passkey, "),
    (["--learning_rate=-1"], r"^learning_rate=-1.0 must be >= 0$"),
    (["--max_iters=-5"], r"^max_iters=-5 must be a positive int$"),  # the one wrong value, not stop_iter's range too
], ids=["unknown-key", "float-for-int", "int-for-tuple", "int-for-bool", "no-value", "block-size", "no-file",
        "copy-rows-in-tasks", "device", "unknown-task", "negative-lr", "negative-iters"])
def test_config_errors(argv, message):
    with pytest.raises(train.ConfigError, match=message):
        train.main(argv)


def test_config_file_unknown_key(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import math\nbatch_size = 2\nn_emdb = 64\n")
    with pytest.raises(train.ConfigError, match=r"bad.py: unknown key 'n_emdb' \(did you mean n_embd\?\)"):
        train.main([str(path)])
    path.write_text("batch_size = 2\nn_embd = (64\n")
    with pytest.raises(train.ConfigError, match=r"^config file .*bad.py does not run \(SyntaxError: .*line 2.*\): fix it$"):
        train.main([str(path)])


def test_data_checked_before_anything(tmp_path):
    """Ids past the vocabulary in val.bin (sampled from its first to its last token): one line, before
    a model is built or out_dir made."""
    data = Path(tiny_dataset(tmp_path / "data"))
    (data / "val.bin").write_bytes((data / "val.bin").read_bytes()[:-2] + np.uint16(60000).tobytes())
    with pytest.raises(train.ConfigError, match=r"val.bin holds token id 60000, outside vocab_size=95 of its "
                                                r"meta.json: prepare the data again"):
        train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()
    train.main(tiny_args(tmp_path, "out", "--max_iters=1", "--eval_iters=1"))  # the data as made: it trains


def test_data_sizes_checked_against_meta(tmp_path):
    """A .bin cut short (its meta.json counts more tokens) or of an odd byte count: one line naming the
    file, before anything is built."""
    data = Path(tiny_dataset(tmp_path / "data"))
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"] = {"train": {"tokens": 5000}, "val": {"tokens": 1000}}
    (data / "meta.json").write_text(json.dumps(meta))
    train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'ok'}", "--max_iters=1", "--eval_iters=1"])  # as listed: it trains
    (data / "train.bin").write_bytes((data / "train.bin").read_bytes()[:8000])
    with pytest.raises(train.ConfigError, match=r"train.bin has 8,000 bytes, 5,000 uint16 tokens by its meta.json: prepare"):
        train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    (data / "train.bin").write_bytes((data / "train.bin").read_bytes() + b"x")
    del meta["splits"]["train"]
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(train.ConfigError, match=r"train.bin has 8,001 bytes, not a whole number of uint16 tokens"):
        train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_setup_errors(tmp_path):
    with pytest.raises(train.ConfigError, match=r"meta.json not found: prepare the data first, e.g. python prepare_pg19.py"):
        train.main([*TINY, f"--data_dir={tmp_path / 'nothing'}", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(train.ConfigError, match=r"meta.json not found: prepare the data first, e.g. python prepare_code.py"):
        train.main([*TINY, "--dataset=code", f"--data_dir={tmp_path / 'nothing'}", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(train.ConfigError, match=r"val.bin has 1,000 tokens, fewer than block_size\+1=1,009; lower --block_size"):
        train.main(tiny_args(tmp_path, "out", "--block_size=1008"))
    with pytest.raises(train.ConfigError, match=r"tokens_per_step=100 is not a multiple of batch_size\*block_size\*GPUs"):
        train.main(tiny_args(tmp_path, "out", "--tokens_per_step=100"))
    with pytest.raises(train.ConfigError, match=r"gives fewer than 3 chunks"):
        train.main(tiny_args(tmp_path, "out", "--block_size=14"))
    with pytest.raises(train.ConfigError, match=r"landmark_id=95 must lie above them"):
        train.main([*TINY, f"--data_dir={tiny_dataset(tmp_path / 'big', vocab=200)}", f"--out_dir={tmp_path / 'out'}"])
    (tmp_path / "a_file").write_text("")
    with pytest.raises(train.ConfigError, match=r"out_dir .*a_file is a file, or inside one: pass --out_dir="):
        train.main(tiny_args(tmp_path, "a_file"))
    with pytest.raises(train.ConfigError, match=r"out_dir .*a_file/out is a file, or inside one"):
        train.main(tiny_args(tmp_path, "a_file/out"))
    with pytest.raises(train.ConfigError, match=r"no checkpoint at .*ckpt.pt: use --init_from=scratch"):
        train.main(tiny_args(tmp_path, "empty", "--init_from=resume"))


def test_progress(tmp_path, monkeypatch, capsys):
    """A step or an evaluation that runs long says how far it got (here: 'long' made 0 s)."""
    args = tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--tokens_per_step=140")
    train.main(args)
    assert "micro-batch" not in capsys.readouterr().out  # a tiny run: quiet
    monkeypatch.setattr(train, "PROGRESS_AFTER", -1)
    train.main([*args, "--overwrite=True"])
    out = capsys.readouterr().out
    assert re.search(r"^step 1: micro-batch 1/2 done after 0m\d\ds$", out, re.M)
    assert re.search(r"^eval val: micro-batch 2/2 done after 0m\d\ds$", out, re.M)


def test_resume_is_exact(tmp_path):
    """6 steps in one go == 3 steps, stop, resume, 3 more: the same losses and weights, bit for
    bit (data windows and Gumbel noise are functions of (seed, step, micro-batch))."""
    full = train.main(tiny_args(tmp_path, "full", "--always_save_checkpoint=True"))
    first = train.main(tiny_args(tmp_path, "split", "--stop_iter=3"))
    rest = train.main(tiny_args(tmp_path, "split", "--init_from=resume"))
    assert [it for it, _ in full] == [1, 2, 3, 4, 5, 6] and full[-1][1] < full[0][1]
    assert first + rest == full
    a, b = load_ckpt(tmp_path / "full"), load_ckpt(tmp_path / "split")
    assert a["iter_num"] == b["iter_num"] == 6
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    with open(tmp_path / "split" / "ckpt.json") as f:  # readable without torch
        summary = json.load(f)
    assert summary["iter_num"] == 6 and summary["model_args"]["groups"] == [1] and summary["config"]["block_size"] == 35


def test_resume_restores_config(tmp_path, capsys):
    """--init_from=resume with nothing but out_dir continues with the checkpoint's config (data,
    model, schedule, device): a run in pieces equals one run. Keys given now are applied and
    printed; stop_iter says what this command does, so it is not restored."""
    full = train.main(tiny_args(tmp_path, "full", "--max_iters=4", "--eval_interval=2"))
    first = train.main(tiny_args(tmp_path, "split", "--max_iters=4", "--eval_interval=2", "--stop_iter=2"))
    capsys.readouterr()
    rest = train.main([f"--out_dir={tmp_path / 'split'}", "--init_from=resume"])
    assert "resume:" not in capsys.readouterr().out
    assert first + rest == full and [it for it, _ in full] == [1, 2, 3, 4]
    more = train.main([f"--out_dir={tmp_path / 'split'}", "--init_from=resume", "--max_iters=5", "--log_interval=1"])
    out = capsys.readouterr().out
    assert [it for it, _ in more] == [5]
    assert re.findall(r"^resume: .*$", out, re.M) == ["resume: max_iters 4 -> 5 (given now)"]
    c = load_ckpt(tmp_path / "split")["config"]
    assert c["max_iters"] == 5 and c["block_size"] == 35 and c["n_embd"] == 32 and c["data_dir"] == str(tmp_path / "data")


def test_resume_conflicting_model(tmp_path):
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))
    with pytest.raises(train.ConfigError, match=r"ckpt.pt is at step 1, past max_iters=0: pass --max_iters above 1"):
        train.main([f"--out_dir={tmp_path / 'run'}", "--init_from=resume", "--max_iters=0"])
    with pytest.raises(train.ConfigError, match=r"has n_embd=32, the config asks 64: drop --n_embd .* or start a new out_dir"):
        train.main(tiny_args(tmp_path, "run", "--init_from=resume", "--n_embd=64", "--max_iters=2"))
    # model keys left out are taken from the checkpoint
    no_model_keys = [a for a in tiny_args(tmp_path, "run", "--init_from=resume", "--max_iters=2")
                     if a.split("=")[0][2:] not in train.MODEL_KEYS]
    assert [it for it, _ in train.main(no_model_keys)] == [2]


def test_finetune_from_checkpoint(tmp_path):
    """init_from=<another run>: that run's weights and architecture, a fresh optimizer and schedule
    from step 0, at another block_size (e.g. PG19 weights, then a synthetic task)."""
    train.main(tiny_args(tmp_path, "base", "--max_iters=3", "--eval_interval=3"))
    base = load_ckpt(tmp_path / "base")
    no_model_keys = [a for a in tiny_args(tmp_path, "ft", f"--init_from={tmp_path / 'base'}", "--block_size=70",
                                          "--max_iters=1", "--eval_interval=1", "--learning_rate=0", "--min_lr=0")
                     if a.split("=")[0][2:] not in train.MODEL_KEYS]
    hist = train.main(no_model_keys)
    assert [it for it, _ in hist] == [1]  # counts from step 0, not from the base run's 3
    ft = load_ckpt(tmp_path / "ft")
    assert ft["iter_num"] == 1 and ft["model_args"] == base["model_args"] and ft["config"]["block_size"] == 70
    for name, t in base["model"].items():  # learning rate 0: the weights are the base run's, untouched
        assert torch.equal(t, ft["model"][name]), name
    assert ft["optimizer"]["state"][0]["step"] == 1  # a fresh AdamW, not the base run's (step 3)
    with pytest.raises(train.ConfigError, match=r"init_from='.*nowhere': no checkpoint there"):
        train.main(tiny_args(tmp_path, "ft2", f"--init_from={tmp_path / 'nowhere'}"))
    with pytest.raises(train.ConfigError, match=r"base/ckpt.pt at step 3 exists: continue that run with --init_from=resume"):
        train.main(tiny_args(tmp_path, "base", f"--init_from={tmp_path / 'base'}"))  # its own checkpoint
    with pytest.raises(train.ConfigError, match=rf"checkpoint {re.escape(str(tmp_path / 'base' / 'ckpt.pt'))} has "
                                                r"n_embd=32, the config asks 64"):  # the file it read, not ft3's
        train.main(tiny_args(tmp_path, "ft3", f"--init_from={tmp_path / 'base'}", "--n_embd=64"))


def test_out_dir_with_a_checkpoint(tmp_path):
    """A run from scratch or a fine-tune into an out_dir that holds a checkpoint stops before it
    changes anything, unless told --overwrite=True; the last step is saved even when val never
    improved, so out_dir ends up holding this run and not the one it replaced."""
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))
    train.main(tiny_args(tmp_path, "base", "--max_iters=1", "--eval_interval=1", "--eval_iters=1", "--seed=1"))
    before = (tmp_path / "run" / "ckpt.pt").read_bytes()
    for init in ("scratch", tmp_path / "base"):
        with pytest.raises(train.ConfigError, match=r"run/ckpt.pt at step 1 exists: continue that run with "
                                                    r"--init_from=resume, replace it with --overwrite=True"):
            train.main(tiny_args(tmp_path, "run", f"--init_from={init}", "--max_iters=2"))
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before
    # learning rate 0: val at step 2 equals val at step 0, never better; always_save_checkpoint=False saves the last step
    train.main(tiny_args(tmp_path, "run", "--overwrite=True", "--always_save_checkpoint=False", "--max_iters=2",
                         "--eval_interval=1", "--learning_rate=0", "--min_lr=0"))
    ckpt = load_ckpt(tmp_path / "run")
    assert ckpt["iter_num"] == 2 and ckpt["config"]["learning_rate"] == 0
    assert json.loads((tmp_path / "run" / "ckpt.json").read_text())["val_loss"] == ckpt["best_val_loss"]


def test_bad_checkpoint_files(tmp_path):
    """A truncated, foreign or not-resumable ckpt.pt: one line that says so, for resume and fine-tune."""
    import argparse
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))
    good = (tmp_path / "run" / "ckpt.pt").read_bytes()
    os.makedirs(tmp_path / "bad")
    bad = tmp_path / "bad" / "ckpt.pt"
    cases = [
        (good[: len(good) // 2], r"is truncated or not a torch checkpoint"),
        (b"", r"is truncated or not a torch checkpoint"),
        ({"model": argparse.Namespace(), "model_args": {}}, r"holds Python objects a train.py checkpoint never has"),
        ({"weight": torch.zeros(2)}, r"is not a train.py checkpoint \(no model_args/model\)"),
    ]
    for content, message in cases:
        if isinstance(content, bytes):
            bad.write_bytes(content)
        else:
            torch.save(content, bad)
        with pytest.raises(common.CheckpointError, match=message + r".*: start over with --init_from=scratch") as e:
            train.main(tiny_args(tmp_path, "bad", "--init_from=resume"))
        assert "\n" not in str(e.value)
        with pytest.raises(common.CheckpointError, match=message + r".*: point --init_from at a train.py ckpt.pt"):
            train.main(tiny_args(tmp_path, "ft", f"--init_from={bad}"))
    weights = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    weights.pop("optimizer")  # weights alone: they fine-tune, but do not resume
    torch.save(weights, bad)
    with pytest.raises(common.CheckpointError, match=r"holds weights alone .*cannot be resumed: fine-tune from it"):
        train.main(tiny_args(tmp_path, "bad", "--init_from=resume", "--max_iters=2"))
    train.main(tiny_args(tmp_path, "ft2", f"--init_from={bad}", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))


def test_passkey_task(tmp_path, monkeypatch):
    _tokenizer_or_skip(monkeypatch)
    hist = train.main(["--dataset=passkey", "--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1",
                       "--chunk_size=8", "--window=16", "--topk=3", "--block_size=70", "--batch_size=2", "--tokens_per_step=0",
                       "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--log_interval=1", "--device=cpu",
                       f"--out_dir={tmp_path / 'out'}"])
    assert [it for it, _ in hist] == [1, 2] and all(np.isfinite(loss) for _, loss in hist)
    assert load_ckpt(tmp_path / "out")["model_args"]["vocab_size"] == 50304  # GPT-2's vocabulary
    with pytest.raises(train.ConfigError, match=r"needles from token 490: raise --block_size or lower --task_min_depth"):
        train.main(["--dataset=passkey", "--block_size=504", "--task_min_depth=490", "--device=cpu",
                    f"--out_dir={tmp_path / 'x'}"])
    with pytest.raises(train.ConfigError, match=r"task_min_depth=-1 must be >= 0"):
        train.main(["--task_min_depth=-1"])
    with pytest.raises(train.ConfigError, match=r"task_names='words' must be one of pool, twenty"):
        train.main(["--task_names=words"])


def test_task_keys_and_templates(tmp_path, monkeypatch):
    """--task_keys, --task_templates and --task_digits reach the training rows (12 keys in the held-out
    phrasing here, ranges and a mix through get_batch); bad values are one-line ConfigErrors."""
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    rows, get_batch = [], tasks.get_batch

    def spy(*a, **kw):  # the rows train.py trains and evaluates on
        x, y = get_batch(*a, **kw)
        rows.append(x)
        return x, y

    monkeypatch.setattr(tasks, "get_batch", spy)
    train.main(["--dataset=multikey", "--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1",
                "--chunk_size=8", "--window=16", "--topk=3", "--block_size=250", "--batch_size=2", "--tokens_per_step=0",
                "--max_iters=1", "--eval_interval=1", "--eval_iters=1", "--log_interval=1", "--device=cpu",
                "--task_keys=12", "--task_templates=code", f"--out_dir={tmp_path / 'out'}"])
    texts = [enc.decode(r.tolist()) for x in rows for r in x]
    needles = [re.findall(r"The secret code for \w+ is \d+\.", t.split("What is")[0]) for t in texts]  # before the question
    assert texts and all(len(n) == 12 for n in needles)
    x, _ = get_batch("multikey", 24, 400, random.Random(0), enc, keys=(2, 16), templates=("key", "number"))
    counts = [len(re.findall(r" (?:pass key|magic number) of \w+ is \d+\.", enc.decode(r.tolist()).split("What is")[0]))
              for r in x]
    assert min(counts) >= 2 and max(counts) <= 16 and len(set(counts)) > 3
    assert {"pass key", "magic number"} == {re.search(r"What is the (pass key|magic number)", enc.decode(r.tolist()))[1]
                                            for r in x}
    x, y = get_batch(["passkey", "multikey"], 32, 400, random.Random(1), enc, keys=(2, 16), templates=("many",),
                     answer_only=True)
    nouns = set()
    for r, t in zip(x, y):
        text = enc.decode(r.tolist())
        noun, named = re.search(r"What is the ([\w ]+?)((?: (?:of|for) \w+)?)\? The \1\2 is", text).groups()
        key = re.search(rf"The {noun}{named} is (\d+)\.", text.split("What is")[0])[1]  # its needle, before the question
        assert enc.decode(t[t >= 0].tolist()) == f" {key}{tasks.ANSWER_END}"  # the loss: the asked key, then the stop
        assert "secret" not in text and "code" not in text  # the held-out phrasing's words never appear
        nouns.add(noun)
    assert nouns <= set(tasks.NOUNS) and len(nouns) >= 10
    x, y = get_batch(["passkey", "multikey"], 32, 400, random.Random(2), enc, keys=(2, 16), digits=(3, 7),
                     answer_only=True)
    sizes = [len(enc.decode(t[t >= 0].tolist()).strip().rstrip(tasks.ANSWER_END.strip())) for t in y]  # the asked key
    assert set(sizes) == {3, 4, 5, 6, 7}
    for bad, message in [("--task_keys=1", r"task_keys='1' must be N or A-B, 2 <= A <= B <= 16"),
                         ("--task_keys=8-3", r"task_keys='8-3'"), ("--task_digits=2-7", r"task_digits='2-7' must be"),
                         ("--task_templates=key,nope", r"task_templates='key,nope' must be a comma list of key, number")]:
        with pytest.raises(train.ConfigError, match=message):
            train.main([bad])


def test_word_pool(monkeypatch):
    """--task_names=pool: multi-key trains on thousands of one-token words, none of them a name any
    test asks about (NAMES, UNSEEN_NAMES), so only matching names can pass a test."""
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    pool = tasks.word_pool(enc)
    assert len(pool) > 10000 and len(set(pool)) == len(pool)
    assert not set(pool) & (set(tasks.NAMES) | set(tasks.UNSEEN_NAMES))
    assert all(len(enc.encode_ordinary(" " + w)) == 1 and w.isalpha() for w in random.Random(0).sample(pool, 500))
    x, _ = tasks.get_batch("multikey", 8, 300, random.Random(0), enc, names=pool)
    rows = [enc.decode(row.tolist()) for row in x]
    assert all(set(re.findall(r"pass key of (\w+)", row)) <= set(pool) for row in rows)
    assert len({re.search(r"pass key of (\w+)\?", row).group(1) for row in rows}) == 8  # asked: 8 draws from 12K


def test_two_stage_recipe(tmp_path, monkeypatch, capsys):
    """The passkey recipe's plumbing at toy size: config/passkey_pretrain.py on text and copy rows, then
    config/passkey_finetune.py from it (a task mix, a real-text haystack, aligned questions, pool names),
    then sample.py's test table on the result."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    data = tiny_dataset(tmp_path / "pg19", vocab=50257)  # GPT-2 ids, as prepare_pg19.py writes them
    small = ["--n_embd=32", "--n_head=2", "--batch_size=2", "--block_size=250", "--max_iters=2", "--eval_interval=2",
             "--eval_iters=1", "--log_interval=1", "--device=cpu"]
    pre, ft = tmp_path / "pre", tmp_path / "ft"
    train.main([os.path.join(HERE, "config/passkey_pretrain.py"), *small, f"--data_dir={data}", f"--out_dir={pre}"])
    hist = train.main([os.path.join(HERE, "config/passkey_finetune.py"), *small[2:], f"--init_from={pre}",
                       f"--out_dir={ft}", f"--task_haystack={data}/train.bin", "--task_min_depth=40",
                       "--task_names=pool", "--block_size=504"])  # 16 keys need ~400 tokens
    assert [it for it, _ in hist] == [1, 2]
    a, b = load_ckpt(pre), load_ckpt(ft)
    assert a["model_args"] == b["model_args"] and b["model_args"]["n_embd"] == 32  # the architecture of stage 1
    assert a["config"]["copy_frac"] == 0.5  # stage 1 learns copying on rows of random tokens
    assert b["config"]["task_align"] and b["config"]["dataset"] == "passkey,multikey"  # one model, 2 tasks
    assert b["config"]["task_names"] == "pool" and b["config"]["task_keys"] == "2-16"  # more keys than top-k
    assert b["config"]["task_templates"] == "key,number,id"  # "code" held out
    capsys.readouterr()
    sample.main([f"--out_dir={ft}", "--passkey", "--lengths=500,2K", "--samples_per_length=2", "--device=cpu",
                 f"--haystack={data}/val.bin"])
    out = capsys.readouterr().out
    assert "question aligned to a chunk" in out and len(re.findall(r"^\s+(500|2K)\s+2\s+\d+\.\d%", out, re.M)) == 2


def test_ddp_matches_one_process(tmp_path):
    """torchrun, 2 CPU processes (gloo), batch 1 each == one process, batch 1, 2 accumulation steps:
    the same global batch and noise. Two steps, so a rank whose weights drifted after step 1 would
    change step 2's averaged gradient and the rank-0 checkpoint. Only rank 0 prints and saves."""
    extra = ["--batch_size=1", f"--tokens_per_step={2 * 35}", "--max_iters=2", "--eval_interval=2"]
    single = train.main(tiny_args(tmp_path, "single", *extra))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *tiny_args(tmp_path, "ddp", *extra)]
    r = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "2 rank(s) x 1 accum" in r.stdout
    ddp = [(int(m[1]), float(m[2])) for m in re.finditer(r"^iter (\d+)/2 \| loss ([\d.]+)", r.stdout, re.M)]
    assert [it for it, _ in ddp] == [1, 2]  # printed once: by rank 0 alone
    for (_, a), (_, b) in zip(ddp, single):
        assert a == pytest.approx(b, rel=1e-4)  # the log prints 4 decimals
    a, b = load_ckpt(tmp_path / "ddp"), load_ckpt(tmp_path / "single")
    assert a["iter_num"] == b["iter_num"] == 2
    for name, t in a["model"].items():
        torch.testing.assert_close(t, b["model"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_timeout(tmp_path, monkeypatch):
    """The process group waits ddp_timeout seconds for a hung rank (torch's default: 10 min for NCCL,
    30 for gloo). By hand: a stopped rank and --ddp_timeout=3 end in gloo's 'Timed out waiting 3000ms'."""
    seen = {}

    def init_process_group(backend, **kw):
        seen.update(kw, backend=backend)
        raise train.ConfigError("enough")

    monkeypatch.setattr(train.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(train.ConfigError, match="enough"):
        train.main(tiny_args(tmp_path, "run", "--ddp_timeout=7"))
    assert seen["backend"] == "gloo" and seen["timeout"].total_seconds() == 7


def start_run(cmd, pid_files=(), timeout=90):
    """Popen cmd in a session of its own (so a signal can go to the group, as a terminal's Ctrl-C
    does), killed after timeout seconds whatever happens, so a hung run cannot hang the tests."""
    proc = subprocess.Popen(cmd, cwd=HERE, env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "6"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc.pid_files = pid_files
    proc.killer = threading.Timer(timeout, end_run, [proc])
    proc.killer.daemon = True
    proc.killer.start()
    return proc


def end_run(proc):
    """Kill what is left of proc's session, and of the sessions of torchrun's workers (pid_files)."""
    proc.killer.cancel()
    for pid in [proc.pid] + [int(f.read_text()) for f in proc.pid_files if f.exists()]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_until(stream, pattern):
    """The lines of stream up to the first that matches pattern (all of them if none does)."""
    lines = []
    for line in stream:
        lines.append(line)
        if re.match(pattern, line):
            break
    return "".join(lines)


def interrupt_after(cmd, pattern):
    """Run cmd, send it one Ctrl-C once its stdout shows pattern -> (exit status, stdout, stderr)."""
    proc = start_run(cmd)
    try:
        read_until(proc.stdout, pattern)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    return proc.returncode, out, err


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ctrl_c_saves_and_resumes(tmp_path):
    """Ctrl-C: the run stops at the next step boundary, saves, exits 130 and prints the command that
    continues it, which does. A second Ctrl-C, a second or more later, stops at once."""
    run = tmp_path / "run"
    rc, out, err = interrupt_after([sys.executable, "train.py", *tiny_args(tmp_path, "run", "--max_iters=100000",
                                                                            "--eval_interval=100000")], r"iter 1/")
    assert rc == 130 and "Traceback" not in err, err
    m = re.search(r"^train.py: interrupted: saved (.*) at step (\d+); continue with: (python train.py .* --init_from=resume)$",
                  err, re.M)
    assert m and m[1] == str(run / "ckpt.pt"), err
    step = int(m[2])
    assert step >= 1 and load_ckpt(run)["iter_num"] == step and f"saved {run / 'ckpt.pt'} at step {step}" in out
    again = shlex.split(m[3])[2:]
    assert [it for it, _ in train.main([*again, f"--max_iters={step + 2}"])] == [step + 1, step + 2]
    # the second Ctrl-C: inside a long evaluation, which the first one waits for
    proc = start_run([sys.executable, "train.py", *tiny_args(tmp_path, "run2", "--eval_iters=1000000")])
    try:
        read_until(proc.stdout, r"DRT groups")
        proc.send_signal(signal.SIGINT)
        threading.Event().wait(1.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip() == "train.py: interrupted: stopped at once; no checkpoint saved" and not os.path.exists(tmp_path / "run2" / "ckpt.pt")
    # one Ctrl-C inside the first evaluation: no step was taken, so nothing is saved (a step-0
    # checkpoint would only make the next run of the same command refuse to overwrite it)
    rc, out, err = interrupt_after([sys.executable, "train.py", *tiny_args(tmp_path, "run3", "--eval_iters=30")],
                                   r"DRT groups")
    assert rc == 130 and err.strip() == "train.py: interrupted before the first step: nothing saved", err
    assert not os.path.exists(tmp_path / "run3" / "ckpt.pt")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ctrl_c_after_a_library_took_sigint(tmp_path):
    """A handler installed during the run over ours (on the GPU: LLVM's, at Triton's first compile; while it
    runs SIGINT has its default action) is replaced at the next step boundary: Ctrl-C still saves and says so,
    instead of killing the run silently."""
    steal = tmp_path / "steal.py"  # a config file (Python): at the first forward, SIGINT gets its default action
    steal.write_text("import signal as _signal\nimport model as _model\n_forward = _model.DRT.forward\n"
                     "def _first(self, *a, **k):\n    _model.DRT.forward = _forward\n"
                     "    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)\n    return _forward(self, *a, **k)\n"
                     "_model.DRT.forward = _first\n")
    rc, out, err = interrupt_after([sys.executable, "train.py", str(steal),
                                    *tiny_args(tmp_path, "run", "--max_iters=100000", "--eval_interval=100000")], r"iter 3/")
    assert rc == 130, (rc, err)  # -2: killed by SIGINT, nothing printed or saved
    m = re.search(r"^train.py: interrupted: saved .* at step (\d+); continue with: ", err, re.M)
    assert m and load_ckpt(tmp_path / "run")["iter_num"] == int(m[1]) >= 3, err


def torchrun_tiny(tmp_path, run, *extra):
    """train.py under torchrun, 2 CPU processes (gloo), batch 1 each, running long enough to be
    interrupted; each rank writes its pid to tmp_path/pid<rank> from a config file (config files are Python)."""
    pids = tmp_path / "pids.py"
    pids.write_text(f"import os as _os\nwith open({str(tmp_path)!r} + '/pid' + _os.environ.get('RANK', 'x'), 'w') as _f:\n"
                    f"    _f.write(str(_os.getpid()))\n")
    args = tiny_args(tmp_path, run, "--batch_size=1", f"--tokens_per_step={2 * 35}", "--max_iters=100000", *extra)
    return start_run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                      str(pids), *args], pid_files=[tmp_path / "pid0", tmp_path / "pid1"])


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ddp_ctrl_c(tmp_path):
    """Ctrl-C under torchrun (which forwards it to each worker): all ranks stop at the same step,
    rank 0 saves, and says once how to continue."""
    proc = torchrun_tiny(tmp_path, "run", "--eval_interval=100000")
    try:
        read_until(proc.stdout, r"iter 3/")
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    m = re.findall(r"^train.py: interrupted: saved (.*) at step (\d+); continue with: torchrun <as before> train.py "
                   r".* --init_from=resume$", err, re.M)
    assert len(m) == 1 and m[0][0] == str(tmp_path / "run" / "ckpt.pt"), err[-3000:]
    assert load_ckpt(tmp_path / "run")["iter_num"] == int(m[0][1]) and "[rank" not in err  # no rank's traceback


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ddp_rank_dies(tmp_path):
    """One rank is killed mid-run: the other stops with one line naming the last checkpoint (whole:
    saves are atomic), and --init_from=resume continues from it (here on one process)."""
    proc = torchrun_tiny(tmp_path, "run", "--eval_interval=2")
    try:
        read_until(proc.stdout, r"iter 5/")
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    assert proc.returncode != 0
    m = re.search(r"^train.py: rank 0: stopped by SIGTERM \(another rank failed\?\); the last checkpoint is (.*) at step "
                  r"(\d+): resume with --init_from=resume$", err, re.M)
    assert m and m[1] == str(tmp_path / "run" / "ckpt.pt"), err[-3000:]
    assert "[rank0]" not in err  # no traceback of rank 0's
    step = int(m[2])
    assert step >= 4 and load_ckpt(tmp_path / "run")["iter_num"] == step
    hist = train.main([f"--out_dir={tmp_path / 'run'}", "--init_from=resume", f"--max_iters={step + 2}"])
    assert [it for it, _ in hist] == [step + 1, step + 2]


# -----------------------------------------------------------------------------
# long-context tasks (tasks.py) and sampling (sample.py): prompts, scoring, the test table, arguments


@pytest.mark.parametrize("task", ["passkey", "multikey", "vartrack"])
def test_tasks(task, monkeypatch):
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    rng = random.Random(task)
    for length in (200, 333, 1000):
        prompt, answer = tasks.make_example(task, length, rng, enc)
        assert len(prompt) == length and prompt.dtype == np.int64
        text, want = enc.decode(prompt.tolist()), enc.decode(answer).strip()
        assert want.isdigit() and text.count(want) >= 1  # the answer is in the haystack
        assert tasks.score(answer + enc.encode_ordinary(". The"), answer, enc) == 1
        assert tasks.score(answer + enc.encode_ordinary("123. The"), answer, enc) == 0  # the number goes on: wrong
        assert tasks.score(enc.encode_ordinary(" 1" + want), answer, enc) == 0
    for answer_only in (True, False):
        x, y = tasks.get_batch(task, 3, 256, rng, enc, answer_only=answer_only)
        assert x.shape == y.shape == (3, 256)
        if not answer_only:
            assert torch.equal(y[:, :-1], x[:, 1:]) and (y != -1).all()  # the next token everywhere
            continue
        for b in range(3):  # the loss on the answer and the full stop that ends it, then filler to the row's end
            on = (y[b] != -1).nonzero().squeeze(1)
            assert 2 <= len(on) <= tasks.MAX_ANSWER and torch.equal(on, torch.arange(on[0], on[0] + len(on)))
            said = enc.decode(x[b, on[0] + 1 : on[-1] + 1].tolist() + [y[b, on[-1]].item()]).strip()
            assert said.endswith(tasks.ANSWER_END) and said[:-1].isdigit(), said
            assert enc.decode(x[b, : on[0] + 1].tolist()).endswith(" is")  # the question's last token
    with pytest.raises(ValueError, match="too short"):
        tasks.make_example(task, 20, rng, enc)
    for _ in range(5):  # min_depth: no needle before that token (training keeps the first chunks clear)
        prompt, answer = tasks.make_example(task, 1000, rng, enc, min_depth=600)
        assert len(prompt) == 1000 and enc.decode(answer).strip() in enc.decode(prompt[600:].tolist())
        assert not any(enc.decode(prompt[:600].tolist()).count(w) for w in ("pass key", "VAR"))
    with pytest.raises(ValueError, match="needles from token 990"):
        tasks.make_example(task, 1000, rng, enc, min_depth=990)


def test_vartrack_needs_two_hops(monkeypatch):
    """vartrack holds two chains, each assigned before it is copied; the asked one's number is the
    answer and the other's is not, so copying "the number" cannot pass."""
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    rng, first = random.Random(0), 0
    for _ in range(20):
        prompt, answer = tasks.make_example("vartrack", 400, rng, enc)
        text, want = enc.decode(prompt.tolist()), enc.decode(answer).strip()
        sets = re.findall(r"VAR (\w+) = (\w+)\.", text)
        values = {name: v for name, v in sets if v.isdigit()}
        copies = {name: src for name, src in sets if not src.isdigit()}
        asked = re.search(r"value of VAR (\w+) is$", text).group(1)
        assert len(values) == len(copies) == 2 and len(set(values.values())) == 2
        assert values[copies[asked]] == want  # two hops: asked -> its source -> the number
        for name, src in copies.items():  # a variable is assigned before it is copied
            assert text.index(f"VAR {src} = ") < text.index(f"VAR {name} = ")
        first += [n for n, _ in sets].index(copies[asked]) == 0
    assert 0 < first < 20  # either chain comes first


def test_multikey_unseen_names(tmp_path, monkeypatch, capsys):
    """--unseen_names: multi-key's test prompts name only words no training prompt holds, with the
    same keys as the usual prompts (the same random draws): a model that matches names scores alike
    on both, one that has learned the twenty names of training does not."""
    import random

    import sample
    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    assert len(tasks.UNSEEN_NAMES) == len(set(tasks.UNSEEN_NAMES)) == len(tasks.NAMES)
    assert not set(tasks.UNSEEN_NAMES) & set(tasks.NAMES)
    for i in range(10):
        seen, _ = tasks.make_example("multikey", 500, random.Random(i), enc)
        unseen, answer = tasks.make_example("multikey", 500, random.Random(i), enc, names=tasks.UNSEEN_NAMES)
        text = enc.decode(unseen.tolist())
        keys = dict(re.findall(r"pass key of (\w+) is (\d+)\.", text))
        asked = re.search(r"pass key of (\w+) is$", text).group(1)
        assert len(keys) == 4 and set(keys) <= set(tasks.UNSEEN_NAMES) and keys[asked] == enc.decode(answer).strip()
        assert not any(re.search(rf"\b{name}\b", text) for name in tasks.NAMES)
        assert sorted(keys.values()) == sorted(re.findall(r"is (\d+)\. Remember", enc.decode(seen.tolist())))
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    sample.main([f"--ckpt={ckpt}", "--multikey", "--unseen_names", "--lengths=300", "--samples_per_length=2",
                 "--device=cpu"])
    assert re.search(r"^multikey, retrieval learned: .*4 keys, names unseen in training\n(.*\n){2}\s+300\s+2\s+\d+\.\d%",
                     capsys.readouterr().out, re.M)


def test_question_alignment(monkeypatch):
    """align=T: the prompt's last token (" is") opens a chunk, so the landmark before it, whose
    retrieval serves the answer, has read the whole question; and training rows keep it."""
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    model = DRT(tiny_config(vocab_size=50304, landmark_id=50257)).eval()  # chunks of 7 text tokens
    T = model.config.chunk_size - 1
    for task in tasks.TASKS:
        for length in (300, 301, 305, 1000):
            prompt, _ = tasks.make_example(task, length, random.Random(length), enc, align=T)
            assert length - T < len(prompt) <= length and (len(prompt) - 1) % T == 0
            assert enc.decode(prompt[-1:].tolist()) == " is"
            state = model.new_state()
            with torch.no_grad():
                model(torch.from_numpy(prompt[None, :-1]), state=state)
            assert state.n % model.config.chunk_size == 0  # the question's chunk is closed: its landmark is in
    x, y = tasks.get_batch(list(tasks.TASKS), 6, 20 * T, random.Random(0), enc, answer_only=True, align=T)
    first = (y != -1).int().argmax(1)  # the position of " is", which predicts the answer
    assert ((first % T) == 0).all()


def old_prompt(task, length, rng, enc, align):
    """make_example as it was before the test variants, frozen (passkey, multi-key): the training prompts."""
    import tasks
    if task == "passkey":
        key = str(rng.randrange(10000, 100000))
        needles = [f" The pass key is {key}. Remember it. {key} is the pass key."]
        question, answer = " What is the pass key? The pass key is", f" {key}"
    else:
        names = rng.sample(tasks.NAMES, 4)
        keys = [str(rng.randrange(10000, 100000)) for _ in names]
        ask = rng.randrange(4)
        needles = [f" The pass key of {n} is {k}. Remember it." for n, k in zip(names, keys)]
        question, answer = f" What is the pass key of {names[ask]}? The pass key of {names[ask]} is", f" {keys[ask]}"
    needles, question = [enc.encode_ordinary(t) for t in needles], enc.encode_ordinary(question)
    length -= (length - 1) % align
    n_fill = length - len(question) - sum(map(len, needles))
    cuts = sorted(rng.randrange(0, n_fill + 1) for _ in needles)
    fill, bounds = tasks.filler(n_fill, rng, enc).tolist(), [0] + cuts
    ids = [t for i, needle in enumerate(needles) for t in fill[bounds[i] : bounds[i + 1]] + needle]
    return ids + fill[cuts[-1]:] + question, enc.encode_ordinary(answer)


def test_task_defaults_are_the_training_prompts(monkeypatch):
    """The test variants leave the defaults as they were: make_example's prompts are those of the
    frozen copy above, and get_batch's rows those of its loop with the answer's full stop (a choice
    among one key count or one template draws nothing from the rng)."""
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    for task in ("passkey", "multikey"):
        for i, length in enumerate((300, 1000, 1001)):
            prompt, answer = tasks.make_example(task, length, random.Random(i), enc, align=7)
            assert (prompt.tolist(), answer) == old_prompt(task, length, random.Random(i), enc, 7)
    x, _ = tasks.get_batch(["passkey", "multikey"], 4, 300, random.Random(3), enc, align=7)
    rng = random.Random(3)
    for row in x:
        prompt, answer = old_prompt(rng.choice(["passkey", "multikey"]), 300 + 1 - tasks.MAX_ANSWER, rng, enc, 7)
        answer = answer + enc.encode_ordinary(".")
        rest = tasks.filler(300 + 1 - len(prompt) - len(answer), rng, enc).tolist()
        assert row.tolist() == (prompt + answer + rest)[:-1]


def test_task_variants(monkeypatch):
    """The held-out variants of sample.py, built by make_example: keys=N needles of distinct names
    (the asked one's key the answer), a template's phrasing, keys of `digits` digits, the asked
    needle at a depth of the filler, or its key `past` tokens before the end with the others before
    it; every prompt aligned (its last token opens a chunk, through insert_landmarks)."""
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    model = DRT(tiny_config(vocab_size=50304, landmark_id=50257)).eval()  # chunks of 7 text tokens
    T = model.config.chunk_size - 1
    variants = [("multikey", dict(keys=2)), ("multikey", dict(keys=16, digits=3)), ("passkey", dict(digits=7)),
                ("passkey", dict(template="code")), ("multikey", dict(template="code", keys=12)),
                ("multikey", dict(template="id", depth=0.9)), ("passkey", dict(depth=0.1)),
                ("multikey", dict(past=300, keys=8)), ("passkey", dict(past=200, template="number")),
                ("vartrack", dict(digits=6))]
    for i, (task, kw) in enumerate(variants):
        prompt, answer = tasks.make_example(task, 700 + i, random.Random(i), enc, align=T, **kw)
        text, want = enc.decode(prompt.tolist()), enc.decode(answer).strip()
        needle, question, named, named_question = tasks.TEMPLATES[kw.get("template", "key")]
        assert want.isdigit() and len(want) == kw.get("digits", 5)
        if task == "passkey":
            assert needle.format(k=want) in text and text.endswith(question)
        if task == "multikey":
            pattern = re.escape(named).replace(re.escape("{n}"), r"(\w+)").replace(re.escape("{k}"), r"(\d+)")
            keys = dict(re.findall(pattern, text))
            asked = [name for name in keys if text.endswith(named_question.format(n=name))]
            assert len(keys) == kw.get("keys", 4) and set(keys) <= set(tasks.NAMES) and len(asked) == 1
            assert keys[asked[0]] == want
        at = tasks.occurrences(prompt, answer)
        if "depth" in kw:  # the asked needle at that depth of the filler, after the needles drawn before it
            needles, q, _, ask = tasks.needles_and_question(task, random.Random(i), **{k: v for k, v in kw.items()
                                                                                       if k != "depth"})
            ids = [enc.encode_ordinary(t) for t in needles]
            n_fill = len(prompt) - len(enc.encode_ordinary(q)) - sum(map(len, ids))
            before = at[0] - tasks.occurrences(ids[ask], answer)[0] - round(kw["depth"] * n_fill)
            assert 0 <= before <= sum(map(len, ids)) - len(ids[ask]), (at, n_fill)
        if "past" in kw:  # its key's last mention ends `past` tokens before the end, after every other key
            assert len(prompt) - 1 - (at[-1] + len(answer) - 1) == kw["past"]
            assert all(text.index(k) < text.index(want) for k in re.findall(r" is (\d+)\.", text) if k != want)
        assert (len(prompt) - 1) % T == 0 and enc.decode(prompt[-1:].tolist()) == " is"
        state = model.new_state()
        with torch.no_grad():
            model(torch.from_numpy(prompt[None, :-1]), state=state)
        assert state.n % model.config.chunk_size == 0  # the question's chunk is closed: its landmark is in
    with pytest.raises(ValueError, match="too short for a passkey prompt with its key 500 tokens before the end"):
        tasks.make_example("passkey", 400, random.Random(0), enc, past=500)


def test_score_is_strict(monkeypatch):
    """Right = the answer, then something that does not continue the number: the
    [' 7', '14', '32', '5'] for 71432 spells 714325 and is wrong (the first len(answer) tokens alone
    would pass it); the answer alone, with nothing seen after it, is not yet right."""
    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    answer = enc.encode_ordinary(" 71432")
    pieces = lambda *texts: [t for s in texts for t in enc.encode_ordinary(s)]  # noqa: E731
    assert tasks.score(answer + pieces(". Remember"), answer, enc) == 1
    assert tasks.score(pieces(" 7", "14", "32", "."), answer, enc) == 1  # another spelling of the same number
    assert tasks.score(answer + pieces(" is"), answer, enc) == 1
    assert tasks.score(pieces(" 7", "14", "32", "5"), answer, enc) == 0
    assert tasks.score(answer + pieces("5."), answer, enc) == 0
    assert tasks.score(answer, answer, enc) == 0 and tasks.score(pieces(" 7143."), answer, enc) == 0


@pytest.mark.parametrize("reply", [".", "5", "other"])
def test_harness_scores_strictly(reply, tmp_path, monkeypatch, capsys):
    """run_task decodes past the answer and scores strictly: the key then '.' is right, the key's
    tokens then '5' wrong; --show_misses names the needle whose key a wrong answer is."""
    import sample
    import tasks
    enc = _tokenizer_or_skip(monkeypatch)

    def answer_prompt(model, prompt, n, state, segment, progress=None):  # a model that answers `reply`
        text = enc.decode(list(prompt))
        keys = dict(re.findall(r"pass key of (\w+) is (\d+)\.", text))
        asked = re.search(r"pass key of (\w+) is$", text)[1]
        answer = enc.encode_ordinary(" " + keys[asked])
        assert n == len(answer) + tasks.SCORE_AFTER
        other = next(name for name in keys if name != asked)
        print(f"other {other}")
        out = enc.encode_ordinary(f" {keys[other]}.") if reply == "other" else answer + enc.encode_ordinary(reply)
        return (out + enc.encode_ordinary(" The pass"))[:n], []

    monkeypatch.setattr(sample, "answer_prompt", answer_prompt)
    sample.main([f"--ckpt={tiny_checkpoint(tmp_path / 'a.pt')}", "--multikey", "--lengths=300",
                 "--samples_per_length=3", "--show_misses", "--device=cpu"])
    out = capsys.readouterr().out
    acc = re.search(r"^\s+300\s+3\s+(\d+\.\d)% \[(\d+)-(\d+)\]", out, re.M)
    assert float(acc[1]) == (100.0 if reply == "." else 0.0), out
    assert (int(acc[2]), int(acc[3])) == tuple(round(100 * b) for b in tasks.wilson(3 * (reply == "."), 3))
    owners = re.findall(r"another needle's key: (\w+)'s\)$", out, re.M)
    assert owners == (re.findall(r"^other (\w+)$", out, re.M) if reply == "other" else []), out


def test_in_reach_counts_positions():
    """in_reach: the answer's last mention lies within `reach` positions of the prompt's last token,
    positions as insert_landmarks lays them out (a landmark after every S-1 tokens); prompt_kwargs'
    'reach' puts a key just past it at every chunk phase."""
    import sample
    import tasks
    model = DRT(tiny_config())  # S=8
    S, T, reach, answer = 8, 7, 20, [5, 6]
    cfg = type("Cfg", (), dict(n_lower=1, groups=(1,), window=10, chunk_size=S))  # window_reach 20
    past = sample.prompt_kwargs(type("Args", (), dict(unseen_names=False, keys=4, template="key", digits=5)),
                                cfg, "reach")["past"]
    near = []
    for n in range(30, 30 + S):  # every chunk phase of the prompt's end
        for i in range(n - 2):
            prompt = [1] * n
            prompt[0:2] = prompt[i : i + 2] = answer  # two mentions: the later one counts
            ids, _ = insert_landmarks(torch.tensor([prompt]), model.config)
            pos = (ids[0] != model.config.landmark_id).nonzero().squeeze(1)  # the text tokens' positions
            assert tasks.in_reach(prompt, answer, T, reach) == (pos[-1] - pos[i + 1] < reach)
            if n - 1 - (i + 1) == past:  # the key `past` tokens before the end: just out of reach
                assert not tasks.in_reach(prompt, answer, T, reach)
            near += [tasks.in_reach(prompt, answer, T, reach)] if n - 1 - (i + 1) == past - 1 else []
    assert any(near)  # one token nearer, and some phase brings it in reach: `past` is the fewest


def test_needle_picks_hit_at_1():
    """hit@1: one of the needle's chunks (its own or the next) got the largest weight of a group's
    picks, in any upper group; found: it was picked with a weight > 0 at all."""
    import tasks
    T, answer = 4, [5, 6]
    prompt = [9] * 40
    prompt[13:15] = answer  # the needle's chunk: 14 // 4 = 3
    P = lambda idx, w: (torch.tensor(idx), torch.tensor(w))  # noqa: E731
    cases = [([P([3, 7], [0.6, 0.3])], True, True), ([P([7, 3], [0.6, 0.3])], True, False),
             ([P([7, 4], [0.3, 0.6])], True, True), ([P([7, 3], [0.6, 0.0])], False, False),
             ([P([7, 1], [0.6, 0.3]), P([2, 3], [0.1, 0.5])], True, True),
             ([P([7, 1], [0.6, 0.3]), P([3, 2], [0.1, 0.5])], True, False), ([P([5, 6], [0.6, 0.3])], False, False)]
    for picks, found, top in cases:
        assert tasks.needle_picks(prompt, answer, picks, T)[:2] == (found, top), picks


def test_wilson_interval():
    """The Wilson interval's bounds are the proportions x where the score test |p - x| / se(x), se(x)
    = sqrt(x (1 - x) / n), equals z = 1.96; it holds p and stays in [0, 1], at 0/n and n/n too."""
    import tasks
    for k, n in [(0, 5), (5, 5), (2, 2), (19, 20), (7, 20), (1, 10)]:
        lo, hi = tasks.wilson(k, n)
        p = k / n
        assert 0 <= lo <= p <= hi <= 1 and lo < hi
        for x in (lo, hi):
            assert abs((p - x) ** 2 - 1.96**2 * x * (1 - x) / n) < 1e-12
    assert tasks.wilson(5, 5)[1] == pytest.approx(1) and tasks.wilson(0, 5)[0] == pytest.approx(0)


def test_key_owner():
    """--show_misses' owner of a wrong answer, read off the needles: another multi-key name, the
    other chain's variable in 2-hop, none for the asked key or a number in no needle."""
    import random

    import tasks
    for task, template in [("multikey", "key"), ("multikey", "code"), ("multikey", "id"), ("vartrack", "key")]:
        needles, _, answer, _ = tasks.needles_and_question(task, random.Random(1), template=template)
        answer = answer.strip()
        owners = dict((k, n) for n, k in re.findall(r"(\w+) (?:is|=) (\d+)\.", "".join(needles)))
        other = next(k for k in owners if k != answer)
        assert tasks.key_owner(needles, other, answer) == owners[other] and owners[other] in "".join(needles)
        assert tasks.key_owner(needles, answer, answer) is None and tasks.key_owner(needles, "7", answer) is None


def test_harness_depth_and_reach(tmp_path, monkeypatch, capsys):
    """--depth: a table per bin, titled by it; 'in reach' counts the prompts whose asked key the
    windows reach from the question: all at 200 tokens (the reach is 256 positions), none with
    --depth=reach. --keys, --template and --digits show in the title."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "a.pt")
    sample.main([f"--ckpt={ckpt}", "--passkey", "--multikey", "--lengths=200", "--samples_per_length=2",
                 "--device=cpu"])
    assert re.findall(r"^\s+200\s+2\s+\d+\.\d% \[\d+-\d+\]\s+(\d+)\s", capsys.readouterr().out, re.M) == ["2", "2"]
    sample.main([f"--ckpt={ckpt}", "--passkey", "--multikey", "--keys=3", "--template=code", "--digits=4",
                 "--depth=0.5,reach", "--lengths=600", "--samples_per_length=2", "--device=cpu"])
    out = capsys.readouterr().out
    titles = re.findall(r"^(\w+), retrieval learned: .*aligned to a chunk, (.*)$", out, re.M)
    assert titles == [(task, f"{keys}template code, 4-digit numbers, {where}")
                      for task, keys in (("passkey", ""), ("multikey", "3 keys, "))
                      for where in ("the asked needle at depth 0.5", "the asked key just past the windows' reach")], out
    near = re.findall(r"^\s+600\s+2\s+\d+\.\d% \[\d+-\d+\]\s+(\d+)\s", out, re.M)
    assert len(near) == 4 and near[1] == near[3] == "0", out


def test_haystack_mix(tmp_path, monkeypatch):
    """Training rows take real text as filler with probability haystack_frac, else the sentences."""
    import random

    import tasks
    enc = _tokenizer_or_skip(monkeypatch)
    book = np.array(enc.encode_ordinary(" Call me Ishmael. Some years ago, never mind how long. " * 100), np.uint16)
    book.tofile(tmp_path / "book.bin")
    hay = tasks.Haystack(str(tmp_path / "book.bin"), enc)
    rows = {}
    for frac in (0.0, 0.5, 1.0):
        x, _ = tasks.get_batch("passkey", 16, 300, random.Random(1), enc, haystack=hay, haystack_frac=frac)
        rows[frac] = sum("Ishmael" in enc.decode(r.tolist()) for r in x)
    assert rows[0.0] == 0 and rows[1.0] == 16 and 3 <= rows[0.5] <= 13


def tiny_checkpoint(path, **kw):
    """A random GPT-2-vocabulary DRT saved the way train.py saves (model, model_args)."""
    from dataclasses import asdict
    kw = {"n_embd": 32, "n_head": 4, "n_lower": 1, "groups": (1,), "n_enc": 1, "window": 128, "topk": 2, **kw}
    cfg = DRTConfig(**kw)
    torch.manual_seed(0)
    torch.save({"model": DRT(cfg).state_dict(), "model_args": asdict(cfg), "iter_num": 7}, path)
    return str(path)


def test_sample_generate_and_harness(tmp_path, monkeypatch, capsys):
    import sample
    _tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    sample.main([f"--ckpt={ckpt}", "--prompt=Once upon a time", "--max_new_tokens=5", "--device=cpu"])
    out = capsys.readouterr().out
    assert "iter 7" in out and "Once upon a time" in out
    sample.main([f"--ckpt={ckpt}", "--passkey", "--vartrack", "--lengths=300,1K", "--samples_per_length=2",
                 "--offload", "--segment=100", "--device=cpu"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines()
            if re.match(r"\s+(300|1K)\s+2\s+\d+\.\d% \[\d+-\d+\]\s+\d\s+(\d/\d|-)\s+(\d/\d|-)\s", line)]
    assert len(rows) == 4, out  # two lengths x two tasks


def test_copying_passes(tmp_path, monkeypatch, capsys):
    """--copying: a perfect induction copier scores ln(V) on pass 1 and 0 after, near and far (a
    pass's first token, which no earlier occurrence predicts, left out); one that copies only
    within its reach scores ln(V) far; the flag runs on a checkpoint, with book text too."""
    import math
    from types import SimpleNamespace

    import sample

    class Induction(torch.nn.Module):  # copies from L and from L_far back, where those are within its reach
        config = SimpleNamespace(window=128, chunk_size=64, n_lower=1, groups=(2,), retriever="learned", topk=2, read_next=False)

        def __init__(self, reach):
            super().__init__()
            self.w, self.reach = torch.nn.Parameter(torch.zeros(1)), reach

        def forward(self, idx, targets, return_logits=True):
            n, T = idx.shape
            logits = torch.zeros(n, T, 50304)
            logits[:, :, 50257:] = -1e9  # V = 50257 live tokens: a uniform guess costs ln(V)
            L, L_far = sample.copy_span(self.config), sample.copy_far_span(self.config)
            for back in (L, L_far):  # L_far back wins a (rare) tie
                if back <= self.reach:
                    for t in range(back, T):
                        seen = idx[:, t - back] == idx[:, t]
                        logits[seen, t, idx[seen, t - back + 1]] = 1e4 * (1 + (back == L_far))
            return None, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    args, ctx, lnV = SimpleNamespace(seed=0, samples=2), torch.autocast("cpu", enabled=False), math.log(50257)
    assert sample.copy_far_span(Induction.config) == 392  # 3 layers x 128 positions + 8
    (p1, p2, p3, far1, far, twins), = sample.copy_test(Induction(reach=10**6), args, ctx).values()
    assert abs(p1 - lnV) < 1e-3 and p2 < 1e-3 and p3 < 1e-3 and abs(far1 - lnV) < 1e-3 and far < 1e-3 and twins < 1e-3
    (p1, p2, p3, far1, far, twins), = sample.copy_test(Induction(reach=384), args, ctx).values()  # the windows' reach only
    assert abs(p1 - lnV) < 1e-3 and p2 < 1e-3 and p3 < 1e-3 and abs(far1 - lnV) < 1e-3 and abs(far - lnV) < 1e-3
    capsys.readouterr()
    enc = _tokenizer_or_skip(monkeypatch)
    np.array(enc.encode_ordinary(" Call me Ishmael. Some years ago, never mind how long. " * 100),
             np.uint16).tofile(tmp_path / "book.bin")
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    sample.main([f"--ckpt={ckpt}", "--copying", "--samples_per_length=2", "--device=cpu",
                 f"--haystack={tmp_path / 'book.bin'}"])
    rows = re.findall(r"(random tokens|haystack text)((?:\s+\d+\.\d\d){6})$", capsys.readouterr().out, re.M)
    assert [r[0] for r in rows] == ["random tokens", "haystack text"]
    assert all(4 < float(v) < 20 for _, vals in rows for v in vals.split())  # an untrained model: no copying


def test_twins_handed_to_gca():
    """--copying's twins column: each chunk of a span's second reading is handed the chunks of the first
    reading that hold its text, strictly earlier; DRT.hand_picks reads them in a forward and a stream
    alike, keeps Eq. 1's picks where it says -1, and with -1 everywhere changes nothing."""
    import sample
    k, S, K = 30, 8, 3
    picks = sample.twin_picks(k, S, K)(torch.arange(2 * k // (S - 1)))  # (n, K)
    handed = 0
    for c, row in enumerate(picks.tolist()):
        need = {t % k for t in range((S - 1) * (c + 1), min((S - 1) * (c + 2), 2 * k))}  # chunk c+1's text
        if row[0] < 0:
            assert (S - 1) * (c + 1) < k + S - 1 or c + 1 >= 2 * k // (S - 1)  # no whole twin earlier than c
            continue
        handed += 1
        have = {t for j in row for t in range((S - 1) * j, (S - 1) * (j + 1))}
        assert max(row) < c and need <= have, (c, row)
    assert handed >= 3
    model = tiny_model(groups=(1, 1), softmax_off_by_one=False)
    model.eval()
    x = tokens(model.config, 2, k, seed=5).repeat(1, 2)  # (2, 2k): the span read twice
    plain = all_logits(model, x)
    model.hand_picks, model.record = sample.twin_picks(k, S, K), []
    handed_logits = all_logits(model, x)
    got = [r[1] for r in model.record if not isinstance(r[0], str)]  # the picks (B, n, K), per group
    assert len(got) == 2
    for idx in got:
        want = picks[: idx.size(1)]
        assert torch.equal(idx[:, want[:, 0] >= 0], want[want[:, 0] >= 0].expand(2, -1, -1))
    assert not torch.allclose(plain, handed_logits)  # GCA read other chunks
    state = model.new_state()
    streamed = torch.cat([all_logits(model, x[:, s : s + 11], state) for s in range(0, 2 * k, 11)], 1)
    assert rel_err(streamed, handed_logits) < 1e-10
    model.hand_picks = lambda ids: torch.full((len(ids), K), -1)
    assert torch.equal(all_logits(model, x), plain)


def test_copying_holds_no_logits(tmp_path, monkeypatch, capsys):
    """--copying scores each pass through the chunked loss: no (spans, tokens, vocab) logits are
    ever held (13 GB on the quick start's model), and a long test says how far it got."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import sample
    _tokenizer_or_skip(monkeypatch)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.numel = max([self.numel] + [t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                             if isinstance(t, torch.Tensor)])
            return out

    monkeypatch.setattr(drt, "CE_ROWS", 64)
    monkeypatch.setattr(sample, "PROGRESS_AFTER", -1)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")  # far spans of 264 tokens, read twice
    with Largest() as largest:
        sample.main([f"--ckpt={ckpt}", "--copying", "--samples_per_length=4", "--device=cpu"])
    assert largest.numel <= 64 * 50304 < 4 * 527 * 50304 // 8
    assert len(re.findall(r"^  random tokens, \d+-token spans: \d/\d passes after \d+m\d\ds, ETA \d+m\d\ds$",
                          capsys.readouterr().out, re.M)) == 5  # 3 near passes, 2 far


# -----------------------------------------------------------------------------
# language modelling instruments: does the retriever learn from the next-token loss? (§4.2, Table 4)


def spy_retrieval(monkeypatch):
    """Record what retrieve scores with: [(q (B, n, C), landmarks (B, M, C))] per call of topk_earlier."""
    seen, orig = [], drt.topk_earlier

    def spy(q, pages, chunk_ids, k, noise=False, uniform=False):
        seen.append((q, torch.cat(list(pages), 1)))
        return orig(q, pages, chunk_ids, k, noise, uniform)
    monkeypatch.setattr(drt, "topk_earlier", spy)
    return seen


def test_retriever_random_and_none(monkeypatch):
    """retriever='random' (Table 4's ablation): k distinct, strictly earlier chunks drawn at random,
    weighted by Eq. 3 of their own scores; 'none': every weight 0, the same loss as a model whose
    retrieval weights are zeroed by hand, and not the learned retriever's."""
    model = tiny_model(seed=3).eval()
    cfg, K = model.config, model.config.topk
    idx = tokens(cfg, 2, 12 * (cfg.chunk_size - 1), seed=4)
    seen = spy_retrieval(monkeypatch)
    model.record = []
    _, learned = model(idx, idx)
    model.config.retriever = "random"
    (t, picks_l, _), = retrievals(model.record)
    for seed in (0, 1):
        model.record, seen[:] = [], []
        torch.manual_seed(seed)
        model(idx, idx)
        (_, picks, w), (q, lm) = retrievals(model.record)[0], seen[0]
        ok = torch.arange(K) < t.clamp(max=K)[:, None]  # (n, K) eligible slots
        assert (picks[:, ok] < t[:, None].expand(-1, K)[ok]).all()  # strictly earlier
        assert all(len(set(row[m].tolist())) == int(m.sum()) for row in picks for row, m in zip(row, ok))  # distinct
        r = (q[:, :, None] * lm[torch.arange(2)[:, None, None], picks]).sum(-1) / math.sqrt(cfg.n_embd)
        assert torch.allclose(w, softmax_off_by_one(r.masked_fill(~ok, float("-inf"))), atol=1e-12)  # Eq. 3
        assert not torch.equal(picks[:, 4:], picks_l[:, 4:])  # not the learned top-k
    model.config.retriever = "none"
    _, none = model(idx, idx)
    model.config.retriever = "learned"
    monkeypatch.setattr(drt, "softmax_off_by_one", lambda r, off_by_one=True: torch.zeros_like(r))
    _, zeroed = model(idx, idx)
    assert none.item() == zeroed.item() and abs(none.item() - learned.item()) > 1e-9


def test_retrieval_stats():
    """retrieval_stats on hand-made picks: sum w, max w, the entropy of w / sum w and the distance
    in chunks, over the landmarks that have an earlier chunk (chunk 0's has none)."""
    t = torch.tensor([0, 1, 3])  # landmarks of chunks 0, 1, 3; K = 2, so chunk 1 has one eligible pick
    idx = torch.tensor([[[0, 0], [0, 0], [2, 0]]])
    w = torch.tensor([[[0.0, 0.0], [0.5, 0.0], [0.6, 0.2]]])
    st = drt.retrieval_stats([(t, idx, w)], 2)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert st["sum_w"] == pytest.approx(0.65) and st["max_w"] == pytest.approx(0.55)
    assert st["entropy"] == pytest.approx(h / 2) and st["distance"] == pytest.approx(5 / 3)
    assert drt.retrieval_stats([], 2) == {}


def test_ppl_by_position(tmp_path, monkeypatch, capsys):
    """sample.py --ppl: a .bin of prepare_pg19.py is cut into its books at <|endoftext|>; every
    predicted token lands in the bucket of its position; a document streamed in segments scores
    what one call scores; 'none' scores as a model whose retrieval weights are zeroed by hand."""
    from types import SimpleNamespace

    import sample
    rng = np.random.default_rng(0)
    books = [rng.integers(0, 50257, n) for n in (1500, 300)]
    np.concatenate([books[0], [prepare_pg19.EOT], books[1], [prepare_pg19.EOT]]).astype(np.uint16).tofile(tmp_path / "t.bin")
    docs = sample.read_docs(str(tmp_path / "t.bin"), enc=None)
    assert [len(d) for _, d in docs] == [1500, 300] and all(np.array_equal(d, b) for (_, d), b in zip(docs, books))
    model, _ = sample.load_model(tiny_checkpoint(tmp_path / "ckpt.pt", window=64), "cpu")
    args, ctx = SimpleNamespace(segment=100, offload=False), torch.autocast("cpu", enabled=False)
    whole = sample.doc_nll(model, docs[0][1], SimpleNamespace(segment=10**6, offload=False), ctx)
    assert whole.shape == (1499,) and torch.allclose(sample.doc_nll(model, docs[0][1], args, ctx), whole, atol=1e-4)
    table = sample.perplexity(model, docs, ["learned", "none"], args, ctx)
    assert [n for n, _ in table["learned"]] == [1023 + 299, 476, 0, 0, 0, 0, 0, 1798]  # 0-1K, 1K-4K, ..., all
    assert table["learned"][1][1] == pytest.approx(whole[1023:].mean().item(), abs=1e-4)
    out = capsys.readouterr().out
    assert re.search(r"^\s+1K-4K\s+476\s+\d+\.\d\d\s+\d+\.\d\d$", out, re.M) and "retrieval learned: sum w" in out
    assert "retrieval none" not in out  # no weights, no picks read: nothing to describe
    monkeypatch.setattr(drt, "softmax_off_by_one", lambda r, off_by_one=True: torch.zeros_like(r))
    zeroed = sample.perplexity(model, docs, ["learned"], args, ctx)["learned"]
    filled = lambda rows: [row for row in rows if row[0]]  # noqa: E731 (empty buckets are nan)
    assert filled(zeroed) == filled(table["none"]) and zeroed[1] != table["learned"][1]


def test_inspect_shows_the_picks(tmp_path, capsys):
    """sample.py --inspect: for the chunk holding token --at, the chunks each group picked at the
    landmark before it, with the weights a stream prefilled by hand gets; all strictly earlier."""
    from types import SimpleNamespace

    import sample
    model, _ = sample.load_model(tiny_checkpoint(tmp_path / "ckpt.pt", window=64, groups=(1, 1)), "cpu")
    ids = np.random.default_rng(1).integers(0, 50257, 1200)
    enc = SimpleNamespace(decode=lambda t: " ".join(map(str, t)))  # no tokenizer needed
    args = SimpleNamespace(offload=False, segment=256)
    got = sample.inspect(model, enc, [("doc", ids)], 700, args, torch.autocast("cpu", enabled=False))
    c = 700 // 63
    state = model.new_state()
    sample.prefill(model, ids[: c * 63], state, 10**6)
    assert len(got) == 2
    for (g, picks), (idx, w) in zip(got, state.picks):
        want = sorted(zip(idx[0, 0].tolist(), w[0, 0].tolist()), key=lambda p: -p[1])
        assert [j for j, _ in picks] == [j for j, _ in want] and all(j < c - 1 for j, _ in picks)
        assert [x for _, x in picks] == pytest.approx([x for _, x in want], abs=1e-6)
    out = capsys.readouterr().out
    assert f"chunk {c} (tokens" in out and out.count(" back): ") == 2 * model.config.topk
    # under read_next each line shows the chunk GCA reads and, before it, Eq. 1's pick as DRT.record logs it
    nxt, _ = sample.load_model(tiny_checkpoint(tmp_path / "n.pt", window=64, read_next=True, center_memory=True), "cpu")
    nxt.record, state = [], nxt.new_state()
    sample.prefill(nxt, ids[: c * 63], state, 10**6)
    t, eq1, w = next(r for r in nxt.record if not isinstance(r[0], str) and c - 1 in r[0].tolist())
    a = t.tolist().index(c - 1)
    want = dict(zip(eq1[0, a].tolist(), w[0, a].tolist()))  # Eq. 1's picks at chunk c-1's landmark -> w
    nxt.record = None
    (_, picks), = sample.inspect(nxt, enc, [("doc", ids)], 700, args, torch.autocast("cpu", enabled=False))
    lines = re.findall(r"w (\d\.\d+)  chunk (\d+) \((\d+) back, picked (\d+)\): '(.*)'", capsys.readouterr().out)
    assert sorted(int(j) for *_, j, _ in lines) == sorted(want) and len(lines) == nxt.config.topk
    for wj, r, back, j, text in lines:
        assert int(r) == int(j) + 1 and int(back) == c - 1 - int(r) and float(wj) == pytest.approx(want[int(j)], abs=1e-3)
        assert text == " ".join(map(str, ids[int(r) * 63 : (int(r) + 1) * 63]))
    with pytest.raises(SystemExit, match="retrieve nothing"):
        sample.inspect(model, enc, [("doc", ids)], 70, args, torch.autocast("cpu", enabled=False))
    with pytest.raises(SystemExit, match=r"--at=1200: the first document, doc, has 1,200 tokens: use --at below that"):
        sample.inspect(model, enc, [("doc", ids)], 1200, args, torch.autocast("cpu", enabled=False))


def test_plots(tmp_path, monkeypatch, capsys):
    """--plot: --ppl's curves and --inspect's picks as PNG files; without matplotlib, one line before the
    model loads."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt", window=64, groups=(1, 1))
    np.random.default_rng(0).integers(0, 50257, 3000).astype(np.uint16).tofile(tmp_path / "d.bin")
    run = [f"--ckpt={ckpt}", f"--docs={tmp_path / 'd.bin'}", "--device=cpu", "--segment=500"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"^sample.py: error: --plot needs matplotlib, an optional requirement: pip install"):
        sample.main([*run, "--ppl", f"--plot={tmp_path / 'p.png'}"])
    with pytest.raises(SystemExit, match="give one of them"):
        sample.main([*run, "--ppl", "--inspect", f"--plot={tmp_path / 'p.png'}"])
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    sample.main([*run, "--ppl", "--retrieval=learned,none", f"--plot={tmp_path / 'ppl.png'}"])
    sample.main([*run, "--inspect", "--at=2500", f"--plot={tmp_path / 'picks.png'}"])
    out = capsys.readouterr().out
    for name in ("ppl.png", "picks.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {tmp_path / name}" in out


def test_repeat_passage_lies_past_the_reach():
    """tasks.repeat_passage (train.py --repeat_frac): one passage of 63-504 tokens recurs, more than the windows' reach
    after its first reading; the rest of the row is untouched."""
    import random

    import tasks
    rng = random.Random(0)
    for n, reach in [(1008, 512), (4032, 1536)]:
        sizes = set()
        for _ in range(100):
            row = np.arange(n)
            out = tasks.repeat_passage(row, rng, reach)
            changed = np.flatnonzero(out != row)
            assert 63 <= len(changed) <= 504 and np.all(np.diff(changed) == 1)  # one passage, in one piece
            assert np.all(changed - out[changed] > reach)  # its source lies more than reach tokens back
            sizes.add(len(changed))
        assert len(sizes) > 20
    assert np.array_equal(tasks.repeat_passage(np.arange(300), rng, 512), np.arange(300))  # no room: unchanged


def test_train_reports_retrieval_health(tmp_path, capsys):
    """Each evaluation line of a DRT run carries sum w, max w and GCA's sink share (a dying retriever,
    or GCA reading nothing, shows there); the baseline's does not."""
    train.main(tiny_args(tmp_path, "drt", "--max_iters=3"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval iter")]
    health = r"\| retrieval: sum w [01]\.\d{3}, max w [01]\.\d{3}, sink [01]\.\d\d$"
    assert len(lines) == 2 and all(re.search(health, x) for x in lines)
    train.main(tiny_args(tmp_path, "nosink", "--max_iters=3", "--gca_sink=False"))  # the slot is a key like the others
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval iter")]
    assert len(lines) == 2 and all(re.search(health.replace("sink", "landmark slot"), x) for x in lines)
    train.main(tiny_args(tmp_path, "base", "--max_iters=3", "--groups=()", "--n_lower=2"))
    assert "retrieval:" not in capsys.readouterr().out


def test_sample_show_misses(tmp_path, monkeypatch, capsys):
    """--show_misses prints one line per wrong answer, with the key asked for: as many as the
    accuracy column says were missed (a random model misses them all)."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    sample.main([f"--ckpt={ckpt}", "--passkey", "--lengths=300", "--samples_per_length=3", "--show_misses",
                 "--device=cpu"])
    out = capsys.readouterr().out
    acc = float(re.search(r"^\s+300\s+3\s+(\d+\.\d)%", out, re.M).group(1))
    misses = re.findall(r"miss at 300, sample (\d): wanted '(\d{5})', got '(.*)'", out)
    assert len(misses) == round(3 * (1 - acc / 100)) and all(w != g for _, w, g in misses), out
    sample.main([f"--ckpt={ckpt}", "--passkey", "--lengths=300", "--samples_per_length=3", "--show_misses",
                 "--device=cpu", "--seed=2026"])  # the prompts of another seed: other keys
    assert not {w for _, w, _ in misses} & set(re.findall(r"wanted '(\d{5})'", capsys.readouterr().out))
    sample.main([f"--ckpt={ckpt}", "--passkey", "--lengths=300", "--samples_per_length=3", "--device=cpu"])
    assert "miss at" not in capsys.readouterr().out


def test_harness_retrieval_column(tmp_path, monkeypatch, capsys):
    """The 'retrieved' column reads the picks that serve the answer: with topk >= the number of
    chunks every chunk is picked, so every needle that retrieval could reach counts as found;
    with topk=1 a random model finds fewer. 'needle w' is the retrieval weight on the needle's chunks;
    'hit@1' counts the needles found with the largest weight, all those found where there is one pick."""
    import sample
    import tasks
    _tokenizer_or_skip(monkeypatch)
    prompt, T = [5, 6, 7, 1, 2, 3, 8, 9, 1, 2, 4], 4
    assert tasks.needle_chunk(prompt, [1, 2, 4], T) == 9 // T and tasks.needle_chunk(prompt, [4, 4], T) is None
    found = {}
    for k in (64, 1):
        ckpt = tiny_checkpoint(tmp_path / f"k{k}.pt", topk=k)
        sample.main([f"--ckpt={ckpt}", "--passkey", "--lengths=2K", "--samples_per_length=6", "--segment=700",
                     "--device=cpu"])
        out = capsys.readouterr().out
        assert re.search(r"in reach\s+hit@1\s+retrieved\s+needle w\s+s/sample", out), out  # the columns parsed below
        top, top_of, hit, eligible, w = re.search(r"^\s+2K\s+6\s+\d+\.\d% \[\d+-\d+\]\s+\d+\s+(\d+)/(\d+)\s+(\d+)/(\d+)\s+"
                                                  r"(\d\.\d\d)\s", out, re.M).groups()
        assert top_of == eligible and int(top) <= int(hit), out  # hit@1: found, and with the largest weight
        found[k] = int(hit), int(eligible), float(w), int(top)
    assert found[1][3] == found[1][0], found  # one pick per group: a needle found is the top pick
    hit, eligible, w, _ = found[64]
    assert eligible >= 4 and hit == eligible, found  # 2K tokens: 33 chunks, needles mostly far from the end
    assert 0 < w < 0.5, found  # every chunk picked: the needle's two chunks get a small part of the weight
    hit, eligible, w, _ = found[1]
    assert hit < eligible, found
    assert (w > 0) == (hit > 0) and w <= hit / eligible + 0.005, found  # one pick: weight < 1, only where found (0.005: rounding)


def test_sample_checkpoint_errors(tmp_path, monkeypatch):
    import sample
    _tokenizer_or_skip(monkeypatch)
    with pytest.raises(SystemExit, match="no checkpoint"):
        sample.main([f"--out_dir={tmp_path}", "--device=cpu"])
    ckpt = torch.load(tiny_checkpoint(tmp_path / "a.pt"), weights_only=False)
    ckpt["model_args"]["n_embd"] = 64  # weights of one shape, config of another
    torch.save(ckpt, tmp_path / "b.pt")
    with pytest.raises(SystemExit, match="do not fit the config"):
        sample.main([f"--ckpt={tmp_path / 'b.pt'}", "--device=cpu"])
    with pytest.raises(SystemExit, match="lengths"):
        sample.main([f"--ckpt={tmp_path / 'a.pt'}", "--passkey", "--lengths=4Q", "--device=cpu"])


# every bad argument is one line, before the checkpoint loads: the --ckpt given does not exist
BAD_SAMPLE_ARGS = [
    (["--passkey", "--lengths=0"], r"--lengths: 0 tokens cannot hold .* passkey prompt: use lengths of at least \d+"),
    (["--multikey", "--lengths=128,10"], r"--lengths: 10 tokens cannot hold .* multikey"),  # before 128 runs
    (["--vartrack", "--lengths=,"], r"--lengths=',': expected a list"),
    (["--prompt=FILE:{tmp}/missing.txt"], r"--prompt=FILE:.*missing.txt: cannot read it"),
    (["--passkey", "--haystack={tmp}/missing"], r"--haystack .*missing: expected a folder"),
    (["--passkey", "--haystack={tmp}/empty"], r"--haystack .*empty: no .txt files"),
    (["--passkey", "--haystack={tmp}/short.bin"], r"--haystack .*short.bin: only 10 tokens"),
    (["--top_k=-1"], r"--top_k=-1: must be >= 0 \(0 = off"),
    (["--max_new_tokens=0"], r"--max_new_tokens=0: must be >= 1"),
    (["--temperature=-0.5"], r"--temperature=-0.5: must be >= 0"),
    (["--num_samples=0"], r"--num_samples=0: must be >= 1"),
    (["--passkey", "--samples_per_length=0"], r"--samples_per_length=0: must be >= 1"),
    (["--passkey", "--samples=0"], r"--samples_per_length=0: must be >= 1"),  # the old name still works
    (["--segment=0"], r"--segment=0: must be >= 1"),
    (["--device=cuda"], r"--device=cuda: no CUDA GPU here: pass --device=cpu"),
    (["--device=gpu0"], r"--device=gpu0: expected cpu, cuda or cuda:N"),
    (["--passkey", "--unseen_names"], r"--unseen_names: only multi-key has names: add --multikey"),
    (["--multikey", "--keys=1"], r"--keys=1: multi-key's needle count, 2 to 16 \(4 as trained\): use it with --multikey"),
    (["--multikey", "--keys=17"], r"--keys=17: multi-key's needle count, 2 to 16"),
    (["--passkey", "--keys=8"], r"--keys=8: multi-key's needle count, .*: use it with --multikey"),
    (["--passkey", "--digits=2"], r"--digits=2: keys of 3 to 7 digits"),
    (["--passkey", "--digits=8"], r"--digits=8: keys of 3 to 7 digits"),
    (["--passkey", "--template=nope"], r"--template=nope: passkey's and multi-key's phrasing, one of key, number, id, code"),
    (["--vartrack", "--template=code"], r"--template=code: passkey's and multi-key's phrasing"),
    (["--passkey", "--depth=1.5"], r"--depth=1.5: expected fractions of the filler in \[0, 1\] or 'reach'"),
    (["--passkey", "--depth=0.1,deep"], r"--depth=0.1,deep: expected fractions"),
    (["--vartrack", "--depth=0.5"], r"--depth: 2-hop's needles keep their order"),
    (["--passkey", "--lengths=4K,100M"], r"--lengths: 100M tokens is past the 64M this harness supports"),
    (["--copying", "--lengths=4K"], r"--lengths=4K: --copying has spans of its own lengths; --lengths is for --passkey"),
    (["--dtype=float16"], r"--dtype=float16: autocast runs on CUDA here; a CPU computes in float32: drop --dtype"),
    (["--tokenizer_file={tmp}/junk.tiktoken"], r"GPT-2 ranks file .*junk.tiktoken \(from --tokenizer_file or "
                                                r"DRT_GPT2_RANKS\) is not a tiktoken ranks file"),
    (["--passkey", "--haystack={tmp}/ids.bin"], r"--haystack .*ids.bin: token id 60000 is past GPT-2's 50257 ids"),
]


@pytest.mark.parametrize("argv, message", BAD_SAMPLE_ARGS, ids=[" ".join(a) for a, _ in BAD_SAMPLE_ARGS])
def test_sample_bad_arguments(argv, message, tmp_path, monkeypatch):
    import sample
    _tokenizer_or_skip(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "empty").mkdir()
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "short.bin")
    np.arange(60001 - 5000, 60001, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    (tmp_path / "junk.tiktoken").write_text("not a ranks file\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit, match="^sample.py: error: " + message) as e:
        sample.main([f"--ckpt={tmp_path / 'none.pt'}", *argv])
    assert "\n" not in str(e.value.code)


def test_sample_memory_check(tmp_path, monkeypatch, capsys):
    """A length whose chunk keys/values (2*d*4 bytes per text token in fp32, x 64/63) cannot fit
    in the memory available is refused before any prompt runs."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")  # d=32, chunks of 64
    need = 2**20 * 2 * 32 * 4 * 64 / 63
    monkeypatch.setattr(common, "available_mem", lambda: need - 1e6)
    with pytest.raises(SystemExit, match=rf"^sample.py: error: --lengths: a 1M-token prompt holds {need / 1e9:.2f} GB "
                                         rf"of chunk keys/values in host memory, and {(need - 1e6) / 1e9:.2f} GB are "
                                         r"available: use shorter lengths$"):
        sample.main([f"--ckpt={ckpt}", "--passkey", "--lengths=1K,1M", "--samples_per_length=1", "--device=cpu"])
    assert "passkey:" not in capsys.readouterr().out  # no test began
    sample.main([f"--ckpt={ckpt}", "--passkey", "--lengths=1K", "--samples_per_length=1", "--device=cpu"])
    assert re.search(r"^\s+1K\s+1\s", capsys.readouterr().out, re.M)


def test_sample_shortest_length(tmp_path, monkeypatch, capsys):
    """A length too short for a test names the shortest that works, and that one runs."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    for task in ("passkey", "multikey", "vartrack"):
        argv = [f"--ckpt={ckpt}", f"--{task}", "--samples_per_length=3", "--device=cpu"]
        n, named = 1, None
        while named is None or named > n:  # a prompt cut to the model's chunks may need more: follow the hint
            n = named or n
            try:
                sample.main([*argv, f"--lengths={n}", "--segment=100000"])
                named = n
            except SystemExit as e:
                named = int(re.search(r"at least (\d+)$", e.code).group(1))
        with pytest.raises(SystemExit, match=f"{n - 1} tokens cannot hold .* at least {n}$"):
            sample.main([*argv, f"--lengths={n - 1}"])
        sample.main([*argv, f"--lengths={n}"])
        assert re.search(rf"^\s+{n}\s+3\s+\d+\.\d%", capsys.readouterr().out, re.M)


def test_sample_haystack_read_once(tmp_path, monkeypatch, capsys):
    import sample
    _tokenizer_or_skip(monkeypatch)
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("The fox ran over the hill and back again. " * 200)
    made = []

    class Counted(sample.Haystack):
        def __init__(self, *a):
            made.append(a[0])
            super().__init__(*a)

    monkeypatch.setattr(sample, "Haystack", Counted)
    sample.main([f"--ckpt={tiny_checkpoint(tmp_path / 'a.pt')}", "--passkey", "--vartrack", "--lengths=300",
                 "--samples_per_length=1", f"--haystack={tmp_path / 'books'}", "--device=cpu"])
    assert len(made) == 1 and capsys.readouterr().out.count("filler from") == 2  # one read, both tests


def test_sample_top_k_zero_is_off(tmp_path, monkeypatch):
    import sample
    _tokenizer_or_skip(monkeypatch)
    seen, generate = [], DRT.generate
    monkeypatch.setattr(DRT, "generate", lambda self, *a, **kw: seen.append(a[3]) or generate(self, *a, **kw))
    sample.main([f"--ckpt={tiny_checkpoint(tmp_path / 'a.pt')}", "--prompt=Hi", "--max_new_tokens=3", "--top_k=0",
                 "--device=cpu"])
    assert seen == [None]  # sample among all tokens


@pytest.mark.parametrize("kind", ["text", "empty", "half", "tensor"])
def test_sample_broken_checkpoint(kind, tmp_path, monkeypatch):
    """A ckpt.pt cut short or of another kind is a one-line error, not a zip or pickle traceback."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    path = tmp_path / "ckpt.pt"
    if kind == "tensor":
        torch.save(torch.zeros(3), path)
    else:
        whole = Path(tiny_checkpoint(path)).read_bytes()
        path.write_bytes({"text": b"not a checkpoint\n", "empty": b"", "half": whole[: len(whole) // 2]}[kind])
    message = "is not a train.py checkpoint" if kind == "tensor" else "is truncated or not a torch checkpoint"
    with pytest.raises(SystemExit, match="^sample.py: error: .*" + message) as e:
        sample.main([f"--out_dir={tmp_path}", "--prompt=Hi", "--device=cpu"])
    assert "\n" not in e.value.code


class RunsCode:
    """Unpickled, it would make the folder `path`: what a ckpt.pt from anywhere could do with pickle."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_checkpoint_that_runs_code_is_refused(tmp_path, monkeypatch):
    """A ckpt.pt whose pickle would run code is refused, unrun, by sample.py and train.py alike
    (both load through common.load_checkpoint, weights_only)."""
    import sample
    _tokenizer_or_skip(monkeypatch)
    (tmp_path / "run").mkdir()
    ckpt = torch.load(tiny_checkpoint(tmp_path / "run" / "ckpt.pt"))
    ran = tmp_path / "code-ran"
    torch.save({**ckpt, "model": RunsCode(str(ran))}, tmp_path / "run" / "ckpt.pt")
    with pytest.raises(SystemExit, match=r"^sample.py: error: .*ckpt.pt holds Python objects .* could run code"):
        sample.main([f"--out_dir={tmp_path / 'run'}", "--prompt=Hi", "--device=cpu"])
    with pytest.raises(common.CheckpointError, match=r"ckpt.pt holds Python objects .* could run code"):
        train.main(tiny_args(tmp_path, "ft", f"--init_from={tmp_path / 'run'}"))
    assert not ran.exists()


def test_sample_help(capsys):
    import sample
    with pytest.raises(SystemExit) as e:
        sample.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert e.value.code == 0
    for flag, default in [("--top_k TOP_K", 200), ("--max_new_tokens MAX_NEW_TOKENS", 200),
                          ("--segment SEGMENT", 65536), ("--num_samples NUM_SAMPLES", 1), ("--samples_per_length N", 10)]:
        assert out.split(flag + " ", 1)[1].split("(default: ", 1)[1].startswith(f"{default})"), flag
    # the two sample counts, told apart; the old name --samples still parses but is not shown
    assert "--num_samples NUM_SAMPLES generations to draw" in out and "--samples_per_length N test prompts per" in out
    assert "--samples " not in out and "[--samples " not in out
    for text in (out, sample.__doc__):
        assert not re.search(r"DESIGN|\.\./shared", text)  # the repository stands alone


# -----------------------------------------------------------------------------
# data preparation (prepare_pg19.py): the tokenizer, the .bin layout, errors, a download from a fake bucket


def _write_books(root, books, metadata=None):
    # books: {split: {book_id: text or bytes}}
    for split, bs in books.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for book_id, text in bs.items():
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            (root / split / f"{book_id}.txt").write_bytes(data)
    if metadata is not None:
        (root / "metadata.csv").write_text(metadata, encoding="utf-8")


def _files(root):
    # {name: bytes} of every file in root: a dataset to compare bit for bit, temp files included
    return {p.name: p.read_bytes() for p in root.iterdir()}


def test_tokenizer_local_file(monkeypatch):
    enc = _tokenizer_or_skip(monkeypatch)
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.n_vocab == prepare_pg19.GPT2_VOCAB == 50257
    assert enc.eot_token == prepare_pg19.EOT == 50256
    text = "It was the best of times,\r\nit was the worst of times — naïve café 日本 <|endoftext|>\n\n"
    assert enc.decode(enc.encode_ordinary(text)) == text
    with pytest.raises(FileNotFoundError, match="nope.tiktoken") as e:
        prepare_pg19.get_tokenizer("/nonexistent/nope.tiktoken")
    assert prepare_pg19.RANKS_URL in str(e.value) and "shared" not in str(e.value)


def test_tokenizer_offline_message(monkeypatch, capsys):
    # no ranks file and no network: the message says which file to fetch and where to point at it
    import tiktoken

    def offline(name):
        raise OSError("Temporary failure in name resolution")
    monkeypatch.delenv("DRT_GPT2_RANKS", raising=False)
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="name resolution") as e:
        prepare_pg19.get_tokenizer()
    msg = str(e.value)
    assert "r50k_base.tiktoken" in msg and "DRT_GPT2_RANKS=" in msg and "--tokenizer_file" in msg
    assert "shared" not in msg
    with pytest.raises(SystemExit):
        prepare_pg19.main(["--help"])
    help_text = capsys.readouterr().out
    assert "r50k_base.tiktoken" in help_text and "--max_books" in help_text and "shared" not in help_text


def test_readme_setup():
    """The README's install block runs in order on a CPU (torch's CPU build before the requirements),
    its test command is CI's and shows why tests skip, it names the variables that enable tests
    offline, and its local-copy quick start keeps --max_books."""
    readme, ci = (Path(HERE) / "README.md").read_text(), (Path(HERE) / ".ci" / "run").read_text()
    block = re.search(r"## Install.*?```bash\n(.*?)```", readme, re.S)[1].splitlines()
    assert "--index-url https://download.pytorch.org/whl/cpu" in block[0] and "requirements.txt" in block[1]
    test_cmd = next(line.split("#")[0].strip() for line in block if line.startswith("python -m pytest"))
    assert "-rs" in test_cmd and re.search(rf"^{re.escape(test_cmd)}$", ci, re.M)
    assert "DRT_GPT2_RANKS" in readme and "DRT_PG19_SAMPLE" in readme
    assert "--source /path/to/pg19 --out data/pg19 --max_books=20" in readme


def test_prepare_fmt_time():
    got = [common.fmt_time(s) for s in (0, 59.9, 61, 3600, 3725)]  # the ETAs of prepare_pg19.py and train.py
    assert got == ["0m00s", "0m59s", "1m01s", "1h00m", "1h02m"]


def test_prepare_requirements_triton_linux_only():
    # Triton has wheels for Linux only: elsewhere `pip install -r requirements.txt` must skip it
    from packaging.requirements import Requirement  # pytest depends on packaging
    lines = (Path(__file__).resolve().parent / "requirements.txt").read_text().splitlines()
    reqs = {r.name: r for r in (Requirement(line.split(" #")[0]) for line in lines if line.strip())}
    assert {"torch", "numpy", "tiktoken", "triton", "pytest"} <= set(reqs)
    assert "2.5" in reqs["torch"].specifier
    for platform, wanted in [("linux", True), ("darwin", False), ("win32", False)]:
        assert reqs["triton"].marker.evaluate({"sys_platform": platform}) is wanted
    assert all(r.marker is None for name, r in reqs.items() if name != "triton")


def test_prepare_tiny_layout(tmp_path, monkeypatch):
    enc = _tokenizer_or_skip(monkeypatch)
    books = {
        "train": {10: "Chapter I.\n\nCall me Ishmael. " * 50, 9: "Short book.\r\nWith CRLF.\r\n",
                  123: "Ünïcødé — “quotes” and <|endoftext|> as plain text.\n", 7: ""},
        "validation": {5: "The valid book.\n" * 20},
        "test": {3: "The test book; the end.\n"},
    }
    # the real PG19 metadata.csv has no header row; titles may hold commas
    metadata = '9,"Short, Book",1900,http://x/9\n10,Moby Dick,1851,http://x/10\n5,Valid,1800,http://x/5\n'
    _write_books(tmp_path / "src", books, metadata)
    out = tmp_path / "out"
    meta = prepare_pg19.prepare(str(tmp_path / "src"), str(out), num_proc=2, log=lambda s: None)
    assert meta == json.loads((out / "meta.json").read_text())
    assert (meta["vocab_size"], meta["eot"], meta["dtype"]) == (50257, 50256, "uint16")
    assert meta["titles"]["9"] == "Short, Book" and meta["titles"]["10"] == "Moby Dick"
    for folder, name in [("train", "train"), ("validation", "val"), ("test", "test")]:
        m = meta["splits"][name]
        data = np.fromfile(out / f"{name}.bin", dtype=np.uint16)
        ids = sorted(books[folder])  # numeric order: 7, 9, 10, 123 (not "10" < "123" < "7" < "9")
        assert [b for b, _, _ in m["offsets"]] == ids
        assert m["books"] == len(ids)
        assert m["tokens"] == len(data) == sum(len(enc.encode_ordinary(books[folder][i])) + 1 for i in ids)
        for book_id, start, n in m["offsets"]:
            toks = data[start:start + n].tolist()
            assert toks[-1] == 50256 and 50256 not in toks[:-1]
            assert enc.decode(toks[:-1]) == books[folder][book_id]
    assert sorted(os.listdir(out)) == ["meta.json", "test.bin", "train.bin", "val.bin"]  # no temp files left

    # re-running one split keeps the others in meta.json
    meta2 = prepare_pg19.prepare(str(tmp_path / "src"), str(out), splits=("test",), num_proc=1, log=lambda s: None)
    assert meta2["splits"] == meta["splits"] and meta2["titles"] == meta["titles"]


def test_prepare_max_books(tmp_path, monkeypatch):
    _tokenizer_or_skip(monkeypatch)
    books = {"train": {i: f"Train book {i}.\n" * (i + 1) for i in (1, 2, 3, 10, 11)},
             "validation": {5: "The valid book.\n"}, "test": {6: "Test six.\n", 7: "Test seven.\n"}}
    _write_books(tmp_path / "src", books, "1,One,1900,u\n2,Two,1900,u\n10,Ten,1900,u\n")
    quiet = dict(num_proc=2, log=lambda s: None)
    full = prepare_pg19.prepare(str(tmp_path / "src"), str(tmp_path / "full"), **quiet)
    sub = prepare_pg19.prepare(str(tmp_path / "src"), str(tmp_path / "sub"), max_books=3, **quiet)
    # the first 3 by file name, as the bucket lists them (1.txt, 10.txt, 11.txt), tokenized in id order;
    # splits with fewer books are taken whole
    assert {n: [b for b, _, _ in m["offsets"]] for n, m in sub["splits"].items()} == \
        {"train": [1, 10, 11], "val": [5], "test": [6, 7]}
    assert sub["titles"] == {"1": "One", "10": "Ten"}  # only the books it holds
    for name, m in sub["splits"].items():  # every book's tokens as in the full run
        data = np.fromfile(tmp_path / "sub" / m["file"], dtype=np.uint16)
        full_data = np.fromfile(tmp_path / "full" / m["file"], dtype=np.uint16)
        where = {b: (start, n) for b, start, n in full["splits"][name]["offsets"]}
        for book_id, start, n in m["offsets"]:
            full_start, full_n = where[book_id]
            assert n == full_n and data[start:start + n].tolist() == full_data[full_start:full_start + n].tolist()
        assert m["tokens"] == len(data)
    with pytest.raises(ValueError, match="max_books=0"):
        prepare_pg19.prepare(str(tmp_path / "src"), str(tmp_path / "sub"), max_books=0, **quiet)
    with pytest.raises(SystemExit, match="--max_books=0"):
        prepare_pg19.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "sub"), "--max_books=0"])


def test_prepare_pg19_sample(tmp_path, monkeypatch):
    # a real PG19-layout folder (e.g. a few dozen books), named by env DRT_PG19_SAMPLE
    if not os.environ.get("DRT_PG19_SAMPLE"):
        pytest.skip("set DRT_PG19_SAMPLE to a folder laid out like PG19 to run this test")
    src = Path(os.environ["DRT_PG19_SAMPLE"])
    enc = _tokenizer_or_skip(monkeypatch)
    meta = prepare_pg19.prepare(str(src), str(tmp_path), num_proc=2, log=lambda s: None)
    for folder, name in prepare_pg19.SPLITS.items():
        m = meta["splits"][name]
        assert m["books"] == len(list((src / folder).glob("*.txt")))
        data = np.memmap(tmp_path / m["file"], dtype=np.uint16, mode="r")
        assert m["tokens"] == len(data) == sum(n for _, _, n in m["offsets"])
        assert int((data == 50256).sum()) == m["books"]
        assert int(data.max()) < 50257
        book_id, start, n = m["offsets"][-1]
        assert enc.decode(data[start:start + n - 1].tolist()) == (src / folder / f"{book_id}.txt").read_text("utf-8")
    if (src / "metadata.csv").is_file():
        import csv
        with open(src / "metadata.csv", newline="", encoding="utf-8") as f:
            rows = {r[0]: r[1] for r in csv.reader(f) if r}
        assert meta["titles"] and all(rows[i] == t for i, t in meta["titles"].items())


def test_prepare_errors(tmp_path, monkeypatch):
    _tokenizer_or_skip(monkeypatch)
    quiet = dict(num_proc=1, log=lambda s: None)
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        prepare_pg19.prepare(str(tmp_path / "no_such_dir"), str(tmp_path / "out"), **quiet)

    src = tmp_path / "src"
    _write_books(src, {"train": {1: "a"}, "validation": {2: "b"}})
    with pytest.raises(FileNotFoundError, match="test"):  # missing split folder
        prepare_pg19.prepare(str(src), str(tmp_path / "out"), **quiet)

    (src / "test").mkdir()
    (src / "test" / "notes.md").write_text("not a book")
    with pytest.raises(ValueError, match="no .txt files"):  # empty split
        prepare_pg19.prepare(str(src), str(tmp_path / "out"), **quiet)

    (src / "test" / "4.txt").write_bytes(b"caf\xe9 in latin-1\n")
    with pytest.raises(ValueError, match=r"4\.txt.*UTF-8"):  # the message names the file
        prepare_pg19.prepare(str(src), str(tmp_path / "out"), **quiet)

    (src / "test" / "4.txt").write_text("fine now")
    (tmp_path / "a_file").write_text("")
    for out in ("a_file", "a_file/out"):
        with pytest.raises(ValueError, match=r"output folder .*a_file(/out)? is a file, or inside one: pass --out"):
            prepare_pg19.prepare(str(src), str(tmp_path / out), **quiet)
    with pytest.raises(ValueError, match="not writable"):  # works as root too, unlike chmod
        prepare_pg19.prepare(str(src), "/proc/out", **quiet)
    for flag in ("--num_proc=0", "--num_proc=-1", "--download_workers=0"):
        with pytest.raises(SystemExit, match=rf"^prepare_pg19.py: error: {flag}: must be >= 1$"):
            prepare_pg19.main(["--source", str(src), "--out", str(tmp_path / "out"), flag])
    with pytest.raises(SystemExit, match=r"^prepare_pg19.py: error: GPT-2 ranks file .*README.md \(from "
                                         r"--tokenizer_file or DRT_GPT2_RANKS\) is not a tiktoken ranks file"):
        prepare_pg19.main(["--source", str(src), "--tokenizer_file", os.path.join(HERE, "README.md")])

    with pytest.raises(SystemExit, match="no_such_dir"):  # the CLI turns errors into one clear line
        prepare_pg19.main(["--source", str(tmp_path / "no_such_dir"), "--out", str(tmp_path / "out")])


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_prepare_ctrl_c(tmp_path, monkeypatch):
    """Ctrl-C (to the whole process group, as a terminal sends it) while the workers tokenize: one
    line, no traceback from the main process or a worker, exit 130, the old dataset as it was."""
    _tokenizer_or_skip(monkeypatch)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_books(src, {"train": {i: "Some perfectly fine text. " * 200 for i in range(1, 9)},
                       "validation": {1: "v"}, "test": {1: "t"}})
    prepare_pg19.prepare(str(src), str(out), num_proc=2, log=lambda s: None)
    before = _files(out)
    slow = ("import signal, sys, time, prepare_pg19 as p\nencode = p._encode_book\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as from a terminal (a background job ignores it)
            "def _encode_book(path):\n    time.sleep(0.5)\n    return encode(path)\n"
            "_encode_book.__module__ = 'prepare_pg19'\np._encode_book = _encode_book\np.main(sys.argv[1:])")
    proc = start_run([sys.executable, "-c", slow, "--source", str(src), "--out", str(out), "--num_proc=2"])
    try:
        read_until(proc.stdout, r"check: ")  # then 5 s of tokenizing
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    assert proc.returncode == 130 and err.strip().count("\n") == 0, err
    assert re.match(r"prepare_pg19.py: interrupted: .*out keeps the dataset it had", err), err
    assert _files(out) == before


def test_prepare_failed_rerun_keeps_old_dataset(tmp_path, monkeypatch):
    _tokenizer_or_skip(monkeypatch)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_books(src, {"train": {i: "Some perfectly fine text. " * 200 for i in range(1, 9)},
                       "validation": {1: "v"}, "test": {1: "t"}})
    prepare_pg19.prepare(str(src), str(out), num_proc=2, log=lambda s: None)
    before = _files(out)
    assert sorted(before) == ["meta.json", "test.bin", "train.bin", "val.bin"]
    (src / "train" / "5.txt").write_text("Changed. " * 300)  # a rewrite of train.bin would show

    # bad books in test/, the last split: found before anything is tokenized or written, all named
    (src / "test" / "98.txt").write_bytes(b"\xc3")
    (src / "test" / "99.txt").write_bytes(b"fine start, then \xff\xfe garbage")
    lines = []
    with pytest.raises(ValueError, match=r"2 of 12 books cannot be used: .*98\.txt is not valid UTF-8.*99\.txt"):
        prepare_pg19.prepare(str(src), str(out), num_proc=2, log=lines.append)
    assert lines and all(line.startswith("check:") for line in lines)  # checked, nothing tokenized
    assert _files(out) == before  # bit-identical, no temp files
    with pytest.raises(SystemExit, match="99.txt"):
        prepare_pg19.main(["--source", str(src), "--out", str(out), "--num_proc=1"])
    assert _files(out) == before

    # interrupted (Ctrl-C) while tokenizing test/: the old dataset stays, the temp files go
    (src / "test" / "98.txt").unlink()
    (src / "test" / "99.txt").unlink()
    encode = prepare_pg19._encode_book

    def interrupted(path):
        if Path(path).parent.name == "test":
            raise KeyboardInterrupt
        return encode(path)
    monkeypatch.setattr(prepare_pg19, "_encode_book", interrupted)  # num_proc=1: tokenizes in this process
    with pytest.raises(KeyboardInterrupt):
        prepare_pg19.prepare(str(src), str(out), num_proc=1, log=lambda s: None)
    assert _files(out) == before
    monkeypatch.setattr(prepare_pg19, "_encode_book", encode)

    # killed between the renames: train.bin and val.bin are new, test.bin old, so no meta.json at all
    replace = os.replace

    def killed(a, b):
        if os.path.basename(b) == "test.bin":
            raise OSError("killed")
        replace(a, b)
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError, match="killed"):
        prepare_pg19.prepare(str(src), str(out), num_proc=1, log=lambda s: None)
    monkeypatch.setattr(os, "replace", replace)
    after = _files(out)
    assert sorted(after) == ["test.bin", "train.bin", "val.bin"]  # incomplete: no meta.json, no temp files
    assert after["test.bin"] == before["test.bin"] and after["train.bin"] != before["train.bin"]


@pytest.fixture
def fake_bucket():
    """start(files) serves {name: bytes} the way the GCS JSON API and bucket do (2 items per
    listing page) and returns (download_pg19 kwargs, names fetched, listings asked as (prefix, page))."""
    servers = []

    def start(files, fail_once=()):
        fetched, listed, fail_once = [], [], set(fail_once)

        class Bucket(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                from urllib.parse import urlparse, parse_qs, unquote
                u = urlparse(self.path)
                if u.path == "/storage/v1/b/bkt/o":  # listing, 2 items per page
                    q = parse_qs(u.query)
                    listed.append((q["prefix"][0], q.get("pageToken", [None])[0]))
                    names = sorted(n for n in files if n.startswith(q["prefix"][0]))
                    start = int(q.get("pageToken", ["0"])[0])
                    page = {"items": [{"name": n, "size": str(len(files[n]))} for n in names[start:start + 2]]}
                    if start + 2 < len(names):
                        page["nextPageToken"] = str(start + 2)
                    body = json.dumps(page).encode()
                else:
                    name = unquote(u.path[len("/bkt/"):])
                    fetched.append(name)
                    if name in fail_once:
                        fail_once.discard(name)
                        self.send_error(503)
                        return
                    body = files[name]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bucket)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        base = f"http://127.0.0.1:{server.server_address[1]}"
        return dict(api_url=f"{base}/storage/v1/b/bkt/o", base_url=f"{base}/bkt", backoff=0.0), fetched, listed

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_download_fake_bucket(tmp_path, fake_bucket):
    files = {f"train/{i}.txt": f"train book {i}\n".encode() * (i + 1) for i in (1, 2, 3, 10, 11)}
    files.update({"validation/5.txt": b"val\n", "test/6.txt": "tést\n".encode(), "metadata.csv": b"1,One,1900,u\n"})
    kw, fetched, listed = fake_bucket(files, fail_once={"train/3.txt"})  # one transient 503 to exercise the retry
    kw.update(workers=4, log=lambda s: None)
    raw = tmp_path / "raw"
    # a .part from an interrupted download, and a truncated file under its final name
    (raw / "train").mkdir(parents=True)
    (raw / "train" / "2.txt.part").write_bytes(files["train/2.txt"][:5])
    (raw / "train" / "10.txt").write_bytes(files["train/10.txt"][:7])
    assert prepare_pg19.download_pg19(str(raw), **kw) == len(files)
    got = {str(p.relative_to(raw)): p.read_bytes() for p in raw.rglob("*") if p.is_file()}
    assert got == files  # every file whole, no .part left
    assert sorted(fetched) == sorted(list(files) + ["train/3.txt"])  # 3.txt twice: the retry

    fetched.clear()
    assert prepare_pg19.download_pg19(str(raw), **kw) == 0  # resume: nothing to fetch
    assert fetched == []

    # max_books: the first N .txt of each split in listing (name) order, and no more listing pages than
    # needed. Train lists as 1, 10 | 11, 2 | 3 (2 a page): 1 book takes page one, 3 books pages one and two
    raw = tmp_path / "raw_small"
    listed.clear()
    fetched.clear()
    assert prepare_pg19.download_pg19(str(raw), max_books=1, **kw) == 4
    assert sorted(fetched) == ["metadata.csv", "test/6.txt", "train/1.txt", "validation/5.txt"]
    assert [page for prefix, page in listed if prefix == "train/"] == [None]
    listed.clear()
    fetched.clear()
    assert prepare_pg19.download_pg19(str(raw), max_books=3, **kw) == 2  # the rest was there already
    assert sorted(fetched) == ["train/10.txt", "train/11.txt"]
    assert [page for prefix, page in listed if prefix == "train/"] == [None, "2"]
    got = {str(p.relative_to(raw)): p.read_bytes() for p in raw.rglob("*") if p.is_file()}
    assert got == {n: files[n] for n in ["metadata.csv", "test/6.txt", "train/1.txt", "train/10.txt",
                                         "train/11.txt", "validation/5.txt"]}


def test_download_max_books_then_prepare(tmp_path, monkeypatch, capsys, fake_bucket):
    # the CLI end to end: --max_books downloads N books of each split, tokenizes just those,
    # and a second run fetches nothing
    _tokenizer_or_skip(monkeypatch)
    files = {f"train/{i}.txt": f"Train book {i}.\n".encode() * i for i in (1, 2, 3, 10, 11)}
    files.update({f"test/{i}.txt": f"Test book {i}.\n".encode() for i in (6, 7, 8)})
    files.update({"validation/5.txt": b"The valid book.\n", "metadata.csv": b"10,Ten,1900,u\n"})
    kw, fetched, listed = fake_bucket(files)
    download = prepare_pg19.download_pg19
    monkeypatch.setattr(prepare_pg19, "download_pg19", lambda *a, **k: download(*a, **k, **kw))
    argv = ["--max_books=2", "--raw_dir", str(tmp_path / "raw"), "--out", str(tmp_path / "out"), "--num_proc=1"]
    prepare_pg19.main(argv)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert {n: [b for b, _, _ in m["offsets"]] for n, m in meta["splits"].items()} == \
        {"train": [1, 10], "val": [5], "test": [6, 7]}
    assert meta["titles"] == {"10": "Ten"}
    assert sorted(fetched) == ["metadata.csv", "test/6.txt", "test/7.txt", "train/1.txt", "train/10.txt",
                               "validation/5.txt"]
    log = capsys.readouterr().out
    assert "download: 6 files listed, 0 already present, 6 to fetch" in log and "check: 5/5 books" in log
    assert "train: 2/2 books" in log and "done in" in log

    fetched.clear()
    prepare_pg19.main(argv)
    assert fetched == []
    assert "download: 6 files listed, 6 already present, 0 to fetch" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta


# -----------------------------------------------------------------------------
# benchmarks (bench.py): with nothing to do, or nothing they can do, they say so and fail


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to do: pass --kernel, --train, --long, or several"),
    (["--train", "--steps=0"], "--steps=0: must be >= 1"),
    (["--kernel", "--rep=0"], "--rep=0: must be >= 1"),
    (["--long", "--lengths=4Q"], "--lengths='4Q': expected a list"),
    (["--long", "--n_embd=100"], "--n_embd=100: must be a multiple of 64"),
    (["--train", "--model=n_embd=64"], "--model='n_embd=64': expected a dict"),
    (["--long", "--lengths=0", "--device=cpu"], "--lengths=0: every length must be at least 1 token"),
    (["--train", "--model={'nope': 1}", "--device=cpu"], "--model: 'nope' cannot be set: give DRTConfig's fields but"),
    (["--train", "--model={'groups': ()}", "--device=cpu"], "--model: 'groups' cannot be set"),
], ids=["nothing to do", "steps", "rep", "lengths", "n_embd", "model", "lengths-zero", "model-key", "model-case-key"])
def test_bench_usage_errors(argv, message, capsys):
    import bench
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage:") and f"error: {message}" in err


@pytest.mark.parametrize("mode", ["--kernel", "--train", "--long"])
def test_bench_without_gpu(mode, monkeypatch):
    """No GPU: each mode of bench.py fails in one line (nothing was timed) and names the CPU kernel
    tests, which exist."""
    import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.main([mode])
    msg = str(e.value.code)
    assert msg.startswith("bench.py: error: no CUDA GPU") and "\n" not in msg
    k = re.search(r"python -m pytest -q test_gca.py -k (\w+)$", msg).group(1)
    assert [n for n in globals() if n.startswith("test_flash_gca") and k in n]  # run on a CPU, not CUDA-only


def test_bench_long_checks_lengths(monkeypatch):
    """bench.py --long refuses, before streaming, what sample.py refuses: past 64M tokens, or chunk memory
    past what is available."""
    import bench
    monkeypatch.setattr(bench, "DRT", lambda cfg: pytest.fail("started"))
    with pytest.raises(SystemExit, match=r"^bench.py: error: --lengths: 1024M tokens is past the 64M DRT's streams"):
        bench.main(["--long", "--device=cpu", "--lengths=64K,1G"])
    monkeypatch.setattr(common, "available_mem", lambda: 10**6)
    with pytest.raises(SystemExit, match=r"^bench.py: error: --lengths: a 64K-token prompt holds 0.14 GB of chunk "
                                         r"keys/values in host memory, and 0.00 GB are available: use shorter lengths$"):
        bench.main(["--long", "--device=cpu", "--lengths=64K"])


def test_bench_cuda_device_has_an_index(monkeypatch):
    """bench.py --device=cuda (the default) selects the GPU with an index: torch.cuda.set_device
    refuses a bare 'cuda'. Checked through torch's own index check, with a pretend GPU."""
    import bench
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(torch.cuda._utils._get_device_index(d)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "pretend GPU")
    monkeypatch.setattr(bench, "bench_long", lambda args, dev: seen.append(dev))
    bench.main(["--long"])
    assert seen == [0, torch.device("cuda", 0)]


def test_bench_kernel_inputs():
    """bench.py --kernel's shapes are in the kernel tests' order (B, C, M, S, H, D, K, dtype, note), the
    first one DRT's training shape, and its naive path (what FlashGCA is timed against) is the reference GCA."""
    import bench
    cfg = DRTConfig()
    B, C, M, S, H, D, K = bench.SHAPES[0][:7]
    assert (C, M, S, H, D, K) == (16380 // (cfg.chunk_size - 1),) * 2 + (cfg.chunk_size, cfg.n_head,
                                                                          cfg.n_embd // cfg.n_head, cfg.topk)
    shape = (2, 5, 5, 8, 2, 16, 3, torch.float32, "hot")
    q, k, v, idx, w, do = bench.make_inputs(shape, seed=int(torch.randint(1 << 30, ())), device="cpu")
    assert q.shape == do.shape == (2, 5, 8, 2, 16) and k.shape == v.shape == (2, 5, 8, 2, 16) and idx.shape == (2, 5, 3)
    assert (idx[:, 1:, 0] == 0).all() and (w[:, 0] == 0).all()  # hot: chunk 0 first; chunk 0 has nothing to pick
    assert rel_err(bench.gca_naive(q, k, v, idx, w), gca_reference(q, k, v, idx, w)) < 1e-5


# -----------------------------------------------------------------------------
# the code corpus (prepare_code.py): a made-up Linux-like tree, documents per directory


def _code_tree(root):
    """A tree with a document for each rule of prepare_code.py -> {directory: what it must give}."""
    import prepare_code as pc
    def big(tag, kib):  # a file of kib KiB or a line more
        line = f"int {tag}(void) {{ return 0; }}\n"
        return line * (kib * 1024 // len(line) + 1)
    by_split = {}  # the first directories d0, d1, ... whose sha1 falls in each split (reserved: None)
    for i in range(200):
        by_split.setdefault(pc.split_of(f"lib/d{i}"), f"lib/d{i}")
    files = {
        "kernel/sched": {"b.c": big("b", 120), "a.c": big("a", 60), "z.h": big("z", 30), "c.h": big("c", 30),
                         "notes.txt": "not code", "Makefile": "obj-y += a.o"},
        "kernel/big": {f"f{i}.c": big(f"f{i}", 250) for i in range(12)},  # 12 x 250 KiB: the 2 MiB cap stops it
        "kernel/skip": {"huge.c": big("huge", 300), "latin1.c": b"caf\xe9 " * 80000, "ok.c": big("ok", 210)},
        "kernel/small": {"s.c": big("s", 150)},  # under the 200 KiB floor
        "arch/x86/kernel": {"x.c": big("x", 250)}, "tools/perf": {"p.c": big("p", 250)},
        "drivers/gpu/drm/amd/include/asic": {"r.h": big("r", 250)},
        "drivers/gpu/drm/amd/display": {"d.c": big("d", 250)},  # beside the excluded include/: kept
        **{d: {"m.c": big(d.replace("/", "_"), 210)} for d in by_split.values()},
    }
    for d, fs in files.items():
        (root / d).mkdir(parents=True, exist_ok=True)
        for name, text in fs.items():
            (root / d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    (root / "kernel/skip/link.c").symlink_to(root / "kernel/skip/ok.c")  # a link is no file of its own
    return files, by_split


def test_code_corpus_builder(tmp_path):
    """prepare_code.py's rules on a made-up tree: excluded folders, .h then .c in name order with their
    headers, files over 256 KiB / not UTF-8 / links skipped, the 2 MiB cap, the 200 KiB floor, the split
    rule with the reserved range written nowhere, and the same documents from the folder and its .tar.xz."""
    import tarfile

    import prepare_code as pc
    files, by_split = _code_tree(tmp_path / "linux-6.12")
    counts = pc.build(str(tmp_path / "linux-6.12"), str(tmp_path / "raw"), log=lambda s: None)
    written = {p.relative_to(tmp_path / "raw").as_posix(): p.read_text() for p in (tmp_path / "raw").rglob("*.txt")}
    where = {name.split("/")[1][:-4].replace("__", "/"): name.split("/")[0] for name in written}
    assert "kernel/small" not in where and not any(d.startswith(("arch", "tools", "drivers/gpu/drm/amd/include")) for d in where)
    assert by_split[None] not in where  # reserved: written nowhere
    for split in ("train", "validation", "test"):
        assert where[by_split[split]] == split
    for d in ("kernel/sched", "kernel/big", "kernel/skip", "drivers/gpu/drm/amd/display"):
        assert where[d] == pc.split_of(d)
    doc = lambda d: written[f"{where[d]}/{d.replace('/', '__')}.txt"]  # noqa: E731
    sched = doc("kernel/sched")
    heads = re.findall(r"^// file: (.*)$", sched, re.M)
    assert heads == ["kernel/sched/c.h", "kernel/sched/z.h", "kernel/sched/a.c", "kernel/sched/b.c"]
    assert sched == "\n".join(f"// file: kernel/sched/{n}\n{files['kernel/sched'][n]}" for n in ("c.h", "z.h", "a.c", "b.c"))
    big = doc("kernel/big")
    n_files = len(re.findall(r"^// file: ", big, re.M))
    assert len(big) > pc.DOC_CAP and n_files < 12  # stopped once past 2 MiB ...
    assert len(big.rsplit("\n// file: ", 1)[0]) <= pc.DOC_CAP  # ... and not before
    assert re.findall(r"^// file: (.*)$", doc("kernel/skip"), re.M) == ["kernel/skip/ok.c"]
    assert counts == {"train": sum(s == "train" for s in where.values()), "validation": sum(s == "validation" for s in where.values()),
                      "test": sum(s == "test" for s in where.values()), "reserved": 1}
    meta_rows = (tmp_path / "raw/metadata.csv").read_text().splitlines()
    assert meta_rows[0] == "_id,directory" and "kernel__sched,kernel/sched" in meta_rows
    # the archive of the same tree gives the same bytes; a second build replaces the first whole
    (tmp_path / "kernel/skip").mkdir(parents=True)
    with tarfile.open(tmp_path / "linux.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "linux-6.12", arcname="linux-source-6.12")
    pc.build(str(tmp_path / "linux.tar.xz"), str(tmp_path / "raw"), log=lambda s: None)
    again = {p.relative_to(tmp_path / "raw").as_posix(): p.read_text() for p in (tmp_path / "raw").rglob("*.txt")}
    assert again == written and not (tmp_path / "raw.tmp").exists()
    with pytest.raises(ValueError, match="no directory holds 200 KiB"):
        pc.build(str(tmp_path / "kernel"), str(tmp_path / "raw2"), log=lambda s: None)
    with pytest.raises(FileNotFoundError, match="expected a Linux source tree"):
        pc.build(str(tmp_path / "nope"), str(tmp_path / "raw2"), log=lambda s: None)


def test_code_corpus_trains_and_scores(tmp_path, monkeypatch, capsys):
    """prepare_code.py end to end on a made-up tree: tokenized as PG19 is, read by train.py, scored by
    sample.py --ppl with the documents named by their directories."""
    import prepare_code as pc
    import sample
    _tokenizer_or_skip(monkeypatch)
    _code_tree(tmp_path / "tree")
    out = tmp_path / "code"
    pc.main(["--source", str(tmp_path / "tree"), "--out", str(out), "--num_proc=1", "--max_books=2"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["books"] == 2
    assert all(meta["titles"][b] == b.replace("__", "/") for m in meta["splits"].values() for b, _, _ in m["offsets"])
    names = [name for name, _ in sample.read_docs(str(out / "test.bin"), enc=None)]
    assert names == [b for b, _, _ in meta["splits"]["test"]["offsets"]]  # named as in meta.json: its directory
    small = ["--n_embd=32", "--n_head=2", "--n_lower=1", "--groups=(1,)", "--n_enc=1", "--window=128", "--topk=2",
             "--batch_size=2", "--block_size=252", "--tokens_per_step=0", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
             "--log_interval=1", "--device=cpu"]
    hist = train.main([*small, "--dataset=code", f"--data_dir={out}", f"--out_dir={tmp_path / 'run'}"])
    assert [it for it, _ in hist] == [1, 2]
    capsys.readouterr()
    sample.main([f"--out_dir={tmp_path / 'run'}", "--ppl", f"--docs={out}/test.bin", "--max_tokens=2000", "--device=cpu"])
    text = capsys.readouterr().out
    assert re.search(r"^\s+1K-4K\s+976\s+\d+\.\d\d$", text, re.M)  # tokens 1,024-1,999 predicted


@pytest.mark.parametrize("read_next", [False, True])
def test_teacher_picks(read_next):
    """teacher_iters' picks: for landmark t, the readable chunks before t sharing the most idf-weighted ids with
    chunk t+1, as the picks Eq. 1 would make (under read_next, the chunk before each): a chunk that
    recurs is read for its repeat, and no pick reads chunk t or later."""
    cfg = DRTConfig(vocab_size=64, landmark_id=63, n_embd=32, n_head=4, n_lower=1, groups=(1,), chunk_size=4,
                    window=8, topk=2, read_next=read_next)
    T, first = cfg.chunk_size - 1, int(read_next)
    chunks = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [4, 5, 6], [10, 11, 12], [7, 8, 13], [20, 21]]  # 3 repeats 1, 5 shares 7, 8 with 2
    idx = torch.tensor([sum(chunks, [])])
    picks = train.teacher_picks(idx, cfg)  # (1, 6, 2): the 6 complete chunks' landmarks
    assert picks.shape == (1, 6, 2)
    reads = torch.where(picks >= 0, picks + first, picks)[0]
    assert reads[2, 0] == 1 and reads[4, 0] == 2  # chunk 3 reads its source, chunk 5 the chunk sharing 7, 8
    t = torch.arange(6)[:, None]
    assert ((reads == -1) | ((reads >= first) & (reads < t))).all()  # only chunks before t, and readable
    assert (reads[0] == -1).all() and (reads[1, 1] == -1) and (reads[1, 0] == (-1 if read_next else 0))
    assert len(set(reads[5].tolist())) == 2  # K distinct chunks where K are readable


def test_teacher_iters_feed_training_only(tmp_path, monkeypatch):
    """teacher_iters: the first steps' training forwards read teacher_picks; later steps, evaluation and
    the checkpoint use Eq. 1 alone (hand_picks is None again)."""
    seen, orig = [], DRT.retrieve

    def spy(self, *a, **k):
        seen.append((self.training, self.hand_picks is not None))
        return orig(self, *a, **k)
    monkeypatch.setattr(DRT, "retrieve", spy)
    train.main(tiny_args(tmp_path, "t", "--teacher_iters=2", "--max_iters=4", "--eval_interval=4",
                         "--eval_iters=1"))
    training = [handed for is_training, handed in seen if is_training]
    assert training == [True, True, False, False]  # one group, one micro-batch a step
    assert not any(handed for is_training, handed in seen if not is_training)
