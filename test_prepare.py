"""
Tests of data preparation: prepare_pg19.py (the tokenizer, the .bin layout, errors, Ctrl-C, a
download from a fake bucket; DRT_PG19_SAMPLE=/path/to/a small PG19-layout folder adds real books)
and prepare_code.py (a made-up Linux-like tree, a document per directory).
"""

import http.server
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import common
import prepare_pg19
import train
from conftest import HERE, end_run, read_until, start_run, tokenizer_or_skip

# -----------------------------------------------------------------------------
# data preparation (prepare_pg19.py): the tokenizer, the .bin layout, errors, a download from a fake bucket


def _write_books(root, books, metadata=None):
    # books: {split: {book_id: text or bytes}}
    for split, bs in books.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for book_id, text in bs.items():
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            (root / split / f"{book_id}.txt").write_bytes(data)
    if metadata is not None:
        (root / "metadata.csv").write_text(metadata, encoding="utf-8")


def _files(root):
    # {name: bytes} of every file in root: a dataset to compare bit for bit, temp files included
    return {p.name: p.read_bytes() for p in root.iterdir()}


def test_tokenizer_local_file(monkeypatch):
    enc = tokenizer_or_skip(monkeypatch)
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.n_vocab == prepare_pg19.GPT2_VOCAB == 50257
    assert enc.eot_token == prepare_pg19.EOT == 50256
    text = "It was the best of times,\r\nit was the worst of times — naïve café 日本 <|endoftext|>\n\n"
    assert enc.decode(enc.encode_ordinary(text)) == text
    with pytest.raises(FileNotFoundError, match="nope.tiktoken") as e:
        prepare_pg19.get_tokenizer("/nonexistent/nope.tiktoken")
    assert prepare_pg19.RANKS_URL in str(e.value) and "shared" not in str(e.value)


def test_tokenizer_offline_message(monkeypatch, capsys):
    # no ranks file and no network: the message says which file to fetch and where to point at it
    import tiktoken

    def offline(name):
        raise OSError("Temporary failure in name resolution")
    monkeypatch.delenv("DRT_GPT2_RANKS", raising=False)
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(RuntimeError, match="name resolution") as e:
        prepare_pg19.get_tokenizer()
    msg = str(e.value)
    assert "r50k_base.tiktoken" in msg and "DRT_GPT2_RANKS=" in msg and "--tokenizer_file" in msg
    assert "shared" not in msg
    with pytest.raises(SystemExit):
        prepare_pg19.main(["--help"])
    help_text = capsys.readouterr().out
    assert "r50k_base.tiktoken" in help_text and "--max_books" in help_text and "shared" not in help_text


def test_readme_setup():
    """The README's install block runs in order on a CPU (torch's CPU build before the requirements),
    its test command is CI's and shows why tests skip, it names the variables that enable tests
    offline, and its local-copy quick start keeps --max_books."""
    readme, ci = (Path(HERE) / "README.md").read_text(), (Path(HERE) / ".ci" / "run").read_text()
    block = re.search(r"## Install.*?```bash\n(.*?)```", readme, re.S)[1].splitlines()
    assert "--index-url https://download.pytorch.org/whl/cpu" in block[0] and "requirements.txt" in block[1]
    test_cmd = next(line.split("#")[0].strip() for line in block if line.startswith("python -m pytest"))
    assert "-rs" in test_cmd and re.search(rf"^{re.escape(test_cmd)}$", ci, re.M)
    assert "DRT_GPT2_RANKS" in readme and "DRT_PG19_SAMPLE" in readme
    assert "--source /path/to/pg19 --out data/pg19 --max_books=20" in readme


def test_gitignore_readme_leftovers():
    """What the README's commands leave in the checkout is ignored: the Linux source package and the tree
    unpacked from it (prepare_code.py), the plots of evaluate.py."""
    import shutil
    import subprocess
    if not shutil.which("git") or not os.path.exists(os.path.join(HERE, ".git")):
        pytest.skip("needs git and a git checkout")
    paths = ["linux/usr/src/linux-source-6.12.tar.xz", "linux-source-6.12_6.12.118-1_all.deb", "ppl.png", "picks.png"]
    r = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=HERE, capture_output=True, text=True)
    assert r.stdout.split() == paths
    r = subprocess.run(["git", "check-ignore", "--no-index", "assets/drt.png", "model.py"], cwd=HERE,
                       capture_output=True, text=True)
    assert r.stdout == ""


def test_prepare_fmt_time():
    got = [common.fmt_time(s) for s in (0, 59.9, 61, 3600, 3725)]  # the ETAs of prepare_pg19.py and train.py
    assert got == ["0m00s", "0m59s", "1m01s", "1h00m", "1h02m"]


def test_prepare_requirements_triton_linux_only():
    # Triton has wheels for Linux only: elsewhere `pip install -r requirements.txt` must skip it
    from packaging.requirements import Requirement  # pytest depends on packaging
    lines = (Path(__file__).resolve().parent / "requirements.txt").read_text().splitlines()
    reqs = {r.name: r for r in (Requirement(line.split(" #")[0]) for line in lines if line.strip())}
    assert {"torch", "numpy", "tiktoken", "triton", "pytest"} <= set(reqs)
    assert "2.5" in reqs["torch"].specifier
    for platform, wanted in [("linux", True), ("darwin", False), ("win32", False)]:
        assert reqs["triton"].marker.evaluate({"sys_platform": platform}) is wanted
    assert all(r.marker is None for name, r in reqs.items() if name != "triton")


