"""torchsnapshot storage plugins of our own: a local one that reads without a copy, and S3.

:class:`~cnr_torchrec.ckpt.format.bytes.storage.Storage` reaches every backend through a
torchsnapshot plugin, picked by :func:`make_plugin` from the root's URI. For the local
filesystem and S3 the stock plugins fall short, so they are subclassed here:

* :class:`FSPlugin` reads whole local files straight into a bytearray that tensors can view,
  saving the stock plugin's copy and thread hop.
* :class:`S3Plugin` keeps one client per storage object (torchsnapshot opens one per
  request), takes its endpoint and credentials from ``storage_options`` (torchsnapshot
  ignores them; see :data:`S3_OPTIONS`), and adds the sizes, listing and prefix deletion that
  garbage collection needs.

Other URIs (``gs://``, registered plugins) get torchsnapshot's own plugin.
"""

from __future__ import annotations

import difflib
import io
import os
import posixpath
from typing import Any

from torchsnapshot.io_types import ReadIO, WriteIO
from torchsnapshot.memoryview_stream import MemoryviewStream
from torchsnapshot.storage_plugin import url_to_storage_plugin
from torchsnapshot.storage_plugins.fs import FSStoragePlugin
from torchsnapshot.storage_plugins.s3 import S3StoragePlugin

from cnr_torchrec.errors import ConfigError

__all__ = ["FSPlugin", "S3_OPTIONS", "S3Plugin", "is_missing", "make_plugin"]


async def make_plugin(root: str, options: dict[str, Any]):
    """The storage plugin for ``root``: ours for fs and s3, torchsnapshot's registry for the rest.

    A coroutine because plugins may create aiohttp sessions, which need a running loop.
    """
    protocol, path = root.split("://", 1) if "://" in root else ("fs", root)
    if protocol == "s3" and path:
        return S3Plugin(path, options)
    if protocol in ("fs", ""):
        return FSPlugin(path, options)
    return url_to_storage_plugin(root, storage_options=options)


class FSPlugin(FSStoragePlugin):
    """torchsnapshot's local-filesystem plugin, reading whole files straight into a bytearray.

    The stock plugin reads through a thread pool into bytes and wraps them in a BytesIO;
    a restore then copies every byte again to get a buffer tensors can view. Reading
    into a bytearray in place saves that copy and the thread hop (a fifth of a restore's
    read time). Range reads and writes are the stock plugin's.
    """

    async def read(self, read_io: ReadIO) -> None:
        if read_io.byte_range is not None:
            return await super().read(read_io)
        with open(os.path.join(self.root, read_io.path), "rb", buffering=0) as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            view, got = memoryview(buf), 0
            while got < len(buf) and (n := f.readinto(view[got:])):
                got += n
            extra = f.read()  # the file grew since fstat: keep every byte, so that size checks see it
        read_io.buf = buf[:got] if got < len(buf) else buf + extra if extra else buf  # type: ignore[assignment]  # torchsnapshot types it BytesIO; its readers take any buffer


# storage_options keys for s3:// roots -> the aiobotocore create_client() argument they set.
S3_OPTIONS: dict[str, str] = {
    "endpoint_url": "endpoint_url",  # e.g. http://127.0.0.1:9000 for MinIO or moto
    "region_name": "region_name",
    "region": "region_name",
    "aws_access_key_id": "aws_access_key_id",
    "aws_secret_access_key": "aws_secret_access_key",
    "aws_session_token": "aws_session_token",
    "verify": "verify",  # False, or the path of a CA bundle
}
_S3_CONFIG_OPTIONS = ("addressing_style", "max_attempts", "connect_timeout", "read_timeout")
_S3_SESSION_OPTIONS = ("profile",)


