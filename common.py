"""
Small helpers that train.py, sample.py, evaluate.py, bench.py and the prepare scripts share: time and length
formatting, the --lengths parser, GPT-2's tokenizer, a prepared dataset's meta.json and .bin files (read and
checked), a DRT's FLOPs per token and a GPU's peak FLOP/s (for MFU), peak memory, the check that an output
folder is writable, the checkpoint loader (which upgrades older checkpoints), train.py's out_dir lock, processes
(DDP) and Ctrl-C handling, retrieval's statistics from DRT.recording(), and what sample.py and evaluate.py share
(their arguments, errors and autocast, the checkpoint as a model, a stream's prefill). Not run on its own.

    from common import check_bin, fmt_time, load_checkpoint, parse_lengths, peak_flops, peak_mem_gib, read_meta

torch is imported inside the functions that use it, so prepare_pg19.py and its worker
processes, which need only fmt_time, do not load it.
"""

import gc
import json
import os
import pickle
import resource
import signal
import socket
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager

import numpy as np

from configurator import MERGED, ConfigError

# dense bf16 tensor-core peak FLOP/s by device name (the first key found in the name wins: PCIe first)
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12)]


# GPT-2's tokenizer, the one home of the ids every script uses
EOT = 50256          # <|endoftext|>, appended after every book
GPT2_VOCAB = 50257   # fits uint16, so a token costs 2 bytes on disk
# GPT-2's 50,257-token BPE is tiktoken's r50k_base; its ranks file is all an offline machine needs
RANKS_URL = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
RANKS_HELP = (f"GPT-2's BPE ranks file is tiktoken's r50k_base.tiktoken ({RANKS_URL}): download it on a "
              f"machine with internet and set DRT_GPT2_RANKS=/path/to/it or pass --tokenizer_file")


def get_tokenizer(ranks_file=None):
    """GPT-2 BPE as a tiktoken Encoding. A local ranks file (argument, or env
    DRT_GPT2_RANKS) is used without touching the network; otherwise tiktoken
    downloads its 'gpt2' files (and caches them)."""
    import tiktoken
    path = ranks_file or os.environ.get("DRT_GPT2_RANKS")
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"GPT-2 ranks file {path} not found (from --tokenizer_file or DRT_GPT2_RANKS); "
                                    f"{RANKS_HELP}")
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext.openai_public import r50k_pat_str
        try:
            return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str,
                                     mergeable_ranks=load_tiktoken_bpe(path),
                                     special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=GPT2_VOCAB)
        except (ValueError, AssertionError):  # not base64 ranks, or not GPT-2's 50,257 of them
            raise ValueError(f"GPT-2 ranks file {path} (from --tokenizer_file or DRT_GPT2_RANKS) is not a "
                             f"tiktoken ranks file of GPT-2's BPE; {RANKS_HELP}") from None
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # requests/urllib errors, whichever tiktoken used
        raise RuntimeError(f"could not load tiktoken's 'gpt2' encoding ({type(e).__name__}: {e}). "
                           f"Offline? {RANKS_HELP}") from e


PROGRESS_AFTER = 10  # seconds long work runs before it says how far it got (Progress, progress): short work is quiet


