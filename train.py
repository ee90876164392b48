"""
Train DRT (or its sliding-window baseline) on PG19 or on a synthetic long-context task.

    python train.py config/quickstart.py       # CPU or one GPU: a tiny DRT on the PG19 sample, minutes
    python train.py config/train_drt146m.py    # the paper's 146M DRT x1 on one GPU (8 accumulation steps)
    torchrun --standalone --nproc_per_node=8 train.py config/train_drt146m.py   # one node of 8 GPUs
    python train.py config/quickstart.py --batch_size=4 --groups=1,1          # override any key
    python train.py config/quickstart.py --init_from=resume                   # continue out_dir/ckpt.pt
    python train.py --out_dir=out-quickstart --init_from=resume --max_iters=600  # its stored config, 600 steps
    python train.py --help                     # every key, its default and why

PG19 must be prepared first: python prepare_pg19.py --source /path/to/pg19 --out data/pg19.
Config files (Python, executed in order), then --key=value overrides (Python literals; strings
need no quotes; tuples as --groups=3,3 or --groups="()", shell-safe) change the hyperparameters
below and the model's (DRTConfig's fields, model.py). Only existing keys, with the default's type.

Ctrl-C (or SIGTERM) stops at the next step boundary, saves, and prints the command that continues;
a second Ctrl-C stops at once. A resumed run takes the checkpoint's config and applies only what
is given now (printing each change); the architecture cannot change.

Resume is exact: every random draw of a step (the data windows, the model's Gumbel noise) is a
function of (seed, iteration, global micro-batch index), and the learning rate a function of
the iteration, so a checkpoint needs no RNG state and a resumed run repeats an uninterrupted
one bit for bit. The same makes the global batch independent of how it is split over GPUs
and accumulation steps.
"""


import ast
import dataclasses
import difflib
import inspect
import itertools
import json
import math
import os
import random
import re
import runpy
import shlex
import signal
import sys
import tempfile
import threading
import time
import types
import typing
from contextlib import nullcontext
from datetime import timedelta

try:
    import fcntl  # POSIX: the out_dir lock
except ImportError:
    fcntl = None

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import tasks
from common import fmt_time, peak_flops, peak_mem_gib
from model import DRT, DRTConfig, retrieval_stats, window_reach
from prepare_pg19 import GPT2_VOCAB, get_tokenizer

# ---- hyperparameters: the paper's 146M DRT x1 on PG19 (§4.1.2, Appendix A), one home each -----
# I/O
out_dir = "out"  # where ckpt.pt (weights, optimizer, loop state) and ckpt.json (the same without tensors) go; one run at a time (.lock)
eval_interval = 1000  # steps between evaluations and checkpoints (146M + AdamW state: a 1.75 GB ckpt.pt)
log_interval = 10  # steps between log lines; each line syncs the GPU once and reports the mean loss since the last (under torchrun a Ctrl-C stops every GPU at the next line)
eval_iters = 40  # micro-batches per split per evaluation: 40 x 4 x 16380 = 2.6M tokens, a steady estimate
always_save_checkpoint = True  # save at every evaluation, not only when val improves (the last step is always saved): a long run must be resumable
overwrite = False  # a run from scratch or a fine-tune refuses an out_dir that holds a ckpt.pt (another run's model); True replaces it
init_from = "scratch"  # 'scratch'; 'resume' continues out_dir/ckpt.pt with its stored config (keys given now change it); a path to another run's ckpt.pt (or its folder) fine-tunes: its weights and architecture, a fresh optimizer and schedule
stop_iter = 0  # stop and save after this step without changing the schedule (a long run in pieces); 0 = max_iters
# data
dataset = "pg19"  # a folder data/<dataset> with meta.json (prepare_pg19.py), or passkey|multikey|vartrack (tasks.py), or a comma list of them (one drawn per prompt)
data_dir = ""  # folder of the prepared dataset; "" = data/<dataset>
copy_frac = 0.0  # text datasets: the fraction of training rows that are a random span repeated to the row's end, half within the window, half past its reach (copy_row): copying, which answering by a name builds on and a pre-training on few books does not learn (sample.py --copying measures it); the logged training loss then includes these rows, evaluation never does
repeat_frac = 0.0  # text datasets: the fraction of training rows in which a passage of 63-504 tokens recurs more than the windows' reach later (repeat_passage): a repeat only retrieval can predict, to see the retriever learn from the next-token loss
task_min_depth = 0  # synthetic tasks: needles no earlier than this token, so the first chunks (told apart by having no past) never hold one and "retrieve the oldest chunks" cannot pass for retrieval
task_loss = "all"  # synthetic tasks: 'all' = next-token loss everywhere (teaches copying from scratch), 'answer' = on the answer and the full stop that ends it; evaluation always scores the answer
task_haystack = ""  # synthetic tasks: real text to hide the needles in, a .bin of prepare_pg19.py (e.g. data/pg19/train.bin); "" = the repeated sentences only
task_haystack_frac = 0.5  # synthetic tasks with task_haystack: the fraction of prompts in real text, the rest in the sentences
task_names = "pool"  # multi-key's names in training: 'pool' = ~12K one-token words (tasks.word_pool), none a test uses, so the model must learn to match names; 'twenty' = tasks.NAMES (its models then answer for those twenty alone)
task_keys = "4"  # multi-key's needles per training prompt: N, or A-B for a count drawn per prompt (2-16: beyond top-k, retrieval must match the name to serve the answer)
task_templates = "key"  # the phrasings of passkey and multi-key in training, a comma list of tasks.TEMPLATES, one drawn per prompt ('key,number,id' varies it; 'code' is sample.py's held-out phrasing)
task_align = True  # synthetic tasks: cut prompts so the question's last token opens a chunk, so the landmark whose retrieval serves the answer has read the question (the paper pads its prompts so, Appendix D)
batch_size = 4  # sequences per micro-batch per GPU: the paper's 4 x 16380 per GPU
block_size = 16380  # text tokens per sequence: 260 chunks of 63, the paper's 16K training length
tokens_per_step = 524160  # per step, all GPUs (the paper's 8x4x16380): k * batch_size*block_size*GPUs, k = accumulation; 0: k=1
# model: DRTConfig's fields; model.py holds each default and its why (--help lists them)
# optimizer: AdamW with warmup and cosine decay (the release's recipe)
learning_rate = 2e-3  # peak learning rate, reached after warmup
min_lr = 4e-4  # the cosine ends here, learning_rate / 5
warmup_frac = 0.02  # linear warmup over this fraction of max_iters
max_iters = 60000  # optimizer steps: 60K x 524K tokens = 31B tokens, the paper's run; the schedule spans them
weight_decay = 1e-3  # on matrices only, not on norm gains
betas = (0.9, 0.95)  # AdamW (beta1, beta2): the release's, the usual beta2 for GPT-style LM training
grad_clip = 1.0  # clip the global gradient norm to this; 0 = no clipping
# system
device = "auto"  # 'auto' = cuda if available, else cpu; or 'cpu', 'cuda' (torchrun: cuda:LOCAL_RANK)
dtype = "auto"  # 'auto' = bfloat16 autocast on CUDA, float32 on CPU; or 'bfloat16', 'float32'
compile = True  # torch.compile the model on CUDA (ignored on a CPU, where compiling costs more than it saves): faster steps after a slow first one
seed = 1337  # the initial weights and every random draw of training derive from it
ddp_timeout = 300  # seconds a GPU waits in a collective before torchrun's job fails (torch's default: 10-30 min); above rank 0's evaluation + save, which the others wait for
# ---- end of hyperparameters ----------------------------------------------------------------

