"""A chain applied to whole, unsharded tables in memory: the offline form of what a restore does to shards.

Every entry carries its global row and column range, and its rows carry offsets into that
range, so a chain's entries can be applied to whole tables, newest checkpoint first and reading
only the rows no newer checkpoint stored, as a restore reads them (a residual entry adds onto what
is below it). The result feeds relocation of managed-collision tables on restore
(:mod:`cnr_torchrec.ckpt.restore.relocate`), ``cnr compact`` and the background fold
(:mod:`cnr_torchrec.ckpt.compact`) and ``cnr export`` (:mod:`cnr_torchrec.ckpt.tools`); it reads
manifests and payloads only, and knows nothing of models, trackers or the tools that call it.

Row-wise optimizer state is one value per row of a column shard. It is kept here as one value per row
and column segment (the column ranges no entry of the chain cuts), so that it can be cut again along any
column range: exactly the saved value when the range lies in one saved shard, the width-weighted mean
otherwise (which is what a restore onto such a shard computes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from cnr_torchrec.ckpt.format.blocks import Region
from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import manifest_path
from cnr_torchrec.ckpt.format.manifest import Manifest, TableEntry
from cnr_torchrec.ckpt.format.precedence import Coverage, closes, newest_first, segments_of
from cnr_torchrec.ckpt.format.row_ids import stored_offsets
from cnr_torchrec.errors import CorruptCheckpointError
from cnr_torchrec.quant import EncodedRows, EncodingFormatError, codec_for, decode, rebuild

__all__ = ["Progress", "ReadRegions", "RowState", "TableData", "assemble_regions", "assemble_tables", "read_regions"]

Progress = Callable[[int], Any]
"""Called with the number of entries just processed (``tqdm.update`` fits)."""


@dataclass
class RowState:
    """One optimizer state of a table or block (momentum, row-wise Adagrad sum...).

    Attributes:
        rowwise: one value per row of each shard (row-wise Adagrad) rather than one per element.
        values: float32; per element ``[rows, dim]``; row-wise ``[rows, segments]``, one value per row and
            column segment of :attr:`bounds`.
        dtype: the dtype the checkpoint stored it in (the ``state_dtype`` of the job).
        bounds: row-wise state: the column segments' edges, from 0 to the width (``(0, 16, 32)``: two
            segments).
    """

    rowwise: bool
    values: torch.Tensor
    dtype: torch.dtype = torch.float32
    bounds: tuple[int, ...] = ()

    def for_shard(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The state as a shard with these ranges stores it: ``[rows]`` if row-wise, else ``[rows, cols]``."""
        if not self.rowwise:
            return self.values[rows[0] : rows[1], cols[0] : cols[1]].contiguous()
        block, edges = self.values[rows[0] : rows[1]], self.bounds
        overlaps = [(k, min(b, cols[1]) - max(a, cols[0])) for k, (a, b) in enumerate(zip(edges[:-1], edges[1:]))]
        overlaps = [(k, w) for k, w in overlaps if w > 0]
        first = block[:, overlaps[0][0]]
        if all(torch.equal(block[:, k], first) for k, _ in overlaps[1:]):
            return first.clone()  # one saved shard's value (or several equal ones), exactly
        ks = torch.tensor([k for k, _ in overlaps])
        widths = torch.tensor([w for _, w in overlaps], dtype=torch.float64)
        return ((block.index_select(1, ks).double() * widths).sum(dim=1) / widths.sum()).float()

    def per_row(self) -> torch.Tensor:
        """Row-wise state of the whole table or block (``[rows]``): the width-weighted mean over its segments."""
        if not self.rowwise:
            raise ValueError("per_row() is for row-wise state")
        return self.for_shard((0, self.values.shape[0]), (0, self.bounds[-1]))

    def rows(self, index: torch.Tensor) -> RowState:
        """The state of rows ``index`` (in that order), cut as this one is."""
        return RowState(self.rowwise, self.values.index_select(0, index), self.dtype, self.bounds)


