"""
Generate text from a trained DRT, or test it on long-context tasks at any length.

    python sample.py --out_dir=out-quickstart --prompt="It was a dark and stormy night"
    python sample.py --out_dir=out-quickstart --prompt=FILE:book.txt --max_new_tokens=200
    python sample.py --out_dir=out-passkey --passkey                       # 4K ... 1M tokens
    python sample.py --out_dir=out-passkey --passkey --lengths=64K,1M,16M --offload --samples_per_length=5
    python sample.py --out_dir=out-passkey --multikey --vartrack --haystack=data/pg19/val.bin
    python sample.py --out_dir=out-passkey-pretrain --copying --haystack=data/pg19/val.bin  # does it copy?
    python sample.py --out_dir=out-passkey --multikey --keys=12 --template=code --depth=0.1,0.5,0.9,reach --seed=2026

The checkpoint (out_dir/ckpt.pt from train.py) carries the model's config: no architecture
flags. Prompts of any length are prefilled in segments and continued token by token with
O(W) self-attention caches (model.DecodeState); --offload keeps the chunk memory (the keys
and values of every past chunk) in host memory and brings only the retrieved chunks to the
GPU. Every argument is checked before the checkpoint loads, so a typo costs no load time.
"""

import argparse
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
from common import fmt_len, fmt_time, parse_lengths, peak_mem_gib
from model import DRT, DRTConfig, retrieval_stats, window_reach
from prepare_pg19 import EOT, GPT2_VOCAB, get_tokenizer
from tasks import NAMES, SCORE_AFTER, TASKS, TEMPLATES, UNSEEN_NAMES, Haystack, key_owner, make_example, min_length
from tasks import needles_and_question, occurrences, score


PROGRESS_AFTER = 10  # seconds between progress lines: long work says how far it got, short work stays quiet


class Progress:
    """Called with the work done so far; prints `label: done/total unit after T, ETA T` at most
    every PROGRESS_AFTER seconds."""

    def __init__(self, label, total, unit="tokens"):
        self.label, self.total, self.unit = label, total, unit
        self.t0 = self.last = time.time()

    def __call__(self, done):
        if time.time() - self.last > PROGRESS_AFTER:
            self.last, dt = time.time(), time.time() - self.t0
            print(f"  {self.label}: {done:,}/{self.total:,} {self.unit} after {fmt_time(dt)}, "
                  f"ETA {fmt_time(dt * (self.total - done) / max(done, 1))}", flush=True)


def error(msg):
    """A wrong argument or an unusable file: one line, no traceback."""
    raise SystemExit(f"sample.py: error: {msg}")


def load_model(path, device):
    """The DRT that train.py saved at path (a ckpt.pt or its out_dir), in eval mode -> (model, checkpoint)."""
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


def prefill(model, ids, state, segment, progress=None):
    """Feed ids (a sequence of ints) through the model in segments; returns the last logits (1, 1, V)."""
    x = torch.as_tensor(np.asarray(ids), dtype=torch.long)[None].to(next(model.parameters()).device)
    for s in range(0, len(ids), segment):
        logits, _ = model(x[:, s : s + segment], state=state)
        if progress:
            progress(min(s + segment, len(ids)))
    return logits