def fmt_time(s):
    """Seconds as 1h05m or 4m07s, for ETAs."""
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def fmt_len(n):
    """A token count as 4K, 1M, or the number itself when it is not a whole K or M."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_lengths(text):
    """'4K,16K,1M' -> [4096, 16384, 1048576]; ValueError if it does not read as lengths."""
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        lengths = [int(float(t[:-1]) * mult[t[-1].upper()]) if t[-1].upper() in mult else int(t)
                   for t in text.split(",") if t]
    except (ValueError, KeyError, OverflowError):  # OverflowError: infK
        lengths = []
    if not lengths:
        raise ValueError(f"--lengths={text!r}: expected a list like 4K,16K,1M or 4096,16384")
    return lengths


def max_token_id(tokens, windows=256, width=4096):
    """The largest id in a sample of a token array (`windows` runs of `width` ids, from its first
    id to its last): a check that a .bin of any size holds ids of the vocabulary, in milliseconds."""
    w = min(len(tokens), width)
    return max(int(tokens[s : s + w].max()) for s in np.linspace(0, len(tokens) - w, windows, dtype=np.int64))


def read_meta(folder, fix="prepare the data again"):
    """folder's meta.json (prepare_pg19.py's, prepare_code.py's) as a dict, or None where there is none; a
    one-line ValueError naming it and ending in fix where it is no such file (a copy cut short, an edit)."""
    path = os.path.join(folder, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e}): {fix}") from None
    except OSError as e:  # a folder of that name, no permission
        raise ValueError(f"{path} cannot be read ({e.strerror}): {fix}") from None
    splits = meta.get("splits") if isinstance(meta, dict) else None
    if not (isinstance(splits, dict) and all(isinstance(m, dict) and type(m.get("tokens", 0)) is int
                                             for m in splits.values()) and type(meta.get("vocab_size")) is int):
        raise ValueError(f"{path} is not a meta.json of prepare_pg19.py (it needs vocab_size, and splits with their "
                         f"token counts): {fix}")
    return meta


def bin_entry(meta, path):
    """The entry of meta's splits that describes the .bin at path (by its file name), or None."""
    name = os.path.basename(path)
    return next((m for split, m in meta["splits"].items() if m.get("file", f"{split}.bin") == name), None)


def check_bin(path, vocab=None, fix="prepare the data again"):
    """The uint16 tokens of a .bin of prepare_pg19.py or prepare_code.py, as a read-only memmap; else a one-line
    ValueError naming it and ending in fix: missing, empty, an odd number of bytes, a size other than the
    meta.json beside it lists (a copy cut short, another run's file), or ids >= vocab (on a sample, by
    max_token_id: another tokenizer's file). vocab None: the meta.json's vocab_size, else GPT-2's."""
    meta = read_meta(os.path.dirname(path) or ".", fix)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        said = "not found" if isinstance(e, FileNotFoundError) else f"cannot be read ({e.strerror})"
        raise ValueError(f"{path} {said}: {fix}") from None
    listed = (bin_entry(meta, path) or {}).get("tokens") if meta else None
    if size == 0 or size % 2 or (listed is not None and size != 2 * listed):
        should = (f"{listed:,} uint16 tokens by its meta.json" if listed is not None
                  else "not a whole number of uint16 tokens" if size else "no tokens")
        raise ValueError(f"{path} has {size:,} bytes, {should}: {fix}")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    vocab, whose = ((vocab, f"a vocabulary of {vocab} ids") if vocab else
                    (meta["vocab_size"], f"vocab_size={meta['vocab_size']} of its meta.json") if meta else
                    (GPT2_VOCAB, f"GPT-2's {GPT2_VOCAB} ids"))
    if (top := max_token_id(tokens)) >= vocab:
        raise ValueError(f"{path} holds token id {top}, outside {whose}: {fix}")
    return tokens