def test_prepare_tiny_layout(tmp_path, monkeypatch):
    enc = tokenizer_or_skip(monkeypatch)
    books = {
        "train": {10: "Chapter I.\n\nCall me Ishmael. " * 50, 9: "Short book.\r\nWith CRLF.\r\n",
                  123: "Ünïcødé — “quotes” and <|endoftext|> as plain text.\n", 7: "Seven."},
        "validation": {5: "The valid book.\n" * 20},
        "test": {3: "The test book; the end.\n"},
    }
    # the real PG19 metadata.csv has no header row; titles may hold commas
    metadata = '9,"Short, Book",1900,http://x/9\n10,Moby Dick,1851,http://x/10\n5,Valid,1800,http://x/5\n'
    _write_books(tmp_path / "src", books, metadata)
    out = tmp_path / "out"
    meta = prepare_pg19.prepare(str(tmp_path / "src"), str(out), num_proc=2, log=lambda s: None)
    assert meta == json.loads((out / "meta.json").read_text())
    assert (meta["vocab_size"], meta["eot"], meta["dtype"]) == (50257, 50256, "uint16")
    assert meta["titles"]["9"] == "Short, Book" and meta["titles"]["10"] == "Moby Dick"
    for folder, name in [("train", "train"), ("validation", "val"), ("test", "test")]:
        m = meta["splits"][name]
        data = np.fromfile(out / f"{name}.bin", dtype=np.uint16)
        ids = sorted(books[folder])  # numeric order: 7, 9, 10, 123 (not "10" < "123" < "7" < "9")
        assert [b for b, _, _ in m["offsets"]] == ids
        assert m["books"] == len(ids)
        assert m["tokens"] == len(data) == sum(len(enc.encode_ordinary(books[folder][i])) + 1 for i in ids)
        for book_id, start, n in m["offsets"]:
            toks = data[start:start + n].tolist()
            assert toks[-1] == 50256 and 50256 not in toks[:-1]
            assert enc.decode(toks[:-1]) == books[folder][book_id]
    assert sorted(os.listdir(out)) == ["meta.json", "test.bin", "train.bin", "val.bin"]  # no temp files left

    # re-running one split keeps the others in meta.json
    meta2 = prepare_pg19.prepare(str(tmp_path / "src"), str(out), splits=("test",), num_proc=1, log=lambda s: None)
    assert meta2["splits"] == meta["splits"] and meta2["titles"] == meta["titles"]


def test_prepare_max_books(tmp_path, monkeypatch):
    tokenizer_or_skip(monkeypatch)
    books = {"train": {i: f"Train book {i}.\n" * (i + 1) for i in (1, 2, 3, 10, 11)},
             "validation": {5: "The valid book.\n"}, "test": {6: "Test six.\n", 7: "Test seven.\n"}}
    _write_books(tmp_path / "src", books, "1,One,1900,u\n2,Two,1900,u\n10,Ten,1900,u\n")
    quiet = dict(num_proc=2, log=lambda s: None)
    full = prepare_pg19.prepare(str(tmp_path / "src"), str(tmp_path / "full"), **quiet)
    sub = prepare_pg19.prepare(str(tmp_path / "src"), str(tmp_path / "sub"), max_books=3, **quiet)
    # the first 3 by file name, as the bucket lists them (1.txt, 10.txt, 11.txt), tokenized in id order;
    # splits with fewer books are taken whole
    assert {n: [b for b, _, _ in m["offsets"]] for n, m in sub["splits"].items()} == \
        {"train": [1, 10, 11], "val": [5], "test": [6, 7]}
    assert sub["titles"] == {"1": "One", "10": "Ten"}  # only the books it holds
    for name, m in sub["splits"].items():  # every book's tokens as in the full run
        data = np.fromfile(tmp_path / "sub" / m["file"], dtype=np.uint16)
        full_data = np.fromfile(tmp_path / "full" / m["file"], dtype=np.uint16)
        where = {b: (start, n) for b, start, n in full["splits"][name]["offsets"]}
        for book_id, start, n in m["offsets"]:
            full_start, full_n = where[book_id]
            assert n == full_n and data[start:start + n].tolist() == full_data[full_start:full_start + n].tolist()
        assert m["tokens"] == len(data)
    with pytest.raises(ValueError, match="max_books=0"):
        prepare_pg19.prepare(str(tmp_path / "src"), str(tmp_path / "sub"), max_books=0, **quiet)
    with pytest.raises(SystemExit, match="--max_books=0"):
        prepare_pg19.main(["--source", str(tmp_path / "src"), "--out", str(tmp_path / "sub"), "--max_books=0"])


def test_prepare_pg19_sample(tmp_path, monkeypatch):
    # a real PG19-layout folder (e.g. a few dozen books), named by env DRT_PG19_SAMPLE
    if not os.environ.get("DRT_PG19_SAMPLE"):
        pytest.skip("set DRT_PG19_SAMPLE to a folder laid out like PG19 to run this test")
    src = Path(os.environ["DRT_PG19_SAMPLE"])
    enc = tokenizer_or_skip(monkeypatch)
    meta = prepare_pg19.prepare(str(src), str(tmp_path), num_proc=2, log=lambda s: None)
    for folder, name in prepare_pg19.SPLITS.items():
        m = meta["splits"][name]
        assert m["books"] == len(list((src / folder).glob("*.txt")))
        data = np.memmap(tmp_path / m["file"], dtype=np.uint16, mode="r")
        assert m["tokens"] == len(data) == sum(n for _, _, n in m["offsets"])
        assert int((data == 50256).sum()) == m["books"]
        assert int(data.max()) < 50257
        book_id, start, n = m["offsets"][-1]
        assert enc.decode(data[start:start + n - 1].tolist()) == (src / folder / f"{book_id}.txt").read_text("utf-8")
    if (src / "metadata.csv").is_file():
        import csv
        with open(src / "metadata.csv", newline="", encoding="utf-8") as f:
            rows = {r[0]: r[1] for r in csv.reader(f) if r}
        assert meta["titles"] and all(rows[i] == t for i, t in meta["titles"].items())


