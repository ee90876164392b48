"""
Synthetic long-context tasks, shared by training (train.py --dataset=passkey) and evaluation
(sample.py --passkey), in the format of the paper's needle-in-a-haystack tests (Appendix D):

  passkey   "The pass key is 71432. Remember it. 71432 is the pass key." hidden at a random
            depth in filler; asked at the end: "What is the pass key? The pass key is"
  multikey  four (or 2-16) "The pass key of <name> is <number>." needles; asked for one of them
  vartrack  2-hop variable tracking (RULER): "VAR X = 12345." ... "VAR Y = X." ... asked for Y's value,
            among other such chains (6 in a test: the needles a single retrieval would need outnumber top-k)

Held-out variants for tests (sample.py --keys, --template, --digits, --depth): 2-16 multi-key
needles, other phrasings (TEMPLATES), keys of 3-7 digits, the asked needle at a chosen depth.
Filler is the classic repeated "The grass is green. ..." or, with a Haystack, real book text.
Everything works in token space (numpy arrays of GPT-2 ids), so a prompt has an exact length.

Question alignment (align=T, the model's text tokens per chunk): the prompt is cut so that its
last token (" is") opens a chunk. The retrieval that serves a chunk is made at the landmark of
the chunk before it; aligned, that landmark sits right after "... The pass key" and has read
the question, so retrieval knows what is asked (the paper pads its prompts the same way, so a
landmark falls before "is"). Unaligned, the landmark before the answer saw only part of the
question, or none of it.

Two hops need one chunk more (lead=True, the default for vartrack). Group g's query at a landmark has
read what group g-1 fetched for that landmark's chunk, which chunk's previous landmark picked. So for
group 2 to fetch "VAR X = 12345." at the landmark serving the answer, group 1 must have fetched
"VAR Y = X." one landmark earlier, and that landmark must have read the question: the question
"What is the value of VAR Y?" closes a chunk, filler pads the next one up to "The value of VAR Y",
and " is" opens the answer's chunk. lead=False asks in one piece at the end, as for one hop.

Training rows (train.py): TaskRows draws train.py's batches of these tasks from its task_* keys,
TextRows those of a prepared text dataset, with copy_row's rows mixed in (--copy_frac).

Scoring (sample.py): score, and for the test table's other columns in_reach, needle_picks and wilson.

    from tasks import make_example, get_batch
    prompt, answer, hops = make_example("passkey", 4096, random.Random(0), enc, align=63)
"""

import functools
import itertools
import math
import os
import random
import re

import numpy as np
import torch

from common import GPT2_VOCAB, check_bin, get_tokenizer, max_token_id, read_meta
from model import cdiv, window_reach

TASKS = ("passkey", "multikey", "vartrack")
TRAINED = TASKS  # train.py's task datasets
CHAINS = 6  # 2-hop chains in a test prompt: a single retrieval would need "VAR Y = X." and all six numbers, > top-k
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SCORE_AFTER = 2  # tokens a test decodes past the answer's, to see that the number ends
ANSWER_END = "."  # what follows a key in its needle; training rows end their answer with it, so a model learns
# to stop the number (tests score the key followed by a digit as wrong)
MAX_ANSWER = 6  # tokens an answer takes at most (a 7-digit key: 5, then ANSWER_END): a training row keeps room for it
NAMES = ["apple", "river", "candle", "falcon", "garden", "marble", "orbit", "pepper", "silver", "tiger",
         "violet", "winter", "anchor", "bishop", "copper", "desert", "ember", "harbor", "island", "jungle"]
# a second test list (sample.py --unseen_names), never in a training prompt: a model that matches names answers
# on both lists alike; one that memorized twenty names would not (18 + 2 two-token words, as NAMES)
UNSEEN_NAMES = ["lantern", "puzzle", "rocket", "saddle", "thunder", "velvet", "quartz", "dragon", "hammer", "lemon",
                "feather", "glacier", "kettle", "mirror", "button", "castle", "ribbon", "helmet", "parrot", "walnut"]