def peak_flops(device):
    """bf16 dense peak FLOP/s of one GPU by its name, or None (a CPU, an unknown GPU: MFU n/a)."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def flops_per_token(model, logit_share=1.0):
    """A DRT's training FLOPs (forward + backward = 3x forward) per text token, counting matmuls: 2 per weight
    per position, attention 4*keys*C per position and layer. Over peak_flops and time: MFU. logit_share: of the
    positions, those whose logits are made (train.py's task rows score only the row's end, which holds the answer)."""
    cfg, C, S = model.config, model.config.n_embd, model.config.chunk_size
    per_pos = 2 * (model.num_params() - model.wte.weight.numel())  # every matrix but the embedding runs per position
    per_pos += 4 * C * cfg.window * (cfg.n_lower + cfg.n_upper)  # sliding-window attention
    per_pos += 4 * C * S * cfg.n_enc  # chunk encoder attention
    per_pos += 4 * C * S * cfg.topk * cfg.n_upper  # GCA over K chunks of S
    lm_head = 2 * model.wte.weight.numel()  # once per text token
    return 3 * (per_pos * S / (S - 1) + lm_head * logit_share)


def available_mem():
    """Bytes of host memory available to a new allocation (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


MAX_LENGTH = 2**26  # 64M tokens: the longest stream sample.py's tests and bench.py --long take


def stream_memory_error(L, n_embd, chunk_size, device, offload, nbytes):
    """None if the chunk keys/values of an L-token stream (2*d*nbytes per text token x S/(S-1)) fit in
    the memory that holds them (the GPU's, or the host's with offload or on a CPU), else why not."""
    import torch
    on_gpu = device.type == "cuda" and not offload
    need = L * 2 * n_embd * nbytes * chunk_size / (chunk_size - 1)
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else available_mem()
    if free is None or need <= free:
        return None
    return (f"a {fmt_len(L)}-token prompt holds {need / 1e9:.2f} GB of chunk keys/values in "
            f"{'GPU' if on_gpu else 'host'} memory, and {free / 1e9:.2f} GB are available: use shorter lengths"
            + (" or --offload (host memory)" if on_gpu else ""))


def peak_mem_gib(device="cpu"):
    """Peak memory in GiB: on a GPU the most torch allocated there (since the last reset_peak_mem), else
    this process's peak resident host memory (Linux: since the last reset_peak_mem that could reset it)."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:  # VmHWM: what /proc/self/clear_refs resets
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration, ValueError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS; never reset
        return rss / (2**30 if sys.platform == "darwin" else 2**20)


def reset_peak_mem(device="cpu"):
    """Start peak_mem_gib(device) afresh -> whether it could: a GPU's allocator statistics always; the host's
    peak resident memory on Linux alone (clear_refs), else it stays the process's peak since its start."""
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (Linux 4.0+)
        return True
    except OSError:
        return False


def unwritable(folder):
    """Make folder if need be -> None if files can be written there, else why not, in words that
    begin with its name; before any real work, so a run that cannot save fails at once."""
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except (FileExistsError, NotADirectoryError):  # folder, or one above it, is a file
        return f"{folder} is a file, or inside one"
    except OSError as e:
        return f"{folder} is not writable ({e})"
    return None


# One run per out_dir: two runs into one folder would save over each other's checkpoints, one silently lost.
# Rank 0 holds out_dir/train.lock, made by an atomic create, for the whole run; a run that died without
# removing it (SIGKILL, a crash) left it behind, and the next run takes it over.
LOCK = "train.lock"


def start_ticks(pid):
    """Process pid's start in clock ticks after boot (Linux's /proc), or None: with the pid, it names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the name's ')'
    except (OSError, ValueError, IndexError):
        return None


def lock_holder(path):
    """The lock at path -> (its text, its run in words, whether that run may still be running)."""
    try:
        with open(path) as f:
            text = f.read()
        age = time.time() - os.path.getmtime(path)
    except FileNotFoundError:
        return None, None, False
    except OSError as e:  # another user's lock, say
        return "", f"{path} unreadable: {e.strerror}", True
    try:
        held = json.loads(text)
        pid, host, when = int(held["pid"]), held["host"], time.strftime("%F %T", time.localtime(held["started"]))
    except (ValueError, KeyError, TypeError, OverflowError):  # being written this instant, or damaged
        return text, f"{path} unreadable", age < 10
    run = f"pid {pid} on {host}, started {when}"
    if host != socket.gethostname():  # another machine's processes cannot be asked
        return text, f"{run}; if that run is gone, remove {path}", True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return text, run, False
    except PermissionError:  # another user's: alive
        pass
    ticks = start_ticks(pid)  # a pid reused since (a container's run is often pid 1) is another process
    return text, run, None in (ticks, held.get("ticks")) or ticks == held["ticks"]


@contextmanager
def out_dir_lock(folder):
    """Hold folder's lock while the block runs: a second run into folder is refused at once (a ConfigError
    naming the first), a dead run's lock is taken over; folder is made, and removed again if it stays empty."""
    made = not os.path.isdir(folder)
    if why := unwritable(folder):
        raise ConfigError(f"out_dir {why}: pass --out_dir=<writable folder>")
    path = os.path.join(folder, LOCK)
    mine = json.dumps({"pid": os.getpid(), "ticks": start_ticks(os.getpid()), "host": socket.gethostname(),
                       "started": time.time()})
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            text, run, alive = lock_holder(path)
        if alive:
            raise ConfigError(f"out_dir {folder} is in use by another train.py run ({run}): wait for it to end, "
                              f"or use another --out_dir")
        took = f"{path}.{os.getpid()}"  # renamed away, atomically: of two runs taking it over, one gets it
        try:
            os.rename(path, took)
        except FileNotFoundError:  # its run removed it just now, or another run took it over
            continue
        with open(took) as f:
            if f.read() != text:  # a new run's lock, made since we read the dead one's: give it back
                os.replace(took, path)
                continue
        os.remove(took)
        print(f"out_dir {folder}: taking over the lock of a run that is gone ({run})", flush=True)
    with os.fdopen(fd, "w") as f:
        f.write(mine)
    try:
        yield
    finally:  # at the end, on an error, Ctrl-C or SIGTERM; only SIGKILL leaves the lock behind
        if lock_holder(path)[0] == mine:
            os.remove(path)
        if made:
            try:
                os.rmdir(folder)  # nothing saved: a run that could not start leaves no folder behind
            except OSError:
                pass  # it holds the run's files


