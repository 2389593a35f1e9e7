"""compression_params validation (docs/compression.md): defaults, a clear error per bad value."""

import numpy as np
import pytest

from bps.compressors import resolve_k, validate_compression_params

DOCUMENTED_KEYS = {"compressor", "k", "scaling", "ef", "momentum", "mu", "seed", "partition",
             "normalize", "fp16", "min_compress_bytes", "warmup_steps", "chunk",
             "comm_dtype", "rank", "warm_start", "orthogonalization_epsilon",
             "min_compression_rate", "batch_tensors_with_same_shape", "shape", "nonfinite",
             "freeze_step"}


def test_defaults_fill_every_key(monkeypatch):
    monkeypatch.delenv("BYTEPS_MIN_COMPRESS_BYTES", raising=False)
    out = validate_compression_params(None)
    assert set(out) == DOCUMENTED_KEYS
    assert out == {"compressor": None, "k": None, "scaling": None, "ef": None,
                   "momentum": None, "mu": None, "seed": None, "partition": "linear",
                   "normalize": "max", "fp16": True, "min_compress_bytes": 65536,
                   "warmup_steps": 0, "chunk": None, "comm_dtype": "fp16", "rank": None,
                   "warm_start": True, "orthogonalization_epsilon": 0.0,
                   "min_compression_rate": 2.0, "batch_tensors_with_same_shape": False,
                   "shape": None, "nonfinite": "raise", "freeze_step": None}


def test_returns_a_new_dict():
    params = {"compressor": "onebit"}
    out = validate_compression_params(params)
    assert out is not params and params == {"compressor": "onebit"}


def test_min_compress_bytes_from_environment(monkeypatch):
    monkeypatch.setenv("BYTEPS_MIN_COMPRESS_BYTES", "1024")
    assert validate_compression_params({})["min_compress_bytes"] == 1024
    assert validate_compression_params({"min_compress_bytes": 0})["min_compress_bytes"] == 0
    monkeypatch.setenv("BYTEPS_MIN_COMPRESS_BYTES", "lots")
    with pytest.raises(ValueError, match="BYTEPS_MIN_COMPRESS_BYTES"):
        validate_compression_params({})


def test_full_valid_dict():
    params = {"compressor": "dithering", "k": 4, "scaling": None, "ef": "vanilla",
              "momentum": "nesterov", "mu": 0.9, "seed": 2**64 - 1, "partition": "natural",
              "normalize": "l2", "fp16": False, "min_compress_bytes": 0, "warmup_steps": 3,
              "chunk": None, "comm_dtype": "fp32", "rank": None, "warm_start": True,
              "orthogonalization_epsilon": 0.0, "min_compression_rate": 2.0,
              "batch_tensors_with_same_shape": False, "shape": None, "nonfinite": "skip",
              "freeze_step": None}
    assert validate_compression_params(params) == params


@pytest.mark.parametrize("k", [1, 5, np.int64(7), 0.5, 1e-6, np.float64(0.25)])
def test_k_accepted_for_topk_and_randomk(k):
    for name in ("topk", "randomk"):
        assert validate_compression_params({"compressor": name, "k": k})["k"] == k


