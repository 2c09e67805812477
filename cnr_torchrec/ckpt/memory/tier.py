"""The memory tier: this rank's restore image, kept as saves and restores commit, taken by a restore that agrees.

The image (:mod:`.image`) holds what the newest committed checkpoint restores on this rank: its
shards' float32 rows, their optimizer states and managed-collision by-row state. The rows are the
residual reconstruction's (:class:`~cnr_torchrec.ckpt.save.residual.Reconstruction`, for which
this object is the :class:`~cnr_torchrec.ckpt.save.residual.RowBacking`): with residual coding the
reconstruction lives in the image, and there is no second copy. With plain coding (``mode: on``)
the reconstruction exists for the image alone.

Every change to the image happens inside :meth:`MemoryTier.update` (the seal removed first; the
checksum taken and the seal written once the change is whole): after a save commits, and after a
restore. A restore asks :meth:`MemoryTier.candidate` whether the image is sealed for exactly the
checkpoint every rank agreed on, on this layout and world size; if so the rank copies its shards
from it (:mod:`~cnr_torchrec.ckpt.restore.from_memory`), else the image is unsealed there (the
restore may stage into its rows) and the rank reads storage.

Images are files ``r<rank>.img`` (and ``.seal``) in the root's own directory under
``memory_tier.path`` (:mod:`.directory`), so that the jobs of a host never take each other's.
Opening a root removes this root's images of ranks beyond the world size, and other roots' only
where their root is gone or they are older than ``memory_tier.max_age_s``; a clean ``close()``
removes this rank's (and the directory, once the host's last rank closed).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from cnr_torchrec.ckpt.config import CheckpointConfig
from cnr_torchrec.ckpt.format.blocks import ShardKey, shard_key
from cnr_torchrec.ckpt.format.bytes.roots import root_digest
from cnr_torchrec.ckpt.format.manifest import Manifest, Payload
from cnr_torchrec.ckpt.host_memory import host_uses, shard_states, short_of_memory
from cnr_torchrec.ckpt.memory import directory
from cnr_torchrec.ckpt.memory.directory import image_stem
from cnr_torchrec.ckpt.memory.image import ImageFile, ImageRefused, Layout, ShardLayout, ShardViews
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["Candidate", "MemoryTier", "image_stem", "image_tables", "payload_identity", "root_digest"]

log = logging.getLogger(__name__)

def payload_identity(payload: Payload | Mapping[str, Any]) -> str:
    """A rank's payload of a checkpoint, by its chunks' digests (a manifest's :class:`Payload`, or a report's dict)."""
    chunks = payload.chunks if isinstance(payload, Payload) else payload["chunks"]
    return ":".join(str(c.get("xxh3", c.get("blake2b"))) if isinstance(c, Mapping) else c.digest for c in chunks)


def image_tables(tracker: DirtyRowTracker) -> list[str]:
    """The tables an image holds: the sharded ones (a data_parallel table comes from storage, stored whole by every
    save, as in any restore)."""
    return [t for t in tracker.tables() if not tracker.is_data_parallel(t)]


def _image_shards(tracker: DirtyRowTracker) -> Iterator[tuple[str, Any, list[torch.Tensor], Any]]:
    """(table, shard, its fused optimizer's state tensors, its managed-collision module or None) for every shard
    an image holds (:func:`image_tables`), each TBE asked once (:func:`~cnr_torchrec.ckpt.host_memory.shard_states`)."""
    held = set(image_tables(tracker))
    for table, shard, states in shard_states(tracker):
        if table in held:
            yield table, shard, states, tracker.mc_table(table)


def _shard_layouts(tracker: DirtyRowTracker) -> list[ShardLayout]:
    """What an image of this rank's shards holds, shard by shard."""
    out = []
    for table, shard, states, mc in _image_shards(tracker):
        n = shard.num_rows
        widths = tuple((str(s.dtype).removeprefix("torch."), s.numel() // max(n, 1)) for s in states)
        out.append(ShardLayout(shard_key(table, shard.rows, shard.cols), shard.cols[1] - shard.cols[0], n,
                               widths, len(mc.fields) if mc is not None else 0))
    return out


class ImageUpdate:
    """What the body of a :meth:`MemoryTier.update` asks the seal to say (nothing: the image stays unsealed)."""

    def __init__(self) -> None:
        self.sealed: tuple[int, tuple[int, ...], str] | None = None
        self.live_states = False

    def seal(self, tip: int, chain: Sequence[int], payload: str, *, live_states: bool = False) -> None:
        """Seal the image for checkpoint ``tip`` (chain ``chain``), whose payload on this rank is ``payload``
        (:func:`payload_identity`); ``live_states``: copy the model's optimizer and by-row states in first (after
        a restore, which wrote them into the model)."""
        self.sealed, self.live_states = (tip, tuple(chain), payload), live_states


class Candidate:
    """An image sealed for the agreed checkpoint, and the check of its bytes against the seal's checksum, made
    once: before the rows are taken (:meth:`check`), or as they are copied out (:meth:`copy_checked`). A check
    that fails unseals the image.

    Attributes:
        views: the image's regions by shard.
        checked: whether its bytes matched the checksum already.
        why: why the check failed ("" while it has not).
    """

    def __init__(self, views: dict[ShardKey, ShardViews], file: ImageFile, checksum: str) -> None:
        self.views, self._file, self._checksum = views, file, checksum
        self.checked = False
        self.why = ""

    def check(self) -> bool:
        """Checksums the image (a pass over its bytes). False: they do not match (the image is unsealed)."""
        return self._outcome(self._file.checksum())

    def copy_checked(self, into: Mapping[ShardKey, Sequence[torch.Tensor | None]]) -> bool:
        """Copies regions into tensors as the image is checksummed (:meth:`ImageFile.copy_checked`). False: the
        bytes do not match (the image is unsealed), and the tensors hold what they were copied, which the caller
        must not keep."""
        return self._outcome(self._file.copy_checked(into))

    def _outcome(self, digest: str) -> bool:
        self.checked = digest == self._checksum
        if not self.checked:
            self.why = f"{self._file.data_path} does not match its seal's checksum"
            self._file.unseal()
        return self.checked


class MemoryTier:
    """This rank's image, for one Checkpointer.

    Args:
        config: the job's config (``memory_tier``, ``root``, what shapes rows).
        tracker: the shards.
        rank, world_size: this rank, of how many.
        residual: whether the job codes residuals (``auto`` keeps an image only then).
        distributed: whether the ranks are a process group (the host-memory check of ``on`` is collective).

    Attributes:
        active: whether this rank keeps an image.
        why_off: why it keeps none (empty when active).
    """

    def __init__(self, config: CheckpointConfig, tracker: DirtyRowTracker, *, rank: int, world_size: int,
                 residual: bool, distributed: bool = False) -> None:
        tier = config.memory_tier
        self.rank, self.world_size, self._tracker = rank, world_size, tracker
        self._path, self._max_age_s, self._root_name = tier.path, tier.max_age_s, config.root
        self._root = root_digest(config.root)
        self._dir: str | None = None  # the root's image directory, once checked to be the user's own
        self._file = ImageFile(image_stem(tier.path, config.root, rank))
        self._layout = Layout(tuple(_shard_layouts(tracker)))
        q = config.quantization
        self._config = hashlib.blake2b(json.dumps([q.method, q.state_dtype, bool(q.residual)]).encode(),
                                       digest_size=8).hexdigest()
        self._refused = ""  # why the image a previous process left was refused, until a new one is sealed
        self.active = tier.mode == "on" or (tier.mode == "auto" and residual)
        self.why_off = "" if self.active else (
            "memory_tier: off" if tier.mode == "off" else
            "memory_tier: auto keeps an image only with residual coding (memory_tier: on keeps one with plain)")
        if tier.mode == "on" and not residual:  # config-uniform, so every rank reaches this collective
            self._check_host_memory(distributed)
        if self.active:
            self._open_root()

    def _check_host_memory(self, distributed: bool) -> None:
        """With plain coding the image is an extra copy of the rank's shards in host memory: where a host's ranks
        would keep more than it has available, the tier is off on every rank, with a warning. Collective."""
        _, hosts = host_uses(self._layout.nbytes, distributed=distributed)
        short = short_of_memory(hosts)
        if short is not None:
            assert short.available is not None  # a host whose memory is unknown is never short
            self._off(f"host {short.host}'s {short.ranks} rank(s) would keep {short.needed / 1e9:.2f} GB of images "
                      f"beside the job, and it has {short.available / 1e9:.2f} GB available", warn=True)

    # ------------------------------------------------------------------ opening a root

    def _open_root(self) -> None:
        """Tidies the path (:func:`~.directory.tidy`), makes this root's directory, and checks that it has room
        for this rank's image; where it has not, or the directory is refused, the tier is off, with one
        warning."""
        if not os.path.isdir(self._path):
            self._off(f"memory_tier.path {self._path} is not a directory", warn=True)
            return
        try:
            removed = directory.tidy(self._path, self._root_name, self._max_age_s)
        except (ConfigError, OSError) as e:  # a path it cannot list: nothing removed, this rank's image still kept
            log.warning("rank %d: could not tidy the memory images under %s (%s: %s)", self.rank, self._path,
                        type(e).__name__, e)
            removed = []
        for entry, why in removed:
            log.info("rank %d: removed the memory images %s (%d file(s), %.2f GB): %s", self.rank, entry.path,
                     len(entry.files), entry.nbytes / 1e9, why)
        try:
            self._dir = directory.open_root_dir(self._path, self._root_name, self.world_size)
        except (ImageRefused, OSError) as e:
            self._off(f"the image directory could not be used ({type(e).__name__}: {e})", warn=True)
            return
        own = 0
        with contextlib.suppress(OSError):
            own = os.lstat(self._file.data_path).st_size
        st = os.statvfs(self._path)
        free = st.f_bavail * st.f_frsize + own
        if free < self._layout.nbytes:
            self._off(f"{self._path} has {free / 1e9:.2f} GB free and this rank's image needs "
                      f"{self._layout.nbytes / 1e9:.2f} GB", warn=True)
            return
        try:  # the pages now (a sealed image of this root is kept as it is): a full directory fails here, not later
            self._ensure_open()
        except (ImageRefused, OSError) as e:
            self._off(f"{self._file.data_path} could not be made ({type(e).__name__}: {e})", warn=True)

    def _off(self, why: str, warn: bool) -> None:
        self.active, self.why_off = False, why
        if warn:
            log.warning("rank %d: the memory tier is off, so a restart reads every shard from storage: %s. Give "
                        "the directory room for the image (%.2f GB on this rank; Docker: --shm-size, Kubernetes: an "
                        "emptyDir volume with medium: Memory), or set memory_tier.path to one that has it",
                        self.rank, why, self._layout.nbytes / 1e9)
        self._remove_files()

    def _remove_files(self) -> None:
        """Removes this rank's files, and the directory once no rank's are left, where the directory was checked
        to be the user's own (never through a directory someone else made)."""
        if self._dir is None:
            self._file.close()
            return
        with contextlib.suppress(OSError):
            self._file.remove()
        directory.release_root_dir(self._dir)

    # ------------------------------------------------------------------ the reconstruction's backing

    def _ensure_open(self) -> None:
        """Maps this rank's image: the one a previous process left (sealed or not, as it is), or a new one in
        place of a refused one (whose reason a restore then gives)."""
        if self._file.is_open:
            return
        try:
            self._file.open(self._layout, create=False)
        except FileNotFoundError:
            self._file.open(self._layout, create=True)
        except ImageRefused as e:
            self._refused = str(e)
            log.warning("rank %d: memory image refused, and made anew: %s", self.rank, e)
            self._file.open(self._layout, create=True)

    def hold(self, key: ShardKey, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` copied into the image's weights of shard ``key`` (nothing copied when they are those). A shard
        the image does not hold (a data_parallel table's, which a fold also gives) is kept as it is."""
        self._ensure_open()
        if not self._file.holds(key):
            return rows
        view = self._file.views(key).weights
        if rows.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.copy_(rows)
        return view

    def put_states(self, key: ShardKey, ids: torch.Tensor | None, states: list[torch.Tensor],
                   mc: torch.Tensor | None) -> None:
        """Rows ``ids`` (every row if None) of shard ``key``'s states and by-row state in the image."""
        self._ensure_open()
        if not self._file.holds(key):
            return
        views = self._file.views(key)
        with torch.no_grad():
            for view, saved in zip(views.states, states):
                vals = saved.to(view.dtype).reshape(-1, view.shape[1])
                view.copy_(vals) if ids is None else view.index_copy_(0, ids, vals)
            if mc is not None and views.mc is not None:
                views.mc.copy_(mc) if ids is None else views.mc.index_copy_(0, ids, mc.to(torch.int64))

    def weight_views(self) -> dict[ShardKey, torch.Tensor]:
        """Every shard's float32 rows in the image (none when the tier is off): what a restore may stage into,
        once it has unsealed the image (a restore that takes the image leaves them as they are)."""
        if not self.active:
            return {}
        self._ensure_open()
        return {s.key: self._file.views(s.key).weights for s in self._layout.shards}

    # ------------------------------------------------------------------ updates

    @contextlib.contextmanager
    def update(self) -> Iterator[ImageUpdate]:
        """Unseal, update, seal, as one step: the image is unsealed before the body writes its rows, and once the
        body returns it is sealed for what the body named (:meth:`ImageUpdate.seal`), after the live optimizer
        states are copied in where it asked. A body that raises, or names nothing, leaves the image unsealed,
        never torn: a restart then reads storage."""
        self._file.unseal()
        update = ImageUpdate()
        yield update
        if update.sealed is None:
            return
        if update.live_states:
            self._take_live_states()
        self._seal(*update.sealed)

    def _seal(self, tip: int, chain: Sequence[int], payload: str) -> None:
        self._refused = ""
        try:
            self._file.seal({"root": self._root, "rank": self.rank, "world_size": self.world_size, "ckpt_id": tip,
                             "chain": tuple(chain), "payload": payload, "config": self._config})
        except OSError as e:  # the image stays unsealed: a restart reads storage, and the job goes on
            log.warning("rank %d: could not seal the memory image for checkpoint %d (%s: %s); a restart before the "
                        "next save reads storage", self.rank, tip, type(e).__name__, e)

    def _take_live_states(self) -> None:
        """Copies every shard's live optimizer states and by-row state into the image (after a restore, which
        wrote them into the model)."""
        self._ensure_open()
        with torch.no_grad():
            for table, shard, states, mc in _image_shards(self._tracker):
                views = self._file.views(shard_key(table, shard.rows, shard.cols))
                for view, state in zip(views.states, states):
                    view.copy_(state.detach().reshape(view.shape))
                if mc is not None and views.mc is not None:
                    views.mc.copy_(mc.by_row())

    # ------------------------------------------------------------------ restore

    def candidate(self, chain: Sequence[Manifest], *, check: bool = True) -> tuple[Candidate | None, str]:
        """This rank's image if it is sealed for exactly ``chain`` (the agreed checkpoint, baseline first) on this
        layout and world size, and (with ``check``) its bytes match the seal's checksum; else None. With why.

        Without ``check`` the bytes are checked as they are copied out (:meth:`Candidate.copy_checked`), or
        by :meth:`Candidate.check` before anything is taken from them.

        An image not taken is unsealed before this returns (or when its bytes fail the check): the restore that
        follows may write into its rows (:meth:`weight_views`, given as its staging buffers), and seals it once
        done (:meth:`update`)."""
        image, why = self._check_seal(chain, check)
        if image is None and self.active:
            self._file.unseal()
        return image, why

    def _check_seal(self, chain: Sequence[Manifest], check: bool) -> tuple[Candidate | None, str]:
        if not self.active:
            return None, self.why_off
        if self._refused:
            return None, self._refused
        tip = chain[-1]
        if tip.world_size != self.world_size:
            return None, f"checkpoint {tip.id} was written by {tip.world_size} ranks, not {self.world_size}"
        try:
            seal = self._file.read_seal()
            expected = {"root": self._root, "rank": self.rank, "world_size": self.world_size, "ckpt_id": tip.id,
                        "chain": tuple(m.id for m in chain), "layout": self._layout.digest(),
                        "config": self._config, "nbytes": self._layout.nbytes,
                        "payload": payload_identity(tip.ranks[self.rank].payload)}
            wrong = [k for k, v in expected.items() if getattr(seal, k) != v]
            if wrong:
                return None, (f"the image is sealed for checkpoint {seal.ckpt_id}, chain {list(seal.chain)}; its "
                              f"{', '.join(wrong)} differ from the agreed checkpoint's")
            self._ensure_open_existing()
            image = Candidate({s.key: self._file.views(s.key) for s in self._layout.shards}, self._file,
                              seal.checksum)
            if check and not image.check():
                return None, image.why
        except (ImageRefused, OSError) as e:
            return None, str(e)
        return image, "sealed for the agreed checkpoint"

    def _ensure_open_existing(self) -> None:
        if not self._file.is_open:
            self._file.open(self._layout, create=False)

    # ------------------------------------------------------------------ end

    def close(self, remove: bool) -> None:
        """Unmaps the image; with ``remove`` (a clean end of the job) deletes its files (and the root's directory,
        once the host's last rank removed its own)."""
        if remove:
            self._remove_files()
        else:
            self._file.close()
