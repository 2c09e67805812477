"""docs/architecture.md's layout names every module of the library, under its own package, and nothing that is
gone: a module added without a line there, or a line left for a module removed, fails here."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layout() -> set[str]:
    """The module paths the layout block names: each line's first column (names before two spaces), under the
    directories its indentation nests it in."""
    doc = open(os.path.join(REPO, "docs", "architecture.md")).read()
    block = doc[doc.index("```\ncnr_torchrec/") + 4 :]
    block = block[: block.index("```")]
    named, stack = set(), []  # stack: (indent, directory)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        head = re.split(r"\s{2,}", line.strip())[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        for name in (n.strip() for n in head.split(",")):
            if name.endswith("/"):
                stack.append((indent, name))
            elif name.endswith(".py"):
                named.add("".join(d for _, d in stack) + name)
    return named


def _modules() -> set[str]:
    out = set()
    for d, dirs, files in os.walk(os.path.join(REPO, "cnr_torchrec")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in files:
            if f.endswith(".py") and not (f == "__init__.py" and d != os.path.join(REPO, "cnr_torchrec")):
                out.add(os.path.relpath(os.path.join(d, f), REPO))
    return out


def test_the_architecture_page_names_every_library_module_and_no_other():
    named, modules = _layout(), _modules()
    assert sorted(modules - named) == [], "modules docs/architecture.md's layout does not name"
    assert sorted(named - modules) == [], "lines of docs/architecture.md's layout for modules that do not exist"
