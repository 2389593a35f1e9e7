"""Streaming outer syncs on a slow link: sweep H, fragments, overlap and the compressor.

Each configuration runs bench/slow_network.py twice, on the limited link and with no
limit (``--rate none``), with the ``-stream`` rows of the chosen compressors; DDP +
PowerSGD runs once on the limited link. The table gives, per configuration and
compressor, the mean step on the link against the same run's unthrottled mean step
(the wire that is not hidden), the time to the target accuracy against DDP +
PowerSGD's, and the final accuracy::

    sudo .venv/bin/python bench/stream_sweep.py --rate 20mbit --target 93.5
    sudo .venv/bin/python bench/stream_sweep.py --model cnn --rate 20mbit --target 97.5
    .venv/bin/python bench/stream_sweep.py --rate 20mbit --summarise   # tables only

``--grid`` takes ``H:F:T`` triples (sync_every, fragments, overlap). The runs' JSON
records go to ``--out`` (default bench/results/stream_sweep), one folder per
configuration and link, so ``--summarise`` rebuilds the table from them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_GRID = "8:1:8,8:4:2,16:1:16,16:4:4,16:4:8,32:4:8,32:4:16"


def load_runner():
    """bench/slow_network.py as a module (its Run and Method classes)."""
    spec = importlib.util.spec_from_file_location("slow_network",
                                                  REPO / "bench" / "slow_network.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["slow_network"] = module  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def parse_grid(text: str) -> list[tuple[int, int, int]]:
    """``"16:4:4,32:4:8"`` -> [(16, 4, 4), (32, 4, 8)]."""
    grid = []
    for item in text.split(","):
        h, f, t = (int(v) for v in item.split(":"))
        grid.append((h, f, t))
    return grid


def folder(args: argparse.Namespace, rate: str, config: tuple[int, int, int] | None) -> Path:
    tag = "ddp-powersgd" if config is None else "H{}F{}T{}".format(*config)
    return Path(args.out) / f"{args.model}-{rate}-{tag}"


MAX_BYTES_PER_STEP = 0.07  # payload bytes per element and step, at most (about 1/16)


def bytes_per_element(name: str) -> float:
    """A payload's bytes per element with the compressor's typical options (its class's
    ``description``), for a large partition.

        >>> bytes_per_element("onebit")
        0.125
    """
    from bps.compressors import description, payload_bound, validate_compression_params

    numel = 1 << 20
    params = validate_compression_params({"compressor": name, **description(name).defaults})
    return round(payload_bound(params, numel) / numel, 4)


def methods_for(args: argparse.Namespace, config: tuple[int, int, int]) -> list[str]:
    """The -stream rows of the compressors, each only where a sync has enough steps
    (H) to spread its payload over: at most MAX_BYTES_PER_STEP bytes per element and
    step (bytegrad, 1 byte per element: from H = 16)."""
    return [f"{c}-stream" for c in args.compressors.split(",")
            if bytes_per_element(c) / config[0] <= MAX_BYTES_PER_STEP]


def run(args: argparse.Namespace, rate: str, config: tuple[int, int, int] | None) -> None:
    out = folder(args, rate, config)
    if args.summarise or (out.exists() and not args.again):
        return
    cmd = [sys.executable, str(REPO / "bench" / "slow_network.py"), "--rate", rate,
           "--model", args.model, "--target", str(args.target), "--out", str(out)]
    if config is None:
        cmd += ["--methods", "ddp-powersgd"]
    else:
        h, f, t = config
        cmd += ["--methods", ",".join(methods_for(args, config)), "--sync-every", str(h),
                "--fragments", str(f), "--overlap", str(t)]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=False, cwd=REPO)


def load(runner, args: argparse.Namespace, rate: str, config) -> dict:
    """{method name: Run} of one folder (empty where it has no record)."""
    stem = "slow_network" + ("" if args.model == "mlp" else f"_{args.model}") + f"_{rate}"
    path = folder(args, rate, config) / f"{stem}.json"
    if not path.exists():
        return {}
    runs = runner.record_runs(json.loads(path.read_text()), runner.parse_args([]))
    return {run.method.name: run for run in runs}


def summarise(args: argparse.Namespace, grid: list[tuple[int, int, int]]) -> str:
    runner = load_runner()
    target = args.target / 100
    peer = load(runner, args, args.rate, None).get("ddp-powersgd")
    peer_time = peer.time_to(target) if peer is not None and peer.ok else float("nan")
    lines = [f"DDP + PowerSGD rank 1 at {args.rate}: time to {args.target:g}% "
             f"{runner.fmt_seconds(peer_time)}, step {runner.fmt_seconds(peer.step_time)}"
             if peer is not None else f"DDP + PowerSGD at {args.rate}: no record", "",
             f"| H | F | T | compressor | step at {args.rate} | unthrottled | ratio | "
             "time to target | vs DDP + PowerSGD | final |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for config in grid:
        slow = load(runner, args, args.rate, config)
        fast = load(runner, args, "none", config)
        for name in methods_for(args, config):
            s, f = slow.get(name), fast.get(name)
            if s is None or not s.ok:
                continue
            unthrottled = f.step_time if f is not None and f.ok else float("nan")
            to_target = s.time_to(target)
            lines.append(
                "| {} | {} | {} | {} | {} | {} | {:.2f}x | {} | {:.1f}x | {:.1%} |".format(
                    *config, name.removesuffix("-stream"), runner.fmt_seconds(s.step_time),
                    runner.fmt_seconds(unthrottled), s.step_time / unthrottled,
                    runner.fmt_seconds(to_target), peer_time / to_target,
                    s.final_accuracy))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--rate", default="20mbit")
    p.add_argument("--target", type=float, required=True,
                   help="target accuracy in percent (fp32's final minus 1 point)")
    p.add_argument("--grid", default=DEFAULT_GRID, help="H:F:T triples, comma-separated")
    p.add_argument("--compressors", default="onebit,topk,bytegrad")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "stream_sweep"))
    p.add_argument("--summarise", action="store_true", help="run nothing, print the table")
    p.add_argument("--again", action="store_true", help="rerun folders that exist")
    args = p.parse_args(argv)
    grid = parse_grid(args.grid)
    run(args, args.rate, None)
    for config in grid:
        run(args, args.rate, config)
        run(args, "none", config)
    print(summarise(args, grid))
    return 0


if __name__ == "__main__":
    sys.exit(main())
