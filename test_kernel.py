"""
Tests of FlashGCA (gca_kernel.py) against a naive PyTorch GCA in fp32: the
output and all four gradients (q, k_mem, v_mem, w), on fresh random inputs.

    python -m pytest -q test_kernel.py

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1 is
set below, before triton is imported), in fp32 and fp16 only: the interpreter's
tl.dot returns garbage on bf16. With CUDA they run natively, bf16 included.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402

import gca_kernel  # noqa: E402
from gca_kernel import flash_gca  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # max relative error


def gca_naive(q, k_mem, v_mem, idx, w):
    """Gather the picked chunks, one softmax per (chunk, pick, head), weighted sum."""
    B, C, S, H, D = q.shape
    k = k_mem[torch.arange(B, device=q.device)[:, None, None], idx]  # (B, C, K, S, H, D)
    v = v_mem[torch.arange(B, device=q.device)[:, None, None], idx]  # (B, C, K, S, H, D)
    s = torch.einsum("bcshd,bckthd->bchkst", q, k) / math.sqrt(D)  # (B, C, H, K, S, S)
    p = s.float().softmax(-1).to(q.dtype) * w[:, :, None, :, None, None].to(q.dtype)
    return torch.einsum("bchkst,bckthd->bcshd", p, v)  # (B, C, S, H, D)


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


def rel(x, ref):
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


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
    o_ref = gca_naive(ref_ins[0], ref_ins[1], ref_ins[2], idx, ref_ins[3])
    ref_grads = torch.autograd.grad(o_ref, ref_ins, do.float())

    assert o.dtype == dtype and o.shape == (B, C, S, H, D)
    errs = {"o": rel(o, o_ref)}
    for name, x, g, r in zip(("dq", "dk", "dv", "dw"), ins, grads, ref_grads):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        errs[name] = rel(g, r)
    zero_w = w == 0
    if zero_w.any():  # dw_i = <dO, O_i> whatever w_i is
        errs["dw[w=0]"] = rel(grads[3][zero_w], ref_grads[3][zero_w])
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
    (dq_ref,) = torch.autograd.grad(gca_naive(q_ref, k, v, idx, w), (q_ref,), do)
    assert rel(dq, dq_ref) < 1e-4


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
