"""
Tests of bench.py: with nothing to do, or nothing it can do, it says so and fails.
"""

import re

import pytest
import torch

import common
from conftest import rel_err
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
], ids=["nothing to do", "steps", "rep", "lengths", "n_embd", "model", "lengths-zero", "model-key", "model-case-key"])
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
    with pytest.raises(SystemExit, match=r"^bench.py: error: --lengths: a 64K-token prompt holds 0.14 GB of chunk "
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
    first one DRT's training shape, and its naive path (what FlashGCA is timed against) is the reference GCA."""
    import bench
    cfg = DRTConfig()
    B, C, M, S, H, D, K = bench.SHAPES[0][:7]
    assert (C, M, S, H, D, K) == (16380 // (cfg.chunk_size - 1),) * 2 + (cfg.chunk_size, cfg.n_head,
                                                                          cfg.n_embd // cfg.n_head, cfg.topk)
    shape = (2, 5, 5, 8, 2, 16, 3, torch.float32, "hot")
    q, k, v, idx, w, do = bench.make_inputs(shape, seed=int(torch.randint(1 << 30, ())), device="cpu")
    assert q.shape == do.shape == (2, 5, 8, 2, 16) and k.shape == v.shape == (2, 5, 8, 2, 16) and idx.shape == (2, 5, 3)
    assert (idx[:, 1:, 0] == 0).all() and (w[:, 0] == 0).all()  # hot: chunk 0 first; chunk 0 has nothing to pick
    assert rel_err(bench.gca_naive(q, k, v, idx, w), gca_reference(q, k, v, idx, w)) < 1e-5
