"""Where a host keeps memory images: one directory per root under ``memory_tier.path``, and when one goes.

Under ``memory_tier.path`` (``/dev/shm`` by default, shared by every job on the host) each root has a
directory of its own, ``cnr-<root digest>/``, mode 0700::

    cnr-<root digest>/root          the root, one line (a local root as an absolute path)
    cnr-<root digest>/r<rank>.img   rank <rank>'s image, and .seal its seal (:mod:`.image`)

A job works in its own root's directory alone: opening a root makes it (or checks that an existing one is
the user's own), names the root in it, and removes this root's images of ranks beyond the world size. It
never decides that another job's images are stale because that job is not running: a killed job waiting
for its restart is exactly the one whose images matter. Another root's directory goes only when

- its root is gone: a local root that no longer exists, where the directory holds a seal (so the root
  existed when the image was sealed; a job before its first commit may not have made its root yet). A
  remote root (``s3://...``) is never judged gone;
- or it is stale: nothing in it changed for ``memory_tier.max_age_s`` (every commit rewrites a seal, and
  every job that opens the root touches its ``root`` file).

Files of the flat layout of older versions (``cnr-<digest>-r<rank>.img`` directly under the path) are no
longer read; they name no root, so they go by age alone. ``cnr clean-images`` removes by the same rules, or
one root's images, or all of the user's. Only the user's own files are removed, and no link is followed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import stat
import time

from cnr_torchrec.ckpt.format.bytes.roots import local_path, normal_root, root_digest
from cnr_torchrec.ckpt.memory.image import ImageRefused
from cnr_torchrec.errors import ConfigError

__all__ = ["ImageDir", "image_stem", "open_root_dir", "release_root_dir", "remove", "root_dir", "scan", "select",
           "tidy", "why_stale"]

_DIR = re.compile(r"^cnr-([0-9a-f]{16})$")
_FILE = re.compile(r"^r(\d{5})\.(img|seal|seal\.\d+\.tmp)$")
_LEGACY = re.compile(r"^cnr-([0-9a-f]{16})-r(\d{5})\.(img|seal|seal\.\d+\.tmp)$")
_MARKER = "root"


def root_dir(path: str, root: str) -> str:
    """The directory of ``root``'s images under ``path``."""
    return os.path.join(path, f"cnr-{root_digest(root)}")


def image_stem(path: str, root: str, rank: int) -> str:
    """Rank ``rank``'s image of ``root`` under ``path``, without its suffix."""
    return os.path.join(root_dir(path, root), f"r{rank:05d}")


