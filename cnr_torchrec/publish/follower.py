"""A follower: every committed checkpoint of a root, applied in order to a serving copy of the model.

:meth:`Follower.poll` looks at the root's newest committed state (the one ``Checkpointer.restore()``
would take first). If its chain holds the checkpoint the follower serves, the members after it are
applied one by one, oldest first, each touching only the rows it stores (:mod:`.updates`). If it hangs on
a background merge of the chain served (a compaction that keeps every row's stored bytes), the folded
chain's members up to the merge's tip are applied, the merge adopted (it restores as its tip, bit for
bit) and the new chain's members applied. Otherwise (a new baseline, a fold of residuals, the served
checkpoint collected by retention, a first poll) the follower reloads from that chain whole
(:func:`~cnr_torchrec.ckpt.format.tables.assemble_tables`). A follower with a ``lease`` writes what it
serves under the root after each update, which a job's ``keep.followers`` keeps the rest from
(:mod:`~cnr_torchrec.ckpt.format.leases`). Every
manifest, part and row goes through the checks a restore makes, and an update is applied whole or
not at all: its changes are staged first, and the served copy is written only once they all decoded.
A checkpoint that fails its checks is named and left out: the copy stays at the version before it,
and the next poll reloads from a newer chain.

The follower keeps the float32 rows of the tables it serves (the rows under each residual: their bytes,
``tables``' shapes times 4), and a cursor: what it serves (root, checkpoint, step, chain, and a digest of
the manifests it applied, in order), written atomically after each update where ``cursor`` names a file;
a follower given another root's cursor refuses it. :meth:`Follower.resume` takes a saved cursor and the
float rows it stood for (what ``cnr publish`` keeps, :mod:`.snapshot`): the next poll goes on from it,
with deltas, after checking that the root's chain up to the cursor is the one whose manifests the digest
covers (a root rewritten under the same ids is reloaded from, and says so).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import xxhash
from torch import nn

from cnr_torchrec.ckpt.format.bytes.roots import normal_root
from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest, walk_chain
from cnr_torchrec.ckpt.format.leases import check_name, write_lease
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.tables import assemble_tables
from cnr_torchrec.ckpt.tools.root import open_storage, resolve_id
from cnr_torchrec.errors import CheckpointError, CnrError, ConfigError, IncompatibleCheckpointError
from cnr_torchrec.publish.targets import Dense, McSink, Sink, Tables, dense_of, sinks_of
from cnr_torchrec.publish.updates import Change, read_dense, stage_checkpoint

__all__ = ["Cursor", "Follower", "Update", "chain_digest"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cursor:
    """What a follower serves: ``ckpt`` of ``root`` (at ``step``), whose chain is ``chain``; ``digest`` is
    :func:`chain_digest` of the manifests it applied, the chain's in order."""

    root: str
    ckpt: int
    step: int
    chain: tuple[int, ...]
    digest: str


def chain_digest(manifests: Sequence[Manifest], start: str = "") -> str:
    """xxh3-128 folded over ``manifests`` in order, from ``start`` (a digest of the ones before): each
    manifest's id and its body as canonical JSON. A reload of a chain and a follower that applied the same
    chain one delta at a time reach the same digest."""
    digest = start
    for m in manifests:
        digest = xxhash.xxh3_128_hexdigest(f"{digest}|{m.id}|{json.dumps(m.body, sort_keys=True)}".encode())
    return digest


@dataclass(frozen=True)
class Update:
    """One checkpoint applied: ``how`` is ``"delta"`` (its rows onto the served copy), ``"adopt"`` (a merge
    equal to the checkpoint served: nothing written) or ``"reload"`` (the whole chain), with ``why``;
    ``rows`` the rows written, ``bytes_read`` what a delta read of its parts and payloads (0 for a reload),
    ``lag_s`` the time from its commit to served."""

    ckpt: int
    step: int
    how: str
    why: str
    rows: int
    apply_ms: float
    lag_s: float
    bytes_read: int = 0


