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

In an elastic job where a worker node may join while it runs (``bpslaunch local
--min-workers M --max-restarts N``), DDP runs over a group of the node's own processes
(:func:`init_process_group`) and the model's first sync across nodes comes from bps
(``HookState(module=...)``): a restarted node cannot enter a group of every node, but
it can make a group of its own and take the state of a node present::

    >>> bps.init()
    >>> bps.ddp.init_process_group("gloo")        # rank: local rank; world: local size
    >>> ddp = DistributedDataParallel(model)
    >>> state = bps.ddp.HookState(params, optimizer=optimizer, module=model)
    >>> for step in range(state.step_count, total):   # a joiner starts where it joined
    ...     ...

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
import datetime
import logging
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from bps.core import rejoin
from bps.core import runtime as bps_runtime
from bps.core.compressed_adam import AdamCoupling, check_adam
from bps.core.frontend import FrontEndCore, momentum_off
from bps.core.model_sync import broadcast_model, check_same_model

__all__ = ["HookState", "init_process_group", "ps_hook"]

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


def init_process_group(backend: str = "gloo",
                       timeout: datetime.timedelta | None = None) -> None:
    """Initialise torch.distributed's default group over this worker node's own
    processes: rank ``bps.local_rank()`` of ``bps.local_size()``, rendezvous at the
    node's local master (``BPS_LOCAL_MASTER_ADDR`` / ``PORT``, under a prefix of its own
    in the store bps's node-local group meets at). DDP's own collectives (the
    constructor's broadcast, buffers, unused parameters) then stay inside the node;
    across nodes only the bps servers carry the gradients, and ``HookState(module=...)``
    gives every node node 0's model. A worker node restarted into a running job can
    make such a group and join (docs/ddp.md, "Elastic jobs"). ``timeout``: the group's
    (torch's default where None). Calls ``bps.init()`` first (idempotent).

    Example::

        >>> bps.init()
        >>> bps.ddp.init_process_group("gloo")     # "nccl" with a GPU per local rank
        >>> ddp = DistributedDataParallel(model)
    """
    rt = bps_runtime.init()
    if rt.local_size == 1:
        store = dist.HashStore()  # a group of one meets nobody
    else:
        # bps's node-local group serves this store on local rank 0; under the node agent
        # (BPS_NODE_AGENT=1) nobody does, and local rank 0 serves it here
        store = dist.TCPStore(rt.env.local_master_addr, rt.env.local_master_port,
                              is_master=bool(rt.env.node_agent) and rt.local_rank == 0,
                              timeout=datetime.timedelta(seconds=rt.env.timeout),
                              wait_for_workers=False)
    options = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, store=dist.PrefixStore("bps.ddp/", store),
                            rank=rt.local_rank, world_size=rt.local_size, **options)


