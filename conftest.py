"""
Shared helpers of the tests (pytest loads this file first): tiny models and random text ids, tiny
datasets and train.py arguments, checkpoints, the GPT-2 tokenizer (or a skip). On a CPU, FlashGCA
runs in Triton's interpreter: TRITON_INTERPRET is set here, before anything imports triton.
"""

import json
import os
import re
import signal
import subprocess
import threading

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton (gca_kernel)

import configurator
import model as drt
import prepare_pg19
import train
from model import DRT, DRTConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel tests: natively on a GPU, interpreted on a CPU


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_config(**kw):
    """A DRT small enough for CPU tests but with every part in it: S=8 (7 tokens + landmark),
    W=16 (2 chunks), K=3, one lower layer, groups of one layer."""
    cfg = dict(vocab_size=96, landmark_id=95, n_embd=32, n_head=4, n_lower=1, groups=(1,), n_enc=1,
               chunk_size=8, window=16, topk=3)
    cfg.update(kw)
    return DRTConfig(**cfg)


def tiny_model(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    return DRT(tiny_config(**kw)).to(dtype)


def tokens(cfg, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.landmark_id, (B, T), generator=g)  # text ids: below the landmark


def all_logits(model, idx, state=None):
    """Logits at every text position: a whole row's, or a stream segment's (scoring it asks for all of them)."""
    logits, _ = model(idx) if state is None else model(idx, torch.zeros_like(idx), state=state)
    return logits


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tokenizer_or_skip(monkeypatch):
    # offline, DRT_GPT2_RANKS names GPT-2's ranks file; without it tiktoken must download 'gpt2'
    # (monkeypatch: unused, kept so that the callers stay as they are)
    try:
        return prepare_pg19.get_tokenizer()
    except (RuntimeError, FileNotFoundError) as e:
        pytest.skip(f"no GPT-2 tokenizer: {e}")


def retrievals(record):
    """The retrievals (chunk ids, idx, w) of DRT.recording()'s record, without its Eq. 1 queries and GCA reads."""
    return [r[1:] for r in record if r[0] == "picks"]


HERE = os.path.dirname(os.path.abspath(__file__))


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


def parse(argv):
    return configurator.configure(argv, train.DEFAULTS, train.KINDS)


def start_run(cmd, pid_files=(), timeout=90):
    """Popen cmd in a process group of its own (so a signal can go to the group, as a terminal's Ctrl-C
    does), killed after timeout seconds whatever happens, so a hung run cannot hang the tests."""
    proc = subprocess.Popen(cmd, cwd=HERE, env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "6"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    proc.pid_files = pid_files
    proc.killer = threading.Timer(timeout, end_run, [proc])
    proc.killer.daemon = True
    proc.killer.start()
    return proc


def end_run(proc):
    """Kill what is left of proc's process group, and of the groups of torchrun's workers (pid_files)."""
    proc.killer.cancel()
    for pid in [proc.pid] + [int(f.read_text()) for f in proc.pid_files if f.exists()]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def read_until(stream, pattern):
    """The lines of stream up to the first that matches pattern (all of them if none does)."""
    lines = []
    for line in stream:
        lines.append(line)
        if re.match(pattern, line):
            break
    return "".join(lines)


def tiny_checkpoint(path, **kw):
    """A random GPT-2-vocabulary DRT saved the way train.py saves (model, model_args)."""
    from dataclasses import asdict
    kw = {"n_embd": 32, "n_head": 4, "n_lower": 1, "groups": (1,), "n_enc": 1, "window": 128, "topk": 2, **kw}
    cfg = DRTConfig(**kw)
    torch.manual_seed(0)
    torch.save({"model": DRT(cfg).state_dict(), "model_args": asdict(cfg), "iter_num": 7}, path)
    return str(path)


def spy_retrieval(monkeypatch):
    """Record what retrieve scores with: [(q (B, n, C), landmarks (B, M, C))] per call of topk_earlier."""
    seen, orig = [], drt.topk_earlier

    def spy(q, pages, chunk_ids, k, noise=False, uniform=False):
        seen.append((q, torch.cat(list(pages), 1)))
        return orig(q, pages, chunk_ids, k, noise, uniform)
    monkeypatch.setattr(drt, "topk_earlier", spy)
    return seen