@functools.lru_cache(maxsize=4)
def word_pool(enc, letters=(4, 8)):
    """Names by the thousand for multi-key: every GPT-2 token that is a space and lower-case letters, past the
    3,000 commonest ("that", "with"), minus NAMES and UNSEEN_NAMES, so that every test name is unseen. 4-8 letters
    (~12K words, too many to learn one by one): training's names; 9-12 letters (~4.9K): validation's, never
    trained, so that the validation loss sees names as the tests do."""
    held, (lo, hi) = set(NAMES) | set(UNSEEN_NAMES), letters
    words = (enc.decode([t]) for t in range(3000, enc.n_vocab))
    return tuple(w[1:] for w in words if re.fullmatch(rf" [a-z]{{{lo},{hi}}}", w) and w[1:] not in held)


class Haystack:
    """Real text as filler: the tokens of a prepared .bin (uint16, from prepare_pg19.py) or of
    the .txt files in a folder (tokenized once)."""

    def __init__(self, path, enc):
        if os.path.isfile(path) and path.endswith(".bin"):
            self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
            if (top := max_token_id(self.tokens)) >= GPT2_VOCAB:  # the model would fail on it mid-test
                raise ValueError(f"--haystack {path}: token id {top} is past GPT-2's {GPT2_VOCAB} ids, so it is "
                                 f"not a .bin of prepare_pg19.py")
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
        """n consecutive tokens from a random place (wrapping around the end), int64 (n,)."""
        start = rng.randrange(len(self.tokens))
        reps = -(-(start + n) // len(self.tokens))
        if reps == 1:
            return np.asarray(self.tokens[start : start + n], dtype=np.int64)
        return np.resize(np.asarray(self.tokens, dtype=np.int64), reps * len(self.tokens))[start : start + n]


def filler(n, rng, enc, haystack=None):
    """n tokens of filler (int64 (n,)): the repeated sentences from a random point in their
    cycle, or n consecutive tokens of the haystack."""
    if haystack is not None:
        return haystack.sample(n, rng)
    unit = np.array(enc.encode_ordinary(FILLER), dtype=np.int64)
    offset = rng.randrange(len(unit))
    return np.resize(unit, offset + n)[offset:]


# phrasings (sample.py --template, train.py --task_templates): passkey's needle and question, then multi-key's
# ({n} the name, {k} the key). The recipe trains on "key"; "number" and "id" vary the phrasing in training;
# "code" is held out, for tests alone: a model tested on it never read it
TEMPLATES = {
    "key": (" The pass key is {k}. Remember it. {k} is the pass key.", " What is the pass key? The pass key is",
            " The pass key of {n} is {k}. Remember it.", " What is the pass key of {n}? The pass key of {n} is"),
    "number": (" The magic number is {k}. Remember it.", " What is the magic number? The magic number is",
               " The magic number of {n} is {k}.", " What is the magic number of {n}? The magic number of {n} is"),
    "id": (" The access ID is {k}.", " What is the access ID? The access ID is",
           " The access ID for {n} is {k}.", " What is the access ID for {n}? The access ID for {n} is"),
    "code": (" The secret code is {k}.", " What is the secret code? The secret code is",
             " The secret code for {n} is {k}.", " What is the secret code for {n}? The secret code for {n} is"),
}


def needles_and_question(task, rng, names=NAMES, keys=4, template="key", digits=5, chains=CHAINS):
    """-> (needle texts in order of appearance, question text, answer text, hops: the indices of the needles
    retrieval must bring back, in the order it needs them; the last holds the answer). names: multi-key's; keys:
    its needle count; template: a TEMPLATES name or entry (passkey, multi-key); digits: of every number;
    chains: vartrack's, each "VAR X = <number>." then "VAR Y = X.", one asked."""
    number = lambda: str(rng.randrange(10 ** (digits - 1), 10**digits))  # noqa: E731
    needle, question, named, named_question = TEMPLATES[template] if isinstance(template, str) else template
    if task == "passkey":
        key = number()
        return [needle.format(k=key)], question, f" {key}", (0,)
    if task == "multikey":
        names = rng.sample(names, keys)
        numbers = distinct(number, len(names))  # a key names one needle
        ask = rng.randrange(len(names))
        return ([named.format(n=n, k=k) for n, k in zip(names, numbers)], named_question.format(n=names[ask]),
                f" {numbers[ask]}", (ask,))
    if task == "vartrack":  # chain 0 is asked; the others' numbers are wrong answers of the same form
        letters = lambda: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(4))  # noqa: E731
        names, values = distinct(letters, 2 * chains), distinct(number, chains)
        order = rng.sample([c for c in range(chains) for _ in (0, 1)], 2 * chains)  # interleaved, each in order
        needles, seen = [], set()
        for c in order:  # a chain's first needle sets its number, its second copies it
            x, y = names[2 * c], names[2 * c + 1]
            needles.append(f" VAR {y} = {x}." if c in seen else f" VAR {x} = {values[c]}.")
            seen.add(c)
        hop1, hop2 = (needles.index(f" VAR {names[1]} = {names[0]}."), needles.index(f" VAR {names[0]} = {values[0]}."))
        return needles, f" What is the value of VAR {names[1]}? The value of VAR {names[1]} is", f" {values[0]}", (hop1, hop2)
    raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")


