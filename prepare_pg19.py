"""
Prepare PG19 for DRT: get the books, tokenize them with GPT-2 BPE and write
flat uint16 token files that train.py memory-maps.

    python prepare_pg19.py                                       # download PG19 (~11 GB) to data/pg19/raw
    python prepare_pg19.py --source ../shared/data/pg19-sample  # or use a local copy laid out like PG19
    python prepare_pg19.py --source /data/pg19 --out data/pg19 --num_proc 16
    DRT_GPT2_RANKS=../shared/data/tokenizers/gpt2.tiktoken python prepare_pg19.py ...   # offline tokenizer

Input layout (the PG19 release, bucket gs://deepmind-gutenberg): train/,
validation/, test/ folders of <gutenberg_id>.txt, plus an optional
metadata.csv (id,title,year,url; the real one has no header row).

Output in --out: train.bin, val.bin, test.bin (uint16 GPT-2 ids, each book
followed by <|endoftext|> = 50256) and meta.json, written last: per split
("train", "val", "test") the numbers of books and tokens and the book offsets
[book_id, start, n_tokens], plus titles from metadata.csv. meta.json being
there is what marks the output complete: a run removes it first, and writes
every .bin under a temporary name, renamed when whole, so an interrupted run
never leaves a truncated file that looks finished.
"""
import argparse
import csv
import json
import multiprocessing as mp
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

EOT = 50256          # <|endoftext|>, appended after every book
GPT2_VOCAB = 50257   # fits uint16, so a token costs 2 bytes on disk
SPLITS = {"train": "train", "validation": "val", "test": "test"}  # PG19 folder -> output name
BUCKET_API = "https://storage.googleapis.com/storage/v1/b/deepmind-gutenberg/o"
BUCKET_URL = "https://storage.googleapis.com/deepmind-gutenberg"

def _print(msg):
    print(msg, flush=True)  # flush: progress must show up in logs and under nohup/tee

def _fmt_time(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"

# -----------------------------------------------------------------------------
# tokenizer (train.py and sample.py import this, so importing this file stays cheap)

def get_tokenizer(ranks_file=None):
    """GPT-2 BPE as a tiktoken Encoding. A local ranks file (argument, or env
    DRT_GPT2_RANKS) is used without touching the network; otherwise tiktoken
    downloads its 'gpt2' files (and caches them)."""
    import tiktoken
    path = ranks_file or os.environ.get("DRT_GPT2_RANKS")
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GPT-2 ranks file {path} not found (from --tokenizer_file or "
                                    f"DRT_GPT2_RANKS); a copy is in ../shared/data/tokenizers/gpt2.tiktoken")
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext.openai_public import r50k_pat_str
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str,
                                 mergeable_ranks=load_tiktoken_bpe(path),
                                 special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=GPT2_VOCAB)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # requests/urllib errors, whichever tiktoken used
        raise RuntimeError(f"could not load tiktoken's 'gpt2' encoding ({type(e).__name__}: {e}). "
                           f"Offline? Set DRT_GPT2_RANKS=/path/to/gpt2.tiktoken (or pass --tokenizer_file); "
                           f"a copy is in ../shared/data/tokenizers/gpt2.tiktoken") from e

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

def list_bucket(api_url, prefix, retries=5, backoff=1.0):
    """[(object name, size)] under prefix, following nextPageToken."""
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
        items += [(it["name"], int(it["size"])) for it in page.get("items", [])]  # GCS sends sizes as strings
        token = page.get("nextPageToken")
        if not token:
            return items

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

def download_pg19(raw_dir, splits=tuple(SPLITS), api_url=BUCKET_API, base_url=BUCKET_URL,
                  workers=16, retries=5, backoff=1.0, log=_print):
    """Mirror metadata.csv and <split>/<id>.txt from the bucket into raw_dir.
    Resumable: files already present with the listed size are skipped.
    Returns the number of files downloaded."""
    objects = list_bucket(api_url, "metadata.csv", retries, backoff)
    for split in splits:
        found = [(n, s) for n, s in list_bucket(api_url, split + "/", retries, backoff) if n.endswith(".txt")]
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
                        f"ETA {_fmt_time((total_mb - done_mb) / max(rate, 1e-9))}")
        except BaseException:  # a failure or Ctrl-C: don't sit through the rest of the queue
            for fut in futures:
                fut.cancel()
            raise
    return len(todo)

