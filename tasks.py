"""
Synthetic long-context tasks (DESIGN §6), shared by training (train.py --dataset=passkey)
and evaluation (sample.py --passkey):

  passkey   "The pass key is 71432. Remember it. 71432 is the pass key." hidden at a random
            depth in filler; asked at the end: "What is the pass key? The pass key is"
  multikey  several "The pass key of <name> is <number>." needles; asked for one of them
  vartrack  2-hop variable tracking (RULER): "VAR X = 12345." ... "VAR Y = X." ... asked for Y

Filler is the classic repeated "The grass is green. ..." or, with a Haystack, real book text.
Everything works in token space, so a prompt has exactly the requested number of tokens.

    from tasks import make_example, get_batch
    prompt, answer = make_example("passkey", 4096, random.Random(0), enc)
"""

import os
import random

import numpy as np
import torch

TASKS = ("passkey", "multikey", "vartrack")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NAMES = ["apple", "river", "candle", "falcon", "garden", "marble", "orbit", "pepper", "silver", "tiger",
         "violet", "winter", "anchor", "bishop", "copper", "desert", "ember", "harbor", "island", "jungle"]


class Haystack:
    """Real text as filler: the tokens of a prepared .bin (uint16, from prepare_pg19.py) or of
    the .txt files in a folder (tokenized once)."""

    def __init__(self, path, enc):
        if os.path.isfile(path) and path.endswith(".bin"):
            self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        elif os.path.isdir(path):
            files = sorted(f for f in os.listdir(path) if f.endswith(".txt"))
            if not files:
                raise FileNotFoundError(f"--haystack {path}: no .txt files in that folder")
            ids = []
            for f in files:
                with open(os.path.join(path, f), encoding="utf-8") as fh:
                    ids.extend(enc.encode_ordinary(fh.read()))
            self.tokens = np.array(ids, dtype=np.uint16)
        else:
            raise FileNotFoundError(f"--haystack {path}: expected a folder of .txt files or a .bin token file")
        if len(self.tokens) < 1000:
            raise ValueError(f"--haystack {path}: only {len(self.tokens)} tokens of text")

    def sample(self, n, rng):
        """n consecutive tokens from a random place (wrapping around the end)."""
        start = rng.randrange(len(self.tokens))
        out = np.asarray(self.tokens[start : start + n], dtype=np.int64)
        while len(out) < n:
            out = np.concatenate([out, np.asarray(self.tokens[: n - len(out)], dtype=np.int64)])
        return out.tolist()


def _filler(n, rng, enc, haystack):
    if n <= 0:
        return []
    if haystack is not None:
        return haystack.sample(n, rng)
    unit = enc.encode_ordinary(FILLER)
    reps = -(-n // len(unit)) + 1
    offset = rng.randrange(len(unit))  # start anywhere in the sentence cycle
    return (unit * reps)[offset : offset + n]


def _needles_and_question(task, rng):
    """-> (needle texts in order of appearance, question text, answer text)."""
    if task == "passkey":
        key = str(rng.randrange(10000, 100000))
        return ([f" The pass key is {key}. Remember it. {key} is the pass key."],
                " What is the pass key? The pass key is", f" {key}")
    if task == "multikey":
        names = rng.sample(NAMES, 4)
        keys = [str(rng.randrange(10000, 100000)) for _ in names]
        ask = rng.randrange(len(names))
        return ([f" The pass key of {n} is {k}. Remember it." for n, k in zip(names, keys)],
                f" What is the pass key of {names[ask]}? The pass key of {names[ask]} is", f" {keys[ask]}")
    if task == "vartrack":
        x, y = ("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4)) for _ in range(2))
        value = str(rng.randrange(10000, 100000))
        return ([f" VAR {x} = {value}.", f" VAR {y} = {x}."],
                f" What is the value of VAR {y}? The value of VAR {y} is", f" {value}")
    raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")


def make_example(task, length, rng, enc, haystack=None, answer_counts=False, min_depth=0):
    """A prompt of exactly `length` tokens (filler with the needles at random depths, none
    before token min_depth, the question at the end) and the answer's tokens; with
    answer_counts=True, prompt and answer together have `length` tokens. rng: random.Random."""
    needles, question, answer = _needles_and_question(task, rng)
    needles = [enc.encode_ordinary(t) for t in needles]
    question, answer = enc.encode_ordinary(question), enc.encode_ordinary(answer)
    n_fill = length - len(question) - sum(map(len, needles)) - (len(answer) if answer_counts else 0)
    if n_fill < 0:
        raise ValueError(f"length {length} is too short for a {task} prompt (needs {length - n_fill} tokens)")
    if min_depth > n_fill:
        raise ValueError(f"length {length} is too short for a {task} prompt with needles from token {min_depth}")
    cuts = sorted(rng.randrange(min_depth, n_fill + 1) for _ in needles)  # needle depths, in order
    filler = _filler(n_fill, rng, enc, haystack)
    prompt, last = [], 0
    for cut, needle in zip(cuts, needles):
        prompt += filler[last:cut] + needle
        last = cut
    prompt += filler[last:] + question
    return prompt, answer


def get_batch(task, batch_size, seq_len, rng, enc, haystack=None, answer_only=True, min_depth=0):
    """A training batch: x, y (B, seq_len) int64, each row a prompt followed by its answer.
    y holds the next token at every position, or with answer_only=True only at the answer's
    (-1, ignored, elsewhere). A model trained from scratch needs the loss everywhere: the
    repeated filler and the key's second mention teach it to copy, which retrieval then
    carries over any distance; the answer alone is too thin a signal to start from."""
    x = torch.empty(batch_size, seq_len, dtype=torch.long)
    y = torch.empty(batch_size, seq_len, dtype=torch.long)
    for b in range(batch_size):
        prompt, answer = make_example(task, seq_len + 1, rng, enc, haystack, answer_counts=True, min_depth=min_depth)
        row = torch.tensor(prompt + answer)  # seq_len + 1 tokens
        x[b], y[b] = row[:-1], row[1:]
        if answer_only:
            y[b, : len(prompt) - 1] = -1  # the question's last token predicts the first answer token
    return x, y


def score(generated_ids, answer_ids, enc):
    """1 if the first len(answer) generated tokens spell the answer, else 0. Only those count:
    training never shows what follows an answer, so a model may go on with more digits."""
    return int(enc.decode(list(generated_ids[: len(answer_ids)])).strip() == enc.decode(answer_ids).strip())