PER_RUN = ("out_dir", "init_from", "overwrite", "stop_iter")  # what this command does, not what the run is: never restored on resume
CPU_FLOPS = 1e11  # FLOP/s of fp32 training on a fast CPU, for the warning that a step will take minutes
PROGRESS_AFTER = 10  # seconds a step or an evaluation runs before it says how far it got


def read_block():
    """[(key, comment)] of the block above, headings as (None, heading), DRTConfig's fields (and their
    comments in model.py) under the model heading: --help shows each key's why from its one home."""
    with open(__file__, encoding="utf-8") as f:
        block = f.read().split("\n# ---- ")[1].splitlines()[1:]  # the lines between the two "# ---- " lines
    said = dict(re.findall(r"^[ \t]+(\w+)[ \t]*:.*? #[ \t]*(.*)$", inspect.getsource(DRTConfig), re.M))
    rows = []
    for line in block:
        m = re.match(r"(\w+) = .+?  # (.+)$", line)
        rows += [(m[1], m[2])] if m else [(None, line[2:].strip())] if line.startswith("# ") else []
        if line.startswith("# model:"):
            rows += [(f.name, said.get(f.name, "")) for f in dataclasses.fields(DRTConfig)]
    return rows


MODEL_DEFAULTS = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                  for f in dataclasses.fields(DRTConfig)}
MODEL_KEYS = list(MODEL_DEFAULTS)
BLOCK = read_block()
DEFAULTS = {k: MODEL_DEFAULTS[k] if k in MODEL_KEYS else globals()[k] for k, _ in BLOCK if k}
# the type a key's values must have: its default's; a default None (model.py fills it in) takes the
# field's annotation, Optional[int] -> int
TYPES = {k: type(v) for k, v in DEFAULTS.items()} | {
    k: next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    for k, hint in typing.get_type_hints(DRTConfig).items() if DEFAULTS[k] is None}


class ConfigError(Exception):
    """Something the user can fix (a key, a value, the data, out_dir): shown without a traceback."""


class Stopped(Exception):
    """Ctrl-C or SIGTERM ended the run: args = (what was saved and how to continue, the signal)."""


def log(msg):  # on rank 0 alone (torchrun sets RANK), flushed so logs under nohup or tee keep up
    if int(os.environ.get("RANK", 0)) == 0:
        print(msg, flush=True)


