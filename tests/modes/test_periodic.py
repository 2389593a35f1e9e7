"""Periodic averaging (``sync_every``) and one-step-delayed updates (``staleness``) end to
end on real clusters (``bpslaunch local``), against an independent numpy simulation.

This module is also the worker program: ``python -m tests.modes.test_periodic
CONFIG_JSON`` is what every worker process runs (tests/harness/trainer_job.py's
``worker_main`` with this module's ``train``), one trainer per configuration in
sequence. The toy model's gradient is known in closed form
(``grad = w - target``), so the simulation replays local steps, the compressor chains,
the servers' sums, the outer update and the delayed application in numpy.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness.trainer_job import (
    MOMENTUM,
    PARTITION,
    SHAPES,
    SIM_CASES,
    initial_params,
    local_step,
    make_model,
    nesterov,
    reference_codec,
    sgd_momentum,
    step_faults,
    targets,
    worker_main,
)
from tests.harness.trainer_job import launch as trainer_launch

NODES = 2
LRS = [0.5, 0.25, 0.25, 0.5, 0.125, 0.25, 0.125, 0.0625]  # powers of two: lr * g exact
EF = {"ef": "vanilla", "fp16": False, "min_compress_bytes": 1000}
CHAIN_MOMENTUM = {"momentum": "nesterov", "mu": MOMENTUM}


def buffer_update(rank: int, step: int) -> np.float32:
    """What a worker adds to its float buffer at a step (as a norm layer's statistics)."""
    return np.float32(0.25 * (rank + 1) + 0.125 * step)


# ----------------------------------------------------------------------------- worker side


def train(cfg: dict, run: dict, rank: int, shapes: dict, out: Path) -> dict:
    import torch

    import bps

    tag, lrs = run["tag"], cfg.get("lrs", LRS)
    model = make_model(rank, shapes)
    buffered = run.get("buffer", True)  # a float buffer
    if buffered:
        model.register_buffer("running", torch.full((3,), float(rank + 1)))  # rank 0's
    optimizer = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=MOMENTUM)
    trainer = bps.DistributedTrainer(model, optimizer, run["params"], **run["mode"])
    start = run.get("start", trainer.step_count)  # a node that joined: the sender's count
    if "start" in run:
        checkpoint = torch.load(out / f"ckpt{tag}{rank}.pt", weights_only=False)
        model.load_state_dict(checkpoint["model"])
        trainer.load_state_dict(checkpoint["trainer"])
    goal = {name: torch.from_numpy(t) for name, t in targets(rank, shapes).items()}
    report = {"bytes": [], "applied": [], "refused": [], "start": start}
    if cfg.get("die_in_buffers", [None])[0] == rank:
        die_at_buffer_push(trainer, cfg["die_in_buffers"][1])
    if run["mode"]:  # the synchronous trainer (PLAIN) has both
        try:  # neither mode has a step for synchronize() to wait for, nor runs join()
            trainer.synchronize()
        except RuntimeError as exc:
            report["refused"].append(str(exc))
        try:
            with trainer.join():
                pass
        except NotImplementedError as exc:
            report["refused"].append(str(exc))
    for step in range(start, run.get("stop", len(lrs))):
        step_faults(cfg, rank, step, out)
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        trainer.zero_grad()
        sum(0.5 * ((getattr(model, n) - goal[n]) ** 2).sum() for n in shapes).backward()
        with torch.no_grad():
            if buffered:
                model.running.mul_(0.5).add_(float(buffer_update(rank, step)))
            if run.get("nan_at") == step and rank == 1:  # a delta with a NaN: skipped
                model.small[0] = float("nan")
        report["applied"].append(trainer.step())
        report["bytes"].append(trainer.stats()["bytes_pushed"])
        if buffered:
            report.setdefault("running", []).append(model.running.tolist())
        if run.get("save_at") == step + 1:
            torch.save({"model": model.state_dict(), "trainer": trainer.state_dict()},
                       out / f"ckpt{tag}{rank}.pt")
    np.savez(out / f"params{tag}{rank}.npz",
             **({"running": model.running.numpy()} if buffered else {}),
             **{n: getattr(model, n).detach().numpy() for n in shapes})
    trainer.close()
    return report


def die_at_buffer_push(trainer, count: int) -> None:
    """This worker kills itself (SIGKILL) at its ``count``-th push of the buffers' mean,
    after its round's parameters went out and came back, before its buffers go."""
    import os
    import signal

    average = trainer.mode.buffers
    push, calls = average.push, [0]

    def dying_push(step: int):
        calls[0] += 1
        if calls[0] == count:
            os.kill(os.getpid(), signal.SIGKILL)
        return push(step)

    average.push = dying_push


# ----------------------------------------------------------------------------- test side


def launch(cfg: dict, tmp: Path, env: dict | None = None,
           timeout: float = 180) -> subprocess.CompletedProcess:
    """tests/harness/trainer_job.py's launch, running this module on NODES nodes and 2
    servers."""
    return trainer_launch(cfg, tmp, NODES, 2, env={"BPS_TIMEOUT": "60", **(env or {})},
                          timeout=timeout, module=__name__)


def load_params(tmp: Path, tag: str, rank: int) -> dict:
    return dict(np.load(tmp / f"params{tag}{rank}.npz"))


