"""A job that loses a worker node or a server: recovery time, steps lost, final accuracy.

Runs examples/mnist.py (the MNIST MLP, onebit + error feedback) on a loopback cluster of
4 worker nodes and 2 servers with ``bpslaunch local --min-workers 3``, twice with the
same job seed: once without failures, once while this script kills one worker node with
``kill -9`` (SIGKILL) at a random step. The victim (a node other than 0, which reports
the accuracy) and the step are drawn from ``--seed``. Every rank logs each finished step
(``--step-log``); the kill is sent once the victim has logged the drawn number of steps.

Reported, per kill:

* recovery: from the kill to the moment every survivor has applied its next step (the
  step in flight at the kill settles first: dropped, or completed where the victim had
  pushed all of it; the survivors' first applied step after it is the one timed);
* steps lost: the steps the survivors skipped (the step in flight is dropped everywhere);
* final test accuracy of rank 0 against the failure-free run's, and both wall times.

Usage::

    .venv/bin/python bench/chaos.py                      # seed 1, 6 epochs
    .venv/bin/python bench/chaos.py --seed 2 --runs 3    # three kills, seeds 2, 3, 4
    .venv/bin/python bench/chaos.py --heartbeat          # SIGSTOP: the heartbeat path

``--max-restarts 1`` has bpslaunch start the killed node again (same worker id); it joins
the job again with node 0's state. The kill then comes in the first quarter of the
steps, and the job needs to be long enough for the restart (a process start, ``import
torch``, the rendezvous: seconds): ``--epochs 24``. Also reported then: ``rejoined``,
from the kill to the restarted node's first finished step (and when the scheduler saw
its HELLO, its JOIN and the state sent for it), the steps the node missed, and the
steps the survivors skipped (two: the one in flight at the kill, the one the join
dropped).

``--kill server`` (with ``--spare-servers 1``, the default then) kills a server instead
(server 0 or 1, drawn from the seed), once rank 0 has logged the drawn number of steps;
both jobs run with ``bpslaunch local --spare-servers 1`` and no ``--min-workers``: the
spare takes the dead server's keys, and every worker node is a survivor. With
``--max-restarts 1`` bpslaunch also starts the killed server again: it waits as the next
spare (bpslaunch's one spare by default), or, with ``--spare-servers 0``, takes its slot
back itself, seconds later::

    .venv/bin/python bench/chaos.py --kill server --runs 3
    .venv/bin/python bench/chaos.py --kill server --max-restarts 1 --runs 3
    .venv/bin/python bench/chaos.py --kill server --max-restarts 1 --spare-servers 0

Results go to ``bench/results/chaos_<seed>.json`` (``chaos_restart_<seed>.json``,
``chaos_server_<seed>.json``). ``--heartbeat`` stops the victim (SIGSTOP) instead of
killing it, so that only its silence, not a closed connection, tells the scheduler
(``BPS_HEARTBEAT_TIMEOUT``, 3 s here); it is killed when the job ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKERS, SERVERS, MIN_WORKERS = 4, 2, 3
JOB = ["--compressor", "onebit", "--ef", "vanilla", "--momentum", "nesterov"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1, help="draws the victim and the step; "
                   "also the job seed (BPS_JOB_SEED)")
    p.add_argument("--runs", type=int, default=1, help="kills, seeds seed, seed + 1, ...")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--heartbeat", action="store_true",
                   help="SIGSTOP the victim instead: found by the heartbeat timeout")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="bpslaunch --max-restarts: the killed node starts again and rejoins")
    p.add_argument("--kill", choices=("worker", "server"), default="worker",
                   help="what dies: a worker node (--min-workers 3) or a server "
                   "(--spare-servers)")
    p.add_argument("--spare-servers", type=int, default=None,
                   help="bpslaunch local --spare-servers (default: 1 with --kill server)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    if args.runs < 1 or args.epochs < 1:
        p.error("--runs and --epochs must be >= 1")
    if args.max_restarts < 0 or (args.max_restarts and args.heartbeat):
        p.error("--max-restarts must be >= 0, and it restarts killed nodes (not --heartbeat)")
    if args.spare_servers is None and args.kill == "server" and not args.max_restarts:
        args.spare_servers = 1
    if args.kill == "server" and not args.max_restarts and args.spare_servers < 1:
        p.error("--kill server needs --spare-servers >= 1 or --max-restarts (else the job "
                "fails)")
    return args


def steps_per_rank(epochs: int) -> int:
    """examples/mnist.py's steps: 4,000 digits dealt to 4 ranks, batches of 32."""
    return epochs * (4000 // WORKERS // 32)


def job_pids(job: str, role: str, *variables: str) -> list[int]:
    """The pids of the live processes of the job whose environment carries
    ``BPS_CHAOS_JOB=job``, ``DMLC_ROLE=role`` and each of ``variables`` (``NAME=value``;
    read from /proc: the launcher passes them on)."""
    want = {f"DMLC_ROLE={role}".encode(), b"BPS_CHAOS_JOB=" + job.encode(),
            *(v.encode() for v in variables)}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if want <= environ and state != "Z":
            found.append(int(pid))
    return found


def server_pid(job: str, server: int) -> int:
    """The pid of server ``server`` of the job (see :func:`job_pids`)."""
    pids = job_pids(job, "server", f"BPS_SERVER_ID={server}")
    if not pids:
        raise RuntimeError(f"server {server} of the job not found")
    return pids[0]


def run_job(workdir: Path, seed: int, epochs: int, timeout: float, env_extra: dict,
            victim: int | None = None, kill_after: int = 0, how: int = signal.SIGKILL,
            restarts: int = 0, kill: str = "worker", spare_servers: int | None = None
            ) -> dict:
    """One job; with ``victim``, that rank (``kill`` "server": that server) gets ``how``
    once it (a server's: rank 0) has logged ``kill_after`` steps. Returns rank 0's
    metrics, every rank's step log and the kill's time."""
    logs = workdir / "steps"
    logs.mkdir(parents=True)
    metrics = workdir / "metrics.json"
    # bpslaunch's --max-restarts needs --min-workers (a restarted worker node rejoins)
    options = ["--min-workers", str(MIN_WORKERS)] if kill == "worker" or restarts else []
    if spare_servers is not None:
        options += ["--spare-servers", str(spare_servers)]
    argv = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", str(WORKERS),
            "--servers", str(SERVERS), *options,
            *(["--max-restarts", str(restarts)] if restarts else []), "--",
            sys.executable, str(REPO / "examples" / "mnist.py"), *JOB, "--epochs",
            str(epochs), "--device", "cpu", "--metrics-json", str(metrics),
            "--step-log", str(logs)]
    job = f"{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "BPS_JOB_SEED": str(seed), "BPS_CHAOS_JOB": job, **env_extra}
    killed: dict = {}
    stop = threading.Event()

    def watch() -> None:  # the victim's step log (a server's: rank 0's) is the trigger
        path = logs / f"rank{victim if kill == 'worker' else 0}.log"
        pid = None
        while not stop.is_set():
            lines = path.read_text().splitlines() if path.exists() else []
            if lines and kill == "server" and pid is None:  # the servers are up by now
                pid = server_pid(job, victim)
            if len(lines) >= kill_after:
                pid = int(lines[kill_after - 1].split()[2]) if kill == "worker" else pid
                killed["time"] = time.time()
                os.kill(pid, how)
                killed["pid"] = pid
                return
            stop.wait(0.002)

    watcher = threading.Thread(target=watch, daemon=True) if victim is not None else None
    start = time.perf_counter()
    with open(workdir / "job.log", "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        if watcher is not None:
            watcher.start()
        try:
            code = proc.wait(timeout=timeout)
        finally:
            stop.set()
            if proc.poll() is None:
                proc.kill()
            if "pid" in killed and how != signal.SIGKILL:
                try:
                    os.kill(killed["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
    wall = time.perf_counter() - start
    if code != 0 or not metrics.exists():
        tail = "\n".join((workdir / "job.log").read_text().splitlines()[-20:])
        raise RuntimeError(f"the job failed (exit code {code}); last lines:\n{tail}")
    steps = {}
    for rank in range(WORKERS):
        path = logs / f"rank{rank}.log"
        rows = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        steps[rank] = [(int(r[0]), float(r[1]), int(r[3]), int(r[2])) for r in rows]
    return {"metrics": json.loads(metrics.read_text()), "steps": steps, "wall": wall,
            "kill_time": killed.get("time"), "joins": scheduler_times(workdir / "job.log")}


def scheduler_times(log: Path) -> dict:
    """When the scheduler logged a node asking to join (its HELLO), its JOIN and the
    state sent for it (the first of each; Unix times from the log's timestamps)."""
    found = {}
    for line in log.read_text().splitlines():
        if not line.startswith("[scheduler] "):
            continue
        for event, text in (("hello", "asks to join"), ("join", " joined: "),
                            ("state", "sent the state")):
            if text in line and event not in found:
                stamp = " ".join(line.split()[1:3])
                found[event] = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return found


def measure(args: argparse.Namespace, seed: int, workdir: Path) -> dict:
    """The failure-free job and the job with one kill, same seed; their figures."""
    rng = random.Random(seed)
    victim = rng.randrange(1, WORKERS)
    total = steps_per_rank(args.epochs)
    # a restarted node needs seconds to start and join: killed in the first quarter
    kill_after = rng.randrange(5, total // 4 if args.max_restarts else total - 5)
    if args.kill == "server":
        victim = rng.randrange(SERVERS)
    env = {"BPS_HEARTBEAT_TIMEOUT": "3", "BPS_HEARTBEAT_INTERVAL": "0.5"} \
        if args.heartbeat else {}
    base = run_job(workdir / "base", seed, args.epochs, args.timeout, env, kill=args.kill,
                   spare_servers=args.spare_servers)
    how = signal.SIGSTOP if args.heartbeat else signal.SIGKILL
    chaos = run_job(workdir / "chaos", seed, args.epochs, args.timeout, env, victim,
                    kill_after, how, args.max_restarts, kill=args.kill,
                    spare_servers=args.spare_servers)
    killed_at = chaos["kill_time"]
    survivors = [r for r in range(WORKERS) if args.kill == "server" or r != victim]
    # the victim was in step kill_after + 1 (counting from 1) when it was killed: each
    # survivor's first step after that one applied; recovery: the last of them
    def first_applied(rank: int) -> float | None:
        return next((t for n, t, skipped, _ in chaos["steps"][rank]
                     if n > kill_after + 1 and t > killed_at and not skipped), None)

    def settled(rank: int) -> float | None:  # the step in flight, dropped or completed
        return next((t for n, t, _, _ in chaos["steps"][rank] if n == kill_after + 1), None)

    next_done = [first_applied(r) for r in survivors]
    recovery = max(next_done) - killed_at if all(t is not None for t in next_done) else None
    in_flight = [settled(r) for r in survivors]
    lost = [sum(s for _, _, s, _ in chaos["steps"][r]) for r in survivors]
    # the restarted node: its first step logged by another process than the one killed
    again = [(n, t) for n, t, _, pid in chaos["steps"][victim] if t > killed_at
             and pid != chaos["steps"][victim][kill_after - 1][3]] \
        if args.kill == "worker" else []
    acc_base = base["metrics"]["test_accuracy"]
    acc_chaos = chaos["metrics"]["test_accuracy"]
    return {
        "seed": seed, "kill": args.kill, "victim": victim,
        "signal": "SIGSTOP" if args.heartbeat else "SIGKILL",
        "killed_after_steps": kill_after, "steps_per_rank": total,
        "victim_steps_logged": len(chaos["steps"][victim]) if args.kill == "worker" else None,
        "recovery_s": recovery, "next_step_done_s": [t - killed_at for t in next_done],
        "in_flight_settled_s": [t - killed_at for t in in_flight],
        "steps_lost": lost, "accuracy_failure_free": acc_base, "accuracy_with_kill": acc_chaos,
        "accuracy_delta_points": 100 * (acc_chaos - acc_base),
        "wall_failure_free_s": base["wall"], "wall_with_kill_s": chaos["wall"],
        "rejoined_s": again[0][1] - killed_at if again else None,
        # from the kill: the restarted node's HELLO, its JOIN (its trainer made), the
        # state sent for it (the survivors' next step boundary)
        **{f"{event}_s": when - killed_at for event, when in chaos["joins"].items()},
        "victim_steps_missed": again[0][0] - kill_after - 1 if again else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in range(args.seed, args.seed + args.runs):
        with tempfile.TemporaryDirectory(prefix="bps-chaos-") as tmp:
            result = measure(args, seed, Path(tmp))
        results.append(result)
        print(f"seed {seed}: {result['signal']} {args.kill} {result['victim']} after "
              f"{result['killed_after_steps']} of {result['steps_per_rank']} steps; next step "
              f"applied on every survivor {result['recovery_s']:.2f} s after the kill (the "
              f"step in flight settled after "
              f"{max(result['in_flight_settled_s']):.2f} s); steps lost "
              f"{result['steps_lost']}; accuracy {result['accuracy_with_kill']:.2%} vs "
              f"{result['accuracy_failure_free']:.2%} without the kill "
              f"({result['accuracy_delta_points']:+.2f} points); wall "
              f"{result['wall_with_kill_s']:.1f} s vs {result['wall_failure_free_s']:.1f} s",
              flush=True)
        if args.max_restarts and args.kill == "worker":
            rejoined = result["rejoined_s"]
            print(f"  restarted: worker {result['victim']} finished its first step again "
                  + (f"{rejoined:.2f} s after the kill, having missed "
                     f"{result['victim_steps_missed']} steps (its HELLO after "
                     f"{result.get('hello_s', float('nan')):.2f} s, JOIN after "
                     f"{result.get('join_s', float('nan')):.2f} s, the state sent after "
                     f"{result.get('state_s', float('nan')):.2f} s)" if rejoined is not None
                     else "never (it did not rejoin)"), flush=True)
    kind = "heartbeat_" if args.heartbeat else "restart_" if args.max_restarts else ""
    name = f"chaos_{'server_' if args.kill == 'server' else ''}{kind}{args.seed}.json"
    (args.out / name).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                             "results": results}, indent=1))
    print(f"written: {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
