"""Compressed Adam: Adam's momentum travels compressed, its variance frozen (1-bit Adam).

Sign compression with error feedback fed into Adam degrades: the second moment is not
linear in the gradient (Tang et al. 2021, 1-bit Adam). DeepSpeed's 1-bit Adam warms up
with plain Adam, then freezes the variance and compresses the momentum instead. Here
``compression_params["freeze_step"] = T`` with the user's ``torch.optim.Adam`` or
``AdamW`` does that (docs/trainer.md, "Compressed Adam")::

    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    >>> trainer = bps.DistributedTrainer(model, optimizer, {
    ...     "compressor": "onebit", "ef": "vanilla", "freeze_step": 60})

Steps ``0 .. T-1`` (warm-up): the gradient travels uncompressed (the pipeline's
``warmup_steps``) and every worker takes the same plain Adam step on the average::

    m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g * g
    x -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t) + eps)

From step ``T``: ``v`` stays as it is. Each worker forms its local momentum
``m_i = b1 * m + (1 - b1) * g_i`` (in ``.grad``), which travels through the chain
(compressor and error feedback on workers and servers); the average becomes ``m`` on
every worker, zero wherever ``v`` is zero (a momentum mask: an entry whose gradient
was zero through the whole warm-up keeps still, where sign compression would move
it), and ::

    x -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**T) + eps)

Adam's L2 ``weight_decay`` is added to the gradient (locally, before the momentum);
AdamW's decoupled decay ``x *= 1 - lr * weight_decay`` is applied by every worker on
its own, never sent. The state is the optimizer's own (``exp_avg``, ``exp_avg_sq``,
``step``), so ``optimizer.state_dict()`` holds it and the stage follows from the
pipeline's step. Every operation rounds on its own (no fused multiply-add), so a
numpy replay of the formulas is bit-identical.

The update runs in ``optimizer.step()`` (a step pre-hook) once a front end has armed
it with :meth:`AdamCoupling.arm`; the pre-hook hides the gradients of the parameters
it updated, so the optimizer's own step passes over them.
"""

from __future__ import annotations

import math

import torch

__all__ = ["AdamCoupling", "check_adam", "frozen_step_", "local_momentum_", "plain_step_"]


def check_adam(optimizer: torch.optim.Optimizer | None) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``optimizer`` is a ``torch.optim.Adam``
    or ``AdamW`` that compressed Adam can run (no ``amsgrad``, no ``maximize``)."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            "compression_params['freeze_step'] (compressed Adam) needs a torch.optim.Adam "
            f"or AdamW optimizer, got {type(optimizer).__name__}: its momentum is what "
            "travels after the freeze")
    for index, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "maximize"):
            if group.get(option):
                raise ValueError(f"compression_params['freeze_step'] (compressed Adam) does "
                                 f"not support {option}=True (param group {index})")


def plain_step_(x: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int,
                lr: float, b1: float, b2: float, eps: float, wd: float,
                decoupled: bool) -> None:
    """One plain Adam/AdamW step in place on ``x``, ``m``, ``v`` (``t``: its number, from
    1); ``g`` is not written.

        >>> x, g = torch.ones(2), torch.tensor([1.0, -1.0])
        >>> m, v = torch.zeros(2), torch.zeros(2)
        >>> plain_step_(x, g, m, v, 1, 0.1, 0.9, 0.999, 1e-8, 0.0, True); x
        tensor([0.9000, 1.1000])
    """
    if wd:
        if decoupled:
            x.mul_(1 - lr * wd)
        else:
            g = torch.add(g, torch.mul(x, wd))
    m.mul_(b1).add_(torch.mul(g, 1 - b1))
    v.mul_(b2).add_(torch.mul(torch.mul(g, g), 1 - b2))
    _descend(x, m, v, t, t, lr, b1, b2, eps)


def local_momentum_(g: torch.Tensor, m: torch.Tensor, x: torch.Tensor, b1: float, wd: float,
                    decoupled: bool) -> None:
    """``g = b1 * m + (1 - b1) * g`` in place (with Adam's L2 term ``wd * x`` in ``g``):
    this worker's momentum, what travels after the freeze.

        >>> g = torch.tensor([1.0]); local_momentum_(g, torch.tensor([2.0]), g, 0.5, 0, True)
        >>> g
        tensor([1.5000])
    """
    if wd and not decoupled:
        g.add_(torch.mul(x, wd))
    g.mul_(1 - b1).add_(torch.mul(m, b1))


def frozen_step_(x: torch.Tensor, avg: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 t: int, frozen_at: int, lr: float, b1: float, b2: float, eps: float,
                 wd: float, decoupled: bool) -> None:
    """The step after the freeze: ``m`` = the averaged momentum ``avg`` (zero where ``v``
    is), then ``x`` moves by it over the frozen ``v`` (its bias correction that of step
    ``frozen_at``); ``v`` is not written."""
    m.copy_(torch.where(v > 0, avg, torch.zeros_like(avg)))
    if wd and decoupled:
        x.mul_(1 - lr * wd)
    _descend(x, m, v, t, frozen_at, lr, b1, b2, eps)


