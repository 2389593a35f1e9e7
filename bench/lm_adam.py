"""Compressed Adam against AdamW's other ways through bps, on the transformer job.

Runs examples/lm.py (a 279k-parameter byte-level GPT on the standard library's sources,
AdamW with warm-up and cosine, 300 steps) on a loopback cluster of 2 worker nodes and
1 server for each setting and seed, and prints one table: validation loss (mean and
standard deviation over the seeds), bytes per step on the wire (whole run, and after
the freeze for compressed Adam) against fp32, and training time. Every setting sends
fp32 where it sends raw (``--no-fp16``) and compresses every tensor
(``--min-compress-bytes 0``). The servers sum in node order, so a seed's losses are the
same run after run.

Usage::

    .venv/bin/python bench/lm_adam.py                     # 4 settings x 3 seeds, ~15 min
    .venv/bin/python bench/lm_adam.py --only adamw,compressed-adam --seeds 0
    .venv/bin/python bench/lm_adam.py --with-topk         # adds topk 1% + EF gradients

Results: bench/results/lm_adam.json (every run's figures) and the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPRESS = ["--no-fp16", "--min-compress-bytes", "0"]
ONEBIT_EF = ["--compressor", "onebit", "--ef", "vanilla", *COMPRESS]
SETTINGS = {  # name -> (label, examples/lm.py arguments)
    "adamw": ("AdamW, uncompressed fp32", ["--no-fp16"]),
    "compressed-adam": ("compressed Adam: onebit + EF momentum, freeze_step 60",
                        [*ONEBIT_EF, "--freeze-step", "60"]),
    "onebit-grad": ("onebit + EF gradients into AdamW", ONEBIT_EF),
    "local-adamw": ("local AdamW, onebit + EF sync every 8", [*ONEBIT_EF, "--sync-every", "8"]),
}
TOPK = ("topk 1% + EF gradients into AdamW",
        ["--compressor", "topk", "--k", "0.01", "--ef", "vanilla", *COMPRESS])


def run_one(args: list[str], seed: int, workdir: Path, timeout: float) -> dict | None:
    """One examples/lm.py run on ``bpslaunch local``: rank 0's metrics (None: failed)."""
    out = workdir / f"run-{time.monotonic_ns()}.json"
    argv = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", "2", "--servers",
            "1", "--", sys.executable, str(REPO / "examples" / "lm.py"), *args, "--seed",
            str(seed), "--metrics-json", str(out)]
    env = {**os.environ, "BPS_JOB_SEED": "4242"}
    try:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout:.0f} s", flush=True)
        return None
    if proc.returncode != 0 or not out.exists():
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
        return None
    return json.loads(out.read_text())


def summarise(name: str, label: str, runs: list[dict]) -> dict:
    losses = [r["val_loss"] for r in runs]
    row = {"setting": name, "label": label, "seeds": len(runs), "val_loss": losses,
           "mean": statistics.fmean(losses),
           "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
           "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in runs),
           "after_freeze": statistics.fmean(r["bytes_per_step_after_freeze"] for r in runs),
           "fp32_per_step": runs[0]["fp32_bytes_per_step"],
           "train_time": statistics.fmean(r["train_time"] for r in runs),
           "sha256": runs[0]["sha256"], "parameters": runs[0]["parameters"]}
    return row


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["setting"] == "adamw"), None)
    lines = ["| setting | val loss (nats), mean ± std | vs AdamW | bytes/step (whole run) "
             "| bytes/step after freeze | training time |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        # fp32 per step of a whole step (a local step's own raw bytes count only syncs)
        fp32 = base["fp32_per_step"] if base else r["fp32_per_step"]
        versus = f"{100 * (r['mean'] / base['mean'] - 1):+.1f}%" if base else "n/a"
        after = f"{r['after_freeze']:,.0f} ({fp32 / r['after_freeze']:.1f}x fewer)" \
            if r["setting"] == "compressed-adam" else "-"
        lines.append(f"| {r['label']} | {r['mean']:.4f} ± {r['std']:.4f} | {versus} | "
                     f"{r['bytes_per_step']:,.0f} ({fp32 / r['bytes_per_step']:.1f}x fewer) | "
                     f"{after} | {r['train_time']:.1f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated settings (default: all)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--with-topk", action="store_true", help="add topk 1%% + EF gradients")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "lm_adam.json"))
    args = p.parse_args(argv)
    settings = dict(SETTINGS)
    if args.with_topk:
        settings["topk-grad"] = TOPK
    if args.only:
        settings = {k: settings[k] for k in args.only.split(",")}
    seeds = [int(s) for s in args.seeds.split(",")]
    rows, runs_out = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (label, extra) in settings.items():
            runs = []
            for seed in seeds:
                started = time.perf_counter()
                metrics = run_one(extra, seed, Path(tmp), args.timeout)
                if metrics is None:
                    print(f"{name} seed {seed}: failed", flush=True)
                    continue
                print(f"{name} seed {seed}: val loss {metrics['val_loss']:.4f}, "
                      f"{metrics['bytes_per_step']:,.0f} B/step, "
                      f"{time.perf_counter() - started:.0f} s", flush=True)
                runs.append(metrics)
            if runs:
                rows.append(summarise(name, label, runs))
                runs_out[name] = [{k: v for k, v in r.items() if k != "steps"} for r in runs]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "runs": runs_out}, indent=1))
    print(table(rows))
    if rows:
        print(f"\n{rows[0]['parameters']:,} parameters; data sha256 {rows[0]['sha256']}; "
              f"loss in nats (/ {math.log(2):.4f} for bits per byte)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
