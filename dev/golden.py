"""
The golden check of a refactor: what small DRTs compute, saved before a change and compared bit for bit after it.
On the CPU, 2 threads, deterministic algorithms, fixed seeds, in a fixed order:

  a  the paper's form (groups (1,1) and (2,)): a row's logits, its training loss and every parameter's gradient,
     retrieval's record and statistics
  b  the code recipe's form (config/code_teacher.py's switches) with the teacher's picks: the same
  c  the passkey tasks: a batch of passkey, multi-key and 2-hop rows (tasks.get_batch), their needle labels, per-group
     teacher picks (per_hop), the answer's loss and the needle ranking loss, each with its gradients; a 2-hop
     test prompt answered through a stream (sample.answer_prompt) and its per-hop hits
  d  streams: a row fed in segments and token by token, a skimmed prefill and a greedy continuation; the logits
  e  checkpoints: two train.py runs of 2 steps (text with the code form and a teacher; tasks with teacher_hops and
     the needle loss) saved with the code of --save; --check loads those files and compares what they compute, and
     trains again and compares the weights and optimizer state

    python dev/golden.py --save /tmp/golden.pt      # before the change: the values, and the checkpoints of e beside
    python dev/golden.py --check /tmp/golden.pt     # after it: recomputes, prints each difference, exit 1 if any
    python dev/golden.py --save /tmp/g.pt --parts=a,d   # some parts only (--check then takes the same --parts)

Part c needs GPT-2's tokenizer (DRT_GPT2_RANKS). The code before and after a change may call the model differently:
the functions under "The model's API" say how, for either version, and are all that should need editing.
"""

import argparse
import inspect
import os
import random
import shutil
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import common  # noqa: E402
import model as drt  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402
from model import DRT, DRTConfig  # noqa: E402

# -----------------------------------------------------------------------------
# The model's API, before the narrow forward (OLD: forward(..., return_logits, picks, record, needles, loss_span))
# and after it

OLD = "return_logits" in inspect.signature(DRT.forward).parameters
SWITCHES = [dict(gca_sink=True, center_memory=False, read_next=False, pool_tokens=False),  # the paper's read path,
            dict(gca_sink=False, center_memory=True, read_next=True, pool_tokens=True)]  # config/code_teacher.py's


def config(code=False, **kw):
    """A DRTConfig of the paper's read path, or (code) of config/code_teacher.py's."""
    return DRTConfig(**kw, **(SWITCHES[code] if OLD else dict(code_read=code)))


def code_args(code):
    """train.py's arguments for that read path."""
    return [f"--{k}={v}" for k, v in (SWITCHES[code] if OLD else dict(code_read=code)).items()]


def row_logits(model, idx, picks=None, **kw):
    """Logits (B, T, vocab) at every position of a whole row."""
    return model(idx, torch.zeros_like(idx), picks=picks, **kw)[0] if OLD else model(idx, picks=picks, **kw)[0]


def row_loss(model, idx, targets, picks=None):
    """The training loss of a whole row, as train.py computes it (never the full logits)."""
    return model(idx, targets, return_logits=False, picks=picks)[1] if OLD else model(idx, targets, picks=picks)[1]


def stream_logits(model, idx, state, **kw):
    """A stream's next segment -> its logits at every position (scored: targets)."""
    return model(idx, torch.zeros_like(idx), state=state, **kw)[0]


def recorded(model, call):
    """call(kw), kw the forward's keyword arguments that make it record (none: DRT.recording()) -> (what call
    returned, the record)."""
    if OLD:
        record = []
        return call({"record": record}), record
    with model.recording() as record:
        return call({}), record


def task_losses(model, x, y, picks, labels):
    """train.py's task step: the answer's loss (before: loss_span from each row's first target; now the targets of
    the row's end, train.Data's span) and the needle ranking loss."""
    if OLD:
        _, loss, ranking = model(x, y, return_logits=False, picks=picks, needles=labels, loss_span=tasks.MAX_ANSWER)
        return loss, ranking
    span = tasks.MAX_ANSWER + model.config.chunk_size - 2
    with model.recording() as record:
        _, loss = model(x, y[:, -span:], picks=picks)
    return loss, teaching("needle_loss")(record, labels)