def _own(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid()


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


# ---------------------------------------------------------------------- a job's own directory


def open_root_dir(path: str, root: str, world_size: int) -> str:
    """Makes (or checks) ``root``'s directory under ``path``, names the root in it (which counts as a use for
    the age limit) and removes this root's images of ranks ``>= world_size``. Every rank of a host may call it
    at once.

    Returns:
        The directory.

    Raises:
        ImageRefused: the directory is a link, not a directory, another user's, or open to others.
        OSError: it could not be made.
    """
    d = root_dir(path, root)
    with contextlib.suppress(FileExistsError):
        os.mkdir(d, 0o700)
    st = os.lstat(d)
    why = None
    if not stat.S_ISDIR(st.st_mode):
        why = "is not a directory (a link?)"
    elif not _own(st):
        why = f"belongs to uid {st.st_uid}, not this job's {os.getuid()}"
    elif st.st_mode & 0o077:
        why = f"has mode {oct(st.st_mode & 0o777)}; an image directory is 0700"
    if why is not None:
        raise ImageRefused(f"{d} {why}; remove it, or set memory_tier.path to a directory of this user's own")
    _write_marker(d, normal_root(root))
    for name in os.listdir(d):
        m = _FILE.match(name)
        if m is not None and int(m.group(1)) >= world_size:
            _unlink_own(os.path.join(d, name))
    return d


def _write_marker(d: str, root: str) -> None:
    """``d/root`` holds ``root``: touched where it does, else written whole and renamed into place."""
    marker = os.path.join(d, _MARKER)
    if _read_marker(d) == root:
        os.utime(marker)
        return
    tmp = f"{marker}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (root + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, marker)


def _read_marker(d: str) -> str | None:
    """The root ``d/root`` names; None where it is missing, unreadable or not the user's regular file."""
    try:
        fd = os.open(os.path.join(d, _MARKER), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _own(st):
            return None
        text = os.read(fd, 1 << 16).decode("utf-8", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    return text or None


def release_root_dir(d: str) -> None:
    """After a rank removed its image at a clean end: removes the directory once it holds no rank's files
    (the last rank of the host to close does; a directory left by a race is tidied like any other)."""
    try:
        names = os.listdir(d)
    except OSError:
        return
    if any(_FILE.match(n) for n in names):
        return
    for name in names:
        if name == _MARKER or name.startswith(_MARKER + "."):
            _unlink_own(os.path.join(d, name))
    with contextlib.suppress(OSError):
        os.rmdir(d)


def _unlink_own(path: str) -> bool:
    """Removes ``path`` if it is the user's own (a link itself, never its target); whether it did."""
    st = _lstat(path)
    if st is None or not _own(st) or stat.S_ISDIR(st.st_mode):
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------- every root's images


@dataclasses.dataclass(frozen=True)
class ImageDir:
    """The user's images of one root under the path: a directory, or the flat files of an older version.

    Attributes:
        path: the directory (legacy: the first file's path).
        digest: the root's digest.
        root: the root its ``root`` file names; None where unknown (a legacy file, no ``root`` file).
        files: its files, the user's own.
        nbytes: their size.
        newest: the newest modification time of the directory and its files (seconds since the epoch).
        sealed: whether it holds a seal.
        legacy: files of the flat layout of an older version.
    """

    path: str
    digest: str
    root: str | None
    files: tuple[str, ...]
    nbytes: int
    newest: float
    sealed: bool
    legacy: bool = False


def scan(path: str) -> list[ImageDir]:
    """The user's image directories (and legacy image files, by root) under ``path``, by name.

    Raises:
        ConfigError: ``path`` is not a directory.
    """
    if not os.path.isdir(path):
        raise ConfigError(f"memory_tier.path {path} is not a directory; give the directory the jobs keep their "
                          "memory images in (memory_tier.path, /dev/shm by default)")
    out: list[ImageDir] = []
    legacy: dict[str, list[tuple[str, os.stat_result]]] = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        st = _lstat(full)
        if st is None or not _own(st):
            continue  # another user's, or gone already: never ours to count or remove
        if (m := _DIR.match(name)) is not None and stat.S_ISDIR(st.st_mode):
            out.append(_scan_dir(full, m.group(1), st))
        elif (m := _LEGACY.match(name)) is not None and stat.S_ISREG(st.st_mode):
            legacy.setdefault(m.group(1), []).append((full, st))
    for digest, files in legacy.items():
        out.append(ImageDir(files[0][0], digest, None, tuple(f for f, _ in files), sum(s.st_size for _, s in files),
                            max(s.st_mtime for _, s in files), any(f.endswith(".seal") for f, _ in files), True))
    return sorted(out, key=lambda e: e.path)


def _scan_dir(d: str, digest: str, st: os.stat_result) -> ImageDir:
    files, nbytes, newest = [], 0, st.st_mtime
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(d)):
            fst = _lstat(os.path.join(d, name))
            if fst is not None and _own(fst) and not stat.S_ISDIR(fst.st_mode):
                files.append(os.path.join(d, name))
                nbytes += fst.st_size
                newest = max(newest, fst.st_mtime)
    sealed = any(f.endswith(".seal") for f in files)
    return ImageDir(d, digest, _read_marker(d), tuple(files), nbytes, newest, sealed)


def why_stale(entry: ImageDir, max_age_s: float, now: float | None = None) -> str:
    """Why ``entry`` may go although no job of its root removed it (its root is gone, or it is older than
    ``max_age_s``), in words; empty when it stays."""
    local = local_path(entry.root) if entry.root is not None else None
    if local and entry.sealed and not os.path.lexists(local):
        return f"its root {entry.root} is gone"
    age = (time.time() if now is None else now) - entry.newest
    if age > max_age_s:
        return f"unchanged for {age / 3600:.1f} h, more than memory_tier.max_age_s ({max_age_s:g} s)"
    return ""


def remove(entry: ImageDir) -> None:
    """Removes ``entry``'s files (the user's own) and its directory; what another user put there stays."""
    for f in entry.files:
        _unlink_own(f)
    if not entry.legacy:
        with contextlib.suppress(OSError):
            os.rmdir(entry.path)


def _legacy_digest(root: str) -> str:
    """The digest older versions named ``root``'s flat image files by (of the root as given)."""
    return hashlib.blake2b(root.rstrip("/").encode(), digest_size=8).hexdigest()


def select(entries: list[ImageDir], *, root: str | None = None, everything: bool = False,
           max_age_s: float = 0.0) -> list[tuple[ImageDir, str]]:
    """The entries to remove, each with why: every one (``everything``), those of ``root``, or else the stale
    ones (:func:`why_stale` with ``max_age_s``)."""
    out = []
    for e in entries:
        if everything:
            out.append((e, "all of the user's images were asked for"))
        elif root is not None:
            if e.root == normal_root(root) or (e.root is None and e.digest in (root_digest(root),
                                                                                _legacy_digest(root))):
                out.append((e, f"the images of root {root} were asked for"))
        elif why := why_stale(e, max_age_s):
            out.append((e, why))
    return out


def tidy(path: str, root: str, max_age_s: float) -> list[tuple[ImageDir, str]]:
    """What a job that opens ``root`` removes under ``path``: other roots' directories whose root is gone or
    older than ``max_age_s``, old-layout files by the same age, and this root's old-layout files at once (no
    version reads them, and they hold the room its image needs). Never another root's images otherwise.

    Returns:
        What was removed, each with why.
    """
    own, old = root_digest(root), _legacy_digest(root)
    picked = []
    for e in scan(path):
        if e.legacy and e.digest == old:
            picked.append((e, "this root's images in the layout of an older version, which no version reads"))
        elif e.digest != own or e.legacy:
            picked += select([e], max_age_s=max_age_s)
    for e, _ in picked:
        remove(e)
    return picked
