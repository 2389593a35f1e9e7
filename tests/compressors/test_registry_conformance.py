"""What every registered compressor states of itself (``Compressor.description``), and the
rule that keeps code serving every compressor free of their names.

Tests, benches, examples and the warm-up loop over ``registered_names()`` and read each
class's description; a compressor's own knowledge lives in its source file and its own
test file. So outside those, no file of tests/, bench/, examples/ or
compressors/warm.py compares anything with a built-in compressor's name (the AST:
``==``, ``!=``, ``in``, ``match`` cases, ``startswith``): adding a compressor is one
source file, one test file and its line in the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from bps.compressors import (
    Description,
    build,
    compressor_class,
    description,
    payload_bound,
    register,
    registered_names,
    unregister,
    validate_compression_params,
)
from bps.compressors.base import SUPPORTED_DTYPES
from bps.compressors.onebit import OneBit
from bps.compressors.registry import BUILTIN
from tests.harness.paths import ROOT
from tests.harness.reference_compressors import ref_codec

# where code serves every compressor; a compressor's own test file, test_<name>.py, may
# name it
SCANNED = ["tests", "bench", "examples", "compressors/warm.py"]
# (file, name): a comparison with the name that is not about the compressor
NOT_THE_COMPRESSOR = {
    ("examples/ddp_mnist.py", "powersgd"): "--hook powersgd is torch's own DDP hook",
    ("examples/lm.py", "powersgd"): "--ddp powersgd is torch's own DDP hook",
}


def scanned_files() -> list[Path]:
    files = []
    for entry in SCANNED:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return [f for f in files if "__pycache__" not in f.parts]


def names_in(node: ast.AST) -> list[str]:
    """The built-in compressor names that ``node`` is, or holds as a tuple/list/set."""
    if isinstance(node, ast.Constant) and node.value in BUILTIN:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [name for item in node.elts for name in names_in(item)]
    return []


def asserted(tree: ast.AST) -> set[int]:
    """The ids of the comparisons an ``assert`` states (alone or joined by and/or/not):
    a test's expected result, not a condition."""
    ids, stack = set(), [node.test for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.BoolOp):
            stack += node.values
        elif isinstance(node, ast.UnaryOp):
            stack.append(node.operand)
        elif isinstance(node, ast.Compare):
            ids.add(id(node))
    return ids


def named_in_conditions(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each comparison with a built-in compressor's name, but those an
    ``assert`` states."""
    found, stated = [], asserted(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and id(node) not in stated:
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in names_in(operand)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, name) for name in names_in(node.value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith")):
            found += [(node.lineno, name) for arg in node.args for name in names_in(arg)]
    return sorted(found)


def violations(path: Path, source: str) -> list[str]:
    where = path.relative_to(ROOT).as_posix()
    return [f"{where}:{line}: compares with compressor {name!r} (read its description "
            "instead, or move this into its own test file)"
            for line, name in named_in_conditions(ast.parse(source, filename=where))
            if path.name != f"test_{name}.py" and (where, name) not in NOT_THE_COMPRESSOR]


def test_no_file_serving_every_compressor_names_one_in_a_condition():
    found = [v for path in scanned_files() for v in violations(path, path.read_text())]
    assert not found, "\n".join(found)


def test_the_rule_finds_what_it_forbids():
    bad = ('if name == "topk":\n    pass\nok = params["compressor"] in ("bytegrad", "x")\n'
           'match name:\n    case "onebit":\n        pass\nname.startswith("dithering")\n'
           'x = {"topk": 1}\nassert name == "topk" and rows == ["onebit"]\n'
           'assert [n for n in names if n != "topk"]\n')
    found = violations(ROOT / "tests" / "x.py", bad)
    assert [v.split(": ", 1)[0] for v in found] == [
        "tests/x.py:1", "tests/x.py:3", "tests/x.py:5", "tests/x.py:7", "tests/x.py:10"], found
    assert not violations(ROOT / "tests" / "test_topk.py", 'if name == "topk":\n    pass\n')


@pytest.mark.parametrize("name", registered_names())
def test_every_registered_compressor_describes_itself(name):
    told = description(name)
    assert isinstance(told, Description) and told.label
    assert set(told.dtypes) <= set(SUPPORTED_DTYPES)
    cls = compressor_class({"compressor": name})
    for options in (*told.examples, told.defaults):
        params = validate_compression_params({"compressor": name, **options})
        if told.payloads_sum:  # a whole tensor's own shape: its own tests
            continue
        for dtype in told.dtypes:
            chain = build(params, 97, dtype)
            payload = chain.compress(torch.linspace(-1.0, 1.0, 97, dtype=dtype))
            bound = payload_bound(params, 97, dtype)
            assert bound is None or payload.numel() <= bound
            assert chain.decompress(payload).shape == (97,)
    if not told.payloads_sum:  # its reference decodes what it sends
        encode, decode = ref_codec({"compressor": name, **told.examples[0]}, 97, "float32")
        assert decode(encode([0.5] * 97)).shape == (97,)
    assert cls is not None and cls.description is told


def test_a_compressor_without_a_description_is_refused_by_name():
    register("bare-signs", lambda params, numel, dtype: OneBit(numel, dtype))
    try:
        assert "bare-signs" in registered_names()
        with pytest.raises(ValueError, match="'bare-signs' .*has no description"):
            description("bare-signs")
    finally:
        unregister("bare-signs")
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
        description("nope")
    with pytest.raises(ValueError, match="examples leave out 'compressor'"):
        Description(examples=({"compressor": "topk"},))
    with pytest.raises(ValueError, match="tolerance must be"):
        Description(examples=({},), tolerance="close")
