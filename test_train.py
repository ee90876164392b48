"""
Tests of training (train.py, configurator.py): the config block and its errors, resume and
fine-tuning, copy rows and synthetic-task rows, the teacher, DDP on the CPU (gloo), Ctrl-C and
dying ranks.
"""

import glob
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import common
import teacher
import train
from conftest import (
    HERE,
    TINY,
    end_run,
    load_ckpt,
    parse,
    read_until,
    start_run,
    tiny_args,
    tiny_checkpoint,
    tiny_dataset,
    tokenizer_or_skip,
)
from model import (
    DRT,
    DRTConfig,
)


def test_copy_rows(tmp_path):
    """copy_frac: that share of training rows become a random span repeated to the end (past the
    first pass every target is the token one span back), near (24-100 tokens) or past the windows'
    reach (only retrieval can copy those); the other rows are the ones copy_frac=0 draws, and
    evaluation batches stay text."""
    import random
    import types
    config, _ = parse(tiny_args(tmp_path, "run", "--block_size=300", "--batch_size=32", "--window=64"))
    reach = (config["n_lower"] + sum(config["groups"])) * config["window"]  # 2 layers x 64 positions: far > 100
    text = train.Data(types.SimpleNamespace(**config), torch.device("cpu"))
    copy = train.Data(types.SimpleNamespace(**{**config, "copy_frac": 0.5}), torch.device("cpu"))
    x0, _ = text.batch("train", random.Random(1), training=True)
    x, y = copy.batch("train", random.Random(1), training=True)
    period = [next((L for L in range(1, 200) if torch.equal(x[b, L:], x[b, :-L])), 0) for b in range(32)]
    near, far = [L for L in period if 24 <= L <= 100], [L for L in period if reach < L < 300 - 100]
    assert len(near) + len(far) == sum(L > 0 for L in period) and 8 <= len(near) + len(far) <= 24
    assert len(near) >= 3 and len(far) >= 3
    assert all(L > 0 or torch.equal(x[b], x0[b]) for b, L in enumerate(period))
    assert x.max() < copy.vocab and torch.equal(x[:, 1:], y[:, :-1])
    for split in ("train", "val"):  # evaluation never copies
        assert torch.equal(copy.batch(split, random.Random(2))[0], text.batch(split, random.Random(2))[0])


def test_config_block_and_help(capsys):
    """--help prints the hyperparameter block, every key with a why-comment, and DRTConfig's fields as
    model.py writes them (their one home: train.py does not repeat them); the shipped config files
    parse and check."""
    import inspect
    assert set(train.MODEL_KEYS) <= set(train.DEFAULTS)
    assert DRTConfig(**{k: train.DEFAULTS[k] for k in train.MODEL_KEYS}) == DRTConfig()
    assert train.main(["--help"]) == []
    out = capsys.readouterr().out
    for key in train.DEFAULTS:
        if key in train.MODEL_KEYS:
            assert re.search(rf"^    {key}: \w+ = .+  # \S", out, re.M), key
            assert not re.search(rf"^{key} = ", Path(train.__file__).read_text(), re.M), key
        else:
            assert re.search(rf"^{key} = .+  # \S", out, re.M), key
    assert inspect.getsource(DRTConfig).split("\n    def ")[0].rstrip() in out
    configs = sorted(glob.glob(os.path.join(HERE, "config", "*.py")))
    assert len(configs) >= 4
    for path in configs:
        c, explicit = parse([path])
        train.check_config(c)
        DRTConfig(**{k: c[k] for k in train.MODEL_KEYS})
        assert explicit


def test_config_files_layer():
    """Config files run in order: config/code_teacher.py changes config/code_lm.py's run into the README's
    teacher run, and the two together are a valid run."""
    c, explicit = parse([os.path.join(HERE, "config", f) for f in ("code_lm.py", "code_teacher.py")])
    train.check_config(c)
    cfg = DRTConfig(**{k: c[k] for k in train.MODEL_KEYS})
    assert (c["block_size"], cfg.n_embd, cfg.topk) == (8190, 384, 4)  # code_lm's shape stays
    assert 0 < c["teacher_iters"] < c["max_iters"] and cfg.code_read and not cfg.softmax_off_by_one
    assert {"teacher_iters", "code_read", "block_size", "learning_rate"} <= explicit
    assert c["learning_rate"] < parse([os.path.join(HERE, "config", "code_lm.py")])[0]["learning_rate"]


def test_overrides():
    c, explicit = parse(["--groups=3,3", "--learning_rate=1", "--out_dir=out-x", "--dataset=passkey",
                                      "--compile=True", "--groups=()"])
    assert c["groups"] == () and c["learning_rate"] == 1.0 and type(c["learning_rate"]) is float
    assert c["out_dir"] == "out-x" and c["dataset"] == "passkey" and c["compile"] is True
    assert explicit == {"groups", "learning_rate", "out_dir", "dataset", "compile"}


@pytest.mark.parametrize("argv, message", [
    (["--lerning_rate=1e-3"], r"unknown key 'lerning_rate' \(did you mean learning_rate\?\)"),
    (["--max_iters=1.5"], r"max_iters must be of type int like its default 60000, got 1.5"),
    (["--groups=3"], r"groups must be of type tuple"),
    (["--compile=1"], r"compile must be of type bool"),
    (["--batch_size"], r"write overrides as --key=value"),
    (["--block_size=0"], r"block_size=0 must be a positive int"),
    (["config/nothing.py"], r"config file config/nothing.py not found"),
    (["--dataset=passkey", "--copy_frac=0.5"], r"copy_frac mixes rows into a text dataset; --dataset=passkey"),
    (["--device=tpu"], r"^device='tpu' must be 'auto', 'cpu', 'cuda' or 'cuda:N'$"),
    (["--dataset=passkey,nope"], r"^dataset='passkey,nope': a comma list is of synthetic tasks, each one of passkey, "),
    (["--learning_rate=-1"], r"^learning_rate=-1.0 must be >= 0$"),
    (["--max_iters=-5"], r"^max_iters=-5 must be a positive int$"),  # the one wrong value, not stop_iter's range too
    (["--betas=0.9,", "--data_dir=nowhere"], r"^betas=\(0.9,\) must be two numbers in \[0, 1\)$"),
    (["--weight_decay=-1", "--data_dir=nowhere"], r"^weight_decay=-1.0 must be >= 0$"),  # nowhere: fails fast if not
    (["--read_next=True"], r"read_next is no key now: gca_sink, center_memory, read_next, pool_tokens are one switch, "
                           r"code_read"),
], ids=["unknown-key", "float-for-int", "int-for-tuple", "int-for-bool", "no-value", "block-size", "no-file",
        "copy-rows-in-tasks", "device", "unknown-task", "negative-lr", "negative-iters", "betas", "weight-decay",
        "merged-key"])
def test_config_errors(argv, message):
    with pytest.raises(train.ConfigError, match=message):
        train.main(argv)


