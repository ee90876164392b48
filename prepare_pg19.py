"""
Prepare PG19 for DRT: get the books, tokenize them with GPT-2 BPE and write
flat uint16 token files that train.py memory-maps.

    python prepare_pg19.py                                    # download PG19 (~11 GB) to data/pg19/raw
    python prepare_pg19.py --max_books=20                     # a small real start: 20 books of each split
    python prepare_pg19.py --source /path/to/pg19             # or use a local copy laid out like PG19
    python prepare_pg19.py --source /path/to/pg19 --out data/pg19 --num_proc 16
    DRT_GPT2_RANKS=/path/to/r50k_base.tiktoken python prepare_pg19.py ...   # offline tokenizer

Input layout (the PG19 release, bucket gs://deepmind-gutenberg): train/,
validation/, test/ folders of <gutenberg_id>.txt, plus an optional
metadata.csv (id,title,year,url; the real one has no header row).
--max_books=N takes the first N books of each split in the bucket's order
(by file name: 10.txt before 9.txt), from the bucket or from --source alike,
so a download fetches those books and lists only the first page(s). Reruns
are cheap: files already downloaded whole are skipped.

A dataset already in --out (its meta.json), or any file a run would write
there (a train.bin of your own), is kept: a run over it stops at once, naming
what is there; --overwrite replaces it (with --splits, those splits alone).
An empty (or whitespace-only) book is skipped, and said so.

Output in --out: train.bin, val.bin, test.bin (uint16 GPT-2 ids, each book
followed by <|endoftext|> = 50256) and meta.json: per split ("train", "val",
"test") the numbers of books and tokens and the book offsets
[book_id, start, n_tokens], plus titles from metadata.csv. meta.json being
there is what marks the output complete. Nothing is lost on a failed run:
every book is read and UTF-8-checked before anything is written, the new
files are written in a temporary folder of the run's own, and the previous
dataset is replaced only when the new one is whole (meta.json removed, .bin
files renamed into place, new meta.json written last); an --out folder the
run made is removed again.
"""
import argparse
import csv
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from common import EOT, GPT2_VOCAB, RANKS_URL, fmt_time, get_tokenizer, read_meta, unwritable  # noqa: F401 (re-exported)

SPLITS = {"train": "train", "validation": "val", "test": "test"}  # PG19 folder -> output name
BUCKET_API = "https://storage.googleapis.com/storage/v1/b/deepmind-gutenberg/o"
BUCKET_URL = "https://storage.googleapis.com/deepmind-gutenberg"

def _print(msg):
    print(msg, flush=True)  # flush: progress must show up in logs and under nohup/tee

# -----------------------------------------------------------------------------
# download from the public GCS bucket

def _retry(fn, what, retries, backoff):
    for attempt in range(retries):
        try:
            return fn()
        except (OSError, ValueError) as e:  # URLError, HTTPError, timeouts, resets; ValueError: bad JSON
            if isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500 and e.code not in (408, 429):
                raise RuntimeError(f"{what} failed: HTTP {e.code} {e.reason}") from e  # retrying won't help
            if attempt == retries - 1:
                raise RuntimeError(f"{what} failed after {retries} tries: {e}") from e
            time.sleep(backoff * 2 ** attempt)

def list_bucket(api_url, prefix, retries=5, backoff=1.0, suffix="", limit=None):
    """[(object name, size)] under prefix whose names end in suffix, in the
    bucket's order (by name), following nextPageToken until limit are found."""
    def get(url):
        with urllib.request.urlopen(url, timeout=60) as r:
            return json.load(r)
    items, token = [], None
    while True:
        query = {"prefix": prefix, "fields": "items(name,size),nextPageToken"}
        if token:
            query["pageToken"] = token
        url = f"{api_url}?{urllib.parse.urlencode(query)}"
        page = _retry(lambda: get(url), f"listing {url}", retries, backoff)
        items += [(it["name"], int(it["size"])) for it in page.get("items", [])  # GCS sends sizes as strings
                  if it["name"].endswith(suffix)]
        token = page.get("nextPageToken")
        if not token or (limit is not None and len(items) >= limit):  # --max_books: no more pages than needed
            return items[:limit]

def _fetch(url, dest, size, retries, backoff):
    # write to .part and rename: a file under its final name is always whole,
    # so resuming only has to compare sizes
    part = dest + ".part"
    def once():
        with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
        if os.path.getsize(part) != size:
            raise OSError(f"got {os.path.getsize(part)} bytes, the listing says {size}")
        os.replace(part, dest)
        return size
    return _retry(once, f"download of {url}", retries, backoff)

