"""``fleetgate``: serve the gateway, run a simulated replica, hash an API key."""

from __future__ import annotations

import argparse
import asyncio
import gc
import getpass
import logging
import resource
import signal
import sys
from pathlib import Path

from gateway.settings import ConfigError, Settings, hash_key, load_settings, settings_digest

log = logging.getLogger("fleetgate")


async def serve(settings: Settings, *, log_dir: Path, config_path: Path | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain (docs/operations.md, "Stopping"):

    1. readiness turns false at once (``/readyz`` 503) and every response closes its connection;
    2. the listeners keep accepting for ``server.drain_delay_s``, while the pod leaves the
       Service's endpoints;
    3. they close; in-flight requests and streams get ``server.shutdown_grace_s`` to finish;
    4. managed replicas stop; the process exits 0.
    """
    from aiohttp import web

    from gateway.app import Gateway, create_admin_app, create_app
    from gateway.server import GatewayRunner

    _raise_file_limit()
    server = settings.server
    gateway = Gateway(settings, log_dir=log_dir, config_path=config_path)
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # closes the upstream connection and so aborts the generation on the replica.
    runner = GatewayRunner(
        create_app(gateway),
        header_timeout_s=server.header_timeout_s,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=server.shutdown_grace_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, server.host, server.port, backlog=2048, reuse_address=True)
    await site.start()
    admin_runner: web.AppRunner | None = None
    admin_address = None
    if server.admin_port is not None:
        admin_runner = GatewayRunner(
            create_admin_app(gateway), header_timeout_s=server.header_timeout_s, access_log=None, shutdown_timeout=1.0
        )
        await admin_runner.setup()
        admin_host = server.admin_host or server.host
        await web.TCPSite(admin_runner, admin_host, server.admin_port, reuse_address=True).start()
        admin_address = f"http://{admin_host}:{server.admin_port}"
    _freeze_start_up()
    log.info(
        "listening",
        extra={
            "address": f"http://{server.host}:{server.port}",
            "admin_address": admin_address,
            **settings_digest(settings),
        },
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        gateway.draining = True
        log.info(
            "draining: not ready, still accepting",
            extra={"drain_delay_s": server.drain_delay_s, "in_flight": gateway.metrics.requests_in_flight},
        )
        await asyncio.sleep(server.drain_delay_s)
        log.info(
            "listener closed: finishing in-flight requests",
            extra={"shutdown_grace_s": server.shutdown_grace_s, "in_flight": gateway.metrics.requests_in_flight},
        )
    finally:
        await runner.cleanup()
        if admin_runner is not None:
            await admin_runner.cleanup()  # last: /metrics answers while the API drains
    log.info("stopped")


def _freeze_start_up() -> None:
    """Take what start-up allocated (modules, settings, the app, pools) out of the collector's
    reach: it lives as long as the process, and the collector's full passes walked all of it,
    every few thousand requests, on the event loop (docs/operations.md, "Memory")."""
    gc.collect()
    gc.freeze()


def _raise_file_limit() -> None:
    """Each stream holds two sockets (client and replica); 1,024 descriptors is too few."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from gateway.logs import configure_logging

    try:
        settings = _load_installable(args.config)
    except ConfigError as exc:
        print(f"fleetgate: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_level)
    config_path = Path(args.config) if args.config else None
    try:
        uvloop.run(serve(settings, log_dir=Path(args.log_dir), config_path=config_path))
    except ConfigError as exc:
        print(f"fleetgate: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_hash_key(args: argparse.Namespace) -> int:
    key = args.key if args.key is not None else getpass.getpass("API key: ")
    if not key:
        print("fleetgate: empty key", file=sys.stderr)
        return 2
    print(f"sha256:{hash_key(key)}")
    return 0


def _load_installable(path: str | None) -> Settings:
    """The settings, refused (``ConfigError``) when they need an extra that is not installed."""
    from gateway.extras import missing_extras

    settings = load_settings(path)
    problems = missing_extras(settings)
    if problems:
        raise ConfigError(f"{path or 'the configuration'}: " + "\n  ".join(problems))
    return settings


def _cmd_check_config(args: argparse.Namespace) -> int:
    try:
        settings = _load_installable(args.config)
    except ConfigError as exc:
        print(f"fleetgate: {exc}", file=sys.stderr)
        return 2
    print(f"{args.config}: ok ({settings_digest(settings)})")
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from sim import server

    server.run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetgate", description="An AI gateway for self-hosted vLLM fleets.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", "-c", default=None, help="YAML config (default: built-in laptop defaults)")
    p.add_argument("--log-dir", default="logs", help="where managed replicas write their logs")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("hash-key", help="print the sha256: form of an API key for the config")
    p.add_argument("key", nargs="?", help="the key (prompted for when omitted, so it stays out of shell history)")
    p.set_defaults(func=_cmd_hash_key)

    p = sub.add_parser("check-config", help="validate a config file and exit")
    p.add_argument("config")
    p.set_defaults(func=_cmd_check_config)

    from sim.server import add_arguments

    p = sub.add_parser("sim", help="run one simulated vLLM-compatible replica")
    add_arguments(p)
    p.set_defaults(func=_cmd_sim)

    from capacity.cli import add_arguments as add_bench_arguments

    p = sub.add_parser("bench", help="capacity planner: how many users fit the SLOs")
    add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    from capacity.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