def test_prepare_errors(tmp_path, monkeypatch):
    tokenizer_or_skip(monkeypatch)
    quiet = dict(num_proc=1, log=lambda s: None)
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        prepare_pg19.prepare(str(tmp_path / "no_such_dir"), str(tmp_path / "out"), **quiet)

    src = tmp_path / "src"
    _write_books(src, {"train": {1: "a"}, "validation": {2: "b"}})
    with pytest.raises(FileNotFoundError, match="test"):  # missing split folder
        prepare_pg19.prepare(str(src), str(tmp_path / "out"), **quiet)

    (src / "test").mkdir()
    (src / "test" / "notes.md").write_text("not a book")
    with pytest.raises(ValueError, match="no .txt files"):  # empty split
        prepare_pg19.prepare(str(src), str(tmp_path / "out"), **quiet)

    (src / "test" / "4.txt").write_bytes(b"caf\xe9 in latin-1\n")
    with pytest.raises(ValueError, match=r"4\.txt.*UTF-8"):  # the message names the file
        prepare_pg19.prepare(str(src), str(tmp_path / "out"), **quiet)

    (src / "test" / "4.txt").write_text("fine now")
    (tmp_path / "a_file").write_text("")
    for out in ("a_file", "a_file/out"):
        with pytest.raises(ValueError, match=r"output folder .*a_file(/out)? is a file, or inside one: pass --out"):
            prepare_pg19.prepare(str(src), str(tmp_path / out), **quiet)
    with pytest.raises(ValueError, match="not writable"):  # works as root too, unlike chmod
        prepare_pg19.prepare(str(src), "/proc/out", **quiet)
    for flag in ("--num_proc=0", "--num_proc=-1", "--download_workers=0"):
        with pytest.raises(SystemExit, match=rf"^prepare_pg19.py: error: {flag}: must be >= 1$"):
            prepare_pg19.main(["--source", str(src), "--out", str(tmp_path / "out"), flag])
    with pytest.raises(SystemExit, match=r"^prepare_pg19.py: error: GPT-2 ranks file .*README.md \(from "
                                         r"--tokenizer_file or DRT_GPT2_RANKS\) is not a tiktoken ranks file"):
        prepare_pg19.main(["--source", str(src), "--out", str(tmp_path / "out"), "--tokenizer_file",
                           os.path.join(HERE, "README.md")])

    with pytest.raises(SystemExit, match="no_such_dir"):  # the CLI turns errors into one clear line
        prepare_pg19.main(["--source", str(tmp_path / "no_such_dir"), "--out", str(tmp_path / "out")])


def test_prepare_skips_blank_books(tmp_path, monkeypatch):
    """An empty or whitespace-only book is skipped, with a line that says so (tokenized, it would be an
    <|endoftext|> alone); a split of nothing else is refused, before anything is written."""
    enc = tokenizer_or_skip(monkeypatch)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_books(src, {"train": {1: "Some text.", 2: "", 3: " \n\t\r\n"}, "validation": {4: ""}, "test": {5: "The end."}})
    with pytest.raises(SystemExit) as e:
        prepare_pg19.main(["--source", str(src), "--out", str(out), "--num_proc=1"])
    assert str(e.value) == (f"prepare_pg19.py: error: split folder {src / 'validation'}: every book is empty or "
                            f"whitespace only, so the split would have no text: add books, or leave the split out "
                            f"(--splits); nothing was written")
    assert not out.exists()
    (src / "validation" / "6.txt").write_text("Valid.")
    lines = []
    meta = prepare_pg19.prepare(str(src), str(out), num_proc=2, log=lines.append)
    skipped = [line for line in lines if "skipped" in line]
    assert skipped == [f"train: skipped {src / 'train' / '2.txt'}: empty or whitespace only",
                       f"train: skipped {src / 'train' / '3.txt'}: empty or whitespace only",
                       f"validation: skipped {src / 'validation' / '4.txt'}: empty or whitespace only"]
    assert {n: [b for b, _, _ in m["offsets"]] for n, m in meta["splits"].items()} == {"train": [1], "val": [6], "test": [5]}
    val = np.fromfile(out / "val.bin", dtype=np.uint16).tolist()
    assert val == enc.encode_ordinary("Valid.") + [50256] and meta["splits"]["val"]["tokens"] == len(val) > 1


def test_prepare_keeps_files_it_would_write(tmp_path, monkeypatch):
    """Files of the user's in --out under the names a run writes (train.bin, val.bin without a meta.json: no
    finished dataset) are kept: the run stops at once, naming them, and --overwrite replaces them. With --splits,
    the other splits' files are not the run's to refuse or touch; a file of any other name is never touched (the
    run's temporary files have names of their own)."""
    tokenizer_or_skip(monkeypatch)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_books(src, {"train": {1: "Train book. " * 20}, "validation": {2: "Valid."}, "test": {3: "Test."}})
    out.mkdir()
    mine = {"train.bin": b"my own tokens", "val.bin": b"mine too", "notes": b"n"}
    others = {f"{n}.tmp": b"t" for n in ("train.bin", "val.bin", "test.bin", "meta.json")}
    for name, data in {**mine, **others}.items():
        (out / name).write_bytes(data)
    argv = ["--source", str(src), "--out", str(out), "--num_proc=1"]
    with pytest.raises(SystemExit) as e:
        prepare_pg19.main(argv)
    assert str(e.value) == (f"prepare_pg19.py: error: {out} already holds train.bin, val.bin, not a finished dataset "
                            f"(no meta.json): pass --overwrite to replace them, or another --out")
    with pytest.raises(SystemExit, match=r"holds val\.bin, not a finished dataset .*: pass --overwrite to replace it,"):
        prepare_pg19.main([*argv, "--splits=validation,test"])
    assert _files(out) == {**mine, **others}
    prepare_pg19.main([*argv, "--splits=test"])  # test.bin and meta.json: no file of the user's
    after = _files(out)
    assert sorted(after) == sorted([*mine, *others, "test.bin", "meta.json"])
    assert {n: after[n] for n in [*mine, *others]} == {**mine, **others}
    prepare_pg19.main([*argv, "--overwrite"])
    after = _files(out)
    assert after["train.bin"] != mine["train.bin"] and after["val.bin"] != mine["val.bin"]
    assert sorted(after) == sorted([*mine, *others, "test.bin", "meta.json"])
    assert {n: after[n] for n in ["notes", *others]} == {"notes": b"n", **others}


