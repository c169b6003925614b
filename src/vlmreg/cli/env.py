"""``vlmreg env serve NAME``: serve a registered environment over the remote-environment protocol; ``vlmreg env list``.

The protocol and its hardening are described in `vlmreg.envs.server` and docs/environments.md. The API key comes
from ``--api-key-file`` (mode 0600) or ``VLMREG_ENV_API_KEY``, never the command line; without one only a loopback
``--host`` is allowed (unless ``--insecure-no-api-key``).
"""

from __future__ import annotations

import argparse
import os
import sys

from vlmreg.cli.serve import _stop_on_sigterm, port_number, positive_int, positive_seconds
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_environment_registry

API_KEY_ENV = "VLMREG_ENV_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="serve a registered environment over HTTP; list the registered environments")
    env_sub = p.add_subparsers(dest="env_command", metavar="SUBCOMMAND", required=True)
    serve = env_sub.add_parser(
        "serve", help="serve a registered environment over the remote-environment protocol (HTTP)"
    )
    serve.add_argument("name", help="a registered environment (`vlmreg env list` shows them)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument(
        "--port", type=port_number, default=8100, help="port to listen on; 0 picks a free one (default: 8100)"
    )
    serve.add_argument(
        "--api-key-file",
        metavar="PATH",
        help=f"a file (mode 0600) holding the API key (default: the environment variable {API_KEY_ENV}; neither: "
        "no key is checked, and only a loopback --host is allowed)",
    )
    serve.add_argument(
        "--insecure-no-api-key", action="store_true", help="listen on a non-loopback --host without an API key"
    )
    serve.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="NAME=WEIGHT",
        help="a reward function and its weight (repeatable; default: the environment's own, if it names one)",
    )
    serve.add_argument(
        "--max-sessions",
        type=positive_int,
        default=1024,
        metavar="N",
        help="live episodes at most; past it a 503 (default 1024)",
    )
    serve.add_argument(
        "--session-ttl",
        type=positive_seconds,
        default=600.0,
        metavar="S",
        help="an idle episode is dropped after S seconds (default 600)",
    )
    serve.add_argument(
        "--call-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds an environment call may take (default 60)",
    )
    serve.add_argument(
        "--read-timeout",
        type=positive_seconds,
        default=30.0,
        metavar="S",
        help="seconds every socket read and write may take, and a request's line and headers together (its body: "
        "that plus its length at 256 KiB/s) (default 30)",
    )
    serve.add_argument(
        "--max-connections",
        type=positive_int,
        default=256,
        metavar="N",
        help="connections open at once; past it a 503 (default 256)",
    )
    serve.set_defaults(run=run_serve)
    listing = env_sub.add_parser(
        "list", help="list the registered environments and the distributions that registered them"
    )
    listing.add_argument("--json", action="store_true", help="print JSON for machines")
    listing.set_defaults(run=run_list)


def _api_key(path: str | None) -> str | None:
    # deferred: `vlmreg` starts without it (hashlib, hmac, vlmreg.http)
    from vlmreg.http.auth import check_key, read_api_key_file  # noqa: PLC0415

    if path is not None:
        return read_api_key_file(path)
    value = os.environ.get(API_KEY_ENV)
    return None if value is None else check_key(value, f"the environment variable {API_KEY_ENV}")


def _weights(items: list[str], default: object) -> dict[str, float] | None:
    """``--reward`` weights, else the environment's own; ``None`` when neither (a game that scores itself)."""

    if not items:
        return dict(default) if default else None  # type: ignore[call-overload]
    weights = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            weights[key.strip()] = float(value) if sep else 1.0
        except ValueError:
            raise VlmregError(f"--reward {item!r}: expected NAME=WEIGHT with a number") from None
    return weights


def run_serve(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stderr, stdout  # noqa: PLC0415

    # deferred: start-up cost (loads http, socketserver, ssl)
    from vlmreg.envs.server import EnvServer  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (base64, io, vlmreg.envs, ...)
    from vlmreg.envs.wire import PROTOCOL, PROTOCOL_VERSION  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (hashlib, hmac, vlmreg.http)
    from vlmreg.http.auth import is_loopback  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (functools, logging, string, ...)
    from vlmreg.rewards import combine  # noqa: PLC0415

    spec = get_environment_registry().get(args.name)
    weights = _weights(args.reward, spec.reward)
    reward = combine(weights) if weights else None  # None: the environment scores answers itself (a game's reward)
    api_key = _api_key(args.api_key_file)
    if api_key is None and not is_loopback(args.host):
        if not args.insecure_no_api_key:
            raise VlmregError(
                f"--host {args.host!r} is reachable from other machines, and no API key is set: anyone who reaches the "
                f"port could play (and load) the environment. Pass --api-key-file PATH (or set {API_KEY_ENV}), or "
                "--insecure-no-api-key"
            )
        stderr.print(
            f"warning: listening on {escape(args.host)} without an API key (--insecure-no-api-key)", soft_wrap=True
        )
    _stop_on_sigterm()
    server = EnvServer(  # a port it cannot listen on is a VlmregError naming it
        spec,
        reward,
        args.host,
        args.port,
        api_key=api_key,
        max_sessions=args.max_sessions,
        session_ttl_s=args.session_ttl,
        call_timeout_s=args.call_timeout,
        read_timeout_s=args.read_timeout,
        max_connections=args.max_connections,
        insecure_no_api_key=args.insecure_no_api_key,
        log=lambda line: stderr.print(escape(line.rstrip()), soft_wrap=True),
    )
    try:
        server.start()
        auth = "an API key is required" if api_key is not None else "no API key is checked"
        stdout.print(
            f"serving environment {escape(spec.name)} at {server.url} (protocol {PROTOCOL} {PROTOCOL_VERSION}); "
            f"{auth} (Ctrl-C stops)",
            soft_wrap=True,
        )
        sys.stdout.flush()
        server.wait()
    except KeyboardInterrupt:
        stdout.print("stopped")
    finally:
        server.close()
    return 0


def run_list(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, print_json, stdout  # noqa: PLC0415

    registry = get_environment_registry()
    rows = [
        {
            "name": s.name,
            "description": s.description,
            "reward": dict(s.reward or {}),
            "plugin": registry.plugin_of(s.name).name,
        }
        for s in registry
    ]
    if args.json:
        print_json(rows)
        return 0
    for row in rows:
        stdout.print(f"{escape(row['name'])} ({escape(row['plugin'])}): {escape(row['description'])}", soft_wrap=True)
    return 0
