"""The ``tiercheck`` command line: list, inspect, verify, export, trim and remove checkpoints.

Subcommands (``tiercheck <command> --help`` for each)::

    tiercheck ls      [URL]            jobs and versions: kind, base, ranks, committed, size
    tiercheck inspect URL              per blob: encoding, stages, base, checksum, sizes, ratio
    tiercheck verify  URL              read and check every blob and record; exit 1 on a problem
    tiercheck export  URL OUT          a version as OUT.pt (torch.save) and OUT.safetensors
                                       (--abandoned TAG: from a set the run went back from)
    tiercheck gc      URL --keep N     apply retention (--dry-run to only list what would go;
                                       --purge-quarantine to remove set-aside blobs too;
                                       --abandoned to remove every abandoned set)
    tiercheck rm-job  URL --job J      delete a whole job: lists it, asks (or --yes), refuses
                                       while a writer holds the job's lock in a node root
    tiercheck repair-job URL --job J   set a damaged job record aside (no version touched); the
                                       next opening writes it anew

A location (``URL``) is a persistent URL or folder -- the checkpointer's ``persistent=`` URL, or
it plus the job id -- or a node root (``/dev/shm/tiercheck/<job>/<node>``, or ``--local-root
PATH``); see :func:`tiercheck.catalog.find_locations`. Every command takes ``--json`` (one JSON
document on stdout) and ``--no-progress``; progress bars go to stderr, only on a terminal and
only where ``tqdm`` is installed.

Exit codes: ``0`` success (``verify``: no problem, warnings allowed), ``1`` problems found or the
operation failed, ``2`` usage errors (bad arguments, a location or job that does not exist, an
unknown protocol), ``130`` interrupted, ``141`` the output pipe was closed (``| head``; nothing
is printed, as for a coreutils tool killed by SIGPIPE). Errors are one line on stderr, never a
traceback (set ``TIERCHECK_DEBUG=1`` to see one).

Commands are registered in one table, :data:`COMMANDS`, each implemented in a module of its own
(:mod:`~tiercheck.cli.show` for ``ls`` and ``inspect``, :mod:`~tiercheck.cli.verify`,
:mod:`~tiercheck.cli.export`, :mod:`~tiercheck.cli.gc`, :mod:`~tiercheck.cli.remove` for
``rm-job``, :mod:`~tiercheck.cli.repair` for ``repair-job``) on top of
:mod:`tiercheck.catalog`, with
:mod:`~tiercheck.cli.base` (exit codes, console, formatting) and :mod:`~tiercheck.cli.args`
(shared arguments, locations); a command implemented elsewhere is one :class:`ExternalCommand`
entry (see the ``demo`` hook at the end of the table).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn, cast

import tiercheck
from tiercheck.catalog import LocationError
from tiercheck.cli.args import output_args
from tiercheck.cli.base import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_USAGE,
    Console,
    UsageError,
)
from tiercheck.cli.export import configure_export, run_export
from tiercheck.cli.gc import configure_gc, run_gc
from tiercheck.cli.pipe import EXIT_PIPE, GuardedStream, OutputClosed, end_quietly
from tiercheck.cli.remove import configure_rm_job, run_rm_job
from tiercheck.cli.repair import configure_repair_job, run_repair_job
from tiercheck.cli.show import configure_inspect, configure_ls, run_inspect, run_ls
from tiercheck.cli.verify import configure_verify, run_verify
from tiercheck.errors import ConfigError, JobLocked, TiercheckError

__all__ = [
    "COMMANDS",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PIPE",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "Command",
    "Console",
    "ExternalCommand",
    "UsageError",
    "build_parser",
    "main",
]

Runner = Callable[[argparse.Namespace, Console], Coroutine[Any, Any, int]]


@dataclass(frozen=True)
class Command:
    """A subcommand implemented here: its arguments and its (async) body."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Runner


@dataclass(frozen=True)
class ExternalCommand:
    """A subcommand implemented in another module, imported only when it runs.

    ``target`` is ``"module:function"``; the function takes the arguments after the
    subcommand's name (a list of strings) and returns an exit code (``None`` means 0). It
    parses its own arguments (``--help`` included).
    """

    name: str
    help: str
    target: str

    def load(self) -> Callable[[list[str]], int | None]:
        """Import the function."""
        module, _, attr = self.target.partition(":")
        fn: Callable[[list[str]], int | None] = getattr(importlib.import_module(module), attr)
        return fn


COMMANDS: list[Command | ExternalCommand] = [
    Command("ls", "list jobs and versions", configure_ls, run_ls),
    Command(
        "inspect",
        "show blobs: encoding, sizes, ratios, checksums",
        configure_inspect,
        run_inspect,
    ),
    Command(
        "verify",
        "check every blob and record (exit 1 on a problem)",
        configure_verify,
        run_verify,
    ),
    Command(
        "export",
        "write a version as torch.save and safetensors files",
        configure_export,
        run_export,
    ),
    Command("gc", "apply retention: keep the newest N committed versions", configure_gc, run_gc),
    Command(
        "rm-job",
        "delete a whole job (lists it first; asks, or --yes)",
        configure_rm_job,
        run_rm_job,
    ),
    Command(
        "repair-job",
        "set a damaged job record (JOB) aside so the job opens again; no version is touched",
        configure_repair_job,
        run_repair_job,
    ),
]

