"""Validation of ``compression_params`` (docs/compression.md), in one place.

Used by :func:`bps.compressors.build` and by the trainer, so a bad dict is rejected
before any communication starts::

    >>> from bps.common.config import validate_compression_params, resolve_k
    >>> p = validate_compression_params({"compressor": "topk", "k": 0.01, "ef": "vanilla"})
    >>> p["k"], p["partition"], p["mu"]
    (0.01, 'linear', None)
    >>> validate_compression_params({"compressor": "onebit"})["scaling"]
    True
    >>> resolve_k(p, 1000)
    10

A key that does not apply to the configuration (``k`` with onebit, ``scaling`` with
topk, ``ef`` without a compressor, ...) is refused with a ``ValueError`` naming it,
unless it holds its default. ``mu`` and ``seed`` stay ``None`` when absent: the trainer
fills them in (optimizer momentum, job seed) before building chains. The accepted
compressor names are the built-in ones plus those :func:`bps.compressors.register` adds
(it calls :func:`accept_compressor`), so this module imports nothing of the compressors.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from bps.common.env import min_compress_bytes

BUILTIN_COMPRESSORS = ("onebit", "topk", "randomk", "dithering", "bytegrad", "powersgd")
COUNT_COMPRESSORS = ("topk", "randomk")
# Implementation limits on the dithering levels s, so that every q fits the Elias-delta
# coder's 32-bit fields (linear: u is a float32, exact up to 2**24).
MAX_LINEAR_LEVELS = 2**24
MAX_NATURAL_LEVELS = 31
BYTEGRAD_CHUNK = 1024  # bytegrad's default elements per (lo, hi) pair
MAX_CHUNK = 2**31 - 1

DEFAULTS: dict[str, Any] = {
    "compressor": None,
    "k": None,
    "scaling": None,  # onebit: True (scaled signs); BytePS's plain signs: False
    "ef": None,
    "momentum": None,
    "mu": None,
    "seed": None,
    "partition": "linear",
    "normalize": "max",
    "fp16": True,
    "min_compress_bytes": None,  # filled from the environment at validation time
    "warmup_steps": 0,
    "nonfinite": "raise",
    "chunk": None,  # bytegrad: BYTEGRAD_CHUNK
    "comm_dtype": None,  # "fp16" (= fp16 True), "bf16" or "fp32" (= fp16 False)
    # powersgd (PyTorch's PowerSGDState options; start step = warmup_steps, seed = seed)
    "rank": None,
    "warm_start": True,
    "orthogonalization_epsilon": 0.0,
    "min_compression_rate": 2.0,
    "batch_tensors_with_same_shape": False,
    "shape": None,  # set per key by the trainer: (n, m) or (batch, n, m)
}
POWERSGD_KEYS = ("rank", "warm_start", "orthogonalization_epsilon", "min_compression_rate",
                 "batch_tensors_with_same_shape", "shape")
# The built-in compressors each key is for; a key given with another one (or with none)
# is refused unless it holds its default. A registered compressor's factory reads what
# it needs, so it is given every key. ``seed`` (the job's) and ``min_compress_bytes``,
# ``comm_dtype``, ``fp16``, ``nonfinite``, ``momentum`` apply to any configuration.
KEY_APPLIES_TO: dict[str, tuple[str, ...]] = {
    "k": ("topk", "randomk", "dithering"),
    "scaling": ("onebit",),
    "partition": ("dithering",),
    "normalize": ("dithering",),
    "chunk": ("bytegrad",),
    **{key: ("powersgd",) for key in POWERSGD_KEYS},
    "ef": BUILTIN_COMPRESSORS,
    "warmup_steps": BUILTIN_COMPRESSORS,
}
# comm_dtype: the name of its torch dtype (``getattr(torch, name)``)
COMM_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _fail(exc: type[Exception], key: str, value: Any, accepted: str) -> Exception:
    return exc(f"compression_params[{key!r}] = {value!r} is invalid: expected {accepted}")


def _check_choice(params: dict, key: str, choices: tuple, allow_none: bool = True) -> None:
    value = params[key]
    if value is None and allow_none:
        return
    accepted = " or ".join(repr(c) for c in choices) + (" (or absent)" if allow_none else "")
    if not isinstance(value, str):
        raise _fail(TypeError, key, value, accepted)
    if value not in choices:
        raise _fail(ValueError, key, value, accepted)


def _check_bool(params: dict, key: str) -> None:
    value = params[key]
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(TypeError, key, value, "a bool (True or False)")
    params[key] = bool(value)


def _check_int(params: dict, key: str, lo: int, hi: int | None = None) -> None:
    value = params[key]
    accepted = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi})"
    if not _is_int(value):
        raise _fail(TypeError, key, value, accepted)
    if value < lo or (hi is not None and value >= hi):
        raise _fail(ValueError, key, value, accepted)
    params[key] = int(value)


_accepted: list[str] = list(BUILTIN_COMPRESSORS)


def accepted_compressors() -> tuple[str, ...]:
    """The compressor names ``compression_params['compressor']`` may take, in order."""
    return tuple(_accepted)


def accept_compressor(name: str) -> None:
    """Accept ``name`` as a compressor (called by :func:`bps.compressors.register`)."""
    if name not in _accepted:
        _accepted.append(name)


def forget_compressor(name: str) -> None:
    """Stop accepting a user compressor's name (built-in ones stay)."""
    if name in _accepted and name not in BUILTIN_COMPRESSORS:
        _accepted.remove(name)