def test_prepare_out_is_a_file(tmp_path, monkeypatch):
    """--out naming a file, or a path inside one, is refused as that, by both scripts, with or without
    --overwrite (there is no dataset to replace), and the file is left as it was."""
    import prepare_code as pc
    tokenizer_or_skip(monkeypatch)
    src = tmp_path / "src"
    _write_books(src, {"train": {1: "a"}, "validation": {2: "b"}, "test": {3: "c"}})
    (tmp_path / "a_file").write_text("mine")
    for script, name in ((prepare_pg19, "prepare_pg19.py"), (pc, "prepare_code.py")):
        for out, what in (("a_file", "is a file"), ("a_file/out", "inside")):
            for extra in ([], ["--overwrite"]):
                with pytest.raises(SystemExit) as e:
                    script.main(["--source", str(src), "--out", str(tmp_path / out), "--num_proc=1", *extra])
                msg = str(e.value)
                assert msg.startswith(f"{name}: error: output folder {tmp_path / out} ") and what in msg, msg
                assert "pass --out" in msg and "--overwrite" not in msg and "\n" not in msg, msg
    assert (tmp_path / "a_file").read_text() == "mine"


def test_prepare_failed_run_leaves_no_folder(tmp_path, monkeypatch):
    """A failed run that says nothing was written leaves nothing: the --out folders it made go again (parents
    too), a folder that was there stays, and so does a file anyone put in one."""
    import prepare_code as pc
    tokenizer_or_skip(monkeypatch)
    src = tmp_path / "src"
    _write_books(src, {"train": {1: "fine"}, "validation": {2: b"\xff bad"}, "test": {3: "fine"}})
    with pytest.raises(SystemExit, match="nothing was written"):
        prepare_pg19.main(["--source", str(src), "--out", str(tmp_path / "new" / "out"), "--num_proc=1"])
    assert sorted(os.listdir(tmp_path)) == ["src"]
    (tmp_path / "there").mkdir()
    with pytest.raises(ValueError, match="nothing was written"):
        prepare_pg19.prepare(str(src), str(tmp_path / "there" / "out"), num_proc=2, log=lambda s: None)
    assert os.listdir(tmp_path / "there") == []

    # prepare_code.py, failing after its build: the raw/ it built goes too, and the --out it made
    _code_tree(tmp_path / "tree")

    def fails(source, out_dir, **kw):
        assert sorted(os.listdir(out_dir)) == ["raw"]
        if os.path.basename(out_dir) == "user":
            (Path(out_dir) / "mine.txt").write_text("added during the run")
        raise ValueError("tokenizing failed")
    monkeypatch.setattr(pc, "prepare", fails)
    for out in (tmp_path / "new2" / "code", tmp_path / "there" / "code", tmp_path / "user"):
        with pytest.raises(SystemExit, match="tokenizing failed"):
            pc.main(["--source", str(tmp_path / "tree"), "--out", str(out)])
    assert sorted(os.listdir(tmp_path)) == ["src", "there", "tree", "user"]
    assert os.listdir(tmp_path / "there") == [] and os.listdir(tmp_path / "user") == ["mine.txt"]


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_prepare_ctrl_c(tmp_path, monkeypatch):
    """Ctrl-C (to the whole process group, as a terminal sends it) while the workers tokenize: one
    line, no traceback from the main process or a worker, exit 130, the old dataset as it was."""
    tokenizer_or_skip(monkeypatch)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_books(src, {"train": {i: "Some perfectly fine text. " * 200 for i in range(1, 9)},
                       "validation": {1: "v"}, "test": {1: "t"}})
    prepare_pg19.prepare(str(src), str(out), num_proc=2, log=lambda s: None)
    before = _files(out)
    slow = ("import signal, sys, time, prepare_pg19 as p\nencode = p._encode_book\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # as from a terminal (a background job ignores it)
            "def _encode_book(path):\n    time.sleep(0.5)\n    return encode(path)\n"
            "_encode_book.__module__ = 'prepare_pg19'\np._encode_book = _encode_book\np.main(sys.argv[1:])")
    proc = start_run([sys.executable, "-c", slow, "--source", str(src), "--out", str(out), "--num_proc=2", "--overwrite"])
    try:
        read_until(proc.stdout, r"check: ")  # then 5 s of tokenizing
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        end_run(proc)
    assert proc.returncode == 130 and err.strip().count("\n") == 0, err
    assert re.match(r"prepare_pg19.py: interrupted: .*out keeps the dataset it had", err), err
    assert _files(out) == before


def test_prepare_failed_rerun_keeps_old_dataset(tmp_path, monkeypatch):
    tokenizer_or_skip(monkeypatch)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_books(src, {"train": {i: "Some perfectly fine text. " * 200 for i in range(1, 9)},
                       "validation": {1: "v"}, "test": {1: "t"}})
    prepare_pg19.prepare(str(src), str(out), num_proc=2, log=lambda s: None)
    before = _files(out)
    assert sorted(before) == ["meta.json", "test.bin", "train.bin", "val.bin"]
    (src / "train" / "5.txt").write_text("Changed. " * 300)  # a rewrite of train.bin would show

    # bad books in test/, the last split: found before anything is tokenized or written, all named
    (src / "test" / "98.txt").write_bytes(b"\xc3")
    (src / "test" / "99.txt").write_bytes(b"fine start, then \xff\xfe garbage")
    lines = []
    with pytest.raises(ValueError, match=r"2 of 12 books cannot be used: .*98\.txt is not valid UTF-8.*99\.txt"):
        prepare_pg19.prepare(str(src), str(out), num_proc=2, log=lines.append)
    assert lines and all(line.startswith("check:") for line in lines)  # checked, nothing tokenized
    assert _files(out) == before  # bit-identical, no temp files
    with pytest.raises(SystemExit, match="99.txt"):
        prepare_pg19.main(["--source", str(src), "--out", str(out), "--num_proc=1", "--overwrite"])
    assert _files(out) == before

    # interrupted (Ctrl-C) while tokenizing test/: the old dataset stays, the temp files go
    (src / "test" / "98.txt").unlink()
    (src / "test" / "99.txt").unlink()
    encode = prepare_pg19._encode_book

    def interrupted(path):
        if Path(path).parent.name == "test":
            raise KeyboardInterrupt
        return encode(path)
    monkeypatch.setattr(prepare_pg19, "_encode_book", interrupted)  # num_proc=1: tokenizes in this process
    with pytest.raises(KeyboardInterrupt):
        prepare_pg19.prepare(str(src), str(out), num_proc=1, log=lambda s: None)
    assert _files(out) == before
    monkeypatch.setattr(prepare_pg19, "_encode_book", encode)

    # killed between the renames: train.bin and val.bin are new, test.bin old, so no meta.json at all
    replace = os.replace

    def killed(a, b):
        if os.path.basename(b) == "test.bin":
            raise OSError("killed")
        replace(a, b)
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(OSError, match="killed"):
        prepare_pg19.prepare(str(src), str(out), num_proc=1, log=lambda s: None)
    monkeypatch.setattr(os, "replace", replace)
    after = _files(out)
    assert sorted(after) == ["test.bin", "train.bin", "val.bin"]  # incomplete: no meta.json, no temp files
    assert after["test.bin"] == before["test.bin"] and after["train.bin"] != before["train.bin"]


