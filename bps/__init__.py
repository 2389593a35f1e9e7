"""bps: parameter-server gradient compression for PyTorch data-parallel training.

Usage (run under ``bpslaunch local --workers 2 --servers 1 -- python train.py``)::

    import bps
    bps.init()
    trainer = bps.DistributedTrainer(model, optimizer, {"compressor": "onebit", "ef": "vanilla"})
    for x, y in loader:
        trainer.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step()
    bps.shutdown()
"""

from __future__ import annotations

import importlib


def _rt():
    # Imported on first use so that `import bps.common.config` in servers stays light.
    return importlib.import_module("bps.core.runtime")


def init() -> None:
    """Join the cluster that the environment (set by ``bpslaunch``) describes.

    Raises :class:`bps.common.env.EnvError` naming the missing or malformed variable when the
    process was not started by ``bpslaunch`` (there is no implicit single-process mode).
    """
    _rt().init()


def shutdown() -> None:
    """Wait for every worker, then close all connections (safe to call twice)."""
    _rt().shutdown()


def rank() -> int:
    """Global rank: ``worker_id * local_size + local_rank``."""
    return _rt().get().rank


def size() -> int:
    """Total number of worker processes: ``num_worker_nodes * local_size``."""
    return _rt().get().size


def local_rank() -> int:
    """Rank of this process within its worker node."""
    return _rt().get().local_rank


def local_size() -> int:
    """Number of worker processes on this node."""
    return _rt().get().local_size


def __getattr__(name: str):
    if name == "ddp":  # the DDP communication hook: bps.ddp.HookState, bps.ddp.ps_hook
        return importlib.import_module("bps.ddp")
    if name == "ElasticSampler":
        from bps.sampler import ElasticSampler

        return ElasticSampler
    if name in ("DistributedTrainer", "NonFiniteGradientError"):
        from bps import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'bps' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with those it loads lazily (``DistributedTrainer``, ``ddp`` ...),
    without loading them."""
    return sorted({*globals(), *__all__, "ddp"})


__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "DistributedTrainer",
           "NonFiniteGradientError", "ElasticSampler"]
