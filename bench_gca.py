"""
Benchmark FlashGCA (gca_kernel.py) against the naive PyTorch GCA (gather the
picked chunks, einsum, softmax): time, TFLOP/s and peak extra memory, forward
and forward+backward. CUDA only.

    python bench_gca.py             # the table
    python bench_gca.py --check     # first: errors vs an fp32 reference at the training shape
    python bench_gca.py --sweep     # first: try num_warps/num_stages per kernel, print the best

FLOPs (model FLOPs, the flash-attention convention): fwd = 4*B*C*K*H*S*S*D
(per pick, q k^T and p v, 2 flops per multiply-add); fwd+bwd = 3.5 * fwd (bwd
counted as 2.5 * fwd). The kernels execute more: the backward recomputes
q k^T and dO v^T in both of its kernels, 7 matmuls against the convention's 5.
Time: triton.testing.do_bench median, 25 ms warmup, 100 ms rep. Memory: peak
torch.cuda.max_memory_allocated above what was allocated before the call
(forward: with autograd on, so it includes the saved tensors).
"""

import argparse
import functools
import math
import sys

import torch

DEVICE = "cuda"
# (B, C, M, H, D, S, K, dtype, note): DRT's training shape first (4 x 16380
# tokens = 4 x 260 chunks of 63 + 1, 12 heads of 64, top-8)
SHAPES = [
    (4, 260, 260, 12, 64, 64, 8, torch.bfloat16, "DRT training"),
    (4, 260, 260, 12, 64, 64, 8, torch.float16, ""),
    (4, 260, 260, 12, 64, 64, 8, torch.bfloat16, "hot chunk 0"),
    (4, 260, 260, 12, 64, 64, 1, torch.bfloat16, ""),
    (4, 260, 260, 12, 64, 64, 16, torch.bfloat16, ""),
    (4, 260, 260, 24, 32, 64, 8, torch.bfloat16, ""),
    (4, 260, 260, 6, 128, 64, 8, torch.bfloat16, ""),
]


def gca_naive(q, k_mem, v_mem, idx, w):
    """The PyTorch path: gathered copies of the picked K/V, softmax in fp32."""
    B, C, S, H, D = q.shape
    k = k_mem[torch.arange(B, device=q.device)[:, None, None], idx]  # (B, C, K, S, H, D)
    v = v_mem[torch.arange(B, device=q.device)[:, None, None], idx]  # (B, C, K, S, H, D)
    s = torch.einsum("bcshd,bckthd->bchkst", q, k) / math.sqrt(D)  # (B, C, H, K, S, S)
    p = s.float().softmax(-1).to(q.dtype) * w[:, :, None, :, None, None].to(q.dtype)
    return torch.einsum("bchkst,bckthd->bcshd", p, v)  # (B, C, S, H, D)


def make_inputs(B, C, M, H, D, S, K, dtype, hot=False, seed=0):
    """Random q/k/v; each query chunk c picks K random chunks among those < c
    (weight 0 for the picks it does not have: chunk c has only c eligible)."""
    torch.manual_seed(seed)
    dev = DEVICE
    q = torch.randn(B, C, S, H, D, device=dev, dtype=dtype)
    k = torch.randn(B, M, S, H, D, device=dev, dtype=dtype)
    v = torch.randn(B, M, S, H, D, device=dev, dtype=dtype)
    score = torch.randn(B, C, M, device=dev)  # stand-in retrieval scores
    eligible = torch.arange(M, device=dev)[None, :] < torch.arange(C, device=dev)[:, None]  # (C, M)
    if hot:
        score[:, :, 0] += 100.0  # everyone's favourite chunk
    top, idx = score.masked_fill(~eligible, -math.inf).topk(K, dim=-1)  # (B, C, K)
    w = torch.rand(B, C, K, device=dev) * top.isfinite()  # weight 0 for ineligible picks
    do = torch.randn(B, C, S, H, D, device=dev, dtype=dtype)
    return q, k, v, idx, w, do