def parse_config(argv):
    """argv: config files and --key=value, applied in order -> (config dict, keys set explicitly).
    Each value must have its key's type: ints pass for floats, lists for tuples, any text for strings."""
    config, explicit = dict(DEFAULTS), set()
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            if not eq:
                raise ConfigError(f"{arg}: write overrides as --key=value")
            try:
                updates = {key: text if TYPES.get(key) is str else ast.literal_eval(text)}
            except (ValueError, SyntaxError):
                updates = {key: text}  # a bare word: a string
        elif os.path.isfile(arg):
            try:
                ran = runpy.run_path(arg)
            except Exception as e:  # a syntax error, a name error, ...: the file's fault, in one line
                raise ConfigError(f"config file {arg} does not run ({type(e).__name__}: {e}): fix it") from None
            updates = {k: v for k, v in ran.items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}
        else:
            raise ConfigError(f"config file {arg} not found (overrides are written --key=value)")
        for k, v in updates.items():
            if k not in DEFAULTS:
                close = difflib.get_close_matches(k, DEFAULTS, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise ConfigError(f"{arg}: unknown key {k!r}{hint}; python train.py --help lists the keys")
            want = TYPES[k]
            if want is float and type(v) is int or want is tuple and isinstance(v, list):
                v = want(v)
            if type(v) is not want and not (v is None and DEFAULTS[k] is None):
                raise ConfigError(f"{arg}: {k} must be of type {want.__name__} like its default "
                                  f"{DEFAULTS[k]!r}, got {v!r} ({type(v).__name__})")
            config[k] = v
            explicit.add(k)
    return config, explicit


def check_config(config):
    """The values' ranges (parse_config checked their types): every problem in one line."""
    c = types.SimpleNamespace(**config)
    positive = ("batch_size", "block_size", "max_iters", "eval_interval", "log_interval", "eval_iters", "ddp_timeout")
    bad = [f"{k}={config[k]} must be a positive int" for k in positive if config[k] < 1]
    bad += [why for wrong, why in [
        (not c.init_from, f"init_from={c.init_from!r} must be 'scratch', 'resume' or the path of a checkpoint"),
        (c.task_min_depth < 0, f"task_min_depth={c.task_min_depth} must be >= 0"),
        (not 0 <= c.stop_iter <= c.max_iters, f"stop_iter={c.stop_iter} must lie in [0, max_iters={c.max_iters}]"),
        (not 0 <= c.warmup_frac < 1, f"warmup_frac={c.warmup_frac} must lie in [0, 1)"),
        (c.learning_rate < 0, f"learning_rate={c.learning_rate} must be >= 0"),
        (c.learning_rate >= 0 and not 0 <= c.min_lr <= c.learning_rate,
         f"min_lr={c.min_lr} must lie in [0, learning_rate={c.learning_rate}]"),
        (c.tokens_per_step < 0 or c.grad_clip < 0, "tokens_per_step and grad_clip must be >= 0"),
        (not 0 <= c.task_haystack_frac <= 1, f"task_haystack_frac={c.task_haystack_frac} must lie in [0, 1]"),
        (not 0 <= c.copy_frac <= 1, f"copy_frac={c.copy_frac} must lie in [0, 1]"),
        (not 0 <= c.repeat_frac <= 1, f"repeat_frac={c.repeat_frac} must lie in [0, 1]"),
        (c.repeat_frac and is_tasks(c.dataset), f"repeat_frac={c.repeat_frac} repeats passages of a text dataset; "
                                                 f"--dataset={c.dataset} is synthetic tasks"),
        (c.copy_frac and is_tasks(c.dataset),
         f"copy_frac={c.copy_frac} mixes copy rows into a text dataset; --dataset={c.dataset} is synthetic tasks"),
        (c.task_loss not in ("all", "answer"), f"task_loss={c.task_loss!r} must be 'all' or 'answer'"),
        (c.task_names not in ("twenty", "pool"), f"task_names={c.task_names!r} must be 'twenty' or 'pool'"),
        (parse_task_keys(c.task_keys) is None, f"task_keys={c.task_keys!r} must be N or A-B, with 2 <= A <= B <= 16"),
        (not set(c.task_templates.split(",")) <= tasks.TEMPLATES.keys(),
         f"task_templates={c.task_templates!r} must be a comma list of {', '.join(tasks.TEMPLATES)}"),
        (not re.fullmatch(r"auto|cpu|cuda(:\d+)?", c.device),
         f"device={c.device!r} must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        ("," in c.dataset and not is_tasks(c.dataset),
         f"dataset={c.dataset!r}: a comma list is of synthetic tasks, each one of {', '.join(tasks.TASKS)}"),
        (c.dtype not in ("auto", "bfloat16", "float32"),
         f"dtype={c.dtype!r} must be 'auto', 'bfloat16' or 'float32' (float16 would need a grad scaler)"),
    ] if wrong]
    if bad:
        raise ConfigError("; ".join(bad))


# checkpoints: each file is written whole (to .tmp, then renamed) and never replaced unasked


def load_checkpoint(path, fix):
    """common.load_checkpoint, its error a ConfigError."""
    try:
        return common.load_checkpoint(path, fix)
    except common.CheckpointError as e:
        raise ConfigError(e) from None


def save_checkpoint(c, model_args, raw_model, optimizer, iter_num, best_val_loss, val_loss, tokens_per_step):
    """ckpt.pt, and ckpt.json (the same without tensors, for people and tools without torch); val_loss None: signal."""
    state = {"model_args": model_args, "config": vars(c), "iter_num": iter_num, "best_val_loss": best_val_loss}
    path = os.path.join(c.out_dir, "ckpt.pt")
    torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), **state}, path + ".tmp")
    os.replace(path + ".tmp", path)
    with open(path[:-3] + ".json.tmp", "w") as f:
        json.dump({**state, "val_loss": val_loss, "tokens_seen": iter_num * tokens_per_step}, f, indent=1)
    os.replace(path[:-3] + ".json.tmp", path[:-3] + ".json")
    log(f"saved {path} at step {iter_num}")


def saved_at(out_dir):
    """'out/ckpt.pt at step N', read from ckpt.json (what is on disk now), or None."""
    try:
        with open(os.path.join(out_dir, "ckpt.json")) as f:
            step = json.load(f)["iter_num"]
    except (OSError, ValueError, KeyError, TypeError):
        step = None
    path = os.path.join(out_dir, "ckpt.pt")
    return None if not os.path.isfile(path) else path if step is None else f"{path} at step {step}"


class Stop:
    """Ctrl-C and SIGTERM: the handler only takes note (STOP.signum), and the loop stops at the next step
    boundary, where the model is whole. Under torchrun the agent forwards a Ctrl-C to the workers, sends
    SIGTERM to all when one worker dies, and kills them TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30) s later."""

    def catch(self, rank, out_dir, ddp):
        self.signum, self.at, self.old, self.wakeup = 0, 0.0, {}, None
        if threading.current_thread() is not threading.main_thread():
            return
        self.old = {s: signal.signal(s, self.note) for s in (signal.SIGINT, signal.SIGTERM)}
        if ddp:
            r, w = os.pipe()
            try:
                os.set_blocking(w, False)
                self.wakeup = (signal.set_wakeup_fd(w), w)  # Python's C-level handler writes the signal number to w
            except (ValueError, OSError):  # where the wakeup fd must be a socket (Windows): no watchdog
                os.close(r)
                os.close(w)
                return
            threading.Thread(target=self.watchdog, args=(r, rank, out_dir), daemon=True).start()

    def arm(self):
        """Put note back in front of SIGINT and SIGTERM, at every step boundary. Triton's first compile in this
        process (the GPU kernels compile at their first call, after catch) has LLVM install its handlers over
        ours. LLVM's passes the signal on, but with SA_RESETHAND: while it runs a signal kills, so the second of
        two quick SIGINTs (timeout -s INT sends the process one and its group one) ended runs with exit 130 and
        nothing printed or saved. LLVM installs them once, so only the step of that compile is exposed."""
        for s in self.old:
            signal.signal(s, self.note)

    def note(self, signum, frame):
        # a second Ctrl-C stops at once; within 1 s it is the first one again (sent by the terminal and by torchrun)
        if signum == signal.SIGINT and self.signum and time.time() - self.at > 1:
            raise KeyboardInterrupt
        if not self.signum:
            self.signum, self.at = signum, time.time()

    def watchdog(self, fd, rank, out_dir):
        """A rank stuck in a collective whose peer died never gets back to Python, where note runs. This
        thread wakes on the signal's byte at fd, gives the main thread 2/3 of torchrun's grace to stop
        at a step boundary, then says in one line what to do and exits."""
        for b in iter(lambda: os.read(fd, 1), b""):  # until release closes the write end
            if b[0] in (signal.SIGINT, signal.SIGTERM):
                time.sleep(int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 30)) * 2 / 3)
                print(f"train.py: {rank_stopped(rank, out_dir, b[0])}", file=sys.stderr, flush=True)
                os._exit(128 + b[0])
        os.close(fd)

    def release(self):
        if self.wakeup:
            signal.set_wakeup_fd(self.wakeup[0])
            os.close(self.wakeup[1])
        for s, handler in self.old.items():
            signal.signal(s, handler)


