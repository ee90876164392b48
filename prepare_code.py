"""
A long-document code corpus for DRT: a Linux source tree, one document per directory, in PG19's
layout, then tokenized as PG19 is (GPT-2 BPE, uint16 .bin files). C code refers back to what it
defined thousands of tokens earlier (struct fields, helpers, macros): far references that a
retriever can use, in far more tokens than 24 books hold.

    apt-get download linux-source-6.12 && dpkg -x linux-source-6.12_*.deb linux    # Debian 13 (12: bookworm-backports)
    python prepare_code.py --source linux/usr/src/linux-source-6.12.tar.xz         # -> data/code
    python prepare_code.py --source ~/src/linux-6.12 --max_books=100               # an unpacked tree (kernel.org);
                                                                                   # the first 100 train documents
    python prepare_code.py --source linux/usr/src/linux-source-6.12.tar.xz --out data/code-dev --train_every=2
                                                                                   # every second train document

The documents, so that everyone who builds from the same tree gets the same ones:
- a document per directory below the root (path relative to it, /-separated), except those under
  EXCLUDED (architecture code, tools and generated register tables: long, and of another kind);
- its *.h files, then its *.c files, each group in name order, each as "// file: <dir>/<name>\n" + its
  text, the files joined by "\n"; a file over 256 KiB, not UTF-8, or a symbolic link is skipped; once
  the document has passed 2 MiB (characters) no further file is added; one under 200 KiB is dropped;
- its split from h = int(sha1(<dir>).hexdigest(), 16) % 100: h < 4 test, h < 8 validation, h < 12
  reserved (written nowhere: kept for checks from outside the project), the rest train.
linux-source-6.12 (6.12.118) gives 775 documents: train 683, validation 38, test 24 (30 reserved).

Output: <out>/raw/{train,validation,test}/<dir with / as __>.txt and metadata.csv (name, directory),
then <out>/train.bin, val.bin, test.bin and meta.json exactly as prepare_pg19.py writes them. A dataset
already in --out, or any of these files or raw/, is kept (the run stops at once, naming it) unless
--overwrite; even then, no file in raw/ but a build's own documents and metadata.csv is ever deleted.
"""
import argparse
import gzip
import hashlib
import lzma
import os
import shutil
import sys
import tarfile
import tempfile
import time

from prepare_pg19 import _print, get_tokenizer, missing_top, prepare, refuse_existing, remove_made, unwritable

EXCLUDED = ("arch", "tools", "scripts", "samples", "Documentation", "usr", "drivers/gpu/drm/amd/include")
MAX_FILE = 256 * 1024       # bytes: larger files are generated tables, not code one reads
DOC_CAP = 2 * 1024 * 1024   # characters: no file is added once a document has passed this
DOC_MIN = 200 * 1024        # characters: shorter documents are dropped (nothing far to refer to)
SPLIT_DIRS = ("train", "validation", "test")
HEADER = "_id,directory"    # of the metadata.csv a build writes: what marks a raw/ folder as one
OUTPUTS = ("train.bin", "val.bin", "test.bin", "meta.json", "raw")  # what a run writes in --out


def split_of(d):
    """The split of directory d: 'test', 'validation', 'train', or None (reserved)."""
    h = int(hashlib.sha1(d.encode()).hexdigest(), 16) % 100
    return "test" if h < 4 else "validation" if h < 8 else None if h < 12 else "train"


def kept(d):
    return d != "" and not any(d == e or d.startswith(e + "/") for e in EXCLUDED)