class CheckpointError(Exception):
    """A checkpoint file that cannot be used: one line, which the scripts show without a traceback."""


def load_checkpoint(path, fix, mmap=False):
    """train.py's checkpoint at path, on the CPU, or a one-line CheckpointError ending in fix.
    weights_only: a ckpt.pt holds tensors and plain values (its config as dicts, lists, numbers,
    strings), so any other object is refused unread, and a file from anywhere runs no code.
    mmap: the tensors mapped from the file, read when used (its config at once, whatever its size)."""
    import torch
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # a truncated zip, a text file, an empty file: each fails its own way
        if isinstance(e, pickle.UnpicklingError) and zipfile.is_zipfile(path):  # whole, but not weights alone
            raise CheckpointError(f"{path} holds Python objects a train.py checkpoint never has (refused: "
                                  f"loading them could run code): {fix}") from None
        raise CheckpointError(f"{path} is truncated or not a torch checkpoint: {fix}") from None
    if not isinstance(ckpt, dict) or not {"model_args", "model"} <= ckpt.keys():
        raise CheckpointError(f"{path} is not a train.py checkpoint (no model_args/model): {fix}")
    upgrade(ckpt, path, fix)
    return ckpt


# options this version removed (dev/LOG.md gives their results): a checkpoint that used one cannot be run the same
REMOVED = {"ret_dim": 0, "enc_rope": False, "repeat_frac": 0.0}  # each at its off value
RENAMED = {"pool_retrieval": ("pool_tokens", {"": False, "tokens": True})}  # old key: (new key, old value -> new)


def upgrade(ckpt, path, fix):
    """A checkpoint of an earlier version in today's keys, in place: a removed option at its off value is
    dropped, a renamed one translated, the four read-path switches all at the paper's or all at the code recipe's
    values made code_read (a key older than the checkpoint: the paper's); any other value is a one-line
    CheckpointError naming the key."""
    for part in ("model_args", "config"):
        args = ckpt.get(part, {})
        for key, off in REMOVED.items():
            if key in args and args.pop(key) != off:
                raise CheckpointError(f"{path} was trained with {key}, an option this version removed (dev/LOG.md "
                                      f"lists it with the last commit that had it): {fix}")
        for key, (new, values) in RENAMED.items():
            if key in args:
                if (old := args.pop(key)) not in values:
                    raise CheckpointError(f"{path} was trained with {key}={old!r}, which this version removed "
                                          f"(dev/LOG.md lists it with the last commit that had it): {fix}")
                args[new] = values[old]
        if any(key in args for key in MERGED[0]):
            switches = {key: args.pop(key, paper) for key, paper in MERGED[0].items()}
            if switches not in MERGED:
                said = ", ".join(f"{k}={v}" for k, v in switches.items())
                raise CheckpointError(f"{path} was trained with {said}, a mix this version removed: its read path is "
                                      f"the paper's or all four departures of config/code_teacher.py (code_read) (the "
                                      f"log, dev/LOG.md, names the last commit that had them apart): {fix}")
            args["code_read"] = switches == MERGED[1]