def test_config_file_unknown_key(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import math\nbatch_size = 2\nn_emdb = 64\n")
    with pytest.raises(train.ConfigError, match=r"bad.py: unknown key 'n_emdb' \(did you mean n_embd\?\)"):
        train.main([str(path)])
    path.write_text("batch_size = 2\nn_embd = (64\n")
    with pytest.raises(train.ConfigError, match=r"^config file .*bad.py does not run \(SyntaxError: .*line 2.*\): fix it$"):
        train.main([str(path)])


def test_data_checked_before_anything(tmp_path):
    """Ids past the vocabulary in val.bin (sampled from its first to its last token): one line, before
    a model is built or out_dir made."""
    data = Path(tiny_dataset(tmp_path / "data"))
    (data / "val.bin").write_bytes((data / "val.bin").read_bytes()[:-2] + np.uint16(60000).tobytes())
    with pytest.raises(train.ConfigError, match=r"val.bin holds token id 60000, outside vocab_size=95 of its "
                                                r"meta.json: prepare the data again"):
        train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()
    train.main(tiny_args(tmp_path, "out", "--max_iters=1", "--eval_iters=1"))  # the data as made: it trains


def test_data_sizes_checked_against_meta(tmp_path):
    """A .bin cut short (its meta.json counts more tokens) or of an odd byte count: one line naming the
    file, before anything is built."""
    data = Path(tiny_dataset(tmp_path / "data"))
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"] = {"train": {"tokens": 5000}, "val": {"tokens": 1000}}
    (data / "meta.json").write_text(json.dumps(meta))
    train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'ok'}", "--max_iters=1", "--eval_iters=1"])  # as listed: it trains
    (data / "train.bin").write_bytes((data / "train.bin").read_bytes()[:8000])
    with pytest.raises(train.ConfigError, match=r"train.bin has 8,000 bytes, 5,000 uint16 tokens by its meta.json: prepare"):
        train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    (data / "train.bin").write_bytes((data / "train.bin").read_bytes() + b"x")
    del meta["splits"]["train"]
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(train.ConfigError, match=r"train.bin has 8,001 bytes, not a whole number of uint16 tokens"):
        train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_data_meta_unreadable(tmp_path):
    """A meta.json cut short, or JSON that is no meta.json of prepare_pg19.py: one line naming it and how to
    prepare the data again (--overwrite: its folder holds a dataset), before anything is built."""
    data = Path(tiny_dataset(tmp_path / "data"))
    text = (data / "meta.json").read_text()
    for bad in (text[: len(text) // 2], "[]", json.dumps({"vocab_size": 95}), text.replace("95", '"95"')):
        (data / "meta.json").write_text(bad)
        with pytest.raises(train.ConfigError) as e:
            train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
        msg = str(e.value)
        assert msg.startswith(f"{data / 'meta.json'} is not ") and "\n" not in msg, msg
        assert msg.endswith(f": prepare the data again, e.g. python prepare_pg19.py --source /path/to/pg19 "
                            f"--out {data} --overwrite"), msg
    assert not (tmp_path / "out").exists()


def test_check_bin(tmp_path):
    """common.check_bin, the one check of a .bin (train.py's data, sample.py's documents): the tokens as a
    memmap, else one line naming the file: missing, empty, odd-sized, cut short by its meta.json's count, or
    with ids past the vocabulary (meta.json's, else GPT-2's)."""
    data = Path(tiny_dataset(tmp_path / "data"))
    meta = json.loads((data / "meta.json").read_text())
    meta["splits"] = {"train": {"file": "train.bin", "tokens": 5000}}
    (data / "meta.json").write_text(json.dumps(meta))
    train_bin = data / "train.bin"
    tokens = common.check_bin(str(train_bin))
    assert isinstance(tokens, np.memmap) and tokens.tolist() == np.fromfile(train_bin, np.uint16).tolist()
    whole = train_bin.read_bytes()
    for cut, n in [(whole[:8000], "8,000"), (b"", "0")]:
        said = f"{n} bytes, 5,000 uint16 tokens by its meta.json"
        train_bin.write_bytes(cut)
        with pytest.raises(ValueError, match=rf"^{re.escape(str(train_bin))} has {said}: do this$"):
            common.check_bin(str(train_bin), fix="do this")
    with pytest.raises(ValueError, match=r"^.*nothing.bin not found: prepare the data again$"):
        common.check_bin(str(data / "nothing.bin"))
    (data / "val.bin").write_bytes((data / "val.bin").read_bytes() + b"x")  # not in meta.json: its evenness checked
    with pytest.raises(ValueError, match=r"val.bin has 2,001 bytes, not a whole number of uint16 tokens"):
        common.check_bin(str(data / "val.bin"))
    alone = tmp_path / "alone.bin"  # no meta.json beside it: GPT-2's vocabulary
    np.array([5, 50256, 7], np.uint16).tofile(alone)
    assert common.check_bin(str(alone)).tolist() == [5, 50256, 7]
    np.array([5, 50257, 7], np.uint16).tofile(alone)
    with pytest.raises(ValueError, match=r"alone.bin holds token id 50257, outside GPT-2's 50257 ids"):
        common.check_bin(str(alone))
    train_bin.write_bytes(whole)  # train.py says the same of an empty val.bin, before anything is built
    (data / "val.bin").write_bytes(b"")
    with pytest.raises(train.ConfigError, match=r"val.bin has 0 bytes, no tokens: prepare the data again"):
        train.main([*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_setup_errors(tmp_path):
    with pytest.raises(train.ConfigError, match=r"meta.json not found: prepare the data first, e.g. python prepare_pg19.py"):
        train.main([*TINY, f"--data_dir={tmp_path / 'nothing'}", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(train.ConfigError, match=r"meta.json not found: prepare the data first, e.g. python prepare_code.py"):
        train.main([*TINY, "--dataset=code", f"--data_dir={tmp_path / 'nothing'}", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(train.ConfigError, match=r"val.bin has 1,000 tokens, fewer than block_size\+1=1,009; lower --block_size"):
        train.main(tiny_args(tmp_path, "out", "--block_size=1008"))
    with pytest.raises(train.ConfigError, match=r"tokens_per_step=100 is not a multiple of batch_size\*block_size\*GPUs"):
        train.main(tiny_args(tmp_path, "out", "--tokens_per_step=100"))
    with pytest.raises(train.ConfigError, match=r"gives fewer than 3 chunks"):
        train.main(tiny_args(tmp_path, "out", "--block_size=14"))
    with pytest.raises(train.ConfigError, match=r"landmark_id=95 must lie above them"):
        train.main([*TINY, f"--data_dir={tiny_dataset(tmp_path / 'big', vocab=200)}", f"--out_dir={tmp_path / 'out'}"])
    (tmp_path / "a_file").write_text("")
    with pytest.raises(train.ConfigError, match=r"out_dir .*a_file is a file, or inside one: pass --out_dir="):
        train.main(tiny_args(tmp_path, "a_file"))
    with pytest.raises(train.ConfigError, match=r"out_dir .*a_file/out is a file, or inside one"):
        train.main(tiny_args(tmp_path, "a_file/out"))
    with pytest.raises(train.ConfigError, match=r"no checkpoint at .*ckpt.pt: use --init_from=scratch"):
        train.main(tiny_args(tmp_path, "empty", "--init_from=resume"))


@pytest.mark.parametrize("extra, message", [
    (["--needle_loss=0.1"], r"^--needle_loss ranks the asked needle of task rows, which only the task datasets "
                            r"\(passkey, multikey, vartrack\) have; --dataset=pg19 is text$"),
    (["--topk=4"], r"^topk=4 is more than a training row can pick: block_size=35 is 5 chunks of 7 tokens, and its last "
                   r"chunk reads 3 at most: use --topk <= 3 or --block_size >= 36$"),
    (["--teacher_iters=7"], r"^teacher_iters=7 must lie in \[0, max_iters=6\]$"),
], ids=["needle-loss-on-text", "topk-past-the-row", "teacher-past-max-iters"])
def test_run_settings_refused(tmp_path, extra, message):
    """Settings that could only waste the run: one line that says why, before anything is made."""
    with pytest.raises(train.ConfigError, match=message):
        train.main(tiny_args(tmp_path, "run", *extra))
    assert not (tmp_path / "run").exists()
    train.main(tiny_args(tmp_path, "run", "--block_size=36", "--topk=4", "--teacher_iters=6", "--stop_iter=1",
                         "--eval_iters=1"))  # at the limits: it trains


def test_progress(tmp_path, monkeypatch, capsys):
    """A step or an evaluation that runs long says how far it got (here: 'long' made 0 s)."""
    args = tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--tokens_per_step=140")
    train.main(args)
    assert "micro-batch" not in capsys.readouterr().out  # a tiny run: quiet
    monkeypatch.setattr(common, "PROGRESS_AFTER", -1)
    train.main([*args, "--overwrite=True"])
    out = capsys.readouterr().out
    assert re.search(r"^step 1: micro-batch 1/2 done after 0m\d\ds$", out, re.M)
    assert re.search(r"^eval val: micro-batch 2/2 done after 0m\d\ds$", out, re.M)


def test_resume_is_exact(tmp_path):
    """6 steps in one go == 3 steps, stop, resume, 3 more: the same losses and weights, bit for
    bit (data windows and Gumbel noise are functions of (seed, step, micro-batch))."""
    full = train.main(tiny_args(tmp_path, "full", "--always_save_checkpoint=True"))
    first = train.main(tiny_args(tmp_path, "split", "--stop_iter=3"))
    rest = train.main(tiny_args(tmp_path, "split", "--init_from=resume"))
    assert [it for it, _ in full] == [1, 2, 3, 4, 5, 6] and full[-1][1] < full[0][1]
    assert first + rest == full
    a, b = load_ckpt(tmp_path / "full"), load_ckpt(tmp_path / "split")
    assert a["iter_num"] == b["iter_num"] == 6
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    with open(tmp_path / "split" / "ckpt.json") as f:  # readable without torch
        summary = json.load(f)
    assert summary["iter_num"] == 6 and summary["model_args"]["groups"] == [1] and summary["config"]["block_size"] == 35


def test_resume_restores_config(tmp_path, capsys):
    """--init_from=resume with nothing but out_dir continues with the checkpoint's config (data,
    model, schedule, device): a run in pieces equals one run. Keys given now are applied and
    printed; stop_iter says what this command does, so it is not restored."""
    full = train.main(tiny_args(tmp_path, "full", "--max_iters=4", "--eval_interval=2"))
    first = train.main(tiny_args(tmp_path, "split", "--max_iters=4", "--eval_interval=2", "--stop_iter=2"))
    capsys.readouterr()
    rest = train.main([f"--out_dir={tmp_path / 'split'}", "--init_from=resume"])
    assert "resume:" not in capsys.readouterr().out
    assert first + rest == full and [it for it, _ in full] == [1, 2, 3, 4]
    more = train.main([f"--out_dir={tmp_path / 'split'}", "--init_from=resume", "--max_iters=5", "--log_interval=1"])
    out = capsys.readouterr().out
    assert [it for it, _ in more] == [5]
    assert re.findall(r"^resume: .*$", out, re.M) == ["resume: max_iters 4 -> 5 (given now)"]
    c = load_ckpt(tmp_path / "split")["config"]
    assert c["max_iters"] == 5 and c["block_size"] == 35 and c["n_embd"] == 32 and c["data_dir"] == str(tmp_path / "data")
    # the optimizer's settings given now are the ones it steps with, not those its saved state brings back
    train.main([f"--out_dir={tmp_path / 'split'}", "--init_from=resume", "--max_iters=6", "--weight_decay=0.5",
                "--betas=0.8,0.99"])
    groups = load_ckpt(tmp_path / "split")["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"])) for g in groups] == [(0.5, (0.8, 0.99)), (0.0, (0.8, 0.99))]


def test_resume_conflicting_model(tmp_path):
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))
    with pytest.raises(train.ConfigError, match=r"ckpt.pt is at step 1, past max_iters=0: pass --max_iters above 1"):
        train.main([f"--out_dir={tmp_path / 'run'}", "--init_from=resume", "--max_iters=0"])
    with pytest.raises(train.ConfigError, match=r"has n_embd=32, the config asks 64: drop --n_embd .* or start a new out_dir"):
        train.main(tiny_args(tmp_path, "run", "--init_from=resume", "--n_embd=64", "--max_iters=2"))
    # model keys left out are taken from the checkpoint
    no_model_keys = [a for a in tiny_args(tmp_path, "run", "--init_from=resume", "--max_iters=2")
                     if a.split("=")[0][2:] not in train.MODEL_KEYS]
    assert [it for it, _ in train.main(no_model_keys)] == [2]


def test_resume_on_other_data_resets_best(tmp_path, capsys):
    """A resume on other data (here --dataset=code, as after PG19) starts its best val loss afresh and says so: the
    best of the old validation rows, lower than any on the new ones, would block every save but the last."""
    train.main(tiny_args(tmp_path, "run", "--max_iters=4", "--eval_interval=2", "--stop_iter=2"))
    old = load_ckpt(tmp_path / "run")["best_val_loss"]
    other = tiny_dataset(tmp_path / "other", vocab=40)  # ids 24-39, which the run never saw: a higher loss
    capsys.readouterr()
    train.main([f"--out_dir={tmp_path / 'run'}", "--init_from=resume", "--dataset=code", f"--data_dir={other}",
                "--eval_interval=1", "--always_save_checkpoint=False"])
    out = capsys.readouterr().out
    assert re.search(rf"^resume: dataset, data_dir changed, so the best val loss starts afresh \(the checkpoint's "
                     rf"{old:.4f} was on other validation rows\)$", out, re.M), out
    assert f"saved {tmp_path / 'run' / 'ckpt.pt'} at step 3" in out  # the first val loss on code is the best so far
    assert load_ckpt(tmp_path / "run")["best_val_loss"] > old


def test_finetune_from_checkpoint(tmp_path):
    """init_from=<another run>: that run's weights and architecture, a fresh optimizer and schedule
    from step 0, at another block_size (e.g. PG19 weights, then a synthetic task)."""
    train.main(tiny_args(tmp_path, "base", "--max_iters=3", "--eval_interval=3"))
    base = load_ckpt(tmp_path / "base")
    no_model_keys = [a for a in tiny_args(tmp_path, "ft", f"--init_from={tmp_path / 'base'}", "--block_size=70",
                                          "--max_iters=1", "--eval_interval=1", "--learning_rate=0", "--min_lr=0")
                     if a.split("=")[0][2:] not in train.MODEL_KEYS]
    hist = train.main(no_model_keys)
    assert [it for it, _ in hist] == [1]  # counts from step 0, not from the base run's 3
    ft = load_ckpt(tmp_path / "ft")
    assert ft["iter_num"] == 1 and ft["model_args"] == base["model_args"] and ft["config"]["block_size"] == 70
    for name, t in base["model"].items():  # learning rate 0: the weights are the base run's, untouched
        assert torch.equal(t, ft["model"][name]), name
    assert ft["optimizer"]["state"][0]["step"] == 1  # a fresh AdamW, not the base run's (step 3)
    with pytest.raises(train.ConfigError, match=r"init_from='.*nowhere': no checkpoint there"):
        train.main(tiny_args(tmp_path, "ft2", f"--init_from={tmp_path / 'nowhere'}"))
    with pytest.raises(train.ConfigError, match=r"base/ckpt.pt at step 3 exists: continue that run with --init_from=resume"):
        train.main(tiny_args(tmp_path, "base", f"--init_from={tmp_path / 'base'}"))  # its own checkpoint
    with pytest.raises(train.ConfigError, match=rf"checkpoint {re.escape(str(tmp_path / 'base' / 'ckpt.pt'))} has "
                                                r"n_embd=32, the config asks 64"):  # the file it read, not ft3's
        train.main(tiny_args(tmp_path, "ft3", f"--init_from={tmp_path / 'base'}", "--n_embd=64"))
    # the teacher's settings are checked against the model fine-tuned (topk=3), not the config's defaults (8)
    with pytest.raises(train.ConfigError, match=r"^teacher_slots=5 must lie in \[0, topk=3\]$"):
        train.main([a for a in tiny_args(tmp_path, "ft4", f"--init_from={tmp_path / 'base'}", "--teacher_iters=1",
                                         "--teacher_slots=5") if a.split("=")[0][2:] not in train.MODEL_KEYS])


def test_finetune_shape_clash_names_its_checkpoint(tmp_path):
    """A fine-tune asking another shape than its init_from checkpoint's (--groups="(1,1)" from a run trained with one
    group) is told that the shape comes from that checkpoint, not to start a new out_dir (it is one)."""
    base = tiny_checkpoint(tmp_path / "base.pt")  # groups=(1,)
    args = [a for a in tiny_args(tmp_path, "ft", f"--init_from={base}") if a.split("=")[0][2:] not in train.MODEL_KEYS]
    with pytest.raises(train.ConfigError, match=rf"^init_from checkpoint {re.escape(base)} has groups=\(1,\), the config "
                                                r"asks \(1, 1\): a fine-tune keeps the shape of the model it starts from, "
                                                r"so drop --groups \(from the command line or config file\), or fine-tune "
                                                r"from a run trained with that shape$"):
        train.main([*args, "--groups=(1,1)"])
    assert not (tmp_path / "ft").exists()


def test_out_dir_with_a_checkpoint(tmp_path):
    """A run from scratch or a fine-tune into an out_dir that holds a checkpoint stops before it
    changes anything, unless told --overwrite=True; the last step is saved even when val never
    improved, so out_dir ends up holding this run and not the one it replaced."""
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))
    train.main(tiny_args(tmp_path, "base", "--max_iters=1", "--eval_interval=1", "--eval_iters=1", "--seed=1"))
    before = (tmp_path / "run" / "ckpt.pt").read_bytes()
    for init in ("scratch", tmp_path / "base"):
        with pytest.raises(train.ConfigError, match=r"run/ckpt.pt at step 1 exists: continue that run with "
                                                    r"--init_from=resume, replace it with --overwrite=True"):
            train.main(tiny_args(tmp_path, "run", f"--init_from={init}", "--max_iters=2"))
    assert (tmp_path / "run" / "ckpt.pt").read_bytes() == before
    # learning rate 0: val at step 2 equals val at step 0, never better; always_save_checkpoint=False saves the last step
    train.main(tiny_args(tmp_path, "run", "--overwrite=True", "--always_save_checkpoint=False", "--max_iters=2",
                         "--eval_interval=1", "--learning_rate=0", "--min_lr=0"))
    ckpt = load_ckpt(tmp_path / "run")
    assert ckpt["iter_num"] == 2 and ckpt["config"]["learning_rate"] == 0
    assert json.loads((tmp_path / "run" / "ckpt.json").read_text())["val_loss"] == ckpt["best_val_loss"]


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_one_run_per_out_dir(tmp_path, capsys):
    """A second run into an out_dir in use is refused at once, naming the first: resumed, replacing it (--overwrite=True)
    or not, the two would save over each other. A run's lock goes when it ends, on an error too; a killed run's
    lock, or one whose pid another process has since, is taken over with a line that says so."""
    run, lock, args = tmp_path / "run", tmp_path / "run" / "train.lock", tiny_args(tmp_path, "run")  # (its data made once)
    proc = start_run([sys.executable, "train.py", *args, "--eval_iters=1000000"])
    try:
        read_until(proc.stdout, r"DRT groups")  # in its first evaluation: no checkpoint yet
        for extra in ([], ["--overwrite=True"], ["--init_from=resume"]):
            with pytest.raises(train.ConfigError, match=rf"^out_dir {re.escape(str(run))} is in use by another train.py "
                                                        rf"run \(pid {proc.pid} on {re.escape(socket.gethostname())}, "
                                                        r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\): wait for it to end, "
                                                        r"or use another --out_dir$"):
                train.main([*args, *extra])
        os.killpg(proc.pid, signal.SIGKILL)  # a crash: its lock stays behind
        proc.wait()
    finally:
        end_run(proc)
    assert json.loads(lock.read_text())["pid"] == proc.pid
    capsys.readouterr()
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_iters=1"))
    assert re.search(rf"^out_dir {re.escape(str(run))}: taking over the lock of a run that is gone \(pid {proc.pid} on ",
                     capsys.readouterr().out, re.M)
    assert not lock.exists() and load_ckpt(run)["iter_num"] == 1
    # this process's pid, with another start: a pid reused since the lock was taken (a container's run is often pid 1)
    lock.write_text(json.dumps({"pid": os.getpid(), "ticks": 0, "host": socket.gethostname(), "started": 0}))
    with pytest.raises(train.ConfigError, match=r"block_size=14 gives fewer than 3 chunks"):
        train.main(tiny_args(tmp_path, "run", "--init_from=resume", "--block_size=14"))
    assert "taking over the lock" in capsys.readouterr().out and not lock.exists()  # released on the error


