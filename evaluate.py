"""
Evaluate a trained DRT as a language model over long documents, and look at what it retrieves.

    python evaluate.py --out_dir=out-code --ppl --docs=data/code/test.bin --max_tokens=32768 --retrieval=learned,random,none
    python evaluate.py --out_dir=out-code-teacher --inspect --docs=data/code/test.bin --doc=drivers__android --at=30558
    python evaluate.py --out_dir=out-passkey-pretrain --copying --haystack=data/pg19/val.bin
    python evaluate.py --out_dir=out-quickstart --ppl --docs=data/pg19/test.bin --plot=ppl.png   # and --inspect --plot

--ppl streams each document from its first token (§3.2) and prints perplexity by position, a column per
retrieval mode: learned, random (Table 4's ablation) and none (the windows alone). --inspect prints the
chunks each group retrieved for the chunk holding token --at of one document (§4.4's case studies).
--copying gives the loss on spans seen again, near and past the windows' reach, and with the right
chunks handed to GCA ("twins"), which tells the read path from the retriever. Every argument is checked
before the model is built.
"""

import argparse
import functools
import math
import os
import random
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

import common
from common import (EOT, GPT2_VOCAB, Progress, as_batch, build_model, fmt_len, get_tokenizer, load_haystack, prefill,
                    read_checkpoint, retrieval_modes, retrieval_stats, shared_args, shared_problems, sink_label)
from model import read_shift, window_reach

error = functools.partial(common.error, "evaluate.py")  # a wrong argument or an unusable file: one line


# -----------------------------------------------------------------------------
# In-context copying (--copying): is a span predicted better once seen, near and past the reach?


