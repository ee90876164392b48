"""
Generate text from a trained DRT, or test it on long-context tasks at any length.

    python sample.py --out_dir=out-quickstart --prompt="It was a dark and stormy night"
    python sample.py --out_dir=out-quickstart --prompt=FILE:book.txt --max_new_tokens=200
    python sample.py --out_dir=out-passkey --passkey                       # 4K ... 1M tokens
    python sample.py --out_dir=out-passkey --passkey --lengths=64K,1M,16M --offload --samples_per_length=5
    python sample.py --out_dir=out-passkey --multikey --vartrack --haystack=data/pg19/val.bin
    python sample.py --out_dir=out-passkey-pretrain --copying --haystack=data/pg19/val.bin  # does it copy?
    python sample.py --out_dir=out-lm --ppl --docs=data/pg19/test.bin --retrieval=learned,none,random
    python sample.py --out_dir=out-lm --inspect --docs=data/pg19/test.bin --at=200000

The checkpoint (out_dir/ckpt.pt from train.py) carries the model's config: no architecture flags.
Prompts of any length are prefilled in segments, then decoded with O(W) self-attention caches
(§3.2 of the paper); --offload keeps the chunk memory in host memory and brings only the retrieved
chunks to the GPU. Every argument is checked before the checkpoint loads.
"""

import argparse
import json
import math
import os
import random
import re
import sys
import textwrap
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

import common
from common import EOT, GPT2_VOCAB, fmt_len, fmt_time, get_tokenizer, parse_lengths, peak_mem_gib
from model import DRT, DRTConfig, retrieval_stats, sink_label, skim_margin, window_reach
from tasks import NAMES, SCORE_AFTER, TASKS, TEMPLATES, UNSEEN_NAMES, Haystack, in_reach, key_owner, make_example
from tasks import min_length, needle_picks, needles_and_question, score, wilson

# -----------------------------------------------------------------------------
# Generation: a checkpoint, a prompt, model.generate


def error(msg):
    """A wrong argument or an unusable file: one line, no traceback."""
    raise SystemExit(f"sample.py: error: {msg}")


def load_model(path, device):
    """train.py's DRT at path (a ckpt.pt or its out_dir), in eval mode -> (model, checkpoint)."""
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        error(f"no checkpoint at {path}: train one with train.py, or pass --out_dir/--ckpt")
    try:
        ckpt = common.load_checkpoint(path, "point --out_dir/--ckpt at a ckpt.pt that train.py wrote")
        model = DRT(DRTConfig(**ckpt["model_args"]))
    except common.CheckpointError as e:
        error(e)
    except (TypeError, ValueError) as e:
        error(f"the config stored in {path} does not build a DRT: {e}")
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # torch names each mismatch on a line of its own: the first three, on one
        detail = textwrap.shorten("; ".join(line.strip(" \t.") for line in str(e).splitlines()[1:4]), 600)
        error(f"the weights in {path} do not fit the config stored with them ({model.config}): {detail}. "
              f"Was the checkpoint written by another version of model.py?")
    return model.to(device).eval(), ckpt


