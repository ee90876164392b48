"""
Train DRT (or its sliding-window baseline) on PG19, on Linux code, or on synthetic long-context tasks.

    python train.py config/quickstart.py       # CPU or one GPU: a tiny DRT on a few books, minutes
    python train.py config/train_drt146m.py    # the paper's 146M DRT x1 on one GPU (8 accumulation steps)
    torchrun --standalone --nproc_per_node=8 train.py config/train_drt146m.py   # one node of 8 GPUs
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --master_addr=10.0.0.1 --master_port=29500 train.py \\
        config/train_drt146m.py                # two nodes: this on node 0 (it saves), --node_rank=1 on the other
    python train.py config/code_lm.py config/code_teacher.py   # Linux code: GCA first reads a teacher's chunks
    python train.py config/quickstart.py --batch_size=4 --groups=1,1           # override any key
    python train.py --out_dir=out-quickstart --init_from=resume --max_iters=600 # continue, with its stored config
    python train.py --help                     # every key, its default and why

The data must be prepared first: python prepare_pg19.py (PG19), python prepare_code.py (Linux code).
Config files, then --key=value, change the hyperparameters below and the model's (configurator.py).
Ctrl-C (or SIGTERM) is answered at once; the run stops at the next micro-batch (under torchrun, the next log
line), saves its last finished step, and prints the command that continues (a second Ctrl-C stops at once).
One run at a time per out_dir: a second is refused while the first holds out_dir/train.lock. A resumed run
takes the checkpoint's config, changed by what is given now, and repeats an uninterrupted one bit for bit,
whatever the GPU count (step_rng).
"""

import dataclasses
import math
import os
import shlex
import signal
import sys
import time
import types
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import tasks
import teacher
from common import (STOP, CheckpointError, catch_signals, fmt_time, load_checkpoint, log, out_dir_lock, peak_flops,
                    peak_mem_gib, progress, retrieval_stats, saved_at, sink_label, step_rng, stopped)
from configurator import ConfigError, check_config, configure, is_tasks, keys_of, print_help
from model import DRT, DRTConfig, cdiv

# ---- hyperparameters: the paper's 146M DRT x1 on PG19 (§4.1.2, Appendix A) ----
# I/O
out_dir = "out"  # ckpt.pt (weights, optimizer, loop state) and ckpt.json (the same without tensors) go here
eval_interval = 1000  # steps between evaluations, and so between checkpoints
log_interval = 10  # steps between log lines; each syncs the GPU once (under torchrun, a Ctrl-C stops at the next)
eval_iters = 40  # micro-batches per split per evaluation: 40 x 4 x 16380 = 2.6M tokens, a steady estimate
always_save_checkpoint = True  # save at every evaluation, not only when val improves: a long run stays resumable
overwrite = False  # True: a run from scratch or a fine-tune may replace the ckpt.pt already in out_dir
init_from = "scratch"  # 'scratch', 'resume' (out_dir/ckpt.pt, its config), or another run's ckpt.pt/folder to fine-tune
stop_iter = 0  # stop and save after this step, the schedule unchanged (a long run in pieces); 0 = max_iters
# data
dataset = "pg19"  # data/<dataset> of prepare_pg19.py or prepare_code.py ("code"), or a comma list of tasks.py's passkey, multikey, vartrack
data_dir = ""  # the prepared dataset's folder; "" = data/<dataset>
copy_frac = 0.0  # text: the share of training rows that teach copying (tasks.copy_row); evaluation never has them
teacher_iters = 0  # first steps in which GCA reads a teacher's chunks, not Eq. 1's (teacher.py); 0 = the paper
teacher_slots = 0  # of top-k: 0 = the teacher fills all; n = its n best take Eq. 1's last n slots (Eq. 1's best stay)
teacher_hops = False  # task rows: where some group has a needle label, the teacher's chunks go to those groups alone
needle_loss = 0.0  # task rows: weight of teacher.needle_loss, Eq. 1 ranking the asked needle first in the batch
train_embeddings = True  # False: a fine-tune keeps init_from's token embeddings (and so the tied output layer)
# synthetic tasks (tasks.py)
task_min_depth = 0  # no needle before this token: the first chunks, told apart by having no past, never hold one
task_haystack = ""  # a .bin of prepare_pg19.py whose text hides the needles; "" = the repeated sentences only
task_haystack_frac = 0.5  # with task_haystack: the share of prompts in real text
task_keys = "4"  # multi-key's needles per prompt: N, or A-B drawn per prompt (2-16; beyond top-k, names must match)
task_chains = "6"  # vartrack's chains per prompt: N, or A-B drawn per prompt (2-16)
task_templates = "key"  # phrasings, a comma list of tasks.TEMPLATES, one per prompt; 'code' is held out for tests
# batch
batch_size = 4  # sequences per micro-batch per GPU: the paper's 4 x 16380
block_size = 16380  # text tokens per sequence: 260 chunks of 63, the paper's 16K training length
tokens_per_step = 524160  # per optimizer step, all GPUs (the paper's 8 x 4 x 16380), by grad accumulation; 0: none
# model: DRTConfig's fields, whose defaults and whys model.py holds (--help prints them)
# optimizer: AdamW, linear warmup, then cosine decay
learning_rate = 2e-3  # peak, reached after warmup
min_lr = 4e-4  # the cosine ends here, learning_rate / 5
warmup_frac = 0.02  # warmup over this share of max_iters
max_iters = 60000  # optimizer steps: 60K x 524K tokens = 31B tokens, the paper's run
weight_decay = 1e-3  # on matrices only, not on norm gains
betas = (0.9, 0.95)  # AdamW's (beta1, beta2): the usual beta2 for GPT-style training
grad_clip = 1.0  # clip the global gradient norm to this; 0 = no clipping
# system
device = "auto"  # 'auto' = cuda if available, else cpu; or 'cpu', 'cuda', 'cuda:N' (torchrun: cuda:LOCAL_RANK)
dtype = "auto"  # 'auto' = bfloat16 autocast on CUDA, float32 on CPU; or 'bfloat16', 'float32'
compile = True  # torch.compile on CUDA (not on a CPU, where compiling costs more than it saves)
seed = 1337  # the initial weights and every random draw of training derive from it
ddp_timeout = 300  # seconds a rank waits in a collective for a dead or hung one before the job fails
# ---- end of hyperparameters ----

