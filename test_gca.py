"""
Tests for DRT: the model (model.py), the FlashGCA kernel (gca_kernel.py), data preparation
(prepare_pg19.py), training (train.py) and inference (sample.py).

    python -m pytest -q test_gca.py            # CPU: the kernel runs under TRITON_INTERPRET=1
    python -m pytest -q test_gca.py -k kernel  # on a GPU the kernel tests run natively (and in bf16)

Every test draws fresh random inputs; models are tiny so the file runs in minutes on 2 cores.
"""

import math

import pytest
import torch

from model import DRT, DRTConfig, alibi_bias, alibi_slopes, gca_reference, retrieve, softmax_off_by_one
from model import topk_earlier, window_attention

# -----------------------------------------------------------------------------
# helpers


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


# -----------------------------------------------------------------------------
# the model: causality, gradients, Gumbel, lengths


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


def test_retrieval_weights_use_clean_scores():
    """Training: picks come from noisy scores, weights from the clean ones (Eq. 1, 3)."""
    torch.manual_seed(4)
    cfg = tiny_config(topk=4)
    B, M, C = 2, 30, cfg.n_embd
    landmarks, q = torch.randn(B, M, C), torch.randn(B, M, C)
    chunk_ids = torch.arange(M)
    idx, w = retrieve(q, landmarks, chunk_ids, cfg, training=True)
    clean_idx, _ = retrieve(q, landmarks, chunk_ids, cfg, training=False)
    assert not torch.equal(idx, clean_idx), "Gumbel noise changed no pick"
    b = torch.arange(B)[:, None, None]
    r = (q[:, :, None] * landmarks[b, idx]).sum(-1) / math.sqrt(C)
    eligible = (torch.arange(cfg.topk)[None, None, :] < chunk_ids[None, :, None]).expand(B, -1, -1)  # t earlier chunks
    expect = softmax_off_by_one(r.masked_fill(~eligible, float("-inf")))
    torch.testing.assert_close(w, expect)
    assert (idx[eligible] < chunk_ids[None, :, None].expand_as(idx)[eligible]).all(), "picked a later chunk"
    assert (w[~eligible] == 0).all() and (w[:, :2].sum(-1) <= 1).all()


def test_topk_blockwise_equals_full():
    torch.manual_seed(5)
    q, landmarks = torch.randn(2, 40, 16), torch.randn(2, 100, 16)
    ids = torch.randint(0, 100, (40,))
    full = topk_earlier(q, landmarks, ids, 6, block=1000)
    for block in (7, 33):
        got = topk_earlier(q, landmarks, ids, 6, block=block)
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
    s = (q @ landmarks.transpose(1, 2)).masked_fill(torch.arange(100)[None, None] >= ids[None, :, None], -1e30)
    want = s.topk(6, -1).indices
    elig = full[1]
    assert torch.equal(full[0][elig], want[elig])


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


@pytest.mark.parametrize("groups", [(2,), (1, 1), ()], ids=["G1", "G2", "baseline"])
def test_configs_train(groups):
    model = tiny_model(groups=groups, dtype=torch.float32).train()
    idx = tokens(model.config, 2, 10 * 7 + 3, seed=6)
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 73, 96) and torch.isfinite(loss)
    loss.backward()
    if not groups:
        assert model.encoder is None and len(model.upper) == 0


def test_loss_without_logits():
    """return_logits=False (training) gives the same loss, and its gradients, from the targeted positions only."""
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


def test_default_config_is_146M():
    """DESIGN §2 defaults build the paper's 146M DRT; groups=() is the baseline of the same depth."""
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


# -----------------------------------------------------------------------------
# GCA: the reference against a loop over every (batch, chunk, pick, head, query)


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
# inference: incremental decoding, segmented prefill, offload


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


def test_generate_odd_prompt():
    model = tiny_model(dtype=torch.float32).eval()
    for T in (1, 13, 50):
        out = model.generate(tokens(model.config, 1, T, seed=T), 10, temperature=1.0, top_k=5, prefill_segment=9)
        assert out.shape == (1, 10) and (out < model.config.landmark_id).all()


# -----------------------------------------------------------------------------
# the model on a GPU (skipped without CUDA): kernel vs reference inside the model, pinned offload

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_model_kernel_equals_reference():
    """The whole model, forward and every gradient, with FlashGCA vs the PyTorch GCA."""
    import model as drt
    torch.manual_seed(13)
    m = DRT(tiny_config(n_embd=128, n_head=2, chunk_size=16, window=32, groups=(1, 1))).cuda()
    idx = tokens(m.config, 2, 20 * 15, seed=13).cuda()
    out = {}
    for impl in ("triton", "torch"):
        drt.GCA_IMPL = impl
        torch.manual_seed(14)  # the same Gumbel noise for both
        logits, loss = m(idx, idx)
        m.zero_grad()
        loss.backward()
        out[impl] = [logits] + [p.grad.clone() for p in m.parameters()]
    drt.GCA_IMPL = "auto"
    for a, b in zip(out["triton"], out["torch"]):
        assert rel_err(a, b) < 1e-4


@cuda
def test_cuda_offload_equals_device():
    """Pinned host memory + non-blocking copies give the on-device logits, segment by segment."""
    torch.manual_seed(15)
    m = DRT(tiny_config(n_embd=128, n_head=2, chunk_size=16, window=32, groups=(1, 1))).cuda().eval()
    idx = tokens(m.config, 1, 700, seed=15).cuda()
    with torch.no_grad():
        full = all_logits(m, idx)
        for offload in (False, True):
            state = m.new_state(offload=offload)
            cuts = [0, 100, 101, 333, 600, 700]
            parts = torch.cat([all_logits(m, idx[:, a:b], state) for a, b in zip(cuts, cuts[1:])], 1)
            assert rel_err(parts, full) < 1e-5, offload
            steps = torch.cat([m(idx[:, t : t + 1], state=state)[0] for t in range(20)], 1)
            assert torch.isfinite(steps).all()
        assert state.memory.host_k and state.memory.host_k[0].is_pinned()
