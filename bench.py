"""
Benchmarks on one CUDA GPU, each printing a table: the FlashGCA kernel, a training step of the
whole model, and streaming a long context.

    python bench.py --kernel                 # FlashGCA (gca_kernel.py) vs the PyTorch reference GCA
    python bench.py --kernel --check         # first: the kernel's errors vs an fp32 reference (exit 1 if off)
    python bench.py --kernel --sweep         # first: try num_warps/num_stages per kernel, print the best
    python bench.py --train                  # a training step: DRT vs the sliding-window baseline, kernel vs PyTorch GCA
    python bench.py --long                   # streaming a long context: time and GPU/host memory vs length
    python bench.py --long --lengths=1M,4M,16M --n_embd=256 --offload

--kernel times forward and forward+backward of FlashGCA and of the PyTorch path the model takes without it
(model.gca_reference: a pick at a time, gather, einsum, softmax in fp32) at DRT's training shape and variations: time (triton.testing.do_bench
median, 25 ms warmup), TFLOP/s and peak memory above what was allocated before the call (forward:
with autograd on, so it includes the saved tensors). FLOPs follow the flash-attention convention:
fwd = 4*B*C*K*H*S*S*D (per pick, q k^T and p v), fwd+bwd = 3.5 * fwd; the kernels execute more
(the backward recomputes q k^T and dO v^T in both of its kernels: 7 matmuls against 5).
--train times forward+backward+AdamW of the paper's 146M models at 16,380-token sequences (bf16
autocast): ms/step, tok/s, MFU, peak memory. --long feeds a random-init DRT a stream of random
tokens in prefill segments, through StreamState: seconds, tokens/s, peak GPU memory and the chunk
memory's bytes (host with --offload). Memory does not depend on the weights: a random model
measures it.

Without a GPU, --train and --long run with --device=cpu as a smoke test, in seconds and a few GB: at
toy sizes unless --block_size, --model or --lengths are given (TOY_TRAIN, TOY_LENGTHS), every --train
case eager (no torch.compile) and with the PyTorch GCA (Triton's kernel needs a GPU), peak memory the
host's.
"""

import argparse
import ast
import dataclasses
import functools
import math
import time

import torch

import common
import model as drt
from common import MAX_LENGTH, fmt_len, parse_lengths, peak_flops, peak_mem_gib, reset_peak_mem, stream_memory_error
from model import DRT, DRTConfig, gca_reference

# -----------------------------------------------------------------------------
# --kernel

# (B, C, M, S, H, D, K, dtype, note), the order of test_gca.py's kernel cases: batch, query chunks,
# memory chunks, chunk size, heads, head width, picks. DRT's training shape first: 4 x 16,380
# tokens = 4 x 260 chunks of 63 + 1 landmark, 12 heads of 64, top-8
SHAPES = [
    (4, 260, 260, 64, 12, 64, 8, torch.bfloat16, "DRT training"),
    (4, 260, 260, 64, 12, 64, 8, torch.float16, ""),
    (4, 260, 260, 64, 12, 64, 8, torch.bfloat16, "hot chunk 0"),
    (4, 260, 260, 64, 12, 64, 1, torch.bfloat16, ""),
    (4, 260, 260, 64, 12, 64, 16, torch.bfloat16, ""),
    (4, 260, 260, 64, 24, 32, 8, torch.bfloat16, ""),
    (4, 260, 260, 64, 6, 128, 8, torch.bfloat16, ""),
]


