"""A DDP communication hook that averages gradients through the bps parameter servers.

``torch.nn.parallel.DistributedDataParallel`` keeps doing what it does (rank 0's
parameters broadcast at construction, buckets, ``no_sync()``, ``Join``,
``static_graph``, ``gradient_as_bucket_view``, ``find_unused_parameters``); only the
gradient exchange changes. For each bucket the hook hands every parameter's slice to
the same front-end core as :class:`bps.DistributedTrainer`
(:class:`bps.core.frontend.FrontEndCore`, :mod:`bps.core.grad_pipeline`): the
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
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from bps.core import runtime as bps_runtime
from bps.core.compressed_adam import AdamCoupling, check_adam
from bps.core.frontend import FrontEndCore, momentum_off

__all__ = ["HookState", "ps_hook"]

log = logging.getLogger("bps")

NOT_REGISTERED = (
    "no DDP model ran bps.ddp.ps_hook with this HookState: register it with "
    "ddp.register_comm_hook(state, bps.ddp.ps_hook). Lightning's "
    "DDPStrategy(ddp_comm_hook=..., ddp_comm_state=state) registers it only on CUDA; on "
    "CPUs add callbacks=[bps.lightning.RegisterHook(state)] to the Trainer")


def _check_ran(state_ref: weakref.ref, optimizer: torch.optim.Optimizer, args: tuple,
               kwargs: dict) -> tuple[tuple, dict] | None:
    """Every optimizer's step pre-hook until the state's hook ran: a step (of the state's
    optimizer, or of any where it has none) before any bucket went through bps would
    apply gradients that were never averaged through it. A step given a closure (as
    Lightning steps) runs the backward inside: the check then follows the closure."""
    state = state_ref()
    if state is None or state.ran or state.optimizer not in (None, optimizer):
        return None
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        _raise_unless_ran(state)
        return None

    def checked(*inner_args, **inner_kwargs):  # noqa: ANN202 - the closure's own
        result = closure(*inner_args, **inner_kwargs)
        _raise_unless_ran(state_ref())
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": checked}
    return (args[0], checked, *args[2:]), kwargs


def _raise_unless_ran(state: "HookState | None") -> None:
    if state is not None and not state.ran:
        raise RuntimeError(f"bps.ddp: optimizer.step() ran, but {NOT_REGISTERED} (no "
                           "parameter was changed)")


class HookState:
    """The state of :func:`ps_hook`: the front-end core and the step's buckets.

    Args:
        compression_params: docs/compression.md dict (``None``: uncompressed), validated
            here: a bad dict raises ``ValueError``/``TypeError`` naming the key.
        optimizer: where the chains read the learning rate (per parameter group, at every
            push) and, with ``momentum`` but no ``mu``, the momentum coefficient; its
            momentum is then turned off (Nesterov runs in the chains). Optional: without
            it the chains get a constant rate, and ``nesterov`` needs ``mu``. May be set
            later as ``state.optimizer`` (for the learning rate; with ``nesterov`` its
            momentum is turned off then).
        module: optional, the model (or the DDP wrapper): names the parameters in keys,
            logs, errors and checkpoints; else they are ``param0``, ``param1``, ... in
            model order.
        scaler: the ``torch.amp.GradScaler`` whose ``scale(loss)`` the backward passes use,
            if any: the chains then see scaled gradients, and follow each change of
            scale (error feedback through the learning rate, ``lr * first_scale /
            scale``; the Nesterov momentum multiplied by the new scale over the last
            applied step's), as
            ``DistributedTrainer.step(scaler=...)`` does. May also be set as
            ``state.scaler``, before the first step (an unpickled state: again, loaded).

    Until DDP hands the state its first bucket, an ``optimizer.step()`` (of its
    optimizer; of any where it has none) raises, and ``close()`` warns: the hook was
    never registered (Lightning's ``DDPStrategy`` registers it only on CUDA; see
    :mod:`bps.lightning`).

    ``state_dict()`` / ``load_state_dict()`` carry the step counters, the local momentum
    (by parameter name), the scaler's first and last scales and (local rank 0) every
    worker and server chain's state: each rank saves its own.
    The state pickles (``torch.save(state)``) without its threads and sockets, like
    ``PowerSGDState``; an unpickled state resumes exactly (set ``state.optimizer``
    again where the learning rate changes, and ``state.scaler``, loaded, where there is
    one).
    """

    def __init__(self, compression_params: dict | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 module: torch.nn.Module | None = None,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        try:
            rt = bps_runtime.get()
        except RuntimeError:  # bps.init() comes later
            rt = None
        if rt is not None and rt.joining:
            raise RuntimeError(
                f"worker node {rt.node_id} started after the job began, but the DDP hook "
                "cannot join a running job (DDP's process group is fixed when it starts); "
                "bps.DistributedTrainer can (docs/runtime.md, 'Joining and --max-restarts')")
        self._setup(FrontEndCore(compression_params, optimizer,
                                 skip_means="gives NaN gradients instead",
                                 skipped_as="the gradients are NaN"), module, None)
        if self.core.params["freeze_step"] is not None:
            check_adam(optimizer)
            if scaler is not None:
                raise ValueError("compressed Adam (compression_params['freeze_step']) takes "
                                 "no GradScaler: after the freeze .grad holds Adam's momentum")
        self.scaler = scaler

    def _setup(self, core: FrontEndCore, module, loaded: dict | None,
               names: list[str] | None = None) -> None:
        self.core = core
        self.module = module
        self._names = names  # an unpickled state's parameter names, in pipeline order
        self._loaded = loaded  # a state to load once the pipeline exists
        self._index: dict[int, int] = {}  # id(parameter) -> pipeline index
        self._held: list[tuple] = []  # the first step's buckets, until the last one
        self._futures: list[tuple] = []  # this step's (future, bucket buffer)
        self._seen = 0  # parameters the step's buckets held so far
        self._lock = threading.Lock()
        self._started_ns = 0
        self.ran = False  # whether DDP handed this state a bucket yet
        # until then, an optimizer step raises: the hook was never registered or called
        ref = weakref.ref(self)
        self._unran_check = register_optimizer_step_pre_hook(
            lambda opt, args, kwargs: _check_ran(ref, opt, args, kwargs))
        weakref.finalize(self, self._unran_check.remove)  # a state dropped unclosed
        self._adam: AdamCoupling | None = None  # compressed Adam (freeze_step), once built

    @property
    def params(self) -> dict:
        """The validated compression_params."""
        return self.core.params

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.core.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.core.optimizer = optimizer
        if optimizer is not None and self.core.params["momentum"] is not None:
            momentum_off(optimizer)  # Nesterov runs in the chains, as at construction

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.core.scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        self.core.scaler = scaler

    # -- the hook ------------------------------------------------------------------------

    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Hand a bucket's gradients to the pipeline; the future gives the bucket back
        holding the average (what :func:`ps_hook` returns)."""
        if not self.ran:
            self.ran = True
            self._unran_check.remove()
        future: torch.futures.Future = torch.futures.Future()
        entry = (bucket.buffer(), list(bucket.parameters()), list(bucket.gradients()), future)
        pipe = self.core.pipeline
        if pipe is None:
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
            if seen != len(pipe.slots):
                last = {id(p) for p in entry[1]}
                missing = [s.name for i, s in enumerate(pipe.slots)
                           if not pipe.pushed(i) and id(s.param) not in last]
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
        pipe = self.core.pipeline
        frozen = self._adam is not None and self._adam.frozen(pipe.step)
        for p, g in zip(params, grads, strict=True):
            index = self._index.get(id(p))
            if index is None:
                raise RuntimeError(f"bps.ddp: a parameter of shape {tuple(p.shape)} was in "
                                   "no bucket of the first synchronised step")
            if g.is_sparse:
                raise NotImplementedError("bps.ddp: sparse gradients are not supported")
            if frozen:  # compressed Adam: this worker's momentum travels
                self._adam.local_momentum(p, g)
            if g.is_contiguous():
                pipe.push(index, g, g.view(-1))
            else:  # a strided layout (channels_last): average in order, then copy back
                flat = torch.empty(g.numel(), dtype=g.dtype, device=g.device)
                pipe.push(index, g, flat,
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
        names = {}
        if self.module is not None:
            names = {id(p): n for n, p in self.module.named_parameters()}
        # a loaded state names the parameters as the run that saved it did (module= or not)
        saved = self._names or (self._loaded or {}).get("names")
        if saved is not None and len(saved) == len(params):
            named = list(zip(saved, params, strict=True))
        else:
            named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]
        self.core.build(rt, self.core.grad_tensors(named), on_step_start=self._step_start,
                        on_step_done=self._settle, on_error=self._fail)
        if self.core.params["freeze_step"] is not None:
            check_adam(self.core.optimizer)  # an unpickled state: set state.optimizer
            self.core.chain_lr_override = lambda group: 1.0  # error feedback on momentum
            self._adam = AdamCoupling(self.core.optimizer, self.core.params["freeze_step"],
                                      params)
        self._index = {id(p): i for i, p in enumerate(params)}
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self._load(loaded)

    def _step_start(self) -> None:
        self._started_ns = time.monotonic_ns()
        if self.core.scaler is None and self.core.loss_scale.first is not None:
            raise ValueError("bps.ddp: this HookState was saved with a GradScaler: set "
                             "state.scaler (loaded) before the first step")

    def _settle(self) -> None:
        """Every parameter of the step has its average (broadcast thread): settle the
        step on every local rank, count it, and give DDP its buckets back."""
        core, pipe = self.core, self.core.pipeline
        skip = pipe.finish()
        nonfinite = skip is not None and skip.reason == "nonfinite"
        dropped = skip is not None and skip.reason == "membership"  # worker nodes left
        step = pipe.step
        core.record(core.engine_before, step, pipe.raw_bytes,
                    (time.monotonic_ns() - self._started_ns) / 1e9, 1, nonfinite or dropped)
        if self._adam is not None and skip is None:  # optimizer.step() applies it
            self._adam.arm(self._adam.frozen(step))
        elif self._adam is not None:  # the user's optimizer.step() must not apply it
            self._adam.skip()
        pipe.end_step(skip is None)
        if core.scale is not None:
            core.loss_scale.settle(core.scale, applied=skip is None)
        with self._lock:
            futures, self._futures = self._futures, []
        error = core.nonfinite_error(skip, step) if nonfinite else None
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
        return self.core.stats.report()

    def state_dict(self) -> dict:
        """``{"step", "wire_step", "rank", "scale", "local_momentum", "engine", "names"}``:
        everything to continue exactly (``local_momentum``: by parameter name; ``engine``:
        the error, momentum and RNG state of every worker and server chain of this
        state's keys, by position, on local rank 0; ``names``: the parameters' names in
        key order, which a state that loads it takes, so that it needs no ``module=``
        to find them). Each rank saves its own."""
        if self.core.pipeline is None:
            if self._loaded is not None:
                return dict(self._loaded)
            return {"step": 0, "wire_step": 0, "rank": None, "scale": (None, None),
                    "local_momentum": {}, "engine": None, "names": self._names}
        return {**self.core.state_dict(), "names": [s.name for s in self.core.pipeline.slots]}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved, on the same rank of a cluster of the same
        shape. Before the first step it is kept and loaded as the keys are declared;
        collective (every rank loads, in the same step)."""
        if self.core.pipeline is None:
            self._loaded = dict(state)
        else:
            self._load(state)

    def _load(self, state: dict) -> None:
        if state.get("rank") is None:  # saved before any step: nothing to restore
            return
        saved, names = state.get("names"), [s.name for s in self.core.pipeline.slots]
        if saved is not None and len(saved) == len(names) and saved != names:
            # named otherwise when saved (module= given or not): the same parameters in order
            rename = dict(zip(saved, names, strict=True))
            state = {**state, "local_momentum": {rename.get(n, n): buffer for n, buffer
                                                 in state["local_momentum"].items()}}
        self.core.load_state_dict(state)

    def __getstate__(self) -> dict:
        names = self._names if self.core.pipeline is None else \
            [slot.name for slot in self.core.pipeline.slots]
        return {"params": self.core.params, "state": self.state_dict(), "names": names}

    def __setstate__(self, saved: dict) -> None:
        self._setup(FrontEndCore(saved["params"], None,
                                 skip_means="gives NaN gradients instead",
                                 skipped_as="the gradients are NaN"), None, saved["state"],
                    saved.get("names"))

    def close(self) -> None:
        """Stop the pipeline's threads (the hook must not run again). A state whose hook
        never ran warns: the training it served did not go through bps."""
        self._unran_check.remove()
        if not self.ran:
            log.warning("bps.ddp: HookState.close(): %s, so nothing went through bps",
                        NOT_REGISTERED)
        if self._adam is not None:
            self._adam.close()
        self.core.close()


def ps_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over every worker through the bps
    parameter servers (see :mod:`bps.ddp`).

    Example::

        >>> ddp.register_comm_hook(bps.ddp.HookState(compression_params, optimizer),
        ...                        bps.ddp.ps_hook)
    """
    return state.submit(bucket)
