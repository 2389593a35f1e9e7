"""The compression_params keys every configuration shares, and the rules a key obeys.

``bps.compressors.validate_compression_params`` checks a whole dict: the keys below here,
then the keys of the chosen compressor, which its class declares in its own file as a
table of :class:`Key`. This module knows no compressor (it sits below them)::

    >>> from bps.common.config import Key, check_shared, integer, shared_defaults
    >>> params = {**shared_defaults(), "compressor": "topk", "warmup_steps": 2}
    >>> check_shared(params, {"warmup_steps": 2}, ("onebit", "topk"))
    >>> params["comm_dtype"], params["fp16"]
    ('fp16', True)
    >>> Key(integer(1, 2**31), required="an int >= 1").check("chunk", 64)
    64

Shared keys: ``compressor``, ``ef``, ``momentum``, ``mu``, ``seed``, ``fp16``,
``comm_dtype``, ``min_compress_bytes``, ``warmup_steps``, ``nonfinite``, ``freeze_step``.
``ef``, ``warmup_steps`` and ``freeze_step`` need a compressor; ``mu`` needs
``momentum``; the others apply to any configuration. ``freeze_step`` (compressed Adam,
:mod:`bps.core.compressed_adam`) also sets ``warmup_steps``: its plain steps travel
uncompressed. ``mu`` and ``seed`` stay ``None`` when absent: the trainer fills them in
(optimizer momentum, job seed) before building chains.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from bps.common.env import min_compress_bytes

# comm_dtype: the name of its torch dtype (``getattr(torch, name)``)
COMM_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
# the shared keys and their values where absent (min_compress_bytes: from the environment)
SHARED_DEFAULTS: dict[str, Any] = {
    "compressor": None,
    "ef": None,
    "momentum": None,
    "mu": None,
    "seed": None,
    "fp16": True,
    "comm_dtype": None,  # "fp16" (= fp16 True), "bf16" or "fp32" (= fp16 False)
    "min_compress_bytes": None,
    "warmup_steps": 0,
    "nonfinite": "raise",
    "freeze_step": None,  # compressed Adam: plain steps before the variance freezes
}
# shared keys that do something only with a compressor
NEED_A_COMPRESSOR = ("ef", "warmup_steps", "freeze_step")

Check = Callable[[str, Any], Any]


def shared_defaults() -> dict[str, Any]:
    """A new dict of the shared keys at their defaults."""
    return dict(SHARED_DEFAULTS)


def is_int(value: Any) -> bool:
    """An integer that is not a bool (numpy's included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A real number that is not a bool (numpy's included)."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def fail(exc: type[Exception], key: str, value: Any, accepted: str) -> Exception:
    """The error that names a key, its value and what it accepts::

        >>> fail(ValueError, "k", 0, "an int >= 1")
        ValueError("compression_params['k'] = 0 is invalid: expected an int >= 1")
    """
    return exc(f"compression_params[{key!r}] = {value!r} is invalid: expected {accepted}")


# rules: check(key, value) returns the value to keep or raises the error naming the key

