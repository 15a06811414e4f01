"""Stopping a background task, even one that lost its cancellation.

``task.cancel(); await task`` can wait forever. A cancellation that arrives while the task
is inside a timeout block (``asyncio.timeout``, or a client library's read timeout) just as
that timeout fires can be taken for the timeout: the task sees a ``TimeoutError``, a loop
that retries on timeouts carries on, and nothing cancels it again. Seen with the semantic
cache's log reader (a blocking ``XREAD`` under redis-py's read timeout) on a loaded
machine: its gateway's shutdown hung.

``stop`` cancels again at every ``every_s`` until the task ends, and gives up after
``timeout_s``: a caller's shutdown is bounded whatever the task does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def stop(task: asyncio.Task[Any] | None, *, timeout_s: float = 5.0, every_s: float = 0.1) -> bool:
    """Cancel ``task`` until it ends, at most ``timeout_s``; True if it ended.

    The task's own result or exception is not raised here: it is a background task being
    stopped. A cancellation of the caller propagates (the task is left cancelled).
    """
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.warning("background task did not stop", extra={"task": task.get_name(), "timeout_s": timeout_s})
            return False
        await asyncio.wait({task}, timeout=min(every_s, left))
    if not task.cancelled():
        task.exception()  # retrieved: a background task's failure is not re-raised here
    return True
