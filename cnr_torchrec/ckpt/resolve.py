"""Which checkpoint a restore takes: the newest committed one whose chain is sound (rank 0 decides).

It reads manifests and file sizes only; the ranks then apply the chain and agree on the
outcome (:meth:`cnr_torchrec.ckpt.Checkpointer.restore`).
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any

from cnr_torchrec.ckpt.manifest import ckpt_dir, ckpt_id_of, committed_ids, load_manifest, manifest_path
from cnr_torchrec.ckpt.payload import _DTYPES
from cnr_torchrec.ckpt.storage import Storage, check_relative
from cnr_torchrec.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["resolve_chain"]

log = logging.getLogger("cnr_torchrec.ckpt.checkpointer")  # its messages belong to restore's log


def resolve_chain(
    storage: Storage, step: int | None, bad: dict[int, str], *, fail: bool, quiet: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """The newest committed checkpoint (of ``step``) whose chain is sound, as far as manifests tell.

    Sound: every manifest of the chain loads and matches its checksum, the members' own
    chains agree with it and start at a baseline, every rank file lies in its
    checkpoint's directory, exists and has the size the manifest gives, and every blob
    has a dtype we write. Checkpoints in ``bad`` (and chains through them) are skipped;
    unless ``fail`` (``on_corrupt: fail``), corrupt ones found here are added to it.
    ``quiet``: do not log the skips (a rank whose pick only confirms rank 0's).

    Rank 0 calls it through :meth:`~cnr_torchrec.ckpt._collective.Ranks.from_rank0`, which
    raises what it raises on every rank.

    Returns:
        ``({"chain": ids, "skipped": ...}, manifests)`` for the pick;
        ``({"chain": [], "skipped": ...}, None)`` when none is left.

    Raises:
        CorruptCheckpointError: under ``on_corrupt: fail``, a checkpoint it looks at is unsound
            (the catalog index.json included).
        UnsafeCheckpointError: a manifest names a file outside its checkpoint, or a dtype never written.
        Exception: whatever the storage raises while listing or reading (an S3 ``ClientError``,
            an ``OSError``); a storage error is no evidence of corruption, so nothing is skipped for it.
    """
    skipped: list[list[Any]] = []  # [id, why] found unsound in this call, for the other ranks' logs

    def skip(cid: int, why: str) -> None:
        bad[cid] = why
        skipped.append([cid, why])
        if not quiet:
            log.warning("restore: skipping checkpoint %d: %s (on_corrupt: fallback)", cid, why)

    loaded: dict[int, dict[str, Any]] = {}

    def manifest(i: int) -> dict[str, Any]:
        if i not in loaded:
            loaded[i] = load_manifest(storage, i)
        return loaded[i]

    def check_files(c: dict[str, Any]) -> None:
        cid, mpath = c["id"], manifest_path(c["id"])
        if [r["rank"] for r in c["ranks"]] != list(range(c["world_size"])):
            raise CorruptCheckpointError(f"{mpath} has rank reports {[r['rank'] for r in c['ranks']]} for a "
                                         f"world size of {c['world_size']}", path=mpath)
        for r in c["ranks"]:
            rel = check_relative(r["file"])  # UnsafeCheckpointError for ../x and absolute paths
            if posixpath.dirname(rel) != ckpt_dir(cid):
                raise UnsafeCheckpointError(
                    f"{mpath} names rank file {r['file']!r}, outside {ckpt_dir(cid)}/. The manifest was crafted "
                    "or edited; refusing it. Restore another checkpoint with restore(step=...)."
                )
            nbytes = int(r["nbytes"])
            for name, meta in r["blobs"].items():
                if meta["dtype"] not in _DTYPES:
                    raise UnsafeCheckpointError(
                        f"{rel}: blob {name!r} has dtype {meta['dtype']!r}, which is never written (payloads are "
                        f"raw tensors of {sorted(_DTYPES)}; nothing is unpickled). Refusing checkpoint {cid}."
                    )
                if not 0 <= int(meta["offset"]) <= int(meta["offset"]) + int(meta["nbytes"]) <= nbytes:
                    raise CorruptCheckpointError(f"{mpath}: blob {name!r} lies outside {rel}'s {nbytes} bytes",
                                                 path=mpath)
            try:
                size = storage.size(rel)
            except CheckpointNotFoundError:
                raise CorruptCheckpointError(f"{rel} is missing; checkpoint {cid} is committed and needs it",
                                             path=rel) from None
            if size is not None and size != nbytes:
                what = "truncated" if size < nbytes else "longer than written"
                raise CorruptCheckpointError(f"{rel} is {size} bytes, its manifest says {nbytes} ({what})",
                                             path=rel)

    def sound_chain(m: dict[str, Any]) -> list[dict[str, Any]]:
        cid, ids = m["id"], m["chain"]
        if not (isinstance(ids, list) and ids and ids[-1] == cid and all(isinstance(i, int) for i in ids)
                and ids == sorted(set(ids))):
            raise CorruptCheckpointError(f"{manifest_path(cid)} has an invalid chain {ids}",
                                         path=manifest_path(cid))
        chain = []
        for k, i in enumerate(ids):
            try:
                c = manifest(i)
            except CheckpointNotFoundError:
                raise CorruptCheckpointError(f"{manifest_path(i)} is missing: checkpoint {cid} needs checkpoint "
                                             f"{i}, which is not committed", path=manifest_path(i)) from None
            if c["chain"] != ids[: k + 1] or (k == 0) != (c["kind"] == "baseline"):
                raise CorruptCheckpointError(f"{manifest_path(i)}: checkpoint {i} ({c['kind']}, chain {c['chain']})"
                                             f" does not fit the chain {ids} of checkpoint {cid}",
                                             path=manifest_path(i))
            chain.append(c)
        for c in chain:
            check_files(c)
        return chain

    ids = committed_ids(storage)  # CorruptCheckpointError for a corrupt index.json, on stores that cannot list
    for cid in reversed(ids):
        if cid in bad:
            continue
        try:
            m = manifest(cid)
        except CheckpointNotFoundError:
            continue  # collected since it was listed
        except CorruptCheckpointError as e:
            if fail:
                raise
            skip(cid, str(e))
            continue
        if step is not None and m.get("step") != step:
            continue
        through = sorted(set(m.get("chain") or []) & set(bad))
        if through:
            log.warning("restore: skipping checkpoint %d: its chain needs checkpoint %s, which failed its checks",
                        cid, through[0])
            continue
        try:
            chain = sound_chain(m)
        except UnsafeCheckpointError:  # a ValueError, but refused, never skipped
            raise
        except CorruptCheckpointError as e:
            if fail:
                raise
            owner = ckpt_id_of(e.path)
            skip(owner if owner is not None else cid, str(e))
            continue
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            err = CorruptCheckpointError(f"{manifest_path(cid)} (or a manifest of its chain) is malformed: "
                                         f"{type(e).__name__}: {e}", path=manifest_path(cid))
            if fail:
                raise err from e
            skip(cid, str(err))
            continue
        return {"chain": list(m["chain"]), "skipped": skipped}, chain
    return {"chain": [], "skipped": skipped}, None