DEFAULTS, KINDS = keys_of(globals(), DRTConfig)
MODEL_KEYS = [f.name for f in dataclasses.fields(DRTConfig)]
PER_RUN = ("out_dir", "init_from", "overwrite", "stop_iter")  # what this command does: never restored on resume
VAL_ROWS = ("dataset", "data_dir", "block_size", "task_min_depth", "task_haystack", "task_haystack_frac", "task_keys",
            "task_chains", "task_templates")  # what the validation rows are made of


class Data:
    """The run's batches, each a function of (split, rng) alone: tasks.TextRows (a prepared text dataset, with
    copy rows mixed into training) or tasks.TaskRows. Checked before a model is built or out_dir made."""

    def __init__(self, c, device):
        try:
            self.rows = (tasks.TaskRows if is_tasks(c.dataset) else tasks.TextRows)(c)
        except (OSError, ValueError) as e:
            raise ConfigError(e) from None
        self.vocab, self.device, self.T, self.G = self.rows.vocab, device, c.chunk_size - 1, len(c.groups)
        # task rows score their answer alone, which ends the row (tasks.get_batch: the prompt takes all but MAX_ANSWER
        # tokens, up to T-1 fewer to align its question): their targets are that end, where alone logits are made
        self.span = tasks.MAX_ANSWER + self.T - 1 if is_tasks(c.dataset) else 0

    def batch(self, split, rng, training=False, needles=False):
        """x (B, T) and its targets y on the device, (B, T) or of task rows (B, span): the row's end; needles: and
        tasks.needle_labels (B, groups, T // (chunk_size - 1))."""
        x, y, hop1 = self.rows.batch(split, rng, training)
        rows = (x, y[:, -self.span :] if self.span else y) + ((tasks.needle_labels(x, y, self.T, self.G, hop1),)
                                                              if needles else ())
        assert not self.span or (y[:, : -self.span] == -1).all(), "a task row scores a token before its end"
        pin = self.device.type == "cuda"
        return tuple((t.pin_memory() if pin else t).to(self.device, non_blocking=pin) for t in rows)


def get_lr(it, c):
    """Learning rate of step it (0-based): linear warmup, then cosine from learning_rate to min_lr."""
    warmup = int(c.warmup_frac * c.max_iters)
    if it < warmup:
        return c.learning_rate * (it + 1) / warmup
    progress = (it - warmup) / max(1, c.max_iters - warmup)
    return c.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (c.learning_rate - c.min_lr)


