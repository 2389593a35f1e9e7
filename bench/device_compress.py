"""Device chains: compress + decompress with torch kernels where the gradient lives.

    .venv/bin/python bench/device_compress.py --device cuda            # 25M float32, < 30 s
    .venv/bin/python bench/device_compress.py --device cpu --numel 4000000 --host

For each compressor, alone ("bare") and as a worker chain (Nesterov momentum + error
feedback: "ef+mom"): the median time of ``compress`` and of ``decompress`` into a
preallocated output (each call followed by a device synchronize, so the time is the
whole call's), GB/s = input bytes / (compress + decompress), and the payload ratio.
``--host`` adds the numba chain on CPU tensors of the same size (the path a CUDA
gradient takes without device chains, its copies to and from the host left out).
Prints a markdown table and writes bench/results/device_compress_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bps.compressors import build

CASES = {
    "onebit": {"compressor": "onebit", "scaling": True},
    "topk": {"compressor": "topk", "k": 0.01},
    "randomk": {"compressor": "randomk", "k": 0.01},
    "bytegrad": {"compressor": "bytegrad"},
    "dithering": {"compressor": "dithering", "k": 4},
}
CHAINS = {"bare": {}, "ef+mom": {"ef": "vanilla", "momentum": "nesterov", "mu": 0.9}}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, runs: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(params: dict, numel: int, device: torch.device, host: bool, runs: int) -> dict:
    if host:
        os.environ["BPS_DEVICE_KERNELS"] = "0"
        chain = build(params, numel, device="cpu")
    else:
        os.environ["BPS_DEVICE_KERNELS"] = "1"  # also torch kernels for --device cpu
        chain = build(params, numel, device=device)
    where = torch.device("cpu") if host else device
    x = torch.randn(numel, device=where)
    out = torch.empty(numel, device=where)
    chain.set_lr(0.1)
    payload = chain.compress(x)

    def compress():
        chain.set_lr(0.1)
        chain.compress(x)

    compress_ms = median_ms(compress, where, runs)
    decompress_ms = median_ms(lambda: chain.decompress(payload, out), where, runs)
    return {"compress_ms": compress_ms, "decompress_ms": decompress_ms,
            "gb_per_s": 4 * numel / (compress_ms + decompress_ms) / 1e6,
            "ratio": 4 * numel / payload.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    parser.add_argument("--host", action="store_true", help="also the numba chain on CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    print(f"numel {args.numel:,} float32 on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print("| compressor | chain | kernels | compress ms | decompress ms | GB/s | ratio |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name in args.only or CASES:
        for chain, extra in CHAINS.items():
            for host in ([False, True] if args.host else [False]):
                row = measure({**CASES[name], **extra}, args.numel, device, host, args.runs)
                row.update(compressor=name, chain=chain, kernels="numba/cpu" if host else
                           f"torch/{device.type}")
                rows.append(row)
                print(f"| {name} | {chain} | {row['kernels']} | {row['compress_ms']:.2f} | "
                      f"{row['decompress_ms']:.2f} | {row['gb_per_s']:.2f} | "
                      f"{row['ratio']:.1f} |", flush=True)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"device_compress_{device.type}.json").write_text(json.dumps(
        {"numel": args.numel, "device": str(device), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