STOP = Stop()


def rank_stopped(rank, out_dir, signum):  # the one line of a rank that cannot reach a step boundary with the others
    why, last = " (another rank failed?)" if signum == signal.SIGTERM else "", saved_at(out_dir)
    return (f"rank {rank}: stopped by {signal.Signals(signum).name}{why}; "
            + (f"the last checkpoint is {last}: resume with --init_from=resume" if last else "no checkpoint saved"))


def model_config(c, explicit, ckpt):
    """The architecture -> (model_args, ckpt to load or None, finetune). Resuming or fine-tuning, it is
    the checkpoint's (model keys given now must agree), else the config's; c's model keys are set to it."""
    ckpt_path = src = os.path.join(c.out_dir, "ckpt.pt")
    finetune = c.init_from not in ("scratch", "resume")
    if finetune:  # another run's weights: a path to its ckpt.pt or to its out_dir
        src = os.path.join(c.init_from, "ckpt.pt") if os.path.isdir(c.init_from) else c.init_from
        if not os.path.isfile(src):
            raise ConfigError(f"init_from={c.init_from!r}: no checkpoint there (want 'scratch', 'resume', or the "
                              f"path of a train.py ckpt.pt or its out_dir)")
        if os.path.abspath(src) == os.path.abspath(ckpt_path):
            raise ConfigError(f"init_from={src} would be overwritten by this run's own checkpoint: use "
                              f"--init_from=resume, or another --out_dir")
    if c.init_from != "resume" and os.path.exists(ckpt_path) and not c.overwrite:
        raise ConfigError(f"{saved_at(c.out_dir) or ckpt_path} exists: continue that run with --init_from=resume, "
                          f"replace it with --overwrite=True, or use another --out_dir")
    if finetune:
        ckpt = load_checkpoint(src, "point --init_from at a train.py ckpt.pt or its out_dir")
    as_tuple = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731 (JSON gives groups as a list)
    if ckpt is not None:
        clash = [k for k in MODEL_KEYS if k in explicit and as_tuple(getattr(c, k)) != as_tuple(ckpt["model_args"][k])]
        if clash:
            said = ", ".join(f"{k}={ckpt['model_args'][k]!r}, the config asks {getattr(c, k)!r}" for k in clash)
            raise ConfigError(f"checkpoint {src} has {said}: drop {' '.join(f'--{k}' for k in clash)} (from the "
                              f"command line or config file) or start a new out_dir")
        vars(c).update({k: ckpt["model_args"][k] for k in MODEL_KEYS})
    try:
        model_args = dataclasses.asdict(DRTConfig(**{k: as_tuple(getattr(c, k)) for k in MODEL_KEYS}))
    except ValueError as e:  # DRTConfig says what is wrong
        raise ConfigError(e) from None
    vars(c).update(model_args)  # what was built (e.g. landmark_id filled in): the checkpoint's config says so
    model_args["groups"] = list(model_args["groups"])  # JSON-able
    min_len = 2 * (c.chunk_size - 1) + 1  # chunks 0 and 1 retrieve nothing: GCA starts in chunk 2
    if c.groups and c.block_size < min_len:
        raise ConfigError(f"block_size={c.block_size} gives fewer than 3 chunks, so GCA would never run: use "
                          f"block_size >= {min_len} (best a multiple of chunk_size-1={c.chunk_size - 1})")
    return model_args, ckpt, finetune