def download_pg19(raw_dir, splits=tuple(SPLITS), max_books=None, api_url=BUCKET_API, base_url=BUCKET_URL,
                  workers=16, retries=5, backoff=1.0, log=_print):
    """Mirror metadata.csv and <split>/<id>.txt from the bucket into raw_dir:
    every book, or the first max_books of each split in the bucket's order.
    Resumable: files already present with the listed size are skipped.
    Returns the number of files downloaded."""
    objects = list_bucket(api_url, "metadata.csv", retries, backoff)
    for split in splits:
        found = list_bucket(api_url, split + "/", retries, backoff, suffix=".txt", limit=max_books)
        if not found:
            raise ValueError(f"the bucket listing {api_url} has no {split}/*.txt objects")
        objects += found
    todo = []
    for name, size in objects:
        dest = os.path.join(raw_dir, *name.split("/"))
        if not (os.path.isfile(dest) and os.path.getsize(dest) == size):
            todo.append((name, dest, size))
    total_mb = sum(s for _, _, s in todo) / 1e6
    log(f"download: {len(objects)} files listed, {len(objects) - len(todo)} already present, "
        f"{len(todo)} to fetch ({total_mb:.1f} MB) into {raw_dir}")
    for d in {os.path.dirname(dest) for _, dest, _ in todo}:
        os.makedirs(d, exist_ok=True)
    t0 = last = time.time()
    done_mb = 0.0
    with ThreadPoolExecutor(workers) as ex:  # threads: the work is waiting on the network
        futures = [ex.submit(_fetch, f"{base_url}/{urllib.parse.quote(name)}", dest, size, retries, backoff)
                   for name, dest, size in todo]
        try:
            for i, fut in enumerate(as_completed(futures), 1):
                done_mb += fut.result() / 1e6
                if time.time() - last > 2 or i == len(todo):
                    last, dt = time.time(), time.time() - t0
                    rate = done_mb / max(dt, 1e-9)
                    log(f"download: {i}/{len(todo)} files, {done_mb:.1f}/{total_mb:.1f} MB, {rate:.2f} MB/s, "
                        f"ETA {fmt_time((total_mb - done_mb) / max(rate, 1e-9))}")
        except BaseException:  # a failure or Ctrl-C: don't sit through the rest of the queue
            for fut in futures:
                fut.cancel()
            raise
    return len(todo)

# -----------------------------------------------------------------------------
# read the local layout, check it, tokenize

def _book_id(path):
    stem = os.path.basename(path)[:-len(".txt")]
    return int(stem) if stem.isdigit() else stem

def list_books(source, split, max_books=None):
    """Sorted [(book_id, path)] of <source>/<split>/*.txt: all of them, or the
    first max_books by file name. That is the bucket's order, so a --max_books
    download and a --max_books run over any fuller copy take the same books."""
    folder = os.path.join(source, split)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"split folder {folder} not found: --source must hold train/, validation/ "
                                f"and test/ folders of <id>.txt files (or pass --splits to choose)")
    names = sorted(f for f in os.listdir(folder) if f.endswith(".txt"))[:max_books]
    if not names:
        raise ValueError(f"split folder {folder} has no .txt files: is the download incomplete?")
    books = [(_book_id(f), os.path.join(folder, f)) for f in names]
    # numeric ids first, in numeric order: listdir order differs between machines
    return sorted(books, key=lambda b: (isinstance(b[0], str), b[0]))

def read_titles(source):
    """{book_id: title} from metadata.csv (prepare_code.py: {name: directory}), if there is one; with or
    without a header row."""
    path = os.path.join(source, "metadata.csv")
    if not os.path.isfile(path):
        return {}
    with open(path, newline="", encoding="utf-8", errors="replace") as f:  # informational only
        rows = [r for r in csv.reader(f) if len(r) >= 2]
    return {r[0]: r[1] for r in rows if r[0] != "_id"}  # the sample's header row ("_id,...") is no book