def save_checkpoint(out_dir, model, optimizer, state, extra):
    """train.py's checkpoint in out_dir: ckpt.pt (weights, optimizer, state) and ckpt.json (state and extra without
    tensors, for people and tools without torch), each written whole (to .tmp, then renamed) -> ckpt.pt's path."""
    import torch
    ckpt_path, json_path = os.path.join(out_dir, "ckpt.pt"), os.path.join(out_dir, "ckpt.json")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **state}, ckpt_path + ".tmp")
    os.replace(ckpt_path + ".tmp", ckpt_path)
    with open(json_path + ".tmp", "w") as f:
        json.dump({**state, **extra}, f, indent=1)
    os.replace(json_path + ".tmp", json_path)
    return ckpt_path


def step_rng(*parts):
    """A random.Random that is a fixed function of parts (str seeds go through SHA-512: the same everywhere)."""
    import random
    return random.Random(":".join(map(str, parts)))


def saved_at(out_dir, since=0.0):
    """'out/ckpt.pt at step N' of a train.py run, read from ckpt.json (written after ckpt.pt), or None; None too
    if it was written before time since (a checkpoint the run replaces is not the run's)."""
    try:
        if os.path.getmtime(path := os.path.join(out_dir, "ckpt.json")) < since:
            return None
        with open(path) as f:
            return f"{os.path.join(out_dir, 'ckpt.pt')} at step {json.load(f)['iter_num']}"
    except (OSError, ValueError, KeyError):
        return None


def log(msg):
    """train.py's lines: rank 0 alone prints (torchrun sets RANK), flushed, so that logs under nohup or tee keep up."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(msg, flush=True)


SAID = {"at": 0.0}  # when progress last said something


def progress(t0, text):
    """log text when the work begun at t0 has run PROGRESS_AFTER s without a word: a long step shows it is alive."""
    if (now := time.time()) - max(t0, SAID["at"]) > PROGRESS_AFTER:
        log(f"{text} after {fmt_time(now - t0)}")
        SAID["at"] = now


# Ctrl-C and SIGTERM in train.py: the handler takes note, and the loop stops at the next step boundary, where
# the model is whole. torchrun forwards a Ctrl-C to its workers, and when one dies sends SIGTERM to the rest.
STOP = {"signum": 0, "at": 0.0}  # the signal this process was sent, and when


def on_signal(signum, frame):  # a second Ctrl-C stops at once; within 1 s it is the first (terminal and torchrun)
    if signum == signal.SIGINT and STOP["signum"] and time.time() - STOP["at"] > 1:
        raise KeyboardInterrupt
    if not STOP["signum"]:
        STOP.update(signum=signum, at=time.time())
        # said now, not when the step ends (minutes on a CPU); by os.write: a print may be what the signal interrupted
        if int(os.environ.get("RANK", 0)) == 0:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            os.write(2, f"train.py: {what} received: saving the last finished step, then stopping "
                        f"(Ctrl-C again to stop now)\n".encode())


def catch_signals():  # again at every step boundary: on the GPU, Triton's first compile puts LLVM's handler first
    """Handle SIGINT and SIGTERM with on_signal -> the handlers they had."""
    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def stopped(said, signum):
    """A signal ended the run: say so (rank 0, or a failing rank) and exit as the shell does (130: Ctrl-C)."""
    if said:
        print(f"train.py: {said}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


@contextmanager
def stopping(out_dir, since, again, rank, ddp):
    """train.py's run inside: Ctrl-C and SIGTERM only take note (on_signal; the loop stops at a step boundary); a
    second Ctrl-C stops at once, naming the last checkpoint this run wrote (after time since) and the command again
    that continues; under DDP a rank whose collective failed waits 3 s for torchrun's SIGTERM and says so in one line.
    On the way out the signal handlers are restored and DDP is torn down."""
    STOP.update(signum=0, at=0.0)
    handlers = catch_signals()
    try:
        yield
    except KeyboardInterrupt:  # a second Ctrl-C
        last = saved_at(out_dir, since)
        stopped("interrupted: stopped at once; " + (f"the last checkpoint is {last}; continue with: {again}"
                                                    if last else "no checkpoint saved"), signal.SIGINT)
    except Exception as e:  # under DDP, a collective fails when a rank dies, and torchrun's SIGTERM follows
        for _ in range(30 if ddp and not isinstance(e, (ConfigError, CheckpointError)) else 0):  # 3 s
            if signum := STOP["signum"]:
                last = saved_at(out_dir, since)
                stopped(f"rank {rank}: stopped by {signal.Signals(signum).name} (another rank failed?); " +
                        (f"the last checkpoint is {last}: resume with --init_from=resume" if last else
                         "no checkpoint saved"), signum)
            time.sleep(0.1)
        raise
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        if ddp:
            import torch.distributed as dist
            dist.destroy_process_group()
            # gloo's worker may still hold the last collectives' tensors: freed as Python exits they take the GIL, and
            # the rank dies of SIGABRT (5 runs of 52 on a loaded CPU; 0 of 120 collected here, while Python lives)
            gc.collect()


def init_ddp(device, timeout):
    """train.py's processes: DDP where torchrun set RANK, LOCAL_RANK and WORLD_SIZE (plain python: one process), each
    rank on its device ('auto': cuda if there is one) -> (ddp, rank, world_size, torch.device); a ConfigError where
    CUDA is asked for and missing. timeout (s): how long a rank waits in a collective for a dead or hung one."""
    import datetime

    import torch
    import torch.distributed as dist
    ddp = "RANK" in os.environ
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dev = device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if (cuda := dev.startswith("cuda")) and not torch.cuda.is_available():
        raise ConfigError(f"device={dev!r} but CUDA is not available: use --device=cpu (or auto)")
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if ddp and cuda else dev)
    if ddp and cuda:
        torch.cuda.set_device(device)
    if ddp:  # a timeout, so that a rank waiting for a dead or hung one fails in minutes, not in half an hour
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                                timeout=datetime.timedelta(seconds=timeout))
    return ddp, rank, world_size, device


# Retrieval's health, from what DRT.recording() collected: train.py logs it at each evaluation,
# evaluate.py --ppl prints it per retrieval mode.

def sink_share(q, k_mem, v_mem, idx, w):
    """The share of GCA's attention on the landmark slot, over queries and heads, each pick weighted by w.
    In the paper's read path that slot is the zero key that reads nothing: near 1, GCA ignores what it retrieved
    whatever sum w says; under code_read it is the landmark's own key and value -> (share, sum w) as tensors."""
    import torch
    from model import gca_attention
    B, N, S, H, D = q.shape
    share = q.new_zeros((), dtype=torch.float32)
    for i, _, att in gca_attention(q, k_mem, idx):  # (B, N, H, S, S) each pick's
        share += (w[..., i, None, None].float() * att[..., -1]).sum() / (S * H)
    return share, w.float().sum()


