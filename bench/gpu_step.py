"""Training step times on one GPU host: the models alone, through bps, and the device limits.

Usage::

    python bench/gpu_step.py                          # one GPU, 16 cores: under 4 minutes
    python bench/gpu_step.py --device cpu --quick     # tiny sizes on the CPU: a smoke run
    python bench/gpu_step.py --only mlp-onebit,gpt2-onebit --steps 30
    python bench/gpu_step.py --only mlp-onebit --workers 1   # one node alone on the device

It needs only the installed package (no checkout, no .venv): the cluster is started as
``[sys.executable, "-m", "bps.launch.cli", "local", "--workers", "2", "--servers", "2"]``
(CURVE on, loopback), its 2 worker nodes sharing the device (``--workers 1``: one node,
so no other process's work is time-sliced with it on the GPU). In one run:

* the limits, in this process first: device-to-host copies of 100 MB into pinned and into
  pageable host memory, and per compressor the device compress time of one 25M-element
  tensor (``bps.compressors.build(params, numel, device=...)`` then ``chain.compress(x)``;
  "n/a" where ``build`` has no ``device`` argument or the chain fails there);
* each model alone on the device (no bps), in this process: the 25.2M-parameter MLP
  (6 x Linear(2048, 2048) + ReLU, then Linear(2048, 10); batch 256; SGD lr 0.01 momentum
  0.9) and the GPT-2-small-shaped transformer (12 layers, d=768, 12 heads, vocabulary
  50,257, 512 positions, untied head: 162.6M parameters; batch 8 x 512 tokens; bf16
  autocast; AdamW);
* each model through ``bps.DistributedTrainer`` on the cluster: the MLP for fp16 raw and
  every compressor with error feedback, the transformer with onebit + EF.

Synthetic data throughout. For each configuration the table gives the median step time
(synchronised with the device at both ends, a barrier between steps) over ``--steps``
steps after ``--warmup``, its ratio to the model alone, node 0's bytes pushed + pulled per
step, and the medians of whatever of ``compress_time``, ``server_time``, ``pcie_bytes`` and
``wait_s`` (else ``wait_time``) ``trainer.stats()`` reports; "added" is the worker's own
time: step - alone - wait. Everything also goes, with the host, to
bench/results/gpu_step-TIME.json (or ``--json PATH``).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import numbers
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMPRESSORS = {
    "onebit": {"compressor": "onebit", "scaling": True},
    "topk": {"compressor": "topk", "k": 0.01},
    "randomk": {"compressor": "randomk", "k": 0.01},
    "bytegrad": {"compressor": "bytegrad"},
    "dithering": {"compressor": "dithering", "k": 4},
    "powersgd": {"compressor": "powersgd", "rank": 4},
}
LABELS = {"onebit": "onebit scaled", "topk": "topk 1%", "randomk": "randomk 1%",
          "bytegrad": "bytegrad", "dithering": "dithering s=4", "powersgd": "powersgd rank 4"}
# (model, compression params or None for fp16 raw); names are what --only selects
CONFIGS = {"mlp-fp16": ("mlp", None)}
CONFIGS.update({f"mlp-{name}": ("mlp", {**params, "ef": "vanilla"})
                for name, params in COMPRESSORS.items()})
CONFIGS["gpt2-onebit"] = ("gpt2", {**COMPRESSORS["onebit"], "ef": "vanilla"})

FULL = {"mlp_width": 2048, "mlp_layers": 6, "mlp_batch": 256,
        "gpt_layers": 12, "gpt_dim": 768, "gpt_heads": 12, "gpt_vocab": 50257,
        "gpt_seq": 512, "gpt_batch": 8, "copy_bytes": 100_000_000, "compress_numel": 25_000_000}
QUICK = {"mlp_width": 128, "mlp_layers": 2, "mlp_batch": 16,
         "gpt_layers": 2, "gpt_dim": 64, "gpt_heads": 2, "gpt_vocab": 1000,
         "gpt_seq": 32, "gpt_batch": 2, "copy_bytes": 4_000_000, "compress_numel": 100_000}
STAT_KEYS = ("compress_time", "server_time", "pcie_bytes", "wait_s", "wait_time")


# ------------------------------------------------------------------------------ models

def build_mlp(sizes: dict):
    """6 x (Linear(2048, 2048) + ReLU), then Linear(2048, 10): 25.2M parameters."""
    import torch

    width = sizes["mlp_width"]
    layers: list = []
    for _ in range(sizes["mlp_layers"]):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def build_gpt(sizes: dict):
    """GPT-2-small's shape: pre-norm blocks of causal attention and a 4x GELU MLP,
    learned positions, an untied head. 162.6M parameters at the full sizes."""
    import torch
    import torch.nn.functional as F

    dim, heads = sizes["gpt_dim"], sizes["gpt_heads"]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.fc, self.out = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, heads, dim // heads).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(dim, dim=2))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(attn.transpose(1, 2).reshape(b, t, dim))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = torch.nn.Embedding(sizes["gpt_vocab"], dim)
            self.positions = torch.nn.Embedding(sizes["gpt_seq"], dim)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(sizes["gpt_layers"]))
            self.norm = torch.nn.LayerNorm(dim)
            self.head = torch.nn.Linear(dim, sizes["gpt_vocab"], bias=False)

        def forward(self, idx):
            x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return GPT()


def workload(kind: str, sizes: dict, device, seed: int):
    """(model, optimizer factory, loss function of the model) for ``kind`` on ``device``;
    the batch is drawn once from ``seed``."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        torch.manual_seed(0)
        model = build_mlp(sizes).to(device)
        x = torch.randn(sizes["mlp_batch"], sizes["mlp_width"], generator=gen).to(device)
        y = torch.randint(0, 10, (sizes["mlp_batch"],), generator=gen).to(device)

        def loss(m):
            return F.cross_entropy(m(x), y)

        def optimizer(m):
            return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
        return model, optimizer, loss
    torch.manual_seed(0)
    model = build_gpt(sizes).to(device)
    shape = (sizes["gpt_batch"], sizes["gpt_seq"] + 1)
    tokens = torch.randint(0, sizes["gpt_vocab"], shape, generator=gen).to(device)

    def loss(m):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def optimizer(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4)
    return model, optimizer, loss


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_device(name: str, local_rank: int = 0):
    import torch

    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device; pass --device cpu")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# ------------------------------------------------------------------------- in this process

