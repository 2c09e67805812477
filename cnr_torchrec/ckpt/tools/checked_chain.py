"""Offline reading of a checkpoint root, with no model and no process group: a committed chain, checked.

The tools (``cnr export``, ``cnr compact``, the DCP export) start here: :func:`load_chain` gives a
checkpoint's chain once every file of it passed ``cnr verify``'s checks, and
:mod:`cnr_torchrec.ckpt.format.tables` applies it to whole tables.

None of this may run while a training job writes to the same root: ``compact`` takes the
next free checkpoint id, which the job would take too.
"""

from __future__ import annotations

from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import load_manifest, manifest_path, walk_chain
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.tools.verify import verify_checkpoint
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError

__all__ = ["count_entries", "load_chain"]


# ---------------------------------------------------------------------- chains


def load_chain(storage: Storage, ckpt_id: int, *, verify: bool = True) -> list[Manifest]:
    """The manifests of ``ckpt_id``'s chain, baseline first.

    Args:
        verify: also check every file of every member (sizes, xxh3 of files and blobs,
            references) with :func:`cnr_torchrec.ckpt.tools.verify.verify_checkpoint`.

    Raises:
        CheckpointNotFoundError: ``ckpt_id`` is not committed.
        CorruptCheckpointError: a member is missing or fails its checks; names the file.
    """
    if not storage.exists(manifest_path(ckpt_id)):
        raise CheckpointNotFoundError(f"checkpoint {ckpt_id} is not committed under {storage.root}")
    if verify:
        problems = verify_checkpoint(storage, ckpt_id)
        if problems:
            p = problems[0]
            more = f" (and {len(problems) - 1} more problems; `cnr verify` lists them)" if len(problems) > 1 else ""
            raise CorruptCheckpointError(f"{p.path}: {p.message}{more}", path=p.path)
    return walk_chain(load_manifest(storage, ckpt_id), lambda i: load_manifest(storage, i))


def count_entries(chain: list[Manifest]) -> int:
    """Table entries in a chain (for a progress bar)."""
    return sum(len(m.entries()) for m in chain)
