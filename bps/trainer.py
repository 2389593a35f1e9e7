"""DistributedTrainer: data-parallel training through the bps parameter servers.

One training step (docs/architecture.md): as soon as a parameter's gradient is ready during
backward, its hook divides it by the total number of workers and hands it to a
background thread that reduces it to local rank 0 (fp16 where on), where it is cut
into partitions and pushed (compressed where configured) to the servers; a second
thread waits for the pulled aggregates, broadcasts them within the node and writes
them into ``.grad``. ``step()`` waits only for what is still in flight and then
calls the optimizer.

Usage (every worker process runs the same script under ``bpslaunch``)::

    >>> import bps, torch
    >>> bps.init()
    >>> model = torch.nn.Linear(784, 10)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> trainer = bps.DistributedTrainer(model, optimizer, {
    ...     "compressor": "onebit", "scaling": True, "ef": "vanilla", "momentum": "nesterov"})
    >>> for x, y in loader:
    ...     trainer.zero_grad()
    ...     torch.nn.functional.cross_entropy(model(x), y).backward()
    ...     trainer.step()
    >>> trainer.stats()["compression_ratio"]

The trainer is a front end: what it shares with the DDP hook :mod:`bps.ddp` (the
pipeline, the optimizer binding, figures, loss scale, non-finite errors, checkpoints)
is :class:`bps.core.frontend.FrontEndCore`; what ``step()`` does is a step mode of
:mod:`bps.modes` (synchronous, ``staleness=1`` or ``sync_every=H``); uneven inputs are
:mod:`bps.core.join`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from bps.common.config import COMM_DTYPES
from bps.compressors.warm import load_soon
from bps.core import runtime as bps_runtime
from bps.core.frontend import FrontEndCore, NonFiniteGradientError
from bps.core.model_sync import ModelMismatchError, broadcast_model, check_same_model
from bps.core.rejoin import (
    front_end_state,
    join_job,
    load_model_state,
    load_pipeline_state,
    publish_if_joined,
)
from bps.modes import choose
from bps.modes.compressed_adam import validate_compressed_adam
from bps.modes.delayed import validate_staleness
from bps.modes.periodic import validate_sync_every
from bps.modes.streaming import plan_fragments, validate_streaming

__all__ = ["DistributedTrainer", "ModelMismatchError", "NonFiniteGradientError"]

log = logging.getLogger("bps")


class DistributedTrainer:
    """Wraps a model and its optimizer for data-parallel training with bps.

    Args:
        model: the module; rank 0's parameters and buffers are copied to every rank.
        optimizer: a ``torch.optim`` optimizer over the model's parameters.
        compression_params: docs/compression.md dict (``None``: uncompressed). Validated here, on
            every rank, before any communication: a bad dict raises ``ValueError`` /
            ``TypeError`` naming the key.
        backward_passes_per_step: ``backward()`` calls per ``step()`` (gradient
            accumulation, Horovod's option of that name): gradients add up in ``.grad``
            as in plain PyTorch, and each partition is pushed once, during the last pass.
        sync_every: ``H > 1``: periodic averaging (:mod:`bps.modes.periodic`): ``H`` local
            optimizer steps, then the pseudo-gradient travels and ``outer`` applies it.
        outer: the outer update of periodic averaging (``None``: the plain mean; see
            :func:`bps.modes.periodic.validate_sync_every`).
        staleness: 1: each ``step()`` applies the aggregate of the step before, whose
            push and pull overlap this step's forward and backward (:mod:`bps.modes.delayed`).
        fragments: with ``sync_every=H``: sync ``1/fragments`` of the parameters every
            ``H / fragments`` local steps instead of all of them every ``H``
            (:mod:`bps.modes.streaming`).
        overlap: with ``sync_every``: each sync's aggregate lands ``overlap`` local steps
            after its push, so its push and pull run while those steps compute.

    Each gradient is pushed once per step. Every rank saves its own ``state_dict()``
    (error-feedback state is per node). docs/trainer.md shows the training loops:
    accumulation, mixed precision with a GradScaler, non-finite gradients, ``join()``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 compression_params: dict | None = None,
                 backward_passes_per_step: int = 1, *, sync_every: int = 1,
                 outer: dict | None = None, staleness: int = 0, fragments: int = 1,
                 overlap: int = 0) -> None:
        outer_spec = validate_sync_every(sync_every, outer)
        staleness = validate_staleness(staleness, sync_every)
        streaming = validate_streaming(sync_every, fragments, overlap)
        if (isinstance(backward_passes_per_step, bool)
                or not isinstance(backward_passes_per_step, int)
                or backward_passes_per_step < 1):
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} is "
                             "invalid: expected an int >= 1")
        core = FrontEndCore(compression_params, optimizer, local_steps=sync_every > 1)
        validate_compressed_adam(core.params, optimizer, staleness=staleness,
                                 sync_every=sync_every, fragments=fragments, overlap=overlap)
        if not any(p.is_cuda for p in model.parameters()):
            # numba starts while the model is checked and broadcast (network waits)
            load_soon(core.params, getattr(torch, COMM_DTYPES[core.params["comm_dtype"]]))
        self.model, self.optimizer, self.params = model, optimizer, core.params
        core.model, core.passes = model, backward_passes_per_step
        seen, named = set(), []
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        tensors = core.grad_tensors(named)
        plan = plan_fragments(tensors, fragments) if streaming else None
        rt = bps_runtime.get()
        joined = None
        if rt.joining:  # a node started after the job began: the state of one present
            joined = join_job(rt)
            rt.skip_keys_to(joined["first_key"])
        else:
            check_same_model(rt, model)
            broadcast_model(rt, model)
        self._first_key = rt.next_key()  # the mode's keys: a joiner takes the same
        self._steps = 0  # step() calls: a joiner takes the count of the node it joins from
        self.core = core
        self.mode = choose(core, rt, tensors, staleness=staleness, sync_every=sync_every,
                           outer=outer_spec, fragments=plan, overlap=overlap)
        if joined is not None:
            self._load_joined(joined)
        self._seen = [0] * len(tensors)  # backward passes per parameter this step
        self._in_step = False  # inside step(): the optimizer steps as the trainer says
        self._optimizer_hook = optimizer.register_step_pre_hook(self._optimizer_stepping)
        self._sample_hook = model.register_forward_pre_hook(self._count_samples,
                                                            with_kwargs=True)
        self._hooks = [
            slot.param.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, slot in enumerate(core.pipeline.slots)
        ] if self.mode.pushes_during_backward else []

    # -- the gradient hooks -----------------------------------------------------------

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._ready(index)
        return hook

    def _ready(self, index: int) -> None:
        """A backward pass finished this gradient; the last pass of the step pushes it."""
        self._seen[index] += 1
        if self._seen[index] > self.core.passes or self.core.pipeline.pushed(index):
            raise RuntimeError(self._extra_backward_message(index))
        if self._seen[index] == self.core.passes:
            self.mode.push(index)

    def _extra_backward_message(self, index: int) -> str:
        """Why a gradient became ready once more than a step takes: what the loop did."""
        name = self.core.pipeline.slots[index].name
        passes = self.core.passes
        passes_text = f"{passes} backward() pass" + ("es" if passes > 1 else "")
        return (f"backward() ran again without trainer.step() (gradient of {name!r} became "
                f"ready {self._seen[index]} times in one step): this trainer takes "
                f"{passes_text} per trainer.step() (backward_passes_per_step={passes}; "
                "set it to accumulate gradients over several passes)")

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args: tuple,
                            kwargs: dict) -> None:
        """The optimizer's step pre-hook: a step outside ``trainer.step()`` (DDP's habit)
        raises before it changes any parameter."""
        if not self._in_step:
            raise RuntimeError(
                "optimizer.step() was called outside trainer.step(): the gradients in .grad "
                "are not averaged over the workers (yet); call trainer.step() instead of "
                "optimizer.step(): it waits for the averaged gradients, then steps the "
                "optimizer (no parameter was changed)")

    def _count_samples(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """A training forward (grad on, module in train mode) adds the first dimension of
        its first tensor input (an argument, or a value of a dict, list or tuple one) to
        this step's samples."""
        if not (module.training and torch.is_grad_enabled()):
            return
        for arg in (*args, *kwargs.values()):
            inner = arg.values() if isinstance(arg, dict) else \
                arg if isinstance(arg, (list, tuple)) else (arg,)
            first = next((t for t in inner if isinstance(t, torch.Tensor) and t.dim() > 0),
                         None)
            if first is not None:
                self.core.samples += int(first.shape[0])
                return

    # -- steps ------------------------------------------------------------------------

    def synchronize(self) -> bool:
        """Wait until every gradient of this step is averaged and written into ``.grad``.

        Returns whether the step is applied: False where a worker's gradient had inf or
        NaN entries (every worker returns False for the same step), and then ``.grad``
        holds NaN and every chain, on workers and servers, is back to its state before
        the step. ``step()`` calls it; call it yourself to clip gradients before."""
        return self.mode.synchronize()

    @property
    def step_count(self) -> int:
        """Steps taken so far, applied or skipped. A node that joined a running job
        (docs/runtime.md, "Elastic membership") starts from the count of the node it
        took the state from: ``for step in range(trainer.step_count, total)`` runs the
        same steps on every node."""
        return self._steps

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """Wait for the averaged gradients, then run ``optimizer.step()``; returns whether
        the step was applied.

        ``scaler``: a ``torch.amp.GradScaler`` whose ``scale(loss)`` the backward passes
        used; ``scaler.step`` unscales the aggregated gradient and skips the update where
        it is not finite (on every rank alike), then ``scaler.update()``. A step with a
        non-finite gradient on any worker is skipped everywhere; without a scaler,
        ``compression_params['nonfinite']`` says whether that raises
        :class:`NonFiniteGradientError` (``"raise"``, the default) or logs a warning."""
        self._in_step = True
        rt = self.core.runtime
        before = rt.members
        try:
            applied = self.mode.step(scaler)
        finally:
            self._steps += 1
            self._in_step = False
            self._seen = [0] * len(self._seen)
            self.core.samples = 0
        if rt.members != before:  # worker nodes joined: the lowest one present sends them
            publish_if_joined(rt, before, self._join_state)
        return applied

    def _join_state(self) -> dict:
        """What a node joining the job loads (:mod:`bps.core.rejoin`); not the chains'
        error feedback and momentum, which start at zero on the joiner."""
        return {**front_end_state(self.core, self.model, self.optimizer),
                "steps": self._steps, "mode": self.mode.join_state(),
                "first_key": self._first_key, "next_key": self.core.runtime.next_key()}

    def _load_joined(self, state: dict) -> None:
        """Load what the node that sent the state had (:meth:`_join_state`)."""
        load_model_state(state, self.model, self.optimizer)
        self._steps = int(state["steps"])
        load_pipeline_state(self.core, state)
        self.mode.load_join_state(state["mode"])
        self.core.runtime.skip_keys_to(state["next_key"])

    def join(self) -> contextlib.AbstractContextManager:
        """Train on uneven inputs (DDP's ``Join``): a worker whose loop inside the block
        ends joins, and takes part in the steps the others still run with a zero
        contribution, until every worker has joined; then all leave with the model of
        the one that stepped last (:mod:`bps.core.join`).

        Example::

            >>> with trainer.join():
            ...     for x, y in my_shard:           # shards of different lengths
            ...         trainer.zero_grad()
            ...         loss_fn(model(x), y).backward()
            ...         trainer.step()
        """
        if not self.mode.supports_join:
            raise NotImplementedError("trainer.join() is not supported with sync_every > 1, "
                                      "staleness=1 or compressed Adam (freeze_step)")
        if self.core.pipeline.started or any(self._seen):
            raise RuntimeError("trainer.join() must be entered between steps")
        return self._joined(self.mode.uneven.run(self.step))

    @contextlib.contextmanager
    def _joined(self, inner: contextlib.AbstractContextManager) -> Iterator[DistributedTrainer]:
        with inner:
            yield self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``; with ``BPS_NODE_AGENT=1``, ``.grad`` is a view into
        shared memory, filled with zeros instead (docs/runtime.md)."""
        pipe = self.core.pipeline
        if pipe is not None and pipe.shared_grads:
            pipe.zero_grads(set_to_none)
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def stats(self) -> dict:
        """Figures of the last step, on local rank 0 (other local ranks report zero bytes
        and ``compression_ratio`` None).

        ``bytes_pushed`` / ``bytes_pulled``: payload bytes this node sent to and received
        from the servers; ``raw_bytes``: what one direction would carry uncompressed in
        float32; ``compression_ratio``: ``2 * raw_bytes / (pushed + pulled)``;
        ``compress_time``: seconds spent compressing and decompressing on this node;
        ``comm_time``: wall seconds during which at least one push was in flight;
        ``server_time``: seconds the servers spent decoding, summing and re-encoding this
        node's partitions (summed over partitions); ``wait_time``: seconds ``step()``
        blocked; ``backward_passes``: backward passes per step (each partition travels
        once per step however many passes);
        ``samples``: the node's samples in the step (the first dimension of the model's
        first tensor input, summed over this process's training forwards, times the
        local ranks); ``bytes_per_sample``: ``(pushed + pulled) / samples``; ``skipped``:
        a non-finite gradient (or worker nodes leaving the job, ``BPS_MIN_WORKERS``) made
        every worker skip the step. ``totals`` sums the byte
        counts, the steps and the skipped steps so far.
        """
        return self.core.stats.report()

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: step counters, optimizer state, local
        momentum buffers, the mode's state and (on local rank 0) every worker and server
        compressor's error, momentum and RNG state. Each rank saves its own. With
        ``staleness=1`` it first waits for the aggregate in flight, which it then holds."""
        self.mode.before_checkpoint()
        return {**self.core.state_dict(), "optimizer": self.optimizer.state_dict(),
                "mode": self.mode.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (on the same rank of the same cluster shape)."""
        if state.get("rank") != self.core.runtime.rank:
            raise ValueError(f"state_dict was saved by rank {state.get('rank')}, "
                             f"this is rank {self.core.runtime.rank}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.core.load_state_dict(state)
        self.mode.load_state_dict(state.get("mode"))

    def close(self) -> None:
        """Stop the background threads and remove the gradient hooks (with
        ``staleness=1``, after the aggregate in flight arrived; it is not applied)."""
        self.mode.close()
        for hook in self._hooks:
            hook.remove()
        self._sample_hook.remove()
        self._optimizer_hook.remove()
        self.core.close()
