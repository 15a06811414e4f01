"""OpenAI's Files and Batches endpoints (``/v1/files``, ``/v1/batches``) over the batch
package: the HTTP edge only (the tenant, the body, the answer's shape); what a batch is and
how it runs lives in ``batch/`` (docs/batch.md).

Everything is the tenant's own: a file or batch is looked up by (tenant, id), and another
tenant's id is a 404 as an unknown one is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import BodyPartReader, web

from batch.config import BatchSettings, window_seconds
from batch.files import FileTooLarge, LocalFileStore, StoredFile
from batch.metrics import BatchMetrics
from batch.model import ENDPOINTS, TERMINAL, BatchRecord, Counts, file_object, iter_lines, new_id, page, validate
from batch.runner import Runner
from batch.store import BatchStore, BatchStoreUnavailable
from gateway.accounting import REQUEST_ID_KEY
from gateway.errors import BadRequest, GatewayError, NotFound, PayloadTooLarge, ServiceUnavailable, error_response

log = logging.getLogger("fleetgate.batch")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# OpenAI's metadata bounds: 16 pairs, keys up to 64 characters, values up to 512.
_MAX_METADATA = 16
_MAX_METADATA_KEY = 64
_MAX_METADATA_VALUE = 512
# OpenAI's list bounds.
_MAX_PAGE = 100
_DEFAULT_PAGE = 20
PURPOSES = frozenset({"batch"})


class BatchApi:
    """The Files and Batches handlers; ``tenant_of`` names the request's tenant (401 otherwise)."""

    def __init__(
        self,
        settings: BatchSettings,
        store: BatchStore,
        files: LocalFileStore,
        runner: Runner | None,
        metrics: BatchMetrics,
        tenant_of: Callable[[web.Request], str],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.store = store
        self.files = files
        self.runner = runner
        self.metrics = metrics
        self.tenant_of = tenant_of
        self.wall = wall

    def add_routes(self, app: web.Application, logged: Callable[[Handler, str], Handler]) -> None:
        routes = (
            ("POST", "/v1/files", self.upload_file),
            ("GET", "/v1/files", self.list_files),
            ("GET", "/v1/files/{file_id}", self.get_file),
            ("DELETE", "/v1/files/{file_id}", self.delete_file),
            ("GET", "/v1/files/{file_id}/content", self.file_content),
            ("POST", "/v1/batches", self.create_batch),
            ("GET", "/v1/batches", self.list_batches),
            ("GET", "/v1/batches/{batch_id}", self.get_batch),
            ("POST", "/v1/batches/{batch_id}/cancel", self.cancel_batch),
        )
        for method, path, handler in routes:
            endpoint = "files" if path.startswith("/v1/files") else "batches"
            app.router.add_route(method, path, logged(self._answering(handler), endpoint))

    def _answering(self, handler: Callable[[web.Request, str], Awaitable[web.Response]]) -> Handler:
        """``handler`` with the tenant resolved and every refusal in OpenAI's error shape."""

        async def wrapped(request: web.Request) -> web.StreamResponse:
            headers = {"x-request-id": request[REQUEST_ID_KEY]}
            try:
                response = await handler(request, self.tenant_of(request))
            except GatewayError as err:
                return error_response(err, headers)
            except BatchStoreUnavailable as exc:
                log.warning("batch store unavailable", extra={"error": str(exc)})
                unavailable = ServiceUnavailable("The batch store is unavailable; try again shortly.")
                return error_response(unavailable, headers)
            response.headers.update(headers)
            return response

        return wrapped

    # -- files ----------------------------------------------------------------------------------

    async def upload_file(self, request: web.Request, tenant: str) -> web.Response:
        """``POST /v1/files`` (multipart: ``purpose``, ``file``): the file stored, each line of
        a ``batch`` file checked to be a JSON object (400 naming the first line that is not)."""
        limit = self.settings.max_file_bytes
        if request.content_length is not None and request.content_length > limit + 64 * 1024:
            raise _too_large(limit)
        if not request.content_type.startswith("multipart/"):
            raise BadRequest("Upload the file as multipart/form-data with 'file' and 'purpose'.", param="file")
        reader = await request.multipart()
        purpose: str | None = None
        stored: StoredFile | None = None
        try:
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await part.text()).strip()
                elif part.name == "file" and stored is None:
                    filename = part.filename or "upload.jsonl"
                    stored = await self.files.put(tenant, filename, "batch", _chunks(part), limit, int(self.wall()))
                else:
                    await part.release()
        except FileTooLarge as exc:
            raise _too_large(limit) from exc
        except ValueError as exc:  # a malformed multipart body
            raise BadRequest(f"The multipart body could not be read: {exc}", param="file") from exc
        try:
            if stored is None:
                raise BadRequest("The 'file' field is required.", param="file")
            if purpose not in PURPOSES:
                raise BadRequest(f"The purpose {purpose!r} is not supported; use 'batch'.", param="purpose")
            await self._check_jsonl(stored)
        except GatewayError:
            if stored is not None:
                await self.files.delete(tenant, stored.id)
            raise
        return web.json_response(_file_json(stored))

    async def _check_jsonl(self, stored: StoredFile) -> None:
        data = await self.files.read(stored)
        bad = await asyncio.to_thread(_first_bad_line, data)
        if bad is not None:
            raise BadRequest(
                f"Line {bad} of the file is not a JSON object; a batch file has one JSON request per line.",
                code="invalid_jsonl",
                param="file",
            )
        if not data.strip():
            raise BadRequest("The file is empty.", code="empty_file", param="file")

    async def get_file(self, request: web.Request, tenant: str) -> web.Response:
        return web.json_response(_file_json(await self._file(tenant, request.match_info["file_id"])))

    async def delete_file(self, request: web.Request, tenant: str) -> web.Response:
        file_id = request.match_info["file_id"]
        if not await self.files.delete(tenant, file_id):
            raise _no_file(file_id)
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def file_content(self, request: web.Request, tenant: str) -> web.Response:
        stored = await self._file(tenant, request.match_info["file_id"])
        data = await self.files.read(stored)
        return web.Response(body=data, content_type="application/octet-stream")

    async def list_files(self, request: web.Request, tenant: str) -> web.Response:
        query = request.query
        purpose = query.get("purpose")
        limit = _limit(query.get("limit"), 10_000)
        files = sorted(await self.files.listing(tenant), key=lambda f: (f.created_at, f.id), reverse=True)
        if query.get("order") == "asc":
            files.reverse()
        if purpose:
            files = [f for f in files if f.purpose == purpose]
        after = query.get("after")
        if after is not None:
            ids = [f.id for f in files]
            files = files[ids.index(after) + 1 :] if after in ids else []
        return web.json_response(page([_file_json(f) for f in files[:limit]], len(files) > limit))

    async def _file(self, tenant: str, file_id: str) -> StoredFile:
        stored = await self.files.get(tenant, file_id)
        if stored is None:
            raise _no_file(file_id)
        return stored

    # -- batches --------------------------------------------------------------------------------

    async def create_batch(self, request: web.Request, tenant: str) -> web.Response:
        """``POST /v1/batches``: the input validated at once; the batch is ``in_progress``, or
        ``failed`` with ``errors`` naming the lines at fault."""
        body = await _json_body(request)
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise BadRequest(
                f"The endpoint {endpoint!r} is not supported in a batch; use one of {', '.join(ENDPOINTS)}.",
                param="endpoint",
            )
        window = body.get("completion_window")
        if not isinstance(window, str) or window not in self.settings.completion_windows:
            allowed = ", ".join(repr(w) for w in self.settings.completion_windows)
            raise BadRequest(f"The completion_window must be one of {allowed}.", param="completion_window")
        metadata = _metadata(body.get("metadata"))
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise BadRequest("input_file_id is required.", param="input_file_id")
        stored = await self.files.get(tenant, file_id)
        if stored is None:
            raise _no_file(file_id, "input_file_id")
        if stored.purpose != "batch":
            raise BadRequest(f"The file {file_id} was not uploaded with purpose 'batch'.", param="input_file_id")
        data = await self.files.read(stored)
        checked = await asyncio.to_thread(validate, data, endpoint, self.settings.max_requests)
        now = int(self.wall())
        seconds = window_seconds(window)
        assert seconds is not None  # the settings checked every allowed window
        record = BatchRecord(
            id=new_id("batch_"),
            tenant=tenant,
            endpoint=endpoint,
            input_file_id=file_id,
            completion_window=window,
            created_at=now,
            expires_at=now + seconds,
            metadata=metadata,
            model=checked.model,
        )
        if checked.errors:
            record = record.moved("failed", now, errors=checked.errors)
        else:
            await self.files.keep_for_batch(stored, record.id)
            record = record.moved("in_progress", now, counts=Counts(total=len(checked.items)))
        await self.store.create(record)
        self.metrics.batches_ended.labels("created").inc()
        if record.status == "failed":
            self.metrics.batches_ended.labels("failed").inc()
        if self.runner is not None:
            self.runner.wake()
        return web.json_response(record.to_openai())

    async def get_batch(self, request: web.Request, tenant: str) -> web.Response:
        record = await self._batch(tenant, request.match_info["batch_id"])
        return web.json_response(await self._shown(record))

    async def list_batches(self, request: web.Request, tenant: str) -> web.Response:
        limit = _limit(request.query.get("limit"), _MAX_PAGE)
        records, more = await self.store.listing(tenant, request.query.get("after"), limit)
        return web.json_response(page([await self._shown(r) for r in records], more))

    async def cancel_batch(self, request: web.Request, tenant: str) -> web.Response:
        """``POST /v1/batches/{id}/cancel``: ``cancelling`` at once (no item taken from now
        on), ``cancelled`` once the items under way have ended."""
        record = await self._batch(tenant, request.match_info["batch_id"])
        if record.status in ("validating", "in_progress"):
            moved = record.moved("cancelling", int(self.wall()))
            if await self.store.replace(moved, record.status):
                await self.store.close(record.id)
                record = moved
            else:
                record = await self._batch(tenant, record.id)
        elif record.status in TERMINAL or record.status == "finalizing":
            if record.status != "cancelled":
                raise BadRequest(f"A batch with status {record.status} cannot be cancelled.", code="invalid_status")
        return web.json_response(await self._shown(record))

    async def _shown(self, record: BatchRecord) -> dict[str, Any]:
        """The batch object, with live counts and usage while it runs."""
        if record.status in TERMINAL:
            return record.to_openai()
        return record.to_openai(await self.store.progress(record.id))

    async def _batch(self, tenant: str, batch_id: str) -> BatchRecord:
        record = await self.store.get(tenant, batch_id)
        if record is None:
            raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")
        return record