class TableData(NamedTuple):
    """A whole table after applying a chain: fp32 weights ``[rows, dim]``, its optimizer states, and for a
    managed-collision table its by-row state (int64 ``[rows, fields]``, :class:`~.manifest.McRows`).

    The weights may share memory with the checkpoint's mapped files (a private mapping: writes stay in the
    process) and with other regions of the same assembly that hold the same stored rows; copy before writing
    where several regions of one table are kept."""

    weights: torch.Tensor
    states: list[RowState]
    mc: torch.Tensor | None = None
    mc_fields: tuple[str, ...] = ()

    def mc_rows(self, rows: tuple[int, int]) -> tuple[torch.Tensor, tuple[str, ...]] | None:
        """The by-row state of rows ``[rows)`` with its fields, as :func:`~.rows.write_rows` takes it."""
        return None if self.mc is None else (self.mc[rows[0] : rows[1]].contiguous(), self.mc_fields)


def assemble_tables(
    storage: Storage, chain: list[Manifest], progress: Progress | None = None,
    tables: Collection[str] | None = None,
) -> dict[str, TableData]:
    """Applies the entries of ``chain`` (baseline first) to whole tables, by global row and column range.

    As a restore does, the chain is read newest checkpoint first, and of each entry only the
    rows that no newer checkpoint stored for its columns (their byte ranges, checked against
    their CRCs; :class:`~cnr_torchrec.ckpt.format.bytes.rows.RowReader`). A residual entry
    (``quantization.residual``) adds to the rows of the older entries instead of replacing them,
    oldest copy first as a restore adds them, so that the sums are a restore's to the bit.

    Replicated (data_parallel) tables come from the tip, as in a restore; they have no
    row states (the dense optimizer holds theirs).

    Args:
        tables: only these tables (default: every one).

    Raises:
        CorruptCheckpointError: an entry does not decode, or the chain leaves part of a table unwritten.
    """
    tip = chain[-1]
    shapes = {t: s for t, s in tip.tables.items() if tables is None or t in tables}
    whole = [Region(t, (0, int(rows)), (0, int(dim))) for t, (rows, dim) in shapes.items()]
    return {region.table: data for region, data in assemble_regions(storage, chain, whole, progress).items()}


def assemble_regions(storage: Storage, chain: list[Manifest], regions: Collection[Region],
                     progress: Progress | None = None) -> dict[Region, TableData]:
    """Applies the entries of ``chain`` to blocks of tables (:func:`assemble_tables` for whole tables):
    each region gets float32 weights ``[its rows, its columns]`` and its optimizer states, from the rows
    and columns of the entries that overlap it (:func:`read_regions`, then :meth:`ReadRegions.assemble`).

    Raises:
        CorruptCheckpointError: an entry does not decode, or the chain leaves part of a region unwritten.
    """
    return read_regions(storage, chain, regions, progress).assemble()


def read_regions(storage: Storage, chain: list[Manifest], regions: Collection[Region],
                 progress: Progress | None = None, into: Collection[Region] = ()) -> ReadRegions:
    """Reads and checks every stored row that the entries of ``chain`` give ``regions``, by the chain's rule,
    decoding nothing: what :meth:`ReadRegions.assemble` then decodes cannot fail on what the checkpoint holds.

    ``into`` names the regions whose weights the caller will give memory for (``assemble(into=...)``): on a
    local root their rows are checked where they lie, and copied out only then, straight into that memory
    where they are its float32 rows, in order.

    Raises:
        CorruptCheckpointError: an entry outside its table, rows that do not match their CRCs or their codec's
            layout, a managed-collision state of two shapes, or a chain that leaves part of a region unwritten.
    """
    tip = chain[-1]
    for region in regions:
        if region.table not in tip.tables:
            raise CorruptCheckpointError(f"table '{region.table}' is not among the tables of checkpoint {tip.id}",
                                         path=manifest_path(tip.id))
    replicated = {g for g in regions if g.table in tip.replicated}
    sharded: dict[str, list[Region]] = {}
    for g in regions:
        if g not in replicated:
            sharded.setdefault(g.table, []).append(g)
    breaks: dict[str, set[int]] = {}
    for m in chain:
        for _, table, entry in m.entries():
            breaks.setdefault(table, set()).update(entry.cols)
    covered: dict[Region, _Covered] = {}
    for g in (g for gs in sharded.values() for g in gs):
        segs = segments_of(g.cols, sorted(breaks.get(g.table, ())))
        n = g.rows[1] - g.rows[0]
        covered[g] = _Covered(Coverage(n, segs), Coverage(n, segs), Coverage(n, [g.cols]))
    claims: list[_EntryClaim] = []  # made newest copy first, applied oldest first (the rule's sums)
    for m in newest_first(chain):
        for report in m.ranks:
            file = report.file
            load = RowReader(storage, report.payload)
            for table, entries in report.tables.items():
                if table not in tip.tables:
                    raise CorruptCheckpointError(
                        f"{file}: table '{table}' is not among the tables of checkpoint {tip.id}", path=file
                    )
                for entry in entries:
                    _check_inside(entry, table, tip.tables[table], file)
                    for g in sharded.get(table, ()):
                        claim = _claim_entry(covered[g], g, table, entry, load, file)
                        if claim is not None:
                            claims.append(claim)
                    if progress is not None:
                        progress(1)
    _check_covered(chain, {g: c.weights for g, c in covered.items()})
    read = [_read_claim(c, c.region in into) for c in reversed(claims)]
    _check_mc_fields(read)
    return ReadRegions(list(covered), read, _replicated_tables(storage, tip, replicated))


