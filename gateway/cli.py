"""``fleetgate``: serve the gateway, run a simulated replica, hash an API key."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import resource
import signal
import sys
from pathlib import Path

from gateway.settings import ConfigError, Settings, hash_key, load_settings, settings_digest

log = logging.getLogger("fleetgate")


async def serve(settings: Settings, *, log_dir: Path, config_path: Path | None = None) -> None:
    """Run until SIGTERM/SIGINT; then stop accepting, let in-flight requests finish, stop replicas."""
    from aiohttp import web

    from gateway.app import Gateway, create_app

    _raise_file_limit()
    gateway = Gateway(settings, log_dir=log_dir, config_path=config_path)
    app = create_app(gateway)
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # closes the upstream connection and so aborts the generation on the replica.
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=settings.server.shutdown_grace_s
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.server.host, settings.server.port, backlog=2048, reuse_address=True)
    await site.start()
    log.info(
        "listening",
        extra={"address": f"http://{settings.server.host}:{settings.server.port}", **settings_digest(settings)},
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("shutting down: draining in-flight requests")
        gateway.ready = False
    finally:
        await runner.cleanup()
    log.info("stopped")


def _raise_file_limit() -> None:
    """Each stream holds two sockets (client and replica); 1,024 descriptors is too few."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from gateway.logs import configure_logging

    try:
        settings = load_settings(args.config)
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


def _cmd_check_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"fleetgate: {exc}", file=sys.stderr)
        return 2
    print(f"{args.config}: ok ({settings_digest(settings)})")
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from replicas import simulator

    simulator.run(args)
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

    from replicas.simulator import add_arguments

    p = sub.add_parser("sim", help="run one simulated vLLM-compatible replica")
    add_arguments(p)
    p.set_defaults(func=_cmd_sim)

    from bench.cli import add_arguments as add_bench_arguments

    p = sub.add_parser("bench", help="capacity planner: how many users fit the SLOs")
    add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    from bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
