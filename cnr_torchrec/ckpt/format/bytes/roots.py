"""What a root is called: one name for every way of writing it, and the digest that names it in short.

A job, a memory image, a follower's cursor and a warm-started root's origin all say which root they mean by
these, so that ``ckpt``, ``./ckpt/`` and ``fs:///abs/ckpt`` are one root to all of them.
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["local_path", "normal_root", "root_digest"]


def local_path(root: str) -> str | None:
    """The directory of a local root (a path, or ``fs://`` one); None for a remote one."""
    if "://" not in root:
        return root
    protocol, path = root.split("://", 1)
    return path if protocol in ("", "fs") else None


def normal_root(root: str) -> str:
    """``root`` as a job on this host names it: a local root as an absolute path (``fs://`` dropped), so that
    ``ckpt``, ``./ckpt/`` and ``fs:///abs/ckpt`` are one root; a remote one as given, less trailing slashes."""
    local = local_path(root)
    return os.path.abspath(local) if local else root.rstrip("/")


def root_digest(root: str) -> str:
    """The 16 hex digits that name ``root`` in short (of :func:`normal_root`): its memory images' directory and
    seals, and a warm-started root's origin."""
    return hashlib.blake2b(normal_root(root).encode(), digest_size=8).hexdigest()