def make_inputs(shape, seed=0, device="cuda"):
    """Random q/k/v for shape (a SHAPES row); each query chunk c picks K random chunks among those
    < c (weight 0 for the picks it does not have: chunk c has only c eligible)."""
    B, C, M, S, H, D, K, dtype, note = shape
    torch.manual_seed(seed)
    q = torch.randn(B, C, S, H, D, device=device, dtype=dtype)
    k = torch.randn(B, M, S, H, D, device=device, dtype=dtype)
    v = torch.randn(B, M, S, H, D, device=device, dtype=dtype)
    score = torch.randn(B, C, M, device=device)  # stand-in retrieval scores
    eligible = torch.arange(M, device=device)[None, :] < torch.arange(C, device=device)[:, None]  # (C, M)
    if "hot" in note:
        score[:, :, 0] += 100.0  # everyone's favourite chunk
    top, idx = score.masked_fill(~eligible, -math.inf).topk(K, dim=-1)  # (B, C, K)
    w = torch.rand(B, C, K, device=device) * top.isfinite()  # weight 0 for ineligible picks
    do = torch.randn(B, C, S, H, D, device=device, dtype=dtype)
    return q, k, v, idx, w, do


def peak_extra_mib(fn):
    """The most memory fn() allocates above what was allocated before it."""
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
    """Kernel vs the reference in fp32, at the training shape: o and all grads. True if all pass."""
    ok, tol = True, {torch.bfloat16: 2e-2, torch.float16: 5e-3}
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v, idx, w, do = make_inputs((*SHAPES[0][:7], dtype, ""), seed=1)
        w[0, -1, 0] = 0.0  # an eligible pick with weight 0: its dw must still be right
        ins = [x.clone().requires_grad_() for x in (q, k, v, w)]
        o = flash_gca(ins[0], ins[1], ins[2], idx, ins[3])
        grads = torch.autograd.grad(o, ins, do)
        ref_ins = [x.float().requires_grad_() for x in (q, k, v, w)]
        o_ref = gca_reference(ref_ins[0], ref_ins[1], ref_ins[2], idx, ref_ins[3])
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
    q, k, v, idx, w, do = make_inputs(SHAPES[0])
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


def bench_kernel(args):
    """The table; returns False if --check found an error above tolerance."""
    import triton
    from triton.testing import do_bench

    import gca_kernel

    print(f"triton {triton.__version__}")
    ok = check(gca_kernel.flash_gca) if args.check else True
    if args.sweep:
        sweep(gca_kernel, do_bench)
    print(f"launch: fwd {gca_kernel.FWD_CONFIG}, dq {gca_kernel.DQ_CONFIG}, dkdv {gca_kernel.DKDV_CONFIG}")
    head = f"{'B':>2} {'C':>4} {'M':>4} {'S':>3} {'H':>3} {'D':>4} {'K':>3} {'dtype':>8} {'path':>6} |" \
           f" {'fwd ms':>8} {'TFLOP/s':>7} {'MiB':>7} | {'f+b ms':>8} {'TFLOP/s':>7} {'MiB':>7} | note"
    print(head + "\n" + "-" * len(head))
    for shape in SHAPES:
        B, C, M, S, H, D, K, dtype, note = shape
        q, k, v, idx, w, do = make_inputs(shape)
        ins = [x.requires_grad_() for x in (q, k, v, w)]
        flops = 4 * B * C * K * H * S * S * D
        flash = functools.partial(gca_kernel.flash_gca, check_idx=False)  # time the kernels, not the idx check's sync
        for path, f in (("torch", gca_reference), ("flash", flash)):
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
            print(f"{B:2d} {C:4d} {M:4d} {S:3d} {H:3d} {D:4d} {K:3d} {str(dtype)[6:]:>8} {path:>6} | "
                  + " | ".join(cols) + f" | {note}", flush=True)
        del ins, q, k, v, do
        torch.cuda.empty_cache()
    return ok


# -----------------------------------------------------------------------------
# --train and --long


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(dev):
    """Start the peaks afresh: the GPU's and the host's -> whether the host's could be (Linux)."""
    if dev.type == "cuda":
        reset_peak_mem(dev)
    return reset_peak_mem("cpu")