async def _chunks(part: BodyPartReader) -> AsyncIterator[bytes]:
    while chunk := await part.read_chunk(256 * 1024):
        yield chunk


def _first_bad_line(data: bytes) -> int | None:
    """The number of the first non-blank line that is not a JSON object, if any."""
    for number, offset, length in iter_lines(data):
        try:
            value = orjson.loads(data[offset : offset + length])
        except orjson.JSONDecodeError:
            return number
        if not isinstance(value, dict):
            return number
    return None


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest("The request body is not valid JSON.") from exc
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > _MAX_METADATA:
        raise BadRequest(f"metadata must be an object of at most {_MAX_METADATA} pairs.", param="metadata")
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > _MAX_METADATA_KEY or len(item) > _MAX_METADATA_VALUE:
            raise BadRequest(
                f"metadata keys are strings up to {_MAX_METADATA_KEY} characters, values strings up to "
                f"{_MAX_METADATA_VALUE}.",
                param="metadata",
            )
    return dict(value)


def _limit(value: str | None, most: int) -> int:
    if value is None:
        return min(_DEFAULT_PAGE, most) if most == _MAX_PAGE else most
    with contextlib.suppress(ValueError):
        limit = int(value)
        if 1 <= limit <= most:
            return limit
    raise BadRequest(f"limit must be an integer from 1 to {most}.", param="limit")


def _file_json(stored: StoredFile) -> dict[str, Any]:
    return file_object(stored.id, stored.bytes, stored.created_at, stored.filename, stored.purpose)


def _no_file(file_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param=param)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The file is larger than the {limit}-byte limit.", code="file_too_large", param="file")
