"""The ``kvplan`` console script.

Subcommands register themselves in :data:`SUBCOMMANDS`: a name mapped to a function that
imports the command's module, lets it add its own arguments to an ``argparse`` sub-parser and
returns the function that runs it. Adding a command means one module with ``add_arguments`` and
one table row. Engines are imported only when a command runs, so ``kvplan --help`` works even
when an optional engine is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "build_parser", "SUBCOMMANDS", "INTERNAL_ERROR_STATUS"]

Runner = Callable[[argparse.Namespace], int]

#: Exit status of a command that failed on a defect of kvplan's own (an unexpected exception):
#: distinct from 1 (a wrong byte, a refused stage) and 2 (bad arguments, a failed peer).
INTERNAL_ERROR_STATUS = 3


def _add_demo(parser: argparse.ArgumentParser) -> Runner:
    from kvplan import demo  # its arguments live with the command

    return demo.add_arguments(parser)


def _add_explain(parser: argparse.ArgumentParser) -> Runner:
    from kvplan import explain  # its arguments live with the command

    return explain.add_arguments(parser)


#: name -> (one-line help, adder). The adder fills the sub-parser and returns the runner.
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], Runner]]] = {
    "demo": ("move a hybrid model's KV cache between real processes (Mooncake TCP, loopback) "
             "and verify every byte", _add_demo),
    "explain": ("show what a plan does for a model preset or two layout files: pairs, runs, "
                "blocks, bytes per layer, fragmentation warnings", _add_explain),
}


def _version() -> str:
    """The installed distribution's version (the wheel's metadata), without building the
    extension's import path."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvplan")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvplan",
        description="KV-cache transfer planner for prefill/decode disaggregated LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvplan {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_run=add(sp), _parser=sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (``kvplan = "kvplan.cli:main"``)."""
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # reported by the command's own parser, so it formats the error its own way
            args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as stop:  # argparse exits on --help and bad arguments; return the status
        return 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 2
    try:
        status = int(args._run(args))
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`kvplan explain ... | head`): stop quietly, as shell tools do.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        # A defect in kvplan, not in the input: keep the traceback for the report, but never
        # exit 1, which `kvplan demo` keeps for a wrong byte and `explain` for a refused stage.
        import traceback

        traceback.print_exc()
        print(f"kvplan {args.command}: internal error ({type(exc).__name__}: {exc}); "
              f"exit {INTERNAL_ERROR_STATUS}", file=sys.stderr)
        return INTERNAL_ERROR_STATUS


if __name__ == "__main__":
    sys.exit(main())