@torch.no_grad()
def estimate_loss(model, raw_model, data, c, autocast):
    """Mean loss over eval_iters micro-batches per split (the same each time), and retrieval_stats of the first
    val micro-batch (uncompiled): all weights 0, the retriever died; max w stuck at 1/K, it is not selective."""
    out, t0 = {}, time.time()
    model.eval()  # plain top-k: no Gumbel noise
    for split in ("train", "val"):
        total = torch.zeros((), device=data.device)
        for k in range(c.eval_iters):
            x, y = data.batch(split, step_rng(c.seed, split, "eval", k))
            with autocast:
                _, loss = model(x, y)
            total += loss.float()
            progress(t0, f"eval {split}: micro-batch {k + 1}/{c.eval_iters} done")
        out[split] = total.item() / c.eval_iters
    with autocast, raw_model.recording() as record:
        if c.groups:
            raw_model(*data.batch("val", step_rng(c.seed, "val", "eval", 0)))
    model.train()
    return out, retrieval_stats(record, c.topk)


def check_run(c, given, ckpt, src, world_size, device):
    """Every setting that needs more than its own value, before a model is built (an error leaves nothing behind)
    -> (DRTConfig's fields, the checkpoint's if any, model keys given now agreeing; the data; micro-batches; tokens)."""
    per_micro = c.batch_size * c.block_size * world_size  # tokens_per_step = grad_accum micro-batches on every rank
    tokens_per_step = c.tokens_per_step or per_micro
    if tokens_per_step % per_micro:
        raise ConfigError(f"tokens_per_step={tokens_per_step:,} is not a multiple of batch_size*block_size*GPUs = "
                          f"{c.batch_size}*{c.block_size}*{world_size} = {per_micro:,}: use a multiple of it (0: none)")
    arch = {k: getattr(c, k) for k in MODEL_KEYS}
    if ckpt is not None:
        stored = {f.name: f.default for f in dataclasses.fields(DRTConfig)}  # a key newer than the checkpoint: the model before it
        stored |= {k: tuple(v) if isinstance(v, list) else v for k, v in ckpt["model_args"].items()}  # JSON: lists
        if clash := [k for k in MODEL_KEYS if k in given and arch[k] != stored[k]]:
            said = ", ".join(f"{k}={stored[k]!r}, the config asks {arch[k]!r}" for k in clash)
            drop = f"drop {' '.join(f'--{k}' for k in clash)} (from the command line or config file)"
            if c.init_from == "resume":
                raise ConfigError(f"checkpoint {src} has {said}: {drop} or start a new out_dir")
            raise ConfigError(f"init_from checkpoint {src} has {said}: a fine-tune keeps the shape of the model it "
                              f"starts from, so {drop}, or fine-tune from a run trained with that shape")
        arch = {k: stored[k] for k in MODEL_KEYS}
    try:
        model_args = dataclasses.asdict(DRTConfig(**arch))
    except ValueError as e:  # DRTConfig says what is wrong
        raise ConfigError(e) from None
    vars(c).update(model_args)  # what is built (e.g. landmark_id filled in): the checkpoint's config says so
    if c.teacher_iters and not c.groups:
        raise ConfigError("teacher_iters hands chunks to GCA, which a model without groups lacks")
    if c.teacher_hops and not (c.teacher_iters and is_tasks(c.dataset)):
        raise ConfigError("teacher_hops splits the teacher's chunks by task rows' needles: it needs --teacher_iters "
                          "and a task dataset")
    if c.needle_loss and not is_tasks(c.dataset):
        raise ConfigError(f"--needle_loss ranks the asked needle of task rows, which only the task datasets "
                          f"({', '.join(tasks.TRAINED)}) have; --dataset={c.dataset} is text")
    if c.needle_loss and (not c.groups or c.code_read):
        raise ConfigError("--needle_loss trains Eq. 1's ranking, which needs a model with groups and code_read=False")
    if not c.train_embeddings and c.init_from == "scratch":
        raise ConfigError("train_embeddings=False keeps trained embeddings: fine-tune them with --init_from=<run>")
    if not 0 <= c.teacher_slots <= c.topk:
        raise ConfigError(f"teacher_slots={c.teacher_slots} must lie in [0, topk={c.topk}]")
    model_args["groups"] = list(model_args["groups"])
    # chunk t reads the picks of landmark t-1 among the chunks before it: chunks 0 and 1 read none, the last one the most
    T, nc = c.chunk_size - 1, cdiv(c.block_size, c.chunk_size - 1)
    if c.groups and nc < 3:
        raise ConfigError(f"block_size={c.block_size} gives fewer than 3 chunks, so GCA would never run: use "
                          f"block_size >= {2 * T + 1} (best a multiple of chunk_size-1={T})")
    data = Data(c, device)
    if not data.vocab <= c.landmark_id:
        raise ConfigError(f"the data's token ids reach {data.vocab - 1}, but landmark_id={c.landmark_id} "
                          f"must lie above them: set --landmark_id={data.vocab} (and vocab_size above it)")
    if c.groups and c.topk > nc - 2:  # top-k slots that no chunk of a training row could ever fill
        raise ConfigError(f"topk={c.topk} is more than a training row can pick: block_size={c.block_size} is {nc} "
                          f"chunks of {T} tokens, and its last chunk reads {nc - 2} at most: use --topk <= {nc - 2} "
                          f"or --block_size >= {(c.topk + 1) * T + 1}")
    return model_args, data, tokens_per_step // per_micro, tokens_per_step