def compact(records):
    """DRT's record with each GCA read ("gca", q, k, v, idx, w) reduced to ("sink", share, sum w): all that
    retrieval_stats needs of it, without holding the read's tensors (a long stream reads gigabytes), and without
    the Eq. 1 queries ("eq1") that the statistics do not read."""
    return [("sink", *sink_share(*r)) if kind == "gca" else (kind, *r) for kind, *r in records if kind != "eq1"]


def retrieval_stats(records, K):
    """DRT's record [("picks", chunk ids (n,), idx, w (B, n, K)), ("gca", q, k_mem, v_mem, idx, w) or its compact
    ("sink", share, sum w)] -> means over landmarks with an earlier chunk of sum w, max w, entropy of w / sum w
    (log K: uniform) and distance in chunks, and GCA's attention on the landmark slot weighted by w
    (sink_share), over all reads and per read (of one whole-row forward: per upper layer); {} with no retrieval."""
    import torch
    sums, maxes, ents, dists, sinks = [], [], [], [], []
    for kind, *r in compact(records):
        if kind == "sink":
            sinks.append(r)
            continue
        t, idx, w = r
        ok = (torch.arange(K, device=w.device) < t.clamp(max=K)[:, None]).expand_as(w)  # eligible picks come first
        keep = ok[..., 0]  # (B, n): landmarks with something to pick
        w = w.float() * ok
        p = w / w.sum(-1, keepdim=True).clamp(min=1e-30)
        sums.append(w.sum(-1)[keep]), maxes.append(w.amax(-1)[keep])
        ents.append(-(p * p.clamp(min=1e-30).log()).sum(-1)[keep])
        dists.append((t[:, None] - idx).float()[ok])
    if not sums:
        return {}
    cat = lambda xs: torch.cat(xs).mean().item()  # noqa: E731
    stats = {"sum_w": cat(sums), "max_w": cat(maxes), "entropy": cat(ents), "distance": cat(dists)}
    weight = sum(s[1] for s in sinks)
    if sinks and weight > 0:
        stats["sink"] = (sum(s[0] for s in sinks) / weight).item()
        stats["sink_reads"] = [(s / w).item() if w > 0 else float("nan") for s, w in sinks]  # each GCA read's
    return stats