def teaching(name):
    """teacher_picks, per_hop or needle_loss, wherever this version keeps it: teacher.py, or before it train.py."""
    try:
        import teacher
    except ImportError:
        return getattr(train, name)
    return getattr(teacher, name)


def teacher_picks(idx, cfg, slots=0):
    return teaching("teacher_picks")(idx, cfg, slots)


def per_hop(picks, labels):
    return teaching("per_hop")(picks, labels)


def helper(name):
    """A function of the scripts (prefill, generate, answer_prompt, read_checkpoint, build_model), wherever this
    version keeps it: sample.py or common.py."""
    import sample
    return getattr(sample, name, None) or getattr(common, name)


# -----------------------------------------------------------------------------
# The values

TINY = dict(vocab_size=96, landmark_id=95, n_embd=32, n_head=4, n_lower=1, n_enc=1, chunk_size=8, window=16, topk=3)
GPT2 = dict(TINY, vocab_size=50304, landmark_id=None)  # task rows: GPT-2's ids


def ids(cfg, B, T, seed):
    return torch.randint(0, cfg.landmark_id, (B, T), generator=torch.Generator().manual_seed(seed))


def build(cfg, seed=0):
    torch.manual_seed(seed)
    return DRT(cfg)


def grads(model, loss, name, out):
    """Every parameter's gradient of loss into out, by name (None: the parameter took no part)."""
    params = dict(model.named_parameters())
    for (n, _), g in zip(params.items(), torch.autograd.grad(loss, list(params.values()), allow_unused=True,
                                                             retain_graph=True)):
        out[f"{name}.grad.{n}"] = torch.zeros(0) if g is None else g


def record_values(record, K, name, out):
    """The record's picks (chunk ids, idx, w) and retrieval_stats; numbered without the Eq. 1 queries ("eq1") that
    DRT.recording() adds for training, which the record before it did not hold."""
    for i, (kind, *r) in enumerate(r for r in record if r[0] != "eq1"):
        if kind == "picks":
            for part, t in zip(("chunks", "idx", "w"), r):
                out[f"{name}.record{i}.{part}"] = t
    stats = common.retrieval_stats(record, K)
    for k in sorted(stats):
        out[f"{name}.stats.{k}"] = torch.tensor(stats[k], dtype=torch.float64)


def form(out, name, cfg, picks_of=None):
    """A row's logits (eval), its record and statistics, and its training loss with every gradient: a + b."""
    model = build(cfg)
    idx = ids(cfg, 2, 12 * (cfg.chunk_size - 1) + 3, seed=1)
    targets = torch.roll(idx, -1, 1)
    targets[:, ::5] = -1
    picks = picks_of(idx, model.config) if picks_of else None
    if picks is not None:
        out[f"{name}.picks"] = picks
    model.eval()
    with torch.no_grad():
        out[f"{name}.logits"], record = recorded(model, lambda kw: row_logits(model, idx, picks, **kw))
        record_values(record, cfg.topk, f"{name}.eval", out)
        out[f"{name}.eval_loss"] = row_loss(model, idx, targets, picks)
    model.train()
    torch.manual_seed(2)  # the Gumbel noise
    loss = row_loss(model, idx, targets, picks)
    out[f"{name}.loss"] = loss.detach()
    grads(model, loss, name, out)


def part_a(out):
    for groups in ((1, 1), (2,)):
        form(out, f"a{len(groups)}", config(groups=groups, **TINY))


def part_b(out):
    cfg = config(code=True, groups=(1, 1), softmax_off_by_one=False, gumbel=False, **TINY)
    form(out, "b", cfg, lambda idx, c: teacher_picks(idx, c))
    form(out, "b_slots", cfg, lambda idx, c: teacher_picks(idx, c, slots=1))
    form(out, "b_eq1", cfg)