def test_prepare_keeps_a_dataset(tmp_path, monkeypatch, fake_bucket):
    """A run over a prepared dataset stops before any work (no listing, no download), in one line that says
    what is there (its meta.json's counts) and how to go on; --overwrite replaces it. A meta.json that is
    not JSON is named, not read past."""
    tokenizer_or_skip(monkeypatch)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_books(src, {"train": {i: f"Train book {i}. " * 50 for i in (1, 2, 3)}, "validation": {4: "v", 6: "w"},
                       "test": {5: "t", 7: "u"}})
    prepare_pg19.main(["--source", str(src), "--out", str(out), "--num_proc=1"])
    before, meta = _files(out), json.loads((out / "meta.json").read_text())
    held = ", ".join(f"{n} {m['tokens']:,} tokens in {m['books']} books" for n, m in meta["splits"].items())
    kw, fetched, listed = fake_bucket({"train/1.txt": b"x", "validation/4.txt": b"v", "test/5.txt": b"t"})
    download = prepare_pg19.download_pg19
    monkeypatch.setattr(prepare_pg19, "download_pg19", lambda *a, **k: download(*a, **k, **kw))
    for argv in (["--source", str(src), "--max_books=1"], ["--raw_dir", str(tmp_path / "raw"), "--max_books=1"]):
        with pytest.raises(SystemExit) as e:
            prepare_pg19.main([*argv, "--out", str(out), "--num_proc=1"])
        assert str(e.value) == (f"prepare_pg19.py: error: {out} already holds a dataset ({held}, by its meta.json): "
                                f"pass --overwrite to replace it, or another --out")
    assert listed == fetched == [] and not (tmp_path / "raw").exists() and _files(out) == before
    (out / "meta.json").write_text((out / "meta.json").read_text()[:40])  # a copy cut short
    with pytest.raises(SystemExit, match=rf"^prepare_pg19.py: error: {re.escape(str(out / 'meta.json'))} is not valid "
                                         rf"JSON \(.*\): pass --overwrite to replace the dataset in .*out, or another --out$"):
        prepare_pg19.main(["--source", str(src), "--out", str(out), "--max_books=1"])
    prepare_pg19.main(["--source", str(src), "--out", str(out), "--max_books=1", "--num_proc=1", "--overwrite"])
    assert json.loads((out / "meta.json").read_text())["splits"]["train"]["books"] == 1


@pytest.fixture
def fake_bucket():
    """start(files) serves {name: bytes} the way the GCS JSON API and bucket do (2 items per
    listing page) and returns (download_pg19 kwargs, names fetched, listings asked as (prefix, page))."""
    servers = []

    def start(files, fail_once=()):
        fetched, listed, fail_once = [], [], set(fail_once)

        class Bucket(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                from urllib.parse import parse_qs, unquote, urlparse
                u = urlparse(self.path)
                if u.path == "/storage/v1/b/bkt/o":  # listing, 2 items per page
                    q = parse_qs(u.query)
                    listed.append((q["prefix"][0], q.get("pageToken", [None])[0]))
                    names = sorted(n for n in files if n.startswith(q["prefix"][0]))
                    start = int(q.get("pageToken", ["0"])[0])
                    page = {"items": [{"name": n, "size": str(len(files[n]))} for n in names[start:start + 2]]}
                    if start + 2 < len(names):
                        page["nextPageToken"] = str(start + 2)
                    body = json.dumps(page).encode()
                else:
                    name = unquote(u.path[len("/bkt/"):])
                    fetched.append(name)
                    if name in fail_once:
                        fail_once.discard(name)
                        self.send_error(503)
                        return
                    body = files[name]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Bucket)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        base = f"http://127.0.0.1:{server.server_address[1]}"
        return dict(api_url=f"{base}/storage/v1/b/bkt/o", base_url=f"{base}/bkt", backoff=0.0), fetched, listed

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_download_fake_bucket(tmp_path, fake_bucket):
    files = {f"train/{i}.txt": f"train book {i}\n".encode() * (i + 1) for i in (1, 2, 3, 10, 11)}
    files.update({"validation/5.txt": b"val\n", "test/6.txt": "tést\n".encode(), "metadata.csv": b"1,One,1900,u\n"})
    kw, fetched, listed = fake_bucket(files, fail_once={"train/3.txt"})  # one transient 503 to exercise the retry
    kw.update(workers=4, log=lambda s: None)
    raw = tmp_path / "raw"
    # a .part from an interrupted download, and a truncated file under its final name
    (raw / "train").mkdir(parents=True)
    (raw / "train" / "2.txt.part").write_bytes(files["train/2.txt"][:5])
    (raw / "train" / "10.txt").write_bytes(files["train/10.txt"][:7])
    assert prepare_pg19.download_pg19(str(raw), **kw) == len(files)
    got = {str(p.relative_to(raw)): p.read_bytes() for p in raw.rglob("*") if p.is_file()}
    assert got == files  # every file whole, no .part left
    assert sorted(fetched) == sorted(list(files) + ["train/3.txt"])  # 3.txt twice: the retry

    fetched.clear()
    assert prepare_pg19.download_pg19(str(raw), **kw) == 0  # resume: nothing to fetch
    assert fetched == []

    # max_books: the first N .txt of each split in listing (name) order, and no more listing pages than
    # needed. Train lists as 1, 10 | 11, 2 | 3 (2 a page): 1 book takes page one, 3 books pages one and two
    raw = tmp_path / "raw_small"
    listed.clear()
    fetched.clear()
    assert prepare_pg19.download_pg19(str(raw), max_books=1, **kw) == 4
    assert sorted(fetched) == ["metadata.csv", "test/6.txt", "train/1.txt", "validation/5.txt"]
    assert [page for prefix, page in listed if prefix == "train/"] == [None]
    listed.clear()
    fetched.clear()
    assert prepare_pg19.download_pg19(str(raw), max_books=3, **kw) == 2  # the rest was there already
    assert sorted(fetched) == ["train/10.txt", "train/11.txt"]
    assert [page for prefix, page in listed if prefix == "train/"] == [None, "2"]
    got = {str(p.relative_to(raw)): p.read_bytes() for p in raw.rglob("*") if p.is_file()}
    assert got == {n: files[n] for n in ["metadata.csv", "test/6.txt", "train/1.txt", "train/10.txt",
                                         "train/11.txt", "validation/5.txt"]}


