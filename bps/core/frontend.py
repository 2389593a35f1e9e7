"""The front-end core: what ``DistributedTrainer`` and the DDP hook share.

A front end turns its framework's events (a trainer's gradient hooks and ``step()``,
DDP's buckets) into pushes; the core owns everything else they have in common:

* the validated ``compression_params`` and the optimizer binding: each parameter's
  optimizer group, the learning rate a chain sees, ``mu`` for Nesterov momentum in the
  chain (taken from the optimizer where not given) and the optimizer's own momentum,
  turned off (one warning, on rank 0);
* the gradient pipeline (:mod:`bps.core.grad_pipeline`) and the runtime it runs on;
* the loss scale of a ``torch.amp.GradScaler`` that the chains follow, the step
  figures (``stats()``), the non-finite error and the pipeline's checkpoint.

Example (what a front end does with it)::

    >>> core = FrontEndCore({"compressor": "onebit", "ef": "vanilla",
    ...                      "momentum": "nesterov"}, optimizer)
    >>> core.build(bps.core.runtime.get(),
    ...            core.grad_tensors(list(model.named_parameters())))
    >>> core.pipeline.push(index, param.grad, param.grad.view(-1))  # as gradients are ready
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from bps.compressors import validate_compression_params
from bps.compressors.base import NonFiniteError
from bps.core import held_momentum
from bps.core.grad_pipeline import GradPipeline, GradTensor, Skipped
from bps.core.loss_scale import LossScale, ScaleReading
from bps.core.shared_pipeline import SharedPipeline, runs_in_agent
from bps.core.trainer_stats import StepStats

log = logging.getLogger("bps")


class NonFiniteGradientError(NonFiniteError):
    """A worker's gradient had inf or NaN entries: the step was applied on no worker.

    ``step()`` (the DDP hook: ``backward()``) raises it on every worker at that step
    (``compression_params['nonfinite'] = 'raise'``, the default), naming the parameter,
    the worker node and the step. Parameters, optimizer, error-feedback and momentum
    buffers, RNG streams and the servers' state are as before the step, so training may
    go on after catching it."""


def grad_view(param: torch.Tensor) -> torch.Tensor:
    """``param.grad`` as a flat view (allocated where missing or strided)."""
    grad = param.grad
    if grad is None or not grad.is_contiguous():
        param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
    return param.grad.view(-1)


def momentum_off(optimizer: torch.optim.Optimizer) -> bool:
    """Turn the optimizer's momentum (and Nesterov flag) off in every group; returns
    whether any group had momentum. Its ``state_dict()`` still reports the values it was
    given, and its ``load_state_dict()`` turns loaded ones off (:mod:`bps.core.held_momentum`)."""
    return held_momentum.hold(optimizer)


class FrontEndCore:
    """What both front ends share (see the module's docstring).

    Args:
        compression_params: docs/compression.md dict (``None``: uncompressed), validated
            here: a bad dict raises ``ValueError`` / ``TypeError`` naming the key.
        optimizer: where the chains read each group's learning rate and, for Nesterov
            momentum without ``mu``, the coefficient; ``None``: a constant rate of 1.
        local_steps: the optimizer takes local steps between syncs (``sync_every > 1``):
            the chain's momentum then acts on the pseudo-gradient, needs its own ``mu``,
            and the optimizer keeps its momentum.
        skip_means, skipped_as: what ``nonfinite: "skip"`` does to a step, for the
            error's message and for the warning that replaces it.
    """

    def __init__(self, compression_params: dict | None,
                 optimizer: torch.optim.Optimizer | None, *, local_steps: bool = False,
                 skip_means: str = "skips such steps", skipped_as: str = "skipped") -> None:
        self.params = validate_compression_params(compression_params)
        self.optimizer = optimizer
        self.skip_means, self.skipped_as = skip_means, skipped_as
        self.runtime = None  # set by build()
        self.pipeline: GradPipeline | None = None
        self.stats = StepStats()
        self.loss_scale = LossScale()  # how the chains follow a GradScaler's scale
        self.scaler: torch.amp.GradScaler | None = None
        self._scale = ScaleReading()  # the scaler's scale this step, read on first use
        self.engine_before: dict = {}  # the engine's counters at this step's start
        # another learning rate for the chains than the optimizer's (a step mode's)
        self.chain_lr_override: Callable[[int], float] | None = None
        self.model: torch.nn.Module | None = None  # the trainer's (periodic buffers, join)
        self.passes = 1  # backward passes per step
        self.samples = 0  # samples this process's training forwards took this step
        self.momentum_moved = self._bind_momentum(local_steps)

    def _bind_momentum(self, local_steps: bool) -> bool:
        """Resolve ``mu``; turn the optimizer's momentum off where the chain's replaces
        it. Returns whether it was on (the warning comes once the rank is known)."""
        params = self.params
        if params["momentum"] is None:
            return False
        if local_steps:
            if params["mu"] is None:
                raise ValueError(
                    "compression_params['momentum'] = 'nesterov' with sync_every > 1 needs "
                    "compression_params['mu']: that momentum acts on the pseudo-gradient, "
                    "and the optimizer keeps its own for the local steps")
            return False
        optimizer_mu = 0.0
        if self.optimizer is not None:
            optimizer_mu = held_momentum.given_momentum(self.optimizer)
        if params["mu"] is None:
            if optimizer_mu == 0.0:
                raise ValueError(
                    "compression_params['momentum'] = 'nesterov' needs a coefficient: set "
                    "compression_params['mu'] or give the optimizer a nonzero momentum")
            params["mu"] = optimizer_mu
        return self.optimizer is not None and momentum_off(self.optimizer)

    def grad_tensors(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[GradTensor]:
        """The parameters, each with its optimizer group (0 without an optimizer);
        ``ValueError`` names a parameter the optimizer does not hold."""
        group_of = {}
        if self.optimizer is not None:
            for index, group in enumerate(self.optimizer.param_groups):
                for p in group["params"]:
                    group_of[id(p)] = index
        tensors = []
        for name, p in named:
            if self.optimizer is not None and id(p) not in group_of:
                raise ValueError(f"parameter {name!r} is not in the optimizer")
            tensors.append(GradTensor(name, p, group_of.get(id(p), 0)))
        return tensors

    def attach(self, runtime) -> None:
        """Bind the runtime: the job seed where ``seed`` is unset, and the warning that
        the optimizer's momentum moved into the chain (rank 0)."""
        self.runtime = runtime
        if self.params["seed"] is None:
            self.params["seed"] = int(runtime.job_seed)
        if self.momentum_moved and runtime.rank == 0:
            log.warning("bps: the optimizer's momentum is turned off; Nesterov momentum "
                        "(mu=%g) runs in the compression chain instead", self.params["mu"])

    def build(self, runtime, tensors: list[GradTensor], *,
              on_step_start: Callable[[], None] | None = None,
              on_step_done: Callable[[], None] | None = None,
              on_error: Callable[[BaseException], None] | None = None,
              grads_shared: bool = False) -> GradPipeline:
        """Plan and declare every parameter's keys on ``runtime``: the pipeline.
        ``grads_shared``: where the node agent runs it, each ``.grad`` becomes a view into
        its buffer in shared memory (:mod:`bps.core.shared_pipeline`)."""
        self.attach(runtime)
        self.pipeline = self.new_pipeline(tensors, on_step_start=on_step_start,
                                          on_step_done=on_step_done, on_error=on_error,
                                          grads_shared=grads_shared)
        return self.pipeline

    def new_pipeline(self, tensors: list[GradTensor], *,
                     on_step_start: Callable[[], None] | None = None,
                     on_step_done: Callable[[], None] | None = None,
                     on_error: Callable[[BaseException], None] | None = None,
                     partition_bytes: int | None = None,
                     grads_shared: bool = False) -> GradPipeline:
        """A pipeline of ``tensors`` on the attached runtime, with the core's learning
        rates and loss scale (a step mode that syncs parameters in fragments holds one
        per fragment; every rank must build them in the same order). ``partition_bytes``:
        its largest partition (default ``BYTEPS_PARTITION_BYTES``). Where the node agent
        can run it (:func:`bps.core.shared_pipeline.runs_in_agent`), a
        :class:`SharedPipeline` of the same interface (``grads_shared``: its install)."""
        runtime = self.runtime

        def step_start() -> None:
            # stats count this step's traffic only; the scale is read once, where first
            # needed (on CUDA a read waits for the device: not in this, the first hook)
            self.engine_before = self.stats.snapshot(runtime.engine)
            self._scale.start(self.scaler)
            if on_step_start is not None:
                on_step_start()

        if runs_in_agent(runtime, self.params, tensors):
            return SharedPipeline(runtime, self.params, tensors, self.pipeline_lr,
                                  lambda: self.loss_scale.change(self.scale),
                                  on_step_start=step_start, on_step_done=on_step_done,
                                  on_error=on_error, partition_bytes=partition_bytes,
                                  install=grads_shared)
        return GradPipeline(runtime, self.params, tensors, self.pipeline_lr,
                            lambda: self.loss_scale.change(self.scale),
                            on_step_start=step_start, on_step_done=on_step_done,
                            on_error=on_error, partition_bytes=partition_bytes)

    @property
    def scale(self) -> float | None:
        """The scaler's scale this step (None without one), read on first use: by the
        reduce thread, as it hands the first gradient to the chains. On a GPU it is read
        on the device's default stream, where ``scaler.update()`` wrote it (the reduce
        thread's own stream is not ordered after it)."""
        device = None if self.pipeline is None else self.pipeline.device
        if device is None or device.type != "cuda":
            return self._scale.value
        with torch.cuda.stream(torch.cuda.default_stream(device)):
            return self._scale.value

    # -- pushes -------------------------------------------------------------------------

    def push_grad(self, index: int, *, absent: bool = False, node_joined: bool = False) -> None:
        """Push parameter ``index``'s ``.grad`` (zeros where it has none or ``absent``; a
        zero marker where ``node_joined``); the average lands in ``.grad`` itself."""
        if self.pipeline.shared_grads:  # .grad is its buffer in shared memory
            self.pipeline.push_param(index, absent=absent, joined=node_joined)
            return
        param = self.pipeline.slots[index].param
        source = None if absent else param.grad
        self.pipeline.push(index, source, grad_view(param), joined=node_joined)

    # -- learning rates ---------------------------------------------------------------

    def own_chain_lr(self, group: int) -> float:
        """The group's learning rate over the GradScaler's scale relative to its first:
        the chains see scaled gradients, so error feedback's ``lr_prev / lr_now`` also
        rescales its residual when the scale changes."""
        lr = 1.0 if self.optimizer is None else float(self.optimizer.param_groups[group]["lr"])
        return lr * self.loss_scale.lr_factor(self.scale)

    def pipeline_lr(self, group: int) -> float:
        """The learning rate the pipeline hands the chains: a step mode's, or our own."""
        if self.chain_lr_override is not None:
            return self.chain_lr_override(group)
        return self.own_chain_lr(group)

    # -- figures, errors --------------------------------------------------------------

    def record(self, before: dict, step: int, raw_bytes: int, wait: float, passes: int,
               nonfinite: bool, samples: int = 0) -> None:
        """Count one step's figures (see ``StepStats.record``)."""
        self.stats.record(self.runtime.engine, before, step, raw_bytes, wait, passes,
                          nonfinite, samples)

    def nonfinite_error(self, skip: Skipped, step: int) -> NonFiniteGradientError | None:
        """The error of a step skipped for a non-finite gradient; None (with a warning)
        where ``nonfinite`` is ``"skip"``."""
        beyond = " (or values beyond float16's range, which fp16 sends)" \
            if self.params["comm_dtype"] == "fp16" else ""
        if skip.node < 0:  # the server's float16 sum of finite pushes
            what = f"the sum over the workers of {skip.what!r} overflows float16"
        else:
            what = (f"the gradient of {skip.what!r} on worker node {skip.node} has inf "
                    f"or NaN entries{beyond}")
        message = f"step {step}: {what}; the step was applied on no worker"
        if self.params["nonfinite"] == "raise":
            return NonFiniteGradientError(
                f"{message} (compression_params['nonfinite'] = 'skip' {self.skip_means})")
        log.warning("bps: %s: %s (compression_params['nonfinite'] = 'skip')", message,
                    self.skipped_as)
        return None

    # -- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """``{"rank", "scale"}`` and the pipeline's :meth:`pipeline_state`: the scaler's
        first and last scales, the counters, local momentum and chains (a core without
        a pipeline of its own, whose mode holds them: rank and scale only)."""
        state = {"rank": self.runtime.rank, "scale": self.loss_scale.state()}
        if self.pipeline is not None:
            state.update(self.pipeline_state(self.pipeline))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s, on the same rank of a cluster of the same shape."""
        if state.get("rank") != self.runtime.rank:
            raise ValueError(f"state_dict was saved by rank {state.get('rank')}, "
                             f"this is rank {self.runtime.rank}")
        if self.pipeline is not None:
            self.load_pipeline_state(self.pipeline, state)
        self.loss_scale.load(state.get("scale", (None, None)))

    def pipeline_state(self, pipe: GradPipeline) -> dict:
        """``{"step", "wire_step", "local_momentum", "engine"}`` of ``pipe``: its
        counters, the local momentum by parameter name, and (local rank 0) every worker
        and server chain of its compressed keys, by position (key numbers depend on
        what else the process declared first)."""
        rt = self.runtime
        engine = None
        if rt.engine is not None:
            full = rt.engine.state_dict()
            keys = pipe.compressed_keys()
            engine = {side: {i: full[side][k] for i, k in enumerate(keys) if k in full[side]}
                      for side in ("worker", "server")}
        return {"step": pipe.step, "wire_step": pipe.wire_step,
                "local_momentum": pipe.momentum_state(), "engine": engine}

    def load_pipeline_state(self, pipe: GradPipeline, state: dict) -> None:
        """Restore :meth:`pipeline_state`'s into ``pipe``."""
        rt = self.runtime
        pipe.load_momentum_state(state["local_momentum"])
        if rt.engine is not None:
            saved = state["engine"]
            if saved is None:
                raise ValueError("state_dict has no engine state (saved on another local rank?)")
            keys = pipe.compressed_keys()
            if any(i >= len(keys) for side in saved.values() for i in side):
                raise ValueError("state_dict holds chains of more compressed keys than "
                                 f"this model has ({len(keys)})")
            rt.engine.load_state_dict({side: {keys[i]: chain for i, chain in saved[side].items()}
                                       for side in ("worker", "server")})
        pipe.step = int(state["step"])
        pipe.wire_step = int(state.get("wire_step", pipe.step))

    def close(self) -> None:
        """Stop the pipeline's threads."""
        if self.pipeline is not None:
            self.pipeline.close()