class S3Plugin(S3StoragePlugin):
    """torchsnapshot's S3 plugin with options, one reused client, listing, sizes and prefix deletion.

    ``root`` is ``bucket`` or ``bucket/prefix``. Options (all optional; botocore's usual
    environment variables and config files fill in the rest):

    * ``endpoint_url``, ``region_name`` (or ``region``), ``aws_access_key_id``,
      ``aws_secret_access_key``, ``aws_session_token``, ``verify``: passed to
      ``create_client("s3", ...)``;
    * ``addressing_style`` (``path``, ``virtual``, ``auto``), ``max_attempts``,
      ``connect_timeout``, ``read_timeout``: go into a botocore ``Config``;
    * ``profile``: the AWS profile of the session.

    Not thread-safe, like :class:`~cnr_torchrec.ckpt.format.bytes.storage.Storage`: one instance per event loop.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})
        valid = sorted(set(S3_OPTIONS) | set(_S3_CONFIG_OPTIONS) | set(_S3_SESSION_OPTIONS))
        for key in options:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(f"storage_options: unknown key '{key}' for s3{hint}; valid keys are {valid}")
        bucket, _, prefix = root.partition("/")
        if len(bucket) < 3:
            raise ConfigError(f"s3://{root}: give s3://BUCKET/PREFIX with a bucket name of at least 3 characters")
        super().__init__(f"{bucket}/{prefix}", {})  # builds the aiobotocore session; we add the options below
        self.bucket = bucket
        self.root = prefix.strip("/")
        if "profile" in options:
            from aiobotocore.session import AioSession

            self.session = AioSession(profile=options["profile"])
        self._client_kwargs: dict[str, Any] = {S3_OPTIONS[k]: v for k, v in options.items() if k in S3_OPTIONS}
        config = {k: options[k] for k in _S3_CONFIG_OPTIONS if k in options}
        if config:
            from botocore.config import Config

            kw: dict[str, Any] = {}
            if "addressing_style" in config:
                kw["s3"] = {"addressing_style": config["addressing_style"]}
            if "max_attempts" in config:
                kw["retries"] = {"max_attempts": int(config["max_attempts"])}
            for k in ("connect_timeout", "read_timeout"):
                if k in config:
                    kw[k] = config[k]
            self._client_kwargs["config"] = Config(**kw)
        self._client_cm: Any = None
        self._client: Any = None

    def _key(self, path: str) -> str:
        return posixpath.join(self.root, path) if self.root else path

    def _base(self) -> str:
        return self.root + "/" if self.root else ""

    async def _get(self) -> Any:
        if self._client is None:
            self._client_cm = self.session.create_client("s3", **self._client_kwargs)
            self._client = await self._client_cm.__aenter__()
        return self._client

    async def write(self, write_io: WriteIO) -> None:
        client = await self._get()
        buf = write_io.buf
        body = MemoryviewStream(buf) if isinstance(buf, memoryview) else io.BytesIO(buf)
        await client.put_object(Bucket=self.bucket, Key=self._key(write_io.path), Body=body)

    async def read(self, read_io: ReadIO) -> None:
        client = await self._get()
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self._key(read_io.path)}
        if read_io.byte_range is not None:
            start, end = read_io.byte_range
            if end <= start:
                read_io.buf = io.BytesIO(b"")
                return
            kw["Range"] = f"bytes={start}-{end - 1}"  # HTTP ranges are inclusive
        try:
            response = await client.get_object(**kw)
        except Exception as e:
            if _error_code(e) == "InvalidRange":  # a range that starts past the end: like a short read
                read_io.buf = io.BytesIO(b"")
                return
            raise
        async with response["Body"] as stream:
            read_io.buf = io.BytesIO(await stream.read())

    async def delete(self, path: str) -> None:
        client = await self._get()
        await client.delete_object(Bucket=self.bucket, Key=self._key(path))

    async def head(self, path: str) -> int | None:
        """The object's size, or None if it does not exist."""
        client = await self._get()
        try:
            response = await client.head_object(Bucket=self.bucket, Key=self._key(path))
        except Exception as e:
            if is_missing(e):
                return None
            raise
        return int(response["ContentLength"])

    async def _list(self, prefix: str, delimiter: str | None) -> tuple[list[str], list[str]]:
        """(keys, common prefixes) under ``prefix``, every page."""
        client = await self._get()
        keys: list[str] = []
        prefixes: list[str] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        while True:
            page = await client.list_objects_v2(**kw)
            keys += [o["Key"] for o in page.get("Contents", [])]
            prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                return keys, prefixes
            kw["ContinuationToken"] = page["NextContinuationToken"]

    async def list_dirs(self) -> list[str]:
        """Names of the "directories" (common prefixes) directly under the root."""
        base = self._base()
        _, prefixes = await self._list(base, "/")
        return [p[len(base) :].rstrip("/") for p in prefixes]

    async def delete_prefix(self, directory: str) -> None:
        """Deletes every object under ``directory/``."""
        client = await self._get()
        keys, _ = await self._list(self._base() + directory.strip("/") + "/", None)
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            response = await client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = response.get("Errors") or []
            if errors:
                raise OSError(f"s3://{self.bucket}: could not delete {len(errors)} objects, e.g. {errors[0]}")

    async def close(self) -> None:
        if self._client_cm is not None:
            cm, self._client_cm, self._client = self._client_cm, None, None
            await cm.__aexit__(None, None, None)


def _error_code(e: Exception) -> str | None:
    response = getattr(e, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def is_missing(e: Exception) -> bool:
    """True when ``e`` is an object store's "no such key" (each backend raises its own)."""
    return _error_code(e) in ("NoSuchKey", "404", "NotFound") or type(e).__name__ in ("NoSuchKey", "NotFound")