def part_c(out):
    enc = common.get_tokenizer()
    cfg = config(groups=(1, 1), **GPT2)
    T = cfg.chunk_size - 1
    x, y, hop1 = tasks.get_batch(["passkey", "multikey", "vartrack"], 6, 700, random.Random(0), enc, align=T,
                                 keys=(2, 4), chains=(2, 2), spacing=tasks.hop_spacing(cfg, test=False))
    labels = tasks.needle_labels(x, y, T, len(cfg.groups), hop1)  # (B, G, n)
    picks = per_hop(teacher_picks(x, cfg, slots=1), labels)  # (B, G, n, K)
    out.update({"c.x": x, "c.y": y, "c.hop1": hop1, "c.labels": labels, "c.picks": picks})
    model = build(cfg).train()
    torch.manual_seed(3)
    loss, ranking = task_losses(model, x, y, picks, labels)
    out["c.loss"], out["c.ranking"] = loss.detach(), ranking.detach()
    grads(model, loss, "c.loss", out)
    grads(model, ranking, "c.ranking", out)
    # a 2-hop test prompt through a stream: the answer, the picks at each hop's landmark, the per-hop hits
    model.eval()
    prompt, answer, spans = tasks.make_example("vartrack", 900, random.Random(1), enc, align=T, chains=2,
                                               spacing=tasks.hop_spacing(cfg))
    with torch.no_grad():
        got, picks = helper("answer_prompt")(model, prompt, len(answer) + 2, model.new_state(), 64, None,
                                     [asked for *_, asked in spans])
    out["c.answer"] = torch.tensor(got)
    for at, groups in picks.items():
        for g, (idx, w) in enumerate(groups):
            out[f"c.hop_picks.{at}.{g}.idx"], out[f"c.hop_picks.{at}.{g}.w"] = idx, w
    out["c.hop_hits"] = torch.tensor([-1 if h is None else int(h) for h in tasks.hop_hits(spans, picks, T)])


def part_d(out):
    for name, cfg in (("d", config(groups=(1, 1), **TINY)),
                      ("d_code", config(code=True, groups=(1, 1), softmax_off_by_one=False, gumbel=False, **TINY))):
        model = build(cfg).eval()
        idx = ids(cfg, 1, 150, seed=12)
        with torch.no_grad():
            out[f"{name}.row"] = row_logits(model, idx)
            state, cuts = model.new_state(), [0, 5, 6, 27, 40, 41, 90, 150]
            parts, record = recorded(model, lambda kw: [stream_logits(model, idx[:, a:b], state, **kw)
                                                        for a, b in zip(cuts, cuts[1:])])
            out[f"{name}.segments"] = torch.cat(parts, 1)
            record_values(common.compact(record), cfg.topk, f"{name}.stream", out)
            state = model.new_state()
            out[f"{name}.tokens"] = torch.cat([model(idx[:, t : t + 1], state=state)[0] for t in range(80)], 1)
            state, rec = model.new_state(), []
            helper("prefill")(model, idx[0].tolist(), state, 17, skim=drt.skim_margin(cfg), record=rec)
            record_values(rec, cfg.topk, f"{name}.prefill", out)
            out[f"{name}.generated"] = helper("generate")(model, idx[:, -1:], 12, temperature=0, state=state)
            out[f"{name}.sampled"] = helper("generate")(model, idx[:, :40], 8, temperature=0.8, top_k=20,
                                                state=(torch.manual_seed(5), model.new_state())[1], prefill_segment=9)


def tiny_data(folder):
    """train.bin / val.bin of random ids (16 of them) and their meta.json, as the tests' tiny_dataset."""
    import json
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in [("train", 5000), ("val", 1000)]:
        rng.integers(95 - 16, 95, n, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"tokenizer": "random", "vocab_size": 95, "splits": {}}, f)
    return folder


RUN = ["--n_embd=32", "--n_head=4", "--n_lower=1", "--n_enc=1", "--chunk_size=8", "--window=16", "--topk=3",
       "--tokens_per_step=0", "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--log_interval=1",
       "--device=cpu", "--compile=False"]


