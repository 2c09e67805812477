"""``cnr import-dcp``: a DMP's DCP checkpoint written as a baseline, a table at a time."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest
from cnr_torchrec.ckpt.format.manifest import Manifest
from cnr_torchrec.ckpt.format.tables import Progress
from cnr_torchrec.ckpt.live.dense_optim import TORCH_OPTIM, SavedDenseOptimizer
from cnr_torchrec.ckpt.live.dense_optim_named import from_fqn
from cnr_torchrec.ckpt.save.baseline import write_baseline
from cnr_torchrec.ckpt.save.staging import StagedShard
from cnr_torchrec.ckpt.tools.dcp.dmp_keys import DENSE_OPTIM, LEGACY_MODEL, OPTIM, STEP_PATHS, _column_shards
from cnr_torchrec.ckpt.tools.dcp.load import _empty, _metadata, _path, _read, _read_tree
from cnr_torchrec.ckpt.tools.dcp.mc import MC_KEY, by_row, fields_of, fresh_window
from cnr_torchrec.errors import ConfigError, IncompatibleCheckpointError

__all__ = ["import_dcp"]

_TABLE_FQN = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.([^.]+)\.weight$")


class _DcpTable(NamedTuple):
    name: str
    fqn: str
    shape: tuple[int, int]
    state: str | None  # flat key of its fused optimizer state
    mc: dict[str, str] | None = None  # a managed-collision table's buffers: flat key by buffer name


def _fp32(md: Metadata, key: str, where: str) -> TensorStorageMetadata:
    """The metadata of tensor ``key``; IncompatibleCheckpointError unless it is float32."""
    m = md.state_dict_metadata[key]
    if not isinstance(m, TensorStorageMetadata) or m.properties.dtype != torch.float32:
        raise IncompatibleCheckpointError(f"{where}: {key} is {getattr(m, 'properties', m)}; tables and their "
                                          "optimizer state are imported from float32 only (cast them before dcp.save)")
    return m


def _model_keys(md: Metadata) -> dict[str, str]:
    """The model's entries, flat key by model key: those under ``model`` where the checkpoint nests them there
    (the older layout; every other top-level entry is then ignored), else every top-level entry but a ``step``."""
    paths = {k: _path(md, k) for k in md.state_dict_metadata}
    nested = {str(p[1]): k for k, p in paths.items() if len(p) == 2 and p[0] == LEGACY_MODEL}
    return nested or {str(p[0]): k for k, p in paths.items() if len(p) == 1 and p not in STEP_PATHS}


def _dcp_tables(md: Metadata, model: dict[str, str], where: str) -> dict[str, _DcpTable]:
    """The tables: the model's weights with fused state under ``optim``, and those named like TorchRec's
    (``...embedding_bags.<table>.weight``, ``...embeddings.<table>.weight``). Checks dtypes and shapes."""
    fused: dict[str, dict[str, str]] = {}
    for key in md.state_dict_metadata:
        if len(p := _path(md, key)) == 4 and p[:2] == (OPTIM, "state"):
            fused.setdefault(str(p[2]), {})[str(p[3])] = key
    out: dict[str, _DcpTable] = {}
    for fqn, key in sorted(model.items()):
        states, m = fused.pop(fqn, {}), _TABLE_FQN.search(fqn)
        if not states and m is None:
            continue  # a dense parameter or buffer
        name = m.group(1) if m else next(iter(states)).rsplit(".", 1)[0]
        if set(states) - {f"{name}.momentum1"} or name in out:
            raise IncompatibleCheckpointError(
                f"{where}: '{OPTIM}' holds {sorted(states)} for {fqn}; a table has one state, '<table>.momentum1' (the "
                f"row-wise or element-wise Adagrad sum), and a unique name. Save a dense optimizer as '{DENSE_OPTIM}'")
        weight = _fp32(md, key, where)
        if len(weight.size) != 2:
            raise IncompatibleCheckpointError(f"{where}: {key} is {list(weight.size)}, not [rows, dim]")
        rows, dim = (int(v) for v in weight.size)
        state = next(iter(states.values()), None)
        size = None if state is None else list(_fp32(md, state, where).size)
        if size is not None and size != [rows, dim] and not (len(size) == 1 and rows and size[0] % rows == 0):
            raise IncompatibleCheckpointError(f"{where}: {state} is {size}; for a table of {rows} x {dim} it must be "
                                              f"[{rows}, {dim}] or [k * {rows}] (k column shards)")
        out[name] = _DcpTable(name, fqn, (rows, dim), state)
    if fused:
        raise IncompatibleCheckpointError(f"{where}: it holds fused optimizer state of {sorted(fused)} but not their "
                                          "weights among the model's keys: it lacks those tables")
    if not out:
        raise IncompatibleCheckpointError(f"{where}: no embedding table among the model's keys; dcp.save({{**dmp."
                                          f"state_dict(), '{OPTIM}': dmp.fused_optimizer.state_dict()}})")
    for table, buffers in _mc_keys(model).items():
        if table not in out:
            raise IncompatibleCheckpointError(f"{where}: it holds managed-collision buffers of table '{table}' but "
                                              "not its weight")
        out[table] = out[table]._replace(mc=buffers)
    return out


def _mc_keys(model: dict[str, str]) -> dict[str, dict[str, str]]:
    """The model's managed-collision buffers, by table: flat key by buffer name."""
    out: dict[str, dict[str, str]] = {}
    for name, key in model.items():
        if m := MC_KEY.match(name):
            out.setdefault(m["table"], {})[m["buffer"]] = key
    return out