def build(c, model_args, ckpt, src, device, finetune):
    """The model (never compiled, never wrapped: what a checkpoint holds) and its optimizer, with the
    checkpoint's weights, and for a resume its optimizer state -> (model, optimizer, iter_num, best val loss)."""
    torch.manual_seed(c.seed)  # the same initial weights on every rank
    model = DRT(DRTConfig(**model_args)).to(device)
    model.wte.weight.requires_grad_(c.train_embeddings)  # tied: the output layer stays too
    optimizer = model.configure_optimizers(c.weight_decay, c.learning_rate, c.betas, device.type)
    if not ckpt:
        return model, optimizer, 0, float("inf")
    model.load_state_dict(ckpt["model"])
    if finetune:  # only the weights: its own optimizer, schedule and best loss
        return model, optimizer, 0, float("inf")
    now = [{k: g[k] for k in ("betas", "weight_decay")} for g in optimizer.param_groups]
    optimizer.load_state_dict(ckpt["optimizer"])  # which brings back the saved betas and decay too
    for group, values in zip(optimizer.param_groups, now):
        group.update(values)  # this run's (what resume printed, and the next checkpoint records)
    return model, optimizer, ckpt["iter_num"], ckpt["best_val_loss"]


def save(r, val_loss):
    """The run r as it stands, into out_dir (common.save_checkpoint) -> its step."""
    state = {"model_args": r.model_args, "config": vars(r.c), "iter_num": r.iter_num, "best_val_loss": r.best_val_loss}
    extra = {"val_loss": val_loss, "tokens_seen": r.iter_num * r.tokens_per_step}
    log(f"saved {common.save_checkpoint(r.c.out_dir, r.raw_model, r.optimizer, state, extra)} at step {r.iter_num}")
    return r.iter_num


def train_step(r):
    """Optimizer step r.iter_num + 1 over grad_accum micro-batches -> (its mean loss, left on the device: no host sync,
    or None if a signal dropped it; its learning rate)."""
    c, model, optimizer, iter_num, grad_accum = r.c, r.model, r.optimizer, r.iter_num, r.grad_accum
    lr = get_lr(iter_num, c)
    for group in optimizer.param_groups:
        group["lr"] = lr
    t_step, step_loss = time.time(), 0
    for micro in range(grad_accum):
        if micro and STOP["signum"] and not r.ddp:  # one process stops now, not grad_accum micro-batches later: the
            optimizer.zero_grad(set_to_none=True)  # step is dropped, the last whole one saved (exact to resume). Under
            return None, lr  # DDP the ranks' all-reduce pairs their steps: they stop together, at a log line
        if micro:
            progress(t_step, f"step {iter_num + 1}: micro-batch {micro}/{grad_accum} done")
        g = r.rank * grad_accum + micro  # global micro-batch index: the same batches whatever the GPU count
        x, y, *labels = r.data.batch("train", step_rng(c.seed, "train", iter_num, g), True,
                                     c.needle_loss > 0 or c.teacher_hops)
        torch.manual_seed(step_rng(c.seed, "gumbel", iter_num, g).getrandbits(63))  # the model's noise
        picks = teacher.teacher_picks(x, r.raw_model.config, c.teacher_slots) if iter_num < c.teacher_iters else None
        if picks is not None and c.teacher_hops:  # (B, n, K) -> (B, G, n, K)
            picks = teacher.per_hop(picks, labels[0])
        with model.no_sync() if r.ddp and micro < grad_accum - 1 else nullcontext():  # all-reduce once per step
            with r.autocast, r.raw_model.recording() if c.needle_loss else nullcontext() as record:  # Eq. 1's queries
                _, loss = model(x, y, picks=picks)
                total = loss + c.needle_loss * teacher.needle_loss(record, labels[0]) if c.needle_loss else loss
            (total / grad_accum).backward()
        step_loss = step_loss + loss.detach().float() / grad_accum
    if c.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, lr