def test_download_max_books_then_prepare(tmp_path, monkeypatch, capsys, fake_bucket):
    # the CLI end to end: --max_books downloads N books of each split, tokenizes just those,
    # and a second run fetches nothing
    tokenizer_or_skip(monkeypatch)
    files = {f"train/{i}.txt": f"Train book {i}.\n".encode() * i for i in (1, 2, 3, 10, 11)}
    files.update({f"test/{i}.txt": f"Test book {i}.\n".encode() for i in (6, 7, 8)})
    files.update({"validation/5.txt": b"The valid book.\n", "metadata.csv": b"10,Ten,1900,u\n"})
    kw, fetched, listed = fake_bucket(files)
    download = prepare_pg19.download_pg19
    monkeypatch.setattr(prepare_pg19, "download_pg19", lambda *a, **k: download(*a, **k, **kw))
    argv = ["--max_books=2", "--raw_dir", str(tmp_path / "raw"), "--out", str(tmp_path / "out"), "--num_proc=1"]
    prepare_pg19.main(argv)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert {n: [b for b, _, _ in m["offsets"]] for n, m in meta["splits"].items()} == \
        {"train": [1, 10], "val": [5], "test": [6, 7]}
    assert meta["titles"] == {"10": "Ten"}
    assert sorted(fetched) == ["metadata.csv", "test/6.txt", "test/7.txt", "train/1.txt", "train/10.txt",
                               "validation/5.txt"]
    log = capsys.readouterr().out
    assert "download: 6 files listed, 0 already present, 6 to fetch" in log and "check: 5/5 books" in log
    assert "train: 2/2 books" in log and "done in" in log

    fetched.clear()
    prepare_pg19.main([*argv, "--overwrite"])
    assert fetched == []
    assert "download: 6 files listed, 6 already present, 0 to fetch" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta


# -----------------------------------------------------------------------------
# the code corpus (prepare_code.py): a made-up Linux-like tree, documents per directory