def check_out_dir(out_dir):
    """out_dir is, or can become, a writable folder: checked last, so a run that cannot start leaves none behind."""
    parent = out_dir
    while parent and not os.path.exists(parent):  # the nearest part of the path that exists
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        where = "" if parent == out_dir else f": {parent}"
        raise ConfigError(f"out_dir {out_dir}{where} is a file, not a folder: pass --out_dir=<folder>")
    try:
        os.makedirs(out_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise ConfigError(f"out_dir {out_dir} is not writable ({e}): pass --out_dir=<writable folder>") from None


LOCK = []  # the open lock file of out_dir while this process trains (lock_out_dir), closed when main() ends


def lock_out_dir(out_dir):
    """Hold out_dir for this run: a second train.py into the same folder (a typo, a resume while the run
    still goes) would pass the checks above, as no checkpoint may be saved yet, and later overwrite this
    run's. The lock is the OS's (flock): it goes with the process, however that ends; none on Windows."""
    if fcntl is None:
        return
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise ConfigError(f"out_dir {out_dir} is in use by another train.py run (pid {pid}): let it finish or "
                          f"stop it first, or use another --out_dir") from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    LOCK.append(f)


def parse_task_keys(text):
    """--task_keys: 'N' or 'A-B' -> (A, B), multi-key's needle counts in training; None if it reads as neither."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    keys = m and (int(m[1]), int(m[2] or m[1]))
    return keys if keys and 2 <= keys[0] <= keys[1] <= 16 else None


def is_tasks(dataset):
    """Whether --dataset names synthetic tasks (tasks.py) rather than a prepared text dataset."""
    return all(t in tasks.TASKS for t in dataset.split(","))


class Data:
    """The run's batches, of a prepared dataset (data_dir/train.bin, val.bin) or of synthetic tasks
    (a comma list: one drawn per prompt). A batch is a function of (split, rng) alone."""

    def __init__(self, c, device):
        self.c, self.device, self.tasks = c, device, c.dataset.split(",")
        if is_tasks(c.dataset):
            self.enc, self.vocab = get_tokenizer(), GPT2_VOCAB  # the tasks' text is GPT-2 tokens
            self.align = c.chunk_size - 1 if c.task_align else None
            self.names = tasks.word_pool(self.enc) if c.task_names == "pool" else tasks.NAMES
            self.keys, self.templates = parse_task_keys(c.task_keys), tuple(c.task_templates.split(","))
            try:
                self.haystack = tasks.Haystack(c.task_haystack, self.enc) if c.task_haystack else None
            except (OSError, ValueError) as e:
                raise ConfigError(f"task_haystack: {e}") from None
            try:  # the longest needles and question must fit after task_min_depth
                for task, template, i in itertools.product(self.tasks, self.templates, range(8)):
                    tasks.make_example(task, c.block_size + 1 - tasks.MAX_ANSWER, random.Random(i), self.enc,
                                       min_depth=c.task_min_depth, align=self.align, names=self.names,
                                       keys=self.keys[1], template=template)
            except ValueError as e:
                raise ConfigError(f"{e}: raise --block_size or lower --task_min_depth") from None
            return
        self.tasks, data_dir = None, c.data_dir or os.path.join("data", c.dataset)
        meta_path = os.path.join(data_dir, "meta.json")
        prepare = f"python prepare_pg19.py --source /path/to/pg19 --out {data_dir}"
        again = f"prepare the data again, e.g. {prepare}"
        if not os.path.isfile(meta_path):
            raise ConfigError(f"{meta_path} not found: prepare the data first, e.g. {prepare} "
                              f"(or --dataset={'|'.join(tasks.TASKS)})")
        try:
            with open(meta_path) as f:
                self.vocab, self.splits = json.load(f).get("vocab_size"), {}
        except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not a JSON object
            self.vocab = None
        if type(self.vocab) is not int or self.vocab < 1:
            raise ConfigError(f"{meta_path} is not a meta.json of prepare_pg19.py (JSON with an int vocab_size): "
                              f"{again}")
        self.reach = window_reach(c)  # copy_row's far rows lie past it
        for split in ("train", "val"):
            path = os.path.join(data_dir, f"{split}.bin")
            if not os.path.isfile(path):
                raise ConfigError(f"{path} not found, but {meta_path} is: the preparation did not finish; run it "
                                  f"again, e.g. {prepare}")
            self.splits[split] = (path, check_bin(path, self.vocab, c.block_size, again))

    def batch(self, split, rng, training=False):
        """(x, y), (B, T) each, on the device; evaluation scores a task's answer alone: that is the task."""
        c = self.c
        if self.tasks:
            x, y = tasks.get_batch(self.tasks, c.batch_size, c.block_size, rng, self.enc, self.haystack,
                                   c.task_haystack_frac, not training or c.task_loss == "answer",
                                   c.task_min_depth, self.align, self.names, self.keys, self.templates)
        else:
            path, n = self.splits[split]
            data = np.memmap(path, dtype=np.uint16, mode="r")  # opened per batch: a memmap kept open leaks memory
            rows = [np.asarray(data[s : s + c.block_size + 1], dtype=np.int64)
                    for s in (rng.randrange(n - c.block_size) for _ in range(c.batch_size))]
            if training and c.repeat_frac:
                rows = [repeat_passage(r, rng, self.reach) if rng.random() < c.repeat_frac else r for r in rows]
            if training and c.copy_frac:
                rows = [copy_row(len(r), rng, self.vocab, self.reach) if rng.random() < c.copy_frac else r
                        for r in rows]
            xy = torch.from_numpy(np.stack(rows))  # (B, T+1)
            x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)


def check_bin(path, vocab, block_size, fix):
    """The token count of a split's .bin, checked before any model is built or folder made: whole
    uint16 ids, enough for a row, and on a sample all below the vocabulary; else a ConfigError."""
    size = os.path.getsize(path)
    if size % 2:
        raise ConfigError(f"{path} has an odd number of bytes ({size:,}), so it is not uint16 token ids: {fix}")
    n = size // 2
    if n < block_size + 1:
        raise ConfigError(f"{path} has {n:,} tokens, fewer than block_size+1={block_size + 1:,}; lower --block_size")
    top = common.max_token_id(np.memmap(path, dtype=np.uint16, mode="r"))
    if top >= vocab:
        raise ConfigError(f"{path} holds token id {top}, outside vocab_size={vocab} of its meta.json: {fix}")
    return n


def copy_row(n, rng, vocab, reach):
    """A training row of n tokens that teaches copying: a span of random tokens (nothing else
    predicts them) repeated from the row's start to its end, as often as fits. Half the rows are
    near: 24-100 tokens, copied within the window (induction); half far: more than `reach` tokens,
    so each repeat lies further back than the stacked windows see and only retrieval (top-k
    chunks, then GCA) can copy it. Measured on a small stage 1: near rows alone make a model copy
    in its window, and its multi-key fine-tune fails (<= 15%); with far rows too it reaches 100%
    at 1M tokens. Copies placed inside text rows, or spans of text tokens, taught nothing."""
    far = rng.random() < 0.5 and n - 108 > reach + 8  # room for a far span and a repeat of >= 108 tokens
    L = rng.randrange(reach + 8, n - 108) if far else rng.randrange(24, 101)
    return np.resize(np.array([rng.randrange(vocab) for _ in range(L)], dtype=np.int64), n)


