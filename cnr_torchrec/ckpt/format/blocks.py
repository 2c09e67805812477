"""A checkpoint's layout as blocks of tables: which rows and columns each rank's shards cover.

A merge writes a checkpoint region by region, and an export cuts tables along the shards of
the checkpoint it exports; both read the blocks from here, and both need them to tile every
table exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cnr_torchrec.ckpt.format.commits import manifest_path
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.errors import CorruptCheckpointError

__all__ = ["ShardKey", "shard_key", "Region", "regions_of_layout"]

ShardKey = tuple[str, tuple[int, int], tuple[int, int]]
"""A shard: (table, global rows ``[start, end)``, global columns ``[start, end)``)."""


def shard_key(table: str, rows: Sequence[int], cols: Sequence[int]) -> ShardKey:
    """The :data:`ShardKey` of a shard of ``table`` (ranges as lists or tuples)."""
    return (table, (int(rows[0]), int(rows[1])), (int(cols[0]), int(cols[1])))


@dataclass(frozen=True)
class Region:
    """A block of a table that one rank writes in a merge.

    Attributes:
        table: the table's name.
        rows: global rows ``[start, end)``.
        cols: columns ``[start, end)``.
    """

    table: str
    rows: tuple[int, int]
    cols: tuple[int, int]


def regions_of_layout(tip: Manifest) -> dict[int, list[Region]]:
    """Regions from a checkpoint's own layout, by rank: each rank report's entry blocks, and on rank 0
    every table the checkpoint stored replicated (offline compaction keeps the tip's layout).

    Raises:
        CorruptCheckpointError: the blocks do not tile some table exactly once (a merge would
            drop or repeat rows).
    """
    out: dict[int, list[Region]] = {r.rank: [] for r in tip.ranks}
    for r in tip.ranks:
        blocks = {(t, e.rows, e.cols) for t, e in r.entries()}
        out[r.rank] += [Region(t, rows, cols) for t, rows, cols in sorted(blocks)]
    for table in tip.replicated:
        rows, cols = tip.tables[table]
        out.setdefault(0, []).append(Region(table, (0, rows), (0, cols)))
    _check_tiling([g for rs in out.values() for g in rs], tip)
    return out


def _check_tiling(regions: list[Region], tip: Manifest) -> None:
    """Raises CorruptCheckpointError unless ``regions`` cover every cell of every table of ``tip`` once."""
    for table, (n_rows, n_cols) in tip.tables.items():
        mine = [g for g in regions if g.table == table]
        rows = sorted({0, int(n_rows), *(v for g in mine for v in g.rows)})
        cols = sorted({0, int(n_cols), *(v for g in mine for v in g.cols)})
        at_row, at_col = {v: i for i, v in enumerate(rows)}, {v: i for i, v in enumerate(cols)}
        count = np.zeros((len(rows), len(cols)), dtype=np.int64)  # a 2-D difference array on the block edges
        for g in mine:
            (a, b), (c, d) = [at_row[v] for v in g.rows], [at_col[v] for v in g.cols]
            count[a, c] += 1
            count[b, c] -= 1
            count[a, d] -= 1
            count[b, d] += 1
        cells = count.cumsum(0).cumsum(1)[:-1, :-1]  # how many blocks hold each cell of the edge grid
        if (rows[0], rows[-1], cols[0], cols[-1]) != (0, int(n_rows), 0, int(n_cols)) or not (cells == 1).all():
            path = manifest_path(tip.id)
            raise CorruptCheckpointError(
                f"{path}: the shards of checkpoint {tip.id} do not cover table '{table}' "
                f"({n_rows} x {n_cols}) exactly once, so a merge in its layout would drop or repeat rows", path=path)