def wanted(name):
    return name.endswith((".c", ".h"))


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def tree_files(source, log=_print):
    """{dir: {name: bytes}}: the .c and .h files of every kept directory of source, a folder or a tar
    archive (.tar, .tar.xz, .tar.gz; its one top folder is the root), files over MAX_FILE left out."""
    files, t0, n = {}, time.time(), 0

    def add(d, name, read):
        nonlocal t0, n
        files.setdefault(d, {})[name] = read()
        n += 1
        if time.time() - t0 > 5:
            log(f"read {n:,} files, now in {d}/")
            t0 = time.time()

    if os.path.isdir(source):
        for root, dirs, names in os.walk(source):
            dirs.sort()
            d = os.path.relpath(root, source).replace(os.sep, "/")
            d = "" if d == "." else d
            for name in sorted(names):
                path = os.path.join(root, name)
                if kept(d) and wanted(name) and not os.path.islink(path) and os.path.getsize(path) <= MAX_FILE:
                    add(d, name, lambda: read_bytes(path))
    elif not os.path.exists(source):
        raise FileNotFoundError(f"--source {source} not found: give a Linux source tree, a folder or its .tar.xz")
    elif not (os.path.isfile(source) and tarfile.is_tarfile(source)):
        raise ValueError(f"--source {source} is not a valid tar archive (.tar, .tar.xz, .tar.gz): give a Linux "
                         f"source tree, a folder or its .tar.xz")
    else:
        try:  # one pass over the stream; lzma and gzip raise EOFError where a file ends before its end marker
            with decompressed(source) as raw, tarfile.open(fileobj=raw, mode="r|") as tar:
                for m in tar:
                    parts = [p for p in m.name.split("/") if p not in ("", ".")]  # tar c ./linux: './linux/...'
                    d, name = "/".join(parts[1:-1]), parts[-1]  # parts[0]: the archive's top folder
                    if m.isfile() and len(parts) > 2 and kept(d) and wanted(name) and m.size <= MAX_FILE:
                        add(d, name, lambda: tar.extractfile(m).read())
                raw.read()  # to the stream's end: its trailer (check sums, end marker) cut short raises there too
        except (tarfile.TarError, EOFError, lzma.LZMAError, gzip.BadGzipFile) as e:  # is_tarfile read its first member
            raise ValueError(f"--source {source} is not a valid tar archive ({e}: cut short?): fetch it again, "
                             f"or give the unpacked tree") from None
    return files


def decompressed(path):
    """A .tar, .tar.xz or .tar.gz as a stream of its tar bytes, by its magic number. A plain .tar must end in
    the two zero blocks of a whole archive: cut at a member's boundary, it would read as a shorter one."""
    with open(path, "rb") as f:
        magic = f.read(6)
        if magic == b"\xfd7zXZ\x00":
            return lzma.open(path)
        if magic[:2] == b"\x1f\x8b":
            return gzip.open(path)
        f.seek(max(0, os.path.getsize(path) - 1024))
        if f.read() != bytes(1024):
            raise EOFError("no end-of-archive blocks")
    return open(path, "rb")


def document(d, files):
    """The text of directory d from its {name: bytes}, or None if under DOC_MIN characters."""
    parts, n = [], 0
    for name in sorted(f for f in files if f.endswith(".h")) + sorted(f for f in files if f.endswith(".c")):
        if n > DOC_CAP:
            break
        try:
            text = files[name].decode("utf-8")
        except UnicodeDecodeError:
            continue
        parts.append(f"// file: {d}/{name}\n{text}")
        n += len(parts[-1]) + (len(parts) > 1)  # the joining "\n"
    return "\n".join(parts) if n >= DOC_MIN else None


def owned(raw_dir):
    """What a build wrote in raw_dir (the documents its metadata.csv lists, that file, their folders, raw_dir;
    deepest first), or a one-line ValueError if raw_dir holds anything else: no run deletes what it did not write."""
    if os.path.islink(raw_dir) or (os.path.lexists(raw_dir) and not os.path.isdir(raw_dir)):
        others = [raw_dir]
    else:
        try:
            with open(os.path.join(raw_dir, "metadata.csv"), encoding="utf-8") as f:
                rows = f.read().splitlines()
        except OSError:  # none: nothing there is a build's
            rows = []
        docs = {r.split(",")[0] + ".txt" for r in rows[1:]} if rows[:1] == [HEADER] else set()
        ours, others = [], []
        for root, dirs, files in os.walk(raw_dir, topdown=False):
            rel = os.path.relpath(root, raw_dir)
            for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:  # walk skips links
                mine = (rel in SPLIT_DIRS and name in docs) or (rel == "." and name == "metadata.csv" and bool(docs))
                (ours if mine else others).append(os.path.join(root, name))
            (ours if rel in (".", *SPLIT_DIRS) else others).append(root)  # removed only once empty
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        raise ValueError(f"{raw_dir}, where the documents go, holds files prepare_code.py did not write "
                         f"({', '.join(others[:3])}{more}): move them out of it, or pass another --out")
    return ours


def remove_build(raw_dir):
    """Remove what a build wrote in raw_dir, or nothing at all (owned's ValueError)."""
    for path in owned(raw_dir):
        (os.rmdir if os.path.isdir(path) else os.remove)(path)