def boolean(key: str, value: Any) -> bool:
    """A bool (numpy's too), kept as a Python bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise fail(TypeError, key, value, "a bool (True or False)")
    return bool(value)


def choice(*choices: str, absent: bool = False) -> Check:
    """One of ``choices`` (``absent``: or None)."""
    accepted = " or ".join(repr(c) for c in choices) + (" (or absent)" if absent else "")

    def check(key: str, value: Any) -> Any:
        if value is None and absent:
            return None
        if not isinstance(value, str):
            raise fail(TypeError, key, value, accepted)
        if value not in choices:
            raise fail(ValueError, key, value, accepted)
        return value

    return check


def integer(lo: int, hi: int | None = None, accepted: str | None = None) -> Check:
    """An int in ``[lo, hi)`` (no upper bound where ``hi`` is None)."""
    accepted = accepted or (f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi})")

    def check(key: str, value: Any) -> int:
        if not is_int(value):
            raise fail(TypeError, key, value, accepted)
        if value < lo or (hi is not None and value >= hi):
            raise fail(ValueError, key, value, accepted)
        return int(value)

    return check


def real(lo: float) -> Check:
    """A finite number >= ``lo``, kept as a float."""
    accepted = f"a finite number >= {lo}"

    def check(key: str, value: Any) -> float:
        if not is_real(value):
            raise fail(TypeError, key, value, accepted)
        if not (math.isfinite(float(value)) and float(value) >= lo):
            raise fail(ValueError, key, value, accepted)
        return float(value)

    return check


@dataclass(frozen=True)
class Key:
    """A key of a compressor's own: an entry of its class's ``keys`` table.

    ``check(key, value)`` returns the value to keep or raises a TypeError/ValueError
    naming the key (:func:`fail`). ``default``: the value where absent; given at it, any
    configuration accepts the key. ``fill``: the value with this compressor where absent
    (``None``: the default). ``required``: with this compressor the key must be given;
    the text says what it may be.

        >>> Key(boolean, fill=True).checked("scaling", False)
        False
    """

    check: Check
    default: Any = None
    fill: Any = None
    required: str | None = None

    def checked(self, key: str, value: Any) -> Any:
        """``value`` as kept: the default as it is, else what ``check`` returns."""
        if value is self.default or (type(value) is type(self.default)
                                     and value == self.default):
            return value
        return self.check(key, value)

    def is_default(self, value: Any) -> bool:
        """Whether ``value`` equals the default (then any configuration accepts it)."""
        try:
            return bool(value == self.default)
        except (TypeError, ValueError):  # an array compares element by element
            return False


def refuse_unused(key: str, value: Any, compressor: str | None,
                  users: tuple[str, ...]) -> ValueError:
    """The error for a key given where it does nothing, naming the compressors that use it."""
    names = " or ".join(repr(n) for n in users)
    which = "no compressor" if compressor is None else f"compressor {compressor!r}"
    return ValueError(f"compression_params[{key!r}] = {value!r} does not apply to {which}: "
                      f"it is only used by compressor {names}; remove it")


def _check_comm_dtype(params: dict, given: dict) -> None:
    """``comm_dtype`` and the older ``fp16`` describe one setting: fill each from the
    other; a pair that contradicts itself is refused. ``fp16`` comes out True exactly
    for ``"fp16"``."""
    params["fp16"] = boolean("fp16", params["fp16"])
    comm = params["comm_dtype"]
    if comm is None:
        params["comm_dtype"] = "fp16" if params["fp16"] else "fp32"
        return
    choice(*COMM_DTYPES, absent=True)("comm_dtype", comm)
    if "fp16" in given and params["fp16"] != (comm == "fp16"):
        raise ValueError(
            f"compression_params['fp16'] = {params['fp16']!r} contradicts "
            f"compression_params['comm_dtype'] = {comm!r}: fp16 True means 'fp16', "
            "False means 'bf16' or 'fp32'; give comm_dtype alone")
    params["fp16"] = comm == "fp16"


def _check_freeze_step(params: dict, given: dict) -> None:
    """``freeze_step``: None, or an int >= 1 with a compressor, no chain momentum and no
    ``warmup_steps`` of its own; it becomes ``warmup_steps`` (the plain steps travel
    uncompressed, the momentum after them compressed)."""
    step = params["freeze_step"]
    if step is None:
        return
    params["freeze_step"] = step = integer(1)("freeze_step", step)
    if params["compressor"] is None:
        return  # refused below, naming the compressors
    if params["momentum"] is not None:
        raise ValueError(
            f"compression_params['freeze_step'] = {step} (compressed Adam) does not go "
            "with compression_params['momentum']: Adam's own momentum is what travels; "
            "remove 'momentum'")
    if given.get("warmup_steps", 0) not in (0, step):
        raise ValueError(
            f"compression_params['warmup_steps'] = {given['warmup_steps']!r} contradicts "
            f"compression_params['freeze_step'] = {step}: the steps before the freeze "
            "are the uncompressed ones; remove 'warmup_steps'")
    params["warmup_steps"] = step


def check_shared(params: dict, given: dict, compressors: tuple[str, ...]) -> None:
    """Check the shared keys of ``params`` (every key present) in place and fill in their
    defaults. ``given``: the caller's dict, to tell a key given from one filled in;
    ``compressors``: the names ``compressor`` may take.

    Raises TypeError or ValueError naming the key, the value and what is accepted; a
    shared key that needs what the configuration lacks (``ef`` without a compressor,
    ``mu`` without ``momentum``) is refused with ValueError.
    """
    if params["compressor"] is not None:
        choice(*compressors)("compressor", params["compressor"])
    params["ef"] = choice("vanilla", absent=True)("ef", params["ef"])
    params["momentum"] = choice("nesterov", absent=True)("momentum", params["momentum"])
    params["nonfinite"] = choice("raise", "skip")("nonfinite", params["nonfinite"])
    _check_comm_dtype(params, given)
    if params["mu"] is not None:
        mu = params["mu"]
        if not is_real(mu):
            raise fail(TypeError, "mu", mu, "a float in [0, 1)")
        if not 0.0 <= float(mu) < 1.0:
            raise fail(ValueError, "mu", mu, "a float in [0, 1)")
        params["mu"] = float(mu)
    if params["seed"] is not None:
        params["seed"] = integer(1, 2**64)("seed", params["seed"])
    if params["min_compress_bytes"] is None:
        params["min_compress_bytes"] = min_compress_bytes()
    else:
        params["min_compress_bytes"] = integer(0)("min_compress_bytes",
                                                  params["min_compress_bytes"])
    params["warmup_steps"] = integer(0)("warmup_steps", params["warmup_steps"])
    if params["compressor"] is None:
        for key in NEED_A_COMPRESSOR:
            if key in given and given[key] != SHARED_DEFAULTS[key]:
                raise refuse_unused(key, given[key], None, compressors)
    _check_freeze_step(params, given)
    if given.get("mu") is not None and params["momentum"] is None:
        raise ValueError(f"compression_params['mu'] = {given['mu']!r} does not apply "
                         "without compression_params['momentum'] = 'nesterov': remove it "
                         "(the optimizer's own momentum stays in the optimizer)")