class Follower:
    """Serves the newest committed checkpoint of ``root`` into ``target``, following each new one.

    Args:
        root: the checkpoint root (a path, ``fs://``, ``s3://``; ``storage_options`` as the Checkpointer's).
        target: an unsharded model (its EmbeddingBagCollections and EmbeddingCollections, or TorchRec's
            quantized inference modules: :mod:`.targets`) or a state_dict by the training model's names.
        tables: the tables to serve (default: every table the target holds); the others are never read.
        cursor: a file to keep the cursor in, written atomically after each update (None: none).
        key: the root's key, if it has one (:func:`~cnr_torchrec.ckpt.format.bytes.integrity.load_key`).
        lease: a name to write this follower's lease under in the root after each update
            (:mod:`~cnr_torchrec.ckpt.format.leases`): a job whose ``keep.followers`` names it keeps every
            checkpoint from the one served on, so a compaction or retention never makes it reload.

    A target may also give its own tables (:class:`~cnr_torchrec.publish.targets.Tables`), as ``cnr publish``'s
    snapshot does.

    Raises:
        ConfigError: a target without tables, tables it does not hold, or a cursor of another root.
    """

    def __init__(self, root: str, target: nn.Module | MutableMapping[str, torch.Tensor] | Tables, *,
                 tables: Sequence[str] | None = None, cursor: str | None = None,
                 storage_options: Mapping[str, Any] | None = None, key: Any = None,
                 lease: str | None = None) -> None:
        self._root, self._target, self._cursor_path = normal_root(root), target, cursor
        self._lease = None if lease is None else check_name(lease, "lease")
        if cursor is not None and os.path.exists(cursor):
            saved = _read_cursor(cursor)
            if saved.root != self._root:
                raise ConfigError(f"{cursor} is the cursor of a follower of {saved.root}, not of {self._root}; give "
                                  "this follower a cursor file of its own")
        self._storage: Storage = open_storage(root, storage_options, key)
        self._only = None if tables is None else list(tables)
        self._served: dict[str, torch.Tensor] = {}  # float32 rows of the served tables, as the chain gave them
        self._remapping: dict[str, torch.Tensor] = {}  # managed-collision tables' state by row (raw id first)
        self._dense = Dense({})  # the target's dense parameters and buffers, bound with its tables
        self._live: dict[str, Sink] = {}  # the target's own tables
        self.cursor: Cursor | None = None
        self._bad: set[int] = set()  # checkpoints that failed their checks: never applied

    def close(self) -> None:
        self._storage.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def root(self) -> str:
        """The root followed, as a job on this host names it (a local one as an absolute path)."""
        return self._root

    @property
    def served_rows(self) -> Mapping[str, torch.Tensor]:
        """The float32 rows of each served table, as the chain gave them (the follower's own: do not write)."""
        return self._served

    def resume(self, cursor: Cursor, rows: Mapping[str, torch.Tensor]) -> None:
        """Goes on from ``cursor`` and the float32 ``rows`` (by table) it stood for, as a follower of this root
        kept them (:attr:`cursor`, :attr:`served_rows`). The next :meth:`poll` writes them to the target and
        applies what was committed since, or reloads (and says why) where the root's chain no longer holds
        that checkpoint, or holds another one under its id.

        Raises:
            ConfigError: a cursor of another root, or rows of other tables than this follower serves.
        """
        if cursor.root != self._root:
            raise ConfigError(f"the cursor given to resume is a follower's of {cursor.root}, not of {self._root}; "
                              "resume from this root's own, or start without one")
        if self._only is not None and sorted(rows) != sorted(self._only):
            raise ConfigError(f"the rows given to resume hold tables {sorted(rows)}; this follower serves "
                              f"{sorted(self._only)}")
        self._served, self._live, self.cursor = {t: w.float() for t, w in rows.items()}, {}, cursor

    # ------------------------------------------------------------------ following

    def poll(self) -> list[Update]:
        """Applies every checkpoint committed since the last poll, oldest first. Returns what was applied.

        Raises:
            CheckpointNotFoundError: nothing is committed under the root.
            IncompatibleCheckpointError: the root's tables do not fit the target's (another model).
            CorruptCheckpointError (and the other CheckpointErrors): the newest chain fails its checks; the
                served copy is left as it was, and that checkpoint is never applied.
        """
        newest = resolve_id(self._storage)
        resumed = self.cursor is not None and not self._live  # rows given to resume(), not yet written
        if (self.cursor is not None and newest == self.cursor.ckpt and not resumed) or newest in self._bad:
            return []
        trying = newest  # the checkpoint being read: the one named, and never tried again, if it fails
        updates: list[Update] = []
        try:
            chain = self._chain(newest)
            if any(m.id in self._bad for m in chain):
                return []
            route = self._route(chain)
            if route is None:
                return [self._reload(chain, self._why_reload(chain))]
            below, steps = route
            assert self.cursor is not None  # a route starts at it
            if chain_digest(below) != self.cursor.digest:
                return [self._reload(chain, f"checkpoint {self.cursor.ckpt} of the root is not the one served "
                                            "(its chain's manifests differ from the cursor's digest: the root was "
                                            "rewritten)")]
            if resumed and (why := self._rebind(below[-1])):
                return [self._reload(chain, why)]
            for how, m in steps:
                trying = m.id
                updates.append(self._apply_delta(m) if how == "delta" else self._adopt(m))
            return updates
        except CnrError as e:
            self._bad.add(trying)
            log.warning("follower of %s: checkpoint %d is not served (%s: %s); still serving %s", self._root,
                        trying, type(e).__name__, e, "nothing" if self.cursor is None else
                        f"checkpoint {self.cursor.ckpt}")
            raise

    def _chain(self, ckpt: int) -> list[Manifest]:
        return walk_chain(load_manifest(self._storage, ckpt), lambda i: load_manifest(self._storage, i))

    def _route(self, chain: list[Manifest]) -> tuple[list[Manifest], list[tuple[str, Manifest]]] | None:
        """How the served copy reaches ``chain``'s tip from the cursor without a reload: the chain up to the
        cursor's checkpoint (what the cursor's digest covers), then the steps after it, in commit order: each
        delta, and a background merge of the chain served (a compaction that keeps every row's stored bytes:
        it restores as the checkpoint it ``equals``, bit for bit), adopted once the copy is at that checkpoint.
        None where only a reload reaches the tip, a residual chain's fold included (its sums are stored at 8
        bits)."""
        if self.cursor is None:
            return None
        at, ids = self.cursor.ckpt, [m.id for m in chain]
        if at in ids:
            k = ids.index(at)
            return chain[: k + 1], [("delta", m) for m in chain[k + 1 :]]
        base = chain[0]
        if base.equals is None or base.compacted_from is None or " by cnr compact" in base.reason:
            return None  # no compaction, or cnr compact's, which may re-encode: the restore is the reference
        try:
            folded = self._chain(base.equals)
        except CheckpointError:  # collected with the chain it folds, or failing: the new chain is reloaded
            return None
        below = [m.id for m in folded]
        if at not in below or dict(base.codec) != dict(folded[-1].codec):
            return None  # not on the folded chain, or a fold of residuals (8-bit sums, not the tip's rows)
        k = below.index(at)
        return folded[: k + 1], [*(("delta", m) for m in folded[k + 1 :]), ("adopt", base),
                                 *(("delta", m) for m in chain[1:])]

    def _adopt(self, base: Manifest) -> Update:
        """Serves compacted baseline ``base``, which restores as the checkpoint served: nothing to write."""
        t0 = time.perf_counter()
        _check_fits(base, {t: (w.shape[0], w.shape[1]) for t, w in self._served.items()})
        assert base.compacted_from is not None and base.equals is not None  # as _route chose it
        span = f"{base.compacted_from[0]}..{base.compacted_from[-1]}"
        return self._done(base, [base.id], chain_digest([base]), "adopt",
                          f"a compaction of checkpoints {span}, equal to checkpoint {base.equals}, served", 0, t0)

    def _why_reload(self, chain: list[Manifest]) -> str:
        tip, base = chain[-1], chain[0]
        if self.cursor is None:
            return "the first load"
        at = self.cursor.ckpt
        if base.compacted_from is not None:
            span = f"{base.compacted_from[0]}..{base.compacted_from[-1]}"
            if at in range(base.compacted_from[0], base.compacted_from[-1] + 1):
                return f"a compaction of checkpoints {span} ({base.reason})"
            return (f"checkpoint {at}, which it served, went on beside the compaction of checkpoints {span} into "
                    f"{base.id}, which the job now goes on from")
        if at not in committed_ids(self._storage):
            return f"checkpoint {at}, which it served, is gone (collected by retention)"
        return f"a new baseline, {base.id}, under checkpoint {tip.id}"

    def _reload(self, chain: list[Manifest], why: str) -> Update:
        t0 = time.perf_counter()
        tip = chain[-1]
        live = self._bind(tip)
        tables = assemble_tables(self._storage, chain, tables=sorted(live))
        remapping = {t: mc for t in live if (mc := tables[t].mc) is not None}
        _check_remapped(tip, live, {t: tables[t].mc_fields for t in remapping}, whole=True)
        dense = read_dense(RowReader(self._storage, tip.ranks[0].payload), tip.ranks[0], self._dense.names)
        self._dense.check(dense, f"checkpoint {tip.id}")
        served = {t: tables[t].weights for t in live}
        for t, w in served.items():
            live[t].write(torch.arange(w.shape[0]), w)
        for t, state in remapping.items():
            cast(McSink, live[t]).write_remapping(state)
        self._dense.write(dense)
        self._served, self._live, self._remapping = served, live, remapping
        return self._done(tip, [m.id for m in chain], chain_digest(chain), "reload", why,
                          sum(w.shape[0] for w in served.values()), t0)

    def _apply_delta(self, m: Manifest) -> Update:
        t0 = time.perf_counter()
        _check_fits(m, {t: (w.shape[0], w.shape[1]) for t, w in self._served.items()})
        stats: dict[str, float] = {}
        staged = stage_checkpoint(self._storage, m, self._served, self._dense.names, stats)  # nothing written yet
        changes = staged.changes
        _check_remapped(m, self._live, {c.table: c.mc_fields for c in changes if c.mc is not None}, whole=False)
        self._dense.check(staged.dense, f"checkpoint {m.id}")
        _write(changes, self._served, self._remapping, self._live)
        self._dense.write(staged.dense)
        assert self.cursor is not None  # a delta follows what is served
        chain = (*self.cursor.chain, m.id)
        return self._done(m, list(chain), chain_digest([m], self.cursor.digest), "delta", f"on checkpoint {m.parent}",
                          sum(c.rows.numel() for c in changes), t0,
                          int(stats.get("bytes_read", 0) + stats.get("part_bytes", 0)))

    def _rebind(self, at: Manifest) -> str | None:
        """Writes the rows given to :meth:`resume` to the target, if they are its served tables in ``at``'s
        shapes (the cursor's checkpoint); otherwise binds the target, writes nothing, and says why not."""
        live = self._bind(at)
        self._live = live
        if sorted(live) != sorted(self._served) or any(tuple(w.shape) != tuple(at.tables[t])
                                                       for t, w in self._served.items()):
            return f"the rows given to resume are not the served tables' {sorted(live)}"
        if any(isinstance(sink, McSink) for sink in live.values()):
            return "the rows given to resume hold no remapping of the managed-collision tables"
        for t, w in self._served.items():
            live[t].write(torch.arange(w.shape[0]), w)
        if self._lease is not None:
            write_lease(self._storage, self._lease, at.id)
        log.info("follower of %s: resumed at checkpoint %d (step %d)", self._root, at.id, at.step)
        return None

    def _bind(self, tip: Manifest) -> dict[str, Sink]:
        """The target's served tables, checked against ``tip``'s shapes."""
        target = self._target
        found = target.sinks(tip) if isinstance(target, Tables) else sinks_of(target, tip.table_fqns)
        wanted = self._only if self._only is not None else sorted(t for t in found if t in tip.tables)
        missing = sorted(set(wanted) - set(found))
        if missing:
            raise ConfigError(f"the target holds no table {missing} (it holds {sorted(found)})")
        live = {t: found[t] for t in wanted}
        _check_fits(tip, {t: sink.shape for t, sink in live.items()})
        self._dense = dense_of(target, tip.table_fqns)
        return live

    def _done(self, m: Manifest, chain: list[int], digest: str, how: str, why: str, rows: int, t0: float,
              nbytes: int = 0) -> Update:
        self.cursor = Cursor(self._root, m.id, m.step, tuple(chain), digest)
        if self._cursor_path is not None:
            _write_cursor(self._cursor_path, self.cursor)
        if self._lease is not None:
            write_lease(self._storage, self._lease, m.id)
        update = Update(m.id, m.step, how, why, rows, (time.perf_counter() - t0) * 1e3,
                        max(0.0, time.time() - m.created_unix), nbytes)
        log.info("follower of %s: serving checkpoint %d (step %d): %s %s, %d rows in %.1f ms, %.2f s after its "
                 "commit", self._root, m.id, m.step, how, why, rows, update.apply_ms, update.lag_s)
        return update