def peak_extra_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def rel(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


def check(flash_gca):
    """Kernel vs the naive path in fp32, at the training shape: o and all grads."""
    B, C, M, H, D, S, K = SHAPES[0][:7]
    ok = True
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, idx, w, do = make_inputs(B, C, M, H, D, S, K, dtype, seed=1)
        w[0, -1, 0] = 0.0  # an eligible pick with weight 0: its dw must still be right
        ins = [x.clone().requires_grad_() for x in (q, k, v, w)]
        o = flash_gca(ins[0], ins[1], ins[2], idx, ins[3])
        grads = torch.autograd.grad(o, ins, do)
        ref_ins = [x.float().requires_grad_() for x in (q, k, v, w)]
        o_ref = gca_naive(ref_ins[0], ref_ins[1], ref_ins[2], idx, ref_ins[3])
        ref_grads = torch.autograd.grad(o_ref, ref_ins, do.float())
        errs = {"o": rel(o, o_ref)}
        errs.update({n: rel(g, r) for n, g, r in zip(("dq", "dk", "dv", "dw"), grads, ref_grads)})
        bad = [n for n, e in errs.items() if not e < tol[dtype]]
        ok &= not bad
        print(f"check {str(dtype)[6:]:8s} " + "  ".join(f"{n} {e:.2e}" for n, e in errs.items())
              + ("  OK" if not bad else f"  FAIL ({', '.join(bad)} above {tol[dtype]:.0e})"))
        del ins, grads, ref_ins, o_ref, ref_grads
    return ok


def sweep(gca_kernel, do_bench):
    """Try launch parameters per kernel at the training shape; print the best."""
    B, C, M, H, D, S, K, dtype = SHAPES[0][:8]
    q, k, v, idx, w, do = make_inputs(B, C, M, H, D, S, K, dtype)
    q1, k1, v1 = (x.clone().requires_grad_() for x in (q, k, v))
    runs = {  # which kernel each needs_input_grad pattern exercises
        "FWD_CONFIG": lambda: gca_kernel.flash_gca(q, k, v, idx, w),
        "DQ_CONFIG": lambda: torch.autograd.grad(gca_kernel.flash_gca(q1, k, v, idx, w), q1, do),
        "DKDV_CONFIG": lambda: torch.autograd.grad(gca_kernel.flash_gca(q, k1, v1, idx, w), (k1, v1), do),
    }
    for name, fn in runs.items():
        config = getattr(gca_kernel, name)
        default = dict(config)
        results = []
        for num_warps in (2, 4, 8):
            for num_stages in (1, 2, 3, 4):
                config.update(num_warps=num_warps, num_stages=num_stages)
                try:
                    results.append((do_bench(fn, warmup=25, rep=100, return_mode="median"), num_warps, num_stages))
                except Exception as e:  # e.g. out of shared memory
                    print(f"  {name} warps={num_warps} stages={num_stages}: {type(e).__name__}")
        config.clear()
        config.update(default)  # the table runs with the defaults: edit them in gca_kernel.py
        results.sort()
        ms, num_warps, num_stages = results[0]
        tried = ", ".join(f"{w}w{s}s {t:.3f}" for t, w, s in results[:4])
        print(f"sweep {name:12s} best num_warps={num_warps} num_stages={num_stages} ({ms:.3f} ms; top: {tried})")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with an fp32 reference first")
    parser.add_argument("--sweep", action="store_true", help="tune num_warps/num_stages first")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    args = parser.parse_args(argv)
    if args.rep < 1:
        parser.error(f"--rep={args.rep}: must be >= 1 (ms)")
    if not torch.cuda.is_available():  # no benchmark ran: not a success
        raise SystemExit("bench_gca.py: error: no CUDA GPU here, so nothing was timed. On a CPU, test the "
                         "kernels under TRITON_INTERPRET=1: python -m pytest -q test_gca.py -k flash_gca")
    import triton
    from triton.testing import do_bench

    import gca_kernel

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    ok = check(gca_kernel.flash_gca) if args.check else True
    if args.sweep:
        sweep(gca_kernel, do_bench)
    print(f"launch: fwd {gca_kernel.FWD_CONFIG}, dq {gca_kernel.DQ_CONFIG}, dkdv {gca_kernel.DKDV_CONFIG}")

    head = f"{'B':>2} {'C':>4} {'M':>4} {'H':>3} {'D':>4} {'S':>3} {'K':>3} {'dtype':>8} {'path':>6} |" \
           f" {'fwd ms':>8} {'TFLOP/s':>7} {'MiB':>7} | {'f+b ms':>8} {'TFLOP/s':>7} {'MiB':>7} | note"
    print(head)
    print("-" * len(head))
    for B, C, M, H, D, S, K, dtype, note in SHAPES:
        q, k, v, idx, w, do = make_inputs(B, C, M, H, D, S, K, dtype, hot="hot" in note)
        ins = [x.requires_grad_() for x in (q, k, v, w)]
        flops = 4 * B * C * K * H * S * S * D
        flash = functools.partial(gca_kernel.flash_gca, check_idx=False)  # time the kernels, not the idx check's sync
        for path, f in (("naive", gca_naive), ("flash", flash)):
            fwd = lambda: f(ins[0], ins[1], ins[2], idx, ins[3])  # noqa: E731
            fwd_bwd = lambda: torch.autograd.grad(fwd(), ins, do)  # noqa: E731
            cols = []
            for fn, fl in ((fwd, flops), (fwd_bwd, 3.5 * flops)):
                try:
                    ms = do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
                    cols.append(f"{ms:8.3f} {fl / ms * 1e-9:7.1f} {peak_extra_mib(fn):7.0f}")
                except torch.cuda.OutOfMemoryError:
                    cols.append(f"{'OOM':>8} {'':7} {'':7}")
                    torch.cuda.empty_cache()
            print(f"{B:2d} {C:4d} {M:4d} {H:3d} {D:4d} {S:3d} {K:3d} {str(dtype)[6:]:>8} {path:>6} | "
                  + " | ".join(cols) + f" | {note}")
        del ins, q, k, v, do
        torch.cuda.empty_cache()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