class ReadRegions:
    """The checked rows of a chain for some regions (:func:`read_regions`), ready to decode.

    Attributes:
        regions: the sharded regions (the replicated ones come whole from the tip).
    """

    def __init__(self, regions: list[Region], claims: list[_ReadClaim], replicated: dict[Region, TableData]) -> None:
        self.regions, self._claims, self._replicated = regions, claims, replicated
        self._sums = {c.claim.region for c in claims if c.claim.entry.residual}

    def state_kinds(self, region: Region) -> list[bool]:
        """Whether each optimizer state the chain stores for ``region`` is row-wise (in the order
        :attr:`TableData.states` holds them), known before anything is decoded."""
        kinds: list[bool] = []
        for c in self._claims:
            if c.claim.region == region:
                refs = c.claim.entry.states
                kinds += [ref.rowwise for ref in refs[len(kinds):]]
        return kinds

    def assemble(self, into: Mapping[Region, torch.Tensor] | None = None) -> dict[Region, TableData]:
        """Decodes the rows read into each region's weights, oldest claim first (:func:`_apply_entry`).

        Args:
            into: for some sharded regions, float32 tensors of the region's shape with contiguous columns to
                decode into (a live shard's rows and columns): their weights are written there, the rows of a
                region with residuals first set to zero, and the region's :attr:`TableData.weights` is that
                tensor. Other regions get memory of their own.
        """
        into = into or {}
        out: dict[Region, TableData] = {}
        for g in self.regions:
            # Where residuals add, the sums start from zero (the rule). Elsewhere every claim is a whole copy of
            # rows no other claim gives, and the chain was checked to give every row, so untouched memory does.
            given = into.get(g)
            if given is not None:
                if given.dtype != torch.float32 or tuple(given.shape) != (g.rows[1] - g.rows[0], g.cols[1] - g.cols[0]):
                    raise ValueError(f"into[{g}] must be float32 {g.rows[1] - g.rows[0]} x {g.cols[1] - g.cols[0]}, "
                                     f"got {given.dtype} {tuple(given.shape)}")
                if g in self._sums:
                    given.zero_()
                weights = given
            else:
                shape = (g.rows[1] - g.rows[0], g.cols[1] - g.cols[0])
                weights = (torch.zeros if g in self._sums else torch.empty)(shape, dtype=torch.float32)
            out[g] = TableData(weights, [])
        alone = {g for g, n in Counter(c.claim.region for c in self._claims).items() if n == 1} - set(into)
        for c in self._claims:
            region = c.claim.region
            out[region] = _apply_entry(out[region], c, region in alone, region in self._sums)
        out.update(self._replicated)
        return out


class _Covered(NamedTuple):
    """What newer entries gave of a region (:mod:`~cnr_torchrec.ckpt.format.precedence`): its weights (closed by
    whole entries), its states (by any) and its managed-collision state (by any, one segment)."""

    weights: Coverage
    states: Coverage
    mc: Coverage