def _check_k(params: dict) -> None:
    name, k = params["compressor"], params["k"]
    if name == "dithering":
        if k is None:
            raise ValueError(
                "compression_params['k'] is required for compressor 'dithering': "
                "expected an int >= 1 (number of levels s)"
            )
        natural = params["partition"] == "natural"
        hi = MAX_NATURAL_LEVELS if natural else MAX_LINEAR_LEVELS
        accepted = f"an int in [1, {hi}] (levels s, {params['partition']} partition)"
        if not _is_int(k):
            raise _fail(TypeError, "k", k, accepted)
        if not 1 <= k <= hi:
            raise _fail(ValueError, "k", k, accepted)
        params["k"] = int(k)
        return
    accepted = "an int >= 1 (count) or a float in (0, 1) (fraction of the partition)"
    if k is None:
        if name in COUNT_COMPRESSORS:
            raise ValueError(f"compression_params['k'] is required for compressor {name!r}: "
                             f"expected {accepted}")
        return
    if _is_int(k):
        if k < 1:
            raise _fail(ValueError, "k", k, accepted)
        params["k"] = int(k)
    elif _is_real(k):
        if not 0.0 < float(k) < 1.0:  # also rejects NaN
            raise _fail(ValueError, "k", k, accepted)
        params["k"] = float(k)
    else:
        raise _fail(TypeError, "k", k, accepted)


def _check_chunk(params: dict) -> None:
    """``chunk``: bytegrad's elements per (lo, hi) pair."""
    if params["chunk"] is None:
        if params["compressor"] == "bytegrad":
            params["chunk"] = BYTEGRAD_CHUNK
        return
    _check_int(params, "chunk", 1, MAX_CHUNK + 1)


def _check_applies(params: dict, given: dict) -> None:
    """Refuse a key given with a value other than its default where it does nothing:
    one rule for every key of :data:`KEY_APPLIES_TO` (``mu``: only with ``momentum``)."""
    name = params["compressor"]
    if name is not None and name not in BUILTIN_COMPRESSORS:
        return
    for key, names in KEY_APPLIES_TO.items():
        if key in given and given[key] != DEFAULTS[key] and name not in names:
            users = " or ".join(repr(n) for n in names)
            which = "no compressor" if name is None else f"compressor {name!r}"
            raise ValueError(f"compression_params[{key!r}] = {given[key]!r} does not apply "
                             f"to {which}: it is only used by compressor {users}; "
                             "remove it")
    if given.get("mu") is not None and params["momentum"] is None:
        raise ValueError(f"compression_params['mu'] = {given['mu']!r} does not apply "
                         "without compression_params['momentum'] = 'nesterov': remove it "
                         "(the optimizer's own momentum stays in the optimizer)")


def _check_comm_dtype(params: dict, given: dict) -> None:
    """``comm_dtype`` and the older ``fp16`` describe one setting: fill each from the
    other; a pair that contradicts itself is refused. ``fp16`` comes out True exactly
    for ``"fp16"``."""
    _check_bool(params, "fp16")
    comm = params["comm_dtype"]
    if comm is None:
        params["comm_dtype"] = "fp16" if params["fp16"] else "fp32"
        return
    _check_choice(params, "comm_dtype", tuple(COMM_DTYPES), allow_none=True)
    if "fp16" in given and params["fp16"] != (comm == "fp16"):
        raise ValueError(
            f"compression_params['fp16'] = {params['fp16']!r} contradicts "
            f"compression_params['comm_dtype'] = {comm!r}: fp16 True means 'fp16', "
            "False means 'bf16' or 'fp32'; give comm_dtype alone")
    params["fp16"] = comm == "fp16"