def read_prompt(prompt):
    """The --prompt text, read from a file for FILE:path."""
    if not prompt.startswith("FILE:"):
        return prompt
    try:
        with open(prompt[5:], encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        error(f"--prompt={prompt}: cannot read it ({e.strerror}): give an existing text file, or the text itself")
    except UnicodeDecodeError:
        error(f"--prompt={prompt}: not UTF-8 text: give a text file, or the text itself")


def as_batch(model, ids):
    """Token ids -> (1, n) on the model's device."""
    return torch.as_tensor(np.asarray(ids), dtype=torch.long, device=next(model.parameters()).device)[None]


def generate(model, enc, prompt, args, ctx):
    """Print --num_samples continuations, each after the prompt's last 500 characters."""
    x = as_batch(model, enc.encode_ordinary(prompt) or [enc.eot_token])  # (1, T)
    for _ in range(args.num_samples):
        with ctx:
            y = model.generate(x, args.max_new_tokens, args.temperature, args.top_k or None,  # top_k 0: all tokens
                               state=model.new_state(offload=args.offload), prefill_segment=args.segment)
        print(prompt[-500:] + enc.decode(y[0].tolist()))
        print("-" * 40, flush=True)


# -----------------------------------------------------------------------------
# The long-context harness: passkey, multi-key and 2-hop accuracy by length (Appendix D) beside
# what retrieval picked; in-context copying (--copying); the loss by position (--ppl); the picks
# themselves (--inspect, §4.4)

LENGTHS = "4K,16K,64K,256K,1M"  # the tests' default context lengths
MAX_LENGTH = common.MAX_LENGTH  # 64M tokens: the longest --lengths takes
PROGRESS_AFTER = 10  # seconds between progress lines: short work stays quiet


class Progress:
    """progress(done) prints `label: done/total unit after T, ETA T`, at most every PROGRESS_AFTER seconds."""

    def __init__(self, label, total, unit="tokens"):
        self.label, self.total, self.unit = label, total, unit
        self.t0 = self.last = time.time()

    def __call__(self, done):
        if time.time() - self.last > PROGRESS_AFTER:
            self.last, dt = time.time(), time.time() - self.t0
            print(f"  {self.label}: {done:,}/{self.total:,} {self.unit} after {fmt_time(dt)}, "
                  f"ETA {fmt_time(dt * (self.total - done) / max(done, 1))}", flush=True)


def prefill(model, ids, state, segment, progress=None, skim=None):
    """Stream ids into the state, `segment` tokens a call; skim: a margin in tokens, or None. Segments that end
    at least that far before ids' end go through DRT.skim (memory only): only what follows is read."""
    x = as_batch(model, ids)
    for s in range(0, x.size(1), segment):
        part = x[:, s : s + segment]
        if skim is not None and s + part.size(1) <= x.size(1) - skim:
            model.skim(part, state)
        else:
            model(part, state=state)
        if progress:
            progress(min(s + segment, x.size(1)))


def answer_prompt(model, prompt, n, state, segment, progress=None):
    """Prefill the prompt (skimmed up to its last skim_margin tokens: outputs are read only after it), decode n
    tokens greedily -> (the tokens, [(chunk ids (K,), weights (K,))] per upper group: the picks that served the
    prompt's last token, read before it goes in, as it may close a chunk)."""
    cfg = model.config
    prefill(model, prompt[:-1], state, segment, progress, skim_margin(cfg))
    picks = [(idx[0, -1], w[0, -1]) for idx, w in (p for p in state.picks if p is not None)]
    out = model.generate(as_batch(model, prompt[-1:]), n, temperature=0, state=state, prefill_segment=segment)
    return out[0].tolist(), picks


def prompt_kwargs(args, cfg=None, depth=None):
    """make_example's arguments for the test flags and one --depth bin."""
    kw = dict(names=UNSEEN_NAMES if args.unseen_names else NAMES, keys=args.keys, template=args.template,
              digits=args.digits)
    if depth == "reach":  # the fewest tokens that, landmarks counted, span the reach in positions
        reach = window_reach(cfg)
        kw["past"] = reach - reach // cfg.chunk_size
    elif depth is not None:
        kw["depth"] = depth
    return kw


def prompt_seed(seed, task, L, i):
    """Test prompt i's seed: the same prompts for every model and run."""
    return f"{seed}-{task}-{L}-{i}"


def check_lengths(tasks, lengths, args, enc, cfg=None, depth=None):
    """Refuse a length past MAX_LENGTH or too short for run_task's prompts, naming the shortest that works;
    without cfg (before the checkpoint loads) prompts are not cut to its chunks."""
    if max(lengths) > MAX_LENGTH:
        error(f"--lengths: {fmt_len(max(lengths))} tokens is past the {fmt_len(MAX_LENGTH)} this harness "
              f"supports: use lengths up to {fmt_len(MAX_LENGTH)}")
    align = None if cfg is None or args.no_align else cfg.chunk_size - 1
    kw = prompt_kwargs(args, cfg, depth)
    for task in tasks:
        # the longest of 64 probes: whether a length passes must not hang on the luck of its own seeds
        floor = max(min_length(task, i, enc, align, **kw) for i in range(64))
        for L in lengths:
            shortest = max(L, floor)  # raised until the prompts drawn for that length all fit
            while any(min_length(task, prompt_seed(args.seed, task, shortest, i), enc, align, **kw) > shortest
                      for i in range(args.samples)):
                shortest += 1
            if shortest > L:
                error(f"--lengths: {L} tokens cannot hold the needles and question of a {task} prompt: "
                      f"use lengths of at least {shortest}")


def check_memory(model, L, args):
    """Refuse a length whose chunk memory (2*d*bytes per text token x S/(S-1)) cannot fit, before it runs for hours."""
    cfg, device = model.config, next(model.parameters()).device
    size = 2 if device.type == "cuda" and args.dtype != "float32" else 4  # autocast on CUDA alone
    if why := common.stream_memory_error(L, cfg.n_embd, cfg.chunk_size, device, args.offload, size):
        error(f"--lengths: {why}")


@torch.no_grad()
def run_task(model, enc, task, lengths, args, ctx, haystack=None, depth=None):
    """Accuracy of `task` at each context length, a table row each; depth: one --depth bin."""
    device, cfg = next(model.parameters()).device, model.config
    T, reach, kw = cfg.chunk_size - 1, window_reach(cfg), prompt_kwargs(args, cfg, depth)
    align = None if args.no_align else T
    variants = {f"{args.keys} keys": task == "multikey", f"template {args.template}": args.template != "key",
                f"{args.digits}-digit numbers": args.digits != 5,
                f"the asked needle at depth {depth}": depth not in (None, "reach"),
                "the asked key just past the windows' reach": depth == "reach",
                "names unseen in training": args.unseen_names and task == "multikey"}
    print(f"\n{task}, retrieval {cfg.retriever}: {args.samples} samples per length, "
          f"{'offloaded' if args.offload else 'on-device'} memory, "
          f"filler {'from ' + args.haystack if haystack else 'sentences'}, "
          f"{'question anywhere in its chunk' if align is None else 'question aligned to a chunk'}"
          + "".join(f", {text}" for text, on in variants.items() if on))
    header = (f"{'length':>8} {'samples':>7} {'accuracy [95% CI]':>17} {'in reach':>8} {'hit@1':>7} {'retrieved':>9} "
              f"{'needle w':>8} {'s/sample':>9} {'peak GPU':>9} {'peak host':>9} {'KV mem':>8}")
    print(header + "\n" + "-" * len(header), flush=True)
    for L in lengths:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0, correct, near, picked = time.time(), 0, 0, []
        for i in range(args.samples):
            seed = prompt_seed(args.seed, task, L, i)
            prompt, answer = make_example(task, L, random.Random(seed), enc, haystack, align=align, **kw)
            state = model.new_state(offload=args.offload)
            progress = Progress(f"{fmt_len(L)} sample {i + 1}/{args.samples}", len(prompt) - 1)
            with ctx:
                out, picks = answer_prompt(model, prompt, len(answer) + SCORE_AFTER, state, args.segment, progress)
            hit = score(out, answer, enc)
            correct, near = correct + hit, near + in_reach(prompt, answer, T, reach)
            if args.show_misses and not hit:
                got, want = enc.decode(out).strip(), enc.decode(answer).strip()
                rng = random.Random(seed)  # make_example drew the needles first: draw them again
                needles = needles_and_question(task, rng, kw["names"], args.keys, args.template, args.digits)[0]
                owner = key_owner(needles, re.match(r"\d*", got).group(), want)
                print(f"  miss at {fmt_len(L)}, sample {i + 1}: wanted {want!r}, got {got!r}"
                      + (f" (another needle's key: {owner}'s)" if owner else ""), flush=True)
            if (p := needle_picks(prompt, answer, picks, T)) is not None:
                picked.append(p)
            kv = state.store.nbytes()
            del state  # before the next sample allocates its own memory
        lo, hi = wilson(correct, args.samples)
        acc = f"{correct / args.samples:.1%} [{100 * lo:.0f}-{100 * hi:.0f}]"
        hit1 = retrieved = needle_w = "-"  # no needle that retrieval could pick
        if n := len(picked):
            found, top, weight = map(sum, zip(*picked))
            hit1, retrieved, needle_w = f"{top}/{n}", f"{found}/{n}", f"{weight / n:.2f}"
        gpu = f"{peak_mem_gib(device):>8.2f}G" if device.type == "cuda" else f"{'-':>9}"
        print(f"{fmt_len(L):>8} {args.samples:>7} {acc:>17} {near:>8} {hit1:>7} {retrieved:>9} {needle_w:>8} "
              f"{(time.time() - t0) / args.samples:>9.2f} {gpu} {peak_mem_gib():>8.2f}G {kv / 2**30:>7.2f}G", flush=True)


# In-context copying (--copying): is a span predicted better once seen, near and past the reach?

def copy_span(cfg):
    """Tokens per near span: 100, or fewer, so that each repeat lies in the window (W*(S-1)/S tokens)."""
    return min(100, cfg.window * (cfg.chunk_size - 1) // cfg.chunk_size - 1)


def copy_far_span(cfg):
    """Tokens per far span, as train.py's far copy rows: past the windows' reach, landmarks taking room too."""
    return window_reach(cfg) + 8


def pass_losses(model, span, passes, ctx, name, only=None):
    """span (n, k) seen `passes` times in a row -> the mean loss on each pass (or on pass `only` alone)."""
    x = torch.from_numpy(np.tile(span, passes)).to(next(model.parameters()).device)  # (n, passes * k)
    k, out = span.shape[1], []
    runs = range(0, passes * k, k) if only is None else [only * k]
    progress = Progress(f"{name}, {k}-token spans", len(runs), "passes")
    for s in runs:  # one pass's targets at a time: never (n, passes * k, vocab) logits
        y = torch.full_like(x[:, 1:], -1)
        y[:, s : s + k - 1] = x[:, s + 1 : s + k]
        with ctx:
            out.append(model(x[:, :-1], y, return_logits=False)[1].item())
        progress(len(out))
    return out


def twin_picks(k, S, K, read_next=False):
    """For a span of k tokens read twice: chunk c's landmark picks, for chunk c+1 of the second reading,
    the two chunks of the first reading that hold its text (an oracle retriever; read_next: the chunks
    before them, which GCA then reads the successors of) -> f(chunk ids (n,)) -> (n, K), -1 where there
    is no twin yet (DRT.hand_picks)."""
    T = S - 1  # text tokens per chunk

    def picks(chunk_ids):
        first = (T * (chunk_ids + 1) - k) // T - int(read_next)  # the first reading's chunk of chunk c+1's first token
        ok = (T * (chunk_ids + 1) >= k) & (first + 1 < chunk_ids) & (first >= 0)  # in the second reading, strictly earlier
        twins = first[:, None] + torch.arange(K, device=chunk_ids.device) % 2  # (n, K): first, first+1, first, ...
        return torch.where(ok[:, None], twins, -1)
    return picks


@torch.no_grad()
def copy_test(model, args, ctx, haystack=None):
    """The mean loss on each pass of spans seen 3 times in a row in the window, and of spans past the windows'
    reach seen twice, whose copy must come through retrieval and GCA; `twins`: far 2 again with the right
    chunks handed to GCA (none without retrieval) -> {span kind: [pass 1-3, far 1-2, twins]}."""
    cfg, n, rng = model.config, args.samples, random.Random(f"{args.seed}-copying")
    L, L_far = copy_span(cfg), copy_far_span(cfg)
    kinds = {"random tokens": lambda k: np.array([[rng.randrange(GPT2_VOCAB) for _ in range(k)] for _ in range(n)])}
    if haystack is not None:
        kinds["haystack text"] = lambda k: np.stack([haystack.sample(k, rng) for _ in range(n)])  # (n, k)
    print(f"\ncopying, retrieval {cfg.retriever}: {n} spans of {L} tokens, each seen 3 times in a row "
          f"(pass 1-3), and {n} spans of {L_far} tokens seen twice (far 1-2: past the windows' reach; twins: "
          f"far 2 with each chunk reading the first reading's chunks that hold its text, which tells the "
          f"read path from the retriever); mean loss per pass (without a pass's first token, which no earlier "
          f"occurrence predicts)")
    header = f"{'span':>14} {'pass 1':>8} {'pass 2':>8} {'pass 3':>8} {'far 1':>8} {'far 2':>8} {'twins':>8}"
    print(header + "\n" + "-" * len(header))
    losses = {}
    for name, rows in kinds.items():
        far = rows(L_far)
        losses[name] = pass_losses(model, rows(L), 3, ctx, name) + pass_losses(model, far, 2, ctx, name)
        twins = float("nan")
        if cfg.groups:
            model.hand_picks = twin_picks(L_far, cfg.chunk_size, cfg.topk, cfg.read_next)
            try:
                twins = pass_losses(model, far, 2, ctx, f"{name} (twins)", only=1)[0]
            finally:
                model.hand_picks = None
        losses[name].append(twins)
        print(f"{name:>14} " + " ".join(f"{'-':>8}" if math.isnan(v) else f"{v:>8.2f}" for v in losses[name]), flush=True)
    return losses


# Long documents (--ppl, --inspect)

BUCKETS = [0, 2**10, 2**12, 2**14, 2**16, 2**18, 2**20]  # position buckets 0-1K, 1K-4K, ..., 256K-1M, 1M+
PPL_SEGMENT = 4096  # --ppl holds one segment's (segment, vocab) logits at a time: on a CPU 16,384 took a 33M
# model 11.5 GB and 46 s for 32K tokens, 4,096 took 3.6 GB and 26 s; on an H200 4,096 costs ~6% in time


def book_names(path):
    """The ids of a .bin's books (a PG19 number, a code directory) from the meta.json beside it, else []."""
    try:
        with open(os.path.join(os.path.dirname(path), "meta.json")) as f:
            splits = json.load(f)["splits"].values()
        return next([str(o[0]) for o in m["offsets"]] for m in splits if m["file"] == os.path.basename(path))
    except (OSError, ValueError, KeyError, StopIteration):
        return []


def read_docs(path, enc, max_tokens=None):
    """--docs (a folder of .txt, one .txt, or a .bin cut at its <|endoftext|>) -> [(name, ids)], at most max_tokens."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".txt"))
        if not files:
            error(f"--docs {path}: no .txt files in that folder")
    elif os.path.isfile(path) and path.endswith((".txt", ".bin")):
        files = [path]
    else:
        error(f"--docs {path}: expected a folder of .txt files, a .txt file, or a .bin from prepare_pg19.py")
    docs = []
    for f in files:
        if f.endswith(".bin"):
            ids = np.fromfile(f, dtype=np.uint16).astype(np.int64)
            books = np.split(ids, np.flatnonzero(ids == EOT) + 1)  # each book ends with its <|endoftext|>
            names = book_names(f) + [""]  # the empty piece after the last <|endoftext|>
            if len(names) != len(books):  # no meta.json beside it, or not this file's
                names = [f"{os.path.basename(f)}#{i}" for i in range(len(books))]
            docs += [(name, book[book != EOT]) for name, book in zip(names, books)]
        else:
            with open(f, encoding="utf-8", errors="replace") as fh:
                docs.append((os.path.basename(f), np.array(enc.encode_ordinary(fh.read()), dtype=np.int64)))
    docs = [(name, d[:max_tokens]) for name, d in docs if len(d) >= 2]
    if not docs:
        error(f"--docs {path}: no document of 2 tokens or more")
    return docs


@torch.no_grad()
def doc_nll(model, ids, args, ctx, name="document"):
    """Every token's loss, the document streamed from its start -> (len(ids) - 1,), nll[i] = -log p(ids[i+1])."""
    x = as_batch(model, ids)  # (1, n)
    state, seg, nll = model.new_state(offload=args.offload), min(args.segment, PPL_SEGMENT), []
    progress = Progress(name, x.size(1) - 1)
    for s in range(0, x.size(1) - 1, seg):
        y = x[:, s + 1 : s + seg + 1]  # (1, L) the next tokens
        with ctx:
            logits, _ = model(x[:, s : s + y.size(1)], y, state=state)  # (1, L, V)
        nll.append(F.cross_entropy(logits[0].float(), y[0], reduction="none"))
        progress(s + y.size(1))
    return torch.cat(nll).cpu()


def perplexity(model, docs, modes, args, ctx):
    """--ppl: perplexity by position, a column per retrieval mode -> {mode: [(tokens, mean loss) per bucket, all]}."""
    cfg = model.config
    print(f"\nperplexity by position: {len(docs)} document(s), {sum(len(d) - 1 for _, d in docs):,} tokens, each "
          f"streamed from its first token in segments of {min(args.segment, PPL_SEGMENT):,}")
    table, stats, curves = {}, {}, {}
    for mode in modes:
        cfg.retriever, model.record = mode, []
        sums, counts = torch.zeros(len(BUCKETS), dtype=torch.float64), torch.zeros(len(BUCKETS), dtype=torch.long)
        fine = torch.zeros(2, 4 * 40, dtype=torch.float64)  # --plot: loss sum and count in quarter octaves of position
        for name, ids in docs:
            nll = doc_nll(model, ids, args, ctx, name).double()
            pos = torch.arange(1, len(ids))  # the predicted token's position
            bucket = torch.bucketize(pos, torch.tensor(BUCKETS), right=True) - 1
            sums.index_add_(0, bucket, nll)
            counts += torch.bincount(bucket, minlength=len(BUCKETS))
            quarter = (4 * pos.double().log2()).long()
            fine[0].index_add_(0, quarter, nll), fine[1].index_add_(0, quarter, torch.ones_like(nll))
        curves[mode] = fine
        table[mode] = ([(int(n), (sm / n).item() if n else float("nan")) for sm, n in zip(sums, counts)]
                       + [(int(counts.sum()), (sums.sum() / counts.sum()).item())])
        stats[mode] = retrieval_stats(model.record, cfg.topk)
    model.record = None
    names = [f"{fmt_len(a)}-{fmt_len(b)}" for a, b in zip(BUCKETS, BUCKETS[1:])] + [f"{fmt_len(BUCKETS[-1])}+", "all"]
    header = f"{'positions':>10} {'tokens':>10} " + " ".join(f"{'ppl ' + m:>12}" for m in modes)
    print(header + "\n" + "-" * len(header))
    for b, bucket in enumerate(names):
        if (n := table[modes[0]][b][0]):
            print(f"{bucket:>10} {n:>10,} " + " ".join(f"{math.exp(table[m][b][1]):>12.2f}" for m in modes))
    for m, st in stats.items():
        if st and m != "none":  # none: every weight 0, nothing retrieved to describe
            print(f"retrieval {m}: sum w {st['sum_w']:.3f}, max w {st['max_w']:.3f}, entropy of w {st['entropy']:.2f} "
                  f"(uniform over the picks: {math.log(cfg.topk):.2f}), mean distance {st['distance']:.1f} chunks"
                  + (f", {sink_label(cfg)} {st['sink']:.2f}" if "sink" in st else ""))
    if getattr(args, "plot", None):
        plot_ppl(curves, cfg, args.plot, f"{len(docs)} document(s) of {args.docs}")
    return table


def pyplot():
    """matplotlib's pyplot, imported only for --plot (an optional requirement), drawing to files alone."""
    try:
        import matplotlib
    except ImportError:
        error("--plot needs matplotlib, an optional requirement: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    print(f"wrote {path}")


def plot_ppl(curves, cfg, path, what):
    """--ppl --plot: perplexity against position (log scale), a curve per retrieval mode, the windows' reach marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for mode, (sums, counts) in curves.items():
        x, y, first, total, n = [], [], 0, 0.0, 0
        for b in range(len(counts)):  # quarter octaves merged until a point averages 256 tokens: no noise at the start
            total, n = total + sums[b].item(), n + counts[b].item()
            if n >= 256 or (b == len(counts) - 1 and n):
                x.append(2 ** ((first + b + 1) / 8))  # the merged range's middle, on the log scale
                y.append(math.exp(total / n))
                first, total, n = b + 1, 0.0, 0
        ax.plot(x, y, label=f"retrieval {mode}")
    ax.axvline(window_reach(cfg), color="gray", ls=":", label="the windows' reach")
    ax.set(xscale="log", yscale="log", xlabel="position in the document (tokens)", ylabel="perplexity", title=what)
    ax.legend()
    save(fig, path)


def plot_picks(records, cfg, path, what):
    """--inspect --plot: for every landmark of the stream (x), the chunks each group picked (y: how far back),
    coloured by their weight (Eq. 3), the windows' reach marked."""
    plt = pyplot()
    G = len(cfg.groups)
    fig, axes = plt.subplots(1, G, figsize=(6.4 * G, 3.6), squeeze=False)
    for g, ax in enumerate(axes[0]):
        t, idx, w = (torch.cat(parts, min(i, 1)) for i, parts in enumerate(zip(*records[g::G])))  # (n,), (1, n, K) x 2
        back = (t[None, :, None] - idx).float()  # picks made at landmark t, read by chunk t+1
        keep = (w > 0) & (back > 0)
        dots = ax.scatter(t[None, :, None].expand_as(idx)[keep], back[keep], c=w[keep].float(), s=4, cmap="viridis", vmin=0)
        ax.axhline(window_reach(cfg) / cfg.chunk_size, color="gray", ls=":", label="the windows' reach")
        ax.set(yscale="log", xlabel="landmark (chunk)", ylabel="picked chunk: chunks back", title=f"{what}, group {g}")
        ax.legend(loc="upper left")
        fig.colorbar(dots, ax=ax, label="weight w")
    save(fig, path)


@torch.no_grad()
def inspect(model, enc, docs, at, args, ctx):
    """--inspect (§4.4's case studies): the chunks each group retrieved, at the landmark before it, for the chunk
    holding token `at` of the first document -> [(group, [(chunk GCA reads, w)] by w)]."""
    name, ids = docs[0]
    T = model.config.chunk_size - 1
    if at >= len(ids):
        error(f"--at={at}: the first document, {name}, has {len(ids):,} tokens: use --at below that")
    c = at // T  # the chunk being predicted
    if c < 2:
        error(f"--at={at}: token {at} lies in chunk {c}; chunks 0 and 1 retrieve nothing: use --at >= {2 * T}")
    show = lambda j: repr(enc.decode(ids[j * T : (j + 1) * T].tolist()))  # noqa: E731
    state, model.record = model.new_state(offload=args.offload), [] if getattr(args, "plot", None) else None
    with ctx:  # the dtype of every other test
        prefill(model, ids[: c * T], state, args.segment, Progress(f"{name}: reading", c * T))  # through chunk c-1's landmark
    if model.record is not None:
        retrieved = [r for r in model.record if not isinstance(r[0], str)]  # per segment, group 0, 1, ...
        plot_picks(retrieved, model.config, args.plot, f"{name}, retrieval {model.config.retriever}")
        model.record = None
    print(f"\n{name}, chunk {c} (tokens {c * T:,}-{(c + 1) * T - 1:,}), retrieval {model.config.retriever}\n"
          f"  the query's chunk {c - 1}: {show(c - 1)}\n  predicted, chunk {c}: {show(c)}")
    out = []
    nxt = model.config.read_next  # GCA reads the chunk after each pick j, never past chunk c-1
    read = ", the chunks GCA reads (read_next: the one after each of Eq. 1's picks)" if nxt else ""
    for g, (idx, w) in enumerate(state.picks):  # the chunks chunk c-1's landmark has GCA read for chunk c
        picks = sorted(zip(idx[0, 0].tolist(), w[0, 0].float().tolist()), key=lambda p: -p[1])[: c - 1]
        print(f"  group {g}: sum w {sum(p[1] for p in picks):.3f}{read}")
        for r, wj in picks:  # under read_next, state.picks already holds the chunk after each of Eq. 1's picks
            print(f"    w {wj:.3f}  chunk {r} ({c - 1 - r} back{f', picked {r - 1}' if nxt else ''}): {show(r)}")
        out.append((g, picks))
    return out


# -----------------------------------------------------------------------------
# The command line: every argument checked before the checkpoint loads, which can take minutes


def depth_bins(text):
    """--depth -> [None] (the needles at random depths), or its bins (fractions and 'reach'); None if bad."""
    if text is None:
        return [None]
    try:
        bins = [t if t == "reach" else float(t) for t in text.split(",")]
    except ValueError:
        return None
    return bins if all(b == "reach" or 0 <= b <= 1 for b in bins) else None


def check_args(args):
    """The arguments that need no file or tokenizer, in order: the first wrong one is the error."""
    try:
        device = torch.device(args.device)
        kind, index = device.type, device.index or 0
    except RuntimeError:
        kind = index = None
    gpus = torch.cuda.device_count()
    for bad, msg in [
        (args.segment < 1, f"--segment={args.segment}: must be >= 1"),
        (args.samples < 1, f"--samples_per_length={args.samples}: must be >= 1"),
        (args.num_samples < 1, f"--num_samples={args.num_samples}: must be >= 1"),
        (args.max_new_tokens < 1, f"--max_new_tokens={args.max_new_tokens}: must be >= 1"),
        (not args.temperature >= 0, f"--temperature={args.temperature}: must be >= 0 (0 = greedy, 1 = as trained)"),
        (args.top_k < 0, f"--top_k={args.top_k}: must be >= 0 (0 = off: sample among all tokens)"),
        (kind is None, f"--device={args.device}: expected cpu, cuda or cuda:N"),
        (kind == "cuda" and not torch.cuda.is_available(), f"--device={args.device}: no CUDA GPU here: pass --device=cpu"),
        (kind == "cuda" and index >= gpus, f"--device={args.device}: this machine has {gpus} GPU(s), numbered from 0"),
        (args.unseen_names and not args.multikey, "--unseen_names: only multi-key has names: add --multikey"),
        (not 2 <= args.keys <= 16 or (args.keys != 4 and not args.multikey),
         f"--keys={args.keys}: multi-key's needle count, 2 to 16 (4 as trained): use it with --multikey"),
        (not 3 <= args.digits <= 7, f"--digits={args.digits}: keys of 3 to 7 digits (5 as trained)"),
        (args.template not in TEMPLATES or (args.template != "key" and not (args.passkey or args.multikey)),
         f"--template={args.template}: passkey's and multi-key's phrasing, one of {', '.join(TEMPLATES)}"),
        (args.depth and args.vartrack,
         "--depth: 2-hop's needles keep their order (a variable is set before it is copied): drop --vartrack"),
        (depth_bins(args.depth) is None,
         f"--depth={args.depth}: expected fractions of the filler in [0, 1] or 'reach', e.g. --depth=0.1,0.5,0.9"),
        ((args.ppl or args.inspect) and not args.docs,
         "--ppl and --inspect read documents: add --docs=PATH (a folder of .txt, a .txt, or a .bin)"),
        (args.max_tokens is not None and args.max_tokens < 2, f"--max_tokens={args.max_tokens}: must be >= 2"),
        (args.plot and args.ppl == args.inspect, "--plot draws --ppl's curves or --inspect's picks: give one of them"),
        (args.plot and args.inspect and len((args.retrieval or "").split(",")) > 1,
         "--inspect --plot draws one retrieval mode: give one --retrieval"),
        (any(m not in ("learned", "random", "none") for m in (args.retrieval or "learned").split(",")),
         f"--retrieval={args.retrieval}: expected learned, random, none, or a comma list of them"),
        (kind == "cpu" and args.dtype != "float32",
         f"--dtype={args.dtype}: autocast runs on CUDA here; a CPU computes in float32: drop --dtype"),
        (args.copying and args.lengths != LENGTHS and not any(getattr(args, t) for t in TASKS),
         f"--lengths={args.lengths}: --copying has spans of its own lengths; --lengths is for "
         f"--passkey, --multikey, --vartrack")]:
        if bad:
            error(msg)


def load_haystack(path, enc):
    """The --haystack text, read once for every test."""
    try:
        return Haystack(path, enc)
    except (OSError, ValueError) as e:  # missing, empty or unreadable
        why = str(e).rstrip(".")
        why = why if why.startswith("--haystack") else f"--haystack {path}: {why}"  # numpy's or the OS's words
        error(f"{why}: give a folder of .txt books or a .bin from prepare_pg19.py, or drop --haystack for "
              f"the synthetic filler")


def arg_parser():
    p = argparse.ArgumentParser(description="Generate from a DRT checkpoint, or run long-context tests.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out_dir", default="out", help="folder with ckpt.pt from train.py")
    p.add_argument("--ckpt", default=None, help="path to a checkpoint file (overrides --out_dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda, cuda:1, ... (default: %(default)s here, cuda where there is a GPU)")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                   choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype on CUDA (default: %(default)s here, bfloat16 where there is a GPU)")
    p.add_argument("--seed", type=int, default=1337, help="random seed (sampling and test prompts)")
    p.add_argument("--tokenizer_file", default=None, help="local gpt2.tiktoken (None: env DRT_GPT2_RANKS or download)")
    p.add_argument("--segment", type=int, default=65536, help="prefill segment in tokens (memory vs speed)")
    p.add_argument("--offload", action="store_true", help="keep chunk keys/values in (pinned) host memory")
    gen = p.add_argument_group("generation (without a test flag)")
    gen.add_argument("--prompt", default="\n", help="prompt text, or FILE:path to read it from (default: %(default)r)")
    gen.add_argument("--num_samples", type=int, default=1, help="generations to draw from the prompt")
    gen.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per generation")
    gen.add_argument("--temperature", type=float, default=0.8, help="1.0 = as trained, < 1 sharper, 0 = greedy")
    gen.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens only; 0 = all")
    test = p.add_argument_group("long-context tests (accuracy per length, one table per test)")
    test.add_argument("--passkey", action="store_true", help="passkey retrieval: one 5-digit key hidden in filler")
    test.add_argument("--multikey", action="store_true", help="multi-key passkey: four named keys, asked for one")
    test.add_argument("--vartrack", action="store_true", help="2-hop variable tracking: VAR X = value ... VAR Y = X")
    test.add_argument("--copying", action="store_true",
                      help="in-context copying: the loss on spans seen 1-3 times, and on repeats past the windows, "
                           "with retrieval and with the right chunks handed over (twins)")
    test.add_argument("--lengths", default=LENGTHS, help="context lengths in tokens (up to 64M)")
    test.add_argument("--samples_per_length", type=int, default=10, dest="samples", metavar="N",
                      help="test prompts per length and test")
    test.add_argument("--samples", type=int, dest="samples", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old
    test.add_argument("--unseen_names", action="store_true", help="multi-key names that no training prompt holds")
    test.add_argument("--show_misses", action="store_true", help="print each wrong answer beside the right one")
    test.add_argument("--keys", type=int, default=4, help="multi-key: needles in each prompt (2-16)")
    test.add_argument("--depth", default=None, help="where the asked needle lies: fractions of the filler "
                      "(0.1,0.5,0.9: a table each), or 'reach': just past the windows' reach (None: random)")
    test.add_argument("--template", default="key", help=f"passkey's and multi-key's phrasing: {', '.join(TEMPLATES)}")
    test.add_argument("--digits", type=int, default=5, help="digits of every key (3-7)")
    test.add_argument("--no_align", action="store_true",
                      help="let the question's last token fall anywhere in its chunk (trained: it opens one)")
    test.add_argument("--retrieval", default=None,
                      help="learned, random, none (the window alone), or a comma list, each in turn (None: as trained)")
    test.add_argument("--haystack", default=None,
                      help="filler of real text: .txt books in a folder, or a prepare_pg19.py .bin (None: sentences)")
    lm = p.add_argument_group("language modelling over long documents")
    lm.add_argument("--ppl", action="store_true", help="perplexity by position over --docs")
    lm.add_argument("--inspect", action="store_true", help="what each group retrieved for the chunk at token --at")
    lm.add_argument("--docs", default=None, help="a folder of .txt, one .txt, or a .bin of prepare_pg19.py")
    lm.add_argument("--max_tokens", type=int, default=None, help="--ppl: the first N tokens of each document only")
    lm.add_argument("--at", type=int, default=4096, help="--inspect: the token of the first document to show")
    lm.add_argument("--plot", default=None, metavar="FILE.png", help="--ppl: perplexity against position, a curve per "
                    "--retrieval mode; --inspect: every pick up to --at; needs matplotlib (pip install matplotlib)")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    check_args(args)
    tasks = [t for t in TASKS if getattr(args, t)]
    if args.plot:
        pyplot()  # a missing matplotlib says so now, not after the model has run
    testing = tasks or args.copying or args.ppl or args.inspect
    prompt = None if testing else read_prompt(args.prompt)
    try:
        enc = get_tokenizer(args.tokenizer_file)
        lengths = parse_lengths(args.lengths) if tasks else None
    except (OSError, RuntimeError, ValueError) as e:
        error(e)
    if tasks:
        check_lengths(tasks, lengths, args, enc)
    haystack = load_haystack(args.haystack, enc) if (tasks or args.copying) and args.haystack else None
    docs = read_docs(args.docs, enc, args.max_tokens) if args.ppl or args.inspect else None

    torch.manual_seed(args.seed)
    model, ckpt = load_model(args.ckpt or args.out_dir, args.device)
    cfg = model.config
    print(f"loaded {args.ckpt or args.out_dir} (iter {ckpt.get('iter_num', '?')}): "
          f"{model.num_params() / 1e6:.1f}M parameters, {cfg}")
    cuda = torch.device(args.device).type == "cuda"
    ctx = torch.autocast("cuda", dtype=getattr(torch, args.dtype)) if cuda and args.dtype != "float32" else nullcontext()
    if not testing:
        return generate(model, enc, prompt, args, ctx)

    depths = depth_bins(args.depth)
    if tasks:
        check_memory(model, max(lengths), args)
        if not args.no_align or "reach" in depths:  # aligned prompts are shorter, a key past the reach longer
            check_lengths(tasks, lengths, args, enc, cfg, "reach" if "reach" in depths else None)
    modes = args.retrieval.split(",") if args.retrieval else [cfg.retriever]
    if args.ppl:
        perplexity(model, docs, modes, args, ctx)
    for mode in modes:
        cfg.retriever = mode
        if args.inspect:
            inspect(model, enc, docs, args.at, args, ctx)
        if args.copying:
            copy_test(model, args, ctx, haystack)
        for task in tasks:
            for depth in depths:
                run_task(model, enc, task, lengths, args, ctx, haystack, depth)


if __name__ == "__main__":
    main(sys.argv[1:])