# -----------------------------------------------------------------------------
# read the local layout and tokenize

def _book_id(path):
    stem = os.path.basename(path)[:-len(".txt")]
    return int(stem) if stem.isdigit() else stem

def list_books(source, split):
    """Sorted [(book_id, path)] of <source>/<split>/*.txt."""
    folder = os.path.join(source, split)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"split folder {folder} not found: --source must hold train/, validation/ "
                                f"and test/ folders of <id>.txt files (or pass --splits to choose)")
    books = [(_book_id(f), os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".txt")]
    if not books:
        raise ValueError(f"split folder {folder} has no .txt files: is the download incomplete?")
    # numeric ids first, in numeric order: listdir order differs between machines
    return sorted(books, key=lambda b: (isinstance(b[0], str), b[0]))

def read_titles(source):
    """{book_id: title} from metadata.csv, if there is one; with or without a header row."""
    path = os.path.join(source, "metadata.csv")
    if not os.path.isfile(path):
        return {}
    with open(path, newline="", encoding="utf-8", errors="replace") as f:  # informational only
        rows = [r for r in csv.reader(f) if len(r) >= 2]
    return {r[0]: r[1] for r in rows if r[0].isdigit()}  # a header row ("_id,...") drops out here

_enc = None  # the tokenizer of this (worker) process

def _init_worker(ranks_file):
    global _enc
    _enc = get_tokenizer(ranks_file)

def _encode_book(path):
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")  # bytes as they are: no newline translation
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not valid UTF-8 ({e}); fix or remove the file") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    ids = _enc.encode_ordinary(text)  # ordinary: "<|endoftext|>" inside a book is just text
    ids.append(EOT)
    return np.array(ids, dtype=np.uint16)

def tokenize_split(books, bin_path, pool, log=_print, name=""):
    """Stream the tokens of books [(book_id, path)] into bin_path. Returns the
    split's meta. pool=None tokenizes in this process."""
    total_bytes = sum(os.path.getsize(p) for _, p in books)
    tmp = bin_path + ".tmp"
    offsets, n_tok, done_bytes = [], 0, 0
    t0 = last = time.time()
    paths = [p for _, p in books]
    results = pool.imap(_encode_book, paths) if pool else map(_encode_book, paths)  # in book order, as they finish
    try:
        with open(tmp, "wb") as f:
            for i, ((book_id, path), ids) in enumerate(zip(books, results), 1):
                ids.tofile(f)
                offsets.append([book_id, n_tok, len(ids)])
                n_tok += len(ids)
                done_bytes += os.path.getsize(path)
                if time.time() - last > 1 or i == len(books):
                    last, dt = time.time(), time.time() - t0
                    eta = dt * (total_bytes - done_bytes) / max(done_bytes, 1)  # by bytes: books vary 100x in size
                    log(f"{name}: {i}/{len(books)} books, {n_tok:,} tokens, {n_tok / max(dt, 1e-9):,.0f} tok/s, "
                        f"ETA {_fmt_time(eta)}")
        os.replace(tmp, bin_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"file": os.path.basename(bin_path), "books": len(books), "tokens": n_tok, "offsets": offsets}

