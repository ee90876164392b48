"""
Tests for prepare_pg19.py (tokenizer, local prepare, errors, interrupted runs,
resumable download from a fake bucket). Run: python -m pytest -q test_prepare.py
Each test is self-contained so it can move into test_gca.py as it is.
"""
import http.server
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import prepare_pg19

SHARED = Path(__file__).resolve().parent.parent / "shared"


def _tokenizer_or_skip(monkeypatch):
    # the shared ranks file works offline; without it, tiktoken must download 'gpt2'
    default = SHARED / "data/tokenizers/gpt2.tiktoken"
    if not os.environ.get("DRT_GPT2_RANKS") and default.is_file():
        monkeypatch.setenv("DRT_GPT2_RANKS", str(default))
    try:
        return prepare_pg19.get_tokenizer()
    except (RuntimeError, FileNotFoundError) as e:
        pytest.skip(f"no GPT-2 tokenizer: {e}")


def _write_books(root, books, metadata=None):
    # books: {split: {book_id: text or bytes}}
    for split, bs in books.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for book_id, text in bs.items():
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            (root / split / f"{book_id}.txt").write_bytes(data)
    if metadata is not None:
        (root / "metadata.csv").write_text(metadata, encoding="utf-8")


def test_tokenizer_local_file(monkeypatch):
    enc = _tokenizer_or_skip(monkeypatch)
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary(" the") == [262]
    assert enc.n_vocab == prepare_pg19.GPT2_VOCAB == 50257
    assert enc.eot_token == prepare_pg19.EOT == 50256
    text = "It was the best of times,\r\nit was the worst of times — naïve café 日本 <|endoftext|>\n\n"
    assert enc.decode(enc.encode_ordinary(text)) == text
    with pytest.raises(FileNotFoundError, match="nope.tiktoken"):
        prepare_pg19.get_tokenizer("/nonexistent/nope.tiktoken")


def test_prepare_tiny_layout(tmp_path, monkeypatch):
    enc = _tokenizer_or_skip(monkeypatch)
    books = {
        "train": {10: "Chapter I.\n\nCall me Ishmael. " * 50, 9: "Short book.\r\nWith CRLF.\r\n",
                  123: "Ünïcødé — “quotes” and <|endoftext|> as plain text.\n", 7: ""},
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


def test_prepare_shared_sample(tmp_path, monkeypatch):
    src = Path(__file__).resolve().parent.parent / "shared/data/pg19-sample"
    if not src.is_dir():
        pytest.skip(f"{src} not present")
    enc = _tokenizer_or_skip(monkeypatch)
    meta = prepare_pg19.prepare(str(src), str(tmp_path), num_proc=2, log=lambda s: None)
    assert {n: m["books"] for n, m in meta["splits"].items()} == {"train": 20, "val": 2, "test": 2}
    for name, m in meta["splits"].items():
        data = np.memmap(tmp_path / m["file"], dtype=np.uint16, mode="r")
        assert m["tokens"] == len(data) == sum(n for _, _, n in m["offsets"])
        assert int((data == 50256).sum()) == m["books"]
        assert int(data.max()) < 50257
    book_id, start, n = meta["splits"]["val"]["offsets"][-1]
    data = np.memmap(tmp_path / "val.bin", dtype=np.uint16, mode="r")
    assert enc.decode(data[start:start + n - 1].tolist()) == (src / "validation" / f"{book_id}.txt").read_text("utf-8")
    assert meta["titles"][str(book_id)] == "The Adventures of Sherlock Holmes"


def test_prepare_errors(tmp_path, monkeypatch):
    _tokenizer_or_skip(monkeypatch)
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
    with pytest.raises(ValueError, match="not writable"):  # works as root too, unlike chmod
        prepare_pg19.prepare(str(src), str(tmp_path / "a_file" / "out"), **quiet)

    with pytest.raises(SystemExit, match="no_such_dir"):  # the CLI turns errors into one clear line
        prepare_pg19.main(["--source", str(tmp_path / "no_such_dir"), "--out", str(tmp_path / "out")])


def test_prepare_interrupted_leaves_nothing_complete(tmp_path, monkeypatch):
    _tokenizer_or_skip(monkeypatch)
    books = {str(i): "Some perfectly fine text. " * 200 for i in range(1, 9)}
    books["99"] = b"fine start, then \xff\xfe garbage"  # sorts last: fails after the others were written
    _write_books(tmp_path / "src", {"train": books, "validation": {1: "v"}, "test": {1: "t"}})
    out = tmp_path / "out"
    out.mkdir()
    (out / "meta.json").write_text('{"splits": {}}')  # from an earlier run: must not survive a failed one
    with pytest.raises(ValueError, match="99.txt"):
        prepare_pg19.prepare(str(tmp_path / "src"), str(out), num_proc=2, log=lambda s: None)
    assert os.listdir(out) == []  # no train.bin, no train.bin.tmp, no meta.json


def test_download_fake_bucket(tmp_path):
    files = {f"train/{i}.txt": f"train book {i}\n".encode() * (i + 1) for i in (1, 2, 3, 10, 11)}
    files.update({"validation/5.txt": b"val\n", "test/6.txt": "tést\n".encode(), "metadata.csv": b"1,One,1900,u\n"})
    requests, fail_once = [], {"train/3.txt"}  # one transient 503 to exercise the retry

    class Bucket(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            from urllib.parse import urlparse, parse_qs, unquote
            u = urlparse(self.path)
            if u.path == "/storage/v1/b/bkt/o":  # listing, 2 items per page
                q = parse_qs(u.query)
                names = sorted(n for n in files if n.startswith(q["prefix"][0]))
                start = int(q.get("pageToken", ["0"])[0])
                page = {"items": [{"name": n, "size": str(len(files[n]))} for n in names[start:start + 2]]}
                if start + 2 < len(names):
                    page["nextPageToken"] = str(start + 2)
                body = json.dumps(page).encode()
            else:
                name = unquote(u.path[len("/bkt/"):])
                requests.append(name)
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
    base = f"http://127.0.0.1:{server.server_address[1]}"
    kw = dict(api_url=f"{base}/storage/v1/b/bkt/o", base_url=f"{base}/bkt", workers=4, backoff=0.0,
              log=lambda s: None)
    raw = tmp_path / "raw"
    try:
        # a .part from an interrupted download, and a truncated file under its final name
        (raw / "train").mkdir(parents=True)
        (raw / "train" / "2.txt.part").write_bytes(files["train/2.txt"][:5])
        (raw / "train" / "10.txt").write_bytes(files["train/10.txt"][:7])
        assert prepare_pg19.download_pg19(str(raw), **kw) == len(files)
        got = {str(p.relative_to(raw)): p.read_bytes() for p in raw.rglob("*") if p.is_file()}
        assert got == files  # every file whole, no .part left
        assert sorted(requests) == sorted(list(files) + ["train/3.txt"])  # 3.txt twice: the retry

        requests.clear()
        assert prepare_pg19.download_pg19(str(raw), **kw) == 0  # resume: nothing to fetch
        assert requests == []
    finally:
        server.shutdown()
        server.server_close()
