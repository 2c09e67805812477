"""``cnr copy --compact``: a chain copied to another root as one baseline.

The chain is copied as ``cnr copy`` copies it (:func:`~cnr_torchrec.ckpt.tools.copy.copy_checkpoints`: every
file checked, each checkpoint committed last), compacted in the destination as ``cnr compact`` compacts
(:func:`~cnr_torchrec.ckpt.compact.offline.compact`: lossless, it restores as the chain's tip, bit for bit),
and then its members are removed there, each uncommitted before its files go, as retention collects one. The
new baseline commits before any member goes, so a copy stopped in between leaves both, each restorable; a copy
run again finds the compaction there and copies nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from cnr_torchrec.ckpt.compact.offline import compact
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import (
    ckpt_dir,
    committed_ids,
    load_manifest,
    manifest_path,
    walk_chain,
    write_index,
)
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.tools.copy import CopyReport, copy_checkpoints
from cnr_torchrec.ckpt.tools.root import resolve_id

__all__ = ["copy_compacted"]


def copy_compacted(src: Storage, dst: Storage, ckpt: int | None = None,
                   progress: Callable[[int], None] | None = None) -> CopyReport:
    """Copies the chain of ``ckpt`` (default: the newest committed state) from ``src`` to ``dst`` as one
    baseline. Raises what :func:`copy_checkpoints` and :func:`compact` raise."""
    tip = load_manifest(src, resolve_id(src, ckpt))
    ids = [m.id for m in walk_chain(tip, lambda i: load_manifest(src, i))]
    if _compacted_already(dst, tip):
        return CopyReport(skipped=ids)
    report = copy_checkpoints(src, dst, ckpt=tip.id, progress=progress)
    compact(dst, tip.id)
    for cid in ids:  # uncommit each member (its manifest), then its files
        files = load_manifest(dst, cid).files
        dst.delete(manifest_path(cid))
        dst.remove_dir(ckpt_dir(cid), files)
    write_index(dst, committed_ids(dst))
    return report


def _compacted_already(dst: Storage, tip: Manifest) -> bool:
    """Whether ``dst`` holds a compaction of the chain of ``tip`` (an earlier ``--compact`` copy)."""
    for cid in committed_ids(dst):
        m = load_manifest(dst, cid)
        if m.equals == tip.id and m.step == tip.step and m.compacted_from is not None:
            return True
    return False
