"""A DDP communication hook that averages gradients through the bps parameter servers.

``torch.nn.parallel.DistributedDataParallel`` keeps doing what it does (rank 0's
parameters broadcast at construction, buckets, ``no_sync()``, ``Join``,
``static_graph``, ``gradient_as_bucket_view``, ``find_unused_parameters``); only the
gradient exchange changes. For each bucket the hook hands every parameter's slice to
the same pipeline as :class:`bps.DistributedTrainer` (:mod:`bps.grad_pipeline`): the
slice is divided by the number of workers, reduced within the node in the
``comm_dtype``, and local rank 0 pushes each partition (compressed, with error feedback
and momentum where configured) to the servers, pulls the aggregate and broadcasts it
in the node; the bucket's ``torch.futures.Future`` then gives the bucket back holding
the average. Keys and partitions are the trainer's, planned per parameter, whatever
DDP's bucketing.

Example (every worker process runs the script under ``bpslaunch``)::

    >>> import bps, bps.ddp, torch
    >>> import torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel
    >>> bps.init()
    >>> dist.init_process_group("gloo")           # bpslaunch exports RANK, MASTER_* ...
    >>> ddp = DistributedDataParallel(torch.nn.Linear(784, 10))
    >>> optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    >>> state = bps.ddp.HookState({"compressor": "topk", "k": 0.01, "ef": "vanilla",
    ...                            "momentum": "nesterov"}, optimizer=optimizer)
    >>> ddp.register_comm_hook(state, bps.ddp.ps_hook)
    >>> for x, y in loader:
    ...     optimizer.zero_grad()
    ...     torch.nn.functional.cross_entropy(ddp(x), y).backward()
    ...     optimizer.step()
    >>> torch.save({"model": ddp.state_dict(), "optimizer": optimizer.state_dict(),
    ...             "hook": state.state_dict()}, f"ckpt{dist.get_rank()}.pt")

The learning rate the chains get (error feedback's ``lr_prev / lr_now``) is read from
``optimizer`` at every push, the parameter's own group; without an optimizer it is 1.0
(a constant rate: the ratio is 1). ``momentum: "nesterov"`` takes ``mu`` from
``compression_params`` or else from the optimizer's momentum, and turns the
optimizer's momentum off, as the trainer does. The parameters are known at the first
synchronised backward pass: its buckets wait until the last one arrives (no overlap
in that one step), then every key is planned and declared, in the order DDP's buckets
first presented the parameters, read backwards (model order, for DDP's initial
buckets). docs/ddp.md has the details.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook checks the hook's
# annotations as objects (``bucket: dist.GradBucket``).
import logging
import threading
import time

import torch
import torch.distributed as dist

from bps import runtime as bps_runtime
from bps.common.config import validate_compression_params
from bps.grad_pipeline import GradPipeline, GradTensor
from bps.loss_scale import LossScale
from bps.trainer import NonFiniteGradientError
from bps.trainer_stats import StepStats

__all__ = ["HookState", "ps_hook"]

log = logging.getLogger("bps")


class HookState:
    """The state of :func:`ps_hook`: compression settings, the pipeline, step counters.

    Args:
        compression_params: docs/compression.md dict (``None``: uncompressed), validated
            here: a bad dict raises ``ValueError``/``TypeError`` naming the key.
        optimizer: where the chains read the learning rate (per parameter group, at every
            push) and, with ``momentum`` but no ``mu``, the momentum coefficient; its
            momentum is then turned off (Nesterov runs in the chains). Optional: without
            it the chains get a constant rate, and ``nesterov`` needs ``mu``. May be set
            later as ``state.optimizer`` (for the learning rate only).
        module: optional, the model (or the DDP wrapper): names the parameters in keys,
            logs and errors; else they are ``param0``, ``param1``, ... in model order.
        scaler: the ``torch.amp.GradScaler`` whose ``scale(loss)`` the backward passes use,
            if any: the chains then see scaled gradients, and follow each change of
            scale (error feedback through the learning rate, ``lr * first_scale /
            scale``; the Nesterov momentum multiplied by the new scale over the last
            applied step's), as
            ``DistributedTrainer.step(scaler=...)`` does. May also be set as
            ``state.scaler``, before the first step (an unpickled state: again, loaded).

    ``state_dict()`` / ``load_state_dict()`` carry the step counters, the local momentum,
    the scaler's first and last scales and (local rank 0) every worker and server
    chain's state: each rank saves its own.
    The state pickles (``torch.save(state)``) without its threads and sockets, like
    ``PowerSGDState``; an unpickled state resumes exactly (set ``state.optimizer``
    again where the learning rate changes, and ``state.scaler``, loaded, where there is
    one).
    """

    def __init__(self, compression_params: dict | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 module: torch.nn.Module | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        params = validate_compression_params(compression_params)
        if params["momentum"] is not None:
            optimizer_mu = 0.0
            if optimizer is not None:
                optimizer_mu = float(optimizer.param_groups[0].get("momentum", 0.0) or 0.0)
            if params["mu"] is None:
                if optimizer_mu == 0.0:
                    raise ValueError(
                        "compression_params['momentum'] = 'nesterov' needs a coefficient: set "
                        "compression_params['mu'] or pass an optimizer with a nonzero momentum")
                params["mu"] = optimizer_mu
            if optimizer is not None:
                _momentum_off(optimizer, params["mu"])
        self._setup(params, optimizer, module, None)
        self.scaler = scaler

    def _setup(self, params: dict, optimizer, module, loaded: dict | None) -> None:
        self.params = params
        self.optimizer = optimizer
        self.module = module
        self.scaler: torch.amp.GradScaler | None = None
        self._loss_scale = LossScale()  # how the chains follow the scaler's scale
        self._scale: float | None = None  # its scale at this step
        self._loaded = loaded  # a state to load once the pipeline exists
        self._pipe: GradPipeline | None = None
        self._index: dict[int, int] = {}  # id(parameter) -> pipeline index
        self._held: list[tuple] = []  # the first step's buckets, until the last one
        self._futures: list[tuple] = []  # this step's (future, bucket buffer)
        self._seen = 0  # parameters the step's buckets held so far
        self._lock = threading.Lock()
        self._stats = StepStats()
        self._before: dict = {}
        self._started_ns = 0

    # -- the hook ------------------------------------------------------------------------

    def _submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        entry = (bucket.buffer(), list(bucket.parameters()), list(bucket.gradients()), future)
        if self._pipe is None:
            self._held.append(entry)
            if bucket.is_last():
                held, self._held = self._held, []
                self._build([p for _, params, _, _ in reversed(held) for p in params])
                for one in held:
                    self._push_bucket(*one)
            return future
        if bucket.is_last():  # the step's buckets must have held every parameter
            seen = self._seen + len(entry[1])
            self._seen = 0
            if seen != len(self._pipe.slots):
                last = {id(p) for p in entry[1]}
                missing = [s.name for i, s in enumerate(self._pipe.slots)
                           if not self._pipe.pushed(i) and id(s.param) not in last]
                raise RuntimeError(f"bps.ddp: the last bucket of a step came, but no bucket "
                                   f"held {missing[:5]} this step")
        else:
            self._seen += len(entry[1])
        self._push_bucket(*entry)
        return future

    def _push_bucket(self, buffer: torch.Tensor, params: list, grads: list,
                     future: torch.futures.Future) -> None:
        with self._lock:
            self._futures.append((future, buffer))
        for p, g in zip(params, grads, strict=True):
            index = self._index.get(id(p))
            if index is None:
                raise RuntimeError(f"bps.ddp: a parameter of shape {tuple(p.shape)} was in "
                                   "no bucket of the first synchronised step")
            if g.is_sparse:
                raise NotImplementedError("bps.ddp: sparse gradients are not supported")
            if g.is_contiguous():
                self._pipe.push(index, g, g.view(-1))
            else:  # a strided layout (channels_last): average in order, then copy back
                flat = torch.empty(g.numel(), dtype=g.dtype, device=g.device)
                self._pipe.push(index, g, flat,
                                done=lambda _, g=g, flat=flat: g.copy_(flat.view(g.shape)))

    def _build(self, params: list[torch.Tensor]) -> None:
        """Plan and declare every parameter's keys (the first step's last bucket)."""
        rt = bps_runtime.init()
        if dist.is_available() and dist.is_initialized() and (
                dist.get_rank() != rt.rank or dist.get_world_size() != rt.size):
            raise RuntimeError(
                f"bps.ddp: torch.distributed rank {dist.get_rank()} of "
                f"{dist.get_world_size()} is bps rank {rt.rank} of {rt.size}: run "
                "init_process_group with the RANK and WORLD_SIZE that bpslaunch exports")
        if self.params["seed"] is None:
            self.params["seed"] = int(rt.job_seed)
        names = {}
        if self.module is not None:
            names = {id(p): n for n, p in self.module.named_parameters()}
        group_of = {}
        if self.optimizer is not None:
            for gi, group in enumerate(self.optimizer.param_groups):
                for p in group["params"]:
                    group_of[id(p)] = gi
        tensors = []
        for i, p in enumerate(params):
            name = names.get(id(p), f"param{i}")
            if self.optimizer is not None and id(p) not in group_of:
                raise ValueError(f"bps.ddp: parameter {name!r} is not in the optimizer")
            tensors.append(GradTensor(name, p, group_of.get(id(p), 0)))
        self._pipe = GradPipeline(rt, self.params, tensors, self._lr,
                                  rescale=lambda: self._loss_scale.change(self._scale),
                                  on_step_start=self._step_start,
                                  on_step_done=self._settle, on_error=self._fail)
        self._index = {id(p): i for i, p in enumerate(params)}
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self._load(loaded)

    def _lr(self, group: int) -> float:
        lr = 1.0 if self.optimizer is None else float(self.optimizer.param_groups[group]["lr"])
        return lr * self._loss_scale.lr_factor(self._scale)

    def _step_start(self) -> None:
        self._started_ns = time.monotonic_ns()
        if self.scaler is None and self._loss_scale.first is not None:
            raise ValueError("bps.ddp: this HookState was saved with a GradScaler: set "
                             "state.scaler (loaded) before the first step")
        if self.scaler is not None:  # read once: the pipeline's threads use it
            self._scale = self.scaler.get_scale()
        self._before = self._stats.snapshot(self._pipe._rt.engine)

    def _settle(self) -> None:
        """Every parameter of the step has its average (broadcast thread): settle the
        step on every local rank, count it, and give DDP its buckets back."""
        pipe = self._pipe
        skip = pipe.finish()
        nonfinite = skip is not None and skip.reason == "nonfinite"
        step = pipe.step
        self._stats.record(pipe._rt.engine, self._before, step, pipe.raw_bytes,
                           (time.monotonic_ns() - self._started_ns) / 1e9, 1, nonfinite)
        pipe.end_step(skip is None)
        if self._scale is not None:
            self._loss_scale.settle(self._scale, applied=skip is None)
        with self._lock:
            futures, self._futures = self._futures, []
        error = None
        if nonfinite:
            if skip.node < 0:
                what = f"the sum over the workers of {skip.what!r} overflows float16"
            else:
                what = f"the gradient of {skip.what!r} on worker node {skip.node} has inf " \
                       "or NaN entries"
            message = f"step {step}: {what}; the step was applied on no worker"
            if self.params["nonfinite"] == "raise":
                error = NonFiniteGradientError(
                    f"{message} (compression_params['nonfinite'] = 'skip' gives NaN "
                    "gradients instead)")
            else:
                log.warning("bps: %s: the gradients are NaN (compression_params"
                            "['nonfinite'] = 'skip')", message)
        for future, buffer in futures:
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(buffer)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        for future, _ in futures:
            if not future.done():
                future.set_exception(RuntimeError(f"bps communication failed: {exc}"))

    # -- figures, checkpoints --------------------------------------------------------------

    def stats(self) -> dict:
        """The last step's figures, as ``DistributedTrainer.stats()`` (``wait_time``: from
        the step's first push to its settling)."""
        return self._stats.report()

    def state_dict(self) -> dict:
        """``{"step", "wire_step", "rank", "scale", "local_momentum", "engine"}``: everything to
        continue exactly (``local_momentum``: per parameter in model order, None where
        it has none; ``engine``: the error, momentum and RNG state of every worker and
        server chain of this state's keys, by position, on local rank 0). Each rank
        saves its own."""
        if self._pipe is None:
            if self._loaded is not None:
                return dict(self._loaded)
            return {"step": 0, "wire_step": 0, "rank": None, "scale": (None, None),
                    "local_momentum": [], "engine": None}
        rt = self._pipe._rt
        return {"step": self._pipe.step, "wire_step": self._pipe.wire_step, "rank": rt.rank,
                "scale": self._loss_scale.state(),
                "local_momentum": [None if s.local_momentum is None else
                                   s.local_momentum.clone() for s in self._pipe.slots],
                "engine": self._engine_state() if rt.engine is not None else None}

    def _engine_state(self) -> dict:
        """The chains of this state's compressed keys, by position (key numbers depend
        on what else the process declared first)."""
        full = self._pipe._rt.engine.state_dict()
        keys = self._pipe.compressed_keys()
        return {side: {i: full[side][k] for i, k in enumerate(keys) if k in full[side]}
                for side in ("worker", "server")}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved, on the same rank of a cluster of the same
        shape. Before the first step it is kept and loaded as the keys are declared;
        collective (every rank loads, in the same step)."""
        if self._pipe is None:
            self._loaded = dict(state)
        else:
            self._load(state)

    def _load(self, state: dict) -> None:
        rt = self._pipe._rt
        if state.get("rank") is None:  # saved before any step: nothing to restore
            return
        if state["rank"] != rt.rank:
            raise ValueError(f"state_dict was saved by rank {state['rank']}, "
                             f"this is rank {rt.rank}")
        saved = state["local_momentum"]
        if len(saved) != len(self._pipe.slots):
            raise ValueError(f"state_dict holds {len(saved)} parameters' momentum, the model "
                             f"has {len(self._pipe.slots)}")
        for slot, buffer in zip(self._pipe.slots, saved, strict=True):
            if slot.local_momentum is None:
                continue
            if buffer is None or buffer.numel() != slot.local_momentum.numel():
                raise ValueError(f"state_dict has no momentum buffer of {slot.name!r}'s "
                                 f"size ({slot.local_momentum.numel()})")
            slot.local_momentum.copy_(buffer)
        if rt.engine is not None:
            if state["engine"] is None:
                raise ValueError("state_dict has no engine state (saved on another local rank?)")
            keys = self._pipe.compressed_keys()
            saved = state["engine"]
            if any(i >= len(keys) for side in saved.values() for i in side):
                raise ValueError("state_dict holds chains of more compressed keys than "
                                 f"this model has ({len(keys)})")
            rt.engine.load_state_dict({side: {keys[i]: chain for i, chain in saved[side].items()}
                                       for side in ("worker", "server")})
        self._pipe.step = int(state["step"])
        self._pipe.wire_step = int(state["wire_step"])
        self._loss_scale.load(state.get("scale", (None, None)))

    def __getstate__(self) -> dict:
        return {"params": self.params, "state": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        self._setup(saved["params"], None, None, saved["state"])

    def close(self) -> None:
        """Stop the pipeline's threads (the hook must not run again)."""
        if self._pipe is not None:
            self._pipe.close()


def _momentum_off(optimizer: torch.optim.Optimizer, mu: float) -> None:
    turned_off = False
    for group in optimizer.param_groups:
        if group.get("momentum"):
            group["momentum"] = 0.0
            turned_off = True
        if group.get("nesterov"):
            group["nesterov"] = False
    if turned_off:
        log.warning("bps: the optimizer's momentum is turned off; Nesterov momentum "
                    "(mu=%g) runs in the compression chain instead", mu)


def ps_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over every worker through the bps
    parameter servers (see :mod:`bps.ddp`).

    Example::

        >>> ddp.register_comm_hook(bps.ddp.HookState(compression_params, optimizer),
        ...                        bps.ddp.ps_hook)
    """
    return state._submit(bucket)
