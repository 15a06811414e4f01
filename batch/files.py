"""Uploaded and produced files: a ``FileStore`` Protocol and its local-disk implementation.

``LocalFileStore`` keeps each file as two entries under ``files_dir``: the body
(``files/<id>.body``) and its metadata (``files/<id>.json``: tenant, name, purpose, size,
time). Both are written to a temporary name and renamed, so a reader never sees half a file.
On Kubernetes the directory is a shared volume (ReadWriteMany): every pod reads what any pod
wrote, which is all a multi-pod deployment needs of it. Lookups are by (tenant, id): another
tenant's file reads as absent. A batch keeps its own link to its input (``batches/<id>.input``),
so deleting the uploaded file does not pull the requests from under a running batch.

An S3-compatible store is not implemented (docs/batch.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import orjson

from batch.model import new_id


class FileTooLarge(Exception):
    """An upload past the configured bound (``batch.max_file_bytes``)."""


@dataclass(frozen=True, slots=True)
class StoredFile:
    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: str


class FileStore(Protocol):
    """Where file bodies and their metadata live."""

    async def put(
        self, tenant: str, filename: str, purpose: str, chunks: AsyncIterator[bytes], max_bytes: int, now: int
    ) -> StoredFile: ...

    async def get(self, tenant: str, file_id: str) -> StoredFile | None: ...

    async def read(self, stored: StoredFile) -> bytes: ...

    async def delete(self, tenant: str, file_id: str) -> bool: ...

    async def listing(self, tenant: str) -> list[StoredFile]: ...

    async def keep_for_batch(self, stored: StoredFile, batch_id: str) -> None: ...

    async def read_batch_input(self, batch_id: str, offset: int, length: int) -> bytes: ...

    async def drop_batch_input(self, batch_id: str) -> None: ...


# Uploads are written in pieces of about this size (multipart parts arrive in 8 KiB chunks;
# one thread hop per chunk would cost more than the write).
_WRITE_BUFFER = 1 << 20


class LocalFileStore:
    """Files on a local (or shared) directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._files = root / "files"
        self._batches = root / "batches"

    def _ensure(self) -> None:
        self._files.mkdir(parents=True, exist_ok=True)
        self._batches.mkdir(parents=True, exist_ok=True)

    def _body(self, file_id: str) -> Path:
        return self._files / f"{file_id}.body"

    def _meta(self, file_id: str) -> Path:
        return self._files / f"{file_id}.json"

    async def put(
        self, tenant: str, filename: str, purpose: str, chunks: AsyncIterator[bytes], max_bytes: int, now: int
    ) -> StoredFile:
        """Stream ``chunks`` to disk; ``FileTooLarge`` (nothing kept) past ``max_bytes``."""
        await asyncio.to_thread(self._ensure)
        file_id = new_id("file-")
        partial = self._files / f".{file_id}.partial"
        size = 0
        handle = await asyncio.to_thread(open, partial, "wb")
        try:
            pending = bytearray()
            async for chunk in chunks:
                size += len(chunk)
                if size > max_bytes:
                    raise FileTooLarge(f"The file is larger than the {max_bytes}-byte limit.")
                pending += chunk
                if len(pending) >= _WRITE_BUFFER:
                    await asyncio.to_thread(handle.write, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(handle.write, bytes(pending))
            await asyncio.to_thread(handle.close)
            stored = StoredFile(file_id, tenant, size, now, filename, purpose)
            await asyncio.to_thread(self._commit, partial, stored)
            return stored
        except BaseException:
            handle.close()
            with contextlib.suppress(OSError):
                partial.unlink()
            raise

    async def put_bytes(self, tenant: str, filename: str, purpose: str, data: bytes, now: int) -> StoredFile:
        """A file the gateway produced (a batch's output or errors)."""

        async def one() -> AsyncIterator[bytes]:
            yield data

        return await self.put(tenant, filename, purpose, one(), len(data), now)

    def _commit(self, partial: Path, stored: StoredFile) -> None:
        os.replace(partial, self._body(stored.id))
        meta = self._files / f".{stored.id}.json.partial"
        meta.write_bytes(orjson.dumps(asdict(stored)))
        os.replace(meta, self._meta(stored.id))

    async def get(self, tenant: str, file_id: str) -> StoredFile | None:
        if not _plain(file_id):
            return None
        try:
            raw = await asyncio.to_thread(self._meta(file_id).read_bytes)
        except FileNotFoundError:
            return None
        stored = StoredFile(**orjson.loads(raw))
        return stored if stored.tenant == tenant else None

    async def read(self, stored: StoredFile) -> bytes:
        return await asyncio.to_thread(self._body(stored.id).read_bytes)

    async def delete(self, tenant: str, file_id: str) -> bool:
        stored = await self.get(tenant, file_id)
        if stored is None:
            return False

        def remove() -> None:
            for path in (self._meta(file_id), self._body(file_id)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

        await asyncio.to_thread(remove)
        return True

    async def listing(self, tenant: str) -> list[StoredFile]:
        def scan() -> list[StoredFile]:
            if not self._files.is_dir():
                return []
            found = []
            for meta in self._files.glob("file-*.json"):
                with contextlib.suppress(FileNotFoundError):
                    stored = StoredFile(**orjson.loads(meta.read_bytes()))
                    if stored.tenant == tenant:
                        found.append(stored)
            return found

        return await asyncio.to_thread(scan)

    def _input(self, batch_id: str) -> Path:
        return self._batches / f"{batch_id}.input"

    async def keep_for_batch(self, stored: StoredFile, batch_id: str) -> None:
        """The batch's own name for its input: a hard link (a copy where links fail)."""

        def link() -> None:
            self._ensure()
            target = self._input(batch_id)
            try:
                os.link(self._body(stored.id), target)
            except OSError:
                target.write_bytes(self._body(stored.id).read_bytes())

        await asyncio.to_thread(link)

    async def read_batch_input(self, batch_id: str, offset: int, length: int) -> bytes:
        def read() -> bytes:
            with open(self._input(batch_id), "rb") as handle:
                handle.seek(offset)
                return handle.read(length)

        return await asyncio.to_thread(read)

    async def drop_batch_input(self, batch_id: str) -> None:
        def remove() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._input(batch_id).unlink()

        await asyncio.to_thread(remove)


def _plain(file_id: str) -> bool:
    """An id that names a file in the directory and nothing else (no path tricks)."""
    return file_id.startswith("file-") and file_id[5:].isalnum()