def build(source, raw_dir, log=_print):
    """Write the documents of source under raw_dir in PG19's layout -> {split: count} (reserved too).
    Written beside, in a folder of the build's own, and swapped in whole: raw_dir never mixes two builds,
    and only what a build wrote there is replaced."""
    owned(raw_dir)  # a user's file in raw_dir: refused now, not after reading the whole tree
    tree, counts = tree_files(source, log), {"train": 0, "validation": 0, "test": 0, "reserved": 0}
    parent, work, tmp = os.path.dirname(os.path.abspath(raw_dir)), None, None
    rows = [HEADER]
    try:
        for d in sorted(tree):
            text = document(d, tree[d])
            if text is None:
                continue
            split = split_of(d)
            counts[split or "reserved"] += 1
            if split is None:
                continue
            if len(rows) == 1:  # the first document: a tree without one leaves no folder behind
                os.makedirs(parent, exist_ok=True)
                work = tempfile.mkdtemp(prefix=".build-", dir=parent)  # no user's folder has its name
                tmp = os.path.join(work, "raw")  # made by makedirs, not mkdtemp: the usual permissions
                for s in SPLIT_DIRS:
                    os.makedirs(os.path.join(tmp, s))
            name = d.replace("/", "__")
            with open(os.path.join(tmp, split, name + ".txt"), "w", encoding="utf-8", newline="") as f:
                f.write(text)
            rows.append(f"{name},{d}")
        if len(rows) == 1:
            raise ValueError(f"--source {source}: no directory holds {DOC_MIN // 1024} KiB of .c/.h files: "
                             f"is it a Linux source tree?")
        with open(os.path.join(tmp, "metadata.csv"), "w", encoding="utf-8") as f:
            f.write("\n".join(rows) + "\n")
        remove_build(raw_dir)
        os.replace(tmp, raw_dir)
    finally:  # an error, Ctrl-C: no half-built copy left beside raw_dir
        if work:
            shutil.rmtree(work, ignore_errors=True)
    log("documents: " + ", ".join(f"{s} {n}" for s, n in counts.items()) + f" -> {raw_dir}")
    return counts


def main(argv=None):
    p = argparse.ArgumentParser(description="Build and tokenize the Linux-code corpus (a document per directory).")
    p.add_argument("--source", required=True, help="a Linux source tree: a folder, or its .tar.xz "
                   "(Debian's linux-source-6.12 package holds usr/src/linux-source-6.12.tar.xz)")
    p.add_argument("--out", default="data/code", help="output folder: raw/ documents, train.bin, val.bin, test.bin, meta.json")
    p.add_argument("--max_books", type=int, default=None, help="tokenize only the first N documents of each split, "
                   "by file name (a smaller train split for a quick run); default: all")
    p.add_argument("--train_every", type=int, default=1, help="keep every N-th training document (validation and "
                   "test whole): the README's code runs used 2, 342 documents, to fit the GPU machine they ran on")
    p.add_argument("--num_proc", type=int, default=None, help="tokenizer processes (default min(8, CPU count))")
    p.add_argument("--tokenizer_file", default=None, help="local GPT-2 BPE ranks file; default: env DRT_GPT2_RANKS")
    p.add_argument("--overwrite", action="store_true", help="replace the dataset already in --out; without it a run "
                   "over one stops at once")
    args = p.parse_args(argv)
    if args.max_books is not None and args.max_books < 1:
        raise SystemExit(f"prepare_code.py: error: --max_books={args.max_books}: give a positive number, or leave it out")
    if args.train_every < 1:
        raise SystemExit(f"prepare_code.py: error: --train_every={args.train_every}: give a positive number")
    if args.num_proc is not None and args.num_proc < 1:
        raise SystemExit(f"prepare_code.py: error: --num_proc={args.num_proc}: must be >= 1")
    t0, raw, meta = time.time(), os.path.join(args.out, "raw"), None
    top, fresh = missing_top(args.out), not os.path.lexists(raw)  # what this run makes, and a failed one removes
    try:
        if not args.overwrite:
            refuse_existing(args.out, OUTPUTS)  # before build replaces raw/
        get_tokenizer(args.tokenizer_file)  # and before it reads a whole tree
        if why := unwritable(args.out):
            raise ValueError(f"output folder {why}: pass --out to a writable folder")
        build(args.source, raw)
        meta = prepare(raw, args.out, num_proc=args.num_proc, ranks_file=args.tokenizer_file, max_books=args.max_books,
                       train_every=args.train_every)
    except (OSError, ValueError, RuntimeError, tarfile.TarError) as e:
        raise SystemExit(f"prepare_code.py: error: {e}")
    except KeyboardInterrupt:
        print(f"prepare_code.py: interrupted: {args.out} keeps the dataset it had", file=sys.stderr)
        raise SystemExit(130)
    finally:
        if meta is None:  # failed: the raw/ and --out this run made go, a user's files stay
            try:
                if fresh:
                    remove_build(raw)
            except (OSError, ValueError):
                pass
            remove_made(args.out, top)
    counts = ", ".join(f"{s} {m['tokens']:,}" for s, m in meta["splits"].items())
    _print(f"done in {time.time() - t0:.1f}s: {counts} tokens -> {args.out}")


if __name__ == "__main__":
    main()