def peak_col(dev, host_reset, width):
    """The peak memory of what ran since reset_peak, in GiB: the GPU's, or on a CPU the host's ('-' where
    it could not be reset, so that it would be the whole process's)."""
    if dev.type == "cuda":
        return f"{peak_mem_gib(dev):{width - 1}.1f}G"
    return f"{peak_mem_gib():{width - 1}.1f}G" if host_reset else f"{'-':>{width}s}"


TRAIN_CASES = [  # (name, DRTConfig changes, GCA implementation, torch.compile)
    ("DRT x1", dict(groups=(6,)), "triton", True),
    ("baseline", dict(n_lower=12, groups=()), "-", True),
    ("DRT x2", dict(groups=(3, 3)), "triton", True),
    ("DRT x1", dict(groups=(6,)), "triton", False),
    ("baseline", dict(n_lower=12, groups=()), "-", False),
]
# --device=cpu: a smoke run in seconds on 2 cores. 16 chunks of 15 tokens, 4 in the window: retrieval
# has chunks to pick beyond it; 12 layers of 64
TOY_TRAIN = dict(block_size=240, model=dict(vocab_size=512, n_embd=64, n_head=1, n_enc=1, chunk_size=16, window=64,
                                            topk=2))
TOY_LENGTHS = "2K,8K"


def train_cases(dev):
    """TRAIN_CASES as dev runs them: on a CPU each model once, eager, with the PyTorch GCA ('torch')."""
    if dev.type == "cuda":
        return TRAIN_CASES
    cases = {}
    for name, kw, impl, _ in TRAIN_CASES:
        cases.setdefault(name, (name, kw, "torch" if impl == "triton" else impl, False))
    return list(cases.values())


def bench_train(args, dev):
    peak = peak_flops(dev)
    head = (f"{'model':10s} {'GCA':>6s} {'compile':>7s} {'params':>8s} {'B x T':>11s} | {'ms/step':>8s} {'tok/s':>9s} "
            f"{'MFU':>6s} {'peak mem':>9s}")
    if dev.type != "cuda":  # the GPU's table has a row per GCA and compile; this one a row per model
        print("cpu: each model eager (torch.compile is timed on a GPU alone), DRT's GCA in PyTorch (the Triton "
              "kernel needs a GPU)", flush=True)
    print(head + "\n" + "-" * len(head))
    for name, kw, impl, compiled in train_cases(dev):
        drt.GCA_IMPL = impl if impl != "-" else "auto"
        torch.manual_seed(0)
        raw = DRT(DRTConfig(**kw, **args.model)).to(dev)
        model = torch.compile(raw) if compiled else raw
        opt = raw.configure_optimizers(1e-3, 1e-4, (0.9, 0.95), dev.type)
        x = torch.randint(0, raw.config.landmark_id, (args.batch_size, args.block_size), device=dev)

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        label = f"{name:10s} {impl:>6s} {'yes' if compiled else 'no':>7s}"
        try:
            t0 = time.time()
            for _ in range(3):  # warm-up: compilation, autotuning, the allocator
                step()
            sync(dev)
            warm = time.time() - t0
            host_reset = reset_peak(dev)
            t0 = time.time()
            for _ in range(args.steps):
                step()
            sync(dev)
        except torch.cuda.OutOfMemoryError:
            print(f"{label} out of memory at batch {args.batch_size}", flush=True)
            continue
        finally:
            del model, opt
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        dt = (time.time() - t0) / args.steps
        tok_s = args.batch_size * args.block_size / dt
        mfu = f"{100 * common.flops_per_token(raw) * tok_s / peak:5.1f}%" if peak else "  n/a"
        print(f"{label} {raw.num_params() / 1e6:7.1f}M {args.batch_size:>3d} x {args.block_size:<6d}"
              f" | {1000 * dt:8.1f} {tok_s:9,.0f} {mfu:>6s} {peak_col(dev, host_reset, 9)}   (warm-up {warm:.0f}s)",
              flush=True)
        del raw
    drt.GCA_IMPL = "auto"