def setup(c, given, ckpt, src, device, ddp, rank, world_size):
    """The run main set up, from checkpoint ckpt (or None): its model (raw_model; eval_model compiled; model under
    DDP), optimizer, data and loop state, as one namespace; says what it is in the first log line."""
    cuda, finetune = device.type == "cuda", c.init_from not in ("scratch", "resume")
    dtype = c.dtype if c.dtype != "auto" else "bfloat16" if cuda else "float32"
    if cuda:
        torch.set_float32_matmul_precision("high")  # TF32 for what stays in fp32 on the GPU
    model_args, data, grad_accum, tokens_per_step = check_run(c, given, ckpt, src, world_size, device)
    raw_model, optimizer, iter_num, best_val_loss = build(c, model_args, ckpt, src, device, finetune)
    if ckpt:
        ckpt.clear()  # free it (main holds it too)
    eval_model = torch.compile(raw_model) if c.compile and cuda else raw_model  # rank 0 evaluates alone: no DDP
    logit_share = min(1.0, data.span / c.block_size) if data.span else 1.0  # task rows make logits at the answer alone
    r = types.SimpleNamespace(
        c=c, raw_model=raw_model, eval_model=eval_model, optimizer=optimizer, data=data, device=device, ddp=ddp,
        model=DDP(eval_model, device_ids=[device.index] if cuda else None) if ddp else eval_model, rank=rank,
        world_size=world_size, grad_accum=grad_accum, tokens_per_step=tokens_per_step, model_args=model_args,
        autocast=torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext(),
        flops_per_token=common.flops_per_token(raw_model, logit_share), peak=peak_flops(device),  # matmuls, fwd + bwd
        iter_num=iter_num, best_val_loss=best_val_loss, start=iter_num, last=c.stop_iter or c.max_iters, history=[],
        resumed=c.init_from == "resume", loss_sum=torch.zeros((), device=device), t_last=time.time(), it_last=iter_num)
    r.evaluated = r.start if r.resumed else -1  # the step last evaluated: a resume's first was, just before its save
    r.saved = r.start  # the step of the checkpoint this run last wrote, or started from: nothing to save before a step
    what = f"DRT groups={model_args['groups']}" if c.groups else "sliding-window baseline"
    how = f"resuming at step {iter_num}" if iter_num else f"fine-tuning {c.init_from}" if finetune else "from scratch"
    if c.teacher_iters:
        what += f" (GCA reads teacher_picks for steps 1-{c.teacher_iters}; evaluation uses Eq. 1)"
    log(f"{what}, {raw_model.num_params() / 1e6:.2f}M parameters, {r.flops_per_token / 1e9:.2f} GFLOP/token | "
        f"{c.batch_size} seq x {c.block_size:,} tok x {world_size} rank(s) x {grad_accum} accum = "
        f"{tokens_per_step:,} tok/step | {device} {dtype} | {c.dataset} | {how}")
    return r