def sink_label(cfg):
    """The name retrieval_stats' "sink" is logged under: the landmark slot reads nothing in the paper's read path."""
    return "landmark slot" if cfg.code_read else "sink"


# -----------------------------------------------------------------------------
# What sample.py and evaluate.py share: their errors, arguments and autocast, the checkpoint as a model, streams

def error(script, msg):
    """A wrong argument or an unusable file: one line, no traceback (each script binds its name)."""
    raise SystemExit(f"{script}: error: {msg}")


def shared_args(p, seed_help):
    """The arguments sample.py and evaluate.py share: the checkpoint, device and dtype, the stream."""
    import torch
    p.add_argument("--out_dir", default="out", help="folder with ckpt.pt from train.py")
    p.add_argument("--ckpt", default=None, help="path to a checkpoint file (overrides --out_dir)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda, cuda:1, ... (default: %(default)s here, cuda where there is a GPU)")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32",
                   choices=["float32", "bfloat16", "float16"],
                   help="autocast dtype on CUDA (default: %(default)s here, bfloat16 where there is a GPU)")
    p.add_argument("--seed", type=int, default=1337, help=f"random seed ({seed_help})")
    p.add_argument("--tokenizer_file", default=None, help="local gpt2.tiktoken (None: env DRT_GPT2_RANKS or download)")
    p.add_argument("--segment", type=int, default=65536, help="stream segment in tokens (memory vs speed)")
    p.add_argument("--offload", action="store_true", help="keep chunk keys/values in (pinned) host memory")
    p.add_argument("--retrieval", default=None,
                   help="learned, random, none (the window alone), or a comma list, each in turn (None: as trained)")
    return p


def shared_problems(args):
    """[(wrong, message)] of the arguments sample.py and evaluate.py share (shared_args): the stream segment,
    the device, the dtype and the retrieval modes."""
    import torch
    try:
        device = torch.device(args.device)
        kind, index = device.type, device.index or 0
    except RuntimeError:
        kind = index = None
    gpus = torch.cuda.device_count()
    return [
        (args.segment < 1, f"--segment={args.segment}: must be >= 1"),
        (kind is None, f"--device={args.device}: expected cpu, cuda or cuda:N"),
        (kind == "cuda" and not torch.cuda.is_available(), f"--device={args.device}: no CUDA GPU here: pass --device=cpu"),
        (kind == "cuda" and index >= gpus, f"--device={args.device}: this machine has {gpus} GPU(s), numbered from 0"),
        (kind == "cpu" and args.dtype != "float32",
         f"--dtype={args.dtype}: autocast runs on CUDA here; a CPU computes in float32: drop --dtype"),
        (any(m not in ("learned", "random", "none") for m in (args.retrieval or "learned").split(",")),
         f"--retrieval={args.retrieval}: expected learned, random, none, or a comma list of them")]


def autocast(args):
    """The context the model runs in for --device and --dtype: autocast on CUDA alone (a CPU computes in float32)."""
    import torch
    from contextlib import nullcontext
    cuda = torch.device(args.device).type == "cuda"
    return torch.autocast("cuda", dtype=getattr(torch, args.dtype)) if cuda and args.dtype != "float32" else nullcontext()


def retrieval_modes(args, cfg):
    """--retrieval's modes (None: as trained); a checkpoint without retrieval (groups=()) runs once, said so."""
    if args.retrieval and not cfg.groups:
        print(f"note: this checkpoint has no retrieval (groups=()), so --retrieval={args.retrieval} changes nothing: "
              f"one run, its windows alone (retrieval none)")
        return ["none"]
    return args.retrieval.split(",") if args.retrieval else [cfg.retriever]


