"""The optimizer's momentum, held by bps while Nesterov momentum runs in the chains.

Where the chain's momentum replaces the optimizer's, each group's ``momentum`` (and
``nesterov``) is set to 0 in the live optimizer, but a checkpoint must not lose it:
``optimizer.state_dict()`` reports the values the optimizer was given, and
``optimizer.load_state_dict()`` takes the values of the dict it loads and turns them off
again. So a resume finds the coefficient whatever the order of loading the optimizer and
building the trainer (or ``HookState``).

Example::

    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> hold(opt), opt.param_groups[0]["momentum"], opt.state_dict()["param_groups"][0]["momentum"]
    (True, 0.0, 0.9)
"""

from __future__ import annotations

import weakref

import torch

KEYS = ("momentum", "nesterov")
# optimizer -> the values of its groups as given (one dict per group)
_held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def given_momentum(optimizer: torch.optim.Optimizer) -> float:
    """The momentum of the first group as the optimizer was given it (0 if none)."""
    groups = _held.get(optimizer) or optimizer.param_groups
    return float(groups[0].get("momentum", 0.0) or 0.0)


def hold(optimizer: torch.optim.Optimizer) -> bool:
    """Turn the momentum (and Nesterov flag) off in every group, keeping the given values
    for the optimizer's ``state_dict()``; returns whether any group had momentum."""
    if optimizer not in _held:
        _held[optimizer] = _given(optimizer)
        optimizer.register_state_dict_post_hook(_report_given)
        optimizer.register_load_state_dict_post_hook(_hold_loaded)
    return _turn_off(optimizer)


def _given(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: group[k] for k in KEYS if k in group} for group in optimizer.param_groups]


def _turn_off(optimizer: torch.optim.Optimizer) -> bool:
    turned_off = False
    for group in optimizer.param_groups:
        if group.get("momentum"):
            group["momentum"] = 0.0
            turned_off = True
        if group.get("nesterov"):
            group["nesterov"] = False
    return turned_off


def _report_given(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """``state_dict()``'s post hook: the groups say the values they were given."""
    given = _held.get(optimizer, [])
    for saved, values in zip(state["param_groups"], given, strict=False):
        saved.update(values)
    return state


def _hold_loaded(optimizer: torch.optim.Optimizer) -> None:
    """``load_state_dict()``'s post hook: the loaded values are the given ones now."""
    _held[optimizer] = _given(optimizer)
    _turn_off(optimizer)
