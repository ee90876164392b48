"""
Tests of the scripts in dev/: the side-by-side runner, on commands that finish, fail, save on SIGTERM or ignore it;
the golden check, which must find a value that changed; the 2-hop probe's ranks.
"""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dev"))
import hops  # noqa: E402
import side_by_side  # noqa: E402

SAVES_ON_TERM = (f'{sys.executable} -c "import signal, sys, time; '
                 f'signal.signal(signal.SIGTERM, lambda *a: (print(\'saved\', flush=True), sys.exit(0))); '
                 f'print(\'started\', flush=True); time.sleep(60)"')
IGNORES_TERM = (f'{sys.executable} -c "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); '
                f'print(\'started\', flush=True); time.sleep(60)"')


def test_side_by_side_runs_logs_and_stops(tmp_path, capsys):
    """Each run has its own log; runs going at the deadline get SIGTERM (one that saves on it exits 0), one that
    ignores it gets SIGKILL after the grace; the others' exit codes are theirs; all in parallel, not in turn."""
    t0 = time.time()
    codes = side_by_side.main(["--deadline=2", "--grace=2", f"--logs={tmp_path}", "ok:echo hello",
                               "fails:exit 3", f"saves:{SAVES_ON_TERM}", f"stubborn:{IGNORES_TERM}"])
    took = time.time() - t0
    assert codes["ok"] == 0 and codes["fails"] == 3 and codes["saves"] == 0 and codes["stubborn"] == -9
    assert 4 <= took < 20  # the deadline, then the grace: not 60 s of sleep, nor the runs one after another
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in codes}
    assert logs["ok"].splitlines() == ["+ echo hello", "hello"]
    assert logs["saves"].splitlines()[-2:] == ["started", "saved"]
    out = capsys.readouterr().out
    assert "deadline 2 s: SIGTERM" in out and "2 s later: SIGKILL" in out
    assert "== saves: exit 0\n" in out and "   started\n   saved\n== stubborn: exit -9" in out


@pytest.mark.parametrize("runs, message", [(["nocolon"], "expected NAME:COMMAND"), ([":echo"], "expected NAME"),
                                           (["a:echo", "a:echo"], "two runs share a name")])
def test_side_by_side_refuses_bad_runs(runs, message, capsys):
    with pytest.raises(SystemExit):
        side_by_side.main(runs)
    assert message in capsys.readouterr().err


def test_golden_saves_checks_and_finds_a_change(tmp_path):
    """dev/golden.py: --check after --save finds every value bit for bit the same; a value changed in the file (one
    gradient entry by one part in 10^6) is named, and the check fails."""
    import subprocess

    import torch
    golden = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "dev", "golden.py")]
    file = str(tmp_path / "golden.pt")
    subprocess.run(golden + ["--save", file, "--parts=a"], check=True, capture_output=True)
    ok = subprocess.run(golden + ["--check", file, "--parts=a"], capture_output=True, text=True)
    assert ok.returncode == 0 and "bit for bit the same" in ok.stdout, ok.stdout + ok.stderr
    values = torch.load(file)
    key = next(k for k in values if ".grad.upper.0.q_proj" in k)
    values[key].view(-1)[0] *= 1 + 1e-6
    torch.save(values, file)
    bad = subprocess.run(golden + ["--check", file, "--parts=a"], capture_output=True, text=True)
    assert bad.returncode == 1 and f"{key}: 1 of {values[key].numel()} differ" in bad.stdout, bad.stdout + bad.stderr


def test_hops_ranks_each_hop_and_runs(tmp_path, monkeypatch, capsys):
    """dev/hops.py: a hop's rank counts the chunks scoring above its own, its next chunk (which may hold part of the
    needle) no rival; the margin is over the best rival. It runs on a 2-group checkpoint, one row per length and
    filler (its hops' ranks and the answer as read, without group 2, without group 1 at the answer), and refuses --hand
    on one group."""
    import torch
    from conftest import tiny_checkpoint, tokenizer_or_skip

    assert hops.rank_and_margin(torch.tensor([1.0, 5.0, 3.0, 9.0, 2.0]), 1) == (1, -4.0)
    assert hops.rank_and_margin(torch.tensor([1.0, 5.0, 9.0, 3.0]), 1) == (0, 2.0)
    tokenizer_or_skip(monkeypatch)
    two = tiny_checkpoint(tmp_path / "two.pt", groups=(1, 1))
    hops.main([f"--out_dir={two}", "--lengths=1008", "--samples=2", "--haystack=", "--hand=filler"])
    rows = capsys.readouterr().out.splitlines()
    assert "group 1 reading filler at hop 1's landmark" in rows[0]
    assert len(rows) == 3 and rows[2].split()[:2] == ["1008", "sentences"] and rows[2].count("/2") == 5  # 2 hops, 3 answer columns
    with pytest.raises(SystemExit):
        hops.main([f"--out_dir={tiny_checkpoint(tmp_path / 'one.pt')}", "--haystack=", "--hand=hop1"])
    assert "--hand needs two groups" in capsys.readouterr().err