def _check_book(path):
    """(path, bytes read, what is wrong or None, whether it is blank: empty or whitespace only)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return path, 0, f"cannot read {path}: {e}", False
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return path, len(data), f"{path} is not valid UTF-8 ({e})", False
    return path, len(data), None, not text.strip()

def check_books(paths, pool, log=_print):
    """Read and UTF-8-decode every book, in the workers, before anything is
    written: a bad book in test/ must not be found after hours of tokenizing
    train/. Costs one read and decode of the text, no tokenizing. Returns the
    set of blank books (empty or whitespace only)."""
    total_mb = sum(os.path.getsize(p) for p in paths) / 1e6
    results = pool.imap_unordered(_check_book, paths) if pool else map(_check_book, paths)
    bad, blank, done_mb = [], set(), 0.0
    t0 = last = time.time()
    for i, (path, n_bytes, err, is_blank) in enumerate(results, 1):
        done_mb += n_bytes / 1e6
        if err:
            bad.append(err)
        if is_blank:
            blank.add(path)
        if time.time() - last > 1 or i == len(paths):
            last, dt = time.time(), time.time() - t0
            rate = done_mb / max(dt, 1e-9)
            log(f"check: {i}/{len(paths)} books read and UTF-8-decoded, {done_mb:.1f}/{total_mb:.1f} MB, "
                f"{rate:.0f} MB/s, ETA {fmt_time((total_mb - done_mb) / max(rate, 1e-9))}")
    if bad:
        bad.sort()  # workers finish in any order
        more = f"; and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{len(bad)} of {len(paths)} books cannot be used: {'; '.join(bad[:3])}{more}. "
                         f"Fix or remove the bad books and rerun; nothing was written")
    return blank

_enc = None  # the tokenizer of this (worker) process

def _init_worker(ranks_file, worker=False):
    global _enc
    if worker:  # a Ctrl-C reaches every process of the terminal's group: the main one alone says so
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _enc = get_tokenizer(ranks_file)

def _encode_book(path):
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")  # bytes as they are: no newline translation
    except UnicodeDecodeError as e:  # check_books has looked, but the file may have changed since
        raise ValueError(f"{path} is not valid UTF-8 ({e}); fix or remove the file") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    ids = _enc.encode_ordinary(text)  # ordinary: "<|endoftext|>" inside a book is just text
    ids.append(EOT)
    return np.array(ids, dtype=np.uint16)

def tokenize_split(books, path, pool, log=_print, name=""):
    """Stream the tokens of books [(book_id, path)] into the file at path.
    Returns the split's books, tokens and offsets. pool=None tokenizes in this
    process."""
    total_bytes = sum(os.path.getsize(p) for _, p in books)
    offsets, n_tok, done_bytes = [], 0, 0
    t0 = last = time.time()
    paths = [p for _, p in books]
    results = pool.imap(_encode_book, paths) if pool else map(_encode_book, paths)  # in book order, as they finish
    with open(path, "wb") as f:
        for i, ((book_id, book), ids) in enumerate(zip(books, results), 1):
            ids.tofile(f)
            offsets.append([book_id, n_tok, len(ids)])
            n_tok += len(ids)
            done_bytes += os.path.getsize(book)
            if time.time() - last > 1 or i == len(books):
                last, dt = time.time(), time.time() - t0
                eta = dt * (total_bytes - done_bytes) / max(done_bytes, 1)  # by bytes: books vary 100x in size
                log(f"{name}: {i}/{len(books)} books, {n_tok:,} tokens, {n_tok / max(dt, 1e-9):,.0f} tok/s, "
                    f"ETA {fmt_time(eta)}")
        f.flush()
        os.fsync(f.fileno())  # whole on disk before it may be renamed over the old one
    return {"books": len(books), "tokens": n_tok, "offsets": offsets}


def split_said(name, m):
    """'train 6,560,000 tokens in 20 books': a split of a meta.json, as much of it as it says."""
    books = f" in {m['books']:,} book" + "s" * (m["books"] != 1) if "books" in m else ""
    return f"{name} {m['tokens']:,} tokens{books}" if "tokens" in m else name

def refuse_existing(out_dir, names):
    """A ValueError, in one line that says what out_dir holds, if it holds a prepared dataset (a meta.json,
    readable or not) or any other of names (what the run would write: a user's train.bin is kept as well),
    or if it is a file: main calls it before any work, unless --overwrite."""
    try:
        present = os.listdir(out_dir)
    except FileNotFoundError:
        return
    except NotADirectoryError:
        what = "is a file, not a folder" if os.path.exists(out_dir) else "is inside a file"
        raise ValueError(f"output folder {out_dir} {what}: pass --out a folder") from None
    meta = read_meta(out_dir, f"pass --overwrite to replace the dataset in {out_dir}, or another --out")
    if meta is not None:
        held = ", ".join(split_said(name, m) for name, m in meta["splits"].items()) or "no splits"
        raise ValueError(f"{out_dir} already holds a dataset ({held}, by its meta.json): pass --overwrite to "
                         f"replace it, or another --out")
    if there := [n for n in names if n in present]:
        raise ValueError(f"{out_dir} already holds {', '.join(there)}, not a finished dataset (no meta.json): pass "
                         f"--overwrite to replace {'it' if len(there) == 1 else 'them'}, or another --out")

def missing_top(folder):
    """The outermost folder of folder's path that does not exist yet, None if folder exists: what this run
    makes, and a failed run removes again."""
    folder, top = os.path.abspath(folder), None
    while not os.path.lexists(folder):
        folder, top = os.path.dirname(folder), folder
    return top

def remove_made(folder, top):
    """After a failed run: remove folder and the folders above it up to top (missing_top before the run), as
    long as they are empty, so that "nothing was written" holds; a file anyone put there stays."""
    folder = os.path.abspath(folder)
    while top:
        try:
            os.rmdir(folder)  # only ever an empty folder
        except OSError:
            return
        if folder == top:
            return
        folder = os.path.dirname(folder)

def swap_in(meta, meta_path, bins, work):
    """Put a finished run in place: meta written in the run's own temporary folder work, then meta.json out
    first, the new .bin files over the old ones (bins: {temporary path: final path}), meta.json in last,
    so that no meta.json ever describes .bin files of another run."""
    tmp_meta = os.path.join(work, "meta.json")
    with open(tmp_meta, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(meta_path):
        os.remove(meta_path)
    for tmp, final in bins.items():
        os.replace(tmp, final)
    os.replace(tmp_meta, meta_path)

def prepare(source, out_dir, splits=tuple(SPLITS), num_proc=None, ranks_file=None, log=_print, max_books=None,
            train_every=1):
    """Tokenize <source>/<split>/*.txt (all, or the first max_books of each
    split; of train, every train_every-th of those in id order) into
    <out_dir>/{train,val,test}.bin and meta.json. Returns the meta
    dict. A dataset already in out_dir is left as it was unless this run
    completes: the new files are written in a temporary folder of its own and
    swapped in at the end. Blank books (empty, whitespace only) are skipped.
    A failed run removes the out_dir it made."""
    if not os.path.isdir(source):
        raise FileNotFoundError(f"source folder {source} not found: pass --source with a PG19 copy "
                                f"(train/ validation/ test/), or leave it out to download PG19")
    for s in splits:
        if s not in SPLITS:
            raise ValueError(f"unknown split {s!r}: choose from {', '.join(SPLITS)}")
    if max_books is not None and max_books < 1:
        raise ValueError(f"max_books={max_books}: give a positive number of books per split, or none for all")
    if train_every < 1:
        raise ValueError(f"train_every={train_every}: give a positive number")
    books = {s: list_books(source, s, max_books) for s in splits}  # every split before any real work
    if "train" in books:
        books["train"] = books["train"][::train_every]
    ranks_file = ranks_file or os.environ.get("DRT_GPT2_RANKS")
    _init_worker(ranks_file)  # fail fast on a tokenizer problem, before starting workers
    top = missing_top(out_dir)
    if why := unwritable(out_dir):
        raise ValueError(f"output folder {why}: pass --out to a writable folder")
    meta_path = os.path.join(out_dir, "meta.json")
    try:
        old = read_meta(out_dir) or {}
    except ValueError:  # unreadable: this run starts afresh (main refuses it without --overwrite)
        old = {}
    work, done, pool = tempfile.mkdtemp(prefix=".prepare-", dir=out_dir), False, None  # no user's file has its name
    tmp = {s: os.path.join(work, SPLITS[s] + ".bin") for s in splits}
    num_proc = num_proc or min(8, os.cpu_count() or 1)
    try:
        pool = mp.Pool(num_proc, initializer=_init_worker, initargs=(ranks_file, True)) if num_proc > 1 else None
        blank = check_books([p for s in splits for _, p in books[s]], pool, log)
        for s in splits:  # a blank book would be an <|endoftext|> alone: nothing to learn or score
            for _, p in books[s]:
                if p in blank:
                    log(f"{s}: skipped {p}: empty or whitespace only")
            books[s] = [b for b in books[s] if b[1] not in blank]
            if not books[s]:
                raise ValueError(f"split folder {os.path.join(source, s)}: every book is empty or whitespace "
                                 f"only, so the split would have no text: add books, or leave the split out "
                                 f"(--splits); nothing was written")
        new = {}
        for s in splits:
            t0 = time.time()
            m = tokenize_split(books[s], tmp[s], pool, log, s)
            new[SPLITS[s]] = m = {"folder": s, "file": SPLITS[s] + ".bin", **m}
            log(f"{s}: {m['books']} books, {m['tokens']:,} tokens in {time.time() - t0:.1f}s")
        # keep the entries of splits this run does not rewrite
        kept = {name: m for name, m in old.get("splits", {}).items()
                if name not in new and os.path.isfile(os.path.join(out_dir, m["file"]))}
        ids = {str(b[0]) for m in {**kept, **new}.values() for b in m["offsets"]}
        titles = {**old.get("titles", {}), **read_titles(source)}
        meta = {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB, "eot": EOT, "dtype": "uint16",
                "source": os.path.abspath(source), "splits": {**kept, **new},
                "titles": {i: t for i, t in titles.items() if i in ids}}
        swap_in(meta, meta_path, {tmp[s]: os.path.join(out_dir, SPLITS[s] + ".bin") for s in splits}, work)
        done = True
    finally:
        if pool:
            pool.terminate()  # also stops workers still busy after an error
        shutil.rmtree(work, ignore_errors=True)  # a failed run leaves no temp files
        if not done:
            remove_made(out_dir, top)
    log(f"wrote {', '.join(m['file'] for m in new.values())} and meta.json to {out_dir}")
    return meta

# -----------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description="Download/tokenize PG19 into uint16 .bin files for DRT.")
    p.add_argument("--source", default=None, help="local PG19 copy (train/ validation/ test/ of <id>.txt); "
                   "default: download PG19 into --raw_dir first")
    p.add_argument("--out", default="data/pg19", help="output folder for train.bin, val.bin, test.bin, meta.json")
    p.add_argument("--raw_dir", default="data/pg19/raw", help="where downloaded books go (ignored with --source)")
    p.add_argument("--num_proc", type=int, default=None, help="tokenizer processes (default min(8, CPU count))")
    p.add_argument("--download_workers", type=int, default=16, help="parallel downloads")
    p.add_argument("--tokenizer_file", default=None, help="local GPT-2 BPE ranks file, tiktoken's r50k_base.tiktoken "
                   f"({RANKS_URL}); default: env DRT_GPT2_RANKS, else tiktoken downloads it")
    p.add_argument("--splits", default="train,validation,test", help="comma-separated PG19 splits to prepare")
    p.add_argument("--max_books", type=int, default=None, help="only the first N books of each split, by file "
                   "name as the bucket lists them (downloads only those); default: all")
    p.add_argument("--overwrite", action="store_true", help="replace the dataset already in --out (with --splits: "
                   "those splits, the others kept); without it a run over one stops at once")
    args = p.parse_args(argv)
    splits = tuple(s.strip() for s in args.splits.split(",") if s.strip())
    if not splits or any(s not in SPLITS for s in splits):
        raise SystemExit(f"prepare_pg19.py: error: --splits {args.splits!r}: choose from {','.join(SPLITS)}")
    if args.max_books is not None and args.max_books < 1:
        raise SystemExit(f"prepare_pg19.py: error: --max_books={args.max_books}: give a positive number of "
                         f"books per split, or leave it out for all")
    for name, n in (("num_proc", args.num_proc), ("download_workers", args.download_workers)):
        if n is not None and n < 1:
            raise SystemExit(f"prepare_pg19.py: error: --{name}={n}: must be >= 1")
    t0 = time.time()
    try:
        if not args.overwrite:
            refuse_existing(args.out, [SPLITS[s] + ".bin" for s in splits] + ["meta.json"])  # before any work
        get_tokenizer(args.tokenizer_file)  # before a long download, not after
        source = args.source
        if source is None:
            try:
                download_pg19(args.raw_dir, splits, args.max_books, workers=args.download_workers)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\nCheck the network (a rerun resumes), or pass --source "
                                   f"with a local PG19 copy") from None
            source = args.raw_dir
        meta = prepare(source, args.out, splits, args.num_proc, args.tokenizer_file, max_books=args.max_books)
    except (OSError, ValueError, RuntimeError) as e:  # FileNotFoundError is an OSError
        raise SystemExit(f"prepare_pg19.py: error: {e}")
    except KeyboardInterrupt:  # the dataset is swapped in whole or not at all (prepare), downloads resume
        print(f"prepare_pg19.py: interrupted: {args.out} keeps the dataset it had (a new one goes in only whole); "
              f"a rerun starts over, keeping the books downloaded", file=sys.stderr)
        raise SystemExit(130)
    counts = ", ".join(f"{s} {m['tokens']:,}" for s, m in meta["splits"].items())
    _print(f"done in {time.time() - t0:.1f}s: {counts} tokens -> {args.out}")


if __name__ == "__main__":
    main()
