"""
Generate text from a trained DRT, or test it on long-context tasks at any length.

    python sample.py --out_dir=out-quickstart --prompt="It was a dark and stormy night"
    python sample.py --out_dir=out-quickstart --prompt=FILE:book.txt --max_new_tokens=200
    python sample.py --out_dir=out-passkey --passkey                       # 4K ... 1M tokens
    python sample.py --out_dir=out-passkey --passkey --lengths=64K,1M,16M --offload --samples_per_length=5
    python sample.py --out_dir=out-passkey --multikey --vartrack --haystack=data/pg19/val.bin

The checkpoint (out_dir/ckpt.pt from train.py) carries the model's config: no architecture flags.
Prompts of any length are prefilled in segments, then decoded with O(W) self-attention caches
(§3.2 of the paper); --offload keeps the chunk memory in host memory and brings only the retrieved
chunks to the GPU. Every argument is checked before the model is built. Perplexity by position,
the picks and in-context copying: evaluate.py.
"""

import argparse
import codecs
import functools
import random
import re
import sys
import time

import torch
import torch.nn.functional as F

import common
from common import (Progress, as_batch, build_model, fmt_len, get_tokenizer, load_haystack, parse_lengths,
                    peak_mem_gib, prefill, read_checkpoint, retrieval_modes, shared_args, shared_problems)
from model import skim_margin, window_reach
from tasks import NAMES, SCORE_AFTER, TASKS, TEMPLATES, UNSEEN_NAMES, in_reach, key_owner, make_example, on_needle
from tasks import CHAINS, hop_hits, hop_spacing, min_length, needle_picks, needles_and_question, score, wilson

# -----------------------------------------------------------------------------
# Generation: a prompt, model.generate (the checkpoint: common.read_checkpoint, common.build_model)


error = functools.partial(common.error, "sample.py")  # a wrong argument or an unusable file: one line


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


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, state=None, prefill_segment=16384, emit=None):
    """Continue idx (B, T) by max_new_tokens through a stream (§3.2): the prompt prefilled in segments of
    prefill_segment tokens, then one token per step -> (B, max_new_tokens) new ids; emit: called with each
    new token (B, 1) as it is drawn."""
    state = state if state is not None else model.new_state()
    for s in range(0, idx.size(1), prefill_segment):
        logits, _ = model(idx[:, s : s + prefill_segment], state=state)
    out = []
    for _ in range(max_new_tokens):
        logits = logits[:, -1, : model.config.landmark_id].float()  # never sample the landmark or padding ids
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = float("-inf")
            nxt = torch.multinomial(F.softmax(logits, -1), 1)
        out.append(nxt)
        emit and emit(nxt)
        logits, _ = model(nxt, state=state)
    return torch.cat(out, 1)


def print_samples(model, enc, prompt, args, ctx):
    """Print --num_samples continuations, each after the prompt's last 500 characters, streamed as generated: token
    by token through an incremental UTF-8 decoder (a character split across tokens shows once whole)."""
    x = as_batch(model, enc.encode_ordinary(prompt) or [enc.eot_token])  # (1, T)
    for _ in range(args.num_samples):
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as enc.decode
        print(prompt[-500:], end="", flush=True)
        with ctx:
            generate(model, x, args.max_new_tokens, args.temperature, args.top_k or None,  # top_k 0: all tokens
                     state=model.new_state(offload=args.offload), prefill_segment=args.segment,
                     emit=lambda t: print(utf8.decode(enc.decode_single_token_bytes(t.item())), end="", flush=True))
        print(utf8.decode(b"", final=True), "-" * 40, sep="\n", flush=True)


# -----------------------------------------------------------------------------
# The long-context harness: passkey, multi-key and 2-hop accuracy by length (Appendix D) beside
# what retrieval picked (the loss by position, copying and the picks themselves: evaluate.py)

