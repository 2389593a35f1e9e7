"""The code blocks of the docs, as a test runs them: typed as the docs show them.

    >>> save, resume = checkpoint_snippet("trainer.md")
    >>> exec(save, namespace)      # the names the snippet uses, in ``namespace``
"""

from __future__ import annotations

import re

from tests.harness.paths import ROOT

DOCS = ROOT / "docs"
RESUMING = "# resuming"


def python_blocks(doc: str) -> list[str]:
    """Every fenced ```python block of docs/``doc``, in order."""
    return re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)


def checkpoint_snippet(doc: str) -> tuple[str, str]:
    """The (saving, resuming) halves of the block of docs/``doc`` that shows both: split
    at its ``# resuming`` comment."""
    [block] = [b for b in python_blocks(doc) if RESUMING in b and "torch.save(" in b]
    at = block.index(RESUMING)
    return block[:at], block[at:]
