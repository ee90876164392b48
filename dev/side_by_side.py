"""
Run several commands side by side, each with its own log, and stop those still running at a deadline with
SIGTERM (train.py then saves its last whole step and prints how to resume). Small trainings share one GPU
well: the long-context recipe's stage 2 is host-bound alone, so five at once give five answers for the time
of about three. Prints each run's exit code, time and last log lines.

    python dev/side_by_side.py --deadline=540 --logs=logs \\
        "s0:python train.py config/passkey_finetune.py config/twohop.py --seed=0 --init_from=out-pre2-s0 --out_dir=out-twohop-s0" \\
        "s1:python train.py config/passkey_finetune.py config/twohop.py --seed=1 --init_from=out-pre2-s1 --out_dir=out-twohop-s1"
"""

import argparse
import os
import signal
import subprocess
import sys
import time


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="NAME:COMMAND", help="a name for the log, then a shell command")
    p.add_argument("--deadline", type=float, default=0, help="seconds from now after which runs still going get "
                   "SIGTERM (0: none)")
    p.add_argument("--grace", type=float, default=60, help="seconds a stopped run has to save before SIGKILL")
    p.add_argument("--logs", default="logs", help="folder of the logs: NAME.log for each run")
    p.add_argument("--tail", type=int, default=3, help="last lines of each log to print at the end")
    args = p.parse_args(argv)
    runs = [r.split(":", 1) for r in args.runs]
    if bad := [r for r, parts in zip(args.runs, runs) if len(parts) != 2 or not parts[0] or not parts[1].strip()]:
        p.error(f"{bad[0]!r}: expected NAME:COMMAND")
    if len({name for name, _ in runs}) < len(runs):
        p.error("two runs share a name: each needs its own log")
    return args, runs


def stop(procs, sig):
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, sig)  # the shell and what it started: each run is a process group of its own


def main(argv=None):
    args, runs = parse(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.logs, exist_ok=True)
    t0, procs = time.time(), {}
    for name, cmd in runs:
        with open(os.path.join(args.logs, f"{name}.log"), "w") as log:
            log.write(f"+ {cmd}\n")
            log.flush()
            procs[name] = subprocess.Popen(cmd, shell=True, executable="/bin/bash", stdout=log,  # bash runs a lone
                                           stderr=subprocess.STDOUT, start_new_session=True)  # command in its place
    stopped_at = None
    while any(p.poll() is None for p in procs.values()):
        now = time.time() - t0
        if args.deadline and stopped_at is None and now >= args.deadline:
            print(f"deadline {args.deadline:.0f} s: SIGTERM to the runs still going", flush=True)
            stop(procs.values(), signal.SIGTERM)
            stopped_at = now
        elif stopped_at is not None and now >= stopped_at + args.grace:
            print(f"{args.grace:.0f} s later: SIGKILL", flush=True)
            stop(procs.values(), signal.SIGKILL)
        time.sleep(0.2)
    for name, proc in procs.items():
        with open(os.path.join(args.logs, f"{name}.log")) as f:
            tail = f.read().splitlines()[-args.tail:]
        print(f"== {name}: exit {proc.returncode}\n" + "\n".join(f"   {line}" for line in tail), flush=True)
    print(f"all done in {time.time() - t0:.0f} s")
    return {name: proc.returncode for name, proc in procs.items()}


if __name__ == "__main__":
    main()
