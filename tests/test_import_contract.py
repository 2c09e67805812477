"""The library's import contract: a ``_``-name belongs to the package that defines it.

A module or name that starts with an underscore may be imported by the modules of the package
it lives in and of that package's subpackages, never from elsewhere: ``ckpt/restore/`` may
import ``ckpt._collective``, but ``ckpt/save/`` may not import ``track._inflight`` nor
``format.bytes.payload._as_bytes``. What another package needs gets a public name and a place in its
module's ``__all__``. Every import statement of ``cnr_torchrec`` is read, those inside
functions included. Tests and benchmarks are outside the contract.

The example training job (``cnr_dlrm``) and the example models (``examples``) live beside the
library, not in it: they are users of it, so they import none of its ``_``-names, and no library
module imports them.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = "cnr_torchrec"
USERS = ("cnr_dlrm", "examples")  # the example job and models: outside the library and its wheel


@dataclass(frozen=True)
class Import:
    where: str  # "cnr_torchrec/ckpt/save/staging.py:28"
    importer: str  # the importing module's package, "cnr_torchrec.ckpt.save"
    target: str  # "cnr_torchrec.track._inflight" or "cnr_torchrec.ckpt.format.bytes.payload._as_bytes"


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _is_package(dotted: str) -> bool:
    return os.path.isdir(os.path.join(ROOT, *dotted.split(".")))


def _package_of(path: str) -> str:
    """The package a library file belongs to: its directory, dotted."""
    return os.path.relpath(os.path.dirname(path), ROOT).replace(os.sep, ".")


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` names, with relative imports resolved against ``package``."""
    if node.level == 0:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def library_imports(root: str = ROOT, top: str = LIBRARY, of: str | None = LIBRARY) -> list[Import]:
    """Every import made by the files under ``top`` (default: the library's own) of a module or name of the
    package ``of`` (default ``cnr_torchrec``; None: every import)."""
    out = []
    for dirpath, _, files in os.walk(os.path.join(root, top)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            package = _package_of(path)
            rel = os.path.relpath(path, root)
            with open(path) as f:
                tree = ast.parse(f.read(), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    module = _absolute(node, package)
                    targets = [f"{module}.{a.name}" for a in node.names if a.name != "*"] or [module]
                else:
                    continue
                out += [Import(f"{rel}:{node.lineno}", package, t) for t in targets if of is None or _within(t, of)]
    return out


def owner_of_private(target: str) -> str | None:
    """The package that owns the first ``_``-part of ``target`` (None when it has none).

    ``cnr_torchrec.track._inflight.x`` -> ``cnr_torchrec.track``; for a name defined in a
    module, ``cnr_torchrec.ckpt.format.bytes.payload._as_bytes`` -> ``cnr_torchrec.ckpt.format.bytes``.
    """
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            owner = ".".join(parts[:i])
            while owner and not _is_package(owner):  # a module's name: its package owns it
                owner = owner.rsplit(".", 1)[0]
            return owner
    return None


def violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        owner = owner_of_private(imp.target)
        if owner is not None and imp.importer != owner and not imp.importer.startswith(owner + "."):
            bad.append(f"{imp.where}: {imp.importer} imports {imp.target}, private to {owner}")
    return bad


def test_no_private_name_is_imported_across_packages():
    imports = library_imports()
    assert len(imports) > 100, "the walk found too few imports to be reading the library"
    bad = violations(imports)
    assert not bad, ("these imports take a _-name from another package; give what is needed a public name "
                     "(and a place in its module's __all__):\n  " + "\n  ".join(bad))


# The lower layers know nothing of what is built on them: each package here imports none of those listed.
# (The example job and models, which sit above everything, are kept out of the whole library by
# test_the_library_imports_none_of_its_users.)
_ABOVE = ("cnr_torchrec.dmp", "cnr_torchrec.cli")
# What reads and writes live models and optimizers: torch's modules and optimizers, TorchRec's and FBGEMM's modules,
# and the library's own package for them (ckpt/live/). The format (its records and its bytes) takes none of them.
_LIVE = ("torch.nn", "torch.optim", "torchrec", "fbgemm_gpu", "cnr_torchrec.ckpt.live")
LAYERS = {
    "cnr_torchrec.track": ("cnr_torchrec.ckpt", "cnr_torchrec.quant", *_ABOVE),
    "cnr_torchrec.quant": ("cnr_torchrec.ckpt", "cnr_torchrec.track", *_ABOVE),
    # The on-disk format (format/ and its bytes, format/bytes/) takes names, not live objects: no model, optimizer
    # or TorchRec module, no tracker, no save or restore machinery.
    "cnr_torchrec.ckpt.format": ("cnr_torchrec.track", "cnr_torchrec.ckpt.save", "cnr_torchrec.ckpt.restore",
                                 "cnr_torchrec.ckpt.compact", "cnr_torchrec.ckpt.tools",
                                 "cnr_torchrec.ckpt.retention", "cnr_torchrec.ckpt.checkpointer", "cnr_torchrec.ckpt.memory",
                                 *_LIVE, *_ABOVE),
    # The live objects' state sits on the format, under the save and restore paths that read and write it.
    "cnr_torchrec.ckpt.live": ("cnr_torchrec.track", "cnr_torchrec.ckpt.save", "cnr_torchrec.ckpt.restore",
                               "cnr_torchrec.ckpt.compact", "cnr_torchrec.ckpt.tools", "cnr_torchrec.ckpt.memory",
                               "cnr_torchrec.ckpt.retention", "cnr_torchrec.ckpt.checkpointer", *_ABOVE),
    # The save path writes checkpoints; what reads, folds or keeps them is built on it.
    "cnr_torchrec.ckpt.save": ("cnr_torchrec.ckpt.restore", "cnr_torchrec.ckpt.compact", "cnr_torchrec.ckpt.tools",
                               "cnr_torchrec.ckpt.retention", "cnr_torchrec.ckpt.checkpointer", *_ABOVE),
    # The offline tools read roots; compaction (cnr compact included) is built on them, not under them.
    "cnr_torchrec.ckpt.tools": ("cnr_torchrec.ckpt.compact", "cnr_torchrec.ckpt.checkpointer", *_ABOVE),
    "cnr_torchrec.ckpt.compact": ("cnr_torchrec.ckpt.restore", "cnr_torchrec.ckpt.checkpointer", *_ABOVE),
    # The memory tier keeps images of what restores give, on the format: no save, restore or other machinery.
    "cnr_torchrec.ckpt.memory": ("cnr_torchrec.ckpt.save", "cnr_torchrec.ckpt.restore", "cnr_torchrec.ckpt.compact",
                                 "cnr_torchrec.ckpt.tools", "cnr_torchrec.ckpt.retention",
                                 "cnr_torchrec.ckpt.checkpointer", *_ABOVE),
    # A restore sits on the format (the whole-table assembly included), never on the tools or compaction.
    "cnr_torchrec.ckpt.restore": ("cnr_torchrec.ckpt.tools", "cnr_torchrec.ckpt.compact",
                                  "cnr_torchrec.ckpt.checkpointer", *_ABOVE),
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_violations(imports: list[Import]) -> list[str]:
    return [f"{imp.where}: {imp.importer} imports {imp.target}"
            for imp in imports for layer, forbidden in LAYERS.items()
            if _within(imp.importer, layer) and any(_within(imp.target, f) for f in forbidden)]


def test_the_lower_layers_import_nothing_built_on_them():
    bad = layer_violations(library_imports(of=None))  # every import: LAYERS forbids some of torch's and TorchRec's
    assert not bad, "these imports reach up a layer (tests/test_import_contract.py: LAYERS):\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("importer, target, allowed", [
    ("cnr_torchrec.ckpt.format.bytes", "torch.nn.Module", False),  # `from torch.nn import Module`
    ("cnr_torchrec.ckpt.format", "torch.nn", False),  # `from torch import nn`, `import torch.nn`
    ("cnr_torchrec.ckpt.format", "torch.optim.Optimizer", False),
    ("cnr_torchrec.ckpt.format", "torchrec.distributed.model_parallel.get_unwrapped_module", False),
    ("cnr_torchrec.ckpt.format.bytes", "fbgemm_gpu.split_table_batched_embeddings_ops_training", False),
    ("cnr_torchrec.ckpt.format", "cnr_torchrec.ckpt.live.rng.rng_state", False),
    ("cnr_torchrec.ckpt.format", "torch.Tensor", True),  # tensors are the format's values
    ("cnr_torchrec.ckpt.format.bytes", "torchsnapshot.io_types.ReadIO", True),  # torchsnapshot is not torchrec
    ("cnr_torchrec.ckpt.live", "cnr_torchrec.ckpt.format.bytes.payload.flatten_state", True),  # live sits on it
    ("cnr_torchrec.ckpt.live", "torch.nn", True),
    ("cnr_torchrec.ckpt.save", "cnr_torchrec.ckpt.live.dense_params.dense_named_state", True),
])
def test_the_layer_rule_on_known_cases(importer, target, allowed):
    assert (layer_violations([Import("x.py:1", importer, target)]) == []) == allowed


def test_the_library_imports_none_of_its_users():
    """cnr_torchrec stands alone: no module of it imports the example job or models (nor the tests'
    and benchmarks' helpers), so the wheel, which ships cnr_torchrec only, imports whole."""
    imports = library_imports(of=None)
    assert len(imports) > 100, "the walk found too few imports to be reading the library"
    outside = (*USERS, "tests", "benchmarks", "_dist", "_toy")
    bad = [f"{imp.where}: {imp.importer} imports {imp.target}" for imp in imports
           if any(_within(imp.target, o) for o in outside)]
    assert not bad, "the library imports code that is not in its wheel:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("user", USERS)
def test_the_example_job_and_models_use_only_public_names(user):
    """The job and the example models are users of the library: not one ``_``-module or ``_``-name of
    cnr_torchrec (what they need has a public name in its module's ``__all__``)."""
    assert os.path.isdir(os.path.join(ROOT, user)), f"{user}/ is not at the repository root"
    imports = library_imports(top=user)
    assert imports, f"{user}/ imports nothing of cnr_torchrec: the walk is not reading it"
    bad = [f"{imp.where}: {imp.importer} imports {imp.target}" for imp in imports if owner_of_private(imp.target)]
    assert not bad, f"{user} takes _-names of cnr_torchrec:\n  " + "\n  ".join(bad)


def test_the_example_job_and_models_are_not_in_the_library():
    for gone in ("job", "examples"):
        assert not os.path.exists(os.path.join(ROOT, LIBRARY, gone)), f"{LIBRARY}/{gone} is back in the library"


@pytest.mark.parametrize("importer, target, allowed", [
    ("cnr_torchrec.ckpt.restore", "cnr_torchrec.ckpt._collective.Collective", True),  # a subpackage of the owner
    ("cnr_torchrec.quant", "cnr_torchrec._ext.ops", True),  # the root owns _ext
    ("cnr_torchrec.ckpt.format.bytes", "cnr_torchrec.ckpt.format.bytes.payload._as_bytes", True),  # same package
    ("cnr_torchrec.ckpt.save", "cnr_torchrec.track._inflight", False),
    ("cnr_torchrec.ckpt.tools", "cnr_torchrec.ckpt.compact.merge._region_rows", False),
    ("cnr_torchrec.ckpt.format", "cnr_torchrec.ckpt.format.bytes.payload._as_bytes", False),  # not the owner
    ("cnr_dlrm", "cnr_torchrec.ckpt.config.__all__", True),  # dunders are not private
    ("cnr_dlrm", "cnr_torchrec.cli._storage_options", False),  # outside the library: no _-name at all
])
def test_the_rule_on_known_cases(importer, target, allowed):
    assert (violations([Import("x.py:1", importer, target)]) == []) == allowed


def test_the_package_exports_every_config_section():
    """A user who builds a config in code reaches every section from ``cnr_torchrec`` itself."""
    import dataclasses

    import cnr_torchrec
    from cnr_torchrec.ckpt import config

    sections = [name for name, obj in vars(config).items()
                if dataclasses.is_dataclass(obj) and isinstance(obj, type) and name.endswith("Config")
                and obj.__module__ == config.__name__]
    assert "KeepConfig" in sections
    missing = [name for name in sections if name not in cnr_torchrec.__all__ or not hasattr(cnr_torchrec, name)]
    assert not missing, f"config sections not exported by cnr_torchrec: {missing}"
