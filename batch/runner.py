"""The runner: takes items from the batch store, sends each through the gateway's request
path, writes its result; and moves batches along (finished, cancelled, expired).

Every pod runs one. ``batch.concurrency`` items at most are under way per pod; a 429 or 503
from the gateway (admission: limits, quotas, a full or shedding queue, no replica) means
"later", not failure: the item goes back to the queue and the pod pauses taking items for the
answer's ``Retry-After`` (at least ``backoff_s``, at most ``max_backoff_s``). Any other answer
is the item's result, as OpenAI records it (status code and body). While items run, their
leases are renewed; a maintenance pass reaps expired leases (a dead pod's items go back to the
queue) and gives each batch its next step (``batch.model.next_step``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp
import orjson

from batch.config import BatchSettings
from batch.files import LocalFileStore
from batch.loopback import Answer
from batch.metrics import BatchMetrics
from batch.model import (
    UNFINISHED,
    BatchRecord,
    Counts,
    Item,
    TransitionError,
    error_line,
    item_body,
    iter_lines,
    next_step,
    output_line,
)
from batch.store import BatchStore, BatchStoreUnavailable, Claim
from batch.usage import ZERO, Usage, usage_of

log = logging.getLogger("fleetgate.batch")

# Statuses that mean "not now" from the gateway's admission, never an item's result.
RETRY_STATUSES = frozenset({429, 503})
# How many batches' item lists a pod keeps parsed (one per batch it takes items of).
_ITEM_CACHE = 16


class Sender(Protocol):
    async def send(self, tenant: str, path: str, body: bytes, request_id: str) -> Answer: ...


class Runner:
    """One pod's share of the batch work (an async context manager: its tasks run inside)."""

    def __init__(
        self,
        settings: BatchSettings,
        store: BatchStore,
        files: LocalFileStore,
        sender: Sender,
        metrics: BatchMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        accepting: Callable[[], bool] = lambda: True,
    ) -> None:
        self.settings = settings
        # False while the pod drains: it takes no new item (the items under way finish), so
        # its own requests do not keep the listener's shutdown waiting.
        self.accepting = accepting
        self.store = store
        self.files = files
        self.sender = sender
        self.metrics = metrics
        self.clock = clock
        self.wall = wall
        # This pod's name on its leases.
        self.token = os.urandom(8).hex()
        self._held: dict[str, Claim] = {}
        self._items: OrderedDict[str, tuple[Item, ...]] = OrderedDict()
        self._records: dict[str, BatchRecord] = {}
        self._paused_until = 0.0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._running: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> Runner:
        self._tasks = [
            asyncio.create_task(self._dispatch(), name="batch-dispatch"),
            asyncio.create_task(self._every(self.settings.lease_s / 3, self._renew), name="batch-renew"),
            asyncio.create_task(self._every(self.settings.poll_s, self.maintain), name="batch-maintain"),
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in (*self._tasks, *self._running):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._running, return_exceptions=True)
        # What this pod held goes back to the queue now, not when its leases lapse.
        for claim in list(self._held.values()):
            with contextlib.suppress(BatchStoreUnavailable):
                await self.store.release(self.token, claim)

    def wake(self) -> None:
        """A batch was created: look for items now rather than at the next poll."""
        self._wake.set()

    # -- taking items ---------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            await self._slots.acquire()
            claim = None
            while claim is None:
                pause = self._paused_until - self.clock()
                if pause > 0:
                    await asyncio.sleep(pause)
                if not self.accepting():
                    await asyncio.sleep(self.settings.poll_s)
                    continue
                try:
                    claim = await self.store.claim(self.token, self.settings.lease_s)
                except BatchStoreUnavailable as exc:
                    log.warning("batch store unavailable; items wait", extra={"error": str(exc)})
                if claim is None:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.settings.poll_s)
            self._held[claim.member] = claim
            task = asyncio.create_task(self._run(claim), name="batch-item")
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, claim: Claim) -> None:
        self.metrics.running.inc()
        try:
            await self._run_item(claim)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The item stays leased; its lease lapses and another pass takes it again.
            log.exception("batch item failed unexpectedly", extra={"batch_id": claim.batch_id, "item": claim.index})
        finally:
            self.metrics.running.dec()
            self._held.pop(claim.member, None)
            self._slots.release()

    async def _run_item(self, claim: Claim) -> None:
        record = await self._record(claim.batch_id)
        items = await self._items_of(claim.batch_id)
        if record is None or items is None or claim.index >= len(items):
            return
        item = items[claim.index]
        line = await self.files.read_batch_input(claim.batch_id, item.offset, item.length)
        body = item_body(line, record.endpoint)
        request_id = f"{claim.batch_id}-{claim.index}"
        try:
            answer = await self.sender.send(record.tenant, record.endpoint, body, request_id)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("batch item could not reach the gateway; retried", extra={"error": repr(exc)})
            await self._hand_back(claim, None)
            return
        if answer.status in RETRY_STATUSES:
            await self._hand_back(claim, answer.retry_after_s)
            return
        ok = 200 <= answer.status < 300
        try:
            parsed: Any = orjson.loads(answer.body)
        except orjson.JSONDecodeError:
            parsed = answer.body.decode("utf-8", "replace")
        result = output_line(item.custom_id, answer.status, answer.request_id, parsed)
        # The batch's usage is its output file's: a failed item's answer adds nothing.
        usage = usage_of(record.endpoint, parsed) if ok else ZERO
        if await self.store.complete(self.token, claim, ok, result, usage):
            self.metrics.items.labels("completed" if ok else "failed").inc()

    async def _hand_back(self, claim: Claim, retry_after_s: float | None) -> None:
        self.metrics.items.labels("retried").inc()
        settings = self.settings
        wait = min(settings.max_backoff_s, max(settings.backoff_s, retry_after_s or 0.0))
        self._paused_until = max(self._paused_until, self.clock() + wait)
        await self.store.release(self.token, claim)

    async def _record(self, batch_id: str) -> BatchRecord | None:
        record = self._records.get(batch_id)
        if record is None:
            record = await self.store.get_any(batch_id)
            if record is not None:
                self._records[batch_id] = record
        return record

    async def _items_of(self, batch_id: str) -> tuple[Item, ...] | None:
        """The batch's items: its input's lines, parsed once per pod."""
        items = self._items.get(batch_id)
        if items is None:
            try:
                data = await self.files.read_batch_input(batch_id, 0, -1)
            except FileNotFoundError:
                return None
            items = await asyncio.to_thread(_parse_items, data)
            self._items[batch_id] = items
            while len(self._items) > _ITEM_CACHE:
                self._items.popitem(last=False)
        return items

    async def _renew(self) -> None:
        await self.store.renew(self.token, list(self._held.values()), self.settings.lease_s)

    async def _every(self, period_s: float, step: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await step()
            except BatchStoreUnavailable as exc:
                log.warning("batch store unavailable", extra={"error": str(exc)})
            except Exception:
                log.exception("batch maintenance failed")

    # -- moving batches along -------------------------------------------------------------------

    async def maintain(self) -> None:
        """Reap expired leases; give every batch under way its next step; refresh the gauges."""
        await self.store.reap()
        statuses: dict[str, int] = {"in_progress": 0, "finalizing": 0, "cancelling": 0}
        for batch_id in await self.store.active():
            record = await self.store.get_any(batch_id)
            if record is None:
                continue
            self._records[batch_id] = record
            statuses[record.status] = statuses.get(record.status, 0) + 1
            progress = await self.store.progress(batch_id)
            step = next_step(record, progress.counts, progress.leased, int(self.wall()))
            if step == "close":
                await self.store.close(batch_id)
            elif step is not None:
                await self._finish(record, step)
        for status, count in statuses.items():
            self.metrics.active.labels(status).set(count)
        self.metrics.queue_depth.set(await self.store.queue_depth())

    async def _finish(self, record: BatchRecord, step: str) -> None:
        """Write the output and error files, then the final status (one pod, under a lock)."""
        if not await self.store.lock(record.id, self.token, max(60.0, self.settings.lease_s)):
            return
        now = int(self.wall())
        try:
            if step == "finalize" and record.status == "in_progress":
                moved = record.moved("finalizing", now)
                if not await self.store.replace(moved, record.status):
                    return
                record = moved
            await self.store.close(record.id)
            output_id, error_id, final, usage = await self._write_files(record, step)
            end = {"finalize": "completed", "expire": "expired", "cancel": "cancelled"}[step]
            # A batch kept before usage was counted shows none (``BatchRecord.from_bytes``).
            kept_usage = usage if record.usage is not None else None
            done = record.moved(
                end,
                int(self.wall()),
                output_file_id=output_id,
                error_file_id=error_id,
                counts=final,
                usage=kept_usage,
            )
        except TransitionError:
            return
        if await self.store.replace(done, record.status):
            self.metrics.batches_ended.labels(end).inc()
            await self.store.forget(record.id)
            await self.files.drop_batch_input(record.id)
            self._records.pop(record.id, None)
            self._items.pop(record.id, None)
            log.info("batch ended", extra={"batch_id": record.id, "status": end, **final.to_json()})

    async def _write_files(self, record: BatchRecord, step: str) -> tuple[str | None, str | None, Counts, Usage]:
        """The output and error files' ids, and the final counts and usage: those of the
        results the files hold (the store reads results and usage at one instant, so an item
        answered after this read is in neither)."""
        results, usage = await self.store.results(record.id)
        items = await self._items_of(record.id) or ()
        outputs: list[bytes] = []
        errors: list[bytes] = []
        unfinished = UNFINISHED.get(step)
        for index, item in enumerate(items):
            result = results.get(index)
            if result is not None:
                (outputs if result[0] else errors).append(result[1])
            elif unfinished is not None:
                errors.append(error_line(item.custom_id, *unfinished))
        completed = len(outputs)
        final = Counts(len(items), completed, len(errors))
        now = int(self.wall())
        output_id = error_id = None
        if outputs:
            data = b"\n".join(outputs) + b"\n"
            stored = await self.files.put_bytes(record.tenant, f"{record.id}_output.jsonl", "batch_output", data, now)
            output_id = stored.id
        if errors:
            data = b"\n".join(errors) + b"\n"
            stored = await self.files.put_bytes(record.tenant, f"{record.id}_error.jsonl", "batch_output", data, now)
            error_id = stored.id
        return output_id, error_id, final, usage


def _parse_items(data: bytes) -> tuple[Item, ...]:
    """A validated input's items (validation already refused anything else)."""
    return tuple(
        Item(offset, length, orjson.loads(data[offset : offset + length])["custom_id"])
        for _, offset, length in iter_lines(data)
    )
