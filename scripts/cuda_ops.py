"""Checks that the CUDA build of the extension registered a CUDA kernel for every op that
touches device tensors on the training, save or restore path (``make cuda-check``).

Run with the CUDA build of torch, after the extension is built; a GPU is not needed.
Exits 1, naming the ops, if one lacks its kernel.
"""

from __future__ import annotations

import sys

import torch

import cnr_torchrec  # noqa: F401  (loads cnr_torchrec._C, which registers the ops)

# Ops that run on host tensors by design, and why.
HOST_ONLY = {
    "claim_rows_": "restore bookkeeping: it reads the host-side `filled` masks and the stored row offsets",
    "exhaustive_search": "a measurement for benchmarks/codecs.py, not on any training, save or restore path",
    "row_crc32c": "the CRCs of stored rows, which a save computes and a restore checks on the host copies it reads",
}


def main() -> int:
    if torch.version.cuda is None:
        print("torch is a CPU build: run this with the CUDA build (scripts/install_cuda.sh)")
        return 1
    names = sorted({n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                    if n.startswith("cnr::")})
    missing = []
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), GPU available: {torch.cuda.is_available()}")
    for name in names:
        has = torch._C._dispatch_has_kernel_for_dispatch_key(f"cnr::{name}", "CUDA")
        note = "CUDA kernel" if has else f"host only: {HOST_ONLY.get(name, 'NO CUDA KERNEL')}"
        print(f"  cnr::{name:<26s} {note}")
        if not has and name not in HOST_ONLY:
            missing.append(name)
    stale = sorted(set(HOST_ONLY) - set(names))
    if stale:
        print(f"HOST_ONLY names ops that do not exist: {stale}")
        return 1
    if missing:
        print(f"ops without a CUDA kernel: {missing}")
        return 1
    print(f"{len(names) - len(HOST_ONLY)} of {len(names)} ops have a CUDA kernel; {len(HOST_ONLY)} are host-only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
