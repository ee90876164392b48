"""
Tests of bench.py: with nothing to do, or nothing it can do, it says so and fails; on a CPU its smoke
run is toy-sized and prints every model's row.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

import common
from conftest import HERE, tiny_model
from model import DRTConfig, gca_reference

# -----------------------------------------------------------------------------
# benchmarks (bench.py): with nothing to do, or nothing they can do, they say so and fail


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to do: pass --kernel, --train, --long, or several"),
    (["--train", "--steps=0"], "--steps=0: must be >= 1"),
    (["--kernel", "--rep=0"], "--rep=0: must be >= 1"),
    (["--long", "--lengths=4Q"], "--lengths='4Q': expected a list"),
    (["--long", "--n_embd=100"], "--n_embd=100: must be a multiple of 64"),
    (["--train", "--model=n_embd=64"], "--model='n_embd=64': expected a dict"),
    (["--long", "--lengths=0", "--device=cpu"], "--lengths=0: every length must be at least 1 token"),
    (["--train", "--model={'nope': 1}", "--device=cpu"], "--model: 'nope' cannot be set: give DRTConfig's fields but"),
    (["--train", "--model={'groups': ()}", "--device=cpu"], "--model: 'groups' cannot be set"),
    # train.py's rule: at least 2 chunks and a token, GCA's first (chunks of 64 on a GPU, the toy's 16 on a CPU)
    (["--train", "--block_size=126"], "--block_size=126 gives fewer than 3 chunks, so GCA would never run: use "
                                      "--block_size >= 127 (best a multiple of chunk_size-1=63)"),
    (["--train", "--block_size=10", "--device=cpu"], "--block_size=10 gives fewer than 3 chunks, so GCA would never "
                                                     "run: use --block_size >= 31 (best a multiple of chunk_size-1=15)"),
], ids=["nothing to do", "steps", "rep", "lengths", "n_embd", "model", "lengths-zero", "model-key", "model-case-key",
        "block_size", "block_size-cpu"])
def test_bench_usage_errors(argv, message, capsys):
    import bench
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage:") and f"error: {message}" in err


@pytest.mark.parametrize("mode", ["--kernel", "--train", "--long"])
def test_bench_without_gpu(mode, monkeypatch):
    """No GPU: each mode of bench.py fails in one line (nothing was timed) and names the CPU kernel
    tests, which exist."""
    import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.main([mode])
    msg = str(e.value.code)
    assert msg.startswith("bench.py: error: no CUDA GPU") and "\n" not in msg
    k = re.search(r"python -m pytest -q test_gca.py -k (\w+)$", msg).group(1)
    import test_gca
    assert [n for n in vars(test_gca) if n.startswith("test_flash_gca") and k in n]  # run on a CPU, not CUDA-only


def test_bench_long_checks_lengths(monkeypatch):
    """bench.py --long refuses, before streaming, what sample.py refuses: past 64M tokens, or chunk memory
    past what is available."""
    import bench
    monkeypatch.setattr(bench, "DRT", lambda cfg: pytest.fail("started"))
    with pytest.raises(SystemExit, match=r"^bench.py: error: --lengths: 1024M tokens is past the 64M DRT's streams"):
        bench.main(["--long", "--device=cpu", "--lengths=64K,1G"])
    monkeypatch.setattr(common, "available_mem", lambda: 10**6)
    kv = 65536 / 63 * 64 * 2 * 256 * 4 / 1e9  # positions (a landmark per 63 tokens) x keys and values x d=256 x fp32
    with pytest.raises(SystemExit, match=rf"^bench.py: error: --lengths: a 64K-token prompt holds {kv:.2f} GB of chunk "
                                         r"keys/values in host memory, and 0.00 GB are available: use shorter lengths$"):
        bench.main(["--long", "--device=cpu", "--lengths=64K"])


def test_bench_cuda_device_has_an_index(monkeypatch):
    """bench.py --device=cuda (the default) selects the GPU with an index: torch.cuda.set_device
    refuses a bare 'cuda'. Checked through torch's own index check, with a pretend GPU."""
    import bench
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(torch.cuda._utils._get_device_index(d)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "pretend GPU")
    monkeypatch.setattr(bench, "bench_long", lambda args, dev: seen.append(dev))
    bench.main(["--long"])
    assert seen == [0, torch.device("cuda", 0)]