def distinct(draw, n):
    """n distinct values of draw() (a redraw only on a collision)."""
    out = []
    while len(out) < n:
        if (v := draw()) not in out:
            out.append(v)
    return out


def key_owner(needles, got, answer):
    """The name whose key, in another needle than the asked one, the wrong answer `got` is, or None."""
    owners = re.findall(r"(\w+) (?:is|=) (\d+)\.", "".join(needles))  # "of falcon is 71432.", "VAR XQZT = 71432."
    return next((name for name, key in owners if key == got != answer), None)


def occurrences(ids, answer):
    """Where the answer's tokens (a list) start in ids, in order."""
    ids, n = np.asarray(ids), len(answer)
    return [int(i) for i in np.flatnonzero(ids[: len(ids) - n + 1] == answer[0]) if ids[i : i + n].tolist() == answer]


def make_example(task, length, rng, enc, haystack=None, min_depth=0, align=None, names=NAMES, keys=4,
                 template="key", digits=5, depth=None, past=None, chains=CHAINS, lead=True, spacing=(0, 0)):
    """A prompt of `length` tokens (filler with the needles at random depths, none before token
    min_depth, the question at the end) -> (prompt, the answer's token ids (a list), hops: for each needle
    retrieval must bring back, in hop order, its (start, end) token span and the token whose chunk's landmark
    should fetch it). With align=T the
    prompt is cut to the longest length <= `length` whose last token opens a chunk of T text
    tokens (length - 1 a multiple of T): at most T-1 tokens shorter. rng: random.Random.
    names, keys, template, digits, chains: as needles_and_question. depth (a fraction of the filler, 0 to 1)
    puts the asked needle there (RULER's depth bins), the others at random; past=n puts it so that
    its key's last mention ends n tokens before the prompt's last token, the others before it.
    Two hops: lead (with align) asks the question a chunk ahead (the module's docstring); spacing (gap, far): the
    hops' needles lie gap tokens apart at least, hop 1's ends far tokens before the prompt's end (hop_spacing; one
    hop: ignored)."""
    needles, question, answer, hops = needles_and_question(task, rng, names, keys, template, digits, chains)
    pairs = chain_pairs(needles) if len(hops) > 1 else []
    needles = [np.array(enc.encode_ordinary(t), dtype=np.int64) for t in needles]
    question, answer = np.array(enc.encode_ordinary(question), dtype=np.int64), enc.encode_ordinary(answer)
    ask = hops[-1]  # the needle holding the answer
    if align:
        length -= (length - 1) % align
    n_pad, split, lead = 0, len(question), lead and align and len(hops) > 1
    if lead:  # "...?" closes a chunk, filler up to "The value of VAR Y", " is" opens one
        split = int(np.flatnonzero(question == enc.encode_ordinary("?")[0])[0]) + 1
        after = len(question) - split - 1  # the tokens between "?" and " is"
        n_pad = cdiv(after, align) * align - after if after else align
    n_fill = length - len(question) - n_pad - sum(map(len, needles))
    if n_fill < 0 or length < 1:
        raise ValueError(f"length {length} is too short for a {task} prompt (needs {length - n_fill} tokens)")
    if min_depth > n_fill:
        raise ValueError(f"length {length} is too short for a {task} prompt with needles from token {min_depth}")
    at = None if depth is None else min_depth + round(depth * (n_fill - min_depth))  # the asked needle's cut
    if past is not None:  # what follows the asked needle: filler, then the question
        key_end = occurrences(needles[ask], answer)[-1] + len(answer) - 1
        at = n_fill - (past - (len(needles[ask]) - 1 - key_end) - len(question))
        if not min_depth <= at <= n_fill:
            raise ValueError(f"length {length} is too short for a {task} prompt with its key {past} tokens "
                             f"before the end")
    if at is not None and len(hops) > 1 and any(spacing):
        raise ValueError("spacing places two hops, whose needles keep their order: not with depth or past")
    cuts = hop_cuts(rng, needles, pairs, min_depth, n_fill if past is None else at, len(question) + n_pad, spacing)
    if cuts is None:
        raise ValueError(f"length {length} is too short for a {task} prompt whose hops lie {spacing[0]} tokens apart "
                         f"and {spacing[1]} before its end")
    if at is not None:
        cuts[ask] = at
    order = sorted(range(len(needles)), key=lambda i: (cuts[i], i == ask and at is not None))  # placed: last at a tie
    starts, n = {}, 0
    for i in order:
        starts[i] = cuts[i] + n
        n += len(needles[i])
    fill = filler(n_fill + n_pad, rng, enc, haystack)
    parts, last = [], 0
    for i in order:
        parts += [fill[last : cuts[i]], needles[i]]
        last = cuts[i]
    tail = [question[:split], fill[n_fill:], question[split:]]  # the pad, if any, inside the question
    prompt = np.concatenate(parts + [fill[last:n_fill]] + tail)
    asked = [len(prompt) - 2] * len(hops)  # the token whose chunk's landmark fetches each hop: the one before " is"
    if lead:
        asked[0] = len(prompt) - len(question) - n_pad + split - 1  # "?", a chunk or more ahead
    return prompt, answer, [(starts[i], starts[i] + len(needles[i]), a) for i, a in zip(hops, asked)]


