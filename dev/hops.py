"""
Where a 2-hop model finds each hop, on prompts laid out as training lays them: for each hop, how often its group's
Eq. 1 ranks the hop's chunk first among the earlier chunks at the landmark that should fetch it, and by what margin
over the best other chunk (its next chunk, which may hold part of the needle, left out as in the ranking loss); and
of the layout, among how many chunks holding needles of its kind each hop is told, and how often hop 1's chunk lies
within the lower layers' reach of hop 2 (its memory may then hold the number: one retrieval may do); and which group
brings the answer: how often it is right as the model reads, with group 2 handed filler, and with group 1 handed filler
at the answer's landmark.
Against sample.py's test, this isolates retrieval from the answer, at training lengths as at test ones, and tells
whether the name or the layout finds a hop: a model that ranks hop 1 first at the training length and not at twice
it, or not under another layout, found it by where it stands.

    python dev/hops.py --out_dir=out-twohop-s0 --lengths=1008,2048,4096     # the training spacing; CPU is enough

Prints one row per length and filler (the repeated sentences, or books from --haystack).
"""

import argparse
import os
import random
import re
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402
from common import build_model, get_tokenizer, read_checkpoint  # noqa: E402


def rank_and_margin(s, need):
    """Eq. 1's scores s (t,) of the chunks before a landmark, the needle's chunk need -> (how many chunks score above
    it, its score minus the best other's); chunk need + 1 is no rival."""
    rivals = torch.ones_like(s, dtype=torch.bool)
    rivals[need : need + 2] = False
    return int((s[rivals] > s[need]).sum()), float(s[need] - s[rivals].max())