BAD = [
    # (params, exception, words the message must contain)
    ({"compressor": "gzip"}, ValueError, ["compressor", "gzip", "onebit"]),
    ({"compressor": 3}, TypeError, ["compressor", "3"]),
    ({"bogus": 1}, ValueError, ["bogus", "accepted keys"]),
    ({"compressor": "topk"}, ValueError, ["'k'", "required", "topk"]),
    ({"compressor": "randomk"}, ValueError, ["'k'", "required"]),
    ({"compressor": "dithering"}, ValueError, ["'k'", "required", "dithering"]),
    ({"compressor": "topk", "k": 0}, ValueError, ["'k'", "0", "int >= 1"]),
    ({"compressor": "topk", "k": -3}, ValueError, ["'k'", "-3"]),
    ({"compressor": "topk", "k": 1.0}, ValueError, ["'k'", "1.0", "(0, 1)"]),
    ({"compressor": "topk", "k": 0.0}, ValueError, ["'k'", "0.0"]),
    ({"compressor": "topk", "k": float("nan")}, ValueError, ["'k'", "nan"]),
    ({"compressor": "topk", "k": True}, TypeError, ["'k'", "True"]),
    ({"compressor": "topk", "k": "3"}, TypeError, ["'k'", "'3'"]),
    ({"compressor": "dithering", "k": 0.5}, TypeError, ["'k'", "0.5", "int"]),
    ({"compressor": "dithering", "k": 0}, ValueError, ["'k'", "0"]),
    ({"compressor": "dithering", "k": 32, "partition": "natural"}, ValueError, ["'k'", "32", "31"]),
    ({"compressor": "dithering", "k": True}, TypeError, ["'k'", "True"]),
    ({"nonfinite": "ignore"}, ValueError, ["nonfinite", "ignore", "'raise'", "'skip'"]),
    ({"nonfinite": None}, TypeError, ["nonfinite", "None"]),
    ({"scaling": 1}, TypeError, ["scaling", "1", "bool"]),
    ({"scaling": "yes"}, TypeError, ["scaling", "yes"]),
    ({"fp16": 0}, TypeError, ["fp16", "0", "bool"]),
    ({"ef": "fancy"}, ValueError, ["ef", "fancy", "vanilla"]),
    ({"ef": True}, TypeError, ["ef", "True"]),
    ({"momentum": "adam"}, ValueError, ["momentum", "adam", "nesterov"]),
    ({"mu": 1.0}, ValueError, ["mu", "1.0", "[0, 1)"]),
    ({"mu": -0.1}, ValueError, ["mu", "-0.1"]),
    ({"mu": "0.9"}, TypeError, ["mu", "'0.9'"]),
    ({"mu": False}, TypeError, ["mu", "False"]),
    ({"seed": 0}, ValueError, ["seed", "0", "[1, "]),
    ({"seed": 2**64}, ValueError, ["seed", str(2**64)]),
    ({"seed": 1.0}, TypeError, ["seed", "1.0"]),
    ({"seed": True}, TypeError, ["seed", "True"]),
    ({"partition": "log"}, ValueError, ["partition", "log", "natural"]),
    ({"partition": None}, TypeError, ["partition", "None"]),
    ({"normalize": "l1"}, ValueError, ["normalize", "l1", "l2"]),
    ({"min_compress_bytes": -1}, ValueError, ["min_compress_bytes", "-1"]),
    ({"min_compress_bytes": 1.5}, TypeError, ["min_compress_bytes", "1.5"]),
    ({"warmup_steps": -2}, ValueError, ["warmup_steps", "-2"]),
    ({"warmup_steps": "2"}, TypeError, ["warmup_steps", "'2'"]),
    ({"compressor": "bytegrad", "chunk": 0}, ValueError, ["chunk", "0", "int in [1, "]),
    ({"compressor": "bytegrad", "chunk": 2**31}, ValueError, ["chunk", str(2**31)]),
    ({"compressor": "bytegrad", "chunk": 2.0}, TypeError, ["chunk", "2.0", "int"]),
    ({"compressor": "bytegrad", "chunk": True}, TypeError, ["chunk", "True"]),
    ({"compressor": "topk", "k": 3, "chunk": 64}, ValueError, ["chunk", "bytegrad", "topk"]),
    ({"chunk": 64}, ValueError, ["chunk", "no compressor", "'bytegrad'"]),
    ({"comm_dtype": "half"}, ValueError, ["comm_dtype", "half", "'bf16'"]),
    ({"comm_dtype": 16}, TypeError, ["comm_dtype", "16"]),
    ({"comm_dtype": "bf16", "fp16": True}, ValueError, ["fp16", "contradicts", "'bf16'"]),
    ({"comm_dtype": "fp32", "fp16": True}, ValueError, ["fp16", "contradicts", "'fp32'"]),
    ({"comm_dtype": "fp16", "fp16": False}, ValueError, ["fp16", "contradicts", "'fp16'"]),
]


