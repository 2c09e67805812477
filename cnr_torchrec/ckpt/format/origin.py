"""Where a root came from: ``origin.json``, written once by a job warm-started from another root.

``{"format": "cnr-origin", "root", "root_digest", "ckpt", "step", "tables", "mapping_digest", "unix"}``: the
source root (as a job on its host names it) and its digest, the checkpoint and step the warm start read, the
tables it filled (``{this model's table: the source's}``) and the sha256 of its whole mapping
(:class:`~cnr_torchrec.ckpt.warm_start.WarmStartReport`). The job's first Checkpointer on an empty root
writes it (rank 0, atomically); ``cnr inspect`` shows it. It is never rewritten, and nothing restores from it.
"""

from __future__ import annotations

import json
import time
from typing import Any

from cnr_torchrec.ckpt.format.bytes.roots import root_digest
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.errors import CheckpointNotFoundError

__all__ = ["ORIGIN", "read_origin", "write_origin"]

ORIGIN = "origin.json"


def write_origin(storage: Storage, report: Any) -> None:
    """Records warm start ``report`` as the root's origin, unless the root has one already."""
    if storage.exists(ORIGIN):
        return
    doc = {"format": "cnr-origin", "root": report.root, "root_digest": root_digest(report.root), "ckpt": report.ckpt,
           "step": report.step, "tables": {t: r.source for t, r in sorted(report.tables.items())},
           "mapping_digest": report.digest, "unix": time.time()}
    storage.write_atomic(ORIGIN, json.dumps(doc, indent=1).encode())


def read_origin(storage: Storage) -> dict[str, Any] | None:
    """The root's origin, or None where it has none (or one that is not a JSON object)."""
    try:
        doc = json.loads(storage.read(ORIGIN))
    except (CheckpointNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == "cnr-origin" else None