def chain_pairs(needles):
    """vartrack's needle texts -> each chain's (index of "VAR X = 12345.", index of "VAR Y = X.")."""
    sets = [re.match(r" VAR (\w+) = (\w+)\.", t).groups() for t in needles]
    first = {name: i for i, (name, value) in enumerate(sets) if value.isdigit()}
    return [(first[value], i) for i, (name, value) in enumerate(sets) if not value.isdigit()]


def hop_cuts(rng, needles, pairs, lo, hi, tail, spacing):
    """Where make_example cuts its filler for the needles (token arrays, in order), each in [lo, hi]: sorted draws, so
    each 2-hop chain is assigned before it is copied. With spacing (gap, far; hi then the filler's end) and 2-hop
    chains (pairs: chain_pairs), every chain is laid out as the asked one must be: its needles gap tokens apart at
    least, "VAR Y = X." ending far tokens before the prompt's end (tail tokens follow the filler). So where a needle
    stands tells nothing of which chain is asked; laid out alone, the asked chain's needles stood apart from the
    others', and models found both hops by that (dev/LOG.md). None where that cannot be."""
    draw = lambda n, a, b: sorted(rng.randrange(a, b + 1) for _ in range(n))  # noqa: E731  n cuts, in order
    gap, far = spacing
    if not pairs or not (gap or far):  # one hop: spacing has nothing to part
        return draw(len(needles), lo, hi)
    gap, last = max(gap, 1), min(hi, hi + tail - far)  # "VAR Y = X." ends far before the end with no needle after it
    if last - gap < lo:
        return None
    cuts = [0] * len(needles)
    for number, copy in pairs:
        two, one = draw(2, lo, last - gap)  # a pair uniform over the allowed ones
        cuts[number], cuts[copy] = two, one + gap
    return cuts