def _check_remapped(m: Manifest, live: Mapping[str, Sink], fields: Mapping[str, tuple[str, ...]], *,
                    whole: bool) -> None:
    """Refuses managed-collision state (``fields``: its fields by table) for a table the target does not remap,
    state of other fields, and, where ``whole`` (a chain read whole), a remapped table without it."""
    for t, sink in sorted(live.items()):
        if isinstance(sink, McSink) and t in fields and fields[t] != sink.mc.fields:
            raise IncompatibleCheckpointError(
                f"checkpoint {m.id} holds table '{t}''s remapping with fields {list(fields[t])}, the target's module "
                f"{list(sink.mc.fields)}; serve it with the eviction policy it was trained with")
        if (t in fields) != isinstance(sink, McSink) and (t in fields or whole):
            raise ConfigError(
                f"table '{t}' is a managed-collision table in checkpoint {m.id} and not in the target, or the other "
                "way round: serve it with the module it was trained with (a ManagedCollisionEmbedding(Bag)Collection "
                "with an MCHManagedCollisionModule), or leave it out with tables=[...]")


def _check_fits(m: Manifest, shapes: Mapping[str, tuple[int, int]]) -> None:
    for t, have in shapes.items():
        shape = m.tables.get(t)
        if shape is None or tuple(have) != tuple(shape):
            raise IncompatibleCheckpointError(
                f"checkpoint {m.id} holds table '{t}' as {None if shape is None else list(shape)}, the target as "
                f"{list(have)}: the root is another model's. Follow the root of the model you serve")