@pytest.mark.parametrize("params, exc, words", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_params_raise_naming_key_value_and_accepted(params, exc, words):
    with pytest.raises(exc) as info:
        validate_compression_params(params)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_onebit_scales_its_signs_unless_told_not_to():
    assert validate_compression_params({"compressor": "onebit"})["scaling"] is True
    plain = validate_compression_params({"compressor": "onebit", "scaling": False})
    assert plain["scaling"] is False
    assert validate_compression_params(plain) == plain  # a validated dict validates again


NOT_APPLYING = [
    # (params, the key refused, what it is for)
    ({"compressor": "onebit", "k": 0.01}, "k", "'topk' or 'randomk' or 'dithering'"),
    ({"compressor": "topk", "k": 3, "scaling": True}, "scaling", "'onebit'"),
    ({"compressor": "topk", "k": 3, "scaling": False}, "scaling", "'onebit'"),
    ({"compressor": "bytegrad", "partition": "natural"}, "partition", "'dithering'"),
    ({"compressor": "randomk", "k": 3, "normalize": "l2"}, "normalize", "'dithering'"),
    ({"compressor": "onebit", "chunk": 16}, "chunk", "'bytegrad'"),
    ({"compressor": "dithering", "k": 2, "rank": 2}, "rank", "'powersgd'"),
    ({"compressor": "onebit", "warm_start": False}, "warm_start", "'powersgd'"),
    ({"ef": "vanilla"}, "ef", "'onebit'"),
    ({"warmup_steps": 5}, "warmup_steps", "'onebit'"),
    ({"scaling": True}, "scaling", "'onebit'"),
    ({"k": 3}, "k", "'topk'"),
]


@pytest.mark.parametrize("params, key, users", NOT_APPLYING,
                         ids=[str(b[0]) for b in NOT_APPLYING])
def test_keys_that_do_not_apply_are_refused(params, key, users):
    with pytest.raises(ValueError) as info:
        validate_compression_params(params)
    message = str(info.value)
    assert f"compression_params[{key!r}]" in message and "does not apply" in message
    assert users in message, message
    which = f"compressor {params['compressor']!r}" if "compressor" in params else "no compressor"
    assert which in message, message


def test_mu_without_momentum_is_refused():
    with pytest.raises(ValueError, match=r"'mu'.*does not apply.*'momentum'"):
        validate_compression_params({"compressor": "topk", "k": 3, "mu": 0.9})
    ok = validate_compression_params({"compressor": "topk", "k": 3, "mu": 0.9,
                                      "momentum": "nesterov"})
    assert ok["mu"] == 0.9


def test_keys_at_their_default_and_job_wide_keys_are_accepted_anywhere():
    shared = {"scaling": None, "k": None, "chunk": None, "rank": None, "warm_start": True,
              "partition": "linear", "normalize": "max", "warmup_steps": 0, "seed": 7,
              "min_compress_bytes": 0, "comm_dtype": "bf16", "nonfinite": "skip",
              "momentum": "nesterov", "mu": 0.5}
    out = validate_compression_params(shared)  # no compressor: momentum still applies
    assert (out["seed"], out["momentum"], out["mu"]) == (7, "nesterov", 0.5)
    assert validate_compression_params({**shared, "compressor": "onebit"})["scaling"] is True


def test_a_registered_compressor_gets_every_key():
    from bps.compressors import register, unregister
    from bps.compressors.onebit import OneBit

    register("signs", lambda p, n, dt: OneBit(n, dt, scaling=p["k"] is None))
    try:
        out = validate_compression_params({"compressor": "signs", "k": 3, "chunk": 8,
                                           "scaling": True, "partition": "natural"})
        assert (out["k"], out["chunk"], out["partition"]) == (3, 8, "natural")
    finally:
        unregister("signs")


@pytest.mark.parametrize("given, comm, fp16", [
    ({}, "fp16", True), ({"fp16": True}, "fp16", True), ({"fp16": False}, "fp32", False),
    ({"comm_dtype": "bf16"}, "bf16", False), ({"comm_dtype": "bf16", "fp16": False}, "bf16", False),
    ({"comm_dtype": "fp32"}, "fp32", False), ({"comm_dtype": "fp16", "fp16": True}, "fp16", True),
])
def test_comm_dtype_and_fp16_describe_one_setting(given, comm, fp16):
    out = validate_compression_params(given)
    assert (out["comm_dtype"], out["fp16"]) == (comm, fp16)
    assert validate_compression_params(out) == out  # a validated dict validates again


def test_not_a_dict():
    with pytest.raises(TypeError, match="dict"):
        validate_compression_params([("compressor", "onebit")])


@pytest.mark.parametrize("k, numel, expected", [
    (10, 100, 10), (10, 5, 5), (0.01, 1000, 10), (0.01, 50, 1), (0.999, 3, 2), (0.5, 1, 1),
])
def test_resolve_k(k, numel, expected):
    params = validate_compression_params({"compressor": "topk", "k": k})
    assert resolve_k(params, numel) == expected