def test_bad_checkpoint_files(tmp_path):
    """A truncated, foreign or not-resumable ckpt.pt: one line that says so, for resume and fine-tune."""
    import argparse
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))
    good = (tmp_path / "run" / "ckpt.pt").read_bytes()
    os.makedirs(tmp_path / "bad")
    bad = tmp_path / "bad" / "ckpt.pt"
    cases = [
        (good[: len(good) // 2], r"is truncated or not a torch checkpoint"),
        (b"", r"is truncated or not a torch checkpoint"),
        ({"model": argparse.Namespace(), "model_args": {}}, r"holds Python objects a train.py checkpoint never has"),
        ({"weight": torch.zeros(2)}, r"is not a train.py checkpoint \(no model_args/model\)"),
    ]
    for content, message in cases:
        if isinstance(content, bytes):
            bad.write_bytes(content)
        else:
            torch.save(content, bad)
        with pytest.raises(common.CheckpointError, match=message + r".*: start over with --init_from=scratch") as e:
            train.main(tiny_args(tmp_path, "bad", "--init_from=resume"))
        assert "\n" not in str(e.value)
        with pytest.raises(common.CheckpointError, match=message + r".*: point --init_from at a train.py ckpt.pt"):
            train.main(tiny_args(tmp_path, "ft", f"--init_from={bad}"))
    weights = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    for part in ("optimizer", "config"):  # weights alone: they fine-tune, but do not resume
        torch.save({k: v for k, v in weights.items() if k != part}, bad)
        with pytest.raises(common.CheckpointError, match=r"holds weights alone .*cannot be resumed: fine-tune from it"):
            train.main(tiny_args(tmp_path, "bad", "--init_from=resume", "--max_iters=2"))
    weights.pop("optimizer")
    torch.save(weights, bad)
    train.main(tiny_args(tmp_path, "ft2", f"--init_from={bad}", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))


def test_checkpoints_of_removed_options(tmp_path):
    """A checkpoint written before ret_dim, enc_rope, pool_retrieval="states" and repeat_frac were removed loads
    and resumes when they hold their off values (pool_retrieval="tokens" was pool_tokens=True); one written before
    the read path's four switches became code_read loads with all four at config/code_teacher.py's values as
    code_read=True, with the same logits, and resumes; one older than some of the four takes the paper's values for
    those. Any other value, or a mix of the four, is one line that names the option."""
    run = ["--max_iters=1", "--eval_interval=1", "--eval_iters=1"]
    train.main(tiny_args(tmp_path, "run", *run, "--code_read=True"))
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    was = dict(ret_dim=0, enc_rope=False, pool_retrieval="tokens", gca_sink=False, center_memory=True,
               read_next=True)  # how the earlier versions stored the run
    before = lambda part, **kw: {k: v for k, v in ckpt[part].items() if k != "code_read"} | kw  # noqa: E731
    old = {**ckpt, "model_args": before("model_args", **was), "config": before("config", **was, repeat_frac=0.0)}
    for name, saved in (("old", old), ("paper", {**ckpt, "model_args": before("model_args", gca_sink=True)})):
        os.makedirs(tmp_path / name)
        torch.save(saved, tmp_path / name / "ckpt.pt")
    assert common.read_checkpoint(str(tmp_path / "paper"))[1].code_read is False  # before center_memory existed
    x = torch.randint(0, 95, (2, 30))
    logits = [common.build_model(common.read_checkpoint(str(tmp_path / r))[0], "cpu")(x)[0] for r in ("run", "old")]
    assert torch.equal(*logits)
    train.main(tiny_args(tmp_path, "old", "--init_from=resume", "--max_iters=2", "--eval_interval=1", "--eval_iters=1"))
    resumed = load_ckpt(tmp_path / "old")
    assert resumed["config"]["code_read"] is True and resumed["model_args"]["code_read"] is True
    for part, key, value in [("model_args", "ret_dim", 16), ("model_args", "enc_rope", True),
                             ("model_args", "pool_retrieval", "states"), ("config", "repeat_frac", 0.5),
                             ("model_args", "center_memory", False)]:
        torch.save({**old, part: old[part] | {key: value}}, tmp_path / "old" / "ckpt.pt")
        said = ("gca_sink=False, center_memory=False, read_next=True, pool_tokens=True, a mix" if key == "center_memory"
                else key)
        for load in (lambda: common.read_checkpoint(str(tmp_path / "old")),
                     lambda: train.main(tiny_args(tmp_path, "old", "--init_from=resume", "--max_iters=3"))):
            with pytest.raises(common.CheckpointError, match=f"old.ckpt.pt was trained with {said}.*removed") as e:
                load()
            assert "\n" not in str(e.value)


def test_passkey_task(tmp_path, monkeypatch):
    tokenizer_or_skip(monkeypatch)
    scored, flops = [], common.flops_per_token  # MFU counts the output layer at the answer's positions alone

    def spy(model, logit_share=1.0):
        scored.append(logit_share)
        return flops(model, logit_share)
    monkeypatch.setattr(common, "flops_per_token", spy)
    hist = train.main(["--dataset=passkey", "--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1",
                       "--chunk_size=8", "--window=16", "--topk=3", "--block_size=70", "--batch_size=2", "--tokens_per_step=0",
                       "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--log_interval=1", "--device=cpu",
                       f"--out_dir={tmp_path / 'out'}"])
    assert [it for it, _ in hist] == [1, 2] and all(np.isfinite(loss) for _, loss in hist)
    assert load_ckpt(tmp_path / "out")["model_args"]["vocab_size"] == 50304  # GPT-2's vocabulary
    assert scored == [12 / 70]  # the row's end that holds the answer, tasks.MAX_ANSWER + chunk_size - 2 of 70
    with pytest.raises(train.ConfigError, match=r"needles from token 490: raise --block_size or lower --task_min_depth"):
        train.main(["--dataset=passkey", "--block_size=504", "--task_min_depth=490", "--device=cpu",
                    f"--out_dir={tmp_path / 'x'}"])
    with pytest.raises(train.ConfigError, match=r"task_min_depth=-1 must be >= 0"):
        train.main(["--task_min_depth=-1"])
    with pytest.raises(train.ConfigError, match=r"a comma list is of synthetic tasks, each one of passkey, multikey, "
                                                "vartrack"):
        train.main(["--dataset=passkey,pg19"])
    with pytest.raises(train.ConfigError, match=r"task_chains='1' must be N or A-B, 2 <= A <= B <= 16"):
        train.main(["--dataset=vartrack", "--task_chains=1"])


def test_task_keys_and_templates(tmp_path, monkeypatch):
    """--task_keys and --task_templates reach the training rows (12 keys in the held-out phrasing here,
    a range and a mix through get_batch), whose loss is on the asked key and its stop; bad values are
    one-line ConfigErrors."""
    import random

    import tasks
    enc = tokenizer_or_skip(monkeypatch)
    rows, get_batch = [], tasks.get_batch

    def spy(*a, **kw):  # the rows train.py trains and evaluates on
        x, y, hops = get_batch(*a, **kw)
        rows.append(x)
        return x, y, hops

    monkeypatch.setattr(tasks, "get_batch", spy)
    train.main(["--dataset=multikey", "--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1",
                "--chunk_size=8", "--window=16", "--topk=3", "--block_size=250", "--batch_size=2", "--tokens_per_step=0",
                "--max_iters=1", "--eval_interval=1", "--eval_iters=1", "--log_interval=1", "--device=cpu",
                "--task_keys=12", "--task_templates=code", f"--out_dir={tmp_path / 'out'}"])
    texts = [enc.decode(r.tolist()) for x in rows for r in x]
    needles = [re.findall(r"The secret code for \w+ is \d+\.", t.split("What is")[0]) for t in texts]  # before the question
    assert texts and all(len(n) == 12 for n in needles)
    x, _, _ = get_batch("multikey", 24, 400, random.Random(0), enc, keys=(2, 16), templates=("key", "number"))
    counts = [len(re.findall(r" (?:pass key|magic number) of \w+ is \d+\.", enc.decode(r.tolist()).split("What is")[0]))
              for r in x]
    assert min(counts) >= 2 and max(counts) <= 16 and len(set(counts)) > 3
    assert {"pass key", "magic number"} == {re.search(r"What is the (pass key|magic number)", enc.decode(r.tolist()))[1]
                                            for r in x}
    x, y, _ = get_batch(["passkey", "multikey"], 32, 400, random.Random(1), enc, keys=(2, 16),
                     templates=("key", "number", "id"))
    nouns = set()
    for r, t in zip(x, y):
        text = enc.decode(r.tolist())
        noun, named = re.search(r"What is the ([\w ]+?)((?: (?:of|for) \w+)?)\? The \1\2 is", text).groups()
        key = re.search(rf"The {noun}{named} is (\d+)\.", text.split("What is")[0])[1]  # its needle, before the question
        assert enc.decode(t[t >= 0].tolist()) == f" {key}{tasks.ANSWER_END}"  # the loss: the asked key, then the stop
        assert "secret" not in text and "code" not in text  # the held-out phrasing's words never appear
        nouns.add(noun)
    assert nouns == {"pass key", "magic number", "access ID"}
    for bad, message in [("--task_keys=1", r"task_keys='1' must be N or A-B, 2 <= A <= B <= 16"),
                         ("--task_keys=8-3", r"task_keys='8-3'"),
                         ("--task_templates=key,nope", r"task_templates='key,nope' must be a comma list of key, number")]:
        with pytest.raises(train.ConfigError, match=message):
            train.main([bad])


def test_word_pool(monkeypatch):
    """Multi-key trains on thousands of one-token words, none of them a name any
    test asks about (NAMES, UNSEEN_NAMES), so only matching names can pass a test."""
    import random

    import tasks
    enc = tokenizer_or_skip(monkeypatch)
    pool = tasks.word_pool(enc)
    assert len(pool) > 10000 and len(set(pool)) == len(pool)
    assert not set(pool) & (set(tasks.NAMES) | set(tasks.UNSEEN_NAMES))
    assert all(len(enc.encode_ordinary(" " + w)) == 1 and w.isalpha() for w in random.Random(0).sample(pool, 500))
    x, _, _ = tasks.get_batch("multikey", 8, 300, random.Random(0), enc, names=pool)
    rows = [enc.decode(row.tolist()) for row in x]
    assert all(set(re.findall(r"pass key of (\w+)", row)) <= set(pool) for row in rows)
    assert len({re.search(r"pass key of (\w+)\?", row).group(1) for row in rows}) == 8  # asked: 8 draws from 12K


def test_task_validation_names_were_never_trained(monkeypatch):
    """Stage 2's validation rows name words its training rows never do (9-12 letters against 4-8), and no test's,
    so that the validation loss sees names as the tests do (a model that learned the training names one by one
    scores well on them alone: dev/LOG.md); training rows draw from the training pool."""
    import random
    import types
    import tasks
    enc = tokenizer_or_skip(monkeypatch)
    files = [os.path.join(HERE, "config", f) for f in ("passkey_pretrain.py", "passkey_finetune.py")]
    c, _ = parse(files + ["--task_haystack=", "--batch_size=32", "--dataset=multikey"])
    rows, tests = tasks.TaskRows(types.SimpleNamespace(**c)), set(tasks.NAMES) | set(tasks.UNSEEN_NAMES)
    train_pool, val_pool = set(tasks.word_pool(enc)), set(tasks.word_pool(enc, (9, 12)))
    assert len(val_pool) > 4000 and not val_pool & train_pool and not val_pool & tests
    for split, pool in (("train", train_pool), ("val", val_pool)):
        x, _, _ = rows.batch(split, random.Random(2), split == "train")
        asked = [re.search(r"What is the [\w ]+? (?:for|of) (\w+)\?", enc.decode(row.tolist())) for row in x]
        assert all(asked) and {m.group(1) for m in asked} <= pool, split


def test_two_stage_recipe(tmp_path, monkeypatch, capsys):
    """The passkey recipe's plumbing at toy size: config/passkey_pretrain.py on text and copy rows, then
    config/passkey_finetune.py from it (a task mix, a real-text haystack, aligned questions, pool names),
    then sample.py's test table on the result."""
    import sample
    tokenizer_or_skip(monkeypatch)
    data = tiny_dataset(tmp_path / "pg19", vocab=50257)  # GPT-2 ids, as prepare_pg19.py writes them
    small = ["--n_embd=32", "--n_head=2", "--batch_size=2", "--block_size=250", "--max_iters=2", "--eval_interval=2",
             "--eval_iters=1", "--log_interval=1", "--device=cpu", "--topk=2"]  # 4 chunks: the last reads 2
    pre, ft = tmp_path / "pre", tmp_path / "ft"
    train.main([os.path.join(HERE, "config/passkey_pretrain.py"), *small, f"--data_dir={data}", f"--out_dir={pre}"])
    hist = train.main([os.path.join(HERE, "config/passkey_finetune.py"), *small[2:], f"--init_from={pre}",
                       f"--out_dir={ft}", f"--task_haystack={data}/train.bin", "--task_min_depth=40",
                       "--block_size=504", "--teacher_iters=1"])  # 16 keys need ~400 tokens
    assert [it for it, _ in hist] == [1, 2]
    a, b = load_ckpt(pre), load_ckpt(ft)
    assert a["model_args"] == b["model_args"] and b["model_args"]["n_embd"] == 32  # the architecture of stage 1
    assert a["config"]["copy_frac"] == 0.5  # stage 1 learns copying on rows of random tokens
    assert b["config"]["dataset"] == "passkey,multikey" and b["config"]["task_keys"] == "2-16"  # more keys than top-k
    assert b["config"]["task_templates"] == "key,number,id"  # "code" held out
    capsys.readouterr()
    sample.main([f"--out_dir={ft}", "--passkey", "--lengths=500,2K", "--samples_per_length=2", "--device=cpu",
                 f"--haystack={data}/val.bin"])
    out = capsys.readouterr().out
    assert "question aligned to a chunk" in out and len(re.findall(r"^\s+(500|2K)\s+2\s+\d+\.\d%", out, re.M)) == 2


def test_ddp_matches_one_process(tmp_path):
    """torchrun, 2 CPU processes (gloo), batch 1 each == one process, batch 1, 2 accumulation steps:
    the same global batch and noise. Two steps, so a rank whose weights drifted after step 1 would
    change step 2's averaged gradient and the rank-0 checkpoint. Only rank 0 prints and saves."""
    extra = ["--batch_size=1", f"--tokens_per_step={2 * 35}", "--max_iters=2", "--eval_interval=2"]
    single = train.main(tiny_args(tmp_path, "single", *extra))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *tiny_args(tmp_path, "ddp", *extra)]
    r = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "2 rank(s) x 1 accum" in r.stdout
    ddp = [(int(m[1]), float(m[2])) for m in re.finditer(r"^iter (\d+)/2 \| loss ([\d.]+)", r.stdout, re.M)]
    assert [it for it, _ in ddp] == [1, 2]  # printed once: by rank 0 alone
    for (_, a), (_, b) in zip(ddp, single):
        assert a == pytest.approx(b, rel=1e-4)  # the log prints 4 decimals
    a, b = load_ckpt(tmp_path / "ddp"), load_ckpt(tmp_path / "single")
    assert a["iter_num"] == b["iter_num"] == 2
    for name, t in a["model"].items():
        torch.testing.assert_close(t, b["model"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_timeout(tmp_path, monkeypatch):
    """The process group waits ddp_timeout seconds for a hung rank (torch's default: 10 min for NCCL,
    30 for gloo). By hand: a stopped rank and --ddp_timeout=3 end in gloo's 'Timed out waiting 3000ms'."""
    seen = {}

    def init_process_group(backend, **kw):
        seen.update(kw, backend=backend)
        raise train.ConfigError("enough")

    monkeypatch.setattr(train.dist, "init_process_group", init_process_group)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(train.ConfigError, match="enough"):
        train.main(tiny_args(tmp_path, "run", "--ddp_timeout=7"))
    assert seen["backend"] == "gloo" and seen["timeout"].total_seconds() == 7


ACK = "train.py: {} received: saving the last finished step, then stopping (Ctrl-C again to stop now)"


def interrupt_after(cmd, pattern):
    """Run cmd, send it one Ctrl-C once its stdout shows pattern -> (exit status, stdout, stderr)."""
    proc = start_run(cmd)
    try:
        read_until(proc.stdout, pattern)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    return proc.returncode, out, err


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ctrl_c_saves_and_resumes(tmp_path):
    """Ctrl-C: the run stops at the next step boundary, saves, exits 130 and prints the command that
    continues it, which does. A second Ctrl-C, a second or more later, stops at once."""
    run = tmp_path / "run"
    rc, out, err = interrupt_after([sys.executable, "train.py", *tiny_args(tmp_path, "run", "--max_iters=100000",
                                                                            "--eval_interval=100000")], r"iter 1/")
    assert rc == 130 and "Traceback" not in err, err
    m = re.search(r"^train.py: interrupted: saved (.*) at step (\d+); continue with: (python train.py .* --init_from=resume)$",
                  err, re.M)
    assert m and m[1] == str(run / "ckpt.pt"), err
    step = int(m[2])
    assert step >= 1 and load_ckpt(run)["iter_num"] == step and f"saved {run / 'ckpt.pt'} at step {step}" in out
    again = shlex.split(m[3])[2:]
    assert [it for it, _ in train.main([*again, f"--max_iters={step + 2}"])] == [step + 1, step + 2]
    # the second Ctrl-C: inside a long evaluation, which the first one waits for; this run replaces `run`, whose
    # checkpoint is not this run's to name
    proc = start_run([sys.executable, "train.py", *tiny_args(tmp_path, "run", "--eval_iters=1000000",
                                                             "--overwrite=True")])
    try:
        read_until(proc.stdout, r"DRT groups")
        proc.send_signal(signal.SIGINT)
        threading.Event().wait(1.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines() == [ACK.format("Ctrl-C"), "train.py: interrupted: stopped at once; no checkpoint saved"]
    # one Ctrl-C inside the first evaluation: no step was taken, so nothing is saved (a step-0
    # checkpoint would only make the next run of the same command refuse to overwrite it)
    rc, out, err = interrupt_after([sys.executable, "train.py", *tiny_args(tmp_path, "run3", "--eval_iters=30")],
                                   r"DRT groups")
    assert rc == 130 and err.splitlines() == [ACK.format("Ctrl-C"), "train.py: interrupted before the first step: "
                                                                    "nothing saved"], err
    assert not os.path.exists(tmp_path / "run3" / "ckpt.pt")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ctrl_c_after_a_library_took_sigint(tmp_path):
    """A handler installed during the run over ours (on the GPU: LLVM's, at Triton's first compile; while it
    runs SIGINT has its default action) is replaced at the next step boundary: Ctrl-C still saves and says so,
    instead of killing the run silently."""
    steal = tmp_path / "steal.py"  # a config file (Python): at the first forward, SIGINT gets its default action
    steal.write_text("import signal as _signal\nimport model as _model\n_forward = _model.DRT.forward\n"
                     "def _first(self, *a, **k):\n    _model.DRT.forward = _forward\n"
                     "    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)\n    return _forward(self, *a, **k)\n"
                     "_model.DRT.forward = _first\n")
    rc, out, err = interrupt_after([sys.executable, "train.py", str(steal),
                                    *tiny_args(tmp_path, "run", "--max_iters=100000", "--eval_interval=100000")], r"iter 3/")
    assert rc == 130, (rc, err)  # -2: killed by SIGINT, nothing printed or saved
    m = re.search(r"^train.py: interrupted: saved .* at step (\d+); continue with: ", err, re.M)
    assert m and load_ckpt(tmp_path / "run")["iter_num"] == int(m[1]) >= 3, err


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_sigterm_stops_inside_a_step(tmp_path):
    """SIGTERM in a step of many micro-batches (one process) is answered at once and stops at the next micro-batch, not
    at the end of the step: the step under way is dropped, the last finished one saved, and the printed command
    continues from it exactly as an uninterrupted run."""
    extra = ["--tokens_per_step=8400", "--max_iters=2", "--eval_interval=100"]  # 120 micro-batches a step: a second
    proc = start_run([sys.executable, "train.py", *tiny_args(tmp_path, "run", *extra)])
    try:
        read_until(proc.stdout, r"iter 1/")  # step 2 under way
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        first = proc.stderr.readline()
        answered = time.time() - t0
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    assert first == ACK.format("SIGTERM") + "\n" and answered < 30, (first, err)
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err
    m = re.search(r"^train.py: stopped by SIGTERM: saved (.*) at step (\d+); continue with: (python train.py .*)$", err, re.M)
    assert m and m[1] == str(tmp_path / "run" / "ckpt.pt") and m[2] == "1", err  # step 2 was dropped
    assert load_ckpt(tmp_path / "run")["iter_num"] == 1
    rest = train.main(shlex.split(m[3])[2:])
    full = train.main(tiny_args(tmp_path, "full", *extra))
    assert [it for it, _ in rest] == [2] and rest == full[1:]
    a, b = load_ckpt(tmp_path / "run"), load_ckpt(tmp_path / "full")
    assert all(torch.equal(t, b["model"][k]) for k, t in a["model"].items())


def torchrun_tiny(tmp_path, run, *extra):
    """train.py under torchrun, 2 CPU processes (gloo), batch 1 each, running long enough to be
    interrupted; each rank writes its pid to tmp_path/pid<rank> from a config file (config files are Python)."""
    pids = tmp_path / "pids.py"
    pids.write_text(f"import os as _os\nwith open({str(tmp_path)!r} + '/pid' + _os.environ.get('RANK', 'x'), 'w') as _f:\n"
                    f"    _f.write(str(_os.getpid()))\n")
    args = tiny_args(tmp_path, run, "--batch_size=1", f"--tokens_per_step={2 * 35}", "--max_iters=100000", *extra)
    return start_run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                      str(pids), *args], pid_files=[tmp_path / "pid0", tmp_path / "pid1"])


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ddp_ctrl_c(tmp_path):
    """Ctrl-C under torchrun (which forwards it to each worker): all ranks stop at the same step,
    rank 0 saves, and says once how to continue."""
    proc = torchrun_tiny(tmp_path, "run", "--eval_interval=100000")
    try:
        read_until(proc.stdout, r"iter 3/")
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    m = re.findall(r"^train.py: interrupted: saved (.*) at step (\d+); continue with: torchrun <as before> train.py "
                   r".* --init_from=resume$", err, re.M)
    assert len(m) == 1 and m[0][0] == str(tmp_path / "run" / "ckpt.pt"), err[-3000:]
    assert load_ckpt(tmp_path / "run")["iter_num"] == int(m[0][1]) and "[rank" not in err  # no rank's traceback


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_ddp_rank_dies(tmp_path):
    """One rank is killed mid-run: the other stops with one line naming the last checkpoint (whole:
    saves are atomic), and --init_from=resume continues from it (here on one process)."""
    proc = torchrun_tiny(tmp_path, "run", "--eval_interval=2")
    try:
        read_until(proc.stdout, r"iter 5/")
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    assert proc.returncode != 0
    m = re.search(r"^train.py: rank 0: stopped by SIGTERM \(another rank failed\?\); the last checkpoint is (.*) at step "
                  r"(\d+): resume with --init_from=resume$", err, re.M)
    assert m and m[1] == str(tmp_path / "run" / "ckpt.pt"), err[-3000:]
    assert "[rank0]" not in err  # no traceback of rank 0's
    step = int(m[2])
    assert step >= 4 and load_ckpt(tmp_path / "run")["iter_num"] == step
    hist = train.main([f"--out_dir={tmp_path / 'run'}", "--init_from=resume", f"--max_iters={step + 2}"])
    assert [it for it, _ in hist] == [step + 1, step + 2]


def test_train_reports_retrieval_health(tmp_path, capsys):
    """Each evaluation line of a DRT run carries sum w, max w and GCA's sink share (a dying retriever,
    or GCA reading nothing, shows there), with two upper layers each one's too: those of the first validation
    micro-batch, as common.retrieval_stats gives them for the saved model; the baseline's line has none."""
    import types

    import common

    def run(name, *extra):  # -> the run's evaluation lines, and retrieval_stats of its saved model (the last line's)
        train.main(tiny_args(tmp_path, name, "--max_iters=3", *extra))
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval iter")]
        ckpt = load_ckpt(tmp_path / name)
        c, model = types.SimpleNamespace(**ckpt["config"]), common.build_model(ckpt, "cpu")
        with torch.no_grad(), model.recording() as record:
            model(*train.Data(c, torch.device("cpu")).batch("val", train.step_rng(c.seed, "val", "eval", 0)))
        return lines, common.retrieval_stats(record, c.topk)

    lines, stats = run("drt")
    health = r"\| retrieval: sum w ([01]\.\d{3}), max w ([01]\.\d{3}), sink ([01]\.\d\d)$"
    assert len(lines) == 2 and all(re.search(health, x) for x in lines)
    assert re.search(health, lines[-1]).groups() == (f"{stats['sum_w']:.3f}", f"{stats['max_w']:.3f}", f"{stats['sink']:.2f}")
    lines, stats = run("two", "--groups=1,1")  # two upper layers: each one's share too
    assert len(stats["sink_reads"]) == 2 and min(stats["sink_reads"]) <= stats["sink"] <= max(stats["sink_reads"])
    assert lines[-1].endswith(f"sink {stats['sink']:.2f} ({stats['sink_reads'][0]:.2f} {stats['sink_reads'][1]:.2f} "
                              f"by upper layer)")
    train.main(tiny_args(tmp_path, "nosink", "--max_iters=3", "--code_read=True"))  # the slot is a key like the others
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval iter")]
    assert len(lines) == 2 and all(re.search(health.replace("sink", "landmark slot"), x) for x in lines)
    train.main(tiny_args(tmp_path, "base", "--max_iters=3", "--groups=()", "--n_lower=2"))
    assert "retrieval:" not in capsys.readouterr().out


@pytest.mark.parametrize("code_read", [False, True])
def test_teacher_picks(code_read):
    """teacher_iters' picks: for landmark t, the readable chunks before t sharing the most idf-weighted ids with
    chunk t+1, as the picks Eq. 1 would make (under code_read, the chunk before each): a chunk that
    recurs is read for its repeat, and no pick reads chunk t or later."""
    cfg = DRTConfig(vocab_size=64, landmark_id=63, n_embd=32, n_head=4, n_lower=1, groups=(1,), chunk_size=4,
                    window=8, topk=2, code_read=code_read)
    T, first = cfg.chunk_size - 1, int(code_read)
    chunks = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [4, 5, 6], [10, 11, 12], [7, 8, 13], [20, 21]]  # 3 repeats 1, 5 shares 7, 8 with 2
    idx = torch.tensor([sum(chunks, [])])
    picks = teacher.teacher_picks(idx, cfg)  # (1, 6, 2): the 6 complete chunks' landmarks
    assert picks.shape == (1, 6, 2)
    reads = torch.where(picks >= 0, picks + first, picks)[0]
    assert reads[2, 0] == 1 and reads[4, 0] == 2  # chunk 3 reads its source, chunk 5 the chunk sharing 7, 8
    t = torch.arange(6)[:, None]
    assert ((reads == -1) | ((reads >= first) & (reads < t))).all()  # only chunks before t, and readable
    assert (reads[0] == -1).all() and (reads[1, 1] == -1) and (reads[1, 0] == (-1 if code_read else 0))
    assert len(set(reads[5].tolist())) == 2  # K distinct chunks where K are readable


def test_teacher_slots_keep_eq1s_best():
    """teacher_slots=n: the teacher's n best chunks go into the last n slots, the rest are -1 (Eq. 1's own best
    picks stay); a chunk that both Eq. 1 and the teacher pick is read once (weight 0 on its second slot)."""
    from conftest import retrievals, tiny_model, tokens
    model = tiny_model(gumbel=False).eval()  # Eq. 1's picks without noise: the same in both forwards
    cfg = model.config
    K, idx = cfg.topk, tokens(cfg, 2, 6 * cfg.chunk_size, 0)
    full, one = teacher.teacher_picks(idx, cfg), teacher.teacher_picks(idx, cfg, slots=1)  # (B, n, K)
    assert (one[..., -1] == full[..., 0]).all() and (one[..., :-1] == -1).all()
    with model.recording() as plain:
        model(idx)
    _, eq1, _ = retrievals(plain)[0]  # (B, n, K): Eq. 1's picks, best first
    picks = torch.full_like(eq1, -1)
    picks[..., -1] = eq1[..., 0]  # Eq. 1's best, handed in again in the last slot
    with model.recording() as handed:
        model(idx, picks=picks)
    _, got, w = retrievals(handed)[0]
    assert (got[..., :-1] == eq1[..., :-1]).all() and (got[..., -1] == eq1[..., 0]).all()
    later = torch.arange(got.size(1)) >= K  # landmarks with K earlier chunks: every slot eligible in Eq. 1
    assert (w[:, later, -1] == 0).all() and (w[:, later, 0] > 0).all()  # the repeat weighs nothing


def test_teacher_iters_feed_training_only(tmp_path, monkeypatch):
    """teacher_iters: the first steps' training forwards read teacher_picks; later steps, evaluation and
    the checkpoint use Eq. 1 alone (no picks handed in)."""
    seen, orig = [], DRT.retrieve

    def spy(self, g, h, chunk_ids, memory, picks=None):
        seen.append((self.training, picks is not None))
        return orig(self, g, h, chunk_ids, memory, picks)
    monkeypatch.setattr(DRT, "retrieve", spy)
    train.main(tiny_args(tmp_path, "t", "--teacher_iters=2", "--max_iters=4", "--eval_interval=4",
                         "--eval_iters=1"))
    training = [handed for is_training, handed in seen if is_training]
    assert training == [True, True, False, False]  # one group, one micro-batch a step
    assert not any(handed for is_training, handed in seen if not is_training)


def test_teacher_hops_hands_each_group_its_hop(tmp_path, monkeypatch):
    """--teacher_hops: where a group has a needle label, the teacher's chunks go to the labelled groups alone (2-hop:
    group 1 "VAR Y = X." a chunk ahead, group 2 the key; the other group picks by Eq. 1 there); elsewhere to all.
    Per-group picks that agree are the shared picks; a run trains with them; without a teacher it is refused."""
    from conftest import tiny_model, tokens
    picks = torch.arange(2 * 4 * 3).view(2, 4, 3)  # (B, n, K)
    labels = torch.full((2, 2, 4), -1)  # (B, G, n)
    labels[0, 0, 2], labels[0, 1, 3] = 0, 1  # row 0: two hops
    labels[1, :, 3] = 1  # row 1: one hop, every group
    got = teacher.per_hop(picks, labels)
    assert got.shape == (2, 2, 4, 3)
    assert (got[0, 0, 3] == -1).all() and (got[0, 1, 2] == -1).all()  # each hop's landmark: its group alone
    assert torch.equal(got[0, 0, 2], picks[0, 2]) and torch.equal(got[0, 1, 3], picks[0, 3])
    assert torch.equal(got[0, :, :2], picks[0, None, :2].expand(2, 2, 3))  # unlabelled landmarks: every group
    assert torch.equal(got[1], picks[1, None].expand(2, 4, 3))
    model = tiny_model(groups=(1, 1)).eval()
    idx = tokens(model.config, 2, 60, seed=1)
    handed = torch.randint(0, 3, (2, 60 // 7, model.config.topk)).masked_fill(torch.rand(2, 60 // 7, 3) < 0.5, -1)
    handed = handed.minimum(torch.arange(60 // 7)[None, :, None] - 1)  # earlier chunks, or -1
    with torch.no_grad():
        shared = model(idx, picks=handed)[0]
        per_group = model(idx, picks=handed[:, None].expand(-1, 2, -1, -1))[0]
    assert torch.equal(shared, per_group)
    tokenizer_or_skip(monkeypatch)
    args = ["--dataset=vartrack", "--task_chains=2", "--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,1",
            "--n_enc=1", "--chunk_size=8", "--window=16", "--topk=3", "--block_size=700", "--batch_size=2",
            "--tokens_per_step=0", "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--device=cpu",
            "--teacher_iters=2", "--teacher_slots=1", f"--out_dir={tmp_path / 'h'}"]
    assert all(np.isfinite(loss) for _, loss in train.main(args + ["--teacher_hops=True"]))
    with pytest.raises(train.ConfigError, match="teacher_hops .* needs --teacher_iters"):
        train.main(args[:-3] + ["--teacher_hops=True", f"--out_dir={tmp_path / 'h2'}"])


def test_teacher_hands_over_the_asked_needle(monkeypatch):
    """config/passkey_finetune.py's teacher: on stage 2's rows (passkey and 2-16-key multi-key, three phrasings),
    the one chunk it hands the landmark that serves the answer is the chunk of the needle asked for, which
    lets the read path learn to copy the key before Eq. 1 can find it. In the filler sentences, as here; in books
    it is the needle about half the time (dev/LOG.md, the long-context recipe)."""
    import random
    import types
    import tasks
    tokenizer_or_skip(monkeypatch)
    files = [os.path.join(HERE, "config", f) for f in ("passkey_pretrain.py", "passkey_finetune.py")]
    c, _ = parse(files + ["--task_haystack=", "--batch_size=32"])  # filler haystack: no data needed
    assert 0 < c["teacher_iters"] < c["max_iters"] and c["teacher_slots"] == 1
    cfg = DRTConfig(**{k: c[k] for k in train.MODEL_KEYS})
    T, rows, found = cfg.chunk_size - 1, tasks.TaskRows(types.SimpleNamespace(**c)), []
    x, y, _ = rows.batch("train", random.Random(0), True)  # (B, block_size) each; y: -1 but on the answer
    picks = teacher.teacher_picks(x, cfg, c["teacher_slots"])  # (B, n, K): -1 but in the last slot
    for b in range(x.size(0)):
        p = int((y[b] >= 0).nonzero()[0, 0])  # the question's last token predicts the answer's first
        answer = y[b, y[b] >= 0].tolist()[:-1]  # its digits, without the closing full stop
        xs = x[b, :p].tolist()
        needle = {(i + j) // T for i in range(p - len(answer) + 1) if xs[i:i + len(answer)] == answer
                  for j in range(len(answer))}  # the chunks that hold the key asked for
        assert needle, "the answer must occur in the prompt"
        if max(needle) < p // T - 1:  # outside the window's chunks: retrieval's job
            found.append(int(picks[b, p // T - 1, -1]) in needle)
    assert len(found) >= 24 and sum(found) >= 0.9 * len(found), (sum(found), len(found))


def test_needle_labels_point_at_the_asked_key(monkeypatch):
    """tasks.needle_labels on stage 2's rows: one label a row, at the landmark that serves the answer, naming the chunk
    that holds the asked key, wherever that chunk lies before the landmark (else no label)."""
    import random
    import types
    import tasks
    tokenizer_or_skip(monkeypatch)
    files = [os.path.join(HERE, "config", f) for f in ("passkey_pretrain.py", "passkey_finetune.py")]
    c, _ = parse(files + ["--task_haystack=", "--batch_size=32"])
    T, rows = c["chunk_size"] - 1, tasks.TaskRows(types.SimpleNamespace(**c))
    x, y, _ = rows.batch("train", random.Random(1), True)
    labels = tasks.needle_labels(x, y, T)[:, 0]  # one group
    assert labels.shape == (x.size(0), x.size(1) // T)
    for b in range(x.size(0)):
        p = int((y[b] >= 0).nonzero()[0, 0])
        answer, xs = y[b, y[b] >= 0].tolist()[:-1], x[b, :p].tolist()
        first = next(i for i in range(p) if xs[i:i + len(answer)] == answer)
        holds = {(first + k) // T for k in range(len(answer))}  # the chunks of the key's first mention
        t, got = p // T - 1, (labels[b] >= 0).nonzero().flatten().tolist()
        if min(holds) < t:
            assert got == [t] and int(labels[b, t]) in holds, (b, got, holds)
        else:
            assert got == []
    assert (labels >= 0).sum() >= 0.75 * x.size(0)


def test_twohop_rows_are_laid_out_as_tests(monkeypatch):
    """config/twohop.py's rows have room for the test's 2-hop layout (tasks.hop_spacing: hop 1's chunk beyond the lower
    windows' reach of hop 2), and take it; rows without room (1,008 tokens) lay the hops 2 chunks apart instead, and
    rows too short for either are refused."""
    import types
    import tasks
    tokenizer_or_skip(monkeypatch)
    files = [os.path.join(HERE, "config", f) for f in ("passkey_pretrain.py", "passkey_finetune.py", "twohop.py")]
    for block, test in ((None, True), (1008, False)):
        c, _ = parse(files + ["--task_haystack=", "--groups=(1,1)"] + ([f"--block_size={block}"] if block else []))
        cfg = types.SimpleNamespace(**c)
        assert tasks.TaskRows(cfg).spacing == tasks.hop_spacing(cfg, test=test), block
    c, _ = parse(files + ["--task_haystack=", "--groups=(1,1)", "--block_size=504"])
    with pytest.raises(ValueError, match="raise --block_size"):
        tasks.TaskRows(types.SimpleNamespace(**c))


def test_needle_labels_of_two_groups(monkeypatch):
    """tasks.needle_labels on config/twohop.py's rows with two groups: a one-hop row labels group 1 alone, at the
    landmark that serves the answer; a 2-hop row labels group 1 at the landmark after "?" with the chunk of
    "VAR Y = X." and group 2 at the one that serves the answer with the chunk of "VAR X = <answer>."."""
    import random
    import types
    import tasks
    enc = tokenizer_or_skip(monkeypatch)
    files = [os.path.join(HERE, "config", f) for f in ("passkey_pretrain.py", "passkey_finetune.py", "twohop.py")]
    c, _ = parse(files + ["--task_haystack=", "--batch_size=32", "--groups=(1,1)"])
    T, rows = c["chunk_size"] - 1, tasks.TaskRows(types.SimpleNamespace(**c))
    x, y, hop1 = rows.batch("train", random.Random(2), True)
    labels = tasks.needle_labels(x, y, T, 2, hop1)  # (B, G, n)
    assert labels.shape == (x.size(0), 2, x.size(1) // T)
    two = 0
    for b in range(x.size(0)):
        p = int((y[b] >= 0).nonzero()[0, 0])
        text, answer = enc.decode(x[b, :p].tolist()), enc.decode(y[b, y[b] >= 0].tolist()[:-1])
        got = [(labels[b, g] >= 0).nonzero().flatten().tolist() for g in range(2)]
        if "VAR" not in text:
            assert got[1] == [] and got[0] in ([], [p // T - 1]), (b, got)
            continue
        two += 1
        asked = re.search(r"What is the value of VAR (\w+)\?", text)[1]
        ask = next(i for i in range(p) if enc.decode(x[b, :i + 1].tolist()).endswith(f"VAR {asked}?"))
        assert got == [[ask // T], [p // T - 1]], (b, got)
        chunk = lambda t: enc.decode(x[b, max(t - 1, 0) * T:(t + 2) * T].tolist())  # noqa: E731  a needle may cross
        hop1 = re.search(rf"VAR {asked} = (\w+)\.", text)[1]
        assert f"VAR {asked} = {hop1}." in chunk(int(labels[b, 0, ask // T]))
        assert f"VAR {hop1} ={answer}." in chunk(int(labels[b, 1, p // T - 1]))
    assert 8 <= two <= 24  # half the rows 2-hop


def test_needle_rank_loss_against_a_loop():
    """teacher.needle_rank_loss: the mean over labelled landmarks of -log softmax of Eq. 1's scores at the needle, over
    the row's earlier chunks but the needle's neighbours and the other rows' chunks before their own landmark, off
    their needle and its neighbours; its gradient raises the needle's score over its rivals."""
    import math
    from teacher import needle_rank_loss
    torch.manual_seed(0)
    B, n, C = 4, 7, 8
    q, l = torch.randn(B, n, C, requires_grad=True), torch.randn(B, n, C)
    needles = torch.full((B, n), -1)
    needles[0, 5], needles[1, 6], needles[2, 2] = 1, 3, 0  # row 3: no label, so none of its chunks is a rival
    want = 0
    for b in range(3):
        t = int((needles[b] >= 0).nonzero()[0, 0])
        j = int(needles[b, t])
        rivals = [(b, k) for k in range(t) if abs(k - j) != 1]
        for b2 in range(3):
            t2 = int((needles[b2] >= 0).nonzero()[0, 0])
            j2 = int(needles[b2, t2])
            rivals += [(b2, k) for k in range(t2) if abs(k - j2) > 1] if b2 != b else []
        s = torch.stack([q[b, t] @ l[b2, k] / math.sqrt(C) for b2, k in rivals])
        want = want - torch.log_softmax(s, 0)[rivals.index((b, j))] / 3
    got = needle_rank_loss(q, l, needles)
    torch.testing.assert_close(got, want)
    got.backward()
    assert torch.isfinite(q.grad).all() and q.grad[3].abs().sum() == 0 and q.grad[0, 5].abs().sum() > 0
    with torch.no_grad():
        before = q[0, 5] @ l[0, 1] - (q[0, 5] @ l[0, 3])
        q -= 0.1 * q.grad
        assert q[0, 5] @ l[0, 1] - (q[0, 5] @ l[0, 3]) > before
    assert needle_rank_loss(q, l, torch.full((B, n), -1)) == 0


def test_needle_loss_trains_and_checks(tmp_path, monkeypatch):
    """--needle_loss: each training micro-batch's labels meet the Eq. 1 queries its forward recorded (evaluation has
    none), and the run trains; a text dataset, which has no needles, is refused before anything is made."""
    tokenizer_or_skip(monkeypatch)
    seen, orig = [], teacher.needle_loss

    def spy(record, labels):
        seen.append((tuple(labels.shape), [r[1].requires_grad for r in record if r[0] == "eq1"]))
        return orig(record, labels)
    monkeypatch.setattr(teacher, "needle_loss", spy)
    args = ["--dataset=passkey", "--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1", "--chunk_size=8",
            "--window=16", "--topk=3", "--block_size=70", "--batch_size=4", "--tokens_per_step=560", "--max_iters=2",
            "--eval_interval=2", "--eval_iters=1", "--device=cpu", "--needle_loss=0.5", f"--out_dir={tmp_path / 'n'}"]
    hist = train.main(args)  # two micro-batches a step
    assert all(np.isfinite(loss) for _, loss in hist)
    assert seen == [((4, 1, 70 // 7), [True])] * 4  # one group's queries, in the graph
    with pytest.raises(train.ConfigError, match="needle_loss"):
        train.main(tiny_args(tmp_path, "text", "--needle_loss=0.5", "--max_iters=2"))


def test_needle_loss_under_compile():
    """The needle loss reads Eq. 1's queries and landmarks from DRT.recording(): under torch.compile (one graph;
    aot_eager traces and differentiates as on the GPU) the answer's loss with it, and every gradient, are eager's."""
    from conftest import tiny_model, tokens
    torch._dynamo.reset()
    model = tiny_model(groups=(1, 1), dtype=torch.float32, gumbel=False).train()
    idx = tokens(model.config, 2, 10 * 7, seed=3)
    labels = torch.full((2, 2, 10), -1)  # (B, G, n)
    labels[0, 0, 6], labels[0, 1, 8], labels[1, :, 9] = 2, 4, 5  # row 0: two hops; row 1: one, in both groups

    def step(run):
        with model.recording() as record:
            _, loss = run(idx, idx)
        total = loss + 0.5 * teacher.needle_loss(record, labels)
        model.zero_grad()
        total.backward()
        return [total.detach()] + [p.grad.clone() for p in model.parameters()]
    eager = step(model)
    for a, b in zip(eager, step(torch.compile(model, backend="aot_eager", fullgraph=True))):
        torch.testing.assert_close(a, b)


def test_train_embeddings_false_keeps_them(tmp_path):
    """--train_embeddings=False: a fine-tune leaves init_from's token embeddings (so the tied output layer) as they were
    while the rest trains, and resumes so; a run from scratch, which would keep random ones, is refused."""
    train.main(tiny_args(tmp_path, "base", "--max_iters=2"))
    base = load_ckpt(tmp_path / "base")["model"]
    train.main(tiny_args(tmp_path, "ft", f"--init_from={tmp_path / 'base'}", "--train_embeddings=False",
                         "--max_iters=4", "--stop_iter=2"))
    train.main([f"--out_dir={tmp_path / 'ft'}", "--init_from=resume"])
    ft = load_ckpt(tmp_path / "ft")
    assert ft["iter_num"] == 4
    assert torch.equal(ft["model"]["wte.weight"], base["wte.weight"])
    assert any(not torch.equal(ft["model"][k], base[k]) for k in base if k != "wte.weight")
    with pytest.raises(train.ConfigError, match="train_embeddings=False"):
        train.main(tiny_args(tmp_path, "scratch", "--train_embeddings=False", "--max_iters=2"))