def _table_shards(path: str, md: Metadata, model: dict[str, str], tables: dict[str, _DcpTable],
                  progress: Progress | None) -> Iterator[StagedShard]:
    """Each table as entries of whole rows, read one table at a time: one entry, or one per column shard when
    its row-wise state was saved per column shard (each keeps its own value)."""
    for t in sorted(tables.values(), key=lambda t: t.name):
        (rows, dim), wkey = t.shape, model[t.fqn]
        got = _read(path, {wkey: torch.empty(rows, dim),
                           **({} if t.state is None else {t.state: _empty(md.state_dict_metadata[t.state])})})
        weights, state = got[wkey], None if t.state is None else got.get(t.state)
        mc = _mc_state(path, md, t)
        if state is None or state.dim() == 2:
            states = [] if state is None else [(state, False)]
            yield StagedShard(t.name, (0, rows), (0, dim), "full", None, weights, states, *mc)
        else:
            saved = md.state_dict_metadata[wkey]
            assert isinstance(saved, TensorStorageMetadata)  # the table's weights: a tensor DCP stored in chunks
            chunks = [(c.offsets, c.sizes) for c in saved.chunks]
            for i, (c0, c1) in enumerate(_column_shards(chunks, rows, dim, state.numel() // rows, wkey)):
                yield StagedShard(t.name, (0, rows), (c0, c1), "full", None, weights[:, c0:c1].contiguous(),
                                  [(state[i * rows: (i + 1) * rows], True)], *mc)
        if progress is not None:
            progress(1)


def _mc_state(path: str, md: Metadata, t: _DcpTable) -> tuple[torch.Tensor | None, tuple[str, ...]]:
    """A managed-collision table's by-row state and its fields (None and () for other tables)."""
    if t.mc is None:
        return None, ()
    sorted_buffers = {b: k for b, k in t.mc.items() if b.startswith("_mch_")}
    got = _read(path, {k: _empty(md.state_dict_metadata[k]) for k in sorted_buffers.values()})
    buffers = {b: got[k] for b, k in sorted_buffers.items()}
    return by_row(buffers, t.shape[0], f"{path}: table '{t.name}'"), fields_of(buffers)


def _mc_windows(path: str, md: Metadata, tables: dict[str, _DcpTable]) -> dict[str, dict[str, Any]]:
    """Each managed-collision table's eviction window, as a state_dict leaves it: empty, at its saved iteration."""
    out = {}
    for t in tables.values():
        if t.mc is None:
            continue
        key = t.mc.get("_current_iter_tensor")
        if key is None:
            raise IncompatibleCheckpointError(f"{path}: table '{t.name}' has managed-collision buffers but no "
                                              "_current_iter_tensor")
        iteration = _read(path, {key: _empty(md.state_dict_metadata[key])})[key]
        out[t.name] = fresh_window(fields_of(t.mc), int(iteration.reshape(-1)[0]))
    return out


def _dense(path: str, md: Metadata, model: dict[str, str], tables: dict[str, _DcpTable]) -> dict[str, torch.Tensor]:
    """The dense parameters and buffers: every model entry that is not a table (or its managed-collision
    buffers)."""
    fqns, mc = {t.fqn for t in tables.values()}, {k for t in tables.values() for k in (t.mc or {}).values()}
    keys = {k: name for name, k in model.items() if name not in fqns and k not in mc}
    for k in keys:  # (a dtype our payloads do not store fails when it is written)
        if not isinstance(md.state_dict_metadata[k], TensorStorageMetadata):
            raise IncompatibleCheckpointError(f"{path}: {k} is not a tensor; the model's entries must all be "
                                              "tensors (save other state under a key of its own, as a dict)")
    return {keys[k]: v for k, v in _read(path, {k: _empty(md.state_dict_metadata[k]) for k in keys}).items()}


def _step(path: str, md: Metadata) -> int | None:
    """The training step the checkpoint records (the first of ``STEP_PATHS`` it holds), or None.

    Raises:
        IncompatibleCheckpointError: it is not a non-negative integer (or a one-element integer tensor).
    """
    keys = {_path(md, k): k for k in md.state_dict_metadata}
    key = next((keys[p] for p in STEP_PATHS if p in keys), None)
    if key is None:
        return None
    value = _read(path, {key: _empty(md.state_dict_metadata[key])})[key]
    if torch.is_tensor(value) and value.numel() == 1 and not value.is_floating_point() and not value.is_complex():
        value = int(value.reshape(-1)[0])
    if type(value) is not int or value < 0:
        raise IncompatibleCheckpointError(f"{path}: '{key}' is {value!r}, not a training step (an int >= 0); "
                                          "save the step as an int, or leave it out and pass --step")
    return value


def _dense_optimizer(tree: Any, where: str) -> dict[str, Any]:
    """``dense_optim`` as a baseline stores it: the by-name torch.optim form with no class recorded (DCP keeps
    none), which restores into a torch.optim optimizer or a TorchRec keyed one."""
    return SavedDenseOptimizer(TORCH_OPTIM, None, from_fqn(tree, where)).to_tree()


def import_dcp(path: str, storage: Storage, *, append: bool = False, step: int | None = None,
               progress: Progress | None = None) -> Manifest:
    """Writes the DCP checkpoint in directory ``path`` as a baseline of ``storage`` with the next free id:
    full-precision entries, one table read at a time. A failure before the commit (the sealed manifest) removes
    what was written.

    It reads the layout of docs/dcp.md, ``dcp.save({**dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict(),
    "dense_optim": ...})``, and the older one that nests the model under ``"model"`` (what earlier versions
    exported): when ``model`` holds entries, those are the model's and other top-level entries are ignored.

    Args:
        append: import into a root that holds checkpoints, as a new baseline with the newest one's tables.
        step: the training step the baseline records. None (the default): the step the checkpoint records
            (a top-level ``step``, else ``train_state.step``, what an export and torchtitan write, else
            ``trainer.step``), or 0 when it records none.

    Returns:
        The new checkpoint's manifest.

    Raises:
        CheckpointNotFoundError: ``path`` holds no DCP checkpoint.
        ConfigError: the root holds checkpoints and ``append`` is False.
        IncompatibleCheckpointError: a table (or its weight) is missing, a shape differs (from the root's, or
            between a table and its state), a table or its state is not float32, the saved step is not an
            int >= 0, or the layout is another.
        UnsafeCheckpointError, CorruptCheckpointError: its metadata pickles what DCP never writes, or does not load.
    """
    md = _metadata(path)
    model = _model_keys(md)
    tables = _dcp_tables(md, model, path)
    saved_step = _step(path, md)
    committed = committed_ids(storage)
    if committed and not append:
        raise ConfigError(f"{storage.root} already holds checkpoints (newest: {committed[-1]}); import into an empty "
                          "root, or pass --append (append=True) to add the import as a new baseline")
    if committed:  # the newest checkpoint's tables, shapes included
        have = {t: list(shape) for t, shape in load_manifest(storage, committed[-1]).tables.items()}
        got = {t.name: list(t.shape) for t in tables.values()}
        problems = [f"table '{t}' is {got.get(t, 'missing')} there and {have.get(t, 'missing')} in checkpoint "
                    f"{committed[-1]}" for t in sorted(set(have) | set(got)) if have.get(t) != got.get(t)]
        if problems:
            raise IncompatibleCheckpointError(f"{path} is not of the model of {storage.root}: {'; '.join(problems)}. "
                                              "Import it into a new root")
    tree = _read_tree(path, md, DENSE_OPTIM)
    return write_baseline(
        storage, step=step if step is not None else (saved_step or 0),
        shards=_table_shards(path, md, model, tables, progress),
        table_shapes={t.name: list(t.shape) for t in tables.values()},
        table_fqns={t.name: t.fqn for t in tables.values()}, dense=_dense(path, md, model, tables),
        dense_optimizer=None if tree is None else _dense_optimizer(tree, f"{path}: '{DENSE_OPTIM}'"),
        reason=f"imported from DCP checkpoint {path}", mc_runtime=_mc_windows(path, md, tables),
    )