def evaluate(r):
    """Rank 0's evaluation: the losses and retrieval's health in a log line, then the checkpoint where it is due."""
    c, t_eval, r.evaluated = r.c, time.time(), r.iter_num
    losses, ret = estimate_loss(r.eval_model, r.raw_model, r.data, c, r.autocast)
    ppl = {k: math.exp(min(v, 700)) for k, v in losses.items()}  # a diverged run is reported, not a crash
    each = ret.get("sink_reads", [])  # per upper layer: a group whose GCA learned to read nothing shows here
    log(f"eval iter {r.iter_num}: train loss {losses['train']:.4f} (ppl {ppl['train']:.2f}), "
        f"val loss {losses['val']:.4f} (ppl {ppl['val']:.2f})"
        + (f" | retrieval: sum w {ret['sum_w']:.3f}, max w {ret['max_w']:.3f}" if ret else "")
        + (f", {sink_label(r.raw_model.config)} {ret['sink']:.2f}" if "sink" in ret else "")
        + (f" ({' '.join(f'{s:.2f}' for s in each)} by upper layer)" if len(each) > 1 else ""))
    improved, r.best_val_loss = losses["val"] < r.best_val_loss, min(r.best_val_loss, losses["val"])
    if r.iter_num > r.start and (improved or c.always_save_checkpoint or r.iter_num == r.last):
        r.saved = save(r, losses["val"])  # the last step too: out_dir must end up holding this run
    r.t_last += time.time() - t_eval  # evaluation and saving are not training time


def stop_here(r, stop, again):
    """A signal stops every rank at this step boundary, where the model is whole: saved, then how to go on (again)."""
    r.saved = save(r, None) if r.rank == 0 and r.iter_num > r.saved else r.saved
    if r.ddp:
        dist.barrier()  # rank 0's save is done before any rank leaves (torchrun would kill it)
    said = "interrupted" if stop == signal.SIGINT else f"stopped by {signal.Signals(stop).name}"
    said += (f": saved {os.path.join(r.c.out_dir, 'ckpt.pt')} at step {r.iter_num}; continue with: {again}"
             if r.iter_num > r.start or r.resumed else " before the first step: nothing saved")
    stopped(said if r.rank == 0 else "", stop)


def log_steps(r, lr):
    """The log line of the steps since the last -> under DDP the signal any rank was sent (all stop on it), else 0."""
    c, stop = r.c, 0
    if r.ddp:  # the losses of all ranks, and the signal any rank was sent
        sent = torch.tensor(float(STOP["signum"]), device=r.device)
        dist.all_reduce(r.loss_sum)  # SUM (gloo has no AVG)
        dist.all_reduce(sent, op=dist.ReduceOp.MAX)  # SIGTERM (15) before SIGINT (2)
        stop = int(sent.item())
    mean_loss = r.loss_sum.item() / r.world_size / (r.iter_num - r.it_last)
    dt = (time.time() - r.t_last) / (r.iter_num - r.it_last)
    tok_s = r.tokens_per_step / dt
    mfu = f"{100 * r.flops_per_token * tok_s / (r.peak * r.world_size):.1f}%" if r.peak else "n/a"
    log(f"iter {r.iter_num}/{c.max_iters} | loss {mean_loss:.4f} | lr {lr:.2e} | "
        f"{1000 * dt:.1f} ms/iter | {tok_s:,.0f} tok/s | mfu {mfu} | peak mem {peak_mem_gib(r.device):.1f} GiB | "
        f"eta {fmt_time(dt * (r.last - r.iter_num))}")
    r.history.append((r.iter_num, mean_loss))
    r.loss_sum.zero_()
    r.t_last, r.it_last = time.time(), r.iter_num
    return stop


def train(c, given, ckpt, src, device, ddp, rank, world_size, again):
    """The run main set up, from checkpoint ckpt (or None); again is the command that continues it -> the logged
    [(iter, loss)]. r.iter_num counts the optimizer steps done: all a checkpoint must hold for an exact resume."""
    r, stop = setup(c, given, ckpt, src, device, ddp, rank, world_size), 0  # stop: the signal that stops every rank
    r.model.train()
    while True:
        catch_signals()  # Ctrl-C and SIGTERM only take note (common.on_signal): the run stops below, between steps
        if rank == 0 and (r.iter_num % c.eval_interval == 0 or r.iter_num == r.last) and r.iter_num != r.evaluated:
            evaluate(r)
        if r.iter_num >= r.last:
            break
        if not ddp:  # one process: at every step boundary; under DDP all ranks agree at the log line below
            stop = STOP["signum"]
        if stop:
            stop_here(r, stop, again)
        step_loss, lr = train_step(r)
        if step_loss is None:
            continue  # dropped by a signal: back at the step boundary, which saves and stops
        r.loss_sum += step_loss
        r.iter_num += 1
        if r.iter_num % c.log_interval == 0 or r.iter_num == r.last:
            stop = log_steps(r, lr)  # under DDP the signal all ranks now stop on; alone, the next boundary's is read
    log(f"done: step {r.iter_num}/{c.max_iters}, best val loss {r.best_val_loss:.4f}")
    if ddp:
        dist.barrier()  # rank 0 may still be evaluating and saving: leave together
    return r.history


