"""
Tests of the language-model instruments: in-context copying (--copying), perplexity by position
(--ppl), the picks (--inspect), the plots, and retrieval's statistics.
"""

import json
import math
import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import common
import fused
import model as drt
import prepare_pg19
from conftest import all_logits, retrievals, tiny_checkpoint, tiny_model, tokenizer_or_skip, tokens


def test_copying_passes(tmp_path, monkeypatch, capsys):
    """--copying: a perfect induction copier scores ln(V) on pass 1 and 0 after, near and far (a
    pass's first token, which no earlier occurrence predicts, left out); one that copies only
    within its reach scores ln(V) far; the flag runs on a checkpoint, with book text too."""
    import math
    from types import SimpleNamespace

    import evaluate

    class Induction(torch.nn.Module):  # copies from L and from L_far back, where those are within its reach
        config = SimpleNamespace(window=128, chunk_size=64, n_lower=1, groups=(2,), retriever="learned", topk=2, code_read=False)

        def __init__(self, reach):
            super().__init__()
            self.w, self.reach = torch.nn.Parameter(torch.zeros(1)), reach

        def forward(self, idx, targets=None, state=None, picks=None):
            n, T = idx.shape
            logits = torch.zeros(n, T, 50304)
            logits[:, :, 50257:] = -1e9  # V = 50257 live tokens: a uniform guess costs ln(V)
            L, L_far = evaluate.copy_span(self.config), evaluate.copy_far_span(self.config)
            for back in (L, L_far):  # L_far back wins a (rare) tie
                if back <= self.reach:
                    for t in range(back, T):
                        seen = idx[:, t - back] == idx[:, t]
                        logits[seen, t, idx[seen, t - back + 1]] = 1e4 * (1 + (back == L_far))
            return None, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    args, ctx, lnV = SimpleNamespace(seed=0, samples=2), torch.autocast("cpu", enabled=False), math.log(50257)
    assert evaluate.copy_far_span(Induction.config) == 392  # 3 layers x 128 positions + 8
    (p1, p2, p3, far1, far, twins), = evaluate.copy_test(Induction(reach=10**6), args, ctx).values()
    assert abs(p1 - lnV) < 1e-3 and p2 < 1e-3 and p3 < 1e-3 and abs(far1 - lnV) < 1e-3 and far < 1e-3 and twins < 1e-3
    (p1, p2, p3, far1, far, twins), = evaluate.copy_test(Induction(reach=384), args, ctx).values()  # the windows' reach only
    assert abs(p1 - lnV) < 1e-3 and p2 < 1e-3 and p3 < 1e-3 and abs(far1 - lnV) < 1e-3 and abs(far - lnV) < 1e-3
    capsys.readouterr()
    enc = tokenizer_or_skip(monkeypatch)
    np.array(enc.encode_ordinary(" Call me Ishmael. Some years ago, never mind how long. " * 100),
             np.uint16).tofile(tmp_path / "book.bin")
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")
    evaluate.main([f"--ckpt={ckpt}", "--copying", "--samples=2", "--device=cpu", f"--haystack={tmp_path / 'book.bin'}"])
    rows = re.findall(r"(random tokens|haystack text)((?:\s+\d+\.\d\d){6})$", capsys.readouterr().out, re.M)
    assert [r[0] for r in rows] == ["random tokens", "haystack text"]
    assert all(4 < float(v) < 20 for _, vals in rows for v in vals.split())  # an untrained model: no copying