def time_alone(kind: str, sizes: dict, device, steps: int, warmup: int) -> float:
    """Median seconds of one plain training step of ``kind`` on ``device``."""
    import torch

    model, make_optimizer, loss = workload(kind, sizes, device, seed=0)
    optimizer = make_optimizer(model)
    times = []
    for i in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss(model).backward()
        optimizer.step()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def time_copies(nbytes: int, device, runs: int = 20) -> dict:
    """Median seconds of a device-to-host copy of ``nbytes`` into pinned and into pageable
    host memory (both allocated once); None on the CPU."""
    import torch

    if device.type != "cuda":
        return {"pinned": None, "pageable": None}
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    targets = {"pinned": torch.empty(source.shape, pin_memory=True),
               "pageable": torch.empty(source.shape)}
    result = {}
    for name, target in targets.items():
        times = []
        for i in range(runs + 2):
            synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=name == "pinned")
            synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - start)
        result[name] = statistics.median(times)
    del source, targets
    torch.cuda.empty_cache()
    return result


def time_device_compress(numel: int, device, runs: int = 10) -> dict:
    """Per compressor: median seconds of ``chain.compress(x)`` of ``numel`` floats built for
    ``device`` (with error feedback), or a string saying why there is no figure."""
    import torch

    from bps.compressors import build

    if "device" not in inspect.signature(build).parameters:
        return dict.fromkeys(COMPRESSORS, "n/a: build() has no device argument")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    result: dict = {}
    for name, params in COMPRESSORS.items():
        try:
            chain = build({**params, "ef": "vanilla"}, numel, device=device.type)
            times = []
            for i in range(runs + 2):
                synchronize(device)
                start = time.perf_counter()
                chain.compress(x)
                synchronize(device)
                if i >= 2:
                    times.append(time.perf_counter() - start)
            result[name] = statistics.median(times)
        except Exception as exc:  # a chain without a device path: say so, keep going
            result[name] = f"n/a: {type(exc).__name__}: {str(exc)[:120]}"
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ------------------------------------------------------------------------ the cluster child