LENGTHS = "4K,16K,64K,256K,1M"  # the tests' default context lengths
MAX_LENGTH = common.MAX_LENGTH  # 64M tokens: the longest --lengths takes


def answer_prompt(model, prompt, n, state, segment, progress=None, marks=()):
    """Prefill the prompt (skimmed up to its last skim_margin tokens: outputs are read only after it), decode n
    tokens greedily -> (the tokens, {token: [(chunk ids (K,), weights (K,))] per upper group}: the picks made at the
    landmark after that token, for each of marks and for the one before the last token, which serve the prompt's
    last token, read before it goes in, as it may close a chunk)."""
    cfg, picks, start = model.config, {}, 0
    for end in sorted({*marks, len(prompt) - 2}):
        prefill(model, prompt[start : end + 1], state, segment, progress, skim_margin(cfg))
        picks[end], start = [(idx[0, -1], w[0, -1]) for idx, w in (p for p in state.picks if p is not None)], end + 1
    out = generate(model, as_batch(model, prompt[-1:]), n, temperature=0, state=state, prefill_segment=segment)
    return out[0].tolist(), picks


def prompt_kwargs(args, cfg, depth=None):
    """make_example's arguments for the test flags and one --depth bin."""
    kw = dict(names=UNSEEN_NAMES if args.unseen_names else NAMES, keys=args.keys, template=args.template,
              digits=args.digits, chains=args.chains, lead=not args.no_lead,
              spacing=hop_spacing(cfg))
    if depth == "reach":  # the fewest tokens that, landmarks counted, span the reach in positions
        reach = window_reach(cfg)
        kw["past"] = reach - reach // cfg.chunk_size
    elif depth is not None:
        kw["depth"] = depth
    return kw


def prompt_seed(seed, task, L, i):
    """Test prompt i's seed: the same prompts for every model and run."""
    return f"{seed}-{task}-{L}-{i}"


def check_lengths(tasks, lengths, args, enc, cfg, depth=None):
    """Refuse a length past MAX_LENGTH or too short for run_task's prompts as cut to cfg's chunks, naming the
    shortest that works."""
    if max(lengths) > MAX_LENGTH:
        error(f"--lengths: {fmt_len(max(lengths))} tokens is past the {fmt_len(MAX_LENGTH)} this harness "
              f"supports: use lengths up to {fmt_len(MAX_LENGTH)}")
    align = None if args.no_align else cfg.chunk_size - 1
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


def check_memory(cfg, L, args):
    """Refuse a length whose chunk memory (2*d*bytes per text token x S/(S-1)) cannot fit, before it runs for hours."""
    device = torch.device(args.device)
    size = 2 if device.type == "cuda" and args.dtype != "float32" else 4  # autocast on CUDA alone
    if why := common.stream_memory_error(L, cfg.n_embd, cfg.chunk_size, device, args.offload, size):
        error(f"--lengths: {why}")


