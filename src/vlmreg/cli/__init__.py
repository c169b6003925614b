"""The ``vlmreg`` command line.

Each subcommand lives in its own module with ``register(subparsers)``; the heavy imports (torch,
transformers) happen inside the commands that need them, so ``vlmreg families`` starts fast.
Every `VlmregError` ends the command with a one-line message and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from vlmreg import __version__
from vlmreg.cli import bench, check, config_cmds, data, env, families, new_family, plugins, serve, train
from vlmreg.sdk.errors import VlmregError

DEBUG_ENV = "VLMREG_DEBUG"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlmreg", description="Reinforcement-learning training of vision-language models, by model family."
    )
    parser.add_argument("--version", action="version", version=f"vlmreg {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (families, plugins, check, new_family, config_cmds, data, train, serve, env, bench):
        module.register(sub)
    return parser


#: Seconds after which (and every as many seconds after) the CLI prints every thread's Python stack to stderr.
STACKS_ENV = "VLMREG_STACKS_EVERY"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the words as typed (`vlmreg train` prints its resume command)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import error  # noqa: PLC0415

    if os.environ.get(STACKS_ENV):  # a run that seems stuck: every thread's stack on stderr every N seconds
        # deferred: `vlmreg` starts without it (faulthandler)
        import faulthandler  # noqa: PLC0415

        faulthandler.dump_traceback_later(float(os.environ[STACKS_ENV]), repeat=True)

    try:
        return _exit_if_stuck(int(args.run(args) or 0))
    except VlmregError as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        error(str(exc))
        return 1
    except KeyboardInterrupt:
        error("interrupted")
        return 130
    except BrokenPipeError:  # `vlmreg families | head`
        sys.stderr.close()
        return 0
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        error(f"unexpected {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 to see the traceback, and please report it)")
        return 1


def _exit_if_stuck(code: int) -> int:
    """When a weight-sync communicator could not be released (an NCCL peer that never let go), exit now with
    ``code``: everything is written, and native teardown at interpreter exit would wait on the blocked release."""
    group = sys.modules.get("vlmreg.broadcast.group")
    if group is None or not group.teardown_pending():
        return code
    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import error  # noqa: PLC0415

    error("an NCCL communicator of the weight sync did not release within 15 s; exiting without waiting for it")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
