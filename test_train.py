"""
Tests for train.py: configuration and its errors, exact resume, DDP (torchrun on CPU, gloo),
a synthetic task. Tiny models on tiny data: the whole file runs in about 10 s on 2 CPU cores.

    python -m pytest -q test_train.py
"""

import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import train
from model import DRTConfig

HERE = os.path.dirname(os.path.abspath(__file__))

# a DRT with every part in it (S=8: 7 tokens + landmark, W=16, K=3), on 5 chunks of 7 tokens
TINY = ["--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1", "--chunk_size=8", "--window=16",
        "--topk=3", "--vocab_size=96", "--landmark_id=95", "--block_size=35", "--batch_size=2", "--tokens_per_step=0",
        "--max_iters=6", "--eval_interval=3", "--eval_iters=2", "--log_interval=1", "--learning_rate=1e-2",
        "--min_lr=1e-3", "--warmup_frac=0.2", "--device=cpu"]


def tiny_dataset(folder, vocab=95):
    """train.bin / val.bin of random uint16 ids and the meta.json that marks them complete. The ids
    use 16 of the vocab's values, so the loss has something to learn at once."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in [("train", 5000), ("val", 1000)]:
        rng.integers(vocab - 16, vocab, n, dtype=np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"tokenizer": "random", "vocab_size": vocab, "splits": {}}, f)
    return str(folder)


def tiny_args(tmp_path, run, *extra):
    return [*TINY, f"--data_dir={tiny_dataset(tmp_path / 'data')}", f"--out_dir={tmp_path / run}", *extra]


def load_ckpt(path):
    return torch.load(os.path.join(path, "ckpt.pt"), map_location="cpu")


# -----------------------------------------------------------------------------


def test_config_block_and_help(capsys):
    """Every key has a why-comment in the block; the model keys are DRTConfig's fields and their
    defaults the paper's 146M model; --help lists every key; the shipped config files parse."""
    keys = [k for k, _ in train.BLOCK if k]
    assert len(keys) == len(set(keys)) and all(comment for _, comment in train.BLOCK)
    assert set(train.MODEL_KEYS) <= set(keys)
    assert DRTConfig(**{k: train.DEFAULTS[k] for k in train.MODEL_KEYS}) == DRTConfig()
    assert train.main(["--help"]) == []
    out = capsys.readouterr().out
    assert all(f"--{k}=" in out for k in keys)
    configs = sorted(glob.glob(os.path.join(HERE, "config", "*.py")))
    assert len(configs) >= 4
    for path in configs:
        c, explicit = train.parse_config([path])
        train.check_config(c)
        DRTConfig(**{k: c[k] for k in train.MODEL_KEYS})
        assert explicit


def test_overrides():
    c, explicit = train.parse_config(["--groups=3,3", "--learning_rate=1", "--out_dir=out-x", "--dataset=passkey",
                                      "--compile=True", "--groups=()"])
    assert c["groups"] == () and c["learning_rate"] == 1.0 and type(c["learning_rate"]) is float
    assert c["out_dir"] == "out-x" and c["dataset"] == "passkey" and c["compile"] is True
    assert explicit == {"groups", "learning_rate", "out_dir", "dataset", "compile"}


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


def test_passkey_task(tmp_path, monkeypatch):
    ranks = os.path.join(HERE, "..", "shared", "data", "tokenizers", "gpt2.tiktoken")
    if "DRT_GPT2_RANKS" not in os.environ and os.path.isfile(ranks):
        monkeypatch.setenv("DRT_GPT2_RANKS", ranks)
    hist = train.main(["--dataset=passkey", "--n_embd=32", "--n_head=4", "--n_lower=1", "--groups=1,", "--n_enc=1",
                       "--chunk_size=8", "--window=16", "--topk=3", "--block_size=70", "--batch_size=2", "--tokens_per_step=0",
                       "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--log_interval=1", "--device=cpu",
                       f"--out_dir={tmp_path / 'out'}"])
    assert [it for it, _ in hist] == [1, 2] and all(np.isfinite(loss) for _, loss in hist)
    assert load_ckpt(tmp_path / "out")["model_args"]["vocab_size"] == 50304  # GPT-2's vocabulary


@pytest.mark.parametrize("argv, message", [
    (["--lerning_rate=1e-3"], r"unknown key 'lerning_rate' \(did you mean learning_rate\?\)"),
    (["--max_iters=1.5"], r"max_iters must be of type int like its default 60000, got 1.5"),
    (["--groups=3"], r"groups must be of type tuple"),
    (["--compile=1"], r"compile must be of type bool"),
    (["--batch_size"], r"write overrides as --key=value"),
    (["--block_size=0"], r"block_size=0 must be a positive int"),
    (["config/nothing.py"], r"config file config/nothing.py not found"),
], ids=["unknown-key", "float-for-int", "int-for-tuple", "int-for-bool", "no-value", "block-size", "no-file"])
def test_config_errors(argv, message):
    with pytest.raises(train.ConfigError, match=message):
        train.main(argv)


def test_config_file_unknown_key(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text("import math\nbatch_size = 2\nn_emdb = 64\n")
    with pytest.raises(train.ConfigError, match=r"bad.py: unknown key 'n_emdb' \(did you mean n_embd\?\)"):
        train.main([str(path)])


def test_setup_errors(tmp_path):
    with pytest.raises(train.ConfigError, match=r"meta.json not found: prepare the data first, e.g. python prepare_pg19.py"):
        train.main([*TINY, f"--data_dir={tmp_path / 'nothing'}", f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(train.ConfigError, match=r"val.bin has 1,000 tokens, fewer than block_size\+1=1,009; lower --block_size"):
        train.main(tiny_args(tmp_path, "out", "--block_size=1008"))
    with pytest.raises(train.ConfigError, match=r"tokens_per_step=100 is not a multiple of batch_size\*block_size\*GPUs"):
        train.main(tiny_args(tmp_path, "out", "--tokens_per_step=100"))
    with pytest.raises(train.ConfigError, match=r"gives fewer than 3 chunks"):
        train.main(tiny_args(tmp_path, "out", "--block_size=14"))
    with pytest.raises(train.ConfigError, match=r"landmark_id=95 must lie above them"):
        train.main([*TINY, f"--data_dir={tiny_dataset(tmp_path / 'big', vocab=200)}", f"--out_dir={tmp_path / 'out'}"])
    (tmp_path / "a_file").write_text("")
    with pytest.raises(train.ConfigError, match=r"is not writable .*: pass --out_dir="):
        train.main(tiny_args(tmp_path, "a_file/out"))
    with pytest.raises(train.ConfigError, match=r"no checkpoint at .*ckpt.pt: use --init_from=scratch"):
        train.main(tiny_args(tmp_path, "empty", "--init_from=resume"))


def test_resume_conflicting_model(tmp_path):
    train.main(tiny_args(tmp_path, "run", "--max_iters=1", "--eval_interval=1", "--eval_iters=1"))
    with pytest.raises(train.ConfigError, match=r"has n_embd=32, the config asks 64: drop --n_embd .* or start a new out_dir"):
        train.main(tiny_args(tmp_path, "run", "--init_from=resume", "--n_embd=64", "--max_iters=2"))
    # model keys left out are taken from the checkpoint
    no_model_keys = [a for a in tiny_args(tmp_path, "run", "--init_from=resume", "--max_iters=2")
                     if a.split("=")[0][2:] not in train.MODEL_KEYS]
    assert [it for it, _ in train.main(no_model_keys)] == [2]
