"""Compressed Adam in numpy (bps/core/compressed_adam.py, docs/trainer.md): the reference
the cluster runs of tests/core/test_compressed_adam.py must match bit for bit.

The toy of tests/harness/trainer_job.py (node r's gradient ``w - t_r``, masked where
``live`` is zero), 2 worker nodes of one rank, ``comm_dtype`` fp32: ``big`` is
compressed after the freeze (partitions of ``PARTITION`` elements), ``small`` and
``bias`` always travel raw. Every operation is a float32 one, rounded on its own.
"""

from __future__ import annotations

import math

import numpy as np

from tests.harness.trainer_job import PARTITION, initial_params, reference_codec, targets

f32 = np.float32


def live_mask(shapes: dict) -> dict:
    """1 where the toy's gradient may be nonzero; ``big``'s first row and ``bias[0]`` 0."""
    live = {n: np.ones(s, f32) for n, s in shapes.items()}
    live["big"][0] = 0
    live["bias"][0] = 0
    return live


def toy_grad(w: np.ndarray, goal: np.ndarray, live: np.ndarray) -> np.ndarray:
    """``(w - goal) * live``, as the worker's backward computes it."""
    return ((w - goal).astype(f32) * live).astype(f32)


def descend(x, m, v, t: int, t2: int, lr: float, b1: float, b2: float, eps: float):
    denom = (np.sqrt(v).astype(f32) * f32(1 / math.sqrt(1 - b2 ** t2))).astype(f32)
    denom = (denom + f32(eps)).astype(f32)
    step = ((m / denom).astype(f32) * f32(lr / (1 - b1 ** t))).astype(f32)
    return (x - step).astype(f32)


def simulate(params: dict, nodes: int, lrs: list[float], shapes: dict, *, betas=(0.9, 0.999),
             eps: float = 1e-8, wd: float = 0.0, decoupled: bool = True,
             members: list[list[int] | None] | None = None,
             fresh_workers: dict[int, int] | None = None,
             fresh_servers: dict[int, list[int]] | None = None) -> dict:
    """The parameters after ``len(lrs)`` steps of compressed Adam with ``params``
    (``freeze_step``, ``compressor``, ``ef``) from rank 0's initial parameters.
    ``members[step]``: the nodes whose gradients make that step (divided by their
    number), or None where it is dropped everywhere (nothing changes; Adam's step count
    and the freeze count applied steps). ``fresh_workers[node] = step``: that node
    joined at that step, its chains' error from zero there (Adam's state is everyone's).
    ``fresh_servers[step]``: the partitions of ``big`` whose server chains start anew at
    that step (their server was replaced)."""
    from tests.harness.reference_compressors import RefChain

    b1, b2 = betas
    freeze = params["freeze_step"]
    w = initial_params(0, shapes)
    live = live_mask(shapes)
    goals = [targets(r, shapes) for r in range(nodes)]
    m = {n: np.zeros(s, f32) for n, s in shapes.items()}
    v = {n: np.zeros(s, f32) for n, s in shapes.items()}
    numel = int(np.prod(shapes["big"]))
    parts = [(o, min(PARTITION, numel - o)) for o in range(0, numel, PARTITION)]
    ef = params.get("ef") == "vanilla"
    def chains() -> list:
        return [RefChain(*reference_codec(params, n), n, "float32", ef, None) for _, n in parts]

    workers = [chains() for _ in range(nodes)]
    servers = [RefChain(*reference_codec(params, n), n, "float32", ef, None) for _, n in parts]
    applied = 0
    for step, lr in enumerate(lrs):
        for node, joined_at in (fresh_workers or {}).items():
            if step == joined_at:
                workers[node] = chains()
        for i in (fresh_servers or {}).get(step, []):
            servers[i] = chains()[i]
        present = list(range(nodes)) if members is None else members[step]
        if present is None:
            continue
        t = applied + 1
        frozen = applied >= freeze
        applied += 1
        shares = {}
        for r in present:
            share = {}
            for n in shapes:
                g = toy_grad(w[n], goals[r][n], live[n])
                if frozen:  # this worker's momentum, with Adam's L2 term
                    if wd and not decoupled:
                        g = (g + (w[n] * f32(wd)).astype(f32)).astype(f32)
                    g = ((g * f32(1 - b1)).astype(f32) + (m[n] * f32(b1)).astype(f32))
                share[n] = (g.astype(f32) / f32(len(present))).astype(f32)
            shares[r] = share
        avg = {}
        for n in shapes:
            if n == "big" and frozen:
                big = np.zeros(numel, f32)
                for i, (offset, length) in enumerate(parts):
                    summed = np.zeros(length, f32)
                    for r in present:
                        workers[r][i].set_lr(1.0)
                        piece = shares[r]["big"].reshape(-1)[offset:offset + length]
                        decoded = workers[r][i].decode(workers[r][i].compress(piece))
                        summed = (summed + decoded.astype(f32)).astype(f32)
                    servers[i].set_lr(1.0)
                    big[offset:offset + length] = servers[i].decode(servers[i].compress(summed))
                avg[n] = big.reshape(shapes[n])
            else:
                summed = np.zeros(shapes[n], f32)
                for r in present:
                    summed = (summed + shares[r][n]).astype(f32)
                avg[n] = summed
        for n in shapes:
            x = w[n]
            if frozen:
                m[n] = np.where(v[n] > 0, avg[n], f32(0)).astype(f32)
                if wd and decoupled:
                    x = (x * f32(1 - lr * wd)).astype(f32)
                w[n] = descend(x, m[n], v[n], t, freeze, lr, b1, b2, eps)
                continue
            g = avg[n]
            if wd:
                if decoupled:
                    x = (x * f32(1 - lr * wd)).astype(f32)
                else:
                    g = (g + (x * f32(wd)).astype(f32)).astype(f32)
            m[n] = ((m[n] * f32(b1)).astype(f32) + (g * f32(1 - b1)).astype(f32)).astype(f32)
            gg = (g * g).astype(f32)
            v[n] = ((v[n] * f32(b2)).astype(f32) + (gg * f32(1 - b2)).astype(f32)).astype(f32)
            w[n] = descend(x, m[n], v[n], t, t, lr, b1, b2, eps)
    return w