def _check_real(params: dict, key: str, lo: float) -> None:
    value = params[key]
    accepted = f"a finite number >= {lo}"
    if not _is_real(value):
        raise _fail(TypeError, key, value, accepted)
    if not (math.isfinite(float(value)) and float(value) >= lo):
        raise _fail(ValueError, key, value, accepted)
    params[key] = float(value)


def _check_powersgd(params: dict) -> None:
    """powersgd's keys: ``rank`` required with it; no chain momentum (use the
    optimizer's, as with DDP's hook)."""
    if params["compressor"] != "powersgd":
        return
    if params["rank"] is None:
        raise ValueError("compression_params['rank'] is required for compressor 'powersgd': "
                         "expected an int >= 1 (rank of the approximation)")
    _check_int(params, "rank", 1)
    if params["momentum"] is not None:
        raise ValueError("compression_params['momentum'] = 'nesterov' cannot be used with "
                         "compressor 'powersgd': keep the optimizer's momentum instead")
    _check_bool(params, "warm_start")
    _check_bool(params, "batch_tensors_with_same_shape")
    _check_real(params, "orthogonalization_epsilon", 0.0)
    _check_real(params, "min_compression_rate", 0.0)
    shape = params["shape"]
    if shape is not None:
        if (not isinstance(shape, (list, tuple)) or len(shape) not in (2, 3)
                or not all(_is_int(d) and d >= 1 for d in shape)):
            raise _fail(ValueError, "shape", shape,
                        "None or 2 or 3 ints >= 1 (set per key by the trainer)")
        params["shape"] = [int(d) for d in shape]


def validate_compression_params(params: dict | None) -> dict:
    """Check a ``compression_params`` dict (docs/compression.md) and return a new, complete one.

    Every key of docs/compression.md is present in the result; absent keys get their defaults
    (``mu``/``seed`` stay ``None`` for the trainer to fill, ``min_compress_bytes``
    comes from ``BYTEPS_MIN_COMPRESS_BYTES``, else 65536).

    Raises:
        TypeError: a value of the wrong type (a bool is not an int, ``"3"`` is not a number).
        ValueError: an unknown key, a missing required key, a value out of range.
        Both name the key, the value and what is accepted.
    """
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise TypeError(f"compression_params must be a dict or None, got {type(params).__name__}")
    unknown = sorted(str(key) for key in params if key not in DEFAULTS)
    if unknown:
        raise ValueError(
            f"compression_params has unknown key(s) {', '.join(map(repr, unknown))}: "
            f"accepted keys are {', '.join(DEFAULTS)}"
        )
    out = dict(DEFAULTS)
    out.update(params)

    if out["compressor"] is not None:
        _check_choice(out, "compressor", accepted_compressors())
    _check_choice(out, "ef", ("vanilla",))
    _check_choice(out, "momentum", ("nesterov",))
    _check_choice(out, "partition", ("linear", "natural"), allow_none=False)
    _check_choice(out, "normalize", ("max", "l2"), allow_none=False)
    _check_choice(out, "nonfinite", ("raise", "skip"), allow_none=False)
    if out["scaling"] is None:
        out["scaling"] = True if out["compressor"] == "onebit" else None
    else:
        _check_bool(out, "scaling")
    _check_comm_dtype(out, params)
    _check_k(out)
    if out["mu"] is not None:
        mu = out["mu"]
        if not _is_real(mu):
            raise _fail(TypeError, "mu", mu, "a float in [0, 1)")
        if not 0.0 <= float(mu) < 1.0:
            raise _fail(ValueError, "mu", mu, "a float in [0, 1)")
        out["mu"] = float(mu)
    if out["seed"] is not None:
        _check_int(out, "seed", 1, 2**64)
    if out["min_compress_bytes"] is None:
        out["min_compress_bytes"] = min_compress_bytes()
    else:
        _check_int(out, "min_compress_bytes", 0)
    _check_int(out, "warmup_steps", 0)
    _check_chunk(out)
    _check_powersgd(out)
    _check_applies(out, params)
    return out


def resolve_k(params: dict, numel: int) -> int:
    """The element count of topk/randomk for a partition of ``numel`` elements.

    An int ``k`` is a count, a float a fraction: ``max(1, int(k * numel))``; either is
    clamped to ``numel``.
    """
    k = params["k"]
    count = k if _is_int(k) else max(1, int(k * numel))
    return int(min(count, numel))