class RefPipeline:
    """docs/architecture.md's path of one step's shares (each already divided by the
    number of nodes), in numpy: the big tensor through every node's Momentum ->
    ErrorFeedback -> C chain per partition, the server's float32 sum in node order,
    its ErrorFeedback -> C and the decode; the raw tensors summed in node order, with
    the chain's Nesterov rule after the sum where momentum is on."""

    def __init__(self, params: dict, nodes: int, shapes: dict,
                 compressed: tuple[str, ...] = ("big",), partition: int = PARTITION) -> None:
        from tests.harness.reference_compressors import RefChain

        self.shapes, self.nodes = shapes, nodes
        self.compressed = compressed if params.get("compressor") is not None else ()
        self.mu = params.get("mu", MOMENTUM) if params.get("momentum") else None
        self.parts, self.workers, self.servers = {}, {}, {}
        for name in self.compressed:
            numel = int(np.prod(shapes[name]))
            parts = [(o, min(partition, numel - o)) for o in range(0, numel, partition)]
            self.parts[name] = parts
            self.workers[name] = [[RefChain(*reference_codec(params, n), n, "float32", True,
                                            self.mu) for _, n in parts] for _ in range(nodes)]
            self.servers[name] = [RefChain(*reference_codec(params, n), n, "float32", True,
                                           None) for _, n in parts]
        self.local_momentum = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
        self.params, self.partition = params, partition

    def renew_server(self, name: str, index: int) -> None:
        """Partition ``index`` of ``name``'s server chain starts anew (its server was
        replaced: its error feedback is lost)."""
        from tests.harness.reference_compressors import RefChain

        n = self.parts[name][index][1]
        self.servers[name][index] = RefChain(*reference_codec(self.params, n), n, "float32",
                                             True, None)

    def renew_worker(self, node: int) -> None:
        """Node ``node``'s chains start anew (it joined the job again)."""
        fresh = RefPipeline(self.params, 1, self.shapes, self.compressed,
                            self.partition)
        for name in self.compressed:
            self.workers[name][node] = fresh.workers[name][0]

    def aggregate(self, shares: list[dict], lr: float, present: list[int] | None = None
                  ) -> dict:
        """The step's aggregate of ``shares`` (one per node, by node id) of the nodes
        ``present`` (default: all); a node present without a share pushed zero markers
        (no chain runs, nothing is added)."""
        f32 = np.float32
        present = list(range(self.nodes)) if present is None else \
            [r for r in present if r in shares]
        out = {}
        for n, shape in self.shapes.items():
            if n in self.compressed:
                big = np.zeros(int(np.prod(shape)), f32)
                for i, (offset, length) in enumerate(self.parts[n]):
                    summed = np.zeros(length, f32)
                    for r in present:
                        chain = self.workers[n][r][i]
                        chain.set_lr(lr)
                        piece = shares[r][n].reshape(-1)[offset:offset + length]
                        summed = (summed + chain.decode(chain.compress(piece)).astype(f32)
                                  ).astype(f32)
                    server = self.servers[n][i]
                    server.set_lr(lr)
                    big[offset:offset + length] = server.decode(server.compress(summed))
                out[n] = big.reshape(shape)
                continue
            summed = np.zeros(shape, f32)
            for r in present:
                summed = (summed + shares[r][n]).astype(f32)
            if self.mu is not None:
                summed, self.local_momentum[n] = nesterov(f32(self.mu), summed,
                                                          self.local_momentum[n])
            out[n] = summed
        return out


def simulate_periodic(params: dict, every: int, outer: dict | None, shapes: dict = SHAPES
                      ) -> dict:
    """Each node: local SGD with momentum on its own target; every ``every`` steps the
    deltas ``anchor - w`` go through the pipeline with the outer lr, the outer update
    (``outer``) moves the anchor, every node restarts from it and the float buffer is
    the float32 mean (node order) of the nodes' buffers."""
    f32 = np.float32
    outer = outer or {"optimizer": "average"}
    defaults = {"average": (1.0, 0.0), "sgd": (1.0, 0.0), "nesterov": (0.7, 0.9)}
    lr_out = f32(outer.get("lr", defaults[outer["optimizer"]][0]))
    mu_out = f32(outer.get("momentum", defaults[outer["optimizer"]][1]))
    anchor = initial_params(0, shapes)
    ws = [dict(anchor) for _ in range(NODES)]
    bufs = [{n: None for n in shapes} for _ in range(NODES)]
    running = [np.full(3, 1.0, f32) for _ in range(NODES)]  # rank 0's, broadcast
    outer_momentum = {n: np.zeros(s, f32) for n, s in shapes.items()}
    pipe = RefPipeline(params, NODES, shapes)
    for step, lr in enumerate(LRS):
        for r in range(NODES):
            local_step(ws[r], bufs[r], r, lr, shapes)
            running[r] = (running[r] * f32(0.5) + buffer_update(r, step)).astype(f32)
        if (step + 1) % every:
            continue
        shares = [{n: ((anchor[n] - ws[r][n]).astype(f32) / f32(NODES)).astype(f32)
                   for n in shapes} for r in range(NODES)]
        avg = pipe.aggregate(shares, float(lr_out))
        for n in shapes:
            step_n = avg[n]
            if mu_out:
                outer_momentum[n] = (mu_out * outer_momentum[n] + avg[n]).astype(f32)
                step_n = ((mu_out * outer_momentum[n]).astype(f32) + avg[n]).astype(f32) \
                    if outer["optimizer"] == "nesterov" else outer_momentum[n]
            if lr_out != 1:
                step_n = (lr_out * step_n).astype(f32)
            anchor[n] = (anchor[n] - step_n).astype(f32)
        ws = [dict(anchor) for _ in range(NODES)]
        mean = np.zeros(3, f32)
        for r in range(NODES):
            mean = (mean + (running[r] / f32(NODES)).astype(f32)).astype(f32)
        running = [mean.copy() for _ in range(NODES)]
    return [{**ws[r], "running": running[r]} for r in range(NODES)]