def needle_chunk(prompt, answer, T):
    """The chunk (of T text tokens) where the answer first appears in the prompt, i.e. the chunk
    retrieval must bring back; None if the answer's tokens never appear as such."""
    at = occurrences(prompt, answer)
    return (at[0] + len(answer) // 2) // T if at else None  # a middle token: the chunk that holds most of it


def in_reach(prompt, answer, T, reach):
    """Whether the answer's last mention in the prompt lies within `reach` positions of the prompt's
    last token, which predicts the answer: then the stacked windows can copy it and the prompt does
    not test retrieval. Positions count the landmarks, one after every T text tokens (< reach, where
    a window of W sees W-1 back: it errs toward calling a prompt in reach)."""
    i = occurrences(prompt, answer)[-1] + len(answer) - 1
    return (len(prompt) - 1 + (len(prompt) - 1) // T) - (i + i // T) < reach


def wilson(k, n, z=1.96):
    """The Wilson score interval of k successes in n (95% at z=1.96): unlike p +- z*se it stays
    inside [0, 1] and is not empty at 0/n or n/n, where small tests sit."""
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)  # at 0/n and n/n, exactly 0 and 1 give or take rounding


def prompt_kwargs(args, cfg=None, depth=None):
    """make_example's arguments for the test flags: the names, --keys, --template, --digits, and one
    --depth bin ('reach' needs the model's config: the asked key just past the windows' reach)."""
    kw = dict(names=UNSEEN_NAMES if args.unseen_names else NAMES, keys=args.keys, template=args.template,
              digits=args.digits)
    if depth == "reach":  # the fewest tokens that, landmarks counted, span the reach in positions
        kw["past"] = window_reach(cfg) - window_reach(cfg) // cfg.chunk_size
    elif depth is not None:
        kw["depth"] = depth
    return kw


def prompt_seed(seed, task, L, i):
    """The seed of test prompt i of `task` at length L: the same prompts for every model and run."""
    return f"{seed}-{task}-{L}-{i}"


def check_lengths(tasks, lengths, samples, seed, enc, align=None, **kw):
    """Every test prompt must hold its needles and question: a length too short for the prompts
    run_task will draw is an error now, before the model loads, naming the shortest that works."""
    for task in tasks:
        # prompts differ by a few tokens (multikey: 62 to 69); no length below the longest of 64
        # probes passes, so that whether a length passes does not hang on the luck of its seeds
        floor = max(min_length(task, i, enc, align, **kw) for i in range(64))

        def ok(L):  # every prompt run_task draws at length L fits
            return L >= floor and all(min_length(task, prompt_seed(seed, task, L, i), enc, align, **kw) <= L
                                      for i in range(samples))

        for L in lengths:
            if not ok(L):
                fix = max(L, floor)
                while not ok(fix):
                    fix += 1
                error(f"--lengths: {L} tokens cannot hold the needles and question of a {task} prompt: "
                      f"use lengths of at least {fix}")


def answer_prompt(model, prompt, n, state, segment, progress=None):
    """Prefill the prompt, decode n tokens greedily -> (the tokens, [(chunk ids (K,), weights (K,))]
    per upper group: the picks that served the prompt's last token, which predicts the answer). The
    picks are read before the last token goes in, which may close a chunk whose landmark picks anew:
    so that token is left to model.generate, and the rest prefilled here, with progress."""
    prefill(model, prompt[:-1], state, segment, progress)
    picks = [(idx[0, -1], w[0, -1]) for idx, w in (p for p in state.picks if p is not None)]
    last = torch.as_tensor(np.asarray(prompt[-1:]), dtype=torch.long, device=next(model.parameters()).device)[None]
    out = model.generate(last, n, temperature=0, state=state, prefill_segment=segment)
    return out[0].tolist(), picks


def needle_picks(prompt, answer, picks, T):
    """Retrieval diagnosis of one prompt: was the needle's chunk (or the next one, whose memory saw
    the needle through the lower layers' window) among the picks serving the answer? -> (found, hit@1:
    did one of them get the largest weight among its group's picks (in any upper group), the weight
    the needle's chunks got), or None where retrieval could not pick it (the needle in the last two
    chunks: chunk c reads what the landmark of chunk c-1 picked among chunks < c-1). With several
    needles, `found` passes a retriever that picks every key chunk whatever the name; hit@1 does not.
    picks: [(chunk ids (K,), weights (K,))] per upper group; T: text tokens per chunk."""
    need, last = needle_chunk(prompt, answer, T), (len(prompt) - 1) // T
    if not picks or need is None or need >= last - 1:
        return None
    on_needle = [((idx == need) | (idx == need + 1)) & (w > 0) for idx, w in picks]
    found = any(bool(m.any()) for m in on_needle)
    top = any(bool(m[w.argmax()]) for (_, w), m in zip(picks, on_needle))
    # the weight (Eq. 3) the needle's chunks get, mean over the upper groups: GCA mixes the picked
    # chunks' outputs by it, so other chunks that hold an answer dilute this one
    return found, top, sum(float(w[m].sum()) for (_, w), m in zip(picks, on_needle)) / len(picks)


def describe(task, args, depth):
    """The test variant, for the table's title: the flags that change the prompts."""
    parts = [(f"{args.keys} keys", task == "multikey"), (f"template {args.template}", args.template != "key"),
             (f"{args.digits}-digit numbers", args.digits != 5),
             (f"the asked needle at depth {depth}", depth not in (None, "reach")),
             ("the asked key just past the windows' reach", depth == "reach"),
             ("names unseen in training", args.unseen_names and task == "multikey")]
    return "".join(f", {text}" for text, on in parts if on)


@torch.no_grad()
def run_task(model, enc, task, lengths, args, ctx, haystack=None, depth=None):
    """Accuracy of `task` at each context length; prints one table row per length. depth: one --depth bin."""
    device, cfg = next(model.parameters()).device, model.config
    align = None if args.no_align else cfg.chunk_size - 1
    kw, T, reach = prompt_kwargs(args, cfg, depth), cfg.chunk_size - 1, window_reach(cfg)
    print(f"\n{task}, retrieval {cfg.retriever}: {args.samples} samples per length, "
          f"{'offloaded' if args.offload else 'on-device'} memory, "
          f"filler {'from ' + args.haystack if haystack else 'sentences'}, "
          f"{'question anywhere in its chunk' if align is None else 'question aligned to a chunk'}"
          f"{describe(task, args, depth)}")
    header = (f"{'length':>8} {'samples':>7} {'accuracy [95% CI]':>17} {'in reach':>8} {'hit@1':>7} {'retrieved':>9} "
              f"{'needle w':>8} {'s/sample':>9} {'peak GPU':>9} {'peak host':>9} {'KV mem':>8}")
    print(header + "\n" + "-" * len(header), flush=True)
    for L in lengths:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        correct, near, t0, kv, eligible, found, top, weight = 0, 0, time.time(), 0, 0, 0, 0, 0.0
        for i in range(args.samples):
            seed = prompt_seed(args.seed, task, L, i)  # same prompts for every model and run
            prompt, answer = make_example(task, L, random.Random(seed), enc, haystack, align=align, **kw)
            state = model.new_state(offload=args.offload)
            progress = Progress(f"{fmt_len(L)} sample {i + 1}/{args.samples}", len(prompt) - 1)
            with ctx:
                out, picks = answer_prompt(model, prompt, len(answer) + SCORE_AFTER, state, args.segment, progress)
            hit = score(out, answer, enc)
            correct, near = correct + hit, near + in_reach(prompt, answer, T, reach)
            if args.show_misses and not hit:
                got, want = enc.decode(out).strip(), enc.decode(answer).strip()
                # the needles are drawn first from the prompt's seed: draw them again
                needles = needles_and_question(task, random.Random(seed), kw["names"], args.keys, args.template,
                                               args.digits)[0]
                owner = key_owner(needles, re.match(r"\d*", got).group(), want)
                print(f"  miss at {fmt_len(L)}, sample {i + 1}: wanted {want!r}, got {got!r}"
                      + (f" (another needle's key: {owner}'s)" if owner else ""), flush=True)
            got = needle_picks(prompt, answer, picks, T)
            if got is not None:
                eligible, found, top, weight = eligible + 1, found + got[0], top + got[1], weight + got[2]
            kv = state.memory.nbytes()
            del state  # before the next sample allocates its own memory
        dt = (time.time() - t0) / args.samples
        gpu = peak_mem_gib(device) if device.type == "cuda" else float("nan")
        lo, hi = wilson(correct, args.samples)
        acc = f"{correct / args.samples:.1%} [{100 * lo:.0f}-{100 * hi:.0f}]"
        hits, tops, share = ((f"{found}/{eligible}", f"{top}/{eligible}", f"{weight / eligible:.2f}") if eligible
                             else ("-", "-", "-"))
        gpu_col = f"{gpu:>8.2f}G" if gpu == gpu else f"{'-':>9}"  # no GPU: nan
        print(f"{fmt_len(L):>8} {args.samples:>7} {acc:>17} {near:>8} {tops:>7} {hits:>9} {share:>8} {dt:>9.2f} "
              f"{gpu_col} {peak_mem_gib():>8.2f}G {kv / 2**30:>7.2f}G", flush=True)


LENGTHS = "4K,16K,64K,256K,1M"  # the tests' default context lengths
MAX_LENGTH = 2**26  # 64M tokens: the longest --lengths takes (--help says so)
COPY_SPAN = 100  # tokens per span of the copying test (less where the window is shorter)


def copy_span(cfg):
    """Tokens per span of the copying test: COPY_SPAN, or fewer, so that each repeat lies within
    the self-attention window (the window counts landmarks: W positions hold W*(S-1)/S tokens)."""
    return min(COPY_SPAN, cfg.window * (cfg.chunk_size - 1) // cfg.chunk_size - 1)


def copy_far_span(cfg):
    """Tokens in a far span of the copying test: the windows' reach in positions, plus 8, so that
    (landmarks taking room too) no chain of windows reaches from a token back to its earlier
    occurrence: only retrieval can copy it. The far copy rows of train.py's stage 1 (copy_row)
    are spans of this kind."""
    return window_reach(cfg) + 8


@torch.no_grad()
def copy_test(model, args, ctx, haystack=None):
    """In-context copying (induction), which answering by a name (multi-key, 2-hop) builds on.
    Near: spans seen three times in a row, within the window; the mean loss on each pass. Far: a
    span longer than the stacked windows' reach, seen twice; the loss on its second pass, whose
    copy must come through retrieval and GCA. A model that copies predicts the repeats far better
    than pass 1; passkey can be learned without it (one fixed pattern: the number after "pass key
    is"). Returns {span kind: [pass 1, 2, 3, far pass 1, far pass 2]}."""
    device, cfg = next(model.parameters()).device, model.config
    L, L_far = copy_span(cfg), copy_far_span(cfg)
    rng, n = random.Random(f"{args.seed}-copying"), args.samples

    def random_rows(k):  # (n, k) uniform over GPT-2's ids
        return np.array([[rng.randrange(GPT2_VOCAB) for _ in range(k)] for _ in range(n)])

    def book_rows(k):  # (n, k) spans of the haystack's books
        return np.stack([haystack.sample(k, rng) for _ in range(n)])

    kinds = {"random tokens": random_rows} | ({"book text": book_rows} if haystack is not None else {})
    print(f"\ncopying, retrieval {model.config.retriever}: {n} spans of {L} tokens, each seen 3 times in a row "
          f"(pass 1-3), and {n} spans of {L_far} tokens seen twice (far 1-2: past the windows' reach); mean loss "
          f"per pass (without a pass's first token, which no earlier occurrence predicts)")
    header = f"{'span':>14} {'pass 1':>8} {'pass 2':>8} {'pass 3':>8} {'far 1':>8} {'far 2':>8}"
    print(header + "\n" + "-" * len(header))

    def pass_losses(name, span, passes, starts):  # span (n, k) repeated `passes` times -> mean loss after each start
        x = torch.from_numpy(np.tile(span, passes)).to(device)  # (n, passes * k)
        k, out = span.shape[1], []
        progress = Progress(f"{name}, {k}-token spans", len(starts), "passes")
        for s in starts:  # the loss on tokens s+1 .. s+k-1 alone, never holding (n, passes * k, vocab) logits
            y = torch.full_like(x[:, 1:], -1)
            y[:, s : s + k - 1] = x[:, s + 1 : s + k]
            with ctx:
                out.append(model(x[:, :-1], y, return_logits=False)[1].item())
            progress(len(out))
        return out

    losses = {}
    for name, rows in kinds.items():
        losses[name] = pass_losses(name, rows(L), 3, [0, L, 2 * L]) + pass_losses(name, rows(L_far), 2, [0, L_far])
        print(f"{name:>14} " + " ".join(f"{v:>8.2f}" for v in losses[name]), flush=True)
    return losses


def check_memory(model, L, args):
    """Refuse a length whose chunk memory cannot fit before it runs for hours: the keys and values
    of every chunk, 2*d*bytes per text token x S/(S-1), in host memory with --offload or on a
    CPU, else on the GPU; one prompt at a time."""
    cfg, device = model.config, next(model.parameters()).device
    on_gpu = device.type == "cuda" and not args.offload
    size = 2 if device.type == "cuda" and args.dtype != "float32" else 4  # autocast on CUDA alone
    need = L * 2 * cfg.n_embd * size * cfg.chunk_size / (cfg.chunk_size - 1)
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else common.available_mem()
    if free is not None and need > free:
        where = "GPU" if on_gpu else "host"
        error(f"--lengths: a {fmt_len(L)}-token prompt holds {need / 1e9:.2f} GB of chunk keys/values in {where} "
              f"memory, and {free / 1e9:.2f} GB are available: use shorter lengths"
              + (" or --offload (host memory)" if on_gpu else ""))


# -----------------------------------------------------------------------------
# Language modelling over long documents: the loss by position, and what was retrieved


BUCKETS = [0, 2**10, 2**12, 2**14, 2**16, 2**18, 2**20]  # position buckets 0-1K, 1K-4K, ..., 256K-1M, 1M+
PPL_SEGMENT = 16384  # --ppl holds one segment's (segment, vocab) logits at a time: 3.3 GB in fp32 at GPT-2's vocabulary


def read_docs(path, enc, max_tokens=None):
    """--docs: [(name, token ids)]: each .txt of a folder, one .txt, or a .bin of prepare_pg19.py
    cut at its <|endoftext|> tokens; each document at most max_tokens long."""
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
            docs += [(f"{os.path.basename(f)}#{i}", book[book != EOT]) for i, book in enumerate(books)]
        else:
            with open(f, encoding="utf-8", errors="replace") as fh:
                docs.append((os.path.basename(f), np.array(enc.encode_ordinary(fh.read()), dtype=np.int64)))
    docs = [(name, d[:max_tokens]) for name, d in docs if len(d) >= 2]
    if not docs:
        error(f"--docs {path}: no document of 2 tokens or more")
    return docs


@torch.no_grad()
def doc_nll(model, ids, args, ctx, name="document"):
    """The loss of every token of one document streamed from its start through a DecodeState, in
    segments, as the long-context tests stream their prompts: (len(ids) - 1,), nll[i] = -log p(ids[i+1])."""
    device = next(model.parameters()).device
    x = torch.as_tensor(ids, dtype=torch.long, device=device)[None]  # (1, n)
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
    """--ppl: the mean loss and perplexity per position bucket over docs, for each retrieval mode,
    and the retrieval statistics (model.retrieval_stats) beside. -> {mode: [(tokens, mean loss) per bucket]}."""
    n_tok = sum(len(d) - 1 for _, d in docs)
    print(f"\nperplexity by position: {len(docs)} document(s), {n_tok:,} tokens, each streamed from its first token "
          f"in segments of {min(args.segment, PPL_SEGMENT):,}")
    table, stats = {}, {}
    for mode in modes:
        model.config.retriever, model.record = mode, []
        sums, counts = torch.zeros(len(BUCKETS), dtype=torch.float64), torch.zeros(len(BUCKETS), dtype=torch.long)
        for name, ids in docs:
            nll = doc_nll(model, ids, args, ctx, name).double()
            bucket = torch.bucketize(torch.arange(1, len(ids)), torch.tensor(BUCKETS), right=True) - 1  # of the predicted token
            sums.index_add_(0, bucket, nll)
            counts += torch.bincount(bucket, minlength=len(BUCKETS))
        table[mode] = [(int(n), (sm / n).item() if n else float("nan")) for sm, n in zip(sums, counts)]
        table[mode].append((int(counts.sum()), (sums.sum() / counts.sum()).item()))
        stats[mode] = retrieval_stats(model.record, model.config.topk)
    model.record = None
    names = [f"{fmt_len(a)}-{fmt_len(b)}" for a, b in zip(BUCKETS, BUCKETS[1:])] + [f"{fmt_len(BUCKETS[-1])}+", "all"]
    header = f"{'positions':>10} {'tokens':>10} " + " ".join(f"{'ppl ' + m:>12}" for m in modes)
    print(header + "\n" + "-" * len(header))
    for b, name in enumerate(names):
        n = table[modes[0]][b][0]
        if n:
            print(f"{name:>10} {n:>10,} " + " ".join(f"{math.exp(table[m][b][1]):>12.2f}" for m in modes))
    for m, st in stats.items():
        if st:
            print(f"retrieval {m}: sum w {st['sum_w']:.3f}, max w {st['max_w']:.3f}, entropy of w {st['entropy']:.2f} "
                  f"(uniform over the picks: {math.log(model.config.topk):.2f}), mean distance {st['distance']:.1f} chunks")
    return table


@torch.no_grad()
def inspect(model, enc, docs, at, args, ctx):
    """--inspect: the paper's case studies (§4.4): for the chunk holding token `at` of the first
    document, the chunks each group retrieved for it (at the landmark of the chunk before), as text,
    with their weights and distances. -> [(group, [(chunk, weight)] by weight)]."""
    name, ids = docs[0]
    T = model.config.chunk_size - 1
    c = min(at, len(ids) - 1) // T  # the chunk being predicted
    if c < 2:
        error(f"--at={at}: token {at} lies in chunk {c}; chunks 0 and 1 retrieve nothing: use --at >= {2 * T}")
    show = lambda j: repr(enc.decode(ids[j * T : (j + 1) * T].tolist()))  # noqa: E731
    state = model.new_state(offload=args.offload)
    prefill(model, ids[: c * T], state, args.segment)  # through the landmark of chunk c-1
    print(f"\n{name}, chunk {c} (tokens {c * T:,}-{(c + 1) * T - 1:,}), retrieval {model.config.retriever}\n"
          f"  the query's chunk {c - 1}: {show(c - 1)}\n  predicted, chunk {c}: {show(c)}")
    out = []
    for g, (idx, w) in enumerate(state.picks):
        picks = sorted(zip(idx[0, 0].tolist(), w[0, 0].float().tolist()), key=lambda p: -p[1])[: min(c - 1, len(idx[0, 0]))]
        print(f"  group {g}: sum w {sum(p[1] for p in picks):.3f}")
        for j, wj in picks:
            print(f"    w {wj:.3f}  chunk {j} ({c - 1 - j} back): {show(j)}")
        out.append((g, picks))
    return out


def check_args(args):
    """The arguments that need no file or tokenizer, checked first."""
    for name in ("segment", "samples", "num_samples", "max_new_tokens"):
        if getattr(args, name) < 1:
            flag = "samples_per_length" if name == "samples" else name
            error(f"--{flag}={getattr(args, name)}: must be >= 1")
    if not args.temperature >= 0:
        error(f"--temperature={args.temperature}: must be >= 0 (0 = greedy, 1 = as trained)")
    if args.top_k < 0:
        error(f"--top_k={args.top_k}: must be >= 0 (0 = off: sample among all tokens)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        error(f"--device={args.device}: expected cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        error(f"--device={args.device}: no CUDA GPU here: pass --device=cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        error(f"--device={args.device}: this machine has {torch.cuda.device_count()} GPU(s), numbered from 0")
    if args.unseen_names and not args.multikey:
        error("--unseen_names: only multi-key has names: add --multikey")
    if not 2 <= args.keys <= 16 or (args.keys != 4 and not args.multikey):
        error(f"--keys={args.keys}: multi-key's needle count, 2 to 16 (4 as trained): use it with --multikey")
    if not 3 <= args.digits <= 7:
        error(f"--digits={args.digits}: keys of 3 to 7 digits (5 as trained)")
    if args.template not in TEMPLATES or (args.template != "key" and not (args.passkey or args.multikey)):
        error(f"--template={args.template}: passkey's and multi-key's phrasing, one of {', '.join(TEMPLATES)}")
    if args.depth and args.vartrack:
        error("--depth: 2-hop's needles keep their order (a variable is set before it is copied): drop --vartrack")
    depth_bins(args.depth)
    if (args.ppl or args.inspect) and not args.docs:
        error("--ppl and --inspect read documents: add --docs=PATH (a folder of .txt, a .txt, or a .bin)")
    if args.max_tokens is not None and args.max_tokens < 2:
        error(f"--max_tokens={args.max_tokens}: must be >= 2")
    modes = (args.retrieval or "learned").split(",")
    if any(m not in ("learned", "random", "none") for m in modes):
        error(f"--retrieval={args.retrieval}: expected learned, random, none, or a comma list of them")
    if device.type == "cpu" and args.dtype != "float32":
        error(f"--dtype={args.dtype}: autocast runs on CUDA here; a CPU computes in float32: drop --dtype")
    if args.copying and args.lengths != LENGTHS and not any(getattr(args, t) for t in TASKS):
        error(f"--lengths={args.lengths}: --copying has spans of its own lengths; --lengths is for "
              f"--passkey, --multikey, --vartrack")


def depth_bins(text):
    """--depth: [None] (the needles at random depths), or the bins of a comma list of fractions and 'reach'."""
    if text is None:
        return [None]
    try:
        bins = [t if t == "reach" else float(t) for t in text.split(",")]
    except ValueError:
        bins = [math.nan]
    if not all(b == "reach" or 0 <= b <= 1 for b in bins):
        error(f"--depth={text}: expected fractions of the filler in [0, 1] or 'reach', e.g. --depth=0.1,0.5,0.9")
    return bins


def read_prompt(prompt):
    """The prompt text, read from a file for FILE:path."""
    if not prompt.startswith("FILE:"):
        return prompt
    path = prompt[5:]
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        error(f"--prompt=FILE:{path}: cannot read it ({e.strerror}): give an existing text file, or the text itself")
    except UnicodeDecodeError:
        error(f"--prompt=FILE:{path}: not UTF-8 text: give a text file, or the text itself")


def load_haystack(path, enc):
    """The --haystack text, read once for every test."""
    try:
        return Haystack(path, enc)
    except (OSError, ValueError) as e:  # missing, empty or unreadable
        why = str(e).rstrip(".")
        if not why.startswith("--haystack"):  # numpy's or the OS's words: name the file
            why = f"--haystack {path}: {why}"
        error(f"{why}: give a folder of .txt books or a .bin from prepare_pg19.py, or drop --haystack for "
              f"the synthetic filler")


def arg_parser():
    p = argparse.ArgumentParser(description="Generate from a DRT checkpoint, or run long-context tests "
                                "(--passkey, --multikey, --vartrack, --copying).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out_dir", default="out", help="folder with ckpt.pt from train.py")
    p.add_argument("--ckpt", default=None, help="path to a checkpoint file (overrides --out_dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda, cuda:1, ... (default: %(default)s here; cuda where there is a GPU)")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                   choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype on CUDA (default: %(default)s here; bfloat16 where there is a GPU)")
    p.add_argument("--seed", type=int, default=1337, help="random seed (sampling and test prompts)")
    p.add_argument("--tokenizer_file", default=None, help="local gpt2.tiktoken (None: env DRT_GPT2_RANKS or download)")
    p.add_argument("--segment", type=int, default=65536, help="prefill segment in tokens (memory vs speed)")
    p.add_argument("--offload", action="store_true", help="keep chunk keys/values in (pinned) host memory")
    gen = p.add_argument_group("generation (without a test flag)")
    gen.add_argument("--prompt", default="\n",
                     help="prompt text, or FILE:path to read it from a file (default: %(default)r)")
    gen.add_argument("--num_samples", type=int, default=1,
                     help="generations to draw from the prompt (the tests count prompts with --samples_per_length)")
    gen.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per generation")
    gen.add_argument("--temperature", type=float, default=0.8, help="1.0 = as trained, < 1 sharper, 0 = greedy")
    gen.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens only; 0 = all tokens")
    test = p.add_argument_group("long-context tests (accuracy per length, one table per test)")
    test.add_argument("--passkey", action="store_true", help="passkey retrieval: one 5-digit key hidden in filler")
    test.add_argument("--multikey", action="store_true", help="multi-key passkey: four named keys, asked for one")
    test.add_argument("--vartrack", action="store_true",
                      help="2-hop variable tracking: VAR X = value ... VAR Y = X, beside a second chain")
    test.add_argument("--copying", action="store_true",
                      help="in-context copying: the loss on spans seen 1, 2, 3 times in the window, and on "
                           "the repeat of a span longer than the windows' reach (book text too with --haystack)")
    test.add_argument("--lengths", default=LENGTHS, help="context lengths in tokens (up to 64M)")
    # dest "samples": run_task reads args.samples
    test.add_argument("--samples_per_length", type=int, default=10, dest="samples", metavar="N",
                      help="test prompts per length and test (not --num_samples, which counts generations)")
    test.add_argument("--samples", type=int, dest="samples", default=argparse.SUPPRESS,
                      help=argparse.SUPPRESS)  # the old name, hidden
    test.add_argument("--unseen_names", action="store_true",
                      help="multi-key asks for a second list of names (tasks.UNSEEN_NAMES), in no training "
                      "prompt: tells a model trained on tasks.NAMES (--task_names=twenty) matching names from "
                      "having learned those twenty")
    test.add_argument("--show_misses", action="store_true", help="print each wrong answer next to the right one "
                      "(and whose key it is where another needle's)")
    test.add_argument("--keys", type=int, default=4, help="multi-key: needles in each prompt (2-16); above the "
                      "model's top-k, a retriever blind to the name cannot serve them all")
    test.add_argument("--depth", default=None, help="where the asked needle lies: fractions of the filler (0.1,0.5,0.9: "
                      "a table each), or 'reach': its key just past the stacked windows' reach of the question "
                      "(None: every needle at a random depth)")
    test.add_argument("--template", default="key", help=f"passkey's and multi-key's phrasing: {', '.join(TEMPLATES)} "
                      "('code', 'The secret code for <name> is ...', is in none of the recipe's training prompts)")
    test.add_argument("--digits", type=int, default=5, help="digits of every key (3-7)")
    test.add_argument("--no_align", action="store_true",
                      help="do not cut prompts so that the question's last token opens a chunk (the default "
                      "format, as in training: then the landmark before the answer has read the question)")
    test.add_argument("--retrieval", default=None,
                      help="learned, random (uniformly random earlier chunks, weighted by Eq. 3) or none (weights 0: "
                      "the window alone), or a comma list, each run in turn (None: as trained)")
    test.add_argument("--haystack", default=None,
                      help="real text as filler: a folder of .txt books or a .bin from prepare_pg19.py "
                      "(None: a repeated 'The grass is green.' filler)")
    lm = p.add_argument_group("language modelling over long documents")
    lm.add_argument("--ppl", action="store_true", help="perplexity by position over --docs, each document streamed "
                    f"from its first token in segments (of at most {PPL_SEGMENT:,} tokens)")
    lm.add_argument("--inspect", action="store_true",
                    help="print what each group retrieved for the chunk at token --at of the first --docs document")
    lm.add_argument("--docs", default=None,
                    help="a folder of .txt (one document each), one .txt, or a .bin of prepare_pg19.py (its books)")
    lm.add_argument("--max_tokens", type=int, default=None, help="--ppl: the first N tokens of each document only")
    lm.add_argument("--at", type=int, default=4096, help="--inspect: the token whose chunk to show")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    # every argument is checked before the checkpoint loads, which can take minutes
    check_args(args)
    tasks = [t for t in TASKS if getattr(args, t)]
    testing = tasks or args.copying or args.ppl or args.inspect
    prompt = None if testing else read_prompt(args.prompt)
    try:
        enc = get_tokenizer(args.tokenizer_file)
    except (OSError, RuntimeError, ValueError) as e:
        error(e)
    haystack = None
    if tasks:
        try:
            lengths = parse_lengths(args.lengths)
        except ValueError as e:
            error(e)
        if max(lengths) > MAX_LENGTH:
            error(f"--lengths: {fmt_len(max(lengths))} tokens is past the {fmt_len(MAX_LENGTH)} this harness "
                  f"supports: use lengths up to {fmt_len(MAX_LENGTH)}")
        check_lengths(tasks, lengths, args.samples, args.seed, enc, **prompt_kwargs(args))
    if (tasks or args.copying) and args.haystack:
        haystack = load_haystack(args.haystack, enc)  # once, for every test
    docs = read_docs(args.docs, enc, args.max_tokens) if args.ppl or args.inspect else None

    torch.manual_seed(args.seed)
    model, ckpt = load_model(args.ckpt or args.out_dir, args.device)
    print(f"loaded {args.ckpt or args.out_dir} (iter {ckpt.get('iter_num', '?')}): "
          f"{model.num_params() / 1e6:.1f}M parameters, {model.config}")
    device_type = "cuda" if "cuda" in args.device else "cpu"
    dtype = getattr(torch, args.dtype)
    ctx = torch.autocast(device_type, dtype=dtype) if device_type == "cuda" and dtype != torch.float32 else nullcontext()

    if testing:
        if tasks:
            check_memory(model, max(lengths), args)
        depths, cfg = depth_bins(args.depth), model.config
        if tasks and (not args.no_align or "reach" in depths):  # aligned prompts are up to chunk_size-2 tokens
            # shorter, and a key past the reach needs room the model's reach sets: check again
            check_lengths(tasks, lengths, args.samples, args.seed, enc, None if args.no_align else cfg.chunk_size - 1,
                          **prompt_kwargs(args, cfg, "reach" if "reach" in depths else None))
        modes = args.retrieval.split(",") if args.retrieval else [model.config.retriever]
        if args.ppl:
            perplexity(model, docs, modes, args, ctx)
        for mode in modes:
            model.config.retriever = mode
            if args.inspect:
                inspect(model, enc, docs, args.at, args, ctx)
            if args.copying:
                copy_test(model, args, ctx, haystack)
            for task in tasks:
                for depth in depths:
                    run_task(model, enc, task, lengths, args, ctx, haystack, depth)
        return

    ids = enc.encode_ordinary(prompt) or [enc.eot_token]
    x = torch.tensor([ids], dtype=torch.long, device=args.device)
    for _ in range(args.num_samples):
        with ctx:
            out = model.generate(x, args.max_new_tokens, args.temperature, args.top_k or None,  # 0: no top-k
                                 state=model.new_state(offload=args.offload), prefill_segment=args.segment)
        print(prompt[-500:] + enc.decode(out[0].tolist()))
        print("-" * 40, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