def prepare(source, out_dir, splits=tuple(SPLITS), num_proc=None, ranks_file=None, log=_print):
    """Tokenize <source>/<split>/*.txt into <out_dir>/{train,val,test}.bin and
    meta.json. Returns the meta dict."""
    if not os.path.isdir(source):
        raise FileNotFoundError(f"source folder {source} not found: pass --source with a PG19 copy "
                                f"(train/ validation/ test/), or leave it out to download PG19")
    for s in splits:
        if s not in SPLITS:
            raise ValueError(f"unknown split {s!r}: choose from {', '.join(SPLITS)}")
    books = {s: list_books(source, s) for s in splits}  # check every split before hours of tokenizing
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{os.getpid()}")
        open(probe, "wb").close()
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"output folder {out_dir} is not writable ({e}): pass --out to a writable folder") from None
    ranks_file = ranks_file or os.environ.get("DRT_GPT2_RANKS")
    _init_worker(ranks_file)  # fail fast on a tokenizer problem, before starting workers
    # meta.json marks a complete output: take it away until this run has finished,
    # keeping the entries of splits this run does not rewrite
    meta_path = os.path.join(out_dir, "meta.json")
    old = {}
    if os.path.exists(meta_path):
        try:
            with open(meta_path) as f:
                old = json.load(f)
        except ValueError:
            pass  # unreadable old meta: start afresh
        os.remove(meta_path)
    kept = {name: m for name, m in old.get("splits", {}).items()
            if name not in [SPLITS[s] for s in splits] and os.path.isfile(os.path.join(out_dir, m["file"]))}
    titles = read_titles(source)
    num_proc = num_proc or min(8, os.cpu_count() or 1)
    pool = mp.Pool(num_proc, initializer=_init_worker, initargs=(ranks_file,)) if num_proc > 1 else None
    meta_splits = {}
    try:
        for s in splits:
            t0 = time.time()
            m = tokenize_split(books[s], os.path.join(out_dir, SPLITS[s] + ".bin"), pool, log, s)
            meta_splits[SPLITS[s]] = m = {"folder": s, **m}
            log(f"{s}: wrote {m['file']}: {m['books']} books, {m['tokens']:,} tokens in {time.time() - t0:.1f}s")
    finally:
        if pool:
            pool.terminate()  # also stops workers still busy after an error
    ids = {str(b[0]) for m in meta_splits.values() for b in m["offsets"]}
    meta = {"tokenizer": "gpt2", "vocab_size": GPT2_VOCAB, "eot": EOT, "dtype": "uint16",
            "source": os.path.abspath(source), "splits": {**kept, **meta_splits},
            "titles": {**old.get("titles", {}), **{i: t for i, t in titles.items() if i in ids}}}
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + ".tmp", meta_path)
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
    p.add_argument("--tokenizer_file", default=None, help="local GPT-2 ranks file (gpt2.tiktoken), "
                   "e.g. ../shared/data/tokenizers/gpt2.tiktoken; default: env DRT_GPT2_RANKS, else tiktoken download")
    p.add_argument("--splits", default="train,validation,test", help="comma-separated PG19 splits to prepare")
    args = p.parse_args(argv)
    splits = tuple(s.strip() for s in args.splits.split(",") if s.strip())
    if not splits or any(s not in SPLITS for s in splits):
        raise SystemExit(f"prepare_pg19.py: error: --splits {args.splits!r}: choose from {','.join(SPLITS)}")
    t0 = time.time()
    try:
        get_tokenizer(args.tokenizer_file)  # before a long download, not after
        source = args.source
        if source is None:
            try:
                download_pg19(args.raw_dir, splits, workers=args.download_workers)
            except RuntimeError as e:
                raise RuntimeError(f"{e}\nCheck the network (a rerun resumes), or pass --source "
                                   f"with a local PG19 copy") from None
            source = args.raw_dir
        meta = prepare(source, args.out, splits, args.num_proc, args.tokenizer_file)
    except (OSError, ValueError, RuntimeError) as e:  # FileNotFoundError is an OSError
        raise SystemExit(f"prepare_pg19.py: error: {e}")
    counts = ", ".join(f"{s} {m['tokens']:,}" for s, m in meta["splits"].items())
    _print(f"done in {time.time() - t0:.1f}s: {counts} tokens -> {args.out}")

if __name__ == "__main__":
    main()

# On ../shared/data/pg19-sample (24 books, 28.4 MB of text), 2 CPU cores, 1.7 s:
# train.bin has 6,564,475 tokens (20 books, 13.1 MB), val.bin 419,176 (2 books),
# test.bin 512,986 (2 books); 7,496,637 in all, about 3.8 bytes of text per token.