@torch.no_grad()
def bench_long(args, dev):
    for L in parse_lengths(args.lengths):  # sample.py's checks, before anything runs for hours
        why = (L > MAX_LENGTH and f"{fmt_len(L)} tokens is past the {fmt_len(MAX_LENGTH)} DRT's streams are tested to"
               or stream_memory_error(L, args.n_embd, DRTConfig.chunk_size, dev, args.offload, 2 if dev.type == "cuda" else 4))
        if why:
            raise SystemExit(f"bench.py: error: --lengths: {why}")
    cfg = DRTConfig(n_embd=args.n_embd, n_head=args.n_embd // 64, n_lower=2, groups=(2,), n_enc=1,
                    window=256, topk=4)
    torch.manual_seed(0)
    model = DRT(cfg).to(dev).eval()
    print(f"random-init DRT, {model.num_params() / 1e6:.1f}M parameters, d={cfg.n_embd}, "
          f"{'offloaded' if args.offload else 'on-device'} chunk memory, segments of {args.segment:,} tokens")
    head = f"{'length':>7s} | {'seconds':>8s} {'tok/s':>10s} | {'peak GPU':>9s} {'chunk mem':>10s} {'B/token':>8s} {'peak host':>10s}"
    print(head + "\n" + "-" * len(head))
    for L in parse_lengths(args.lengths):
        reset_peak(dev)  # the host's too, where it can (Linux): else its column is the process's peak
        state = model.new_state(offload=args.offload)
        g = torch.Generator(device=dev).manual_seed(L)
        t0 = time.time()
        for s in range(0, L, args.segment):
            x = torch.randint(0, 50257, (1, min(args.segment, L - s)), device=dev, generator=g)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                model(x, state=state)
        sync(dev)
        dt = time.time() - t0
        kv = state.store.nbytes()
        del state  # before the next length allocates its own memory
        gpu = f"{peak_mem_gib(dev):8.2f}G" if dev.type == "cuda" else f"{'-':>9s}"
        print(f"{fmt_len(L):>7s} | {dt:8.1f} {L / dt:10,.0f} | {gpu} {kv / 2**30:9.2f}G {kv / L:8.0f} "
              f"{peak_mem_gib():9.1f}G", flush=True)


class Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # a default of None hangs on the device: its help says so
        return action.help if action.default is None else super()._get_help_string(action)


def device_defaults(args, dev):
    """The sizes left out: the paper's on a GPU, toy ones on a CPU (a smoke run)."""
    gpu = dev.type == "cuda"
    for name, full, toy in (("block_size", 16380, TOY_TRAIN["block_size"]), ("model", "{}", repr(TOY_TRAIN["model"])),
                            ("lengths", "64K,256K,1M", TOY_LENGTHS)):
        if getattr(args, name) is None:
            setattr(args, name, full if gpu else toy)


def parse_args(argv):
    """bench.py's arguments, each checked (a bad one is a one-line error before anything runs) -> (args, device)."""
    p = argparse.ArgumentParser(description="DRT benchmarks (CUDA): pass --kernel, --train, --long, or several.",
                                formatter_class=Help)
    p.add_argument("--kernel", action="store_true", help="FlashGCA vs the PyTorch reference GCA: time, TFLOP/s, memory")
    p.add_argument("--train", action="store_true", help="time training steps of the 146M models (toy ones on a CPU)")
    p.add_argument("--long", action="store_true", help="stream long contexts: time and memory vs length")
    p.add_argument("--check", action="store_true", help="--kernel: first compare with an fp32 reference")
    p.add_argument("--sweep", action="store_true", help="--kernel: first tune num_warps/num_stages")
    p.add_argument("--rep", type=int, default=100, help="--kernel: do_bench repetition time, ms")
    p.add_argument("--batch_size", type=int, default=1, help="--train: sequences per step")
    p.add_argument("--block_size", type=int, default=None, help="--train: text tokens per sequence (default: "
                   f"16380; on a CPU {TOY_TRAIN['block_size']})")
    p.add_argument("--steps", type=int, default=5, help="--train: timed steps per case")
    p.add_argument("--model", default=None, help="--train: DRTConfig overrides as a dict, e.g. \"{'n_embd': 64}\" "
                   f"(default: none; on a CPU {TOY_TRAIN['model']})")
    p.add_argument("--lengths", default=None, help="--long: context lengths (default: 64K,256K,1M; on a CPU "
                   f"{TOY_LENGTHS})")
    p.add_argument("--n_embd", type=int, default=256, help="--long: model width (heads of 64)")
    p.add_argument("--segment", type=int, default=65536, help="--long: prefill segment in tokens")
    p.add_argument("--offload", action="store_true", help="--long: chunk keys/values in pinned host memory")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of --train/--long at toy sizes")
    args = p.parse_args(argv)
    return args, check_args(p, args)