def _write(changes: list[Change], served: dict[str, torch.Tensor], remapping: dict[str, torch.Tensor],
           live: Mapping[str, Sink]) -> None:
    """Writes staged changes to the float rows (and remapping states), in the order they were staged, then
    each touched row whole to the target (a quantized row is quantized over all its columns), and each
    touched remapping."""
    touched: dict[str, list[torch.Tensor]] = {}
    for c in changes:
        c0, c1 = c.cols
        served[c.table][c.rows, c0:c1] = c.values
        touched.setdefault(c.table, []).append(c.rows)
        if c.mc is not None:
            remapping[c.table][c.rows] = c.mc
    for t, rows in touched.items():
        ids = torch.unique(torch.cat(rows))
        live[t].write(ids, served[t].index_select(0, ids))
        if t in remapping:
            cast(McSink, live[t]).write_remapping(remapping[t])


def _write_cursor(path: str, cursor: Cursor) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({**asdict(cursor), "chain": list(cursor.chain)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def cursor_of(doc: Mapping[str, Any]) -> Cursor:
    """The cursor a JSON object holds (as :func:`_write_cursor` writes it). Raises KeyError, TypeError or
    ValueError for one that is not."""
    return Cursor(str(doc["root"]), int(doc["ckpt"]), int(doc["step"]), tuple(int(i) for i in doc["chain"]),
                  str(doc["digest"]))


def _read_cursor(path: str) -> Cursor:
    try:
        with open(path) as f:
            doc = json.load(f)
        return cursor_of(doc)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a follower's cursor ({type(e).__name__}: {e}); remove it to start "
                          "afresh") from None
