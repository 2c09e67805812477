"""Checks an installed cnr_torchrec from outside the source tree (``scripts/install_check.sh``).

``imports SRC SITE``: the package comes from the install in SITE; the install holds the
library alone (not the example job ``cnr_dlrm``, nor the example models ``examples``, which stay
in the source tree); every op that ``SRC/csrc/schemas.h`` declares is registered in
``torch.ops.cnr`` with a CPU kernel; the package ships ``py.typed``; the package and its ``cnr``
command work without the ``plot`` and ``s3`` extras.

``digest``: prints a SHA-256 of every codec's encoded tensors and decoded rows, including a
decode into a 32 MB table (the streaming-store path). Two builds of the extension that
print the same digest give the same bits.

Exits 1, saying what is wrong, when a check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys

# Imported by the optional features only: the package must import and run without them.
EXTRA_MODULES = ("matplotlib", "aiobotocore", "botocore", "boto3", "moto")


def _declared_ops(src: str) -> list[str]:
    with open(os.path.join(src, "csrc", "schemas.h")) as f:
        return sorted(set(re.findall(r'm\.def\(\s*"(\w+)\(', f.read())))


def installed_outside_the_library(site: str) -> list[str]:
    """What an install of the wheel into ``site`` (``pip install --target``) holds beyond the library: every
    file its RECORD lists outside ``cnr_torchrec/``, its dist-info and the console scripts, and the example
    job and models wherever they appear. Empty when the wheel ships the library alone."""
    records = [os.path.join(site, d, "RECORD") for d in os.listdir(site)
               if d.startswith("cnr_torchrec-") and d.endswith(".dist-info")]
    if len(records) != 1:
        return [f"{site} holds {len(records)} cnr_torchrec dist-info folders, expected 1"]
    extra = []
    with open(records[0]) as f:
        for line in f:
            path = line.rsplit(",", 2)[0]
            top = path.split("/", 1)[0]
            if not (top == "cnr_torchrec" or (top.startswith("cnr_torchrec-") and top.endswith(".dist-info"))
                    or top == ".." or top == "bin"):
                extra.append(path)
            elif path.startswith(("cnr_torchrec/job/", "cnr_torchrec/examples/")):
                extra.append(path)
    for name in ("cnr_dlrm", "examples", os.path.join("cnr_torchrec", "job"), os.path.join("cnr_torchrec", "examples")):
        if os.path.exists(os.path.join(site, name)) and not any(e.startswith(name) for e in extra):
            extra.append(name)
    return extra


def check_imports(src: str, site: str) -> int:
    """Runs the ``imports`` checks against the cnr_torchrec on ``sys.path``."""
    for name in EXTRA_MODULES:
        sys.modules[name] = None  # an import of it raises ImportError from here on
    import torch

    import cnr_torchrec
    import cnr_torchrec.ckpt  # noqa: F401
    import cnr_torchrec.cli  # noqa: F401

    where = os.path.realpath(cnr_torchrec.__file__)
    print(f"cnr_torchrec from {os.path.dirname(where)} (torch {torch.__version__})")
    if not where.startswith(os.path.realpath(site) + os.sep):
        print(f"cnr_torchrec was imported from {where}, not from the install in {site}")
        return 1
    failed = False
    extra = installed_outside_the_library(site)
    if extra:
        print("the wheel ships more than the library (the example job and models stay in the source tree; "
              f"pyproject.toml's packages.find includes cnr_torchrec only): {extra[:10]}")
        failed = True
    if not os.path.isfile(os.path.join(os.path.dirname(where), "py.typed")):
        print("the install has no py.typed (PEP 561): pyproject.toml's package-data must ship it")
        failed = True
    declared = _declared_ops(src)
    registered = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                         if n.startswith("cnr::")})
    no_cpu = [n for n in registered if not torch._C._dispatch_has_kernel_for_dispatch_key(f"cnr::{n}", "CPU")]
    print(f"torch.ops.cnr: {len(registered)} ops registered, {len(declared)} declared in csrc/schemas.h")
    if not declared or registered != declared:
        print(f"declared but not registered: {sorted(set(declared) - set(registered))}; "
              f"registered but not declared: {sorted(set(registered) - set(declared))}")
        failed = True
    if no_cpu:
        print(f"ops without a CPU kernel: {no_cpu}")
        failed = True
    # The console script, in a fresh process that sees the same sys.path.
    cnr = os.path.join(site, "bin", "cnr")
    if not os.path.isfile(cnr):
        print(f"the `cnr` command was not installed (looked for {cnr})")
        return 1
    out = subprocess.run([sys.executable, cnr, "--help"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0 or "usage: cnr" not in out.stdout:
        print(f"`cnr --help` failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
        failed = True
    if not failed:
        print("the library alone is installed, imports without the plot and s3 extras, all ops registered with CPU "
              "kernels, `cnr --help` runs")
    return 1 if failed else 0


def codec_digest() -> str:
    """SHA-256 over every codec's encoded tensors and decoded rows on fixed random rows."""
    import torch

    from cnr_torchrec.quant import get_codec
    from cnr_torchrec.quant.registry import METHODS

    g = torch.Generator().manual_seed(7)
    # 45 and 64 columns: a partial last block and whole cache lines; a zero row and a constant row.
    tables = [torch.randn(97, dim, generator=g) * torch.rand(97, 1, generator=g) for dim in (45, 64)]
    for rows in tables:
        rows[3] = 0.0
        rows[5] = 0.25
    big = torch.zeros(1 << 17, 64)  # 32 MB: decode_into streams whole lines into it
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())

    for method in METHODS:
        for bits in [None] if method in ("none", "fp16", "bf16") else [2, 3, 4, 8]:
            codec = get_codec(method, bits)
            for rows in tables:
                encoded = codec.encode(rows)
                for t in encoded.to_tensors().values():
                    add(t)
                add(codec.decode(encoded))
                if rows.shape[1] == big.shape[1]:
                    dst = torch.randperm(big.shape[0], generator=g)[: rows.shape[0]]
                    codec.decode_into(encoded, big, dst)
                    add(big[dst])
    return h.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imports = sub.add_parser("imports")
    imports.add_argument("src", help="the source tree the install was built from")
    imports.add_argument("site", help="the folder it was installed into")
    sub.add_parser("digest")
    args = parser.parse_args()
    if args.command == "imports":
        return check_imports(args.src, args.site)
    print(codec_digest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
