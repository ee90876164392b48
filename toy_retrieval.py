"""
When does DRT's retriever learn by content, so that it generalizes to longer contexts, and when
does it learn a shortcut? A CPU-sized experiment: a tiny DRT (model.py as it is) trained on a
toy passkey task, then tested on prompts up to 8x longer than it was trained on.

The task, in a 64-symbol vocabulary: filler cycles through 23 symbols (from a random phase), a
needle KEY d KEY with one digit d sits at a random depth, the prompt ends with Q Q Q, and the
answer is d (the loss is on d alone). Each evaluation prints, per test length, the answer
accuracy and how often the retrieval that serves the answer picked the needle's chunk or the
next one (whose memory saw the needle through the window).

    python toy_retrieval.py                                        # 16-chunk prompts, window 2 chunks: generalizes
    python toy_retrieval.py --chunks=8 --window=4 --min_depth=0    # the windows reach the whole prompt: does not

About 5 minutes on 2 CPU cores. The finding (README, Results: Passkey): if n_layers x window
reaches over the whole training prompt, self-attention carries the needle, the retriever is
never forced to find it, and accuracy falls with length; with prompts twice that reach, the
model answers as well at 128 chunks as at 16.
"""

import argparse
import random
import time
from contextlib import contextmanager

import torch

import model
from model import DRT, DRTConfig

V, LANDMARK, KEY, Q = 64, 63, 10, 11  # digits are 0..9
FILLER = list(range(12, 35))  # 23 symbols: a period prime to the chunk length, so chunks differ


def example(n_chunks, T, rng, min_depth):
    """One row of n_chunks*T + 1 tokens: prompt then answer; and the needle's depth."""
    d = rng.randrange(10)
    needle, question = [KEY, d, KEY], [Q, Q, Q]
    n_fill = n_chunks * T + 1 - len(needle) - len(question) - 1
    phase = rng.randrange(len(FILLER))
    fill = [FILLER[(phase + i) % len(FILLER)] for i in range(n_fill)]
    depth = rng.randrange(min(min_depth, n_fill), n_fill + 1)
    return fill[:depth] + needle + fill[depth:] + question + [d], depth


def batch(n_chunks, size, T, rng, min_depth=0):
    """x, y (size, n_chunks*T) with the loss on the answer only; needle depths (size,)."""
    rows, depths = zip(*(example(n_chunks, T, rng, min_depth) for _ in range(size)))
    rows = torch.tensor(rows)
    x, y = rows[:, :-1], rows[:, 1:].clone()
    y[:, :-1] = -1
    return x, y, torch.tensor(depths)


@contextmanager
def recording_picks():
    """Record the picks of every model.retrieve call: a list of idx (B, n_landmarks, K)."""
    picks, original = [], model.retrieve

    def spy(*args):
        idx, w = original(*args)
        picks.append(idx)
        return idx, w

    model.retrieve = spy
    try:
        yield picks
    finally:
        model.retrieve = original


@torch.no_grad()
def evaluate(drt, n_chunks, T, n=64):
    """-> (answer accuracy, share of eligible prompts whose needle chunk was picked)."""
    drt.eval()
    x, y, depths = batch(n_chunks, n, T, random.Random(1234 + n_chunks))  # the same prompts every time
    with recording_picks() as picks:
        logits, _ = drt(x)
    acc = (logits[:, -1, :LANDMARK].argmax(-1) == y[:, -1]).float().mean().item()
    # the answer is in the last chunk, served by the retrieval at the landmark of chunk n-2,
    # which picks among chunks < n-2; the digit is at depth+1
    serving = picks[0][:, n_chunks - 2]  # (n, K), first group
    need = (depths + 1) // T
    eligible = need < n_chunks - 2
    found = ((serving == need[:, None]) | (serving == need[:, None] + 1)).any(-1)
    drt.train()
    return acc, found[eligible].float().mean().item() if eligible.any() else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--chunks", type=int, default=16, help="training prompt length in chunks")
    p.add_argument("--window", type=int, default=2, help="self-attention window in chunks")
    p.add_argument("--min_depth", type=int, default=4, help="training needles from this chunk on (task_min_depth)")
    p.add_argument("--test", default="16,32,128", help="test lengths in chunks")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    S = 16  # chunk: 15 tokens + landmark
    T = S - 1
    torch.manual_seed(a.seed)
    cfg = DRTConfig(vocab_size=V, landmark_id=LANDMARK, n_embd=64, n_head=4, n_lower=2, groups=(2,), n_enc=1,
                    chunk_size=S, window=a.window * S, topk=2)
    drt = DRT(cfg)
    opt = torch.optim.AdamW(drt.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=1e-3)
    tests = [int(c) for c in a.test.split(",")]
    size = max(1, 256 // a.chunks)  # the same tokens per step at every prompt length
    print(f"train: {a.chunks} chunks x {size} prompts, window {a.window} chunks ({cfg.n_lower + cfg.n_upper} layers "
          f"reach {(cfg.n_lower + cfg.n_upper) * a.window} chunks), needles from chunk {a.min_depth}, seed {a.seed}")
    print(f"{'step':>5} {'loss':>6} {'s':>5} | " + " ".join(f"{'acc@' + str(c):>7}" for c in tests) + " | "
          + " ".join(f"{'found@' + str(c):>9}" for c in tests), flush=True)
    rng, t0, losses, rows = random.Random(a.seed), time.time(), [], []
    for step in range(a.steps + 1):
        if step % a.eval_every == 0 or step == a.steps:
            res = [evaluate(drt, c, T) for c in tests]
            rows.append((step, res))
            loss = sum(losses) / len(losses) if losses else float("nan")
            print(f"{step:>5} {loss:>6.3f} {time.time() - t0:>5.0f} | " + " ".join(f"{acc:>7.2f}" for acc, _ in res)
                  + " | " + " ".join(f"{hit:>9.2f}" for _, hit in res), flush=True)
            losses = []
        if step == a.steps:
            break
        x, y, _ = batch(a.chunks, size, T, rng, a.min_depth * T)
        _, loss = drt(x, y, return_logits=False)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drt.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return rows


if __name__ == "__main__":
    main()
