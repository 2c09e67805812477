"""Which stored copy of a row a chain gives back: the one rule every reader of a chain follows.

A chain is read newest checkpoint first (:func:`newest_first`). For each destination block (a
shard being restored, a region being assembled or merged) and each column segment of it, a row
is *open* until a whole copy of it has been applied:

* a whole copy (a baseline's row, a plain delta's row, a folded or merged row) is applied to the
  open rows it holds and closes them: older copies of those rows are never read;
* a residual copy (``quantization.residual``) is added onto the open rows it holds and closes none:
  the row is the sum of every residual above its newest whole copy, and that copy. A residual
  entry may store some rows whole (format 6: its ``whole`` bitmap, the rows that coded closer
  whole than as a residual); those are whole copies, and close;
* the sum is taken oldest copy first, starting from zero, one rounded float32 add per copy:
  ``(((0 + whole) + r_1) + r_2) + ... + r_n``. That is the order a writer builds it in as the chain
  grows (the residual reconstruction, :mod:`~cnr_torchrec.ckpt.save.residual`, which the memory tier
  keeps as the restore image), so the claims, made newest first, are applied in the other order.
  Every reader adds in this order, so every path, and the writer's own copy, give the same bits.

Optimizer state and a managed-collision table's by-row state are not sums: the newest copy of
either kind gives them (:meth:`Coverage.claim` with ``closes=True``).

The restore (:mod:`~cnr_torchrec.ckpt.restore.apply`), the whole-table assembler
(:mod:`~cnr_torchrec.ckpt.format.tables`: export, relocation, the fold) and the lossless merge
(:mod:`~cnr_torchrec.ckpt.compact.merge`) claim rows through :class:`Coverage` and read the chain
through :func:`newest_first`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from cnr_torchrec.ckpt.format.manifest import Manifest, TableEntry
from cnr_torchrec.ckpt.format.row_ids import stored_modes
from cnr_torchrec.ops import claim_rows_

__all__ = ["Coverage", "closes", "newest_first", "segments_of"]


def newest_first(chain: Sequence[Manifest]) -> Iterator[Manifest]:
    """The checkpoints of ``chain`` (baseline first) in the order every reader applies them."""
    return reversed(list(chain))


def closes(entry: TableEntry, blob: Callable[[str], torch.Tensor] | None = None, where: str = "",
           path: str = "") -> bool | torch.Tensor:
    """Which of ``entry``'s stored rows close the rows they land on (whole copies) rather than add onto them
    (residuals): True for every row of a plain entry, False for every row of a residual entry that marks
    none whole, else a bool ``[num_stored]`` read from its bitmap through ``blob``.

    Raises:
        CorruptCheckpointError: the bitmap does not match the entry
            (:func:`~cnr_torchrec.ckpt.format.row_ids.stored_modes`).
    """
    if not entry.residual:
        return True
    if entry.whole is None:
        return False
    if blob is None:
        raise ValueError("a residual entry with rows stored whole: pass a reader of its blobs")
    whole = stored_modes(entry, blob, where, path)
    return False if whole is None else whole


def segments_of(cols: tuple[int, int], breaks: Sequence[int]) -> list[tuple[int, int]]:
    """``cols`` cut at every edge in ``breaks`` that falls inside it: the column segments a chain written
    under several plans splits a block into."""
    c0, c1 = cols
    edges = sorted({c0, c1, *(b for b in breaks if c0 < b < c1)})
    return list(zip(edges[:-1], edges[1:]))


class Coverage:
    """Which rows of a block the chain has given so far, per column segment.

    Attributes:
        num_rows: the block's rows.
        filled: per segment, a bool ``[rows]`` mask of the rows a whole copy has closed (True: closed).
    """

    def __init__(self, num_rows: int, segments: Sequence[tuple[int, int]]) -> None:
        self.num_rows = num_rows
        self.filled = {seg: torch.zeros(num_rows, dtype=torch.bool) for seg in segments}

    def claim(self, seg: tuple[int, int], offsets: torch.Tensor | None, count: int, lo: int, hi: int, shift: int,
              *, closes: bool | torch.Tensor) -> torch.Tensor:
        """The block row each stored row of an entry goes to in segment ``seg`` (-1: none), by the rule.

        The entry stores ``count`` rows at entry rows ``offsets`` (None: ``0 .. count-1``); stored
        row ``p`` at entry row ``o`` lands on block row ``o + shift`` when ``lo <= o < hi`` and that row is
        open. ``closes``: whether the stored rows are whole copies, which close the rows they take (all
        or none, or a bool per stored row: :func:`closes`).
        """
        mask = self.filled[seg]
        if isinstance(closes, bool):
            return claim_rows_(mask if closes else mask.clone(), offsets, count, lo, hi, shift)
        taken = claim_rows_(mask.clone(), offsets, count, lo, hi, shift)
        shut = taken.numpy()[closes.numpy()]  # an entry stores a row once, so the rows it takes are distinct
        mask.numpy()[shut[shut >= 0]] = True  # (numpy's indexing: a third of torch's time on these)
        return taken

    def complete(self) -> bool:
        """Whether every row of every segment is closed."""
        return all(bool(m.numpy().all()) for m in self.filled.values())
