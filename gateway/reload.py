"""Apply edits of the config file without a restart (tenants, keys, limits, cache settings).

The file is polled rather than watched through inotify because Kubernetes updates a
mounted ConfigMap by swapping the ``..data`` symlink of its directory atomically: the file
path never changes, only what it resolves to. Polling ``os.stat`` (which follows symlinks)
sees both that and an in-place edit, costs one syscall per interval, and needs no library.
SIGHUP asks for a reload at once.

A file that fails to parse or validate is refused whole: the last good configuration
stays, the error is logged with the key path, and ``fleetgate_config_reloads_total``
counts it. Tenants (their keys, limits and cache settings) and admin keys apply to the
next request; requests in flight keep the tenant they started with. Other sections
(models, server, upstream...) need a restart, which the log says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from gateway.settings import ConfigError, Settings, load_settings

log = logging.getLogger("fleetgate.reload")

# How often the file is checked: edits apply within two intervals at worst.
POLL_INTERVAL_S = 0.5
# Sections that are applied live; a change anywhere else is reported as needing a restart.
LIVE_SECTIONS = frozenset({"tenants", "admin_api_keys"})

Fingerprint = tuple[int, int, int, int] | None
Apply = Callable[[Settings], None]
Counter = Callable[[str], None]


def fingerprint(path: Path) -> Fingerprint:
    """What identifies the file's current content cheaply (None: unreadable right now)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)


def restart_needed(old: Settings, new: Settings) -> list[str]:
    """Top-level sections that changed but only take effect after a restart."""
    before, after = old.model_dump(), new.model_dump()
    return sorted(k for k in after if k not in LIVE_SECTIONS and before.get(k) != after[k])


class ConfigWatcher:
    """Polls one config file and hands every valid new version to ``apply``."""

    def __init__(
        self, path: Path, current: Settings, apply: Apply, count: Counter, *, interval_s: float = POLL_INTERVAL_S
    ) -> None:
        self.path = path
        self.current = current
        self._apply = apply
        self._count = count
        self._interval = interval_s
        self._seen = fingerprint(path)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def reload_now(self) -> None:
        """Check the file at once (SIGHUP)."""
        self._seen = None
        self._wake.set()

    def check(self) -> bool:
        """Reload if the file changed; True when a new configuration was applied."""
        seen = fingerprint(self.path)
        if seen is None or seen == self._seen:
            return False
        self._seen = seen
        try:
            new = load_settings(self.path)
            later = restart_needed(self.current, new)
            self._apply(new)  # builds everything before swapping: all or nothing
        except ConfigError as exc:
            log.error("config reload refused; keeping the last good configuration", extra={"error": str(exc)})
            self._count("error")
            return False
        if later:
            log.warning("config sections changed that apply only after a restart", extra={"sections": later})
        self.current = new
        self._count("ok")
        log.info("config reloaded", extra={"tenants": [t.id for t in new.tenants]})
        return True

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval):
                    await self._wake.wait()
            self._wake.clear()
            self.check()

    async def __aenter__(self) -> ConfigWatcher:
        self._task = asyncio.create_task(self.run(), name="config-watcher")
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_now)
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
