"""
Benchmarks of the whole model on one GPU; each prints a table.

    python bench.py --train                  # a training step: DRT vs the sliding-window baseline, kernel vs PyTorch GCA
    python bench.py --long                   # streaming a long context: time and GPU/host memory vs length
    python bench.py --long --lengths=1M,4M,16M --n_embd=256 --offload

--train times forward+backward+AdamW of the paper's 146M models at 16,380-token sequences
(bf16 autocast) and reports ms/step, tok/s, MFU and peak memory. --long feeds a random-init
DRT a stream of random tokens in prefill segments, through DecodeState, and reports
seconds, tokens/s, peak GPU memory and the chunk memory's bytes (host with --offload).
Memory does not depend on the weights, so a random model measures it. Kernel timings are
in bench_gca.py.
"""

import argparse
import ast
import time

import torch

import model as drt
from model import DRT, DRTConfig
from sample import fmt_len, parse_lengths, peak_host_gib
from train import peak_flops



def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak_gpu_gib(dev):
    return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")


def reset_peak(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


TRAIN_CASES = [  # (name, DRTConfig changes, GCA implementation, torch.compile)
    ("DRT x1", dict(groups=(6,)), "triton", True),
    ("baseline", dict(n_lower=12, groups=()), "-", True),
    ("DRT x2", dict(groups=(3, 3)), "triton", True),
    ("DRT x1", dict(groups=(6,)), "triton", False),
    ("baseline", dict(n_lower=12, groups=()), "-", False),
]


def bench_train(args, dev):
    peak = peak_flops(dev)  # train.py's table of dense bf16 peaks by GPU name
    head = (f"{'model':10s} {'GCA':>6s} {'compile':>7s} {'params':>8s} {'B x T':>11s} | {'ms/step':>8s} {'tok/s':>9s} "
            f"{'MFU':>6s} {'peak mem':>9s}")
    print(head + "\n" + "-" * len(head))
    for name, kw, impl, compiled in TRAIN_CASES:
        if dev.type != "cuda" and (impl == "triton" or compiled):
            continue
        drt.GCA_IMPL = impl if impl != "-" else "auto"
        torch.manual_seed(0)
        raw = DRT(DRTConfig(**kw, **args.model)).to(dev)
        model = torch.compile(raw) if compiled else raw
        opt = raw.configure_optimizers(1e-3, 1e-4, (0.9, 0.95), dev.type)
        x = torch.randint(0, raw.config.landmark_id, (args.batch_size, args.block_size), device=dev)

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                _, loss = model(x, x, return_logits=False)
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
            reset_peak(dev)
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
        mfu = f"{100 * raw.flops_per_token() * tok_s / peak:5.1f}%" if peak else "  n/a"
        print(f"{label} {raw.num_params() / 1e6:7.1f}M {args.batch_size:>3d} x {args.block_size:<6d}"
              f" | {1000 * dt:8.1f} {tok_s:9,.0f} {mfu:>6s} {peak_gpu_gib(dev):8.1f}G   (warm-up {warm:.0f}s)", flush=True)
        del raw
    drt.GCA_IMPL = "auto"


@torch.no_grad()
def bench_long(args, dev):
    cfg = DRTConfig(n_embd=args.n_embd, n_head=args.n_embd // 64, n_lower=2, groups=(2,), n_enc=1,
                    window=256, topk=4)
    torch.manual_seed(0)
    model = DRT(cfg).to(dev).eval()
    print(f"random-init DRT, {model.num_params() / 1e6:.1f}M parameters, d={cfg.n_embd}, "
          f"{'offloaded' if args.offload else 'on-device'} chunk memory, segments of {args.segment:,} tokens")
    head = f"{'length':>7s} | {'seconds':>8s} {'tok/s':>10s} | {'peak GPU':>9s} {'chunk mem':>10s} {'B/token':>8s} {'peak host':>10s}"
    print(head + "\n" + "-" * len(head))
    for L in parse_lengths(args.lengths):
        reset_peak(dev)
        state = model.new_state(offload=args.offload)
        g = torch.Generator(device=dev).manual_seed(L)
        t0 = time.time()
        for s in range(0, L, args.segment):
            x = torch.randint(0, 50257, (1, min(args.segment, L - s)), device=dev, generator=g)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                model(x, state=state)
        sync(dev)
        dt = time.time() - t0
        kv = state.memory.nbytes()
        del state  # before the next length allocates its own memory
        print(f"{fmt_len(L):>7s} | {dt:8.1f} {L / dt:10,.0f} | {peak_gpu_gib(dev):8.2f}G "
              f"{kv / 2**30:9.2f}G {kv / L:8.0f} {peak_host_gib():9.1f}G", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description="DRT model benchmarks (CUDA): pass --train, --long or both.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train", action="store_true", help="time training steps of the 146M models")
    p.add_argument("--long", action="store_true", help="stream long contexts: time and memory vs length")
    p.add_argument("--batch_size", type=int, default=1, help="--train: sequences per step")
    p.add_argument("--block_size", type=int, default=16380, help="--train: text tokens per sequence")
    p.add_argument("--steps", type=int, default=5, help="--train: timed steps per case")
    p.add_argument("--lengths", default="64K,256K,1M", help="--long: context lengths")
    p.add_argument("--n_embd", type=int, default=256, help="--long: model width (heads of 64)")
    p.add_argument("--segment", type=int, default=65536, help="--long: prefill segment in tokens")
    p.add_argument("--offload", action="store_true", help="--long: chunk keys/values in pinned host memory")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at toy sizes")
    p.add_argument("--model", default="{}", help="--train: DRTConfig overrides as a dict, e.g. \"{'n_embd': 64}\"")
    args = p.parse_args(argv)
    if not (args.train or args.long):
        p.error("nothing to do: pass --train, --long or both")
    for name in ("batch_size", "block_size", "steps", "segment"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.n_embd < 64 or args.n_embd % 64:
        p.error(f"--n_embd={args.n_embd}: must be a multiple of 64 (heads of 64)")
    try:
        parse_lengths(args.lengths)
    except ValueError as e:
        p.error(e)
    try:
        overrides = ast.literal_eval(args.model)
    except (ValueError, SyntaxError):
        overrides = None
    if not isinstance(overrides, dict):
        p.error(f"--model={args.model!r}: expected a dict of DRTConfig fields, e.g. \"{{'n_embd': 64}}\"")
    args.model = overrides
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device={args.device}: expected cuda, cuda:N or cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.py: no CUDA GPU here (--device=cpu runs a smoke test)")
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}")
    if args.train:
        bench_train(args, dev)
    if args.long:
        bench_long(args, dev)


if __name__ == "__main__":
    main()
