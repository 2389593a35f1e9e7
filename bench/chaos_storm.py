"""Many kills in one job: random worker nodes and servers, each started again by bpslaunch.

Usage::

    .venv/bin/python bench/chaos_storm.py                      # 10 kills, seed 1
    .venv/bin/python bench/chaos_storm.py --kills 3 --epochs 20 --seed 4

bench/chaos.py's MNIST job (4 worker nodes, 2 servers, onebit + EF + Nesterov) under
``bpslaunch local --min-workers 3 --spare-servers 1 --max-restarts K``, twice with the
same job seed: without a failure, and with K kills (``kill -9``). Each kill waits until
the job has recovered from the one before and rank 0 has logged ``--gap`` more steps;
the victim is drawn from the seed: a worker node other than node 0 (whose rank writes
the metrics), or any running server process of the job (one serving a slot, or the
spare). A worker node then rejoins (its restarted process logs a step); a server's slot
goes to the spare, and the restarted server process waits as the next spare.

Reported: per kill, the victim, the seconds to the next step rank 0 applied, to the
recovery (a worker: its restarted process's first step; a server: the restarted process
running again), and rank 0's skipped steps; then the kills made, the accuracies, and
whether every worker rank ended with the same parameters (each rank's SHA-256 of its
parameters, written by examples/mnist.py beside its step log). Results go to
``bench/results/chaos_storm_<seed>.json``, the jobs' logs to ``bench/results/chaos_storm_<seed>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from chaos import JOB, REPO, SERVERS, WORKERS, job_pids, steps_per_rank

MIN_WORKERS, SPARES = 3, 1
# a restarted server has this long to register before its slot fails the job
ENV = {"BPS_HEARTBEAT_TIMEOUT": "30"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=1, help="draws the victims; the job seed")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--gap", type=int, default=20,
                   help="steps rank 0 logs after a recovery before the next kill")
    p.add_argument("--recover-timeout", type=float, default=120,
                   help="seconds a kill may take to recover before the storm stops")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    if args.kills < 1 or args.epochs < 1 or args.gap < 1:
        p.error("--kills, --epochs and --gap must be >= 1")
    return args


def read_log(logs: Path, rank: int) -> list[tuple[int, float, int, int]]:
    """(step, time, pid, skipped) of every step ``rank`` logged (examples/mnist.py)."""
    path = logs / f"rank{rank}.log"
    rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
    return [(int(r[0]), float(r[1]), int(r[2]), int(r[3])) for r in rows if len(r) == 4]


class Storm:
    """Kills, one at a time, in a thread beside the job (see the module's docstring)."""

    def __init__(self, job: str, logs: Path, args: argparse.Namespace, seed: int) -> None:
        self.job, self.logs, self.args = job, logs, args
        self.rng = random.Random(seed)
        self.events: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def wait_for(self, done, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.stop.is_set() and time.monotonic() < deadline:
            if done():
                return True
            self.stop.wait(0.01)
        return False

    def run(self) -> None:
        mark = 0
        for _ in range(self.args.kills):
            goal = mark + self.args.gap
            if not self.wait_for(lambda g=goal: len(read_log(self.logs, 0)) >= g,
                                 self.args.timeout):
                return
            event = self.kill()
            if event is None:
                return
            self.events.append(event)
            if not self.wait_for(lambda e=event: self.recovered(e), self.args.recover_timeout):
                event["recovered_s"] = None
                return
            event["recovered_s"] = time.time() - event["time"]
            mark = len(read_log(self.logs, 0))

    def kill(self) -> dict | None:
        if self.rng.random() < 0.5:
            rank = self.rng.randrange(1, WORKERS)
            rows = read_log(self.logs, rank)
            if not rows:
                return None
            event = {"role": "worker", "rank": rank, "pid": rows[-1][2]}
        else:
            servers = sorted(job_pids(self.job, "server"))
            if not servers:
                return None
            event = {"role": "server", "pid": self.rng.choice(servers)}
        event["time"], event["rank0_steps"] = time.time(), len(read_log(self.logs, 0))
        os.kill(event["pid"], signal.SIGKILL)
        return event

    def recovered(self, event: dict) -> bool:
        """A worker: its restarted process has logged a step. A server: as many server
        processes run as at the start (the restart is up) and rank 0 applied a step."""
        if event["role"] == "worker":
            return any(pid != event["pid"] and t > event["time"]
                       for _, t, pid, _ in read_log(self.logs, event["rank"]))
        applied = any(t > event["time"] and not skipped
                      for _, t, _, skipped in read_log(self.logs, 0))
        return applied and len(job_pids(self.job, "server")) == SERVERS + SPARES


def run_job(workdir: Path, args: argparse.Namespace, seed: int, storm: bool) -> dict:
    logs = workdir / "steps"
    logs.mkdir(parents=True)
    metrics = workdir / "metrics.json"
    argv = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", str(WORKERS),
            "--servers", str(SERVERS), "--min-workers", str(MIN_WORKERS), "--spare-servers",
            str(SPARES), "--max-restarts", str(args.kills), "--",
            sys.executable, str(REPO / "examples" / "mnist.py"), *JOB, "--epochs",
            str(args.epochs), "--device", "cpu", "--metrics-json", str(metrics),
            "--step-log", str(logs)]
    job = f"{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, **ENV, "BPS_JOB_SEED": str(seed), "BPS_CHAOS_JOB": job}
    kills = Storm(job, logs, args, seed) if storm else None
    start = time.perf_counter()
    with open(workdir / "job.log", "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        if kills is not None:
            kills.thread.start()
        try:
            code = proc.wait(timeout=args.timeout)
        finally:
            if kills is not None:
                kills.stop.set()
                kills.thread.join()
            if proc.poll() is None:
                proc.kill()
    wall = time.perf_counter() - start
    if code != 0 or not metrics.exists():
        tail = "\n".join((workdir / "job.log").read_text().splitlines()[-30:])
        raise RuntimeError(f"the job failed (exit code {code}); last lines:\n{tail}")
    digests = {r: (logs / f"rank{r}.params").read_text().strip()
               if (logs / f"rank{r}.params").exists() else None for r in range(WORKERS)}
    rank0 = read_log(logs, 0)
    events = kills.events if kills is not None else []
    for event in events:
        event["next_step_s"] = next((t - event["time"] for _, t, _, skipped in rank0
                                     if t > event["time"] and not skipped), None)
    return {"metrics": json.loads(metrics.read_text()), "wall": wall, "events": events,
            "digests": digests, "skipped": sum(s for *_, s in rank0)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / f"chaos_storm_{args.seed}"  # the jobs' logs stay there
    shutil.rmtree(work, ignore_errors=True)
    base = run_job(work / "base", args, args.seed, storm=False)
    chaos = run_job(work / "storm", args, args.seed, storm=True)
    for n, e in enumerate(chaos["events"], 1):
        who = f"worker {e['rank']}" if e["role"] == "worker" else f"server pid {e['pid']}"
        print(f"kill {n}: {who} after {e['rank0_steps']} steps of rank 0; next step "
              f"{e['next_step_s']:.2f} s after, recovered after "
              + (f"{e['recovered_s']:.1f} s" if e["recovered_s"] is not None else "never"),
              flush=True)
    same = None not in chaos["digests"].values() and \
        len(set(chaos["digests"].values())) == 1
    acc_base, acc = base["metrics"]["test_accuracy"], chaos["metrics"]["test_accuracy"]
    print(f"{len(chaos['events'])} kills in {steps_per_rank(args.epochs)} steps a rank; rank 0 "
          f"skipped {chaos['skipped']} steps; every rank's parameters "
          f"{'identical' if same else 'DIFFER'}; accuracy {acc:.2%} vs {acc_base:.2%} "
          f"without kills ({100 * (acc - acc_base):+.2f} points); wall {chaos['wall']:.0f} s "
          f"vs {base['wall']:.0f} s", flush=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "events": chaos["events"],
              "kills": len(chaos["events"]), "identical": same, "digests": chaos["digests"],
              "skipped": chaos["skipped"], "accuracy": acc, "accuracy_failure_free": acc_base,
              "wall_s": chaos["wall"], "wall_failure_free_s": base["wall"]}
    path = args.out / f"chaos_storm_{args.seed}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"written: {path}")
    return 0 if same and len(chaos["events"]) == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())