def load_haystack(path, enc):
    """The --haystack text, read once for every test, or a one-line ValueError; a .bin checked as train.py's."""
    from tasks import Haystack
    fix = "give a folder of .txt books or a .bin from prepare_pg19.py, or drop --haystack for the synthetic filler"
    try:
        if path.endswith(".bin") and os.path.isfile(path):  # cut short, of odd size, another vocabulary's
            check_bin(path, fix=fix)  # refused as train.py and evaluate.py --docs refuse it
        return Haystack(path, enc)
    except (OSError, ValueError) as e:  # missing, empty or unreadable
        why = str(e).rstrip(".")
        if why.endswith(fix):  # check_bin's, which begins with the path
            raise ValueError(f"--haystack {why}") from None
        why = why if why.startswith("--haystack") else f"--haystack {path}: {why}"  # numpy's or the OS's words
        raise ValueError(f"{why}: {fix}") from None


def read_checkpoint(path):
    """train.py's checkpoint at path (a ckpt.pt or its out_dir), its tensors mapped, not read -> (checkpoint,
    its DRTConfig), or a one-line CheckpointError."""
    from model import DRTConfig
    path = os.path.join(path, "ckpt.pt") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise CheckpointError(f"no checkpoint at {path}: train one with train.py, or pass --out_dir/--ckpt")
    ckpt = load_checkpoint(path, "point --out_dir/--ckpt at a ckpt.pt that train.py wrote", mmap=True)
    try:
        return ckpt, DRTConfig(**ckpt["model_args"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the config stored in {path} does not build a DRT: {e}") from None


def build_model(ckpt, device, retriever=None):
    """The checkpoint's DRT in eval mode on device; retriever: another retrieval mode than the one trained
    (Table 4's ablations: learned, random, none), the same weights."""
    import dataclasses
    import textwrap
    from model import DRT, DRTConfig
    cfg = DRTConfig(**ckpt["model_args"])
    model = DRT(dataclasses.replace(cfg, retriever=retriever or cfg.retriever))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # torch names each mismatch on a line of its own: the first three, on one
        detail = textwrap.shorten("; ".join(line.strip(" \t.") for line in str(e).splitlines()[1:4]), 600)
        raise CheckpointError(f"the checkpoint's weights do not fit the config stored with them ({cfg}): "
                              f"{detail}. Was it written by another version of model.py?") from None
    return model.to(device).eval()


def as_batch(model, ids):
    """Token ids -> (1, n) on the model's device."""
    import torch
    return torch.as_tensor(np.asarray(ids), dtype=torch.long, device=next(model.parameters()).device)[None]


class Progress:
    """progress(done) prints `label: done/total unit after T, ETA T`, at most every PROGRESS_AFTER seconds."""

    def __init__(self, label, total, unit="tokens"):
        self.label, self.total, self.unit = label, total, unit
        self.t0 = self.last = time.time()

    def __call__(self, done):
        if time.time() - self.last > PROGRESS_AFTER:
            self.last, dt = time.time(), time.time() - self.t0
            print(f"  {self.label}: {done:,}/{self.total:,} {self.unit} after {fmt_time(dt)}, "
                  f"ETA {fmt_time(dt * (self.total - done) / max(done, 1))}", flush=True)


def prefill(model, ids, state, segment, progress=None, skim=None, record=None):
    """Stream ids into the state, `segment` tokens a call; skim: a margin in tokens, or None. Segments that end
    at least that far before ids' end go through DRT.skim (memory only): only what follows is read. record: a
    list to extend with each segment's DRT.recording(), its GCA reads reduced at once (compact)."""
    from contextlib import nullcontext
    x = as_batch(model, ids)
    for s in range(0, x.size(1), segment):
        part = x[:, s : s + segment]
        if skim is not None and s + part.size(1) <= x.size(1) - skim:
            model.skim(part, state)
        else:
            with model.recording() if record is not None else nullcontext() as seen:
                model(part, state=state)
            record is None or record.extend(compact(seen))
        if progress:
            progress(min(s + segment, x.size(1)))
