"""
Generate text from a trained DRT, or test it on long-context tasks at any length.

    python sample.py --out_dir=out-quickstart --prompt="It was a dark and stormy night"
    python sample.py --out_dir=out-quickstart --prompt=FILE:book.txt --max_new_tokens=200
    python sample.py --out_dir=out-passkey --passkey                       # 4K ... 1M tokens
    python sample.py --out_dir=out-passkey --passkey --lengths=64K,1M,16M --offload --samples=5
    python sample.py --out_dir=out-passkey --multikey --vartrack --haystack=data/pg19/val.bin

The checkpoint (out_dir/ckpt.pt from train.py) carries the model's config: no architecture
flags. Prompts of any length are prefilled in segments and continued token by token with
O(W) self-attention caches (model.DecodeState); --offload keeps the chunk memory in host
memory and brings only the retrieved chunks to the GPU (DESIGN §5).
"""

import argparse
import os
import random
import resource
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch

from model import DRT, DRTConfig
from prepare_pg19 import get_tokenizer
from tasks import TASKS, Haystack, make_example, score


def load_checkpoint(path, device):
    """The model saved by train.py, with the config it was trained with."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    if not os.path.isfile(path):
        raise SystemExit(f"sample.py: no checkpoint at {path}: train one with train.py, or pass --out_dir/--ckpt")
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if "model" not in ckpt or "model_args" not in ckpt:
        raise SystemExit(f"sample.py: {path} is not a train.py checkpoint (it needs 'model' and 'model_args')")
    try:
        cfg = DRTConfig(**ckpt["model_args"])
    except (TypeError, ValueError) as e:
        raise SystemExit(f"sample.py: the config stored in {path} does not build a DRT: {e}")
    model = DRT(cfg)
    state = ckpt["model"]
    own = model.state_dict()
    wrong = [f"{k}: checkpoint {tuple(v.shape)}, config {tuple(own[k].shape)}"
             for k, v in state.items() if k in own and own[k].shape != v.shape]
    missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if wrong or missing or extra:
        detail = "; ".join(wrong[:3] + [f"missing {m}" for m in missing[:3]] + [f"unexpected {e}" for e in extra[:3]])
        raise SystemExit(f"sample.py: the weights in {path} do not fit the config stored with them "
                         f"({cfg}): {detail}. Was the checkpoint written by another version of model.py?")
    model.load_state_dict(state)
    return model.to(device).eval(), ckpt


def prefill(model, ids, state, segment, progress=None):
    """Feed ids (list of ints) through the model in segments; returns the last logits (1, 1, V)."""
    x = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    t0, last = time.time(), time.time()
    for s in range(0, len(ids), segment):
        logits, _ = model(x[:, s : s + segment], state=state)
        if progress and time.time() - last > 10:
            done, dt = s + segment, time.time() - t0
            progress(f"{done:,}/{len(ids):,} tokens, {done / dt:,.0f} tok/s, ETA {(len(ids) - done) * dt / done:.0f}s")
            last = time.time()
    return logits


def needle_chunk(prompt, answer, T):
    """The chunk (of T text tokens) where the answer first appears in the prompt, i.e. the chunk
    retrieval must bring back; None if the answer's tokens never appear as such."""
    ids, n = np.asarray(prompt), len(answer)
    for i in np.flatnonzero(ids[: len(ids) - n + 1] == answer[0]):
        if ids[i : i + n].tolist() == answer:
            return int(i + n // 2) // T  # a middle token: the chunk that holds most of it
    return None


@torch.no_grad()
def greedy(model, logits, state, n):
    out = []
    for _ in range(n):
        nxt = logits[:, -1, : model.config.landmark_id].argmax(-1, keepdim=True)  # (1, 1)
        out.append(nxt.item())
        logits, _ = model(nxt, state=state)
    return out


def parse_lengths(text):
    """'4K,16K,1M' -> [4096, 16384, 1048576]."""
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        return [int(float(t[:-1]) * mult[t[-1].upper()]) if t[-1].upper() in mult else int(t)
                for t in text.split(",") if t]
    except (ValueError, KeyError):
        raise SystemExit(f"sample.py: --lengths {text!r}: expected a list like 4K,16K,1M or 4096,16384")


def fmt_len(n):
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def kv_bytes(memory):
    """Bytes of chunk keys/values a stream holds (host or device): 2 * S * C elements per chunk."""
    kv = memory.host_k[0] if memory.host_k else memory.k
    return 0 if kv is None else memory.M * 2 * kv[0, 0].numel() * kv.element_size()


def peak_host_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


@torch.no_grad()
def run_task(model, enc, task, lengths, args, ctx):
    """Accuracy of `task` at each context length; prints one table row per length."""
    device = next(model.parameters()).device
    haystack = Haystack(args.haystack, enc) if args.haystack else None
    print(f"\n{task}: {args.samples} samples per length, {'offloaded' if args.offload else 'on-device'} memory, "
          f"filler {'from ' + args.haystack if haystack else 'sentences'}")
    header = (f"{'length':>8} {'samples':>7} {'accuracy':>8} {'retrieved':>9} {'s/sample':>9} {'peak GPU':>9} "
              f"{'peak host':>9} {'KV mem':>8}")
    print(header + "\n" + "-" * len(header), flush=True)
    rows, T = [], model.config.chunk_size - 1
    for L in lengths:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        correct, t0, kv, eligible, found = 0, time.time(), 0, 0, 0
        for i in range(args.samples):
            rng = random.Random(f"{args.seed}-{task}-{L}-{i}")  # same prompts for every model and run
            prompt, answer = make_example(task, L, rng, enc, haystack)
            state = model.new_state(offload=args.offload)
            progress = None
            if L >= 2**18:
                def progress(msg, i=i, L=L):
                    print(f"  {fmt_len(L)} sample {i + 1}/{args.samples}: {msg}", flush=True)
            with ctx:
                prefill(model, prompt[:-1], state, args.segment, progress)
                # the picks serving the prompt's last token, which predicts the answer (DecodeState)
                picks = [(idx[0, -1], w[0, -1]) for idx, w in (p for p in state.picks if p is not None)]
                logits = prefill(model, prompt[-1:], state, args.segment)
                out = greedy(model, logits, state, len(answer))
            correct += score(out, answer, enc)
            # retrieval diagnosis: was the needle's chunk (or the next one, whose memory saw the needle
            # through the lower layers' window) among the picks, where retrieval could pick it?
            # (chunk c reads what the landmark of chunk c-1 picked among chunks < c-1)
            need, last = needle_chunk(prompt, answer, T), (len(prompt) - 1) // T
            if picks and need is not None and need < last - 1:
                eligible += 1
                found += any(bool((((idx == need) | (idx == need + 1)) & (w > 0)).any()) for idx, w in picks)
            kv = kv_bytes(state.memory)
            del state  # before the next sample allocates its own memory
        dt = (time.time() - t0) / args.samples
        gpu = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        hits = f"{found}/{eligible}" if eligible else "-"
        row = (fmt_len(L), args.samples, correct / args.samples, hits, dt, gpu, peak_host_gib(), kv / 2**30)
        rows.append(row)
        gpu_col = f"{gpu:>8.2f}G" if gpu == gpu else f"{'-':>9}"  # no GPU: nan
        print(f"{row[0]:>8} {row[1]:>7} {row[2]:>8.1%} {row[3]:>9} {row[4]:>9.2f} {gpu_col} {row[6]:>8.2f}G "
              f"{row[7]:>7.2f}G", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="Generate from a DRT checkpoint, or run long-context tests.")
    p.add_argument("--out_dir", default="out", help="folder with ckpt.pt from train.py")
    p.add_argument("--ckpt", default=None, help="path to a checkpoint file (overrides --out_dir)")
    p.add_argument("--prompt", default="\n", help="prompt text, or FILE:path to read it from a file")
    p.add_argument("--num_samples", type=int, default=1, help="generations to draw")
    p.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="1.0 = as trained, < 1 sharper, 0 = greedy")
    p.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens only")
    p.add_argument("--passkey", action="store_true", help="run the passkey retrieval test (DESIGN §6)")
    p.add_argument("--multikey", action="store_true", help="run the multi-key passkey test")
    p.add_argument("--vartrack", action="store_true", help="run the 2-hop variable tracking test")
    p.add_argument("--lengths", default="4K,16K,64K,256K,1M", help="context lengths in tokens for the tests (up to 64M)")
    p.add_argument("--samples", type=int, default=10, help="test prompts per length")
    p.add_argument("--haystack", default=None, help="real text as filler: a folder of .txt books or a .bin from prepare_pg19.py")
    p.add_argument("--offload", action="store_true", help="keep chunk keys/values in (pinned) host memory")
    p.add_argument("--segment", type=int, default=16384, help="prefill segment in tokens (memory vs speed)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                   choices=["float32", "bfloat16", "float16"], help="autocast dtype on CUDA")
    p.add_argument("--seed", type=int, default=1337, help="random seed (sampling and test prompts)")
    p.add_argument("--tokenizer_file", default=None, help="local gpt2.tiktoken (default: env DRT_GPT2_RANKS or download)")
    args = p.parse_args(argv)
    if args.segment < 1 or args.samples < 1:
        raise SystemExit("sample.py: --segment and --samples must be >= 1")

    torch.manual_seed(args.seed)
    model, ckpt = load_checkpoint(args.ckpt or args.out_dir, args.device)
    print(f"loaded {args.ckpt or args.out_dir} (iter {ckpt.get('iter_num', '?')}): "
          f"{model.num_params() / 1e6:.1f}M parameters, {model.config}")
    device_type = "cuda" if "cuda" in args.device else "cpu"
    dtype = getattr(torch, args.dtype)
    ctx = torch.autocast(device_type, dtype=dtype) if device_type == "cuda" and dtype != torch.float32 else nullcontext()
    try:
        enc = get_tokenizer(args.tokenizer_file)
    except (OSError, RuntimeError) as e:
        raise SystemExit(f"sample.py: {e}")

    tasks = [t for t in TASKS if getattr(args, t)]
    if tasks:
        lengths = parse_lengths(args.lengths)
        for task in tasks:
            run_task(model, enc, task, lengths, args, ctx)
        return

    prompt = args.prompt
    if prompt.startswith("FILE:"):
        with open(prompt[5:], encoding="utf-8") as f:
            prompt = f.read()
    ids = enc.encode_ordinary(prompt) or [enc.eot_token]
    x = torch.tensor([ids], dtype=torch.long, device=args.device)
    for _ in range(args.num_samples):
        with ctx:
            out = model.generate(x, args.max_new_tokens, args.temperature, args.top_k,
                                 state=model.new_state(offload=args.offload), prefill_segment=args.segment)
        print(prompt[-500:] + enc.decode(out[0].tolist()))
        print("-" * 40, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
