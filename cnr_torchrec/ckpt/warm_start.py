"""Warm start: chosen tables of any checkpoint into a model that may differ from the one that wrote it.

:func:`warm_start` takes, for each of the model's tables it is told to fill, a table of the checkpoint (the
same name, or another: a rename), and optionally a row map (``remap[table][new_row]`` is the old row, or -1
for a new id the old vocabulary lacks: :func:`vocabulary_remap` builds one from two vocabulary files). Each
rank reads, through the chain assembly a restore's rule and checks apply (:func:`~cnr_torchrec.ckpt.format.
tables.assemble_regions`), only the block of old rows and columns its own shards need, on any plan and world
size, from any chain (plain, residual, folded, keyed). The model's other tables, and the rows no old row maps
to, keep their own values.

The model remembers the report: the first ``Checkpointer`` on it records it as its root's origin
(``origin.json``, :mod:`~cnr_torchrec.ckpt.format.origin`, shown by ``cnr inspect``), and a save into the
source root is refused, so a warm-started job saves into a root of its own, its first save a baseline.

It is all or nothing: every rank decodes what it will write first, the ranks agree that every one of them
succeeded, and only then is anything written; a failure anywhere leaves the model as it was and raises the
same named error on every rank. The source root is only read.

Refused by name: a table the checkpoint lacks, a table of the model told twice, another embedding dim unless
``columns="fit"`` (copy the columns both have, leave the rest), fused optimizer state of another layout than
the model's unless ``optimizer_state="reset"``, a row map of the wrong length or into rows the old table lacks.
A managed-collision table's rows move by raw id, as a restore onto another world size relocates them
(:func:`_stage_remapped`); a row map, another dim, or a managed-collision table into a plain one are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from cnr_torchrec.ckpt._collective import Failure, Ranks
from cnr_torchrec.ckpt.format.blocks import Region
from cnr_torchrec.ckpt.format.bytes.roots import normal_root
from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.commits import load_manifest, walk_chain
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.tables import ReadRegions, assemble_tables, read_regions
from cnr_torchrec.ckpt.live.dense_params import dense_named_state
from cnr_torchrec.ckpt.restore.relocate import ids_for_rank, router, write_rows
from cnr_torchrec.ckpt.tools.root import open_storage, resolve_id
from cnr_torchrec.errors import ConfigError, IncompatibleCheckpointError

__all__ = ["TableReport", "WarmStartReport", "vocabulary_remap", "warm_start"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TableReport:
    """What one table of the model got: ``loaded`` rows from table ``source`` (``remapped`` through a row map),
    ``fresh`` rows left as the model had them, the ``columns`` copied, and its fused optimizer state
    (``"kept"``, moved with its rows; ``"reset"``, left as the model had it, as asked or because the
    checkpoint holds none for it, a data_parallel table's being the dense optimizer's; ``"none"``: the model's
    table has none)."""

    table: str
    source: str
    loaded: int
    fresh: int
    remapped: bool
    columns: int
    optimizer: str


@dataclass(frozen=True)
class WarmStartReport:
    """What :func:`warm_start` did, the same on every rank: the checkpoint read (``root``, ``ckpt``, ``step``),
    each table filled, the model's tables left ``untouched``, the dense tensors loaded, and ``digest``, a
    sha256 of the mapping (tables, row maps, columns, optimizer, dense) that a new root can record."""

    root: str
    ckpt: int
    step: int
    tables: dict[str, TableReport]
    untouched: list[str]
    dense: list[str] = field(default_factory=list)
    digest: str = ""


@dataclass
class _Write:
    """One shard's rows to fill: shard rows ``rows`` take rows ``pick`` of ``region`` (as assembled), in columns
    ``[c0, c1)`` of the shard, with their fused optimizer states (``states``: kept). ``direct``: the region is
    those very rows and columns of the shard, in order, so it is decoded straight into them."""

    table: str
    weights: torch.Tensor
    live_states: list[torch.Tensor]
    rows: torch.Tensor
    pick: torch.Tensor
    region: Region
    cols: tuple[int, int]
    counted: bool  # the shard holds the table's first columns (a row counts once, whatever its column shards)
    states: bool = False
    direct: bool = False


@dataclass
class _Staged:
    """What every rank reads and checks before any rank writes: the regions' rows (``read``, None when no
    plain table is filled), the shards' writes, and the managed-collision tables' relocations."""

    read: ReadRegions | None
    writes: list[_Write]
    relocations: list[Any]

    def into(self) -> dict[Region, torch.Tensor]:
        """The live shard blocks the direct writes decode into."""
        return {w.region: _block(w) for w in self.writes if w.direct}


def warm_start(model: nn.Module, root: str, *, tables: Mapping[str, str] | Sequence[str] | None = None,
               remap: Mapping[str, torch.Tensor] | None = None, columns: Literal["exact", "fit"] = "exact",
               optimizer_state: Literal["keep", "reset"] = "keep", dense: Mapping[str, str] | None = None,
               ckpt: int | None = None, storage_options: Mapping[str, Any] | None = None,
               key: Any = None) -> WarmStartReport:
    """Fills tables of ``model`` (a ``CheckNRunDMP``, any plan and world size) from checkpoint ``ckpt`` of
    ``root`` (default: the newest committed state). Every rank calls it at once.

    Args:
        tables: ``{model's table: checkpoint's table}``; a list names tables kept under their names; None:
            every table of the model the checkpoint holds under the same name.
        remap: per model table, an int64 tensor with one entry per row of the model's table: the checkpoint
            table's row it takes, or -1 to keep the model's own (a new id). Without one, row ``r`` takes row
            ``r`` (a grown table keeps its new rows, a shrunk one drops the old rows past its end).
        columns: ``"exact"`` refuses another embedding dim; ``"fit"`` copies the columns both tables have.
        optimizer_state: ``"keep"`` moves each row's fused optimizer state with it (the layouts must match);
            ``"reset"`` leaves the model's own.
        dense: ``{model's name prefix: checkpoint's name prefix}`` for dense parameters and buffers (``{"":
            ""}``: every one by its own name); None: none. The dense optimizer, RNG and extra state are never
            taken.
        key: the root's key (:func:`~cnr_torchrec.ckpt.format.bytes.integrity.load_key`), for a keyed root.

    Returns:
        A :class:`WarmStartReport`, the same on every rank.

    Raises:
        ConfigError: a table, row map or option that does not fit the model or the checkpoint (named).
        IncompatibleCheckpointError: another dim without ``columns="fit"``, optimizer state of another
            layout with ``optimizer_state="keep"``, a dense tensor of another shape.
        CheckpointNotFoundError, CorruptCheckpointError, UnauthenticatedCheckpointError: as a restore raises
            them. Whatever is raised, on every rank, and the model is left as it was.
    """
    ranks = Ranks()
    tracker = getattr(model, "dirty_tracker", None)
    if tracker is None:
        raise ConfigError(f"warm_start takes a CheckNRunDMP; got a {type(model).__name__}")
    shapes, mc_of = _shapes(ranks, tracker)
    materialize = getattr(model, "materialize_init", None)
    if materialize is not None:  # the tables a warm start leaves fresh keep the model's own initial values
        materialize()
    storage = open_storage(root, storage_options, key)
    failure, cause = None, None
    try:
        cid = int(ranks.from_rank0(lambda: resolve_id(storage, ckpt), what="choosing the checkpoint to warm start"))
        staged = _Staged(None, [], [])
        report, dense_values = None, {}
        try:
            chain = walk_chain(load_manifest(storage, cid), lambda i: load_manifest(storage, i))
            pairs = _pairs(shapes, chain[-1], tables)
            _check(shapes, mc_of, chain, pairs, remap or {}, columns, optimizer_state)
            staged, counts, kept = _stage(storage, chain, tracker, pairs, remap or {}, optimizer_state)
            dense_values = _dense(storage, chain[-1], model, tracker, dense)
            report = _report(normal_root(root), chain[-1], tracker, shapes, pairs, remap or {}, columns,
                             optimizer_state, counts, kept, sorted(dense_values))
        except Exception as e:  # every rank must hear of it before anything is written
            failure, cause = Failure.of(e, ranks.rank, "warm start"), e
        ranks.raise_any(failure, cause)
        assert report is not None  # no rank failed
        _write(staged, model, dense_values)
    finally:
        storage.close()
    told = ranks.exchange({t: [r.loaded, r.optimizer] for t, r in report.tables.items()})
    for t, r in list(report.tables.items()):  # data_parallel tables count once (every rank holds them)
        loaded = told[0][t][0] if tracker.is_data_parallel(t) else sum(x[t][0] for x in told)
        labels = {x[t][1] for x in told}
        state = "kept" if "kept" in labels else "reset" if "reset" in labels else "none"
        report.tables[t] = TableReport(t, r.source, loaded, shapes[t][0] - loaded, r.remapped, r.columns, state)
    model._cnr_warm_start = report  # type: ignore[assignment]  # the Checkpointer records it as the root's origin
    log.info("warm start from checkpoint %d (step %d) of %s: %s", report.ckpt, report.step, root,
             ", ".join(f"{t} <- {r.source}: {r.loaded} rows" for t, r in sorted(report.tables.items())))
    return report


def vocabulary_remap(old_vocabulary: str | Sequence[str], new_vocabulary: str | Sequence[str]) -> torch.Tensor:
    """The row map of a table whose rows are a vocabulary's entries, in order: for each entry of the new
    vocabulary its row in the old one, or -1 where the old one lacks it. A vocabulary is a file (one entry
    per line, as TensorFlow's ``VocabInfo`` reads them) or a sequence of entries.

    Raises:
        ConfigError: a file that cannot be read, or a vocabulary that names an entry twice.
    """
    old, new = _vocabulary(old_vocabulary), _vocabulary(new_vocabulary)
    index = {entry: i for i, entry in enumerate(old)}
    return torch.tensor([index.get(entry, -1) for entry in new], dtype=torch.int64)


def _vocabulary(source: str | Sequence[str]) -> list[str]:
    if isinstance(source, str):
        try:
            with open(source) as f:
                entries = [line.rstrip("\n") for line in f]
        except OSError as e:
            raise ConfigError(f"vocabulary file {source}: {e.strerror or e}; give a file of one entry per line") from e
    else:
        entries = [str(e) for e in source]
    seen: set[str] = set()
    for entry in entries:
        if entry in seen:
            raise ConfigError(f"the vocabulary names {entry!r} twice; each entry names one row")
        seen.add(entry)
    return entries


# ---------------------------------------------------------------------- checks


def _shapes(ranks: Ranks, tracker: Any) -> tuple[dict[str, tuple[int, int]], dict[str, bool]]:
    """Every table of the model, its whole shape and whether it is a managed-collision table (a rank knows the
    tables it holds shards of; all ranks tell)."""
    mine = {t: [*shape, tracker.mc_table(t) is not None] for t in tracker.tables()
            if (shape := tracker.table_shape(t)) is not None}
    shapes: dict[str, tuple[int, int]] = {}
    mc_of: dict[str, bool] = {}
    for told in ranks.exchange(mine):
        shapes |= {t: (int(r), int(d)) for t, (r, d, _) in told.items()}
        mc_of |= {t: bool(mc) for t, (_, _, mc) in told.items()}
    return shapes, mc_of


def _pairs(shapes: Mapping[str, tuple[int, int]], tip: Manifest,
           tables: Mapping[str, str] | Sequence[str] | None) -> dict[str, str]:
    """``{model table: checkpoint table}`` as asked, checked against both."""
    mine = set(shapes)
    if tables is None:
        pairs = {t: t for t in sorted(mine) if t in tip.tables}
    elif isinstance(tables, Mapping):
        pairs = dict(tables)
    else:
        if len(set(tables)) != len(tables):
            raise ConfigError(f"tables names a table twice: {list(tables)}")
        pairs = {t: t for t in tables}
    unknown = sorted(set(pairs) - mine)
    if unknown:
        raise ConfigError(f"the model has no table {unknown} (it has {sorted(mine)}); name the model's tables as "
                          "tables={model's table: checkpoint's table}")
    missing = sorted({old for old in pairs.values() if old not in tip.tables})
    if missing:
        raise ConfigError(f"checkpoint {tip.id} holds no table {missing} (it holds {sorted(tip.tables)})")
    if not pairs:
        raise ConfigError(f"checkpoint {tip.id} holds none of the model's tables {sorted(mine)} by name; say which "
                          "to take with tables={model's table: checkpoint's table}")
    return pairs


def _check(shapes: Mapping[str, tuple[int, int]], mc_of: Mapping[str, bool], chain: list[Manifest],
           pairs: Mapping[str, str], remap: Mapping[str, torch.Tensor], columns: str, optimizer_state: str) -> None:
    tip, remapped = chain[-1], _mc_tables(chain[0])
    if columns not in ("exact", "fit"):
        raise ConfigError(f"columns={columns!r}: give 'exact' (the same dim) or 'fit' (the columns both have)")
    if optimizer_state not in ("keep", "reset"):
        raise ConfigError(f"optimizer_state={optimizer_state!r}: give 'keep' or 'reset'")
    unknown = sorted(set(remap) - set(pairs))
    if unknown:
        raise ConfigError(f"remap names {unknown}, which this warm start does not fill (it fills {sorted(pairs)})")
    for new, old in pairs.items():
        (rows, dim), (old_rows, old_dim) = shapes[new], tip.tables[old]
        if mc_of.get(new, False) != (old in remapped):
            raise ConfigError(f"table '{new}' is {'a' if mc_of.get(new) else 'no'} managed-collision table and "
                              f"checkpoint {tip.id}'s '{old}' is {'one' if old in remapped else 'not'}: take a "
                              "managed-collision table into one, a plain table into a plain one")
        if mc_of.get(new) and (new in remap or dim != old_dim):
            raise ConfigError(f"table '{new}' is a managed-collision table: its raw ids are its vocabulary (each row "
                              "moves to the slot its raw id routes to), so it takes no row map and the same dim")
        if dim != old_dim and columns == "exact":
            raise IncompatibleCheckpointError(
                f"table '{new}' has {dim} columns, checkpoint {tip.id}'s '{old}' {old_dim}: pass columns='fit' to copy "
                f"the {min(dim, old_dim)} columns both have, or warm start another table")
        if new in remap:
            m = remap[new]
            if m.dtype != torch.int64 or m.dim() != 1 or m.numel() != rows:
                raise ConfigError(f"remap['{new}'] must be an int64 tensor of {rows} entries (one per row of the "
                                  f"model's table), got {m.dtype} {list(m.shape)}")
            if m.numel() and (int(m.max()) >= old_rows or int(m.min()) < -1):
                raise ConfigError(f"remap['{new}'] names rows outside [-1, {old_rows}) of checkpoint table '{old}'")


def _mc_tables(base: Manifest) -> set[str]:
    """The managed-collision tables of a chain, by its baseline (which stores every table's rows)."""
    return {t for _, t, e in base.entries() if e.mc is not None}


# ---------------------------------------------------------------------- staging


def _stage(storage: Any, chain: list[Manifest], tracker: Any, pairs: Mapping[str, str],
           remap: Mapping[str, torch.Tensor], optimizer_state: str) -> tuple[_Staged, dict[str, int], set[str]]:
    """Every shard's rows of this rank, read and checked (nothing decoded into the model yet): the staged
    writes, the rows loaded per table, and the tables whose fused optimizer state moves with them."""
    tip = chain[-1]
    mc_pairs = {new: old for new, old in pairs.items() if tracker.mc_table(new) is not None}
    writes: list[_Write] = []
    for new, old in sorted(pairs.items()):
        if new in mc_pairs:
            continue
        old_rows, old_dim = tip.tables[old]
        for kernel, shard in tracker.shards(new):
            (r0, r1), (c0, c1) = shard.rows, shard.cols
            c1 = min(c1, old_dim)
            if c0 >= c1:
                continue  # a column shard past the old dim: left as the model has it
            source = remap[new][r0:r1] if new in remap else torch.arange(r0, r1)
            local = torch.nonzero((source >= 0) & (source < old_rows)).view(-1)
            if not local.numel():
                continue
            src = source[local]
            lo, hi = (0, old_rows) if old in tip.replicated else (int(src.min()), int(src.max()) + 1)
            live = kernel.tbe.split_optimizer_states() if hasattr(kernel.tbe, "split_optimizer_states") else []
            writes.append(_Write(new, kernel.tbe.split_embedding_weights()[shard.local_index],
                                 list(live[shard.local_index]) if live else [], local, src - lo,
                                 Region(old, (lo, hi), (c0, c1)), (0, c1 - c0), shard.cols[0] == 0))
    uses = Counter(w.region for w in writes)
    for w in writes:  # (host float32 weights: a table on a GPU or of another dtype is staged on the host, as before)
        w.direct = (uses[w.region] == 1 and w.region.table not in tip.replicated and w.weights.dtype == torch.float32
                    and w.weights.device.type == "cpu" and _in_order(w))
    read = read_regions(storage, chain, {w.region for w in writes}, into={w.region for w in writes if w.direct}) \
        if writes else None
    counts, kept = {t: 0 for t in pairs}, set()
    for w in writes:
        assert read is not None  # read above for these writes
        w.states = _keeps_states(w, read.state_kinds(w.region), tracker, optimizer_state)
        counts[w.table] += int(w.rows.numel()) if w.counted else 0
        if w.states:
            kept.add(w.table)
    relocations = []
    for new, rows, moves_state, relocation in _stage_remapped(storage, chain, tracker, mc_pairs, optimizer_state):
        counts[new] += rows
        relocations.append(relocation)
        if moves_state:
            kept.add(new)
    return _Staged(read, writes, relocations), counts, kept


def _stage_remapped(storage: Any, chain: list[Manifest], tracker: Any, pairs: Mapping[str, str],
                    optimizer_state: str) -> list[tuple[str, int, bool, Any]]:
    """Managed-collision tables: each old row moves, by its raw id, to this rank's slots where the raw id routes
    now, the ids the module's eviction policy keeps where they outnumber the slots, as a restore onto another
    world size relocates them (:mod:`~cnr_torchrec.ckpt.restore.relocate`); the last slot, which the module's
    misses read, and the eviction window (a new run's) stay the model's own. Returns (table, rows, whether its
    optimizer state moves, the relocation to run once every rank has read its rows)."""
    if not pairs:
        return []
    whole = assemble_tables(storage, chain, tables=set(pairs.values()))
    out = []
    for new, old in sorted(pairs.items()):
        data, mc = whole[old], tracker.mc_table(new)
        if data.mc is None or data.mc.shape[1] != len(mc.fields):
            raise IncompatibleCheckpointError(
                f"table '{new}': checkpoint table '{old}' keeps its remapping with "
                f"{None if data.mc is None else data.mc.shape[1]} fields, the model's module {list(mc.fields)}; "
                "warm start it into a module of the same eviction policy")
        order = ids_for_rank(new, data, mc, [], dist.get_rank() if dist.is_initialized() else 0,
                             router(mc, tracker, dist.get_world_size() if dist.is_initialized() else 1))
        keep = optimizer_state == "keep" and bool(data.states)
        out.append((new, int(order.numel()), keep,
                    functools.partial(write_rows, new, data, order, None, mc, tracker, states=keep)))
    return out


def _keeps_states(w: _Write, stored: list[bool], tracker: Any, optimizer_state: str) -> bool:
    """Whether the fused optimizer states move with ``w``'s rows: ``stored`` says whether each state the checkpoint
    holds for its region is row-wise, and the model's must match it.

    Raises:
        IncompatibleCheckpointError: another number or kind of states than the model's, unless reset.
    """
    if optimizer_state == "reset" or tracker.is_data_parallel(w.table) or not w.live_states or not stored:
        return False  # reset, none in the model, or none in the checkpoint (a data_parallel table's is the dense one's)
    if len(stored) != len(w.live_states):
        raise IncompatibleCheckpointError(
            f"table '{w.table}': the checkpoint's '{w.region.table}' stores {len(stored)} fused optimizer states, "
            f"the model's optimizer keeps {len(w.live_states)}: pass optimizer_state='reset' to leave the model's own")
    for rowwise, have in zip(stored, w.live_states):
        if (have.dim() == 1) != rowwise:
            raise IncompatibleCheckpointError(
                f"table '{w.table}': the checkpoint's '{w.region.table}' stores "
                f"{'row-wise' if rowwise else 'per-element'} optimizer state, the model's optimizer the other kind: "
                "pass optimizer_state='reset'")
    return True


def _in_order(w: _Write) -> bool:
    """Whether ``w``'s region is its shard rows, one run, in order (each region row to the next shard row)."""
    n = int(w.rows.numel())
    return (w.region.rows[1] - w.region.rows[0] == n and int(w.rows[-1]) - int(w.rows[0]) + 1 == n
            and torch.equal(w.pick, torch.arange(n)))


def _block(w: _Write) -> torch.Tensor:
    """The live rows and columns of ``w``'s shard that its region fills (a view)."""
    first, n = int(w.rows[0]), int(w.rows.numel())
    return w.weights[first : first + n, w.cols[0] : w.cols[1]]


def _rows_of(block: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """Rows ``pick`` of ``block``: the block itself where they are all of its rows in order (no copy)."""
    if pick.numel() == block.shape[0] and torch.equal(pick, torch.arange(block.shape[0])):
        return block
    return block.index_select(0, pick)


def _dense(storage: Any, tip: Manifest, model: nn.Module, tracker: Any,
           prefixes: Mapping[str, str] | None) -> dict[str, torch.Tensor]:
    """The model's dense tensors the checkpoint holds under the mapped names, read from rank 0's part."""
    if not prefixes:
        return {}
    first = tip.ranks[0]
    load = RowReader(storage, first.payload)
    out = {}
    for name, t in dense_named_state(model, tracker.module_fqns()).items():
        prefix = max((p for p in prefixes if name.startswith(p)), key=len, default=None)
        if prefix is None:
            continue
        old = prefixes[prefix] + name[len(prefix):]
        if old not in first.dense:
            continue
        value = load(first.dense[old])
        if tuple(value.shape) != tuple(t.shape):
            raise IncompatibleCheckpointError(f"dense {name!r} is {list(t.shape)} in the model, checkpoint "
                                              f"{tip.id}'s {old!r} {list(value.shape)}; map it elsewhere or leave it "
                                              "out of dense=")
        out[name] = value.clone()
    return out


def _report(root: str, tip: Manifest, tracker: Any, shapes: Mapping[str, tuple[int, int]], pairs: Mapping[str, str],
            remap: Mapping[str, torch.Tensor], columns: str, optimizer_state: str, counts: Mapping[str, int],
            kept: set[str], dense: list[str]) -> WarmStartReport:
    """This rank's report (:func:`warm_start` merges the ranks')."""
    tables = {}
    for new, old in pairs.items():
        has_state = not tracker.is_data_parallel(new) and any(
            hasattr(k.tbe, "split_optimizer_states") and k.tbe.split_optimizer_states() for k, _ in tracker.shards(new))
        tables[new] = TableReport(new, old, counts[new], 0, new in remap, min(shapes[new][1], tip.tables[old][1]),
                                  "kept" if new in kept else "reset" if has_state else "none")
    h = hashlib.sha256(json.dumps({"tables": dict(sorted(pairs.items())), "columns": columns,
                                   "optimizer": optimizer_state, "dense": dense}, sort_keys=True).encode())
    for t in sorted(remap):
        h.update(t.encode() + remap[t].numpy().tobytes())
    untouched = sorted(set(shapes) - set(pairs))
    return WarmStartReport(root, tip.id, tip.step, tables, untouched, dense, h.hexdigest())


# ---------------------------------------------------------------------- writing


def _write(staged: _Staged, model: nn.Module, dense: Mapping[str, torch.Tensor]) -> None:
    """Writes what every rank read and checked: the plain tables' rows (a direct region decoded straight into
    its shard), their optimizer states, the relocated managed-collision tables, then the dense tensors."""
    with torch.no_grad():
        assembled = staged.read.assemble(staged.into()) if staged.read is not None else {}
        for w in staged.writes:
            data = assembled[w.region]
            rows = _span_of(w.rows)
            c0, c1 = w.cols
            if not w.direct:
                view = w.weights if (c0, c1) == (0, w.weights.shape[1]) else w.weights[:, c0:c1]
                view[rows] = _rows_of(data.weights, w.pick).to(w.weights.dtype)
            if not w.states:
                continue
            n = int(w.pick.numel())
            for saved, live in zip(data.states, w.live_states):
                picked = dataclasses.replace(saved, values=_rows_of(saved.values, w.pick))
                value = picked.for_shard((0, n), (0, c1 - c0))
                target = live if live.dim() == 1 or (c0, c1) == (0, live.shape[1]) else live[:, c0:c1]
                target[rows] = value.to(live.dtype)
        for relocation in staged.relocations:
            relocation()
        if dense:
            tracker = getattr(model, "dirty_tracker")
            mine = dense_named_state(model, tracker.module_fqns())
            for name, value in dense.items():
                mine[name].copy_(value)


def _span_of(rows: torch.Tensor) -> torch.Tensor | slice:
    """``rows`` (ascending) as a slice where they are one run, which copies without a scatter."""
    n = int(rows.numel())
    if n and int(rows[-1]) - int(rows[0]) + 1 == n:
        return slice(int(rows[0]), int(rows[0]) + n)
    return rows