def _check_inside(entry: TableEntry, table: str, shape: tuple[int, int], file: str) -> None:
    """An entry lies inside its own checkpoint's table (the schema), but the tip's may differ."""
    (r0, r1), (c0, c1) = entry.rows, entry.cols
    if not (r1 <= shape[0] and c1 <= shape[1]):
        raise CorruptCheckpointError(
            f"{file}: an entry of table '{table}' spans rows [{r0}, {r1}) x cols [{c0}, {c1}), "
            f"outside the table's {shape[0]} x {shape[1]}",
            path=file,
        )


class _EntryClaim(NamedTuple):
    """The rows and columns one entry gives a region (:func:`_claim_entry`), to apply (:func:`_apply_entry`)."""

    region: Region
    table: str
    entry: TableEntry
    load: RowReader
    file: str
    segs: list[tuple[int, int]]
    region_segs: list[tuple[int, int]]  # every column segment of the region, in order
    maps: list[torch.Tensor]
    state_maps: list[torch.Tensor]
    mc_map: torch.Tensor | None
    pick: torch.Tensor  # the stored rows to read


def _claim_entry(covered: _Covered, region: Region, table: str, entry: TableEntry, load: RowReader,
                 file: str) -> _EntryClaim | None:
    """Claims the rows and columns one entry holds of ``region`` by the chain's rule (reading only its row ids
    and row modes): the open rows its whole copies close or its residuals add onto, and the optimizer and
    managed-collision states no newer entry gave. None when it gives nothing."""
    (w0, w1), (v0, v1) = region.rows, region.cols
    (r0, r1), (c0, c1) = entry.rows, entry.cols
    a0, a1 = max(c0, v0), min(c1, v1)  # the columns the entry holds of the region
    if max(r0, w0) >= min(r1, w1) or a0 >= a1:
        return None
    offsets = stored_offsets(entry, load, f"{file}: table '{table}': ", file)
    whole = closes(entry, load, f"{file}: table '{table}': ", file)
    n = entry.num_stored
    at = (max(r0, w0) - r0, min(r1, w1) - r0, r0 - w0)  # entry rows [lo, hi) land on region row o + shift
    segs = [seg for seg in covered.weights.filled if a0 <= seg[0] and seg[1] <= a1]
    maps = [covered.weights.claim(seg, offsets, n, *at, closes=whole) for seg in segs]
    state_maps = [covered.states.claim(seg, offsets, n, *at, closes=True) for seg in segs] if entry.states else []
    mc_map = covered.mc.claim(region.cols, offsets, n, *at, closes=True) if entry.mc is not None else None
    needed = torch.zeros(n, dtype=torch.bool)
    for mp in (*maps, *state_maps, *([mc_map] if mc_map is not None else [])):
        needed |= mp >= 0
    pick = torch.from_numpy(np.flatnonzero(needed.numpy()))
    if not pick.numel():
        return None
    return _EntryClaim(region, table, entry, load, file, segs, list(covered.weights.filled), maps, state_maps, mc_map,
                       pick)


class _ReadClaim(NamedTuple):
    """A claim's stored rows, read and checked (:func:`_read_claim`): its rows encoded, then the parts of its
    optimizer states and managed-collision state, as the entry stores them. ``later``: checked where they lie
    and not copied yet (the tensors are then on the meta device: their shapes, for the codec's check)."""

    claim: _EntryClaim
    encoded: EncodedRows
    extra: list[torch.Tensor]
    later: bool = False


def _read_claim(claim: _EntryClaim, later: bool = False) -> _ReadClaim:
    """Reads the rows ``claim`` took (checked against their CRCs) and rebuilds them as their codec stores them;
    ``later``: leaves them where they lie, checked, where the reader can (:meth:`~.rows.RowReader.check`)."""
    table, entry, file = claim.table, claim.entry, claim.file
    parts = claim.load.check(entry, claim.pick) if later else claim.load.rows(entry, claim.pick)
    keys = sorted(entry.coded.blobs)
    encoded = _rebuild(claim, parts)
    c0, c1 = entry.cols
    if encoded.dim != c1 - c0:
        raise CorruptCheckpointError(
            f"{file}: table '{table}' stores rows of {encoded.dim} values for columns [{c0}, {c1})", path=file)
    return _ReadClaim(claim, encoded, parts[len(keys):], later and parts[0].is_meta)