def child(args: argparse.Namespace) -> int:
    """One worker process of the cluster: every selected configuration in turn."""
    import torch
    import torch.distributed as dist

    import bps

    bps.init()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    device = pick_device(args.device, bps.local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sizes = QUICK if args.quick else FULL
    results = {}
    for name in args.only.split(","):
        kind, params = CONFIGS[name]
        model, make_optimizer, loss = workload(kind, sizes, device, seed=1 + bps.rank())
        trainer = bps.DistributedTrainer(model, make_optimizer(model), params)
        times, stats = [], []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            trainer.zero_grad()
            loss(model).backward()
            trainer.step()
            synchronize(device)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                times.append(elapsed)
                stats.append(trainer.stats())
        trainer.close()
        results[name] = {
            "step_s": statistics.median(times), "steps_s": times,
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes_per_step": float(statistics.median(
                s.get("bytes_pushed", 0) + s.get("bytes_pulled", 0) for s in stats)),
            "stats": {key: float(statistics.median(s[key] for s in stats))
                      for key in STAT_KEYS if all(isinstance(s.get(key), numbers.Real)
                                                  for s in stats)},
            "last_stats": {k: v for k, v in stats[-1].items() if k != "totals"},
        }
        del model, trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if bps.rank() == 0:
        Path(args.out).write_text(json.dumps(results, default=str))  # stats of any type
    dist.barrier()
    dist.destroy_process_group()
    bps.shutdown()
    return 0


# ----------------------------------------------------------------------------- the parent

def run_cluster(args: argparse.Namespace) -> dict:
    """Start the loopback cluster on this file's child; rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "bps.launch.cli", "local", "--workers", str(args.workers),
               "--servers", "2", "--", sys.executable, os.path.abspath(__file__), "--child",
               "--out", out, "--device", args.device, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--only", args.only,
               "--timeout", str(args.timeout)] + (["--quick"] if args.quick else [])
        env = {**os.environ, "BPS_TIMEOUT": str(args.timeout), "PYTHONUNBUFFERED": "1"}
        env.pop("BPS_INSECURE", None)  # CURVE on: bpslaunch local makes the cluster's key
        try:
            done = subprocess.run(cmd, env=env, timeout=args.cluster_timeout,
                                  stdout=None if args.verbose else subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"the cluster did not finish within {args.cluster_timeout} s "
                             "(--cluster-timeout)") from None
        if done.returncode:
            raise SystemExit(f"the cluster failed with exit code {done.returncode}:\n"
                             f"{(done.stdout or '')[-4000:]}")
        return json.loads(Path(out).read_text()), warnings_of(done.stdout or "")


def warnings_of(log: str) -> list[str]:
    """The cluster log's WARNING and ERROR lines, each once (without its time), such as
    a key whose CUDA graph capture failed; empty with --verbose (the log was shown).

        >>> warnings_of("[worker0.0] 2026-11-27 16:23:52,001 bps WARNING: x\\n"
        ...             "[worker0.0] 2026-11-27 16:23:53,002 bps WARNING: x\\n")
        ['[worker0.0] bps WARNING: x']
    """
    found = []
    for line in log.splitlines():
        match = re.match(r"^(\[[^\]]*\]) \S+ \S+ (\S+ (?:WARNING|ERROR):.*)$", line)
        if match:
            found.append(f"{match[1]} {match[2]}")
    return list(dict.fromkeys(found))


def source_commit() -> str | None:
    """The short commit of this tree; in a copy without .git (a lent GPU host),
    ``BPS_BENCH_COMMIT``, the commit it was copied from; else None."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:  # no git on the host
        commit = ""
    return commit or os.environ.get("BPS_BENCH_COMMIT") or None