def main(argv=None):
    """Train with the hyperparameters above as changed by argv (default sys.argv[1:]) -> the logged [(iter, loss)]."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print_help(__doc__, __file__, DRTConfig)
        return []
    config, given = configure(argv, DEFAULTS, KINDS)
    # rank 0 holds out_dir's lock from here to the end: a second run into it is refused at once, and what start finds
    # there (a checkpoint to resume or not to overwrite) stays this run's until it saves
    with out_dir_lock(config["out_dir"]) if int(os.environ.get("RANK", 0)) == 0 else nullcontext():
        ckpt, src = starting_point(config, given)
        check_config(config)
        c = types.SimpleNamespace(**config)
        ddp, rank, world_size, device = common.init_ddp(c.device, c.ddp_timeout)
        again = [a for a in argv if not a.startswith(("--init_from=", "--overwrite="))] + ["--init_from=resume"]
        again = ("torchrun <as before> " if ddp else "python ") + shlex.join(["train.py", *again])  # what continues
        since = 0.0 if c.init_from == "resume" else time.time()  # this run's checkpoints: written after it began
        with common.stopping(c.out_dir, since, again, rank, ddp):
            return train(c, given, ckpt, src, device, ddp, rank, world_size, again)


def starting_point(config, given):
    """Where the run starts -> (the checkpoint or None, its path): resuming takes the checkpoint's values of the keys
    not given now (PER_RUN keys excepted); a fine-tune, init_from's weights; a run from scratch, nothing, and out_dir
    must hold no checkpoint unless overwrite."""
    ckpt, src = None, os.path.join(config["out_dir"], "ckpt.pt")
    if config["init_from"] == "resume":
        if not os.path.isfile(src):
            raise ConfigError(f"no checkpoint at {src}: use --init_from=scratch (or point --out_dir at the run)")
        ckpt = load_checkpoint(src, "start over with --init_from=scratch --overwrite=True, or use another --out_dir")
        if not {"optimizer", "config", "iter_num", "best_val_loss"} <= ckpt.keys():
            raise CheckpointError(f"{src} holds weights alone (no optimizer state) and cannot be resumed: "
                                  f"fine-tune from it with --init_from=<its folder> and a new --out_dir")
        for k in (k for k in DEFAULTS if k not in PER_RUN):
            stored = ckpt["config"].get(k, config[k])  # a key newer than the checkpoint: its value now
            if k not in given:
                config[k] = stored
            elif k not in MODEL_KEYS and stored != config[k]:  # model keys: train checks them against model_args
                log(f"resume: {k} {stored!r} -> {config[k]!r} (given now)")
        if changed := [k for k in VAL_ROWS if ckpt["config"].get(k, config[k]) != config[k]]:
            # reset, not refused: training on other data may go on with the same optimizer and schedule, but a loss on
            # other validation rows is no bar for this run's (a lower one would block every save)
            log(f"resume: {', '.join(changed)} changed, so the best val loss starts afresh (the checkpoint's "
                f"{ckpt['best_val_loss']:.4f} was on other validation rows)")
            ckpt["best_val_loss"] = float("inf")
        if ckpt["iter_num"] > config["max_iters"]:
            raise ConfigError(f"{src} is at step {ckpt['iter_num']}, past max_iters={config['max_iters']}: pass "
                              f"--max_iters above {ckpt['iter_num']} to train on")
    elif os.path.exists(src) and not config["overwrite"]:
        raise ConfigError(f"{saved_at(config['out_dir']) or src} exists: continue that run with --init_from=resume, "
                          f"replace it with --overwrite=True, or use another --out_dir")
    elif config["init_from"] != "scratch":  # fine-tuning another run's weights: its ckpt.pt or its out_dir
        src = os.path.join(src, "ckpt.pt") if os.path.isdir(src := config["init_from"]) else src
        if not os.path.isfile(src):
            raise ConfigError(f"init_from={config['init_from']!r}: no checkpoint there (want 'scratch', 'resume', or "
                              f"the path of a train.py ckpt.pt or its out_dir)")
        ckpt = load_checkpoint(src, "point --init_from at a train.py ckpt.pt or its out_dir")
    return ckpt, src


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, CheckpointError) as e:
        raise SystemExit(f"train.py: error: {e}")