def test_twins_handed_to_gca():
    """--copying's twins column: each chunk of a span's second reading is handed the chunks of the first
    reading that hold its text, strictly earlier; DRT.forward(picks=...) reads them, keeps Eq. 1's picks
    where it says -1, and with -1 everywhere changes nothing; a stream takes no picks."""
    import evaluate
    k, S = 30, 8
    model = tiny_model(groups=(1, 1), softmax_off_by_one=False)
    picks = evaluate.twin_picks(k, model.config, 2 * k // (S - 1))  # (n, K)
    handed = 0
    for c, row in enumerate(picks.tolist()):
        need = {t % k for t in range((S - 1) * (c + 1), min((S - 1) * (c + 2), 2 * k))}  # chunk c+1's text
        if row[0] < 0:
            assert (S - 1) * (c + 1) < k + S - 1 or c + 1 >= 2 * k // (S - 1)  # no whole twin earlier than c
            continue
        handed += 1
        have = {t for j in row for t in range((S - 1) * j, (S - 1) * (j + 1))}
        assert max(row) < c and need <= have, (c, row)
    assert handed >= 3
    model.eval()
    x = tokens(model.config, 2, k, seed=5).repeat(1, 2)  # (2, 2k): the span read twice
    plain = all_logits(model, x)
    with model.recording() as record:
        handed_logits = model(x, picks=picks)[0]
    got = [idx for _, idx, _ in retrievals(record)]  # the picks (B, n, K), per group
    assert len(got) == 2
    for idx in got:
        want = picks[: idx.size(1)]
        assert torch.equal(idx[:, want[:, 0] >= 0], want[want[:, 0] >= 0].expand(2, -1, -1))
    assert not torch.allclose(plain, handed_logits)  # GCA read other chunks
    assert torch.equal(model(x, picks=torch.full_like(picks, -1))[0], plain)
    with pytest.raises(ValueError, match="picks are handed in for a whole row"):
        model(x, state=model.new_state(), picks=picks)


def test_copying_holds_no_logits(tmp_path, monkeypatch, capsys):
    """--copying scores each pass through the chunked loss: no (spans, tokens, vocab) logits are
    ever held (13 GB on the quick start's model), and a long test says how far it got."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import evaluate
    tokenizer_or_skip(monkeypatch)

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.numel = max([self.numel] + [t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                             if isinstance(t, torch.Tensor)])
            return out

    monkeypatch.setattr(fused, "CE_ROWS", 64)
    monkeypatch.setattr(common, "PROGRESS_AFTER", -1)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt")  # far spans of 264 tokens, read twice
    with Largest() as largest:
        evaluate.main([f"--ckpt={ckpt}", "--copying", "--samples=4", "--device=cpu"])
    assert largest.numel <= 64 * 50304 < 4 * 527 * 50304 // 8
    assert len(re.findall(r"^  random tokens, \d+-token spans: \d/\d passes after \d+m\d\ds, ETA \d+m\d\ds$",
                          capsys.readouterr().out, re.M)) == 5  # 3 near passes, 2 far


def test_retrieval_stats():
    """retrieval_stats on hand-made picks: sum w, max w, the entropy of w / sum w and the distance
    in chunks, over the landmarks that have an earlier chunk (chunk 0's has none)."""
    t = torch.tensor([0, 1, 3])  # landmarks of chunks 0, 1, 3; K = 2, so chunk 1 has one eligible pick
    idx = torch.tensor([[[0, 0], [0, 0], [2, 0]]])
    w = torch.tensor([[[0.0, 0.0], [0.5, 0.0], [0.6, 0.2]]])
    st = common.retrieval_stats([("picks", t, idx, w)], 2)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert st["sum_w"] == pytest.approx(0.65) and st["max_w"] == pytest.approx(0.55)
    assert st["entropy"] == pytest.approx(h / 2) and st["distance"] == pytest.approx(5 / 3)
    assert common.retrieval_stats([], 2) == {}


def test_ppl_by_position(tmp_path, monkeypatch, capsys):
    """evaluate.py --ppl: a .bin of prepare_pg19.py is cut into its books at <|endoftext|>; every
    predicted token lands in the bucket of its position; a document streamed in segments scores
    what one call scores; 'none' scores as a model whose retrieval weights are zeroed by hand."""
    from types import SimpleNamespace

    import evaluate
    rng = np.random.default_rng(0)
    books = [rng.integers(0, 50257, n) for n in (1500, 300)]
    np.concatenate([books[0], [prepare_pg19.EOT], books[1], [prepare_pg19.EOT]]).astype(np.uint16).tofile(tmp_path / "t.bin")
    docs = evaluate.read_docs(str(tmp_path / "t.bin"), enc=None)
    assert [len(d) for _, d in docs] == [1500, 300] and all(np.array_equal(d, b) for (_, d), b in zip(docs, books))
    ckpt, _ = common.read_checkpoint(tiny_checkpoint(tmp_path / "ckpt.pt", window=64))
    model = common.build_model(ckpt, "cpu")
    args, ctx = SimpleNamespace(segment=100, offload=False, plot=None), torch.autocast("cpu", enabled=False)
    whole = evaluate.doc_nll(model, docs[0][1], SimpleNamespace(segment=10**6, offload=False), ctx)
    assert whole.shape == (1499,) and torch.allclose(evaluate.doc_nll(model, docs[0][1], args, ctx), whole, atol=1e-4)
    table = evaluate.perplexity({"learned": model, "none": common.build_model(ckpt, "cpu", "none")}, docs, args, ctx)
    assert [n for n, _ in table["learned"]] == [1023 + 299, 476, 0, 0, 0, 0, 0, 1798]  # 0-1K, 1K-4K, ..., all
    assert table["learned"][1][1] == pytest.approx(whole[1023:].mean().item(), abs=1e-4)
    out = capsys.readouterr().out
    assert re.search(r"^\s+1K-4K\s+476\s+\d+\.\d\d\s+\d+\.\d\d$", out, re.M) and "retrieval learned: sum w" in out
    assert "retrieval none" not in out  # no weights, no picks read: nothing to describe
    monkeypatch.setattr(drt, "softmax_off_by_one", lambda r, off_by_one=True: torch.zeros_like(r))
    zeroed = evaluate.perplexity({"learned": model}, docs, args, ctx)["learned"]
    filled = lambda rows: [row for row in rows if row[0]]  # noqa: E731 (empty buckets are nan)
    assert filled(zeroed) == filled(table["none"]) and zeroed[1] != table["learned"][1]


def test_baseline_runs_one_retrieval_mode(tmp_path, monkeypatch, capsys):
    """A checkpoint without retrieval (groups=()) under --retrieval=learned,random,none: a one-line note and
    one column, its windows alone, not three identical columns."""
    import evaluate
    tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt", groups=(), window=64)
    np.random.default_rng(0).integers(0, 50257, 300).astype(np.uint16).tofile(tmp_path / "d.bin")
    table = evaluate.main([f"--ckpt={ckpt}", f"--docs={tmp_path / 'd.bin'}", "--ppl", "--retrieval=learned,random,none",
                           "--device=cpu"])
    out = capsys.readouterr().out
    assert list(table) == ["none"] and re.search(r"^\s+positions\s+tokens\s+ppl none$", out, re.M), out
    assert re.search(r"^note: this checkpoint has no retrieval \(groups=\(\)\), so --retrieval=learned,random,none "
                     r"changes nothing: one run, its windows alone \(retrieval none\)$", out, re.M), out


def test_inspect_shows_the_picks(tmp_path, capsys):
    """evaluate.py --inspect: for the chunk holding token --at, the chunks each group picked at the
    landmark before it, with the weights a stream prefilled by hand gets; all strictly earlier."""
    from types import SimpleNamespace

    import evaluate
    load = lambda path, **kw: common.build_model(common.read_checkpoint(tiny_checkpoint(path, **kw))[0], "cpu")  # noqa: E731
    model = load(tmp_path / "ckpt.pt", window=64, groups=(1, 1))
    ids = np.random.default_rng(1).integers(0, 50257, 1200)
    enc = SimpleNamespace(decode=lambda t: " ".join(map(str, t)))  # no tokenizer needed
    args = SimpleNamespace(offload=False, segment=256, plot=None)
    got = evaluate.inspect(model, enc, ("doc", ids), 700, args, torch.autocast("cpu", enabled=False))
    c = 700 // 63
    state = model.new_state()
    common.prefill(model, ids[: c * 63], state, 10**6)
    assert len(got) == 2
    for (g, picks), (idx, w) in zip(got, state.picks):
        want = sorted(zip(idx[0, 0].tolist(), w[0, 0].tolist()), key=lambda p: -p[1])
        assert [j for j, _ in picks] == [j for j, _ in want] and all(j < c - 1 for j, _ in picks)
        assert [x for _, x in picks] == pytest.approx([x for _, x in want], abs=1e-6)
    out = capsys.readouterr().out
    assert f"chunk {c} (tokens" in out and out.count(" back): ") == 2 * model.config.topk
    # under code_read each line shows the chunk GCA reads and, before it, Eq. 1's pick as DRT's record has it
    nxt = load(tmp_path / "n.pt", window=64, code_read=True)
    record, state = [], nxt.new_state()
    common.prefill(nxt, ids[: c * 63], state, 10**6, record=record)
    t, eq1, w = next(r for r in retrievals(record) if c - 1 in r[0].tolist())
    a = t.tolist().index(c - 1)
    want = dict(zip(eq1[0, a].tolist(), w[0, a].tolist()))  # Eq. 1's picks at chunk c-1's landmark -> w
    (_, picks), = evaluate.inspect(nxt, enc, ("doc", ids), 700, args, torch.autocast("cpu", enabled=False))
    lines = re.findall(r"w (\d\.\d+)  chunk (\d+) \((\d+) back, picked (\d+)\): '(.*)'", capsys.readouterr().out)
    assert sorted(int(j) for *_, j, _ in lines) == sorted(want) and len(lines) == nxt.config.topk
    for wj, r, back, j, text in lines:
        assert int(r) == int(j) + 1 and int(back) == c - 1 - int(r) and float(wj) == pytest.approx(want[int(j)], abs=1e-3)
        assert text == " ".join(map(str, ids[int(r) * 63 : (int(r) + 1) * 63]))
    with pytest.raises(SystemExit, match="retrieve nothing"):
        evaluate.inspect(model, enc, ("doc", ids), 70, args, torch.autocast("cpu", enabled=False))
    with pytest.raises(SystemExit, match=r"--at=1200: document doc has 1,200 tokens: use --at below that"):
        evaluate.inspect(model, enc, ("doc", ids), 1200, args, torch.autocast("cpu", enabled=False))


def test_plots(tmp_path, monkeypatch, capsys):
    """--plot: --ppl's curves and --inspect's picks as PNG files (a name without an extension gets .png, and
    is printed so); without matplotlib, one line before the model loads."""
    import evaluate
    tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt", window=64, groups=(1, 1))
    np.random.default_rng(0).integers(0, 50257, 3000).astype(np.uint16).tofile(tmp_path / "d.bin")
    run = [f"--ckpt={ckpt}", f"--docs={tmp_path / 'd.bin'}", "--device=cpu", "--segment=500"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"^evaluate.py: error: --plot needs matplotlib, an optional requirement: pip in"):
        evaluate.main([*run, "--ppl", f"--plot={tmp_path / 'p.png'}"])
    with pytest.raises(SystemExit, match="give one of --ppl, --inspect, --copying"):
        evaluate.main([*run, "--ppl", "--inspect", f"--plot={tmp_path / 'p.png'}"])
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    evaluate.main([*run, "--ppl", "--retrieval=learned,none", f"--plot={tmp_path / 'ppl.png'}"])
    evaluate.main([*run, "--inspect", "--at=2500", f"--plot={tmp_path / 'picks'}"])  # no extension: a PNG, so named
    out = capsys.readouterr().out
    assert not (tmp_path / "picks").exists()
    for name in ("ppl.png", "picks.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {tmp_path / name}" in out


def test_evaluate_arguments(tmp_path, monkeypatch, capsys):
    """Every bad argument is one line before the model runs: a --plot into a folder that cannot be made or
    written, or in a format matplotlib cannot write (not after minutes of evaluation), --ppl and --inspect
    together, --doc without --inspect or naming no document, a .bin cut short or of odd size (train.py's
    check, for --docs and --haystack); --doc picks --inspect's document by name or index, and --inspect
    --plot's title names it."""
    import evaluate
    tokenizer_or_skip(monkeypatch)
    ckpt = tiny_checkpoint(tmp_path / "ckpt.pt", window=64)
    rng = np.random.default_rng(0)
    books = [rng.integers(0, 50256, n) for n in (700, 900)]
    np.concatenate([books[0], [prepare_pg19.EOT], books[1], [prepare_pg19.EOT]]).astype(np.uint16).tofile(tmp_path / "t.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50257, "splits": {"test": {"file": "t.bin",
        "tokens": 1602, "offsets": [["730", 0, 700], ["1260", 700, 900]]}}}))
    (tmp_path / "odd.bin").write_bytes(b"abc")  # 3 bytes: not uint16 tokens
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "meta.json").write_text((tmp_path / "meta.json").read_text())
    (tmp_path / "cut" / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:1000])  # a copy cut short
    run = [f"--ckpt={ckpt}", f"--docs={tmp_path / 't.bin'}", "--device=cpu"]
    ran = []
    monkeypatch.setattr(evaluate, "doc_nll", lambda *a, **k: ran.append(1))
    for argv, message in [
        (["--ppl", f"--plot={tmp_path / 't.bin'}/x.png"], r"--plot=.*t.bin/x.png: .*t.bin is a file"),
        (["--ppl", f"--plot={tmp_path / 'x.txt'}"], r"--plot=.*x.txt: matplotlib cannot write .txt files: end the "
                                                   r"name in .png, or another of its formats \(.*pdf.*svg"),
        (["--ppl", "--inspect"], r"give one of --ppl, --inspect, --copying"),
        (["--ppl", "--doc=730"], r"--doc chooses --inspect's document: --ppl reads them all"),
        (["--inspect", "--doc=999"], r"--doc=999: .*t.bin has no document of that name, and 2 by index \(0-1\): "
                                     r"give one of 730, 1260"),
        (["--ppl", "--haystack=x"], r"--haystack is the text of --copying's spans: add --copying"),
        (["--ppl", f"--docs={tmp_path / 'odd.bin'}"], r"--docs: .*odd.bin has 3 bytes, not a whole number of uint16"),
        (["--ppl", f"--docs={tmp_path / 'cut' / 't.bin'}"], r"--docs: .*t.bin has 1,000 bytes, 1,602 uint16 tokens by its "
                                                             r"meta.json: prepare it again, or pass another --docs"),
        (["--copying", f"--haystack={tmp_path / 'cut' / 't.bin'}"], r"--haystack .*t.bin has 1,000 bytes, 1,602 uint16 "
                                                                     r"tokens by its meta.json: give a folder of .txt"),
    ]:
        if "plot" in argv[-1]:
            pytest.importorskip("matplotlib")
        with pytest.raises(SystemExit, match="^evaluate.py: error: " + message) as e:
            evaluate.main([*run, *argv])
        assert "\n" not in str(e.value.code) and not ran
    for doc in ("1260", "1"):
        got = evaluate.main([*run, "--inspect", f"--doc={doc}", "--at=800"])
        assert "document 1260, chunk 12 " in capsys.readouterr().out and got is None
    pytest.importorskip("matplotlib")
    titles = []
    monkeypatch.setattr(evaluate, "save", lambda fig, path: titles.append(fig.axes[0].get_title()))
    evaluate.main([*run, "--inspect", "--doc=1260", "--at=800", f"--plot={tmp_path / 'new' / 'p.png'}"])
    assert titles == ["document 1260, retrieval learned, group 0"] and (tmp_path / "new").is_dir()  # made, as out_dir
