"""``vlmreg serve CONFIG``: serve the config's model over an OpenAI-compatible HTTP API until Ctrl-C (or SIGTERM)."""

from __future__ import annotations

import argparse

import attrs

from vlmreg.cli.config_cmds import add_set_option, load_resolved
from vlmreg.sdk.errors import VlmregError


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (argparse reports anything else as a usage error naming --port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0..65535; 0 picks a free one)")
    return port


def positive_int(text: str) -> int:
    """A whole number of at least 1 (argparse reports anything else as a usage error naming the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive (at least 1)")
    return value


def host_port(text: str) -> str:
    """``HOST:PORT`` with a port of 1..65535 (checked before the model loads, not after)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (a port of 1..65535)")
    return text


def positive_seconds(text: str) -> float:
    """A finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of seconds")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a run config's model over an OpenAI-compatible HTTP API")
    p.add_argument("config", help="a run config (TOML)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=8000, help="port to listen on; 0 picks a free one (default: 8000)"
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a file (mode 0600) holding the API key every request but GET /health must send as 'Authorization: Bearer "
        "KEY' (default: the environment variable VLMREG_API_KEY; neither: no key is checked, and only a loopback "
        "--host is allowed)",
    )
    p.add_argument(
        "--insecure-no-api-key",
        action="store_true",
        help="listen on a non-loopback --host without an API key: anyone who reaches the port can use the server",
    )
    p.add_argument(
        "--weights-dir",
        metavar="DIR",
        help='the directory the trainer\'s filesystem transport writes to: POST /v1/weights takes a "path" only under '
        "it "
        "(default: none, paths are refused)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=1024,
        metavar="N",
        help="connections handled at once; past it a 503 (default 1024)",
    )
    p.add_argument(
        "--max-queued",
        type=positive_int,
        default=4096,
        metavar="N",
        help="requests waiting for the model; past it a 503 (default 4096)",
    )
    p.add_argument(
        "--read-timeout",
        type=positive_seconds,
        default=60.0,
        metavar="S",
        help="seconds every read and write of a client's socket may take before it is dropped (default 60)",
    )
    p.add_argument(
        "--weights-from",
        metavar="HOST:PORT",
        type=host_port,
        help="join the trainer's weight process group (its sender's store) to take syncs",
    )
    p.add_argument("--weights-rank", type=positive_int, default=1, help="this server's rank in that group (default 1)")
    p.add_argument(
        "--weights-backend", choices=("gloo", "nccl"), default="gloo", help="the group's backend (default gloo)"
    )
    p.add_argument(
        "--weights-timeout", type=positive_seconds, default=120.0, help="seconds to wait for the trainer (default 120)"
    )
    p.add_argument(
        "--weights-transport",
        metavar="NAME",
        help="take syncs through the receiver of this registered transport (a plugin's; `vlmreg plugins` lists them)",
    )
    p.add_argument(
        "--weights-option",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="an option for that transport's receiver (repeatable)",
    )
    add_set_option(p)
    p.set_defaults(run=run_serve)


def _stop_on_sigterm() -> None:
    """SIGTERM (how a parent process stops the server) ends it as Ctrl-C does: queued requests get a 503."""
    # deferred: `vlmreg` starts without it (signal)
    import signal  # noqa: PLC0415

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def run_serve(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import escape, stderr, stdout  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (hashlib, hmac, vlmreg.http)
    from vlmreg.http.auth import is_loopback, resolve_api_key  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, torch)
    from vlmreg.loading.load import load  # noqa: PLC0415

    # deferred: start-up cost (loads cattrs, concurrent, http, safetensors, torch, urllib.request)
    from vlmreg.serve import Server  # noqa: PLC0415

    rc = load_resolved(args.config, args.sets)
    if rc.config.model.lora is not None and rc.config.broadcast.lora_sync == "merged":
        # the server holds plain weights; a trainer sends LoRA merged into them (with "adapters" it keeps peft's LoRA
        # layers and takes the adapters as they are: `vlmreg.broadcast.adapters`)
        rc = attrs.evolve(rc, config=attrs.evolve(rc.config, model=attrs.evolve(rc.config.model, lora=None)))
    api_key = resolve_api_key(args.api_key_file)  # before anything binds or loads: a bad key file is a clear error
    if api_key is None and not is_loopback(args.host):
        if not args.insecure_no_api_key:
            raise VlmregError(
                f"--host {args.host!r} is reachable from other machines, and no API key is set: anyone who reaches the "
                "port could use the server. Pass --api-key-file PATH (or set VLMREG_API_KEY), or --insecure-no-api-key "
                "to accept that risk"
            )
        stderr.print(
            f"warning: listening on {escape(args.host)} without an API key (--insecure-no-api-key)", soft_wrap=True
        )
    _stop_on_sigterm()
    server = Server(
        args.host,
        args.port,
        log=lambda line: stderr.print(escape(line.rstrip()), soft_wrap=True),
        api_key=api_key,
        allow_weights=bool(args.weights_from or args.weights_transport),
        weights_dir=args.weights_dir,
        max_connections=args.max_connections,
        max_queued=args.max_queued,
        read_timeout_s=args.read_timeout,
        insecure_no_api_key=args.insecure_no_api_key,
    )
    try:
        server.start()
        stdout.print(
            f"loading {escape(rc.config.model.name or 'a random ' + rc.family.name + ' model')} (GET /health answers "
            "503 until ready)",
            soft_wrap=True,
        )
        server.attach(load(rc))
        assert server.limits is not None
        if args.weights_from:
            host, _, port = args.weights_from.rpartition(":")
            if not host or not port.isdigit():
                raise VlmregError(f"--weights-from {args.weights_from!r}: expected HOST:PORT")
            stdout.print(f"joining the weight process group at {escape(args.weights_from)}", soft_wrap=True)
            server.receive_weights_from(
                host, int(port), rank=args.weights_rank, backend=args.weights_backend, timeout_s=args.weights_timeout
            )
        if args.weights_transport:
            options = dict(option.partition("=")[::2] for option in args.weights_option)
            if any("=" not in option for option in args.weights_option):
                raise VlmregError(f"--weights-option takes KEY=VALUE (got {args.weights_option!r})")
            stdout.print(f"taking weights through transport {escape(args.weights_transport)}", soft_wrap=True)
            server.receive_weights_with(args.weights_transport, options, timeout_s=args.weights_timeout)
        auth = "an API key is required" if api_key is not None else "no API key is checked"
        limits = (
            f"at most {args.max_connections} connections, {args.max_queued} queued, {args.read_timeout:g} s read "
            "timeout"
        )
        stdout.print(
            f"serving {escape(server.limits.model_name)} at {server.url}/v1; {auth}; {limits} (Ctrl-C stops)",
            soft_wrap=True,
        )
        server.wait()
    except KeyboardInterrupt:
        stdout.print("stopped")
    finally:
        server.close()
    return 0
