"""Worker nodes joining a running job (``BPS_MIN_WORKERS``; docs/runtime.md, "Elastic
membership").

A worker node that starts after the job began (one restarted after it died, with its
old ``DMLC_WORKER_ID``, or one started late) is welcomed by the scheduler as a
*joiner* (``Runtime.joining``), not yet a member. Its trainer does not take rank 0's
model at construction: :func:`join_job` makes it a member (JOIN: the scheduler tells
everyone the next membership generation) and waits for the training state of the
lowest-numbered node present, which that node sends through the scheduler at its next
step boundary (:func:`publish_if_joined`, after the step that the membership change
dropped everywhere). The joiner loads it and pushes the next step with everyone else.

What travels: the model's parameters and buffers, the optimizer's state, the step
counters, the loss scale and the step mode's state (``torch.save`` bytes). The joiner's
own compression chains (error feedback, momentum) start at zero, as the servers'
state has nothing per node. Both front ends (``DistributedTrainer``, the DDP hook
``bps.ddp.HookState``) send :func:`front_end_state` with what is their own, and load it
with :func:`load_model_state` and :func:`load_pipeline_state`.

Usage (inside ``DistributedTrainer``)::

    state = join_job(rt) if rt.joining else None     # on every local rank of the joiner
    before = rt.members
    mode.step()
    publish_if_joined(rt, before, trainer_state)      # on every node present
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger("bps")


def join_job(rt) -> dict:
    """Become a member and load the state a node present sent (every local rank of
    the joiner calls it): the dict :func:`publish_if_joined` sent, with ``generation``
    and ``members``. Waits up to ``BPS_TIMEOUT`` for it, naming its source."""
    blob = None
    if rt.engine is not None:
        generation, members, source = rt.engine.join()
        log.warning("bps: worker node %d joins the job at membership generation %d "
                    "(worker nodes %s); waiting for the state of worker node %d",
                    rt.node_id, generation, members, source)
        sent_for, blob = rt.engine.fetch_state(generation, source)
    blob = rt.setup_channel.broadcast_bytes(blob)
    state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    rt.joining = False
    rt.set_membership(state["generation"], state["members"])
    if rt.engine is not None:
        rt.engine.set_membership(state["generation"], state["members"])
        rt.engine.barriers = max(rt.engine.barriers, state["barriers"])  # the same numbers
    return state


def publish_if_joined(rt, before: Sequence[int], state: Callable[[], dict]) -> None:
    """After a step: where nodes joined since ``before`` (the members then), the
    lowest-numbered node that was present before sends ``state()`` for them."""
    now = set(rt.members)
    stayed = set(before) & now
    if not now - set(before) or not stayed or rt.engine is None or \
            rt.node_id != min(stayed):
        return
    buffer = io.BytesIO()
    torch.save({**state(), "generation": rt.generation, "members": sorted(now),
                "barriers": rt.engine.barriers}, buffer)
    blob = buffer.getvalue()
    rt.engine.publish_state(rt.generation, blob)
    log.warning("bps: worker node %d sent the training state (%d bytes) to worker node(s) "
                "%s, which join at membership generation %d", rt.node_id, len(blob),
                sorted(now - set(before)), rt.generation)


def front_end_state(core, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                    ) -> dict:
    """What every front end sends a joiner (``core``: its
    :class:`bps.core.frontend.FrontEndCore`): the model, the optimizer's state (None
    without one), the pipeline's counters and the local momentum of the parts that
    travel raw (the same on every node; none where the core has no pipeline of its own,
    a step mode's holding them) and the loss scale; not the chains' error feedback and
    momentum, which start at zero on the joiner."""
    pipe = core.pipeline
    counters = {} if pipe is None else {
        "step": pipe.step, "wire_step": pipe.wire_step,
        "local_momentum": pipe.momentum_state()}
    return {"model": model.state_dict(),
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            **counters, "scale": core.loss_scale.state()}


def load_model_state(state: dict, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None) -> None:
    """Load :func:`front_end_state`'s model and optimizer state; ``ValueError`` where
    the node that sent it had an optimizer's state and this one has no optimizer."""
    model.load_state_dict(state["model"])
    if state["optimizer"] is None:
        return
    if optimizer is None:
        raise ValueError("the node that sent the training state has an optimizer's state, "
                         "but this joining node has no optimizer to load it into (give "
                         "HookState optimizer=)")
    optimizer.load_state_dict(state["optimizer"])


def load_pipeline_state(core, state: dict) -> None:
    """Load :func:`front_end_state`'s counters, local momentum and loss scale into
    ``core`` (its pipeline built, where it has one)."""
    pipe = core.pipeline
    if pipe is not None:
        pipe.step, pipe.wire_step = int(state["step"]), int(state["wire_step"])
        pipe.load_momentum_state(state["local_momentum"])
    core.loss_scale.load(state["scale"])