# the fragments of SHAPES, by hand: rows go to the fragment their middle element falls
# in (311 elements; big's rows hold 10)
FRAGMENTS = {
    1: [[("big", None), ("small", None), ("bias", None)]],
    2: [[("big", (0, 16))], [("big", (16, 30)), ("small", None), ("bias", None)]],
    4: [[("big", (0, 8))], [("big", (8, 16))], [("big", (16, 23))],
        [("big", (23, 30)), ("small", None), ("bias", None)]],
}


def outer_step(anchor: np.ndarray, avg: np.ndarray, momentum: np.ndarray | None,
               optimizer: str, lr: np.float32, mu: np.float32
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """docs/trainer.md's outer update in float32: (anchor, momentum)."""
    f32 = np.float32
    step = avg
    if mu:
        momentum = (mu * momentum + avg).astype(f32)
        step = ((mu * momentum).astype(f32) + avg).astype(f32) if optimizer == "nesterov" \
            else momentum
    if lr != 1:
        step = (lr * step).astype(f32)
    return (anchor - step).astype(f32), momentum


def simulate_streaming(params: dict, every: int, fragments: int, overlap: int,
                       outer: dict | None, nan_at: int | None = None, shapes: dict = SHAPES,
                       nodes: int = NODES, lrs: list[float] = LRS, buffers: bool = True,
                       death: tuple[int, int] | None = None,
                       server_death: tuple[int, list[tuple[int, str, int]]] | None = None,
                       rejoin: tuple[int, int, int] | None = None,
                       buffer_death: tuple[int, int] | None = None,
                       dropped_buffers: tuple[int, ...] = ()) -> list[dict]:
    """Local SGD with momentum on each node; after local step s with s % (every /
    fragments) == 0 the next fragment's deltas go through that fragment's own pipeline
    and its outer update lands after step s + overlap, each node keeping its local
    change since the push (w = anchor + w - w_at_push); the float buffer (``buffers``)
    travels with the last fragment and merges the same way. Rounds still in flight at
    the end never land. ``nan_at``: node 1's small[0] becomes NaN before that step's
    optimizer step; the round that carries it is skipped: the chains as before it, the
    fragment back to its anchor on every node, the buffers as they are. ``death``:
    (node, step): that node is gone from the start of that step (no round in flight
    then); the first round pushed after it is dropped as a skipped one, the later ones
    average the nodes present. ``server_death``: (step, moved): a server is replaced at
    the start of that step (no round in flight then): the first round pushed after it is
    dropped, and the server chains ``moved`` ((fragment, piece, partition) each) start
    anew. ``rejoin``: (node, d, j): that node dies, the round pushed after local step
    ``d`` (counted from 1) is dropped, the later ones average the others; the round
    pushed after ``j`` is dropped for its join: when it lands the node joins with node
    0's parameters, momentum and buffer and chains anew; in a round pushed at that same
    step it pushes zero markers (counted in the divisor, its buffer counted too).
    ``buffer_death``: (node, s): that node dies after pushing its round of local step
    ``s`` but before its buffer: the round lands, the buffers' mean is dropped (each
    node keeps its own), the next round is dropped and the later ones average the
    others. ``dropped_buffers``: the local steps after which a round was pushed whose
    buffers' mean a membership change dropped (each node keeps its own)."""
    f32 = np.float32
    outer = outer or {"optimizer": "average"}
    defaults = {"average": (1.0, 0.0), "sgd": (1.0, 0.0), "nesterov": (0.7, 0.9)}
    lr_out = f32(outer.get("lr", defaults[outer["optimizer"]][0]))
    mu_out = f32(outer.get("momentum", defaults[outer["optimizer"]][1]))
    plan = FRAGMENTS[fragments]

    def piece_name(name: str, rows: tuple | None) -> str:
        return name if rows is None else f"{name}[{rows[0]}:{rows[1]}]"

    def view(tensors: dict, name: str, rows: tuple | None) -> np.ndarray:
        return tensors[name] if rows is None else tensors[name][rows[0]:rows[1]]

    present = list(range(nodes))
    ws = [initial_params(0, shapes) for _ in range(nodes)]
    anchor = initial_params(0, shapes)
    outer_momentum = {n: np.zeros(s, f32) for n, s in shapes.items()}
    bufs = [{n: None for n in shapes} for _ in range(nodes)]
    running = [np.full(3, 1.0, f32) for _ in range(nodes)]
    pipes = []
    for pieces in plan:
        piece_shapes = {piece_name(n, rows): view(anchor, n, rows).shape for n, rows in pieces}
        big = tuple(piece_name(n, rows) for n, rows in pieces
                    if np.prod(view(anchor, n, rows).shape) * 4 >= params.get(
                        "min_compress_bytes", 65536))
        # partitions spread a fragment over both servers
        floats = sum(int(np.prod(shape)) for shape in piece_shapes.values())
        pipes.append(RefPipeline(params, nodes, piece_shapes, compressed=big,
                                 partition=min(PARTITION, -(-floats // 2))))
    rounds = []  # (fragment, lands at, avg by piece, start [node][piece], buffer round)
    dropping = False  # the first round after a death is dropped

    joined_at = None  # the local step after which the rejoining node is back

    def land(due: tuple) -> None:
        nonlocal joined_at
        fragment, lands, pushed, avg, start, pending = due
        if avg is None:  # skipped
            for n, rows in plan[fragment]:
                for r in present:
                    view(ws[r], n, rows)[...] = view(anchor, n, rows)
            if rejoin is not None and pushed == rejoin[2]:
                node = rejoin[0]
                ws[node] = {n: v.copy() for n, v in ws[0].items()}
                bufs[node] = {n: None if v is None else v.copy() for n, v in bufs[0].items()}
                running[node] = running[0].copy()
                for pipe in pipes:
                    pipe.renew_worker(node)
                present.append(node)
                present.sort()
                joined_at = lands
            return
        for n, rows in plan[fragment]:
            name = piece_name(n, rows)
            a, m = outer_step(view(anchor, n, rows), avg[name], view(outer_momentum, n, rows),
                              outer["optimizer"], lr_out, mu_out)
            view(anchor, n, rows)[...] = a
            if m is not None:
                view(outer_momentum, n, rows)[...] = m
            for r in present:
                w = view(ws[r], n, rows)
                w[...] = (a + (w - start[r][name]).astype(f32)).astype(f32) \
                    if lands != pushed else a
        if pending is not None:
            mean, before = pending
            for r in present:
                running[r] = (mean + (running[r] - before[r]).astype(f32)).astype(f32) \
                    if lands != pushed else mean.copy()

    period = every // fragments
    for step, lr in enumerate(lrs):
        s = step + 1
        if death is not None and step == death[1]:
            assert not rounds, "a death with a round in flight: not simulated"
            present.remove(death[0])
            dropping = True
        if server_death is not None and step == server_death[0]:
            assert not rounds, "a server replaced with a round in flight: not simulated"
            for fragment, name, index in server_death[1]:
                pipes[fragment].renew_server(name, index)
            dropping = True
        for r in present:
            goal = targets(r, shapes)
            grads = {n: (ws[r][n] - goal[n]).astype(f32) for n in shapes}  # before the NaN
            if step == nan_at and r == 1:
                ws[r]["small"][0] = np.nan  # before the optimizer step, as the worker does
            for n in shapes:
                ws[r][n], bufs[r][n] = sgd_momentum(ws[r][n], grads[n], bufs[r][n], lr)
            running[r] = (running[r] * f32(0.5) + buffer_update(r, step)).astype(f32)
        for due in [d for d in rounds if d[1] == s]:
            rounds.remove(due)
            land(due)
        if s % period:
            continue
        fragment = (s // period - 1) % fragments
        if rejoin is not None and s == rejoin[1]:
            present.remove(rejoin[0])
            dropping = True
        if rejoin is not None and s == rejoin[2]:
            dropping = True
        shares, start = {}, {}
        for r in present:
            start[r] = {piece_name(n, rows): view(ws[r], n, rows).copy()
                        for n, rows in plan[fragment]}
            if s == joined_at and r == rejoin[0]:
                continue  # zero markers
            shares[r] = {piece_name(n, rows): (((view(anchor, n, rows) - view(ws[r], n, rows))
                                                .astype(f32) / f32(len(present))).astype(f32))
                         for n, rows in plan[fragment]}
        finite = all(np.isfinite(v).all() for share in shares.values() for v in share.values())
        avg = pipes[fragment].aggregate(shares, float(lr_out), present) \
            if finite and not dropping else None
        dropping = False
        pending = None
        if buffers and fragment == fragments - 1 and s not in dropped_buffers and \
                (buffer_death is None or s != buffer_death[1]):
            mean = np.zeros(3, f32)
            for r in present:
                mean = (mean + (running[r] / f32(len(present))).astype(f32)).astype(f32)
            pending = (mean, [b.copy() for b in running])
        due = (fragment, s + overlap, s, avg, start, pending)
        if overlap:
            rounds.append(due)
        else:
            land(due)
        if buffer_death is not None and s == buffer_death[1]:
            present.remove(buffer_death[0])
            dropping = True
    return [{**ws[r], **({"running": running[r]} if buffers else {})} for r in range(nodes)]


STREAM_EF = {**EF, "min_compress_bytes": 256}  # big's row pieces travel compressed
STREAMING = {  # params, sync_every, fragments, overlap, outer
    "onebit": ({**SIM_CASES["onebit"], **STREAM_EF, **CHAIN_MOMENTUM}, 4, 2, 1, None),
    "topk": ({**SIM_CASES["topk"], **STREAM_EF}, 4, 2, 2,
             {"optimizer": "nesterov", "lr": 0.5, "momentum": 0.5}),
    "bytegrad": ({**SIM_CASES["bytegrad"], **STREAM_EF}, 4, 4, 0, None),
    "raw": ({"fp16": False}, 2, 1, 2, {"optimizer": "sgd", "lr": 0.5, "momentum": 0.5}),
    # node 1's delta of the last fragment holds a NaN at step 4: that round is skipped
    "skip": ({**SIM_CASES["onebit"], **STREAM_EF, "nonfinite": "skip"}, 4, 2, 1, None, 3),
}


PERIODIC = {
    "onebit": ({**SIM_CASES["onebit"], **EF, **CHAIN_MOMENTUM}, 3, None),
    "topk": ({**SIM_CASES["topk"], **EF}, 2, {"optimizer": "nesterov"}),
    "randomk": ({**SIM_CASES["randomk"], **EF}, 2, {"optimizer": "sgd", "lr": 0.5,
                                                     "momentum": 0.5}),
    "dithering": ({**SIM_CASES["dithering"], **EF, **CHAIN_MOMENTUM}, 4,
                  {"optimizer": "nesterov", "lr": 0.6, "momentum": 0.8}),
    "bytegrad": ({**SIM_CASES["bytegrad"], **EF, **CHAIN_MOMENTUM}, 2, None),
    "raw": ({"fp16": False}, 3, {"optimizer": "nesterov"}),
}


def simulate_stale(params: dict, shapes: dict = SHAPES) -> dict:
    """Step t pushes the shares of the gradients at w_t through the pipeline with step
    t's lr and applies the aggregate of step t-1 (nothing at step 0) with step t's lr;
    the optimizer's momentum where the chain has none."""
    f32 = np.float32
    w = initial_params(0, shapes)
    goals = [targets(r, shapes) for r in range(NODES)]
    pipe = RefPipeline(params, NODES, shapes)
    bufs = {n: None for n in shapes}
    pending = None
    for lr in LRS:
        shares = [{n: ((w[n] - goals[r][n]).astype(f32) / f32(NODES)).astype(f32)
                   for n in shapes} for r in range(NODES)]
        aggregate = pipe.aggregate(shares, lr)
        if pending is not None:
            for n in shapes:
                if params.get("momentum"):  # moved into the chain: plain SGD
                    w[n] = (w[n] - f32(lr) * pending[n]).astype(f32)
                else:
                    w[n], bufs[n] = sgd_momentum(w[n], pending[n], bufs[n], lr)
        pending = aggregate
    return w


STALE = {
    "onebit": {**SIM_CASES["onebit"], **EF, "momentum": "nesterov"},
    "topk": {**SIM_CASES["topk"], **EF, "momentum": "nesterov"},
    "randomk": {**SIM_CASES["randomk"], **EF},  # the optimizer keeps its momentum
    "dithering": {**SIM_CASES["dithering"], **EF, "momentum": "nesterov"},
    "bytegrad": {**SIM_CASES["bytegrad"], **EF, "momentum": "nesterov"},
    "raw": {"fp16": False, "momentum": "nesterov"},
}


# the synchronous trainer resumed from a checkpoint: randomk's worker and server chains
# carry error, momentum and RNG state
PLAIN = {"tag": "plain-randomk", "params": {**SIM_CASES["randomk"], **EF, **CHAIN_MOMENTUM},
         "mode": {}}


def overlap_runs() -> list[dict]:
    return [{"tag": f"periodic-{name}", "params": params,
             "mode": {"sync_every": every, "outer": outer}}
            for name, (params, every, outer) in PERIODIC.items()] + \
        [{"tag": f"stale-{name}", "params": params, "mode": {"staleness": 1}}
         for name, params in STALE.items()] + \
        [{"tag": f"stream-{name}", "params": params, "nan_at": nan_at[0] if nan_at else None,
          "mode": {"sync_every": every, "fragments": fragments, "overlap": overlap,
                   "outer": outer}}
         for name, (params, every, fragments, overlap, outer, *nan_at) in STREAMING.items()]


def test_overlap_modes_match_simulation_and_resume_exactly(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    whole.mkdir()
    resumed.mkdir()
    # the resumed runs come first in both launches, so their keys are numbered alike;
    # step 4 of H = 3 is one local step into the second round; after step 4 with
    # staleness=1 step 3's aggregate is in flight, and so is a fragment streamed with
    # an overlap
    resume = [{**run, "tag": f"{run['tag']}-resume", "save_at": 4}
              for run in overlap_runs() + [PLAIN] if run["tag"] in (
                  "periodic-onebit", "periodic-randomk", "stale-randomk", "stale-onebit",
                  "stream-onebit", "stream-topk", PLAIN["tag"])]
    result = launch({"runs": resume + overlap_runs() + [PLAIN]}, whole)
    assert result.returncode == 0, result.stdout[-3000:]
    for r in range(NODES):
        for run in resume:
            (resumed / f"ckpt{run['tag']}{r}.pt").write_bytes(
                (whole / f"ckpt{run['tag']}{r}.pt").read_bytes())
    # fresh processes, another job seed: randomk's generators come from the checkpoint
    result = launch({"runs": [{**run, "start": 4} for run in resume]}, resumed,
                    env={"BPS_JOB_SEED": "999"})
    assert result.returncode == 0, result.stdout[-3000:]
    reports = [json.loads((whole / f"report{r}.json").read_text()) for r in range(NODES)]
    for run in overlap_runs():
        tag = run["tag"]
        sync, join = reports[0][tag]["refused"]
        assert "synchronize()" in sync and ("staleness=1" in sync or "sync_every" in sync)
        assert "join()" in join, join
        if tag.startswith("stale-"):
            expected = simulate_stale(run["params"])
            for r in range(NODES):
                final = load_params(whole, tag, r)
                for n in expected:
                    np.testing.assert_array_equal(final[n], expected[n],
                                                  err_msg=f"{tag} rank {r}: {n}")
                assert reports[r][tag]["applied"] == [s > 0 for s in range(len(LRS))]
            continue
        if tag.startswith("stream-"):
            expected = simulate_streaming(*STREAMING[tag.removeprefix("stream-")])
            if tag == "stream-skip":  # the round pushed after step 4 lands after step 5
                assert reports[0][tag]["applied"] == [s != 4 for s in range(len(LRS))]
            for r in range(NODES):
                final = load_params(whole, tag, r)
                for n in expected[r]:
                    np.testing.assert_array_equal(final[n], expected[r][n],
                                                  err_msg=f"{tag} rank {r}: {n}")
            continue
        params, every, outer = PERIODIC[tag.removeprefix("periodic-")]
        expected = simulate_periodic(params, every, outer)
        for r in range(NODES):
            final = load_params(whole, tag, r)
            for n in expected[r]:
                np.testing.assert_array_equal(final[n], expected[r][n],
                                              err_msg=f"{tag} rank {r}: {n}")
            pushed = [b > 0 for b in reports[r][tag]["bytes"]]
            if r == 0:  # nothing on the wire between syncs
                assert pushed == [(s + 1) % every == 0 for s in range(len(LRS))], (tag, pushed)
    for run in resume:
        for r in range(NODES):
            final, whole_run = load_params(resumed, run["tag"], r), load_params(whole, run[
                "tag"].removesuffix("-resume"), r)
            for n in final:
                np.testing.assert_array_equal(final[n], whole_run[n], err_msg=run["tag"])
    # the synchronous trainer, too (and its checkpoint did not disturb its own run)
    assert not np.array_equal(load_params(whole, PLAIN["tag"], 0)["big"],
                              initial_params(0, SHAPES)["big"])
    for r in range(NODES):
        checkpointed = load_params(whole, f"{PLAIN['tag']}-resume", r)
        for n, value in load_params(whole, PLAIN["tag"], r).items():
            np.testing.assert_array_equal(checkpointed[n], value, err_msg=n)


def run_with_a_death(tmp_path, run: dict, lrs: list[float], fault: dict
                     ) -> tuple[str, list[dict]]:
    """``run`` on 3 nodes and 2 servers with ``--min-workers 2`` and ``fault`` (one of
    the harness's, on node 2); the launcher's output and the survivors' reports."""
    result = trainer_launch({"runs": [run], "lrs": lrs, **fault}, tmp_path, 3, 2,
                            env={"BPS_TIMEOUT": "60"}, timeout=180, module=__name__,
                            options=("--min-workers", "2"))
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout, [json.loads((tmp_path / f"report{r}.json").read_text())[run["tag"]]
                           for r in (0, 1)]


def test_streaming_syncs_go_on_over_the_nodes_left(tmp_path):
    """``--min-workers 2`` of 3 nodes, streaming onebit syncs (H = 4, two fragments, an
    overlap of one step; a float buffer averaged with the last fragment): node 2 is
    killed (SIGKILL) at the start of step 5, with no round in flight. The round pushed
    after step 5 (fragment 0) is dropped on both survivors and puts that fragment back
    to its anchor; the rounds after it average the two survivors' deltas, each
    fragment's pipeline dividing by two, and the buffer's mean the survivors' buffers.
    The survivors end bit-identical to the simulation."""
    params, every, fragments, overlap, outer = STREAMING["onebit"]
    lrs = LRS + [0.25, 0.5]
    run = {"tag": "elastic", "params": params,
           "mode": {"sync_every": every, "fragments": fragments, "overlap": overlap}}
    output, reports = run_with_a_death(tmp_path, run, lrs, {"leave": [2, 5, "SIGKILL"]})
    assert "worker nodes [0, 1] go on (membership generation 1)" in output
    # the round pushed after step 5 lands after step 6: applied nowhere
    assert reports[0]["applied"] == reports[1]["applied"] == [s != 6 for s in range(10)]
    expected = simulate_streaming(params, every, fragments, overlap, outer, nodes=3,
                                  lrs=lrs, death=(2, 5))
    for r in (0, 1):
        final = load_params(tmp_path, "elastic", r)
        assert set(final) == {*SHAPES, "running"}, final.keys()
        for n in final:
            np.testing.assert_array_equal(final[n], expected[r][n], err_msg=f"rank {r}: {n}")


def test_local_sgd_with_a_float_buffer_goes_on_over_the_nodes_left(tmp_path):
    """``--min-workers 2`` of 3 nodes, local SGD (H = 4, onebit with error feedback and
    Nesterov momentum, a float buffer averaged after each round): node 2 is killed at
    the start of step 5; the round after step 7 is dropped (both survivors back to the
    anchor, their buffers as they are), the round after step 11 averages the two
    survivors' deltas and buffers. The survivors end bit-identical to the simulation
    (one fragment, no overlap)."""
    params, _, _, _, outer = STREAMING["onebit"]
    lrs = LRS + [0.25, 0.5, 0.5, 0.25]
    run = {"tag": "elastic", "params": params, "mode": {"sync_every": 4}}
    _, reports = run_with_a_death(tmp_path, run, lrs, {"leave": [2, 5, "SIGKILL"]})
    assert reports[0]["applied"] == reports[1]["applied"] == [s != 7 for s in range(12)]
    expected = simulate_streaming(params, 4, 1, 0, outer, nodes=3, lrs=lrs, death=(2, 5))
    for r in (0, 1):
        final = load_params(tmp_path, "elastic", r)
        for n in final:
            np.testing.assert_array_equal(final[n], expected[r][n], err_msg=f"rank {r}: {n}")


def run_with_a_spare(tmp_path, run: dict, lrs: list[float]) -> list[dict]:
    """``run`` (tag "spare") on 2 nodes, 2 servers and ``--spare-servers 1``, server 1
    killed at the start of step 5; the nodes' reports, once the spare took its keys."""
    result = trainer_launch({"runs": [run], "lrs": lrs, "kill_server": [1, 5]}, tmp_path,
                            2, 2, env={"BPS_TIMEOUT": "60"}, timeout=180, module=__name__,
                            options=("--spare-servers", "1"))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "server 1 is now served from" in result.stdout, result.stdout[-3000:]
    return [json.loads((tmp_path / f"report{r}.json").read_text())["spare"] for r in (0, 1)]


def test_streaming_syncs_go_on_when_a_spare_takes_a_killed_servers_keys(tmp_path):
    """``--spare-servers 1``, 2 nodes, the streaming onebit syncs above: server 1 is
    killed (SIGKILL) at the start of step 5, with no round in flight, and the spare takes
    its keys. The round pushed after step 5 is dropped on both nodes; the server chains
    of the keys it held restart at zero: fragment 0's second partition (its two spread
    over both servers) and both of fragment 1's (its raw key, the largest payload, went
    to server 0 first). Both nodes end as the simulation, bit for bit; a round of each
    fragment lands after the replacement."""
    params, every, fragments, overlap, outer = STREAMING["onebit"]
    lrs = LRS + [0.25, 0.5, 0.5, 0.25]
    run = {"tag": "spare", "params": params, "buffer": False,
           "mode": {"sync_every": every, "fragments": fragments, "overlap": overlap}}
    reports = run_with_a_spare(tmp_path, run, lrs)
    assert reports[0]["applied"] == reports[1]["applied"] == [s != 6 for s in range(12)]
    moved = [(0, "big[0:16]", 1), (1, "big[16:30]", 0), (1, "big[16:30]", 1)]
    expected = simulate_streaming(params, every, fragments, overlap, outer, nodes=2,
                                  lrs=lrs, buffers=False, server_death=(5, moved))
    # the simulation tells each reset apart: without any one of them a node differs
    for kept in range(len(moved)):
        other = simulate_streaming(params, every, fragments, overlap, outer, nodes=2,
                                   lrs=lrs, buffers=False,
                                   server_death=(5, moved[:kept] + moved[kept + 1:]))
        assert any(not np.array_equal(other[r]["big"], expected[r]["big"]) for r in (0, 1))
    for r in (0, 1):
        final = load_params(tmp_path, "spare", r)
        for n in SHAPES:
            np.testing.assert_array_equal(final[n], expected[r][n], err_msg=f"rank {r}: {n}")


def test_a_buffer_mean_that_a_death_drops_leaves_each_nodes_buffers(tmp_path):
    """``--min-workers 2`` of 3 nodes, local SGD (H = 4) with a float buffer: node 2
    dies after its second round's parameters came back, before it pushes its buffers.
    That round lands on the survivors; its buffers' mean is dropped by the membership
    change, so each survivor keeps its own buffer (they differ now, as between syncs);
    the third round (pushed for the old membership) is dropped, the fourth averages
    the two. The survivors end as the simulation, bit for bit."""
    params, _, _, _, outer = STREAMING["onebit"]
    lrs = LRS + LRS
    run = {"tag": "buffers", "params": params, "mode": {"sync_every": 4}}
    _, reports = run_with_a_death(tmp_path, run, lrs, {"die_in_buffers": [2, 2]})
    assert reports[0]["applied"] == reports[1]["applied"] == [s != 11 for s in range(16)]
    expected = simulate_streaming(params, 4, 1, 0, outer, nodes=3, lrs=lrs,
                                  buffer_death=(2, 8))
    # after the second round (step 7) the survivors' buffers are their own, not a mean
    assert reports[0]["running"][7] != reports[1]["running"][7], reports
    assert reports[0]["running"][3] == reports[1]["running"][3], reports  # the first's
    finals = [load_params(tmp_path, "buffers", r) for r in (0, 1)]
    for r in (0, 1):
        for n in finals[r]:
            np.testing.assert_array_equal(finals[r][n], expected[r][n], err_msg=f"rank {r}: {n}")


def test_local_sgd_goes_on_when_a_spare_takes_a_killed_servers_keys(tmp_path):
    """``--spare-servers 1``, 2 nodes, local SGD (H = 4, onebit with error feedback and
    Nesterov momentum, a float buffer): server 1 is killed at the start of step 5 and
    the spare takes its keys. The round after step 7 is dropped (both nodes back to the
    anchor, buffers as they are); the server chains of the three partitions of "big"
    (on server 1: the raw key, the largest payload, went to server 0) restart at zero
    for the round after step 11. Both nodes end as the simulation, bit for bit."""
    params, _, _, _, outer = STREAMING["onebit"]
    lrs = LRS + [0.25, 0.5, 0.5, 0.25]
    run = {"tag": "spare", "params": params, "mode": {"sync_every": 4}}
    reports = run_with_a_spare(tmp_path, run, lrs)
    assert reports[0]["applied"] == reports[1]["applied"] == [s != 7 for s in range(12)]
    moved = [(0, "big", i) for i in range(3)]
    expected = simulate_streaming(params, 4, 1, 0, outer, nodes=2, lrs=lrs,
                                  server_death=(5, moved))
    kept = simulate_streaming(params, 4, 1, 0, outer, nodes=2, lrs=lrs, server_death=(5, []))
    assert not np.array_equal(kept[0]["big"], expected[0]["big"])
    for r in (0, 1):
        final = load_params(tmp_path, "spare", r)
        for n in final:
            np.testing.assert_array_equal(final[n], expected[r][n], err_msg=f"rank {r}: {n}")


# under the node agent: its fragment pipelines share one membership, as in process
@pytest.mark.parametrize("agent", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_restarted_worker_node_joins_streaming_syncs_in_the_round_in_flight(tmp_path,
                                                                              agent):
    """``--min-workers 2 --max-restarts 1``, 3 nodes, streaming topk syncs (H = 4, two
    fragments, an overlap of two steps: a round is always in flight; a float buffer):
    node 2 kills itself at the start of step 4 and is started again; the others wait at
    step 8 until it joined. The death drops one round, the join another (which ones, by
    timing: the survivors' reports say); the round pushed when the join's round lands
    was divided by three and waits for the joiner, which pushes zero markers for it and
    applies it with everyone. Every node ends as the simulation, bit for bit."""
    params, every, fragments, overlap, outer = STREAMING["topk"]
    lrs, period = LRS + LRS, every // fragments
    run = {"tag": "rejoin", "params": params,
           "mode": {"sync_every": every, "fragments": fragments, "overlap": overlap,
                    "outer": outer}}
    result = trainer_launch({"runs": [run], "lrs": lrs, "kill": [2, 4], "wait_at": 8},
                            tmp_path, 3, 2, timeout=240,
                            env={"BPS_TIMEOUT": "60", **({"BPS_NODE_AGENT": "1"} if agent
                                                        else {})},
                            module=__name__,
                            options=("--min-workers", "2", "--max-restarts", "1"))
    assert result.returncode == 0, result.stdout[-6000:]
    assert "joined: worker nodes [0, 1, 2] (membership generation 2)" in result.stdout, \
        result.stdout[-6000:]
    reports = [json.loads((tmp_path / f"report{r}.json").read_text())["rejoin"]
               for r in range(3)]
    assert reports[0]["applied"] == reports[1]["applied"], reports
    # a round pushed after local step s lands after s + overlap: False at step s + 1
    dropped = [step + 1 - overlap for step, applied in enumerate(reports[0]["applied"])
               if not applied]
    assert len(dropped) == 2 and 4 <= dropped[0] < 8 <= dropped[1], reports
    start = reports[2]["start"]
    assert start == dropped[1] + overlap and all(reports[2]["applied"]), reports
    # a round with the buffers (the last fragment's: after steps 4, 8, ...) pushed just
    # before a dropped one may have landed with its buffers' mean dropped: the change
    # came between its parameters and its buffers (node 2 killed right after pushing
    # both, the first on their way; or the join announced between them)
    finals = [load_params(tmp_path, "rejoin", r) for r in range(3)]
    maybe = [d - period for d in dropped if (d - period) % every == 0 and d > period]
    matches = []
    for kept in (c for k in range(len(maybe) + 1) for c in itertools.combinations(maybe, k)):
        expected = simulate_streaming(params, every, fragments, overlap, outer, nodes=3,
                                      lrs=lrs, rejoin=(2, *dropped), dropped_buffers=kept)
        if all(np.array_equal(finals[r][n], expected[r][n]) for r in range(3)
               for n in finals[r]):
            matches.append(kept)
    assert len(matches) == 1, (dropped, matches)
    for final in finals:
        assert set(final) == {*SHAPES, "running"}, final.keys()


def test_bad_overlap_arguments_fail_in_the_constructor_naming_them():
    import torch

    import bps

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bad = [({"sync_every": 0}, "sync_every=0"), ({"sync_every": 2.5}, "sync_every=2.5"),
           ({"sync_every": True}, "sync_every=True"),
           ({"outer": {"optimizer": "average"}}, "needs sync_every > 1"),
           ({"sync_every": 2, "outer": {"optimizer": "adam"}}, "outer['optimizer']='adam'"),
           ({"sync_every": 2, "outer": {"optimizer": "sgd", "beta": 1}}, "'beta'"),
           ({"sync_every": 2, "outer": {"optimizer": "nesterov", "lr": -1}}, "outer['lr']"),
           ({"sync_every": 2, "outer": {"optimizer": "nesterov", "momentum": 1.0}},
            "outer['momentum']"),
           ({"sync_every": 2, "outer": {"optimizer": "average", "lr": 0.5}}, "'average'"),
           ({"sync_every": 2, "outer": "nesterov"}, "outer='nesterov'"),
           ({"sync_every": 2, "compression_params": {"momentum": "nesterov"}},
            "compression_params['mu']"),
           ({"staleness": 2}, "staleness=2"), ({"staleness": -1}, "staleness=-1"),
           ({"staleness": 1.0}, "staleness=1.0"),
           ({"staleness": 1, "sync_every": 4}, "staleness=1 with sync_every=4"),
           ({"sync_every": 4, "fragments": 0}, "fragments=0"),
           ({"sync_every": 4, "fragments": 2.0}, "fragments=2.0"),
           ({"sync_every": 4, "overlap": -1}, "overlap=-1"),
           ({"fragments": 2}, "need sync_every > 1"),
           ({"overlap": 1}, "need sync_every > 1"),
           ({"sync_every": 6, "fragments": 4}, "fragments=4 does not divide sync_every=6"),
           ({"sync_every": 4, "overlap": 5}, "overlap=5 is larger than sync_every=4"),
           ({"sync_every": 4, "fragments": 4}, "fragment 0 without parameters")]
    for kwargs, expected in bad:
        params = kwargs.pop("compression_params", None)
        with pytest.raises((ValueError, TypeError)) as info:
            bps.DistributedTrainer(model, optimizer, params, **kwargs)
        assert expected in str(info.value), (kwargs, str(info.value))


def test_fragments_are_runs_of_rows_of_about_equal_size():
    """Against FRAGMENTS, worked out by hand, and a model whose rows are uneven."""
    import torch

    from bps.core.grad_pipeline import GradTensor
    from bps.modes.streaming import plan_fragments

    tensors = [GradTensor(n, torch.zeros(s), 0) for n, s in SHAPES.items()]
    for count, expected in FRAGMENTS.items():
        plan = plan_fragments(tensors, count)
        names = [[t.name for t in fragment] for fragment in plan]
        assert names == [[n if rows is None else f"{n}[{rows[0]}:{rows[1]}]"
                          for n, rows in fragment] for fragment in expected], names
        for fragment in plan:  # views of the parameters, not copies
            for t in fragment:
                whole = dict(zip(SHAPES, tensors, strict=True))[t.name.split("[")[0]].param
                assert t.param.data_ptr() >= whole.data_ptr()
                assert t.param.untyped_storage().data_ptr() == \
                    whole.untyped_storage().data_ptr()
    # a 0-dim tensor is one row; 1000 + 1 + 3 elements in 2 fragments: the matrix's
    # 10 rows of 100 split 5/5 (middles 50..950 against 502)
    uneven = [GradTensor("m", torch.zeros(10, 100), 0), GradTensor("s", torch.zeros(()), 0),
              GradTensor("v", torch.zeros(3), 0)]
    assert [[(t.name, tuple(t.param.shape)) for t in f] for f in plan_fragments(uneven, 2)] \
        == [[("m[0:5]", (5, 100))], [("m[5:10]", (5, 100)), ("s", ()), ("v", (3,))]]


if __name__ == "__main__":
    # exits without the interpreter's finalization, which costs 0.3-0.5 s of CPU
    # per process after torch (every test's cluster is on the same two cores)
    from bps.server.role import end_process

    end_process(worker_main(json.loads(sys.argv[1]), train))