def copy_span(cfg):
    """Tokens per near span: 100, or fewer, so that each repeat lies in the window (W*(S-1)/S tokens)."""
    return min(100, cfg.window * (cfg.chunk_size - 1) // cfg.chunk_size - 1)


def copy_far_span(cfg):
    """Tokens per far span, as train.py's far copy rows: past the windows' reach, landmarks taking room too."""
    return window_reach(cfg) + 8


def pass_losses(model, span, passes, ctx, name, only=None, picks=None):
    """span (n, k) seen `passes` times in a row -> the mean loss on each pass (or on pass `only` alone);
    picks: the chunks to read instead of Eq. 1's (DRT.forward)."""
    x = torch.from_numpy(np.tile(span, passes)).to(next(model.parameters()).device)  # (n, passes * k)
    k, out = span.shape[1], []
    runs = range(0, passes * k, k) if only is None else [only * k]
    progress = Progress(f"{name}, {k}-token spans", len(runs), "passes")
    for s in runs:  # one pass's targets at a time: never (n, passes * k, vocab) logits
        y = torch.full_like(x[:, 1:], -1)
        y[:, s : s + k - 1] = x[:, s + 1 : s + k]
        with ctx:
            out.append(model(x[:, :-1], y, picks=picks)[1].item())
        progress(len(out))
    return out


def twin_picks(k, cfg, n):
    """For a span of k tokens read twice, at the row's n landmarks: chunk c's picks, for chunk c+1 of the second
    reading, the two chunks of the first reading that hold its text (an oracle retriever; as picks, which under
    code_read are the chunks before the ones GCA reads, read_shift) -> (n, K), -1 where there is no twin yet."""
    T, chunk_ids = cfg.chunk_size - 1, torch.arange(n)  # text tokens per chunk
    first = (T * (chunk_ids + 1) - k) // T - read_shift(cfg)  # the first reading's chunk of chunk c+1's first token
    ok = (T * (chunk_ids + 1) >= k) & (first + 1 < chunk_ids) & (first >= 0)  # in the second reading, strictly earlier
    twins = first[:, None] + torch.arange(cfg.topk) % 2  # (n, K): first, first+1, first, ...
    return torch.where(ok[:, None], twins, -1)


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
            picks = twin_picks(L_far, cfg, (2 * L_far - 1) // (cfg.chunk_size - 1)).to(next(model.parameters()).device)
            twins = pass_losses(model, far, 2, ctx, f"{name} (twins)", only=1, picks=picks)[0]
        losses[name].append(twins)
        print(f"{name:>14} " + " ".join(f"{'-':>8}" if math.isnan(v) else f"{v:>8.2f}" for v in losses[name]), flush=True)
    return losses


# -----------------------------------------------------------------------------
# Long documents (--ppl, --inspect)

BUCKETS = [0, 2**10, 2**12, 2**14, 2**16, 2**18, 2**20]  # position buckets 0-1K, 1K-4K, ..., 256K-1M, 1M+
PPL_SEGMENT = 4096  # --ppl holds one segment's (segment, vocab) logits at a time: on a CPU 16,384 took a 33M
# model 11.5 GB and 46 s for 32K tokens, 4,096 took 3.6 GB and 26 s; on an H200 4,096 costs ~6% in time


def book_names(path):
    """The ids of a .bin's books (a PG19 number, a code directory) from the meta.json beside it, else []
    (check_bin has read that meta.json: a corrupt one is already an error)."""
    meta = common.read_meta(os.path.dirname(path) or ".")
    entry = common.bin_entry(meta, path) if meta else None
    return [str(o[0]) for o in entry.get("offsets", [])] if entry else []


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
            try:  # a file cut short, or another tokenizer's, is refused by name (as train.py refuses it)
                ids = np.asarray(common.check_bin(f, fix="prepare it again, or pass another --docs")).astype(np.int64)
            except ValueError as e:
                error(f"--docs: {e}")
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


def pick_doc(docs, doc, path):
    """--doc: a document of --docs by its name (a PG19 book number, a code directory, a file) or its index."""
    names = [name for name, _ in docs]
    if doc in names:
        return docs[names.index(doc)]
    if doc.isdigit() and int(doc) < len(docs):
        return docs[int(doc)]
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    error(f"--doc={doc}: {path} has no document of that name, and {len(docs)} by index (0-{len(docs) - 1}): "
          f"give one of {shown}")


@torch.no_grad()
def doc_nll(model, ids, args, ctx, name="document", record=None):
    """Every token's loss, the document streamed from its start -> (len(ids) - 1,), nll[i] = -log p(ids[i+1]);
    record: a list to extend with each segment's DRT.recording(), reduced at once (common.compact)."""
    x = as_batch(model, ids)  # (1, n)
    state, seg, nll = model.new_state(offload=args.offload), min(args.segment, PPL_SEGMENT), []
    progress = Progress(name, x.size(1) - 1)
    for s in range(0, x.size(1) - 1, seg):
        y = x[:, s + 1 : s + seg + 1]  # (1, L) the next tokens
        with ctx, model.recording() if record is not None else nullcontext() as seen:
            logits, _ = model(x[:, s : s + y.size(1)], y, state=state)  # (1, L, V)
        nll.append(F.cross_entropy(logits[0].float(), y[0], reduction="none"))
        if record is not None:
            record.extend(common.compact(seen))
        progress(s + y.size(1))
    return torch.cat(nll).cpu()


def perplexity(models, docs, args, ctx):
    """--ppl: perplexity by position, a column per retrieval mode of models ({mode: DRT}) -> {mode: [(tokens,
    mean loss) per bucket, all]}."""
    modes, cfg = list(models), next(iter(models.values())).config
    print(f"\nperplexity by position: {len(docs)} document(s), {sum(len(d) - 1 for _, d in docs):,} tokens, each "
          f"streamed from its first token in segments of {min(args.segment, PPL_SEGMENT):,}")
    table, stats, curves = {}, {}, {}
    for mode, model in models.items():
        sums, counts = torch.zeros(len(BUCKETS), dtype=torch.float64), torch.zeros(len(BUCKETS), dtype=torch.long)
        fine = torch.zeros(2, 4 * 40, dtype=torch.float64)  # --plot: loss sum and count in quarter octaves of position
        record = []
        for name, ids in docs:
            nll = doc_nll(model, ids, args, ctx, name, record).double()
            pos = torch.arange(1, len(ids))  # the predicted token's position
            bucket = torch.bucketize(pos, torch.tensor(BUCKETS), right=True) - 1
            sums.index_add_(0, bucket, nll)
            counts += torch.bincount(bucket, minlength=len(BUCKETS))
            quarter = (4 * pos.double().log2()).long()
            fine[0].index_add_(0, quarter, nll), fine[1].index_add_(0, quarter, torch.ones_like(nll))
        curves[mode] = fine
        table[mode] = ([(int(n), (sm / n).item() if n else float("nan")) for sm, n in zip(sums, counts)]
                       + [(int(counts.sum()), (sums.sum() / counts.sum()).item())])
        stats[mode] = retrieval_stats(record, cfg.topk)
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
    if args.plot:
        plot_ppl(curves, cfg, args.plot, f"{len(docs)} document(s) of {args.docs}")
    return table


@torch.no_grad()
def inspect(model, enc, doc, at, args, ctx):
    """--inspect (§4.4's case studies): the chunks each group retrieved, at the landmark before it, for the chunk
    holding token `at` of the document doc (name, ids) -> [(group, [(chunk GCA reads, w)] by w)]."""
    name, ids = doc
    T = model.config.chunk_size - 1
    if at >= len(ids):
        error(f"--at={at}: document {name} has {len(ids):,} tokens: use --at below that")
    c = at // T  # the chunk being predicted
    if c < 2:
        error(f"--at={at}: token {at} lies in chunk {c}; chunks 0 and 1 retrieve nothing: use --at >= {2 * T}")
    show = lambda j: repr(enc.decode(ids[j * T : (j + 1) * T].tolist()))  # noqa: E731
    state, record = model.new_state(offload=args.offload), [] if args.plot else None
    with ctx:  # the dtype of every other test
        prefill(model, ids[: c * T], state, args.segment, Progress(f"{name}: reading", c * T), record=record)  # through chunk c-1's landmark
    if args.plot:
        plot_picks(record, model.config, args.plot, f"document {name}, retrieval {model.config.retriever}")
    print(f"\ndocument {name}, chunk {c} (tokens {c * T:,}-{(c + 1) * T - 1:,}), retrieval {model.config.retriever}\n"
          f"  the query's chunk {c - 1}: {show(c - 1)}\n  predicted, chunk {c}: {show(c)}")
    out = []
    shift = read_shift(model.config)  # GCA reads chunk j + shift for a pick j, never past chunk c-1
    read = ", the chunks GCA reads (code_read: the one after each of Eq. 1's picks)" if shift else ""
    for g, (idx, w) in enumerate(state.picks):  # the chunks chunk c-1's landmark has GCA read for chunk c
        picks = sorted(zip(idx[0, 0].tolist(), w[0, 0].float().tolist()), key=lambda p: -p[1])[: c - 1]
        print(f"  group {g}: sum w {sum(p[1] for p in picks):.3f}{read}")
        for r, wj in picks:  # state.picks holds the chunks GCA reads, Eq. 1's picks shifted
            print(f"    w {wj:.3f}  chunk {r} ({c - 1 - r} back{f', picked {r - shift}' if shift else ''}): {show(r)}")
        out.append((g, picks))
    return out


# -----------------------------------------------------------------------------
# Plots (--plot): matplotlib, an optional requirement, imported only here


def pyplot():
    """matplotlib's pyplot, drawing to files alone."""
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
    coloured by their weight (Eq. 3), the windows' reach marked. records: DRT's, one entry per group a segment."""
    plt = pyplot()
    G = len(cfg.groups)
    picks = [r[1:] for r in records if r[0] == "picks"]  # (chunk ids (n,), idx (1, n, K), w (1, n, K))
    fig, axes = plt.subplots(1, G, figsize=(6.4 * G, 3.6), squeeze=False)
    for g, ax in enumerate(axes[0]):
        t, idx, w = (torch.cat(parts, min(i, 1)) for i, parts in enumerate(zip(*picks[g::G])))  # (n,), (1, n, K) x 2
        back = (t[None, :, None] - idx).float()  # picks made at landmark t, read by chunk t+1
        keep = (w > 0) & (back > 0)
        dots = ax.scatter(t[None, :, None].expand_as(idx)[keep], back[keep], c=w[keep].float(), s=4, cmap="viridis", vmin=0)
        ax.axhline(window_reach(cfg) / cfg.chunk_size, color="gray", ls=":", label="the windows' reach")
        ax.set(yscale="log", xlabel="landmark (chunk)", ylabel="picked chunk: chunks back", title=f"{what}, group {g}")
        ax.legend(loc="upper left")
        fig.colorbar(dots, ax=ax, label="weight w")
    save(fig, path)


# -----------------------------------------------------------------------------
# The command line


def check_args(args):
    """The arguments that need no file, in order: the first wrong one is the error."""
    for bad, msg in [
        (args.ppl + args.inspect + args.copying != 1, "give one of --ppl, --inspect, --copying"),
        (args.samples < 1, f"--samples={args.samples}: must be >= 1"),
        *shared_problems(args),
        ((args.ppl or args.inspect) and not args.docs,
         "--ppl and --inspect read documents: add --docs=PATH (a folder of .txt, a .txt, or a .bin)"),
        (args.max_tokens is not None and args.max_tokens < 2, f"--max_tokens={args.max_tokens}: must be >= 2"),
        (args.doc is not None and not args.inspect, "--doc chooses --inspect's document: --ppl reads them all"),
        (args.haystack and not args.copying, "--haystack is the text of --copying's spans: add --copying"),
        (args.plot and args.copying, "--plot draws --ppl's curves or --inspect's picks, not --copying"),
        (args.plot and args.inspect and "," in (args.retrieval or ""),
         "--inspect --plot draws one retrieval mode: give one --retrieval")]:
        if bad:
            error(msg)
    if args.plot:  # a missing matplotlib or a format it cannot write says so now, not after the model has run
        pyplot()
        from matplotlib.backend_bases import FigureCanvasBase
        formats = FigureCanvasBase.get_supported_filetypes()  # {extension: what it is}
        if not (ext := os.path.splitext(args.plot)[1][1:].lower()):  # savefig's rule: no extension, a PNG
            args.plot = args.plot.rstrip(".") + ".png"  # the name it writes, and that "wrote" prints
        elif ext not in formats:
            error(f"--plot={args.plot}: matplotlib cannot write .{ext} files: end the name in .png, or another "
                  f"of its formats ({', '.join(f for f in formats if f != 'png')})")
        if why := common.unwritable(os.path.dirname(os.path.abspath(args.plot))):
            error(f"--plot={args.plot}: {why}")


def arg_parser():
    p = shared_args(argparse.ArgumentParser(description="Evaluate a DRT checkpoint as a language model over long "
                                            "documents.", formatter_class=argparse.ArgumentDefaultsHelpFormatter),
                    "--copying's spans")
    p.add_argument("--ppl", action="store_true", help="perplexity by position over --docs")
    p.add_argument("--inspect", action="store_true", help="what each group retrieved for the chunk at token --at")
    p.add_argument("--copying", action="store_true",
                   help="in-context copying: the loss on spans seen 1-3 times, and on repeats past the windows, "
                        "with retrieval and with the right chunks handed over (twins)")
    p.add_argument("--docs", default=None, help="a folder of .txt, one .txt, or a .bin of prepare_pg19.py")
    p.add_argument("--max_tokens", type=int, default=None, help="the first N tokens of each document only")
    p.add_argument("--doc", default=None, help="--inspect: the document, by name (a PG19 book, a code directory, "
                   "a file) or index in --docs (None: the first)")
    p.add_argument("--at", type=int, default=4096, help="--inspect: the token of the document to show")
    p.add_argument("--samples", type=int, default=10, help="--copying: spans of each kind")
    p.add_argument("--haystack", default=None,
                   help="--copying: spans of real text too, from .txt books in a folder or a prepare_pg19.py .bin")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="--ppl: perplexity against position, a curve per "
                   "--retrieval mode; --inspect: every pick up to --at; the format by the extension (.png, .pdf, .svg, "
                   "...; none: .png); needs matplotlib (pip install matplotlib)")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    check_args(args)
    try:
        enc = get_tokenizer(args.tokenizer_file)
        ckpt, cfg = read_checkpoint(args.ckpt or args.out_dir)  # its tensors mapped, not read: quick
    except (OSError, RuntimeError, ValueError, common.CheckpointError) as e:
        error(e)
    docs = read_docs(args.docs, enc, args.max_tokens) if args.docs else None
    doc = pick_doc(docs, args.doc, args.docs) if args.inspect and args.doc is not None else docs and docs[0]
    try:
        haystack = load_haystack(args.haystack, enc) if args.haystack else None
    except ValueError as e:
        error(e)

    torch.manual_seed(args.seed)
    print(f"loaded {args.ckpt or args.out_dir} (iter {ckpt.get('iter_num', '?')}): {cfg}")
    ctx = common.autocast(args)
    try:
        models = {m: build_model(ckpt, args.device, m) for m in retrieval_modes(args, cfg)}
    except common.CheckpointError as e:
        error(e)
    if args.ppl:
        return perplexity(models, docs, args, ctx)
    for model in models.values():
        if args.inspect:
            inspect(model, enc, doc, args.at, args, ctx)
        else:
            copy_test(model, args, ctx, haystack)


if __name__ == "__main__":
    main(sys.argv[1:])
