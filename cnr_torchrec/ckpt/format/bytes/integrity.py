"""Authenticated roots: a secret key that vouches for every manifest and every chunk under a root.

Without a key, a root is checked against accidents: xxh3 over each manifest's body, each chunk
and each blob, CRC-32C over groups of rows. Anyone who can write to the root can recompute all
of them, so a crafted checkpoint passes. With a key (``integrity`` in the config, docs/checkpoints.md):

- a manifest's header also carries ``hmac_sha256``: HMAC-SHA256 over the body's text exactly as it
  stands in the file (what the header's xxh3 covers);
- each chunk is listed with ``blake2b``, BLAKE2b keyed with the root's key (16 bytes, as wide as
  xxh3-128), in place of ``xxh3``, which is not collision-resistant;
- a reader that holds the key reads chunks whole, into its own memory, and checks each against its
  keyed digest before any byte of it is used. A range read would be checked by the CRC-32Cs of its
  rows or the xxh3 of its blob, which vouch for nothing against someone who can forge them, and a
  mapped file can change under its reader.

The manifest binds each chunk's digest, each chunk's digest binds its bytes, and the key binds
both, so a root written without the key, with another key, or altered since, is refused by name
(:class:`~cnr_torchrec.errors.UnauthenticatedCheckpointError` for a manifest, CorruptCheckpointError
for a chunk, which may also be an accident). A keyed root read without its key is refused the same
way; an unkeyed root read with a key is refused too, so a reader never trusts what it cannot check.

What a key does not stop: deleting checkpoints (a restore then finds an older one, as after a
retention), or copying a root's whole checkpoint directory to another root sealed with the same key.

The two keys used are derived from the secret with HMAC-SHA256 under fixed labels, so a manifest's
MAC can never stand for a chunk's digest. Only the standard library's ``hmac`` and ``hashlib``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from typing import Any, Protocol

import xxhash

from cnr_torchrec.errors import ConfigError, CorruptCheckpointError, UnauthenticatedCheckpointError

__all__ = ["CHUNK_DIGESTS", "MAC_FIELD", "RootKey", "check_chunk", "check_seal", "chunk_hasher", "chunk_record",
           "load_key", "seal_fields"]

log = logging.getLogger("cnr_torchrec")

# A manifest header's MAC; a chunk's digest field, unkeyed and keyed.
MAC_FIELD = "hmac_sha256"
CHUNK_DIGESTS = ("xxh3", "blake2b")


class _Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


class RootKey:
    """The secret of an authenticated root. Holds the two derived keys, never prints the secret.

    Args:
        secret: at least :attr:`MIN_BYTES` bytes (for example 32 random bytes, or their 64 hex digits).
        source: where it came from, for messages (``key file /etc/cnr/key``, ``$CNR_ROOT_KEY``).
    """

    MIN_BYTES = 16

    def __init__(self, secret: bytes, source: str) -> None:
        if len(secret) < self.MIN_BYTES:
            raise ConfigError(
                f"integrity: the key from {source} is {len(secret)} bytes; use at least {self.MIN_BYTES} random "
                "bytes, e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
            )
        self.source = source
        # Names the key in messages and lets ranks compare keys without showing them.
        self.fingerprint = hmac.new(secret, b"cnr-torchrec key id v1", hashlib.sha256).hexdigest()[:16]
        self._mac_key = hmac.new(secret, b"cnr-torchrec manifest v1", hashlib.sha256).digest()
        self._chunk_key = hmac.new(secret, b"cnr-torchrec chunk v1", hashlib.sha256).digest()

    def __repr__(self) -> str:
        return f"RootKey(from {self.source})"

    def mac(self, text: bytes | bytearray) -> str:
        """HMAC-SHA256 of a manifest body's text, as 64 hex digits."""
        return hmac.new(self._mac_key, text, hashlib.sha256).hexdigest()

    def hasher(self) -> _Hasher:
        """A keyed BLAKE2b of 16 bytes, fed chunk by chunk (hashlib releases the GIL on large buffers)."""
        return hashlib.blake2b(key=self._chunk_key, digest_size=16)