@torch.no_grad()
def run_task(model, enc, task, lengths, args, ctx, haystack=None, depth=None):
    """Accuracy of `task` at each context length, a table row each; depth: one --depth bin."""
    device, cfg = next(model.parameters()).device, model.config
    T, kw = cfg.chunk_size - 1, prompt_kwargs(args, cfg, depth)
    sight = window_reach(cfg, exact=True) + 1  # in_reach counts distances below it
    align = None if args.no_align else T
    hops = task == "vartrack"  # the per-group columns: hop h's hit@1 in group h (or the last)
    print_header(task, args, cfg, kw, depth, haystack, align)
    for L in lengths:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0, correct, near, picked, hopped = time.time(), 0, 0, [], []
        for i in range(args.samples):
            seed = prompt_seed(args.seed, task, L, i)
            prompt, answer, spans = make_example(task, L, random.Random(seed), enc, haystack, align=align, **kw)
            state = model.new_state(offload=args.offload)
            progress = Progress(f"{fmt_len(L)} sample {i + 1}/{args.samples}", len(prompt) - 1)
            with ctx:
                out, picks = answer_prompt(model, prompt, len(answer) + SCORE_AFTER, state, args.segment, progress,
                                           [asked for *_, asked in spans])
            hopped += [hop_hits(spans, picks, T)] if hops else []
            every, picks = picks, picks[len(prompt) - 2]
            hit = score(out, answer, enc)
            correct, near = correct + hit, near + in_reach(prompt, answer, T, sight)
            if args.show_misses and not hit:
                reads = hop_reads(prompt, spans, every, T, enc) if hops else needle_reads(prompt, answer, picks, T)
                print_miss(task, args, kw, seed, L, i, out, answer, enc, reads)
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
        per_hop = "".join(f" {count_hits(h):>5}" for h in zip(*hopped)) if hops else ""
        print(f"{fmt_len(L):>8} {args.samples:>7} {acc:>17} {near:>8} {hit1:>7} {retrieved:>9} {needle_w:>8}{per_hop} "
              f"{(time.time() - t0) / args.samples:>9.2f} {gpu} {peak_mem_gib():>8.2f}G {kv / 2**30:>7.2f}G", flush=True)


def print_header(task, args, cfg, kw, depth, haystack, align):
    """run_task's first lines: what the prompts are, then the table's column names."""
    hops = task == "vartrack"
    variants = {f"{args.keys} keys": task == "multikey", f"template {args.template}": args.template != "key",
                f"{args.chains} chains ({args.chains + 1} needles for one retrieval, top-{cfg.topk}), each chain's needles "
                f"{kw['spacing'][0]:,} tokens apart and its copy {kw['spacing'][1]:,} before the end, the question asked "
                f"{'in one piece' if args.no_lead else 'a chunk ahead'}"
                f"; hop h's hit@1 in group {'h' if len(cfg.groups) > 1 else '1'}": hops,
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
              f"{'needle w':>8}" + (f" {'hop1':>5} {'hop2':>5}" if hops else "") +
              f" {'s/sample':>9} {'peak GPU':>9} {'peak host':>9} {'KV mem':>8}")
    print(header + "\n" + "-" * len(header), flush=True)


def print_miss(task, args, kw, seed, L, i, out, answer, enc, reads):
    """--show_misses' line for a wrong answer: what was wanted, what came, whose key it is if another needle's, and
    reads (2-hop: what each hop's group weighed most; one hop: where each group ranked the needle)."""
    got, want = enc.decode(out).strip(), enc.decode(answer).strip()
    rng = random.Random(seed)  # make_example drew the needles first: draw them again
    needles = needles_and_question(task, rng, kw["names"], args.keys, args.template, args.digits, args.chains)[0]
    owner = key_owner(needles, re.match(r"\d*", got).group(), want)
    print(f"  miss at {fmt_len(L)}, sample {i + 1}: wanted {want!r}, got {got!r}"
          + (f" (another needle's key: {owner}'s)" if owner else "") + reads, flush=True)


def hop_reads(prompt, spans, picks, T, enc):
    """What each group weighed most at each hop's landmark, as the assignments in that chunk (or 'text'). Hop h's
    needle should be group h's at hop h's landmark; group 1 holding hop 1 only at hop 2's landmark fetched it too late
    for group 2 to read it."""
    said = []
    for h, (*_, asked) in enumerate(spans):
        reads = []
        for g, (idx, w) in enumerate(picks[asked]):
            sets = re.findall(r"VAR \w+ = \w+", enc.decode(prompt[int(idx[w.argmax()]) * T :][:T].tolist()))
            reads.append(f"group {g + 1} {' + '.join(sets) or 'text'}")
        if reads:
            said.append(f"hop {h + 1}'s landmark: " + ", ".join(reads))
    return "; " + " | ".join(said) if said else ""


