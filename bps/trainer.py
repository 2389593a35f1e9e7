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

The per-parameter pipeline (partition -> push -> pull -> broadcast) is
:mod:`bps.grad_pipeline`, shared with the DDP hook :mod:`bps.ddp`; what goes where is
planned by :mod:`bps.worker.planning`; the model is checked and
copied from rank 0 by :mod:`bps.model_sync`; the figures come from
:mod:`bps.trainer_stats`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time

import torch

from bps import runtime as bps_runtime
from bps.common.config import validate_compression_params
from bps.compressors.base import NonFiniteError
from bps.grad_pipeline import (  # noqa: F401 - _BucketSlice, _forward: re-exported
    COMM_DTYPES,
    GradPipeline,
    GradTensor,
    _BucketSlice,
    _forward,
)
from bps.loss_scale import LossScale
from bps.model_sync import (
    ModelMismatchError,
    broadcast_model,
    broadcast_model_in_node,
    check_same_model,
)
from bps.periodic import PeriodicAveraging, validate_sync_every
from bps.stale import DelayedUpdate, validate_staleness
from bps.trainer_stats import StepStats
from bps.worker.engine import Skipped

__all__ = ["DistributedTrainer", "ModelMismatchError", "NonFiniteGradientError"]

log = logging.getLogger("bps")