def load_key(key_file: str | None, key_env: str | None) -> RootKey | None:
    """The root's key from ``integrity.key_file`` or the variable ``integrity.key_env`` names; None without either.

    A key file's bytes are the secret, less one trailing line break. A file others can read gets a
    warning (the key is what keeps the root honest).

    Raises:
        ConfigError: the file cannot be read, the variable is not set, or the key is too short.
    """
    if key_file:
        try:
            with open(key_file, "rb") as f:
                secret = f.read()
                mode = os.fstat(f.fileno()).st_mode
        except OSError as e:
            raise ConfigError(f"integrity.key_file: cannot read {key_file} ({e.strerror}); give a readable file "
                              "that holds the root's key, on every rank") from None
        if mode & (stat.S_IROTH | stat.S_IWOTH):
            log.warning("integrity.key_file %s can be read or written by any user; chmod 600 it", key_file)
        return RootKey(secret.removesuffix(b"\n").removesuffix(b"\r"), f"key file {key_file}")
    if key_env:
        value = os.environ.get(key_env)
        if not value:
            raise ConfigError(f"integrity.key_env names ${key_env}, which is not set (or empty) in this process; "
                              "export it on every rank before the job starts")
        return RootKey(value.encode(), f"${key_env}")
    return None


def seal_fields(key: RootKey | None, text: bytes) -> dict[str, str]:
    """What a manifest's header adds for the body ``text``: its MAC under ``key``, or nothing."""
    return {} if key is None else {MAC_FIELD: key.mac(text)}


def check_seal(key: RootKey | None, header: dict[str, Any], text: bytes | bytearray, path: str) -> None:
    """Refuses a manifest that ``key`` does not vouch for, and a keyed manifest read without a key.

    Raises:
        UnauthenticatedCheckpointError: names ``path`` and says what to do.
    """
    mac = header.get(MAC_FIELD)
    if key is None:
        if mac is not None:
            raise UnauthenticatedCheckpointError(
                f"{path} is sealed with a key (an authenticated root): give the root's key, as integrity.key_file "
                "or integrity.key_env in the config (cnr: --key-file)", path=path)
        return
    if not isinstance(mac, str):
        raise UnauthenticatedCheckpointError(
            f"{path} carries no {MAC_FIELD}: it was written without a key, and the key from {key.source} cannot "
            "vouch for it. Restore it without integrity in the config only if you trust whoever wrote it", path=path)
    if not _same(key.mac(text), mac):
        raise UnauthenticatedCheckpointError(
            f"{path} does not match its {MAC_FIELD} under the key from {key.source}: it was sealed with another "
            "key, or altered after it was written. Refusing it; check the key, or restore another checkpoint",
            path=path)


def _same(computed: str, stored: str) -> bool:
    """A digest against the manifest's, in constant time (compare_digest takes ASCII strings only)."""
    return stored.isascii() and hmac.compare_digest(computed, stored)


def chunk_hasher(key: RootKey | None) -> _Hasher:
    """The digest a chunk is written with: keyed BLAKE2b under ``key``, else XXH3-128."""
    return xxhash.xxh3_128() if key is None else key.hasher()


def chunk_record(key: RootKey | None, nbytes: int, digest: str) -> dict[str, Any]:
    """A chunk's entry in its rank's report: its size and its digest, under the field that names the digest."""
    return {"nbytes": nbytes, CHUNK_DIGESTS[key is not None]: digest}


def check_chunk(key: RootKey | None, path: str, data: Any, nbytes: int, digest: str, keyed: bool) -> None:
    """Checks a whole chunk's bytes against its size and its digest from the manifest.

    Raises:
        CorruptCheckpointError: the size or the digest does not match (named ``path``).
        UnauthenticatedCheckpointError: a chunk listed with xxh3 read with a key, or the other way round.
    """
    if keyed != (key is not None):
        raise UnauthenticatedCheckpointError(
            f"{path} is listed with {CHUNK_DIGESTS[keyed]} in its manifest, but this reader "
            f"{'holds a key' if key is not None else 'has no key'}: give the root's key or none, as it was written",
            path=path)
    if len(data) != nbytes:
        what = "truncated" if len(data) < nbytes else "longer than written"
        raise CorruptCheckpointError(f"{path} is {len(data)} bytes, its manifest says {nbytes} ({what})", path=path)
    hasher = chunk_hasher(key)
    hasher.update(data)
    if not _same(hasher.hexdigest(), digest):
        which = f"keyed {CHUNK_DIGESTS[1]} (key from {key.source})" if key is not None else CHUNK_DIGESTS[0]
        raise CorruptCheckpointError(f"{path} does not match its {which} in the manifest (its bytes changed)",
                                     path=path)
