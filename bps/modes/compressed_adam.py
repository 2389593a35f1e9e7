"""Compressed Adam steps: ``compression_params["freeze_step"]`` with Adam or AdamW.

Synchronous steps (:mod:`bps.modes.synchronous`) whose pushes and updates are those
of :mod:`bps.core.compressed_adam`: before the freeze each gradient travels
uncompressed and ``optimizer.step()`` takes a plain Adam step on the average; after
it each gradient is turned into this worker's Adam momentum as backward produces it,
the momentum travels through the compressor chain, and ``optimizer.step()`` moves the
parameters by the average over the frozen variance::

    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    >>> trainer = bps.DistributedTrainer(model, optimizer, {
    ...     "compressor": "onebit", "ef": "vanilla", "freeze_step": 60})

``staleness=1`` and ``sync_every > 1`` are refused (:func:`validate_compressed_adam`):
the momentum is Adam's, one step's, and a local step has none to send.
"""

from __future__ import annotations

import torch

from bps.core.compressed_adam import AdamCoupling, check_adam
from bps.core.frontend import FrontEndCore, grad_view
from bps.modes.synchronous import SynchronousSteps


def validate_compressed_adam(params: dict, optimizer: torch.optim.Optimizer | None, *,
                             staleness: int, sync_every: int, fragments: int,
                             overlap: int) -> None:
    """With ``freeze_step`` in the validated ``params``: the optimizer must be Adam or
    AdamW and the steps synchronous; raises ``ValueError``/``TypeError`` naming what
    does not go (before anything is sent)."""
    if params.get("freeze_step") is None:
        return
    for name, value, default in (("staleness", staleness, 0), ("sync_every", sync_every, 1),
                                 ("fragments", fragments, 1), ("overlap", overlap, 0)):
        if value != default:
            raise ValueError(
                f"{name}={value!r} does not go with compression_params['freeze_step'] "
                "(compressed Adam): the momentum that travels is Adam's, one step's; "
                "for local steps with an Adam inner optimizer use sync_every without "
                "freeze_step")
    check_adam(optimizer)


class CompressedAdamSteps(SynchronousSteps):
    """Synchronous steps of compressed Adam (see the module); no ``trainer.join()``."""

    supports_join = False
    name = "compressed Adam (freeze_step)"

    def __init__(self, core: FrontEndCore) -> None:
        super().__init__(core)
        # error feedback carries momentum, not a learning-rate-scaled gradient
        core.chain_lr_override = lambda group: 1.0
        self.adam = AdamCoupling(core.optimizer, core.params["freeze_step"],
                                 [slot.param for slot in core.pipeline.slots])

    def push(self, index: int) -> None:
        """A gradient is final: after the freeze it becomes this worker's momentum, then
        it is pushed."""
        pipe = self.core.pipeline
        param = pipe.slots[index].param
        flat = grad_view(param)
        if self.adam.frozen(pipe.step):
            self.adam.local_momentum(param, flat)
        pipe.push(index, param.grad, flat)

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        if scaler is not None:
            raise ValueError("compressed Adam (compression_params['freeze_step']) takes no "
                             "GradScaler: after the freeze .grad holds Adam's momentum")
        self.adam.arm(self.adam.frozen(self.core.pipeline.step))
        try:
            return super().step(None)
        finally:
            self.adam.disarm()

    def close(self) -> None:
        self.adam.close()
        super().close()
