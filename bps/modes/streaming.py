"""Streaming outer syncs: ``DistributedTrainer(..., sync_every=H, fragments=F, overlap=T)``.

Periodic averaging (:mod:`bps.modes.periodic`) stops every worker at each sync until
the whole model's pseudo-gradient went to the servers and came back. Here the
parameters are cut into ``F`` fragments, synced in a fixed order one every ``H / F``
local steps, so the wire carries a steady trickle instead of a burst (Streaming
DiLoCo's fragments), and each fragment's push and pull run while the next ``T`` local
steps compute (its overlap)::

    >>> trainer = bps.DistributedTrainer(model, optimizer, {"compressor": "onebit",
    ...                                  "ef": "vanilla"}, sync_every=16, fragments=4,
    ...                                  overlap=4)
    >>> for x, y in loader:           # the loop does not change
    ...     trainer.zero_grad()
    ...     loss_fn(model(x), y).backward()
    ...     trainer.step()            # every 4th step pushes a quarter of the model

The schedule, with ``s`` the local steps taken so far (after this step's optimizer
step) and ``P = H / F``: at ``s = k * P`` fragment ``(k - 1) % F`` pushes its
pseudo-gradient ``delta = anchor - w`` (float32, through the trainer's chains and
servers, divided by the number of workers), and at ``s + T`` its aggregate lands:

* the outer update moves the fragment's anchor: ``anchor' = outer(anchor, avg)``
  (:func:`bps.modes.periodic.outer_update`);
* the local progress made since the push is kept: ``w = anchor' + (w - w_at_push)``.
  Streaming DiLoCo mixes the global and the local parameters with a factor instead;
  adding the local change keeps every local step exactly once, as the next round's
  delta (``anchor' - w``) then holds it, and with ``T = 0`` it is periodic averaging.

Every chain, the error feedback and the servers are those of periodic averaging: each
fragment has its own pipeline, whose keys travel every ``H`` steps. A landing that
has not arrived blocks that step until it has, so every worker applies it at the same
step and a run is deterministic. Floating-point buffers travel with the last fragment
(uncompressed) and merge the same way: their mean at the push plus the local change
since. A fragment is a run of parameter rows in model order holding about ``1/F`` of
the elements (a large matrix may be cut between rows); its partitions are cut small
enough to spread it over every server.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bps.core.frontend import FrontEndCore
from bps.core.grad_pipeline import GradPipeline, GradTensor, Skipped
from bps.modes.base import StepMode
from bps.modes.periodic import (
    BufferAverage,
    OuterSpec,
    PendingBuffers,
    outer_update,
    warn_outer_defaults,
)


def validate_streaming(sync_every: int, fragments: Any, overlap: Any) -> bool:
    """Check ``fragments`` and ``overlap`` against a checked ``sync_every``; returns
    whether they ask for streaming syncs (else periodic averaging or synchronous
    steps). Raises ``ValueError`` naming the argument.

    >>> validate_streaming(8, 4, 2)
    True
    >>> validate_streaming(8, 1, 0)
    False
    """
    for name, value, low in (("fragments", fragments, 1), ("overlap", overlap, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is invalid: expected an int >= {low}")
    if fragments == 1 and overlap == 0:
        return False
    if sync_every == 1:
        raise ValueError(f"fragments={fragments}, overlap={overlap} need sync_every > 1 "
                         "(they stream the outer syncs of periodic averaging)")
    if sync_every % fragments:
        raise ValueError(f"fragments={fragments} does not divide sync_every={sync_every}: "
                         "a fragment syncs every sync_every / fragments local steps")
    if overlap > sync_every:
        raise ValueError(f"overlap={overlap} is larger than sync_every={sync_every}: a "
                         "fragment's aggregate must land before its next push")
    return True


def plan_fragments(tensors: list[GradTensor], fragments: int) -> list[list[GradTensor]]:
    """Cut the parameters, in order, into ``fragments`` runs of rows of about equal
    element counts: row ``r`` of a tensor goes to the fragment its middle element falls
    in. A tensor cut between fragments becomes row slices named ``name[a:b]``.

    >>> ts = [GradTensor("w", torch.zeros(4, 3), 0), GradTensor("b", torch.zeros(4), 0)]
    >>> [[t.name for t in f] for f in plan_fragments(ts, 2)]
    [['w[0:3]'], ['w[3:4]', 'b']]
    """
    total = sum(t.param.numel() for t in tensors)
    plan: list[list[GradTensor]] = [[] for _ in range(fragments)]
    done = 0
    for tensor in tensors:
        p = tensor.param
        rows = p.shape[0] if p.dim() > 0 else 1
        width = p.numel() // rows if rows else 0
        owner = [min(fragments - 1, int((done + width * r + width / 2) * fragments // total))
                 for r in range(rows)]
        done += p.numel()
        start = 0
        while start < rows:
            stop = start
            while stop < rows and owner[stop] == owner[start]:
                stop += 1
            whole = start == 0 and stop == rows
            piece = p if whole else p[start:stop]
            name = tensor.name if whole else f"{tensor.name}[{start}:{stop}]"
            plan[owner[start]].append(GradTensor(name, piece, tensor.group))
            start = stop
    empty = [f for f, part in enumerate(plan) if not part]
    if empty:
        raise ValueError(f"fragments={fragments} leaves fragment {empty[0]} without "
                         "parameters (a single row holds more than 1/fragments of the "
                         "model's elements): use fewer fragments")
    return plan


def spread_bytes(fragment: list[GradTensor], env) -> int:
    """The partition size that spreads a fragment over every server: at most
    ``BYTEPS_PARTITION_BYTES``, at most the fragment's float32 bytes over the servers
    (a fragment on one server would put every node's round on that server's link).

    >>> from types import SimpleNamespace
    >>> spread_bytes([GradTensor("w", torch.zeros(1000, 100), 0)],
    ...              SimpleNamespace(partition_bytes=4096000, num_servers=4))
    100000
    """
    floats = sum(t.param.numel() for t in fragment)
    per_server = -(-floats // env.num_servers)
    return max(4, min(env.partition_bytes, 4 * per_server))


@dataclass
class Round:
    """A fragment's sync in flight: pushed after local step ``pushed_at``, lands after
    ``lands_at``. ``start``: its parameters (float32) when pushed; ``wire``: source and
    destination of the pushes, then the aggregate; ``skip``: why it is applied nowhere
    (once settled)."""

    fragment: int
    pushed_at: int
    lands_at: int
    start: list[torch.Tensor]
    wire: list[torch.Tensor]
    buffers: PendingBuffers | None = None
    settled: bool = False
    skip: Skipped | None = None
    generation: int = 0  # the membership generation its pushes were divided by


class StreamingAveraging(StepMode):
    """Periodic averaging in overlapped fragments (see the module's docstring)."""

    pushes_during_backward = False
    name = "sync_every > 1 with fragments or overlap"

    def __init__(self, core: FrontEndCore, fragments: list[list[GradTensor]], every: int,
                 spec: OuterSpec, overlap: int) -> None:
        super().__init__(core)
        self.every, self.spec, self.overlap = every, spec, overlap
        self.period = every // len(fragments)
        core.chain_lr_override = lambda group: spec.lr  # error feedback's ratio: the outer lr
        warn_outer_defaults(core, every, spec)
        self.fragments = fragments
        self.pipes: list[GradPipeline] = [
            core.new_pipeline(f, partition_bytes=spread_bytes(f, core.runtime.env))
            for f in fragments]
        self.anchor = [[t.param.detach().reshape(-1).float().clone() for t in f]
                       for f in fragments]
        self.momentum = [[torch.zeros_like(a) for a in f] for f in self.anchor] \
            if spec.momentum else None
        self.local = 0  # local steps taken
        self.rounds: list[Round] = []  # in flight, in push order
        self.snapshot = core.stats.snapshot(core.runtime.engine)
        self.buffers = BufferAverage(core)

    # -- a step ---------------------------------------------------------------------

    def step(self, scaler: torch.amp.GradScaler | None = None) -> bool:
        """A local step; lands the rounds due now, then pushes the fragment due now.
        Returns False where a round that landed was skipped everywhere (a non-finite
        delta), else True."""
        core = self.core
        called = time.monotonic_ns()
        if scaler is not None:
            scaler.step(core.optimizer)
            scaler.update()
        else:
            core.optimizer.step()
        self.local += 1
        skipped: list[tuple[Skipped, int]] = []
        raw = 0
        for due in [r for r in self.rounds if r.lands_at == self.local]:
            if not self._land(due):
                skipped.append((due.skip, due.pushed_at))
        if self.local % self.period == 0:
            fragment = (self.local // self.period - 1) % len(self.pipes)
            raw += self.pipes[fragment].raw_bytes
            pushed = self._push(fragment)
            if self.overlap == 0 and not self._land(pushed):
                skipped.append((pushed.skip, pushed.pushed_at))
        wait = (time.monotonic_ns() - called) / 1e9
        nonfinite = [(s, n) for s, n in skipped if s.reason == "nonfinite"]
        core.record(self.snapshot, self.local, raw, wait, core.passes, bool(nonfinite),
                    core.samples * core.runtime.local_size)
        self.snapshot = core.stats.snapshot(core.runtime.engine)
        if nonfinite:
            error = core.nonfinite_error(*nonfinite[0])
            if error is not None:
                raise error
        return not skipped

    def _push(self, fragment: int) -> Round:
        """Start fragment ``fragment``'s round: its pseudo-gradient into the pipeline
        (the buffers' mean with the last fragment)."""
        pipe = self.pipes[fragment]
        start, wire = [], []
        with torch.no_grad():
            for index, (tensor, anchor) in enumerate(zip(self.fragments[fragment],
                                                         self.anchor[fragment], strict=True)):
                now = tensor.param.detach().reshape(-1).float()
                start.append(now.clone())
                delta = torch.sub(anchor, now)
                out = torch.empty(tensor.param.numel(), dtype=tensor.param.dtype,
                                  device=tensor.param.device)
                out.copy_(delta)
                wire.append(out)
                pipe.push(index, out, out)
        due = Round(fragment, self.local, self.local + self.overlap, start, wire,
                    generation=self.core.runtime.generation)
        if fragment == len(self.pipes) - 1 and self.buffers:
            due.buffers = self.buffers.push(pipe.wire_step)
        self.rounds.append(due)
        return due

    def _settle(self, due: Round) -> None:
        """Wait for a round's aggregates (in ``wire``) and settle its pipeline step."""
        if due.settled:
            return
        pipe = self.pipes[due.fragment]
        pipe.wait()
        due.skip = pipe.finish()
        pipe.end_step(due.skip is None)
        due.settled = True

    def _land(self, due: Round) -> bool:
        """Apply a round: the outer update of its fragment's anchor, the local change
        since its push kept; a round skipped everywhere (a non-finite delta) puts the
        fragment back to its anchor on every worker, as periodic averaging does.
        Returns whether it was applied."""
        self._settle(due)
        self.rounds.remove(due)
        applied = due.skip is None
        moved = due.lands_at != due.pushed_at
        with torch.no_grad():
            for index, tensor in enumerate(self.fragments[due.fragment]):
                anchor = self.anchor[due.fragment][index]
                if applied:
                    momentum = None if self.momentum is None else \
                        self.momentum[due.fragment][index]
                    outer_update(anchor, due.wire[index].float(), momentum, self.spec)
                flat = tensor.param.view(-1)
                if moved and applied:
                    local = torch.sub(flat.float(), due.start[index])
                    flat.copy_(torch.add(anchor, local))
                else:  # a skipped round also drops the local steps since its push
                    flat.copy_(anchor)
        if due.buffers is not None:
            self._land_buffers(due.buffers, applied, moved)
        return applied

    # -- buffers --------------------------------------------------------------------

    def _land_buffers(self, pushed: PendingBuffers, applied: bool, moved: bool) -> None:
        """The buffers' mean at the push, plus the local change since where it moved."""
        mean = self.buffers.mean(pushed)
        if not applied:
            return
        offset = 0
        for buffer in self.buffers.tensors:
            n = buffer.numel()
            value = mean[offset:offset + n]
            if moved:  # entries not averaged (inf, NaN; a mean dropped) keep what they are
                now, start = buffer.reshape(-1).float(), pushed.start[offset:offset + n]
                averaged = torch.isfinite(start) & ~torch.isnan(pushed.mean[offset:offset + n])
                value = torch.where(averaged, torch.add(value, torch.sub(now, start)), now)
            buffer.copy_(value.view_as(buffer))
            offset += n

    # -- checkpoints, close -----------------------------------------------------------

    def before_checkpoint(self) -> None:
        for due in self.rounds:  # the rounds change the chains: settle them first
            self._settle(due)
            if due.buffers is not None:
                self.buffers.pull(due.buffers)

    def close(self) -> None:
        """Wait for the rounds in flight (they are not applied) and stop the pipelines."""
        self.before_checkpoint()
        self.rounds = []
        for pipe in self.pipes:
            pipe.close()

    def state_dict(self) -> dict:
        """The local step count, anchors, outer momentum, each fragment's pipeline
        state, and the rounds in flight, settled: their aggregates wait to land."""
        self.before_checkpoint()
        core = self.core
        return {**self._outer_state(),
                "pipelines": [core.pipeline_state(pipe) for pipe in self.pipes],
                "rounds": [self._round_state(due) for due in self.rounds]}

    def load_state_dict(self, state: dict | None) -> None:
        if state is None or "pipelines" not in state:
            raise ValueError("state_dict has no streaming state (saved by a trainer "
                             "without fragments or overlap?)")
        self._load_outer_state(state, "load_state_dict()")
        for pipe, saved in zip(self.pipes, state["pipelines"], strict=True):
            self.core.load_pipeline_state(pipe, saved)
        self.rounds = [self._loaded_round(saved) for saved in state["rounds"]]

    def join_state(self) -> dict:
        """For a node joining now (the step that the join dropped just landed): the
        rounds pushed before the membership that counts the joiner do not wait for it:
        they are settled and travel as in :meth:`state_dict`. A round pushed since (this
        step's) was divided by the new membership and waits for the joiner's push: it
        travels unsettled, for the joiner to take part in. No chain travels: the
        joiner's start at zero."""
        generation = self.core.runtime.generation
        for due in self.rounds:
            if due.generation < generation:
                self._settle(due)
                if due.buffers is not None:
                    self.buffers.pull(due.buffers)
        return {**self._outer_state(),
                "pipelines": [{"step": pipe.step, "wire_step": pipe.wire_step,
                               "local_momentum": pipe.momentum_state()} for pipe in self.pipes],
                "rounds": [self._round_state(due) for due in self.rounds if due.settled],
                "joining": [{"fragment": due.fragment, "pushed_at": due.pushed_at,
                             "lands_at": due.lands_at} for due in self.rounds
                            if not due.settled]}

    def load_join_state(self, state: dict | None) -> None:
        """The joiner takes the counters, anchors and settled rounds, and takes part in
        each unsettled round with zero markers (it made no local steps for it; its
        buffers, a copy of the sender's, go with the last fragment's); its first landing
        applies the aggregate with everyone, keeping its local change since."""
        if state is None or "joining" not in state:
            raise ValueError("the joining state has no streaming state")
        self._load_outer_state(state, "a join")
        for pipe, saved in zip(self.pipes, state["pipelines"], strict=True):
            pipe.load_momentum_state(saved["local_momentum"])
            pipe.step, pipe.wire_step = int(saved["step"]), int(saved["wire_step"])
        self.rounds = [self._loaded_round(saved) for saved in state["rounds"]]
        for joining in state["joining"]:
            fragment, pipe = joining["fragment"], self.pipes[joining["fragment"]]
            tensors = [t.param for t in self.fragments[fragment]]
            start = [p.detach().reshape(-1).float().clone() for p in tensors]
            wire = [torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in tensors]
            for index, out in enumerate(wire):
                pipe.push(index, None, out, joined=True)
            due = Round(fragment, joining["pushed_at"], joining["lands_at"], start, wire,
                        generation=self.core.runtime.generation)
            if fragment == len(self.pipes) - 1 and self.buffers:
                due.buffers = self.buffers.push(pipe.wire_step)
            self.rounds.append(due)

    def _outer_state(self) -> dict:
        return {"local": self.local,
                "anchor": [[a.clone() for a in f] for f in self.anchor],
                "momentum": None if self.momentum is None else
                [[m.clone() for m in f] for f in self.momentum]}

    def _load_outer_state(self, state: dict, what: str) -> None:
        if len(state["pipelines"]) != len(self.pipes):
            raise ValueError(f"the state was saved with {len(state['pipelines'])} "
                             f"fragments, this trainer has {len(self.pipes)}")
        if self.rounds:
            raise RuntimeError(f"{what} with fragments or overlap must come before the "
                               "first step()")
        self.local = int(state["local"])
        for mine, saved in zip(self.anchor, state["anchor"], strict=True):
            for a, s in zip(mine, saved, strict=True):
                a.copy_(s)
        if self.momentum is not None:
            for mine, saved in zip(self.momentum, state["momentum"], strict=True):
                for m, s in zip(mine, saved, strict=True):
                    m.copy_(s)

    @staticmethod
    def _round_state(due: Round) -> dict:
        """A settled round, as it travels in a state."""
        buffers = None if due.buffers is None else \
            (due.buffers.start.clone(), due.buffers.mean.clone())
        return {"fragment": due.fragment, "pushed_at": due.pushed_at,
                "lands_at": due.lands_at, "start": [t.clone() for t in due.start],
                "aggregate": [t.clone() for t in due.wire],
                "skip": None if due.skip is None else asdict(due.skip), "buffers": buffers}

    @staticmethod
    def _loaded_round(saved: dict) -> Round:
        buffers = None if saved["buffers"] is None else \
            PendingBuffers(saved["buffers"][0].clone(), saved["buffers"][1].clone())
        skip = None if saved["skip"] is None else Skipped(**saved["skip"])
        return Round(saved["fragment"], saved["pushed_at"], saved["lands_at"],
                     [t.clone() for t in saved["start"]],
                     [t.clone() for t in saved["aggregate"]], buffers, settled=True, skip=skip)