def needle_reads(prompt, answer, picks, T):
    """One hop: where each group ranked the needle (tasks.on_needle's picks) by weight at the landmark serving the
    answer, and their weight; a miss with the needle ranked first is a copy, not a retrieval."""
    if (on := on_needle(prompt, answer, picks, T)) is None:
        return ""
    said = []
    for g, ((idx, w), m) in enumerate(zip(picks, on)):
        rank = int((w > w[m].max()).sum()) + 1 if m.any() else 0  # the best of its picks, ties in its favour
        said.append(f"group {g + 1} " + (f"ranked it {rank} of {len(idx)}, w {float(w[m].sum()):.3f}" if rank else
                                         "left it"))
    return "; the needle's chunk: " + ", ".join(said)


def count_hits(hits):
    """hop_hits' entries of one hop over the prompts -> 'k/n' over those where its needle could be picked, or '-'."""
    known = [h for h in hits if h is not None]
    return f"{sum(known)}/{len(known)}" if known else "-"


# -----------------------------------------------------------------------------
# The command line: every argument checked before the model is built, which can take minutes


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
    for bad, msg in [
        (args.samples < 1, f"--samples_per_length={args.samples}: must be >= 1"),
        (args.num_samples < 1, f"--num_samples={args.num_samples}: must be >= 1"),
        (args.max_new_tokens < 1, f"--max_new_tokens={args.max_new_tokens}: must be >= 1"),
        (not args.temperature >= 0, f"--temperature={args.temperature}: must be >= 0 (0 = greedy, 1 = as trained)"),
        (args.top_k < 0, f"--top_k={args.top_k}: must be >= 0 (0 = off: sample among all tokens)"),
        ("prompt" in args and (args.passkey or args.multikey or args.vartrack),
         "--prompt: --passkey, --multikey and --vartrack make their own prompts: drop --prompt, or the test flags"),
        *shared_problems(args),
        (args.unseen_names and not args.multikey, "--unseen_names: only multi-key has names: add --multikey"),
        (not 2 <= args.keys <= 16 or (args.keys != 4 and not args.multikey),
         f"--keys={args.keys}: multi-key's needle count, 2 to 16 (4 as trained): use it with --multikey"),
        (not 3 <= args.digits <= 7, f"--digits={args.digits}: keys of 3 to 7 digits (5 as trained)"),
        (args.template not in TEMPLATES or (args.template != "key" and not (args.passkey or args.multikey)),
         f"--template={args.template}: passkey's and multi-key's phrasing, one of {', '.join(TEMPLATES)}"),
        (not 2 <= args.chains <= 16 or (args.chains != CHAINS and not args.vartrack),
         f"--chains={args.chains}: 2-hop's chain count, 2 to 16 ({CHAINS} by default): use it with --vartrack"),
        (args.no_lead and not args.vartrack, "--no_lead: the question's lead is 2-hop's: add --vartrack"),
        (args.depth and args.vartrack,
         "--depth: 2-hop's needles keep their order (a variable is set before it is copied): drop --vartrack"),
        (depth_bins(args.depth) is None,
         f"--depth={args.depth}: expected fractions of the filler in [0, 1] or 'reach', e.g. --depth=0.1,0.5,0.9")]:
        if bad:
            error(msg)