def min_length(task, seed, enc, align=None, **kw):
    """The shortest length make_example accepts for the prompt it draws with random.Random(seed)
    (kw: its arguments). Whether a length fits grows with it, the needles being drawn first, so a
    bisection finds it without building any long filler."""
    def fits(n):
        try:
            make_example(task, n, random.Random(seed), enc, align=align, **kw)
            return True
        except ValueError:  # too short for the needles and question
            return False
    lo, hi = 1, 64
    while not fits(hi):
        lo, hi = hi + 1, 2 * hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def get_batch(tasks, batch_size, seq_len, rng, enc, haystack=None, haystack_frac=1.0, min_depth=0, align=None,
              names=NAMES, keys=(4, 4), templates=("key",), chains=(CHAINS, CHAINS), spacing=(0, 0)):
    """A training batch: x, y (B, seq_len) int64 and hop1 (B, 2). Each row: a prompt of one of `tasks` (a name or
    a list: one drawn per row), its answer, then filler to the end of the row. The prompt takes
    real text from the haystack with probability haystack_frac (else the repeated sentences).
    The answer is followed by ANSWER_END, as the key is in its needle. y is the next token at the
    answer's and ANSWER_END's positions alone (-1 elsewhere): the model has learned text and copying
    in stage 1. names: multi-key's; keys (lo, hi): its needle count, drawn per row; templates: one
    drawn per row; chains (lo, hi): vartrack's, drawn per row; spacing: its hops' (make_example). hop1: in a
    2-hop row, the middle token of the first hop's needle and the token whose chunk's landmark must fetch it (-1:
    one hop). A choice of one draws nothing from rng."""
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    x = torch.empty(batch_size, seq_len, dtype=torch.long)
    y = torch.empty(batch_size, seq_len, dtype=torch.long)
    hop1 = torch.full((batch_size, 2), -1, dtype=torch.long)
    for b in range(batch_size):
        task = rng.choice(tasks)
        hs = haystack if haystack is not None and rng.random() < haystack_frac else None
        n = rng.randint(*keys) if keys[0] < keys[1] else keys[0]
        template = rng.choice(templates) if len(templates) > 1 else templates[0]
        m = rng.randint(*chains) if task == "vartrack" and chains[0] < chains[1] else chains[0]
        prompt, answer, hops = make_example(task, seq_len + 1 - MAX_ANSWER, rng, enc, hs, min_depth, align, names,
                                            n, template, chains=m, spacing=spacing)
        if len(hops) > 1:
            hop1[b] = torch.tensor([(hops[0][0] + hops[0][1]) // 2, hops[0][2]])
        answer = answer + enc.encode_ordinary(ANSWER_END)
        row = np.concatenate([prompt, answer, filler(seq_len + 1 - len(prompt) - len(answer), rng, enc, hs)])
        row = torch.from_numpy(row)
        x[b], y[b] = row[:-1], row[1:]
        y[b, : len(prompt) - 1] = -1  # the question's last token predicts the first answer token
        y[b, len(prompt) - 1 + len(answer) :] = -1
    return x, y, hop1


def parse_range(text, lo, hi):
    """train.py's --task_keys: 'N' or 'A-B' -> (A, B) within [lo, hi]; None if it reads as neither."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    got = m and (int(m[1]), int(m[2] or m[1]))
    return got if got and lo <= got[0] <= got[1] <= hi else None


class TaskRows:
    """train.py's batches of synthetic tasks (--dataset=passkey,multikey,vartrack: one task drawn per row), as
    its task_* keys say (c: train.py's config). ValueError where the haystack is unusable or the
    longest needles and question do not fit a row after task_min_depth."""

    def __init__(self, c):
        self.c, self.tasks, self.vocab, self.enc = c, c.dataset.split(","), GPT2_VOCAB, get_tokenizer()
        self.align = c.chunk_size - 1  # questions aligned (Appendix D)
        self.names = {"train": word_pool(self.enc), "val": word_pool(self.enc, (9, 12))}  # val's: never trained
        self.keys, self.templates = parse_range(c.task_keys, 2, 16), tuple(c.task_templates.split(","))
        self.chains = parse_range(c.task_chains, 2, 16)  # 2-hop's
        try:
            self.haystack = Haystack(c.task_haystack, self.enc) if c.task_haystack else None
        except (OSError, ValueError) as e:
            raise ValueError(f"task_haystack: {e}") from None
        # each 2-hop row is laid out as a test prompt (hop_spacing) where it has room, else with the hops 2 chunks apart
        self.spacing = hop_spacing(c)
        if "vartrack" in self.tasks and self.misfit(["vartrack"]):
            self.spacing = hop_spacing(c, test=False)
        if why := self.misfit(self.tasks):
            raise ValueError(f"{why}: raise --block_size or lower --task_min_depth")

    def misfit(self, tasks):
        """Why the longest prompts of tasks do not fit a row (make_example's ValueError), None where they do."""
        c = self.c
        try:
            for task, template, i in itertools.product(tasks, self.templates, range(8)):
                make_example(task, c.block_size + 1 - MAX_ANSWER, random.Random(i), self.enc,
                             min_depth=c.task_min_depth, align=self.align, names=self.names["train"], keys=self.keys[1],
                             template=template, chains=self.chains[1], spacing=self.spacing)
        except ValueError as e:
            return str(e)
        return None

    def batch(self, split, rng, training):
        """x, y (B, T) and hop1 (B, 2) on the CPU: get_batch with the run's keys; multi-key's names from the split's
        pool."""
        c = self.c
        return get_batch(self.tasks, c.batch_size, c.block_size, rng, self.enc, self.haystack, c.task_haystack_frac,
                         c.task_min_depth, self.align, self.names[split], self.keys, self.templates, self.chains,
                         self.spacing)


class TextRows:
    """train.py's batches of a prepared text dataset (data_dir/train.bin, val.bin of prepare_pg19.py):
    random windows, with copy rows mixed into training (c: train.py's config). ValueError where the
    data is missing, cut short (common.check_bin), shorter than a row, or of another vocabulary."""

    def __init__(self, c):
        data_dir = c.data_dir or os.path.join("data", c.dataset)
        prepare = (f"python prepare_code.py --source linux/usr/src/linux-source-6.12.tar.xz --out {data_dir}"
                   if c.dataset == "code" else f"python prepare_pg19.py --source /path/to/pg19 --out {data_dir}")
        fix = f"prepare the data again, e.g. {prepare} --overwrite"
        if (meta := read_meta(data_dir, fix)) is None:  # prepare_pg19.py writes it last
            raise ValueError(f"{data_dir}/meta.json not found: prepare the data first, e.g. {prepare} "
                             f"(or --dataset={'|'.join(TRAINED)})")
        self.c, self.vocab, self.splits, self.reach = c, meta["vocab_size"], {}, window_reach(c)
        for split in ("train", "val"):
            path = os.path.join(data_dir, f"{split}.bin")
            tokens = check_bin(path, fix=fix)  # whole, as its meta.json lists it, of its vocabulary
            if len(tokens) < c.block_size + 1:
                raise ValueError(f"{path} has {len(tokens):,} tokens, fewer than block_size+1={c.block_size + 1:,}; "
                                 f"lower --block_size")
            self.splits[split] = (path, len(tokens))

    def batch(self, split, rng, training):
        """x, y (B, T) on the CPU, and None for the hops of task rows; copy_frac changes training rows alone."""
        c, (path, n) = self.c, self.splits[split]
        data = np.memmap(path, dtype=np.uint16, mode="r")  # opened per batch: a memmap kept open leaks memory
        rows = [np.asarray(data[s : s + c.block_size + 1], dtype=np.int64)
                for s in (rng.randrange(n - c.block_size) for _ in range(c.batch_size))]
        if training and c.copy_frac:
            rows = [copy_row(len(r), rng, self.vocab, self.reach) if rng.random() < c.copy_frac else r for r in rows]
        xy = torch.from_numpy(np.stack(rows))  # (B, T+1)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous(), None  # no hops


def copy_row(n, rng, vocab, reach):
    """A training row of n tokens that teaches copying: a span of random tokens (nothing else
    predicts them) repeated from the row's start to its end, as often as fits. Half the rows are
    near: 24-100 tokens, copied within the window (induction); half far: more than `reach` tokens,
    so each repeat lies further back than the stacked windows see and only retrieval (top-k
    chunks, then GCA) can copy it. Answering by a name (multi-key) builds on both."""
    far = rng.random() < 0.5 and n - 108 > reach + 8  # room for a far span and a repeat of >= 108 tokens
    L = rng.randrange(reach + 8, n - 108) if far else rng.randrange(24, 101)
    return np.resize(np.array([rng.randrange(vocab) for _ in range(L)], dtype=np.int64), n)


def score(generated_ids, answer_ids, enc):
    """1 if the generated text is the answer followed by something that does not continue the
    number (a full stop, a space: not a digit), else 0: 71432 then 5 spells 714325, a wrong key.
    Decode SCORE_AFTER tokens past the answer's, so that what follows it is seen."""
    text, want = enc.decode(list(generated_ids)).lstrip(), enc.decode(answer_ids).strip()
    return int(text.startswith(want) and len(text) > len(want) and not text[len(want)].isdigit())


# The test table's other columns: could the windows or retrieval reach the needle; how sure is the accuracy

def needle_chunk(prompt, answer, T):
    """The chunk (of T text tokens) where the answer first appears, which retrieval must bring back; or None."""
    at = occurrences(prompt, answer)
    return (at[0] + len(answer) // 2) // T if at else None  # a middle token: the chunk that holds most of it


def needle_labels(x, y, T, groups=1, hop1=None):
    """For needle_rank_loss, from training rows x, y (B, L) and hop1 (B, 2) of get_batch: (B, groups, L // T) int64,
    at the landmark that should fetch a needle the chunk that holds it (where it lies before the landmark: one in
    the window's chunk needs no retrieval), -1 elsewhere. One hop: the asked key, at the landmark that serves the
    answer (chunk p // T - 1, p the answer's first position), in group 1 alone. Two: hop h in group h (where there is
    one), each at its own landmark: "VAR Y = X." a chunk ahead in group 1, the key in group 2. Group 2 is never asked to
    fetch by the name in the question, which in a 2-hop prompt is Y's and would fetch "VAR Y = X." again."""
    labels = np.full((x.size(0), groups, x.size(1) // T), -1, dtype=np.int64)
    hop1 = np.full((x.size(0), 2), -1) if hop1 is None else hop1.numpy()
    for b, (xb, yb) in enumerate(zip(x.numpy(), y.numpy())):  # numpy: this runs every step, beside the GPU's
        at = np.flatnonzero(yb >= 0)
        if not len(at):
            continue
        p, answer = at[0], yb[at[:-1]].tolist()  # the key's tokens, without ANSWER_END
        need, t = needle_chunk(xb[:p], answer, T), p // T - 1
        hops = [(need, t)] if hop1[b, 0] < 0 else [(hop1[b, 0] // T, hop1[b, 1] // T), (need, t)]
        for g in range(groups):
            need, t = hops[g] if g < len(hops) else (None, 0)
            if need is not None and 0 <= need < t < labels.shape[2]:
                labels[b, g, t] = need
    return torch.from_numpy(labels)


def hop_spacing(cfg, test=True):
    """make_example's spacing (gap, far) of a 2-hop prompt, so that it takes two retrievals (cfg: a DRTConfig, or
    train.py's config). far = (n_lower + 1) x W: hop 1's needle ends beyond what the windows carry to the landmark
    serving the answer by the time group 2's query forms there (after the lower layers and group 1's), so X reaches
    that query only through group 1's read. gap: the hops' fewest tokens apart; in a test n_lower x W + 2 chunks, more
    than a chunk's memory sees back through the lower windows, so no chunk holds both; in training (test=False) 2
    chunks, as far as a row of 16 chunks allows with hop 1 far: no chunk or its neighbour holds both, but hop 1's
    chunk lies within the lower windows' reach of hop 2, so its memory may carry the number and one retrieval may
    answer (dev/hops.py). TaskRows takes the test layout wherever its rows have room (config/twohop.py's do)."""
    return (cfg.n_lower * cfg.window if test else 0) + 2 * cfg.chunk_size, (cfg.n_lower + 1) * cfg.window


def hop_hits(hops, picks, T):
    """2-hop's per-group columns: for each of make_example's hops (start, end, asked), whether its needle's chunk (or
    the next) got the largest weight among the picks of the group that should fetch it (hop h: group h, or the
    last) at the landmark closing the chunk of token `asked`; None where the needle is not before that landmark.
    picks: {asked: [(chunk ids (K,), weights (K,)) per group]}."""
    hits = []
    for h, (start, end, asked) in enumerate(hops):
        need, groups = (start + end) // 2 // T, picks[asked]
        if need >= asked // T or not groups:  # in the landmark's own chunk, or a model without retrieval
            hits.append(None)
            continue
        idx, w = groups[min(h, len(groups) - 1)]
        hits.append(bool(w.max() > 0 and int(idx[w.argmax()]) in (need, need + 1)))
    return hits


def in_reach(prompt, answer, T, reach):
    """Whether the answer's last mention lies within `reach` positions (a landmark per T text tokens) of the
    prompt's last token, where the windows can copy it."""
    i = occurrences(prompt, answer)[-1] + len(answer) - 1
    return (len(prompt) - 1 + (len(prompt) - 1) // T) - (i + i // T) < reach


def on_needle(prompt, answer, picks, T):
    """Per upper group, a mask of its picks (idx, w) that hold the answer's needle (its chunk, or the next, whose memory
    saw it) with weight > 0; None where retrieval has no part: no picks, no needle, or the needle in the last two
    chunks, which retrieval cannot pick (chunk c reads what chunk c-1's landmark picked among chunks < c-1)."""
    need, last = needle_chunk(prompt, answer, T), (len(prompt) - 1) // T
    if not picks or need is None or need >= last - 1:
        return None
    return [((idx == need) | (idx == need + 1)) & (w > 0) for idx, w in picks]


def needle_picks(prompt, answer, picks, T):
    """Retrieval's part in one answer -> (found: on_needle's picks exist; hit@1: one of them got some upper group's
    largest weight; their weight (Eq. 3), mean over the groups), or None where on_needle is."""
    if (on := on_needle(prompt, answer, picks, T)) is None:
        return None
    found = any(bool(m.any()) for m in on)
    top = any(bool(m[w.argmax()]) for (_, w), m in zip(picks, on))
    return found, top, sum(float(w[m].sum()) for (_, w), m in zip(picks, on)) / len(picks)


def wilson(k, n, z=1.96):
    """The Wilson score interval of k successes in n: inside [0, 1], and not empty at 0/n or n/n."""
    p, d = k / n, 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, mid - half), min(1.0, mid + half)