def _descend(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int, t2: int, lr: float,
             b1: float, b2: float, eps: float) -> None:
    """``x -= lr / (1 - b1**t) * m / (sqrt(v) / sqrt(1 - b2**t2) + eps)``; the square
    root is taken in float64 and rounded once (torch's float32 one on CPU is not always
    the correctly rounded value)."""
    root = torch.sqrt(v.to(torch.float64)).to(v.dtype)
    denom = root.mul_(1 / math.sqrt(1 - b2 ** t2)).add_(eps)
    x.sub_(torch.div(m, denom).mul_(lr / (1 - b1 ** t)))


SKIPPED = "skipped"  # an armed step that applies nothing of ours


class AdamCoupling:
    """Compressed Adam bound to one ``torch.optim.Adam``/``AdamW`` (see the module).

    Args:
        optimizer: the user's Adam or AdamW (:func:`check_adam`).
        freeze_step: ``compression_params["freeze_step"]``: plain steps before the freeze.
        params: the parameters the front end averages (the others in the optimizer step
            as the optimizer does).

    A front end calls :meth:`local_momentum` on each gradient it pushes in a step with
    :meth:`frozen` true, :meth:`arm` before the ``optimizer.step()`` of an applied step,
    and :meth:`close` at the end.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, freeze_step: int,
                 params: list[torch.Tensor]) -> None:
        check_adam(optimizer)
        self.optimizer, self.freeze_step = optimizer, int(freeze_step)
        self._ours = {id(p) for p in params}
        self._groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        # the next optimizer.step(): frozen or plain, SKIPPED (touch none of ours) or None
        self._armed: bool | str | None = None
        self._hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hooks = [optimizer.register_step_pre_hook(self._before_step),
                       optimizer.register_step_post_hook(self._after_step)]

    def frozen(self, step: int) -> bool:
        """Whether applied step ``step`` (from 0) is after the freeze."""
        return step >= self.freeze_step

    def _group(self, param: torch.Tensor) -> dict:
        group = self._groups.get(id(param))
        groups = self.optimizer.param_groups  # new dicts after optimizer.load_state_dict
        if group is not None and any(g is group for g in groups):
            return group
        self._groups = {id(p): g for g in groups for p in g["params"]}
        if id(param) in self._groups:
            return self._groups[id(param)]
        raise ValueError(f"a parameter of shape {tuple(param.shape)} is not in the optimizer")

    def _state(self, param: torch.Tensor, group: dict) -> dict:
        """The optimizer's state of ``param``, created as torch's Adam creates it (the
        step on the parameter's device where the group is fused or capturable)."""
        state = self.optimizer.state[param]
        if "step" not in state:
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.tensor(0.0, dtype=torch.float32,
                                         device=param.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def local_momentum(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Turn ``grad`` (``param``'s gradient: its shape, any strides, or a contiguous
        flat view) into this worker's momentum, in place."""
        group = self._group(param)
        state = self._state(param, group)
        if grad.shape != param.shape:
            grad = grad.view(param.shape)
        with torch.no_grad():
            local_momentum_(grad, state["exp_avg"], param.detach(), group["betas"][0],
                            group["weight_decay"], self._decoupled(group))

    def arm(self, frozen: bool) -> None:
        """The next ``optimizer.step()`` applies the averages in ``.grad``: gradients
        (plain) or momenta (``frozen``)."""
        self._armed = frozen

    def skip(self) -> None:
        """The next ``optimizer.step()`` leaves the averaged parameters and their Adam
        state alone: the step was not applied (its ``.grad`` may hold NaN)."""
        self._armed = SKIPPED

    def disarm(self) -> None:
        """No step of ours is due (a step that was not applied)."""
        self._armed = None

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
                     ) -> tuple[tuple, dict] | None:
        """Apply the armed update; a step given a closure (as Lightning steps) runs the
        backward, which arms this step's update, inside: the update then follows it."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self._apply_armed(optimizer)
            return None

        def then_apply(*inner_args, **inner_kwargs):  # noqa: ANN202 - the closure's own
            result = closure(*inner_args, **inner_kwargs)
            self._apply_armed(optimizer)
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": then_apply}
        return (args[0], then_apply, *args[2:]), kwargs

    def _apply_armed(self, optimizer: torch.optim.Optimizer) -> None:
        frozen, self._armed = self._armed, None
        if frozen is None:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None or id(p) not in self._ours:
                        continue
                    if frozen is not SKIPPED:
                        self._update(p, p.grad, group, frozen)
                    self._hidden.append((p, p.grad))
                    p.grad = None  # the optimizer's own step passes over it

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        hidden, self._hidden = self._hidden, []
        for p, grad in hidden:
            p.grad = grad

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict, frozen: bool) -> None:
        state = self._state(p, group)
        state["step"] += 1
        t = int(state["step"].item())
        b1, b2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        m, v = state["exp_avg"], state["exp_avg_sq"]  # elementwise: any strides
        if frozen:
            frozen_step_(p, grad, m, v, t, self.freeze_step, lr, b1, b2, eps, wd,
                         self._decoupled(group))
        else:
            plain_step_(p, grad, m, v, t, lr, b1, b2, eps, wd, self._decoupled(group))

    def close(self) -> None:
        """Take the hooks off the optimizer."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _decoupled(self, group: dict) -> bool:
        """AdamW's decoupled weight decay (torch's ``decoupled_weight_decay``)."""
        return bool(group.get("decoupled_weight_decay",
                              isinstance(self.optimizer, torch.optim.AdamW)))