def _check_mc_fields(claims: list[_ReadClaim]) -> None:
    """The entries that give one region managed-collision state give it with the same fields."""
    fields: dict[Region, tuple[str, ...]] = {}
    for c in claims:
        entry = c.claim.entry
        if c.claim.mc_map is None or entry.mc is None:
            continue
        seen = fields.setdefault(c.claim.region, entry.mc_rows.fields)
        if len(seen) != len(entry.mc_rows.fields):
            raise CorruptCheckpointError(
                f"{c.claim.file}: table '{c.claim.table}' stores managed-collision state with fields "
                f"{list(entry.mc_rows.fields)} and, in another entry, {len(seen)} fields", path=c.claim.file)


def _copy_out(read: _ReadClaim, weights: torch.Tensor, sums: bool) -> tuple[_ReadClaim, bool]:
    """Copies out the rows of a claim checked where they lie (``read.later``): straight into ``weights`` when they
    are its float32 rows, every one in order and every column (and nothing is added: no residuals), then True;
    else into memory of their own, to decode as any claim's."""
    claim, entry = read.claim, read.encoded
    n_rows = weights.shape[0]
    keys = sorted(claim.entry.coded.blobs)
    whole = (not sums and entry.method == "none" and claim.segs == [claim.entry.cols] and len(claim.maps) == 1
             and claim.entry.cols == claim.region.cols and claim.pick.numel() == n_rows and weights.is_contiguous()
             and bool((claim.maps[0].index_select(0, claim.pick) == torch.arange(n_rows)).all()))
    into = {claim.entry.coded.blobs["payload"]: weights.view(torch.uint8)} if whole and keys == ["payload"] else None
    parts = claim.load.rows(claim.entry, claim.pick, into)
    return _ReadClaim(claim, _rebuild(claim, parts), parts[len(keys):]), into is not None


def _rebuild(claim: _EntryClaim, parts: list[torch.Tensor]) -> EncodedRows:
    """A claim's rows as their codec stores them, checked against its layout."""
    entry, keys = claim.entry, sorted(claim.entry.coded.blobs)
    try:
        return rebuild(dict(zip(keys, parts)), {**entry.coded.meta, "num_rows": claim.pick.numel()})
    except EncodingFormatError as e:
        raise CorruptCheckpointError(f"{claim.file}: encoded rows of table '{claim.table}' are inconsistent: {e}",
                                     path=claim.file) from None