def host_info(device) -> dict:
    import torch
    import zmq

    info = {"host": socket.gethostname(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "pyzmq": zmq.__version__,
            "torch": torch.__version__, "device": str(device), "commit": source_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def ms(seconds) -> str:
    return f"{seconds * 1e3:.2f}" if isinstance(seconds, numbers.Real) else "n/a"


def table(report: dict) -> str:
    """The configurations as one markdown table."""
    rows = ["| configuration | step ms | x alone | MB pushed+pulled | compress ms | server ms "
            "| PCIe MB | wait ms | added ms | device compress ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in ("mlp", "gpt2"):
        alone = report["alone"].get(kind)
        if alone is not None:
            rows.append(f"| {kind} alone | {ms(alone)} | 1.00 | | | | | | | |")
        for name, result in report["bps"].items():
            if CONFIGS[name][0] != kind:
                continue
            compressor = name.split("-", 1)[1]
            label = f"{kind} fp16 raw" if compressor == "fp16" else \
                f"{kind} {LABELS[compressor]} + EF"
            stats = result["stats"]
            wait = stats.get("wait_s", stats.get("wait_time"))
            step = result["step_s"]
            added = step - alone - wait if wait is not None and alone is not None else None
            pcie = stats.get("pcie_bytes")
            rows.append(" | ".join([
                f"| {label}", ms(step), f"{step / alone:.2f}" if alone else "n/a",
                f"{result['bytes_per_step'] / 1e6:.2f}", ms(stats.get("compress_time")),
                ms(stats.get("server_time")), f"{pcie / 1e6:.2f}" if pcie is not None else "n/a",
                ms(wait), ms(added),
                ms(report["device_compress"].get(compressor)) + " |"]))
    return "\n".join(rows)


def parent(args: argparse.Namespace) -> int:
    import torch

    started = time.perf_counter()
    device = pick_device(args.device)
    sizes = QUICK if args.quick else FULL
    kinds = sorted({CONFIGS[name][0] for name in args.only.split(",")})
    report: dict = {"host": host_info(device), "args": vars(args), "sizes": sizes}
    def phase(text: str) -> None:
        print(f"[{time.perf_counter() - started:5.1f} s] {text}", flush=True)

    phase(f"limits on {device}")
    report["copy"] = time_copies(sizes["copy_bytes"], device)
    report["device_compress"] = time_device_compress(sizes["compress_numel"], device)
    phase(f"models alone: {', '.join(kinds)}")
    report["alone"] = {kind: time_alone(kind, sizes, device, args.steps, args.warmup)
                       for kind in kinds}
    if device.type == "cuda":
        torch.cuda.empty_cache()
    phase(f"through bps: {args.workers} worker node(s), 2 servers, CURVE, loopback")
    report["bps"], report["cluster_warnings"] = run_cluster(args)
    report["wall_s"] = time.perf_counter() - started

    host = report["host"]
    print(f"\n{host.get('gpu', host['device'])}, {host['cpus']} cores, torch {host['torch']}, "
          f"commit {host['commit']}, {host['date']}; medians of {args.steps} steps after "
          f"{args.warmup}; {args.workers} worker node(s) on the device, 2 servers, CURVE, "
          f"loopback; pyzmq {host['pyzmq']}")
    copy = report["copy"]
    print(f"device-to-host {sizes['copy_bytes'] / 1e6:.0f} MB: pinned {ms(copy['pinned'])} ms, "
          f"pageable {ms(copy['pageable'])} ms; device compress of "
          f"{sizes['compress_numel']:,} floats (+ EF) in the last column\n")
    print(table(report))
    for name, value in report["device_compress"].items():
        if isinstance(value, str):
            print(f"device compress {name}: {value}")
    for line in report["cluster_warnings"][:20]:
        print(f"cluster: {line}")
    if len(report["cluster_warnings"]) > 20:
        print(f"cluster: ... {len(report['cluster_warnings']) - 20} more in the JSON")
    path = Path(args.json) if args.json else Path(__file__).parent / "results" / \
        f"gpu_step-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{report['wall_s']:.0f} s in all; wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda where torch sees a GPU")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per configuration (default 20; 4 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 5; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny models and tensors")
    p.add_argument("--workers", type=int, default=2,
                   help="worker nodes sharing the device (default 2)")
    p.add_argument("--only", default=",".join(CONFIGS),
                   help=f"configurations, comma-separated (of {', '.join(CONFIGS)})")
    p.add_argument("--json", default=None, help="default: bench/results/gpu_step-TIME.json")
    p.add_argument("--timeout", type=int, default=120,
                   help="BPS_TIMEOUT and the workers' barriers, seconds")
    p.add_argument("--cluster-timeout", type=int, default=600,
                   help="the whole cluster run, seconds")
    p.add_argument("--verbose", action="store_true", help="show the cluster's log")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 5
    unknown = [name for name in args.only.split(",") if name not in CONFIGS]
    if unknown:
        p.error(f"--only: unknown configuration {unknown[0]!r} (of {', '.join(CONFIGS)})")
    if args.steps < 1 or args.warmup < 0 or args.workers < 1:
        p.error("--steps and --workers must be >= 1 and --warmup >= 0")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
