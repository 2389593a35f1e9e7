"""Where a job's workers hold the GIL: py-spy's GIL samples, summed by thread and function.

Usage::

    python bench/gil_profile.py -- python bench/gpu_step.py --only mlp-onebit --workers 1 \\
        --steps 300                       # run a command under py-spy, then summarise
    python bench/gil_profile.py --raw gil.txt     # summarise a recording again

The command runs under ``py-spy record --subprocesses --gil --threads --nonblocking -f
raw`` (py-spy on PATH: ``pip install py-spy``; root, or ptrace allowed), so every Python
process it starts is sampled, but only while a thread holds the GIL. A process is a
bps worker where one of its threads is a codec or engine thread. For the workers, the
summary gives each thread's share of the GIL samples and, per thread, the functions
that held it longest: inclusive (any frame on the stack) and innermost. Samples taken
while modules import are left out: they are start-up, not steps.

On the device path a step launches its kernels, sends and receives its messages and
runs the autograd hooks from several threads that take turns at the GIL; this shows
which of them, and what in them, the steps wait on (docs/benchmarks.md, one GPU host).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

WORKER_THREADS = ("bps-codec", "bps-engine-io")
IMPORTING = "<frozen importlib"  # a frame of a module's import
GENERIC = {"Thread.run", "Thread._bootstrap", "Thread._bootstrap_inner", "_worker",
           "_WorkItem.run"}  # on every stack of a thread: say nothing
FRAME = re.compile(r"^(?P<name>.*?) \((?:.*/)?(?P<file>[^/]+\.py):\d+\)$")


def parse(raw: str) -> dict[str, list[tuple[str, list[str], int]]]:
    """``{process: [(thread, Python frames outermost first, samples)]}`` from py-spy's raw
    output (one stack per line, ``;``-separated, the count last); stacks inside an
    import are left out."""
    processes: dict[str, list] = collections.defaultdict(list)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        if any(IMPORTING in part for part in parts):
            continue
        process = [p for p in parts if p.startswith("process ")]
        thread = next((p for p in parts if p.startswith("thread ")), "thread ?")
        thread = re.sub(r"^thread \(\d+\):? ?", "", thread) or "?"
        thread = re.sub(r"_\d+$", "", thread)  # bps-codec_0 .. _3 as one
        frames = []
        for part in parts:
            match = FRAME.match(part)
            if match and match["name"] not in GENERIC:
                frames.append(f"{match['name']} ({match['file']})")
        processes[process[-1] if process else "?"].append((thread, frames, int(count)))
    return processes


def summary(processes: dict, top: int = 12) -> str:
    """The report for the worker processes (see the module docstring)."""
    out = []
    for process, stacks in processes.items():
        if not any(t.startswith(WORKER_THREADS) for t, _, _ in stacks):
            continue
        total = sum(n for _, _, n in stacks)
        if not total:
            continue
        out.append(f"\n{process}: {total} GIL samples outside imports")
        by_thread = collections.Counter()
        inclusive = collections.defaultdict(collections.Counter)
        innermost = collections.defaultdict(collections.Counter)
        for thread, frames, n in stacks:
            by_thread[thread] += n
            for frame in set(frames):
                inclusive[thread][frame] += n
            innermost[thread][frames[-1] if frames else "(no Python frame)"] += n
        for thread, n in by_thread.most_common():
            out.append(f"  {100 * n / total:5.1f}%  {thread}")
        for thread, _ in by_thread.most_common(4):
            out.append(f"\n  {thread}: inclusive | innermost")
            inner = innermost[thread].most_common(top)
            for i, (frame, count) in enumerate(inclusive[thread].most_common(top)):
                right = f"{inner[i][1]:6d} {inner[i][0]}" if i < len(inner) else ""
                out.append(f"    {count:6d} {frame[:58]:58s} | {right[:70]}")
    return "\n".join(out) if out else "no bps worker process in the recording"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--raw", help="summarise this py-spy raw file (no command is run)")
    p.add_argument("--out", default="bench/results/gil.txt", help="where the recording goes")
    p.add_argument("--rate", type=int, default=100, help="samples per second")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    path = Path(args.raw or args.out)
    if not args.raw:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            p.error("give a command after --, or --raw FILE")
        path.parent.mkdir(parents=True, exist_ok=True)
        spy = ["py-spy", "record", "--subprocesses", "--gil", "--threads", "--nonblocking",
               "-r", str(args.rate), "-f", "raw", "-o", str(path), "--", *command]
        try:
            subprocess.run(spy, check=False)
        except FileNotFoundError:
            p.error("py-spy is not on PATH (pip install py-spy)")
        if not path.exists():
            print(f"py-spy wrote no {path}", file=sys.stderr)
            return 1
    print(summary(parse(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