def test_bench_kernel_inputs():
    """bench.py --kernel's shapes are in the kernel tests' order (B, C, M, S, H, D, K, dtype, note), the
    first one DRT's training shape, and its PyTorch path (what FlashGCA is timed against) is the model's reference GCA."""
    import bench
    cfg = DRTConfig()
    B, C, M, S, H, D, K = bench.SHAPES[0][:7]
    assert (C, M, S, H, D, K) == (16380 // (cfg.chunk_size - 1),) * 2 + (cfg.chunk_size, cfg.n_head,
                                                                          cfg.n_embd // cfg.n_head, cfg.topk)
    shape = (2, 5, 5, 8, 2, 16, 3, torch.float32, "hot")
    q, k, v, idx, w, do = bench.make_inputs(shape, seed=int(torch.randint(1 << 30, ())), device="cpu")
    assert q.shape == do.shape == (2, 5, 8, 2, 16) and k.shape == v.shape == (2, 5, 8, 2, 16) and idx.shape == (2, 5, 3)
    assert (idx[:, 1:, 0] == 0).all() and (w[:, 0] == 0).all()  # hot: chunk 0 first; chunk 0 has nothing to pick
    assert bench.gca_reference is gca_reference  # the PyTorch path timed against FlashGCA is the model's own


def test_flops_per_token_scores_the_output_layer_where_logits_are_made():
    """MFU's FLOPs: the tied output layer's 2 x 3 per weight at the share of positions that make logits (task rows:
    their answer), every other matmul at every position."""
    model = tiny_model()
    full, none, some = (common.flops_per_token(model, logit_share) for logit_share in (1.0, 0.0, 0.25))
    assert full - none == 6 * model.wte.weight.numel() and some == pytest.approx(none + 0.25 * (full - none))
    assert none > 6 * (model.num_params() - model.wte.weight.numel())  # plus attention


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS caps a process's memory on Linux")
def test_bench_cpu_smoke_run():
    """bench.py --train --long --device=cpu, as --help offers it: toy sizes (within 4 GiB of address space and
    two minutes; the paper's sizes took 24 GB and were killed), a row for every model --train times, a line
    saying why the compiled and Triton rows are not run, and peak memory the host's (not nan)."""
    import bench
    limit = 4 * 2**30

    def cap():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    run = subprocess.run([sys.executable, "bench.py", "--train", "--long", "--device=cpu"], cwd=HERE, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, preexec_fn=cap)
    out = run.stdout
    assert run.returncode == 0, run.stderr[-2000:]
    assert "nan" not in out.lower(), out
    rows = re.findall(r"^(DRT x\d|baseline) +(\S+) +(yes|no) +[\d.]+M +1 x (\d+) +\| +[\d.]+ +[\d,]+ +n/a +([\d.]+)G ",
                      out, re.M)  # model, GCA, compile, T, peak memory
    assert sorted(name for name, *_ in rows) == sorted({name for name, *_ in bench.TRAIN_CASES}), out
    assert all(compiled == "no" and gca in ("torch", "-") for _, gca, compiled, _, _ in rows), out
    assert all(0 < float(peak) < limit / 2**30 for *_, peak in rows), out
    assert all(int(T) == bench.TOY_TRAIN["block_size"] for *_, T, _ in rows), out
    why = [line for line in out.splitlines() if line.startswith("cpu: ")]
    assert len(why) == 1 and "torch.compile" in why[0] and "Triton" in why[0], out
    lengths = re.findall(r"^ +(\w+) \| +[\d.]+ +[\d,]+ \| +- +[\d.]+G +\d+ +([\d.]+)G$", out, re.M)
    assert [n for n, _ in lengths] == bench.TOY_LENGTHS.split(",") and all(float(h) > 0 for _, h in lengths), out