def _world_size() -> int | None:
    """The default group's size (None: torch.distributed is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return None


def group_refusal(rt, world_size: int | None) -> str | None:
    """Why joining node ``rt`` cannot join with DDP's default group of ``world_size``
    processes (None: not initialised): it can only with a group of its own node's
    processes (:func:`init_process_group`); None where it can, or is no joiner.

        >>> group_refusal(rt, 6)  # a joiner of node 2, 2 local ranks, a group of all nodes
        "worker node 2 started after the job began, but DDP's process group spans 6 ..."
    """
    if not rt.joining or world_size == rt.local_size:
        return None
    what = "torch.distributed is not initialised" if world_size is None else \
        f"DDP's process group spans {world_size} processes, not this node's {rt.local_size}"
    return (f"worker node {rt.node_id} started after the job began, but {what}: a node "
            "joins a running job through the DDP hook only where DDP's group is its own "
            "node's processes: call bps.ddp.init_process_group() instead of "
            "dist.init_process_group() on every node, before HookState (docs/ddp.md, "
            "'Elastic jobs')")


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
        module: the model (or the DDP wrapper): names the parameters in keys, logs,
            errors and checkpoints; else they are ``param0``, ``param1``, ... in model
            order. Needed where DDP's group is node-local (:func:`init_process_group`)
            on several worker nodes: the state then checks that every rank has the
            same parameters and buffers and gives every rank node 0's (as
            ``DistributedTrainer`` does), and a joining node loads the model of a node
            present into it.
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

    A worker node that joins a running job (``BPS_MIN_WORKERS``; DDP's group
    node-local) joins when its state is made: it takes the model, the optimizer's state,
    the step counters, the loss scale and the local momentum of the lowest-numbered node
    present (its own chains start at zero), and ``step_count`` says where its loop
    starts. The nodes present send that state as their next step starts after the join
    (or at ``close()``).

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
        self._setup(FrontEndCore(compression_params, optimizer,
                                 skip_means="gives NaN gradients instead",
                                 skipped_as="the gradients are NaN"), module, None)
        if self.core.params["freeze_step"] is not None:
            check_adam(optimizer)
            if scaler is not None:
                raise ValueError("compressed Adam (compression_params['freeze_step']) takes "
                                 "no GradScaler: after the freeze .grad holds Adam's momentum")
        self.scaler = scaler
        try:
            rt = bps_runtime.get()
        except RuntimeError:  # bps.init() comes later
            rt = None
        if rt is not None and rt.joining:
            self._join(rt)
        elif rt is not None and self._node_local(rt):
            self._sync_model(rt)

    def _node_local(self, rt) -> bool:
        """Whether DDP's group is this node's processes on a job of several nodes: the
        model's sync across nodes is then bps's."""
        return rt.num_nodes > 1 and _world_size() == rt.local_size

    def _sync_model(self, rt) -> None:
        """Every rank checks its model against rank 0's and takes node 0's (over the
        servers), as ``DistributedTrainer`` does: DDP's broadcast stays in the node."""
        if self.module is None:
            raise ValueError(
                "bps.ddp: DDP's process group is this node's processes "
                "(bps.ddp.init_process_group), so the model's sync across worker nodes is "
                "bps's: give HookState module= (the model or the DDP wrapper)")
        check_same_model(rt, self.module)
        broadcast_model(rt, self.module)
        self._synced = True

    def _join(self, rt) -> None:
        """A worker node that started after the job began: become a member and load the
        model and optimizer state of the node present that sends it (the pipeline's
        part when the keys are declared, :meth:`_build`)."""
        refusal = group_refusal(rt, _world_size())
        if refusal is None and self.core.params["freeze_step"] is not None:
            refusal = (f"worker node {rt.node_id} started after the job began, but the DDP "
                       "hook takes no joiner with compressed Adam (freeze_step)")
        if refusal is None and self.module is None:
            refusal = (f"worker node {rt.node_id} started after the job began: to join the "
                       "running job HookState needs module= (the model or the DDP wrapper), "
                       "which takes the model of the node present")
        if refusal is not None:
            raise ValueError(refusal)
        joined = rejoin.join_job(rt)
        rejoin.load_model_state(joined, self.module, self.core.optimizer)
        self._joined, self._synced = joined, True

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
        self._synced = False  # whether this state gave every node node 0's model
        self._joined: dict | None = None  # a joining node's state, for the pipeline
        self._first_key = 0  # the pipeline's first key: a joiner takes the same
        self._members: list[int] | None = None  # nodes present before a join, to send to

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
        world = _world_size()
        if world is not None and (dist.get_rank(), world) not in (
                (rt.rank, rt.size), (rt.local_rank, rt.local_size)):
            raise RuntimeError(
                f"bps.ddp: torch.distributed rank {dist.get_rank()} of {world} is bps rank "
                f"{rt.rank} of {rt.size} (local rank {rt.local_rank} of {rt.local_size}): "
                "run init_process_group with the RANK and WORLD_SIZE that bpslaunch "
                "exports, or bps.ddp.init_process_group() for a group of the node")
        if not self._synced and self._node_local(rt):
            raise RuntimeError(
                "bps.ddp: DDP's process group is this node's processes "
                "(bps.ddp.init_process_group), but this HookState was made before it (or "
                "before bps.init()), so nobody gave every worker node node 0's model: make "
                "the HookState after both, with module=")
        names = {}
        if self.module is not None:
            names = {id(p): n for n, p in self.module.named_parameters()}
        # a loaded state names the parameters as the run that saved it did (module= or not)
        saved = self._names or (self._loaded or {}).get("names")
        if saved is not None and len(saved) == len(params):
            named = list(zip(saved, params, strict=True))
        else:
            named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]
        if self._joined is not None:  # the keys the nodes present gave these parameters
            rt.skip_keys_to(self._joined["first_key"])
        self._first_key = rt.next_key()
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
        if self._joined is not None:
            joined, self._joined = self._joined, None
            rejoin.load_pipeline_state(self.core, joined)
            rt.skip_keys_to(joined["next_key"])

    @property
    def step_count(self) -> int:
        """Synchronised steps so far, applied or skipped (``no_sync()`` passes are not
        steps). A node that joined a running job starts from the count of the node it
        took the state from: ``for step in range(state.step_count, total)`` runs the
        same steps on every node."""
        pipe = self.core.pipeline
        if pipe is not None:
            return pipe.wire_step
        saved = self._joined or self._loaded or {}
        return int(saved.get("wire_step", saved.get("step", 0)))

    def _publish(self) -> None:
        """Where worker nodes joined in the last step, the lowest-numbered node that
        was present sends them the state (after the user's optimizer step: as the next
        step starts, or at close())."""
        before, self._members = self._members, None
        if before is not None:
            rejoin.publish_if_joined(self.core.runtime, before, self._join_state)

    def _join_state(self) -> dict:
        """What a joining node loads (:meth:`_join`, :meth:`_build`)."""
        if self.module is None:
            raise RuntimeError("bps.ddp: a worker node joined the job, but this HookState "
                               "has no module= whose model it could send the joiner")
        return {**rejoin.front_end_state(self.core, self.module, self.core.optimizer),
                "first_key": self._first_key, "next_key": self.core.runtime.next_key()}

    def _step_start(self) -> None:
        self._publish()
        self._started_ns = time.monotonic_ns()
        if self.core.scaler is None and self.core.loss_scale.first is not None:
            raise ValueError("bps.ddp: this HookState was saved with a GradScaler: set "
                             "state.scaler (loaded) before the first step")

    def _settle(self) -> None:
        """Every parameter of the step has its average (broadcast thread): settle the
        step on every local rank, count it, and give DDP its buckets back."""
        core, pipe = self.core, self.core.pipeline
        before = core.runtime.members
        skip = pipe.finish()
        if core.runtime.members != before:  # worker nodes joined: sent as the next starts
            self._members = before
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
        self._synced = True  # a resumed job: every rank loads the model it saved

    def close(self) -> None:
        """Stop the pipeline's threads (the hook must not run again). A state whose hook
        never ran warns: the training it served did not go through bps."""
        self._unran_check.remove()
        if not self.ran:
            log.warning("bps.ddp: HookState.close(): %s, so nothing went through bps",
                        NOT_REGISTERED)
        if self.core.pipeline is not None:
            self._publish()  # nodes that joined in the last step get the final state
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