def probe(model, prompt, hops, T, hand="none"):
    """One prompt (make_example's prompt and hops) -> [(rank, margin)] per hop, hop h by group h (or the last). hand:
    what group 1 reads at hop 1's landmark in place of its picks: "hop1" its chunk alone, "filler" chunk 0 alone (the
    filler before the needles), "none" Eq. 1's picks. Group 2 finding hop 2 with group 1 handed filler finds it
    without X."""
    idx, picks = torch.as_tensor(prompt, device=next(model.parameters()).device)[None], None
    if hand != "none":
        (start, end, asked), n = hops[0], idx.size(1) // T
        picks = torch.full((1, len(model.config.groups), n, model.config.topk), -1, device=idx.device)
        picks[0, 0, asked // T] = (start + end) // 2 // T if hand == "hop1" else 0  # one chunk: read once
    with torch.no_grad(), model.recording() as record:
        model(idx, picks=picks)
    eq1 = [r[1:] for r in record if r[0] == "eq1"]
    out = []
    for h, (start, end, asked) in enumerate(hops):
        q, l = eq1[min(h, len(eq1) - 1)]
        t, need = asked // T, (start + end) // 2 // T
        out.append(rank_and_margin((q[0, t].float() @ l[0, :t].float().T).cpu() / q.size(-1) ** 0.5, need))  # Eq. 1
    return out


def answers(model, prompt, answer, hops, T):
    """Which group brings the answer: whether every answer token is the argmax (teacher-forced) as the model reads,
    with group 2 handed filler (chunk 0) at every landmark, and with group 1 handed filler at the landmark serving
    the answer. A model that needs both hops loses the answer in both; one that answers without group 2 took one
    retrieval (through group 1's pick at the answer's landmark, whose memory may hold the number)."""
    dev = next(model.parameters()).device
    x = torch.as_tensor(list(prompt) + list(answer[:-1]), device=dev)[None]
    out = []
    for knock in (None, "group 2", "group 1 at the answer"):
        picks = torch.full((1, len(model.config.groups), x.size(1) // T, model.config.topk), -1, device=dev)
        if knock == "group 2":
            picks[0, 1, 1:] = 0
        elif knock:
            picks[0, 0, hops[-1][2] // T] = 0
        with torch.no_grad():
            logits, _ = model(x, picks=picks if knock else None)
        out.append(logits[0, -len(answer):].argmax(-1).tolist() == list(answer))
    return out


def layout(prompt, hops, T, reach, enc):
    """How many chunks hold a "VAR Y = X." and how many a "VAR X = 12345." (the candidates each hop is told among), and
    whether the first token of hop 1's chunk lies within the lower layers' reach of hop 2's needle: then the memory of
    hop 1's chunk may already hold the number, and one retrieval may do."""
    chunks = [enc.decode(prompt[j * T : (j + 1) * T].tolist()) for j in range(len(prompt) // T)]
    (start1, _, _), (_, end2, _) = hops
    return [sum(bool(re.search(rf"VAR \w+ = {v}", c)) for c in chunks) for v in ("[A-Z]", r"\d")] + [
        start1 // T * T - end2 < reach]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--out_dir", required=True, help="a 2-hop model's folder (its ckpt.pt)")
    p.add_argument("--lengths", default="1008,2048,4096", help="prompt lengths, in tokens")
    p.add_argument("--samples", type=int, default=16, help="prompts per length and filler")
    p.add_argument("--chains", type=int, default=tasks.CHAINS)
    p.add_argument("--spacing", default="train", help="'train' or 'test' (tasks.hop_spacing), or GAP,FAR in tokens")
    p.add_argument("--min_depth", type=int, default=256, help="no needle before this token (stage 2's task_min_depth)")
    p.add_argument("--haystack", default="data/pg19/test.bin", help="books for half the rows ('' for none)")
    p.add_argument("--hand", default="none", choices=("none", "hop1", "filler"), help="what group 1 reads at hop 1's "
                   "landmark: Eq. 1's picks, hop 1's chunk alone, or filler alone (does group 2 follow group 1?)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    enc = get_tokenizer()
    ckpt, cfg = read_checkpoint(args.out_dir)
    model, T = build_model(ckpt, args.device), cfg.chunk_size - 1
    spacing = (tasks.hop_spacing(cfg, test=args.spacing == "test") if args.spacing in ("train", "test")
               else tuple(int(v) for v in args.spacing.split(",")))
    fillers = [("sentences", None)] + ([("books", tasks.Haystack(args.haystack, enc))] if args.haystack else [])
    if args.hand != "none" and len(cfg.groups) < 2:
        p.error("--hand needs two groups")
    print(f"{args.out_dir}: hops {spacing[0]} tokens apart, hop 1 {spacing[1]} before the end, {args.chains} chains, "
          f"group 1 reading {args.hand if args.hand != 'none' else 'its picks'} at hop 1's landmark; "
          f"'first': Eq. 1 ranks the hop's chunk first at its landmark; margin: its score over the best other's")
    print(f"{'length':>7} {'filler':>9} {'hop1 first':>10} {'margin':>7} {'hop2 first':>10} {'margin':>7} "
          f"{'chunks with copies, numbers':>27} {'hop 1 sees hop 2':>16} {'answer':>6} {'without g2':>10} "
          f"{'without g1 at answer':>20}")
    for length in (int(v) for v in args.lengths.split(",")):
        for name, haystack in fillers:
            rng, got, held, said = random.Random(args.seed), [], [], []
            for _ in range(args.samples):
                prompt, answer, hops = tasks.make_example("vartrack", length, rng, enc, haystack, args.min_depth, T,
                                                          chains=args.chains, spacing=spacing)
                got.append(probe(model, prompt, hops, T, args.hand))
                held.append(layout(prompt, hops, T, cfg.n_lower * cfg.window, enc))
                if len(cfg.groups) > 1:  # one group has none to hand filler to
                    said.append(answers(model, prompt, answer, hops, T))
            got = np.array(got)  # (samples, 2 hops, (rank, margin))
            cells = [f"{int((got[:, h, 0] == 0).sum()):>5}/{args.samples:<4} {np.median(got[:, h, 1]):>7.1f}"
                     for h in range(2)]
            copies, numbers, sees = np.mean(held, 0)
            right = [f"{n:>{w}}/{args.samples:<3}" if said else f"{'-':>{w + 4}}"
                     for n, w in zip(np.sum(said, 0) if said else (0, 0, 0), (2, 6, 16))]
            print(f"{length:>7} {name:>9} {cells[0]} {cells[1]} {copies:>20.1f}, {numbers:<5.1f} {sees:>16.0%} "
                  f"{' '.join(right)}")


if __name__ == "__main__":
    main()