class NonFiniteGradientError(NonFiniteError):
    """A worker's gradient had inf or NaN entries: the step was applied on no worker.

    ``step()`` raises it on every worker at that step (``compression_params['nonfinite']
    = 'raise'``, the default), naming the parameter, the worker node and the step.
    Parameters, optimizer, error-feedback and momentum buffers, RNG streams and the
    servers' state are as before the step, so training may go on after catching it."""


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
        sync_every: ``H > 1``: periodic averaging (:mod:`bps.periodic`): ``H`` local
            optimizer steps, then the pseudo-gradient travels and ``outer`` applies it.
        outer: the outer update of periodic averaging (``None``: the plain mean; see
            :func:`bps.periodic.validate_sync_every`).
        staleness: 1: each ``step()`` applies the aggregate of the step before, whose
            push and pull overlap this step's forward and backward (:mod:`bps.stale`).

    Each gradient is pushed once per step. Every rank saves its own ``state_dict()``
    (error-feedback state is per node). docs/trainer.md shows the training loops:
    accumulation, mixed precision with a GradScaler, non-finite gradients, ``join()``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 compression_params: dict | None = None,
                 backward_passes_per_step: int = 1, *, sync_every: int = 1,
                 outer: dict | None = None, staleness: int = 0) -> None:
        outer_spec = validate_sync_every(sync_every, outer)
        staleness = validate_staleness(staleness, sync_every)
        if (isinstance(backward_passes_per_step, bool)
                or not isinstance(backward_passes_per_step, int)
                or backward_passes_per_step < 1):
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} is "
                             "invalid: expected an int >= 1")
        self._passes = backward_passes_per_step
        self._periodic: PeriodicAveraging | None = None
        self._delayed: DelayedUpdate | None = None
        self._sync_every = sync_every
        params = validate_compression_params(compression_params)
        if sync_every > 1 and params["momentum"] is not None and params["mu"] is None:
            raise ValueError(
                "compression_params['momentum'] = 'nesterov' with sync_every > 1 needs "
                "compression_params['mu']: that momentum acts on the pseudo-gradient, "
                "and the optimizer keeps its own for the local steps")
        self._rt = bps_runtime.get()
        if (outer_spec is not None and outer_spec.nesterov and sync_every < 16
                and not {"lr", "momentum"} & set(outer or {}) and self._rt.rank == 0):
            log.warning("bps: outer Nesterov at its defaults (lr %g, momentum %g, DiLoCo's, "
                        "for hundreds of local steps) overshoots with sync_every=%d; "
                        "lr 1.0 and momentum 0.5 match the plain mean there "
                        "(docs/trainer.md, periodic averaging)", outer_spec.lr,
                        outer_spec.momentum, sync_every)
        self.model = model
        self.optimizer = optimizer
        self._fill_run_defaults(params)
        self.params = params
        self._compress = params["compressor"] is not None
        # intra-node reduction and uncompressed traffic (docs/compression.md, comm_dtype)
        self._wire_dtype = COMM_DTYPES[params["comm_dtype"]]
        self._synced: bool | None = None  # this step's outcome, once synchronize() ran
        self._skip: Skipped | None = None  # why this step is skipped (None: applied)
        self._scaler = None  # the GradScaler that step() was given
        self._loss_scale = LossScale()  # how the chains follow its scale
        self._scale: float | None = None  # its scale this step, read at the first push
        self._joining = False  # inside join(): each step counts the nodes with data
        self._joined = False  # this worker ran out of data: it pushes zero markers
        self._join_future: concurrent.futures.Future | None = None
        self._active: list[int] = []  # the nodes with data this step (in join())
        self._last_active = 0  # the lowest of them in the last step any node had data
        # several local ranks in join(), known at the step's first push: which local
        # ranks have data this step (1.0 each), the chain learning rates of the lowest
        # of them (None: none has), that rank in the last step the node had any, and
        # the channel that tells them apart
        self._local_active: torch.Tensor | None = None
        self._node_lrs: list[float] | None = None
        self._last_local_active = 0
        self._join_ch = None
        self._stats = StepStats()
        self._engine_before: dict = {}
        self._tracer = self._rt.tracer  # bps.common.trace: None unless BYTEPS_TRACE_ON=1
        self._last_step_end_ns: int | None = None
        self._samples = 0  # samples this process's training forwards took this step
        self._in_step = False  # inside step(): the optimizer steps as the trainer says
        self._outside_steps = 0  # optimizer.step() calls outside step() since the last
        self._optimizer_hook = optimizer.register_step_post_hook(self._optimizer_stepped)

        check_same_model(self._rt, model)
        broadcast_model(self._rt, model)
        # partition -> push -> pull -> broadcast: :mod:`bps.grad_pipeline`
        self._pipe = GradPipeline(self._rt, params, self._tensors(), self._chain_lr,
                                  self._scale_change, on_step_start=self._step_start)
        self._seen = [0] * len(self._pipe.slots)  # backward passes per parameter this step
        self._join_key = self._declare_join_key()
        if outer_spec is not None:
            self._periodic = PeriodicAveraging(self, sync_every, outer_spec)
        if staleness:
            self._delayed = DelayedUpdate(self)
        self._sample_hook = model.register_forward_pre_hook(self._count_samples,
                                                            with_kwargs=True)
        self._hooks = [  # periodic averaging and delayed updates push from step() only
            slot.param.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, slot in enumerate(self._pipe.slots)
        ] if self._periodic is None and self._delayed is None else []

    @property
    def _step(self) -> int:
        """Steps applied."""
        return self._pipe.step

    @property
    def _wire_step(self) -> int:
        """Steps attempted: the step number the pushes carry."""
        return self._pipe.wire_step

    # -- construction ----------------------------------------------------------------

    def _fill_run_defaults(self, params: dict) -> None:
        """Fill ``seed`` (job seed) and ``mu`` (optimizer momentum); turn that momentum off."""
        if params["seed"] is None:
            params["seed"] = int(self._rt.job_seed)
        if params["momentum"] is None:
            return
        if self._sync_every > 1:  # the chain's momentum acts on the pseudo-gradient
            return
        optimizer_mu = float(self.optimizer.param_groups[0].get("momentum", 0.0) or 0.0)
        if params["mu"] is None:
            if optimizer_mu == 0.0:
                raise ValueError(
                    "compression_params['momentum'] = 'nesterov' needs a coefficient: set "
                    "compression_params['mu'] or give the optimizer a nonzero momentum"
                )
            params["mu"] = optimizer_mu
        turned_off = False
        for group in self.optimizer.param_groups:
            if group.get("momentum"):
                group["momentum"] = 0.0
                turned_off = True
            if group.get("nesterov"):
                group["nesterov"] = False
        if turned_off and self._rt.rank == 0:
            log.warning("bps: the optimizer's momentum is turned off; Nesterov momentum "
                        "(mu=%g) runs in the compression chain instead", params["mu"])

    def _tensors(self) -> list[GradTensor]:
        """The trainable parameters in model order, each with its optimizer param group."""
        group_of = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        tensors, seen = [], set()
        for name, p in self.model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) not in group_of:
                raise ValueError(f"parameter {name!r} is not in the optimizer")
            tensors.append(GradTensor(name, p, group_of[id(p)]))
        return tensors

    def _declare_join_key(self) -> int:
        """A raw key of one float32 per worker node: in ``join()`` each step sums which
        nodes still have data (declared always: every worker declares the same keys)."""
        key = self._rt.allocate_keys(1)
        engine = self._rt.engine
        if engine is not None:
            engine.declare(key, engine.num_workers, torch.float32, None, name="join")
        return key

    # -- the step pipeline ------------------------------------------------------------

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._ready(index)
        return hook

    def _ready(self, index: int) -> None:
        """A backward pass finished this gradient; the last pass of the step pushes it."""
        self._seen[index] += 1
        if self._seen[index] > self._passes or self._pipe.pushed(index):
            raise RuntimeError(self._extra_backward_message(index))
        if self._seen[index] == self._passes:
            self._push(index)

    def _extra_backward_message(self, index: int) -> str:
        """Why a gradient became ready once more than a step takes: what the loop did."""
        name = self._pipe.slots[index].name
        passes = f"{self._passes} backward() pass" + ("es" if self._passes > 1 else "")
        if self._outside_steps:
            return (f"backward() ran again without trainer.step() (gradient of {name!r}), "
                    f"and optimizer.step() was called {self._outside_steps} time(s) outside "
                    "the trainer since its last step: call trainer.step() instead of "
                    "optimizer.step(); it waits for the averaged gradients, then steps the "
                    "optimizer")
        return (f"backward() ran again without trainer.step() (gradient of {name!r} became "
                f"ready {self._seen[index]} times in one step): this trainer takes "
                f"{passes} per trainer.step() (backward_passes_per_step={self._passes}; "
                "set it to accumulate gradients over several passes)")

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: tuple,
                           kwargs: dict) -> None:
        """The optimizer's step hook: count the steps taken outside ``trainer.step()``."""
        if not self._in_step:
            self._outside_steps += 1

    def _push(self, index: int) -> None:
        """A gradient is final: push ``.grad`` (zeros where it has none, or once joined;
        a zero marker where every local rank of the node has joined); the average
        lands in ``.grad`` itself."""
        param = self._pipe.slots[index].param
        source = None if self._joined else param.grad
        node_joined = self._joined
        if self._joining and self._rt.local_size > 1:
            node_joined = not bool(self._node_active().any())
        self._pipe.push(index, source, self._grad_view(param), joined=node_joined)

    def _node_active(self) -> torch.Tensor:
        """In join() with several local ranks: which local ranks of this node still have
        data this step (1.0 each), agreed at the step's first push on every local rank
        (a joined rank's first push comes from synchronize()). Each active rank also
        tells its chain learning rates, which a joined local rank 0 pushes with."""
        if self._local_active is None:
            groups = len(self.optimizer.param_groups)
            rows = torch.zeros(self._rt.local_size, 1 + groups, dtype=torch.float64)
            if not self._joined:
                rows[self._rt.local_rank, 0] = 1.0
                rows[self._rt.local_rank, 1:] = torch.tensor(
                    [self._own_chain_lr(g) for g in range(groups)], dtype=torch.float64)
            self._join_ch.reduce(rows)
            self._join_ch.broadcast(rows)
            self._local_active = rows[:, 0]
            self._node_lrs = None
            if self._local_active.any():
                first = int(self._local_active.nonzero()[0])
                self._node_lrs = rows[first, 1:].tolist()
                self._last_local_active = first
        return self._local_active

    def _step_start(self) -> None:
        """The step's first push: stats count this step's traffic only; the scaler's
        scale is read once (on CUDA each read waits for the device)."""
        self._engine_before = self._stats.snapshot(self._rt.engine)
        self._scale = None if self._scaler is None else self._scaler.get_scale()

    def _chain_lr(self, group: int) -> float:
        """The group's learning rate, over the GradScaler's scale relative to its first
        one: the chains see scaled gradients, so error feedback's ``lr_prev / lr_now``
        then also rescales its residual when the scale changes."""
        if self._periodic is not None:  # the outer update's
            return self._periodic.lr
        if self._delayed is not None:  # the step's that pushed the round in flight
            return self._delayed.chain_lr(group)
        if self._joined and self._node_lrs is not None:
            # a joined rank runs no loop that sets it: the node's first rank with data
            return self._node_lrs[group]
        return self._own_chain_lr(group)

    def _own_chain_lr(self, group: int) -> float:
        lr = float(self.optimizer.param_groups[group]["lr"])
        return lr * self._loss_scale.lr_factor(self._scale)

    @staticmethod
    def _grad_view(p: torch.Tensor) -> torch.Tensor:
        """``p.grad`` as a flat view (allocated where missing or strided)."""
        grad = p.grad
        if grad is None or not grad.is_contiguous():
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return p.grad.view(-1)

    def _scale_change(self) -> float:
        """The GradScaler's scale over its scale at the last applied step (1 without one):
        the momentum and error feedback hold gradients at that scale."""
        return self._loss_scale.change(self._scale)

    def synchronize(self) -> bool:
        """Wait until every gradient of this step is averaged and written into ``.grad``.

        Returns whether the step is applied: False where a worker's gradient had inf or
        NaN entries (every worker returns False for the same step), and then ``.grad``
        holds NaN and every chain, on workers and servers, is back to its state before
        the step. ``step()`` calls it; call it yourself to clip gradients before."""
        if self._delayed is not None:
            raise RuntimeError("synchronize() has no step to wait for with staleness=1: "
                               "step() applies the aggregate of the step before")
        if self._periodic is not None and not self._periodic.syncing:
            raise RuntimeError("synchronize() is not for sync_every > 1: step() syncs the "
                               "parameters every sync_every steps")
        if self._synced is not None:
            return self._synced
        for index in self._pipe.pending():  # no gradient this step (unused): push zeros
            self._push(index)
        if self._joining and self._rt.engine is not None:
            flag = torch.zeros(self._rt.engine.num_workers, dtype=torch.float32)
            flag[self._rt.node_id] = float(self._node_active().sum()) \
                if self._rt.local_size > 1 else float(not self._joined)
            self._join_future = self._rt.engine.push_pull(self._join_key, flag,
                                                          self._wire_step, 0.0)
        self._pipe.wait()
        skip = self._pipe.finish()
        if self._joining:
            counts = torch.zeros(self._rt.num_nodes, dtype=torch.float32)
            if self._join_future is not None:
                counts = self._join_future.result(timeout=self._rt.env.timeout * 2)
                self._join_future = None
            if self._rt.local_size > 1:  # local rank 0's counts, to its node
                self._join_ch.broadcast(counts)
            self._active = [node for node, c in enumerate(counts.tolist()) if c]
            if self._active:
                self._last_active = self._active[0]
        self._skip = skip
        self._synced = skip is None
        return self._synced

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
        try:
            return self._run_step(scaler)
        finally:
            self._in_step = False
            self._outside_steps = 0

    def _run_step(self, scaler: torch.amp.GradScaler | None) -> bool:
        if self._delayed is not None:
            return self._delayed_step(scaler)
        called_ns = time.monotonic_ns()
        if self._periodic is not None:
            if not self._periodic.local_step(scaler):  # a local step: nothing travels
                self._stats.record(self._rt.engine, self._stats.snapshot(self._rt.engine),
                                   self._step, 0, 0.0, self._passes, False,
                                   self._samples * self._rt.local_size)
                self._samples = 0
                return True
            scaler = None  # the pseudo-gradient is not scaled
        if scaler is not None:
            self._scaler = scaler
        applied = self.synchronize()
        synced_ns = time.monotonic_ns()
        skip = self._skip
        if scaler is not None:
            scale = scaler.get_scale()
            # NaN .grad: the scaler skips the step (a joined worker steps nothing)
            if not self._joined and (skip is None or skip.reason == "nonfinite"):
                scaler.step(self.optimizer)
                scaler.update()
            self._loss_scale.settle(scale, applied=skip is None and not self._joined)
        elif self._periodic is not None:
            self._periodic.apply(applied)
        elif applied and not self._joined:
            self.optimizer.step()
        end_ns = time.monotonic_ns()
        if self._tracer is not None:
            if self._last_step_end_ns is not None:
                self._tracer.complete("compute", "", self._step, self._last_step_end_ns,
                                      called_ns)
            self._tracer.complete("wait", "", self._step, called_ns, synced_ns)
            self._tracer.complete("update", "", self._step, synced_ns, end_ns)
        self._last_step_end_ns = end_ns
        nonfinite = skip is not None and skip.reason == "nonfinite"
        self._stats.record(self._rt.engine, self._engine_before, self._step,
                           self._pipe.raw_bytes, (synced_ns - called_ns) / 1e9,
                           self._passes, nonfinite, self._samples * self._rt.local_size)
        self._samples = 0
        step = self._step
        self._seen = [0] * len(self._seen)
        self._local_active = None
        self._pipe.end_step(skip is None)
        self._synced, self._skip = None, None
        if nonfinite and scaler is None:
            self._report_nonfinite(skip, step)
        return applied

    def _report_nonfinite(self, skip: Skipped, step: int) -> None:
        """Raise :class:`NonFiniteGradientError` or warn, per ``nonfinite``."""
        beyond = " (or values beyond float16's range, which fp16 sends)" \
            if self._wire_dtype == torch.float16 else ""
        if skip.node < 0:  # the server's float16 sum of finite pushes
            what = f"the sum over the workers of {skip.what!r} overflows float16"
        else:
            what = (f"the gradient of {skip.what!r} on worker node {skip.node} has inf "
                    f"or NaN entries{beyond}")
        message = f"step {step}: {what}; the step was applied on no worker"
        if self.params["nonfinite"] == "raise":
            raise NonFiniteGradientError(
                f"{message} (compression_params['nonfinite'] = 'skip' skips such steps)")
        log.warning("bps: %s: skipped (compression_params['nonfinite'] = 'skip')", message)

    def _delayed_step(self, scaler: torch.amp.GradScaler | None) -> bool:
        """``step()`` with ``staleness=1`` (:mod:`bps.stale`): settle the round in flight
        (its figures are this step's ``stats()``), push this step's gradients, apply the
        settled aggregate."""
        if scaler is not None:
            raise ValueError("step(scaler=...) is not supported with staleness=1: an "
                             "aggregate would be unscaled by the scale of the step after")
        delayed, engine = self._delayed, self._rt.engine
        delayed.settle()
        skip = delayed.skip
        nonfinite = skip is not None and skip.reason == "nonfinite"
        before, wait = delayed.settled or (self._stats.snapshot(engine), 0.0)
        self._stats.record(engine, before, delayed.round_step,
                           self._pipe.raw_bytes if delayed.settled else 0, wait,
                           self._passes, nonfinite, self._samples * self._rt.local_size)
        self._samples = 0
        step = delayed.round_step
        applied = delayed.push_and_apply()
        if nonfinite:
            self._report_nonfinite(skip, step)
        return applied

    @contextlib.contextmanager
    def join(self):
        """Train on uneven inputs (DDP's ``Join``): a worker whose loop inside the block
        ends joins, and takes part in the steps the others still run with a zero
        contribution, until every worker has joined. The divisor stays the number of
        workers (``bps.size()``), as DDP's ``divide_by_initial_world_size``. Then every
        worker takes the parameters and buffers of the one that stepped last (the
        lowest node among them), so all leave with the same model.

        Example::

            >>> with trainer.join():
            ...     for x, y in my_shard:           # shards of different lengths
            ...         trainer.zero_grad()
            ...         loss_fn(model(x), y).backward()
            ...         trainer.step()
        """
        if self._periodic is not None or self._delayed is not None:
            raise NotImplementedError("trainer.join() is not supported with sync_every > 1 "
                                      "or staleness=1")
        if self._pipe.started or any(self._seen):
            raise RuntimeError("trainer.join() must be entered between steps")
        if self._rt.local_size > 1 and self._join_ch is None:  # every local rank is here
            self._join_ch = self._rt.group.channel(self._rt.unique_name("join"))
        self._joining, self._active = True, []
        try:
            yield self
            self._joined = True
            while True:
                try:
                    self.step()
                except NonFiniteGradientError as exc:  # every worker raised it: go on
                    log.warning("bps: while joined: %s", exc)
                if not self._active:
                    break
            if self._join_ch is not None:  # the node's freshest model to its local rank 0
                broadcast_model_in_node(self._join_ch, self.model, self._last_local_active)
            broadcast_model(self._rt, self.model, source=self._last_active)
        finally:
            self._joining = self._joined = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- statistics -------------------------------------------------------------------

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
                self._samples += int(first.shape[0])
                return

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
        a non-finite gradient made every worker skip the step. ``totals`` sums the byte
        counts, the steps and the skipped steps so far.
        """
        return self._stats.report()

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: step counter, optimizer state, local
        momentum buffers and (on local rank 0) every worker and server compressor's
        error, momentum and RNG state. Each rank saves its own. With ``staleness=1`` it
        first waits for the aggregate in flight, which it then holds."""
        if self._delayed is not None:
            self._delayed.settle()  # before anything else: the round changes the chains
        engine = self._rt.engine
        return {
            "step": self._step,
            "wire_step": self._wire_step,
            "scale": self._loss_scale.state(),
            "rank": self._rt.rank,
            "optimizer": self.optimizer.state_dict(),
            "local_momentum": self._pipe.momentum_state(),
            "engine": engine.state_dict() if engine is not None else None,
            "periodic": self._periodic.state_dict() if self._periodic is not None else None,
            "delayed": self._delayed.state_dict() if self._delayed is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (on the same rank of the same cluster shape)."""
        if state.get("rank") != self._rt.rank:
            raise ValueError(f"state_dict was saved by rank {state.get('rank')}, "
                             f"this is rank {self._rt.rank}")
        self.optimizer.load_state_dict(state["optimizer"])
        self._pipe.load_momentum_state(state["local_momentum"])
        if self._rt.engine is not None:
            if state["engine"] is None:
                raise ValueError("state_dict has no engine state (saved on another local rank?)")
            self._rt.engine.load_state_dict(state["engine"])
        self._pipe.step = int(state["step"])
        self._pipe.wire_step = int(state.get("wire_step", self._pipe.step))
        self._loss_scale.load(state.get("scale", (None, None)))
        if self._periodic is not None:
            self._periodic.load_state_dict(state.get("periodic"))
        if self._delayed is not None:
            self._delayed.load_state_dict(state.get("delayed"))

    def close(self) -> None:
        """Stop the background threads and remove the gradient hooks (with
        ``staleness=1``, after the aggregate in flight arrived; it is not applied)."""
        if self._delayed is not None:
            self._delayed.close()
        for hook in self._hooks:
            hook.remove()
        self._sample_hook.remove()
        self._optimizer_hook.remove()
        self._pipe.close()