def _apply_entry(data: TableData, read: _ReadClaim, alone: bool, sums: bool) -> TableData:
    """Applies what a claim took of its region: decodes the claimed rows and writes them (a whole copy) or
    adds them (a residual; one rounded add per copy, onto the older copies applied before), and sets the
    claimed optimizer and managed-collision states.

    Claims are applied oldest first. In a region with residuals (``sums``) every claim adds onto a block that
    starts from zero, so the claims alone say which copies make a row (:mod:`~.precedence`). In a region of
    whole copies only, each claim writes its rows, which no other claim gives; the one claim of such a region
    (``alone``) that gives every row of it, in order, gives its decoded rows as the region's weights: for
    float32 rows, the rows as read, with no copy, which may then share memory with the checkpoint's mapped file
    (privately: writes to them stay in the process). Rows decode straight to their places where the entry's
    columns are one segment of the region (the codec's ``decode_into``: no decoded temporary)."""
    claim = read.claim
    region, entry = claim.region, claim.entry
    segs, maps, state_maps, mc_map, pick = claim.segs, claim.maps, claim.state_maps, claim.mc_map, claim.pick
    v0 = region.cols[0]
    c0, c1 = entry.cols
    n_rows, n_cols = data.weights.shape
    copied = False  # the region's weights are its rows, copied into place
    if read.later:
        read, copied = _copy_out(read, data.weights, sums)
    encoded = read.encoded
    codec = codec_for(encoded)
    decoded: torch.Tensor | None = None  # the claimed rows decoded, where a segment needs them cut
    for seg, mp in zip([] if copied else segs, maps):
        dst_of = mp.index_select(0, pick)  # the block row of each row read (-1: another's)
        if not sums and alone and seg == (c0, c1) and (seg[1] - seg[0], pick.numel()) == (n_cols, n_rows) and bool(
                (dst_of == torch.arange(n_rows)).all()):
            rows = codec.view_decoded(encoded)
            if rows is not None:  # the region in one copy, in order: its rows as read
                data = data._replace(weights=rows)
                continue
        block = data.weights[:, seg[0] - v0 : seg[1] - v0]
        if seg == (c0, c1):
            codec.decode_into(encoded, block, dst_of, accumulate=sums)  # (an entry stores a row once: distinct)
            continue
        if decoded is None:
            decoded = decode(encoded)
        src, dst = _kept(dst_of)
        rows = decoded.index_select(0, src)[:, seg[0] - c0 : seg[1] - c0]
        if sums:  # one rounded add per element, as ``x[dst] += y`` makes it (no index repeats)
            block.index_add_(0, dst, rows)
        else:
            block.index_copy_(0, dst, rows)
    bounds = (*(a - v0 for a, _ in claim.region_segs), claim.region_segs[-1][1] - v0)
    for j, (ref, t) in enumerate(zip(entry.states, read.extra)):
        if j == len(data.states):
            width = len(bounds) - 1 if ref.rowwise else n_cols
            data.states.append(RowState(ref.rowwise, torch.zeros(n_rows, width, dtype=torch.float32), t.dtype,
                                        bounds if ref.rowwise else ()))
        vals = t.float().reshape(t.shape[0], -1)
        for seg, mp in zip(segs, state_maps):
            src, dst = _kept(mp.index_select(0, pick))
            if ref.rowwise:  # the entry's one value a row, in the segment's column
                data.states[j].values[dst, bounds.index(seg[0] - v0)] = vals[src, 0]
            else:
                data.states[j].values[dst, seg[0] - v0 : seg[1] - v0] = vals[src, seg[0] - c0 : seg[1] - c0]
    if mc_map is not None:
        if data.mc is None:
            data = data._replace(mc=torch.zeros(n_rows, len(entry.mc_rows.fields), dtype=torch.int64),
                                 mc_fields=entry.mc_rows.fields)
        src, dst = _kept(mc_map.index_select(0, pick))
        assert data.mc is not None  # made above where it was missing
        data.mc[dst] = read.extra[-1][src]
    return data


def _kept(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, destinations) of the entries of a claim map that land somewhere (>= 0)."""
    src = torch.from_numpy(np.flatnonzero((index >= 0).numpy()))
    return src, index.index_select(0, src)


def _replicated_tables(storage: Storage, tip: Manifest, regions: Collection[Region]) -> dict[Region, TableData]:
    """Blocks of the data_parallel tables, from rank 0's report of the tip (as a restore takes them)."""
    first = tip.ranks[0]
    load0 = RowReader(storage, first.payload) if regions else None
    out = {}
    for g in sorted(regions, key=lambda g: (g.table, g.rows, g.cols)):
        if g.table not in first.replicated_tables:
            raise CorruptCheckpointError(
                f"{first.file}: replicated table '{g.table}' is not stored by rank 0", path=first.file
            )
        assert load0 is not None  # made above for these regions
        whole = load0(first.replicated_tables[g.table])
        out[g] = TableData(whole[g.rows[0] : g.rows[1], g.cols[0] : g.cols[1]].float().clone(), [])
    return out


def _check_covered(chain: list[Manifest], covered: Mapping[Region, Coverage]) -> None:
    """Every row and column of the sharded ``regions`` was written by a whole copy in the chain."""
    for g, cov in covered.items():
        if not cov.complete():
            base = manifest_path(chain[0].id)
            open_rows = torch.zeros(cov.num_rows, dtype=torch.bool)
            for mask in cov.filled.values():
                open_rows |= ~mask
            missing = int(open_rows.sum())
            what = f"table '{g.table}'" if g.rows[0] == 0 and g.cols[0] == 0 and missing == cov.num_rows else (
                f"rows [{g.rows[0]}, {g.rows[1]}) x cols [{g.cols[0]}, {g.cols[1]}) of table '{g.table}'")
            raise CorruptCheckpointError(
                f"the chain {[m.id for m in chain]} leaves {missing} rows of {what} unwritten; "
                f"its baseline ({base}) is incomplete",
                path=base,
            )