# --- hook: `tiercheck demo` ------------------------------------------------------------------
# The demo lives in tiercheck/demo/ (`main(argv: list[str]) -> int | None`). It registers
# here as soon as that module exists; find_spec looks for it without importing it, so the other
# commands never pay for the demo's imports.
if importlib.util.find_spec("tiercheck.demo") is not None:
    COMMANDS.append(
        ExternalCommand(
            "demo", "train, kill and restore: the end-to-end showcase", "tiercheck.demo:main"
        )
    )

# `tiercheck chaos`: the seeded chaos soak (tiercheck/testing/chaos/), imported only when it runs;
# it needs the test and s3 extras (moto, boto3, s3fs).
COMMANDS.append(
    ExternalCommand(
        "chaos",
        "a seeded chaos soak: a real multi-process job, faults, an oracle (test extras)",
        "tiercheck.testing.chaos:main",
    )
)


class _BadArguments(UsageError):
    """What argparse found wrong with the arguments, and the parser (or subparser) that did."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises its errors instead of printing them and exiting, so that
    :func:`main` can answer them in JSON where ``--json`` was asked for. Subcommands' parsers
    are of the same class (argparse gives subparsers their parent's class)."""

    def error(self, message: str) -> NoReturn:
        """Raise the error (argparse calls this for every bad argument)."""
        raise _BadArguments(self, message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every :class:`Command` in :data:`COMMANDS`."""
    parser = _Parser(
        prog="tiercheck",
        description="List, inspect, verify, export, trim and remove tiercheck checkpoints.",
        epilog="Exit codes: 0 ok, 1 problems found or the operation failed, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"tiercheck {tiercheck.__version__}")
    output_args(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        if isinstance(cmd, ExternalCommand):
            # Listed for --help only: main() hands its arguments over before parsing.
            sub.add_parser(cmd.name, help=cmd.help, add_help=False)
            continue
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        output_args(p, default=argparse.SUPPRESS)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _error(console: Console, exc: BaseException, code: int) -> int:
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if console.json_mode:
        console.json({"error": {"type": type(exc).__name__, "message": message, "exit_code": code}})
    print(f"tiercheck: error: {message}", file=console.err)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); return the exit code.

    When the reader of the output goes away (``tiercheck ls | head``) the command ends at
    once, with no message, and returns 141, as a coreutils tool killed by SIGPIPE reports
    (see :mod:`tiercheck.cli.pipe`).
    """
    try:
        code = _main(argv)
        # The interpreter's own flush at exit is outside any handler: flush here.
        GuardedStream(sys.stdout).flush()
        GuardedStream(sys.stderr).flush()
    except OutputClosed as exc:
        return end_quietly(exc.stream)
    return code


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    for cmd in COMMANDS:
        if isinstance(cmd, ExternalCommand) and args_list[:1] == [cmd.name]:
            return cmd.load()(args_list[1:]) or EXIT_OK

    parser = build_parser()
    # Known before parsing, so that arguments argparse refuses are answered in JSON too.
    options = args_list[: args_list.index("--")] if "--" in args_list else args_list
    json_mode = "--json" in options
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse's own exit: --help or --version (0)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except _BadArguments as exc:
        if json_mode:
            return _error(Console(json_mode=True, progress=False), UsageError(str(exc)), EXIT_USAGE)
        err = GuardedStream(sys.stderr)
        exc.parser.print_usage(cast("IO[str]", err))
        print(f"{exc.parser.prog}: error: {exc}", file=err)
        return EXIT_USAGE
    except BrokenPipeError:
        # argparse writes --help and --version to stdout itself.
        raise OutputClosed(sys.stdout) from None
    console = Console(json_mode=args.json, progress=not args.no_progress)
    run: Runner | None = getattr(args, "_run", None)
    if run is None:
        if console.json_mode:
            missing = UsageError("give a command (tiercheck --help lists them)")
            return _error(console, missing, EXIT_USAGE)
        parser.print_help(console.err)
        return EXIT_USAGE
    debug = os.environ.get("TIERCHECK_DEBUG", "") not in ("", "0")
    try:
        return asyncio.run(run(args, console))
    except KeyboardInterrupt:
        if console.json_mode:
            error = {"type": "KeyboardInterrupt", "message": "interrupted"}
            console.json({"error": {**error, "exit_code": EXIT_INTERRUPTED}})
        print("tiercheck: interrupted", file=console.err)
        return EXIT_INTERRUPTED
    except JobLocked as exc:
        # A configuration error to a checkpointer, but here the job is simply busy.
        if debug:
            raise
        return _error(console, exc, EXIT_PROBLEMS)
    except (UsageError, LocationError, ConfigError) as exc:
        if debug:
            raise
        return _error(console, exc, EXIT_USAGE)
    except (TiercheckError, OSError, ValueError) as exc:
        # A failure while working (a blob that does not decode, storage that fails): one line.
        if debug:
            raise
        return _error(console, exc, EXIT_PROBLEMS)
