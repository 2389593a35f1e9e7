"""Lightning's ``DDPStrategy`` with the bps hook, on any device.

Lightning registers ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` only where
the root device is CUDA; on CPUs its DDP would run plain allreduce. :class:`RegisterHook`
registers the same hook and state where Lightning did not, and hands the state the
optimizer (so the chains follow the learning rate). One line in the ``Trainer``::

    >>> import bps, bps.ddp, bps.lightning
    >>> from lightning.pytorch.strategies import DDPStrategy
    >>> state = bps.ddp.HookState({"compressor": "topk", "k": 0.01, "ef": "vanilla"})
    >>> trainer = L.Trainer(strategy=DDPStrategy(ddp_comm_hook=bps.ddp.ps_hook,
    ...                                          ddp_comm_state=state),
    ...                     callbacks=[bps.lightning.RegisterHook(state)])

Without it, on CPUs, the first ``optimizer.step()`` raises (the hook never ran) and
``state.close()`` warns.
"""

from __future__ import annotations

import lightning.pytorch as pl

import bps.ddp

__all__ = ["RegisterHook"]


class RegisterHook(pl.Callback):
    """At the start of training: the state's optimizer is the Trainer's first (where it
    has none), and on any device but CUDA the hook is registered on Lightning's DDP
    model (on CUDA, ``DDPStrategy(ddp_comm_hook=...)`` did it).

    Args:
        state: the ``bps.ddp.HookState`` given to ``DDPStrategy(ddp_comm_state=...)``.
    """

    def __init__(self, state: bps.ddp.HookState) -> None:
        self.state = state

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.state.optimizer is None and trainer.optimizers:
            self.state.optimizer = trainer.optimizers[0]
        if trainer.strategy.root_device.type != "cuda":  # where Lightning registers none
            trainer.strategy.model.register_comm_hook(self.state, bps.ddp.ps_hook)
