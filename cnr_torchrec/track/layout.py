"""The tracker's map of the model: the plan's tables, and this rank's shards of them on each TBE.

The tracker's other parts keep their state per TBE, in lists in the order of
:attr:`ShardLayout.kernels`, and name a TBE by its position there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cnr_torchrec.errors import UnknownTableError
from cnr_torchrec.track.discovery import ShardSlice, TrackedKernel

__all__ = ["ShardLayout"]


class ShardLayout:
    """The plan's tables and this rank's shards of them, each with the index of the TBE that holds it.

    Args:
        plan_tables: every table of the plan, as :func:`~cnr_torchrec.track.discovery.plan_table_shapes`
            gives them.
        kernels: this rank's TBEs, as :func:`~cnr_torchrec.track.discovery.find_kernels` gives them.
    """

    def __init__(self, plan_tables: dict[str, dict[str, object]], kernels: list[TrackedKernel]) -> None:
        self.kernels = kernels
        # Where the tracker keeps each TBE's state: with its row offsets, so that the hook never copies.
        self.devices: list[torch.device] = [info.tbe.hash_size_cumsum.device for info in kernels]
        self._plan = plan_tables
        self._shards: dict[str, list[tuple[int, ShardSlice]]] = {t: [] for t in plan_tables}
        self._shapes: dict[str, tuple[int, int]] = {}
        for i, info in enumerate(kernels):
            for cfg, shard in zip(info.kernel.config.embedding_tables, info.shards):
                self._shards[shard.table].append((i, shard))
                self._shapes[shard.table] = (int(cfg.num_embeddings), int(cfg.embedding_dim))

    def entry(self, table: str) -> dict[str, object]:
        """The plan's entry for ``table``.

        Raises:
            UnknownTableError: the model has no table of that name.
        """
        try:
            return self._plan[table]
        except KeyError:
            raise UnknownTableError(
                f"no embedding table named '{table}'; the model has {sorted(self._plan)}"
            ) from None

    def tables(self) -> list[str]:
        """Every table of the plan, in its order."""
        return list(self._plan)

    def bounds_check_modes(self) -> dict[str, object]:
        """The plan's ``bounds_check_mode`` of each table (None where it sets none)."""
        return {t: e["bounds_check_mode"] for t, e in self._plan.items()}

    def shards(self, table: str) -> list[tuple[int, ShardSlice]]:
        """This rank's shards of ``table``, each with its TBE's index (raises UnknownTableError)."""
        self.entry(table)
        return self._shards[table]

    def kernels_of(self, table: str) -> list[int]:
        """Indices of the TBEs that hold shards of ``table``, each once (KeyError for an unknown table)."""
        return list(dict.fromkeys(i for i, _ in self._shards[table]))

    def table_shape(self, table: str) -> tuple[int, int] | None:
        """``(num_embeddings, embedding_dim)`` of ``table``, or None if this rank holds none of it."""
        self.entry(table)
        return self._shapes.get(table)

    def kept_flat_rows(self, keep: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``keep`` (global rows per table) as sorted flat TBE rows on each TBE's device, per TBE index.

        Rows this rank does not hold, and those of data_parallel shards, are left out.

        Raises:
            UnknownTableError: ``keep`` names a table the model does not have.
        """
        parts: dict[int, list[torch.Tensor]] = {}
        for table, rows in keep.items():
            self.entry(table)
            rows = torch.as_tensor(rows, dtype=torch.int64).cpu()
            for i, s in self._shards[table]:
                if self.kernels[i].data_parallel or rows.numel() == 0:
                    continue
                mine = rows[(rows >= s.rows[0]) & (rows < s.rows[1])]
                parts.setdefault(i, []).append(mine + (s.flat_start - s.rows[0]))
        return {i: torch.unique(torch.cat(parts[i])).to(self.devices[i]) for i in sorted(parts)}