def runs(tmp):
    """The two train.py runs of part e: {name: arguments}."""
    text = RUN + code_args(True) + ["--vocab_size=96", "--landmark_id=95", "--groups=1,1", "--block_size=63",
                                    "--batch_size=2", "--learning_rate=1e-2", "--softmax_off_by_one=False",
                                    "--gumbel=False", "--teacher_iters=2", f"--data_dir={tiny_data(tmp + '/data')}"]
    task = RUN + code_args(False) + ["--dataset=passkey,vartrack", "--task_chains=2", "--groups=1,1",
                                     "--block_size=700", "--batch_size=2", "--teacher_iters=2", "--teacher_slots=1",
                                     "--teacher_hops=True", "--needle_loss=0.5", "--seed=7"]
    return {"text": text, "task": task}


def checkpoint_values(path, name, out):
    """What a checkpoint computes, loaded the way sample.py loads it: a row's logits and a greedy continuation."""
    ckpt, cfg = helper("read_checkpoint")(path)
    model = helper("build_model")(ckpt, "cpu")
    idx = ids(cfg, 2, 60, seed=4) % min(cfg.landmark_id, 95)
    with torch.no_grad():
        out[f"{name}.logits"] = row_logits(model, idx)
        out[f"{name}.generated"] = helper("generate")(model, idx, 10, temperature=0, prefill_segment=13)


def part_e(out, file, save):
    tmp = tempfile.mkdtemp()
    try:
        for name, args in runs(tmp).items():
            kept = f"{file}.{name}.ckpt.pt"  # the checkpoint of --save's code, kept beside the file
            train.main(args + [f"--out_dir={tmp}/{name}"])
            made = torch.load(f"{tmp}/{name}/ckpt.pt", map_location="cpu", weights_only=True)
            if save:
                shutil.copy(f"{tmp}/{name}/ckpt.pt", kept)
            for k, t in made["model"].items():
                out[f"e.{name}.trained.{k}"] = t
            for i, state in made["optimizer"]["state"].items():
                for k, t in state.items():
                    out[f"e.{name}.adam.{i}.{k}"] = t
            checkpoint_values(kept, f"e.{name}.loaded", out)
    finally:
        shutil.rmtree(tmp)


# -----------------------------------------------------------------------------
# Saving and checking

PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}


def compute(parts, file, save):
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    out = {}
    for p in parts:
        print(f"part {p} ...", flush=True)
        part_e(out, file, save) if p == "e" else PARTS[p](out)
    return {k: (v.detach().clone() if torch.is_tensor(v) else torch.as_tensor(v)) for k, v in out.items()}


def differences(want, got):
    """Each value that is not bit for bit the same, in words."""
    said = [f"{k}: missing now" for k in want if k not in got] + [f"{k}: new" for k in got if k not in want]
    for k in (k for k in want if k in got):
        a, b = want[k], got[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            said.append(f"{k}: {tuple(a.shape)} {a.dtype} before, {tuple(b.shape)} {b.dtype} now")
        elif not torch.equal(a, b):
            d = (a.double() - b.double()).abs()
            ne = (a != b).sum().item()
            said.append(f"{k}: {ne} of {a.numel()} differ, max |diff| {d.max().item():.3g} "
                        f"(max |value| {a.double().abs().max().item():.3g})")
    return said


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    do = p.add_mutually_exclusive_group(required=True)
    do.add_argument("--save", metavar="FILE", help="compute and write the values to FILE (checkpoints beside it)")
    do.add_argument("--check", metavar="FILE", help="compute and compare with FILE, bit for bit")
    p.add_argument("--parts", default="a,b,c,d,e", help="which parts: a paper, b code, c passkey, d stream, e checkpoint")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if bad := [x for x in parts if x not in "abcde" or len(x) != 1]:
        p.error(f"--parts: unknown part(s) {', '.join(bad)}: give a comma list of a, b, c, d, e")
    file = os.path.abspath(args.save or args.check)
    got = compute(parts, file, save=bool(args.save))
    if args.save:
        torch.save(got, file)
        print(f"saved {len(got)} values to {file}")
        return 0
    want = torch.load(file, weights_only=True)
    want = {k: v for k, v in want.items() if k[0] in parts}  # each value's name begins with its part's letter
    said = differences(want, got)
    print("\n".join(said) if said else f"all {len(want)} values bit for bit the same")
    return 1 if said else 0


if __name__ == "__main__":
    sys.exit(main())