def arg_parser():
    p = shared_args(argparse.ArgumentParser(description="Generate from a DRT checkpoint, or run long-context tests.",
                                            formatter_class=argparse.ArgumentDefaultsHelpFormatter),
                    "sampling and test prompts")
    gen = p.add_argument_group("generation (without a test flag)")
    gen.add_argument("--prompt", default=argparse.SUPPRESS,  # absent unless given: the tests refuse it
                     help="prompt text, or FILE:path to read it from (default: a newline)")
    gen.add_argument("--num_samples", type=int, default=1, help="generations to draw from the prompt")
    gen.add_argument("--max_new_tokens", type=int, default=200, help="tokens to generate per generation")
    gen.add_argument("--temperature", type=float, default=0.8, help="1.0 = as trained, < 1 sharper, 0 = greedy")
    gen.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens only; 0 = all")
    test = p.add_argument_group("long-context tests (accuracy per length, one table per test)")
    test.add_argument("--passkey", action="store_true", help="passkey retrieval: one 5-digit key hidden in filler")
    test.add_argument("--multikey", action="store_true", help="multi-key passkey: four named keys, asked for one")
    test.add_argument("--vartrack", action="store_true", help="2-hop variable tracking: VAR X = value ... VAR Y = X "
                      "... asked for Y's value")
    test.add_argument("--chains", type=int, default=CHAINS, help="2-hop: variable chains in each prompt (2-16)")
    test.add_argument("--no_lead", action="store_true", help="2-hop: ask the question in one piece at the end, as "
                      "for one hop (default: a chunk ahead of the answer, so that group 2 reads group 1's find)")
    test.add_argument("--lengths", default=LENGTHS, help="context lengths in tokens (up to 64M)")
    test.add_argument("--samples_per_length", type=int, default=10, dest="samples", metavar="N",
                      help="test prompts per length and test")
    test.add_argument("--samples", type=int, dest="samples", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old
    test.add_argument("--unseen_names", action="store_true", help="multi-key names that no training prompt holds")
    test.add_argument("--show_misses", action="store_true",
                      help="print each wrong answer beside the right one, and where each group ranked the needle "
                      "(2-hop: what each group read at each hop)")
    test.add_argument("--keys", type=int, default=4, help="multi-key: needles in each prompt (2-16)")
    test.add_argument("--depth", default=None, help="where the asked needle lies: fractions of the filler "
                      "(0.1,0.5,0.9: a table each), or 'reach': just past the windows' reach (None: random)")
    test.add_argument("--template", default="key", help=f"passkey's and multi-key's phrasing: {', '.join(TEMPLATES)}")
    test.add_argument("--digits", type=int, default=5, help="digits of every key (3-7)")
    test.add_argument("--no_align", action="store_true",
                      help="let the question's last token fall anywhere in its chunk (trained: it opens one)")
    test.add_argument("--haystack", default=None,
                      help="filler of real text: .txt books in a folder, or a prepare_pg19.py .bin (None: sentences)")
    return p


def main(argv=None):
    args = arg_parser().parse_args(argv)
    check_args(args)
    tasks = [t for t in TASKS if getattr(args, t)]
    prompt = None if tasks else read_prompt(getattr(args, "prompt", "\n"))
    try:
        enc = get_tokenizer(args.tokenizer_file)
        lengths = parse_lengths(args.lengths) if tasks else None
        ckpt, cfg = read_checkpoint(args.ckpt or args.out_dir)  # its tensors mapped, not read: quick
    except (OSError, RuntimeError, ValueError, common.CheckpointError) as e:
        error(e)
    depths = depth_bins(args.depth)
    if tasks:  # prompts cut to the model's chunks, a key past its reach
        check_lengths(tasks, lengths, args, enc, cfg, "reach" if "reach" in depths else None)
        check_memory(cfg, max(lengths), args)
    try:
        haystack = load_haystack(args.haystack, enc) if tasks and args.haystack else None
    except ValueError as e:
        error(e)

    torch.manual_seed(args.seed)
    print(f"loaded {args.ckpt or args.out_dir} (iter {ckpt.get('iter_num', '?')}): {cfg}")
    ctx = common.autocast(args)
    for mode in (modes := retrieval_modes(args, cfg)):
        try:
            model = build_model(ckpt, args.device, mode)
        except common.CheckpointError as e:
            error(e)
        if not tasks:
            if len(modes) > 1:
                print(f"\nretrieval {mode}:")
            print_samples(model, enc, prompt, args, ctx)
        for task in tasks:
            for depth in depths:
                run_task(model, enc, task, lengths, args, ctx, haystack, depth)


if __name__ == "__main__":
    main(sys.argv[1:])