def repeat_passage(row, rng, reach):
    """The row (n,) of text with a passage of 63-504 tokens (1-8 chunks, as the row allows) copied over a later part
    of it, more than `reach` tokens after its first reading: no chain of self-attention windows
    links the two, so only retrieval (top-k chunks, then GCA) can predict the repeat from it."""
    if len(row) < 2 * 63 + reach + 8:
        return row
    P = rng.randrange(63, min(504, (len(row) - reach - 8) // 2) + 1)
    a = rng.randrange(len(row) - 2 * P - reach - 7)
    b = rng.randrange(a + P + reach + 8, len(row) - P + 1)
    row = row.copy()
    row[b : b + P] = row[a : a + P]
    return row


def step_rng(*parts):
    """A random.Random that is a fixed function of parts, e.g. (seed, split, iteration, micro-batch):
    str seeds go through SHA-512, so it is the same in every process and on every machine."""
    return random.Random(":".join(map(str, parts)))


def get_lr(it, c):
    """Learning rate of step it (0-based): linear warmup, then cosine from learning_rate to min_lr."""
    warmup = int(c.warmup_frac * c.max_iters)
    if it < warmup:
        return c.learning_rate * (it + 1) / warmup
    progress = (it - warmup) / max(1, c.max_iters - warmup)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (c.learning_rate - c.min_lr)


SAID = {"at": 0.0}  # when progress last printed


def progress(t0, text):
    """Print text when the work begun at t0 (a step, an evaluation) has run PROGRESS_AFTER seconds
    since it began or last said so: a long first step shows it is alive. Host clock: no GPU sync."""
    now = time.time()
    if now - max(t0, SAID["at"]) > PROGRESS_AFTER:
        log(f"{text} after {fmt_time(now - t0)}")
        SAID["at"] = now


@torch.no_grad()
def retrieval_health(model, data, c, autocast):
    """The retrieval statistics (model.retrieval_stats) on the first validation micro-batch, from the
    uncompiled model: a retriever whose weights all go to 0 has died, one whose max w stays 1/K is
    not selective. {} for the baseline."""
    if not c.groups:
        return {}
    x, y = data.batch("val", step_rng(c.seed, "val", "eval", 0))
    model.eval()
    model.record = []
    with autocast:
        model(x, y, return_logits=False)
    stats = retrieval_stats(model.record, c.topk)
    model.record = None
    model.train()
    return stats


@torch.no_grad()
def estimate_loss(model, data, c, autocast):
    """Mean loss over eval_iters micro-batches per split; the same batches at every evaluation."""
    out, t0 = {}, time.time()
    model.eval()  # plain top-k: no Gumbel noise
    for split in ("train", "val"):
        total = torch.zeros((), device=data.device)
        for k in range(c.eval_iters):
            x, y = data.batch(split, step_rng(c.seed, split, "eval", k))
            with autocast:
                _, loss = model(x, y, return_logits=False)
            total += loss.float()
            progress(t0, f"eval {split}: micro-batch {k + 1}/{c.eval_iters} done")
        out[split] = total.item() / c.eval_iters
    model.train()
    return out


def step_plan(c, world_size):
    """-> (tokens_per_step, grad_accum): micro-batches of batch_size x block_size on every rank,
    accumulated to tokens_per_step (0: one micro-batch per rank)."""
    per_micro = c.batch_size * c.block_size * world_size
    tokens_per_step = c.tokens_per_step or per_micro
    grad_accum = tokens_per_step // per_micro
    if grad_accum < 1 or tokens_per_step % per_micro:
        options = ", ".join(f"{per_micro * m:,}" for m in range(max(1, grad_accum), max(1, grad_accum) + 3))
        raise ConfigError(f"tokens_per_step={tokens_per_step:,} is not a multiple of batch_size*block_size*GPUs = "
                          f"{c.batch_size}*{c.block_size}*{world_size} = {per_micro:,}: use e.g. {options} "
                          f"(or 0 for no accumulation), or change batch_size")
    return tokens_per_step, grad_accum


def build(c, model_args, ckpt, finetune, device, ddp):
    """The model and optimizer, loaded from ckpt if given -> (raw_model, eval_model, model, optimizer,
    iter_num, best_val_loss). raw_model is what a checkpoint holds (never compiled, never wrapped);
    eval_model is compiled on CUDA; model is what trains (eval_model in DDP). Evaluation runs on
    rank 0 alone, so never through DDP."""
    torch.manual_seed(c.seed)  # the same initial weights on every rank
    raw_model = DRT(DRTConfig(**model_args)).to(device)
    optimizer = raw_model.configure_optimizers(c.weight_decay, c.learning_rate, c.betas, device.type)
    iter_num, best_val_loss = 0, float("inf")
    if ckpt:
        raw_model.load_state_dict(ckpt["model"])
        if not finetune:  # a fine-tune keeps only the weights: its own optimizer, schedule and best loss
            optimizer.load_state_dict(ckpt["optimizer"])
            iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        ckpt.clear()  # free it (main holds it too)
    eval_model = torch.compile(raw_model) if c.compile and device.type == "cuda" else raw_model
    model = DDP(eval_model, device_ids=[device.index] if device.type == "cuda" else None) if ddp else eval_model
    return raw_model, eval_model, model, optimizer, iter_num, best_val_loss


def train_step(model, optimizer, data, c, autocast, iter_num, rank, grad_accum, ddp):
    """Optimizer step iter_num + 1 over grad_accum micro-batches -> its mean loss on this rank (a
    tensor: no host sync). Batches and Gumbel noise are functions of (seed, iter_num, global
    micro-batch), so any number of GPUs, and a resumed run, take the same steps."""
    lr = get_lr(iter_num, c)
    for group in optimizer.param_groups:
        group["lr"] = lr
    t_step, loss_sum = time.time(), 0
    for micro in range(grad_accum):
        if micro:
            progress(t_step, f"step {iter_num + 1}: micro-batch {micro}/{grad_accum} done")
        g = rank * grad_accum + micro  # global micro-batch index: the same batches whatever the GPU count
        x, y = data.batch("train", step_rng(c.seed, "train", iter_num, g), training=True)
        torch.manual_seed(step_rng(c.seed, "gumbel", iter_num, g).getrandbits(63))  # the model's noise
        with model.no_sync() if ddp and micro < grad_accum - 1 else nullcontext():  # all-reduce once per step
            with autocast:
                _, loss = model(x, y, return_logits=False)
            (loss / grad_accum).backward()
        loss_sum = loss_sum + loss.detach().float() / grad_accum
    if c.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum


def gather_loss(loss_sum, ddp, device):
    """-> (the summed loss of all ranks, the signal every rank must stop at, or 0). Under DDP both
    travel on one all-reduce, which the log line needs anyway: a flag of its own would sync every
    step; if any rank was sent Ctrl-C or SIGTERM, all stop at this step."""
    if not ddp:
        return loss_sum.item(), 0
    sent = [float(STOP.signum == s) for s in (signal.SIGINT, signal.SIGTERM)]
    both = torch.cat([loss_sum.view(1), torch.tensor(sent, device=device)])
    dist.all_reduce(both)  # SUM (gloo has no AVG)
    total, n_int, n_term = both.tolist()
    return total, signal.SIGTERM if n_term else signal.SIGINT if n_int else 0


def stop_message(stop, iter_num, start, resumed, c, again):
    """What a run stopped by a signal at step boundary iter_num says."""
    said = "interrupted" if stop == signal.SIGINT else f"stopped by {signal.Signals(stop).name}"
    if iter_num > start:
        return f"{said}: saved {os.path.join(c.out_dir, 'ckpt.pt')} at step {iter_num}; continue with: {again}"
    if resumed:
        return f"{said} before step {start + 1}: nothing new to save; continue with: {again}"
    return f"{said} before the first step: nothing saved"


def announce(c, raw_model, model_args, world_size, grad_accum, tokens_per_step, device, dtype, how):
    """The run's first line, and a warning where a CPU would take minutes per step."""
    flops_per_token = raw_model.flops_per_token()  # matmul FLOPs of forward + backward
    arch = f"DRT groups={model_args['groups']}" if c.groups else "sliding-window baseline"
    log(f"{arch}, {raw_model.num_params() / 1e6:.2f}M parameters, {flops_per_token / 1e9:.2f} GFLOP/token | "
        f"{c.batch_size} seq x {c.block_size:,} tok x {world_size} rank(s) x {grad_accum} accum = "
        f"{tokens_per_step:,} tok/step | {device} {dtype} | {c.dataset} | {how}")
    step_s = flops_per_token * tokens_per_step / CPU_FLOPS
    eval_s = flops_per_token / 3 * 2 * c.eval_iters * c.batch_size * c.block_size / CPU_FLOPS  # forward only
    if device.type == "cpu" and max(step_s, eval_s) > 60:
        log(f"warning: {raw_model.num_params() / 1e6:.3g}M parameters x {tokens_per_step:,} tokens per step on a CPU: "
            f"one step takes ~{fmt_time(step_s)}, one evaluation ~{fmt_time(eval_s)} (at {CPU_FLOPS / 1e9:.3g} "
            f"GFLOP/s); for a first run use config/quickstart.py")


def train(c, explicit, ckpt, device, ddp, rank, world_size, again):
    """The run main set up: ckpt is the checkpoint to resume (or None), again the command that continues.
    Returns the logged [(iteration, mean train loss since the previous line)]."""
    master, cuda = rank == 0, device.type == "cuda"
    dtype = c.dtype if c.dtype != "auto" else "bfloat16" if cuda else "float32"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for what stays in fp32 on the GPU
    tokens_per_step, grad_accum = step_plan(c, world_size)
    model_args, ckpt, finetune = model_config(c, explicit, ckpt)
    data = Data(c, device)
    if not data.vocab <= c.landmark_id:
        raise ConfigError(f"the data's token ids reach {data.vocab - 1}, but landmark_id={c.landmark_id} "
                          f"must lie above them: set --landmark_id={data.vocab} (and vocab_size above it)")
    if master:
        check_out_dir(c.out_dir)
        lock_out_dir(c.out_dir)
    raw_model, eval_model, model, optimizer, iter_num, best_val_loss = build(c, model_args, ckpt, finetune, device, ddp)
    flops_per_token, peak = raw_model.flops_per_token(), peak_flops(device)
    announce(c, raw_model, model_args, world_size, grad_accum, tokens_per_step, device, dtype,
             f"resuming at step {iter_num}" if iter_num else f"fine-tuning {c.init_from}" if finetune else "from scratch")

    def save(step, val_loss):  # val_loss None: the save of a stop by a signal
        save_checkpoint(c, model_args, raw_model, optimizer, step, best_val_loss, val_loss, tokens_per_step)

    # the loop. iter_num counts the optimizer steps done; everything about step iter_num+1
    # (lr, batches, Gumbel noise) is a function of iter_num, which is all a checkpoint must hold
    start, last, history = iter_num, c.stop_iter or c.max_iters, []
    resumed = c.init_from == "resume"  # then step `start` was evaluated just before the save
    saved = start if resumed else -1  # the step of the checkpoint this run last wrote (or resumed)
    stop = 0  # the signal that stops every rank at the next step boundary (STOP.signum: what this rank was sent)
    loss_sum = torch.zeros((), device=device)
    model.train()
    t_last, it_last = time.time(), iter_num
    while True:
        STOP.arm()  # a step boundary: our handler, whatever a compile during the last step installed
        if master and (iter_num % c.eval_interval == 0 or iter_num == last) and not (resumed and iter_num == start):
            t_eval = time.time()
            losses, ret = estimate_loss(eval_model, data, c, autocast), retrieval_health(raw_model, data, c, autocast)
            log(f"eval iter {iter_num}: train loss {losses['train']:.4f} (ppl {math.exp(losses['train']):.2f}), "
                f"val loss {losses['val']:.4f} (ppl {math.exp(losses['val']):.2f})"
                + (f" | retrieval: sum w {ret['sum_w']:.3f}, max w {ret['max_w']:.3f}" if ret else ""))
            improved, best_val_loss = losses["val"] < best_val_loss, min(best_val_loss, losses["val"])
            if iter_num > start and (improved or c.always_save_checkpoint or iter_num == last):
                save(iter_num, losses["val"])  # the last step too: out_dir must end up holding this run
                saved = iter_num
            t_last += time.time() - t_eval  # evaluation and saving are not training time
        if iter_num >= last:
            break
        stop = stop if ddp else STOP.signum  # one process: at every step; DDP: agreed at the log line below
        if stop:  # a step boundary: the model is whole
            if master and iter_num > saved:
                save(iter_num, None)
            if ddp:
                dist.barrier()  # rank 0's save is done before any rank leaves (torchrun would kill it)
            raise Stopped(stop_message(stop, iter_num, start, resumed, c, again) if master else "", stop)

        loss_sum += train_step(model, optimizer, data, c, autocast, iter_num, rank, grad_accum, ddp)
        iter_num += 1
        if iter_num % c.log_interval == 0 or iter_num == last:
            total, agreed = gather_loss(loss_sum, ddp, device)
            stop = agreed if ddp else stop
            mean_loss = total / world_size / (iter_num - it_last)
            dt = (time.time() - t_last) / (iter_num - it_last)
            tok_s = tokens_per_step / dt
            mfu = f"{100 * flops_per_token * tok_s / (peak * world_size):.1f}%" if peak else "n/a"
            log(f"iter {iter_num}/{c.max_iters} | loss {mean_loss:.4f} | lr {get_lr(iter_num - 1, c):.2e} | "
                f"{1000 * dt:.1f} ms/iter | {tok_s:,.0f} tok/s | mfu {mfu} | peak mem {peak_mem_gib(device):.1f} GiB | "
                f"eta {fmt_time(dt * (last - iter_num))}")
            history.append((iter_num, mean_loss))
            loss_sum.zero_()
            t_last, it_last = time.time(), iter_num

    log(f"done: step {iter_num}/{c.max_iters}, best val loss {best_val_loss:.4f}")
    return history


def main(argv=None):
    """Train with the hyperparameters above as changed by argv (default sys.argv[1:]).
    Returns the logged [(iteration, mean train loss since the previous line)]."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(__doc__.strip() + "\n\nKeys (default, why):")
        for key, comment in BLOCK:
            print(f"\n{comment}" if key is None else f"  --{key}={DEFAULTS[key]!r}\n      {comment}")
        return []
    config, explicit = parse_config(argv)

    # DDP: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE; plain python runs one process
    ddp = "RANK" in os.environ
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))

    ckpt = None  # resume: the checkpoint's config, and on top of it only what is given now
    if config["init_from"] == "resume":
        path = os.path.join(config["out_dir"], "ckpt.pt")
        if not os.path.isfile(path):
            raise ConfigError(f"no checkpoint at {path}: use --init_from=scratch (or point --out_dir at the run)")
        ckpt = load_checkpoint(path, "start over with --init_from=scratch --overwrite=True, or use another --out_dir")
        if missing := {"config", "optimizer", "iter_num", "best_val_loss"} - ckpt.keys():
            raise ConfigError(f"{path} has no {', '.join(sorted(missing))}: train.py cannot resume it; fine-tune "
                              f"from it with --init_from={path} and another --out_dir")
        for k in DEFAULTS:  # PER_RUN keys and those given now are now's; model keys are checked in model_config
            stored = ckpt["config"].get(k, config[k])  # a key newer than the checkpoint: its value now
            if k in explicit and k not in PER_RUN and k not in MODEL_KEYS and stored != config[k]:
                log(f"resume: {k} {stored!r} -> {config[k]!r} (given now)")
            if k not in explicit and k not in PER_RUN:
                config[k] = stored
        if ckpt["iter_num"] > config["max_iters"]:
            raise ConfigError(f"{path} is at step {ckpt['iter_num']}, past max_iters={config['max_iters']}: pass "
                              f"--max_iters above {ckpt['iter_num']} to train on")
    check_config(config)
    c = types.SimpleNamespace(**config)
    again = [a for a in argv if not a.startswith(("--init_from=", "--overwrite="))] + ["--init_from=resume"]
    again = ("torchrun <as before> " if ddp else "python ") + shlex.join(["train.py", *again])  # what continues

    dev = c.device if c.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={dev!r} but CUDA is not available: use --device=cpu (or auto)")
    if ddp and dev.startswith("cuda"):
        dev = f"cuda:{local_rank}"
        torch.cuda.set_device(dev)
    device = torch.device(dev)
    if ddp:  # a timeout, so that a rank waiting for a dead or hung one fails in minutes, not in half an hour
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                                timeout=timedelta(seconds=c.ddp_timeout))

    STOP.catch(rank, c.out_dir, ddp)
    try:
        history = train(c, explicit, ckpt, device, ddp, rank, world_size, again)
        if ddp:
            dist.barrier()  # rank 0 may still be evaluating and saving: leave together
        return history
    except KeyboardInterrupt:  # a Ctrl-C before the loop, or a second one
        last = saved_at(c.out_dir)
        raise Stopped("interrupted: stopped at once; " + (f"the last checkpoint is {last}; continue with: {again}"
                                                         if last else "no checkpoint saved"), signal.SIGINT) from None
    except (ConfigError, Stopped):
        raise
    except Exception:
        if ddp:  # a collective failed: if another rank died, torchrun sends SIGTERM, maybe a moment after
            for _ in range(30):  # it comes within torchrun's monitor interval (0.1 s) of the death
                if STOP.signum:
                    raise Stopped(rank_stopped(rank, c.out_dir, STOP.signum), STOP.signum) from None
                time.sleep(0.1)
        raise
    finally:
        STOP.release()
        while LOCK:
            LOCK.pop().close()  # out_dir is free for the next run (in a notebook or a test: this process)
        if ddp:
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        raise SystemExit(f"train.py: error: {e}")
    except Stopped as e:
        if e.args[0]:  # said by rank 0, or by each rank that failed
            print(f"train.py: {e.args[0]}", file=sys.stderr, flush=True)
        raise SystemExit(128 + e.args[1])  # the shell's code for death by that signal: 130 for Ctrl-C
    except KeyboardInterrupt:  # before training began
        print("train.py: interrupted before training began: nothing saved", file=sys.stderr)
        raise SystemExit(130)