def check_args(p, args):
    """Refuse what cannot run, through p.error; fill the device's defaults; args.model becomes a dict -> the device."""
    if not (args.kernel or args.train or args.long):
        p.error("nothing to do: pass --kernel, --train, --long, or several")
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device={args.device}: expected cuda, cuda:N or cpu")
    device_defaults(args, dev)
    for name in ("batch_size", "block_size", "steps", "segment", "rep"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.n_embd < 64 or args.n_embd % 64:
        p.error(f"--n_embd={args.n_embd}: must be a multiple of 64 (heads of 64)")
    try:
        if min(parse_lengths(args.lengths)) < 1:
            p.error(f"--lengths={args.lengths}: every length must be at least 1 token")
    except ValueError as e:
        p.error(e)
    try:
        overrides = ast.literal_eval(args.model)
    except (ValueError, SyntaxError):
        overrides = None
    if not isinstance(overrides, dict):
        p.error(f"--model={args.model!r}: expected a dict of DRTConfig fields, e.g. \"{{'n_embd': 64}}\"")
    settable = {f.name for f in dataclasses.fields(DRTConfig)} - {"groups", "n_lower"}  # each case sets those
    if wrong := sorted(set(overrides) - settable):
        p.error(f"--model: {', '.join(map(repr, wrong))} cannot be set: give DRTConfig's fields but groups and "
                f"n_lower, which each --train case sets")
    try:
        DRTConfig(**overrides)
    except (TypeError, ValueError) as e:
        p.error(f"--model={args.model!r}: {e}")
    args.model = overrides
    T = overrides.get("chunk_size", DRTConfig.chunk_size) - 1  # text tokens per chunk
    if args.train and args.block_size < 2 * T + 1:  # train.py's rule: chunks 0 and 1 retrieve nothing, GCA starts in 2
        p.error(f"--block_size={args.block_size} gives fewer than 3 chunks, so GCA would never run: use --block_size "
                f">= {2 * T + 1} (best a multiple of chunk_size-1={T})")
    if (dev.type == "cuda" or args.kernel) and not torch.cuda.is_available():  # no benchmark ran: not a success
        raise SystemExit("bench.py: error: no CUDA GPU here, so nothing was timed (--train and --long take "
                         "--device=cpu for a smoke run); the kernels' CPU tests, under TRITON_INTERPRET=1: "
                         "python -m pytest -q test_gca.py -k flash_gca")
    if args.kernel and dev.type != "cuda":
        p.error("--kernel times the Triton kernels on a GPU: drop --device=cpu")
    if dev.type == "cuda":  # "cuda" below (inputs, memory stats) is this GPU; plain "cuda" has no index
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def main(argv=None):
    args, dev = parse_args(argv)
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}", flush=True)
    ok = bench_kernel(args) if args.kernel else True
    if args.train:
        torch.set_float32_matmul_precision("high")  # as train.py: TF32 for what stays in fp32
        bench_train(args, dev)
    if args.long:
        bench_long(args, dev)
    if not ok:
        raise SystemExit("bench.py: error: --check found kernel errors above tolerance (FAIL above)")


if __name__ == "__main__":
    main()
