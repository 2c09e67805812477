"""Where a restore's time goes: the phases its ``stats`` dict adds up, in milliseconds.

* ``resolve_ms``: choosing the chain, on every rank until it hears rank 0's pick (listing the
  root, reading and checking manifests and file sizes on rank 0), of which
  ``manifests_ms``: this rank's manifest reads, seal and schema checks;
* ``check_ms``: comparing the chain's tip with the model;
* ``snapshot_ms``: the host copy of what the restore may overwrite (``restore_rollback``), and
  ``rollback_ms``: putting it back, after a restore that failed;
* ``stage_ms``: setting up the shards' restore, host copies included: a residual chain adds up into
  host copies of the shards, zeroed first (new memory, ``staged_copy_bytes`` of it, unless the caller
  gave buffers), which costs with the shard bytes and the machine's page faults;
* ``plan_ms``: working out which stored rows of which checkpoints this rank's shards need (reading
  the entries' row ids and claiming rows), and starting their reads;
* ``apply_ms``: gathering those rows, checking their CRCs, decoding and writing them into the
  shards, of which ``read_wait_ms``: waiting for reads still in flight; a staged plain chain
  (``restore_rollback``) reads and checks every row first, before any write (``check_rows_ms``:
  the CRCs, the codec's layout and the shapes; read waits count there), and decodes them in place
  at its commit (``apply_ms`` is then part of ``commit_ms``);
* ``relocate_ms``: managed-collision tables whose slots moved, restored by raw id (only when there are);
* ``state_ms``: dense parameters, the dense optimizer, the TBE step, per-rank state;
* ``agree_ms``: the ranks' exchange of their outcome, then ``commit_ms``: the checked rows decoded, or
  the staged shards copied, into the model (``restore_rollback``), and the ranks' exchange of that outcome;
* ``reconstruction_ms``: with residual coding, the float32 copy of what was restored that the next
  deltas code against (after the ranks agreed); with the memory tier, the image sealed for the restored
  checkpoint too (unless the shards came from it);
* ``memory_check_ms``: with the memory tier, reading this rank's image seal and checking its bytes against
  it, and ``memory_ms``: the shards copied (or staged) from the image, when the rank took it.

``from_memory`` is 1 where this rank's shards came from its memory image, else 0, and ``memory_ranks``
how many ranks' did (:attr:`~cnr_torchrec.ckpt.Checkpointer.last_restore_sources` says why, rank by rank).

``bytes_read`` and ``reads`` count what was read from storage (from a mapped local file: the
bytes copied out of it, and one read per file mapped); ``minimal_bytes`` is what
had to be: the stored bytes (encoded row, optimizer state and CRC, prorated by columns) of the
rows the restore applied, each from the newest checkpoint that holds it. Their ratio is how far
the reads are from the physical limit. ``staged_copy_bytes`` is the new host memory the restore took for
copies of shards (a residual chain's, without a reconstruction to stage into: 0 for a plain chain), and
``snapshot_bytes`` the rollback's host copy of what the restore may overwrite (optimizer states, dense).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["COUNTS", "PHASES", "timed"]

PHASES = ("resolve_ms", "manifests_ms", "check_ms", "snapshot_ms", "stage_ms", "plan_ms", "check_rows_ms",
          "apply_ms", "read_wait_ms", "relocate_ms", "state_ms", "agree_ms", "commit_ms", "rollback_ms",
          "reconstruction_ms", "memory_check_ms", "memory_ms")
COUNTS = ("bytes_read", "reads", "minimal_bytes", "from_memory", "memory_ranks", "staged_copy_bytes", "snapshot_bytes")


@contextmanager
def timed(stats: dict[str, float] | None, key: str) -> Iterator[None]:
    """Adds the wall time of the ``with`` block to ``stats[key]`` (ms); nothing when ``stats`` is None."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if stats is not None:
            stats[key] = stats.get(key, 0.0) + (time.perf_counter() - t0) * 1e3