def _code_tree(root):
    """A tree with a document for each rule of prepare_code.py -> {directory: what it must give}."""
    import prepare_code as pc
    def big(tag, kib):  # a file of kib KiB or a line more
        line = f"int {tag}(void) {{ return 0; }}\n"
        return line * (kib * 1024 // len(line) + 1)
    by_split = {}  # the first directories d0, d1, ... whose sha1 falls in each split (reserved: None)
    for i in range(200):
        by_split.setdefault(pc.split_of(f"lib/d{i}"), f"lib/d{i}")
    files = {
        "kernel/sched": {"b.c": big("b", 120), "a.c": big("a", 60), "z.h": big("z", 30), "c.h": big("c", 30),
                         "notes.txt": "not code", "Makefile": "obj-y += a.o"},
        "kernel/big": {f"f{i}.c": big(f"f{i}", 250) for i in range(12)},  # 12 x 250 KiB: the 2 MiB cap stops it
        "kernel/skip": {"huge.c": big("huge", 300), "latin1.c": b"caf\xe9 " * 80000, "ok.c": big("ok", 210)},
        "kernel/small": {"s.c": big("s", 150)},  # under the 200 KiB floor
        "arch/x86/kernel": {"x.c": big("x", 250)}, "tools/perf": {"p.c": big("p", 250)},
        "drivers/gpu/drm/amd/include/asic": {"r.h": big("r", 250)},
        "drivers/gpu/drm/amd/display": {"d.c": big("d", 250)},  # beside the excluded include/: kept
        **{d: {"m.c": big(d.replace("/", "_"), 210)} for d in by_split.values()},
    }
    for d, fs in files.items():
        (root / d).mkdir(parents=True, exist_ok=True)
        for name, text in fs.items():
            (root / d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    (root / "kernel/skip/link.c").symlink_to(root / "kernel/skip/ok.c")  # a link is no file of its own
    return files, by_split


def test_code_corpus_builder(tmp_path):
    """prepare_code.py's rules on a made-up tree: excluded folders, .h then .c in name order with their
    headers, files over 256 KiB / not UTF-8 / links skipped, the 2 MiB cap, the 200 KiB floor, the split
    rule with the reserved range written nowhere, and the same documents from the folder and its .tar.xz."""
    import tarfile

    import prepare_code as pc
    files, by_split = _code_tree(tmp_path / "linux-6.12")
    counts = pc.build(str(tmp_path / "linux-6.12"), str(tmp_path / "raw"), log=lambda s: None)
    written = {p.relative_to(tmp_path / "raw").as_posix(): p.read_text() for p in (tmp_path / "raw").rglob("*.txt")}
    where = {name.split("/")[1][:-4].replace("__", "/"): name.split("/")[0] for name in written}
    assert "kernel/small" not in where and not any(d.startswith(("arch", "tools", "drivers/gpu/drm/amd/include")) for d in where)
    assert by_split[None] not in where  # reserved: written nowhere
    for split in ("train", "validation", "test"):
        assert where[by_split[split]] == split
    for d in ("kernel/sched", "kernel/big", "kernel/skip", "drivers/gpu/drm/amd/display"):
        assert where[d] == pc.split_of(d)
    doc = lambda d: written[f"{where[d]}/{d.replace('/', '__')}.txt"]  # noqa: E731
    sched = doc("kernel/sched")
    heads = re.findall(r"^// file: (.*)$", sched, re.M)
    assert heads == ["kernel/sched/c.h", "kernel/sched/z.h", "kernel/sched/a.c", "kernel/sched/b.c"]
    assert sched == "\n".join(f"// file: kernel/sched/{n}\n{files['kernel/sched'][n]}" for n in ("c.h", "z.h", "a.c", "b.c"))
    big = doc("kernel/big")
    n_files = len(re.findall(r"^// file: ", big, re.M))
    assert len(big) > pc.DOC_CAP and n_files < 12  # stopped once past 2 MiB ...
    assert len(big.rsplit("\n// file: ", 1)[0]) <= pc.DOC_CAP  # ... and not before
    assert re.findall(r"^// file: (.*)$", doc("kernel/skip"), re.M) == ["kernel/skip/ok.c"]
    assert counts == {"train": sum(s == "train" for s in where.values()), "validation": sum(s == "validation" for s in where.values()),
                      "test": sum(s == "test" for s in where.values()), "reserved": 1}
    meta_rows = (tmp_path / "raw/metadata.csv").read_text().splitlines()
    assert meta_rows[0] == "_id,directory" and "kernel__sched,kernel/sched" in meta_rows
    # the archive of the same tree gives the same bytes; a second build replaces the first whole
    (tmp_path / "kernel/skip").mkdir(parents=True)
    with tarfile.open(tmp_path / "linux.tar.xz", "w:xz") as tar:
        tar.add(tmp_path / "linux-6.12", arcname="linux-source-6.12")
    pc.build(str(tmp_path / "linux.tar.xz"), str(tmp_path / "raw"), log=lambda s: None)
    again = {p.relative_to(tmp_path / "raw").as_posix(): p.read_text() for p in (tmp_path / "raw").rglob("*.txt")}
    assert again == written and not (tmp_path / "raw.tmp").exists()
    with tarfile.open(tmp_path / "dot.tar.xz", "w:xz") as tar:  # `tar c ./linux`: every name starts with ./
        tar.add(tmp_path / "linux-6.12", arcname="./linux-source-6.12")
    pc.build(str(tmp_path / "dot.tar.xz"), str(tmp_path / "raw"), log=lambda s: None)
    assert {p.relative_to(tmp_path / "raw").as_posix(): p.read_text() for p in (tmp_path / "raw").rglob("*.txt")} == written
    with pytest.raises(ValueError, match="no directory holds 200 KiB"):
        pc.build(str(tmp_path / "kernel"), str(tmp_path / "raw2"), log=lambda s: None)
    with pytest.raises(FileNotFoundError, match="nope not found"):
        pc.build(str(tmp_path / "nope"), str(tmp_path / "raw2"), log=lambda s: None)


def test_code_corpus_errors(tmp_path, monkeypatch):
    """prepare_code.py's --source errors say what is wrong (not found; not a valid archive, or one cut short)
    and leave no output folder behind; a dataset already in --out is kept: the run stops before building,
    and with --overwrite a failed build keeps it too."""
    import random
    import tarfile

    import prepare_code as pc
    tokenizer_or_skip(monkeypatch)
    out = tmp_path / "out"

    def error(source, *extra):
        with pytest.raises(SystemExit) as e:
            pc.main(["--source", str(source), "--out", str(out), "--num_proc=1", *extra])
        assert "\n" not in str(e.value)
        return str(e.value)
    nope = tmp_path / "nope.tar.xz"
    assert error(nope) == f"prepare_code.py: error: --source {nope} not found: give a Linux source tree, a folder or its .tar.xz"
    (tmp_path / "text.tar.xz").write_text("not xz at all")
    assert re.match(r"prepare_code.py: error: --source .*text.tar.xz is not a valid tar archive", error(tmp_path / "text.tar.xz"))
    rng = random.Random(0)
    (tmp_path / "linux/kernel/a").mkdir(parents=True)
    for name in ("x.c", "y.c"):  # random text, which compresses little: a cut lands in any part of the tree
        (tmp_path / "linux/kernel/a" / name).write_text("".join(rng.choice("abcdefgh \n") for _ in range(250_000)))
    for ext, mode in (("xz", "w:xz"), ("gz", "w:gz"), ("tar", "w")):
        name = "linux.tar" + ("" if ext == "tar" else f".{ext}")
        with tarfile.open(tmp_path / name, mode) as tar:
            tar.add(tmp_path / "linux", arcname="linux")
        whole = (tmp_path / name).read_bytes()
        cuts = [int(len(whole) * f) for f in (0.3, 0.5, 0.7)]  # inside a file
        # where a tar stream alone reads a whole archive: before y.c's header; in the compressed stream's trailer
        cuts.append(whole.index(b"linux/kernel/a/y.c") if ext == "tar" else len(whole) - 5)
        for cut in cuts:
            (tmp_path / ("cut." + name[6:])).write_bytes(whole[:cut])
            assert re.match(r"prepare_code.py: error: --source .*cut.tar.* is not a valid tar archive \(.*: cut short\?\)",
                            error(tmp_path / ("cut." + name[6:]))), (ext, cut)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/README").write_text("no C here")
    assert "no directory holds 200 KiB of .c/.h files" in error(tmp_path / "docs")
    assert not out.exists()  # none of these made the output folder

    src = tmp_path / "books"
    _write_books(src, {"train": {1: "a book"}, "validation": {2: "b"}, "test": {3: "c"}})
    prepare_pg19.prepare(str(src), str(out), num_proc=1, log=lambda s: None)
    before = _files(out)
    assert re.match(rf"prepare_code.py: error: {re.escape(str(out))} already holds a dataset \(train \d+ tokens in 1 book, "
                    r".*\): pass --overwrite to replace it, or another --out$", error(tmp_path / "linux.tar.xz"))
    assert "no directory holds" in error(tmp_path / "docs", "--overwrite")  # past the check, to the build's error
    assert "nothing.tiktoken" in error(tmp_path / "linux.tar.xz", "--overwrite", f"--tokenizer_file={tmp_path / 'nothing.tiktoken'}")
    assert _files(out) == before  # the tokenizer is checked before the tree is read and raw/ replaced


def test_code_corpus_keeps_user_files(tmp_path, monkeypatch):
    """prepare_code.py deletes nothing it did not write: a raw/ (or train.bin) of the user's in --out stops the run at
    once; with --overwrite a file of the user's in raw/ stops it too, before the tree is read; a folder beside raw/
    is never touched, whatever its name; a build's own raw/ is replaced."""
    import prepare_code as pc
    tokenizer_or_skip(monkeypatch)
    _code_tree(tmp_path / "tree")
    out = tmp_path / "mine2"
    (out / "raw").mkdir(parents=True)
    (out / "raw" / "notes.txt").write_text("my notes")
    (out / "raw.tmp").mkdir()
    (out / "raw.tmp" / "keep.txt").write_text("keep")

    def files():
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def run(*extra):
        pc.main(["--source", str(tmp_path / "tree"), "--out", str(out), "--num_proc=1", "--max_books=1", *extra])
    with pytest.raises(SystemExit) as e:
        run()
    assert str(e.value) == (f"prepare_code.py: error: {out} already holds raw, not a finished dataset (no meta.json): "
                            f"pass --overwrite to replace it, or another --out")
    read = pc.tree_files
    monkeypatch.setattr(pc, "tree_files", lambda *a: pytest.fail("read the tree"))
    with pytest.raises(SystemExit) as e:
        run("--overwrite")
    assert str(e.value) == (f"prepare_code.py: error: {out / 'raw'}, where the documents go, holds files prepare_code.py "
                            f"did not write ({out / 'raw' / 'notes.txt'}): move them out of it, or pass another --out")
    assert files() == {"raw/notes.txt": b"my notes", "raw.tmp/keep.txt": b"keep"}
    monkeypatch.setattr(pc, "tree_files", read)
    (out / "raw" / "notes.txt").rename(tmp_path / "notes.txt")
    run("--overwrite")
    built = files()
    assert built["raw.tmp/keep.txt"] == b"keep" and "meta.json" in built and "raw/metadata.csv" in built
    (out / "raw" / "train" / "mine.txt").write_text("mine")
    with pytest.raises(SystemExit, match=re.escape(f"did not write ({out / 'raw' / 'train' / 'mine.txt'})")):
        run("--overwrite")
    assert files() == {**built, "raw/train/mine.txt": b"mine"}
    (out / "raw" / "train" / "mine.txt").unlink()
    run("--overwrite")  # over a build's own raw/: replaced
    assert files() == built and sorted(os.listdir(out)) == ["meta.json", "raw", "raw.tmp", "test.bin", "train.bin", "val.bin"]


def test_code_corpus_num_proc(tmp_path):
    import prepare_code as pc
    for flag in ("--num_proc=0", "--num_proc=-3"):  # as prepare_pg19.py refuses them
        with pytest.raises(SystemExit, match=rf"^prepare_code.py: error: {flag}: must be >= 1$"):
            pc.main(["--source", str(tmp_path / "linux.tar.xz"), "--out", str(tmp_path / "out"), flag])


def test_code_corpus_train_every(tmp_path, monkeypatch):
    """--train_every=2 (the README's code runs): every second training document in the dataset's order, each
    with the tokens the whole build gives it; validation and test whole. Bad values stop at once."""
    import numpy as np

    import prepare_code as pc
    tokenizer_or_skip(monkeypatch)
    _code_tree(tmp_path / "tree")
    for name, extra in (("all", []), ("half", ["--train_every=2"])):
        pc.main(["--source", str(tmp_path / "tree"), "--out", str(tmp_path / name), "--num_proc=1", *extra])
    full, half = (json.loads((tmp_path / n / "meta.json").read_text())["splits"] for n in ("all", "half"))
    assert len(full["train"]["offsets"]) >= 4
    assert [b for b, _, _ in half["train"]["offsets"]] == [b for b, _, _ in full["train"]["offsets"]][::2]
    tokens = {n: np.fromfile(tmp_path / n / "train.bin", dtype=np.uint16) for n in ("all", "half")}
    cut = np.concatenate([tokens["all"][a : a + n] for _, a, n in full["train"]["offsets"][::2]])
    assert np.array_equal(cut, tokens["half"])  # what cutting the whole build's train.bin gives, byte for byte
    for f in ("val.bin", "test.bin"):
        assert (tmp_path / "all" / f).read_bytes() == (tmp_path / "half" / f).read_bytes()
    with pytest.raises(SystemExit, match="--train_every=0: give a positive number"):
        pc.main(["--source", str(tmp_path / "tree"), "--out", str(tmp_path / "x"), "--train_every=0"])


def test_code_corpus_trains_and_scores(tmp_path, monkeypatch, capsys):
    """prepare_code.py end to end on a made-up tree: tokenized as PG19 is, read by train.py, scored by
    evaluate.py --ppl with the documents named by their directories."""
    import evaluate
    import prepare_code as pc
    tokenizer_or_skip(monkeypatch)
    _code_tree(tmp_path / "tree")
    out = tmp_path / "code"
    pc.main(["--source", str(tmp_path / "tree"), "--out", str(out), "--num_proc=1", "--max_books=2"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["splits"]["train"]["books"] == 2
    assert all(meta["titles"][b] == b.replace("__", "/") for m in meta["splits"].values() for b, _, _ in m["offsets"])
    names = [name for name, _ in evaluate.read_docs(str(out / "test.bin"), enc=None)]
    assert names == [b for b, _, _ in meta["splits"]["test"]["offsets"]]  # named as in meta.json: its directory
    small = ["--n_embd=32", "--n_head=2", "--n_lower=1", "--groups=(1,)", "--n_enc=1", "--window=128", "--topk=2",
             "--batch_size=2", "--block_size=252", "--tokens_per_step=0", "--max_iters=2", "--eval_interval=2", "--eval_iters=1",
             "--log_interval=1", "--device=cpu"]
    hist = train.main([*small, "--dataset=code", f"--data_dir={out}", f"--out_dir={tmp_path / 'run'}"])
    assert [it for it, _ in hist] == [1, 2]
    capsys.readouterr()
    evaluate.main([f"--out_dir={tmp_path / 'run'}", "--ppl", f"--docs={out}/test.bin", "--max_tokens=2000", "--device=cpu"])
    text = capsys.readouterr().out
    assert re.search(r"^\s+1K-4K\s+976\s+\d+\.\d\d$", text, re.M)  # tokens 1,024-1,999 predicted
