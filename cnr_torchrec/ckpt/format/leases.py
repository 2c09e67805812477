"""Followers' leases: what a follower serves, written under the root, so that retention keeps what it has not
read yet.

``followers/<name>.json`` holds ``{"ckpt": id, "unix": time}``: the checkpoint follower ``name`` serves, and
when it said so. A follower rewrites it (atomically, through the root's own storage) after each update. A
job whose ``keep.followers`` names the follower keeps every checkpoint committed from that one on, with what
their chains need, until the lease moves on or grows older than ``keep.follower_max_age_s``. A lease of an
unnamed follower keeps nothing; a missing, stale or unreadable one keeps nothing and is logged.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable

from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.errors import CheckpointNotFoundError, ConfigError

__all__ = ["check_name", "lease_path", "read_leases", "write_lease"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def check_name(name: object, what: str) -> str:
    """``name`` if it can name a lease file. Raises ConfigError otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{what}: {name!r} cannot name a follower: use letters, digits, '_', '.' and '-' "
                          "(100 at most, not starting with '.')")
    return name


def lease_path(name: str) -> str:
    return f"followers/{check_name(name, 'lease')}.json"


def write_lease(storage: Storage, name: str, ckpt: int) -> None:
    """Follower ``name`` serves checkpoint ``ckpt``, now."""
    storage.write_atomic(lease_path(name), json.dumps({"ckpt": int(ckpt), "unix": time.time()}).encode())


def read_leases(storage: Storage, names: Iterable[str], max_age_s: float) -> dict[str, int]:
    """The checkpoint each named follower serves, of the leases renewed within ``max_age_s``."""
    out: dict[str, int] = {}
    now = time.time()
    for name in names:
        try:
            doc = json.loads(storage.read(lease_path(name)))
            ckpt, unix = doc["ckpt"], doc["unix"]
            if not isinstance(ckpt, int) or isinstance(ckpt, bool) or not isinstance(unix, (int, float)):
                raise TypeError(f"ckpt {ckpt!r} and unix {unix!r}")
        except CheckpointNotFoundError:
            log.info("follower %s holds no lease under %s yet: it keeps nothing", name, storage.root)
            continue
        except (ValueError, KeyError, TypeError) as e:
            log.warning("the lease of follower %s under %s is unreadable (%s: %s): it keeps nothing", name,
                        storage.root, type(e).__name__, e)
            continue
        if now - unix > max_age_s:
            log.warning("follower %s last renewed its lease %.0f s ago (keep.follower_max_age_s %g): it keeps "
                        "nothing", name, now - unix, max_age_s)
            continue
        out[name] = ckpt
    return out
