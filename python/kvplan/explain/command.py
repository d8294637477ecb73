"""The ``kvplan explain`` sub-command: its arguments, and the runner that maps every outcome to
an exit status."""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable

from kvplan.explain.analysis import DEFAULT_MAX_BLOCKS, MAX_START_LAYER, explain, explain_dcp
from kvplan.explain.as_json import dcp_json, explanation_json
from kvplan.explain.figure import plot
from kvplan.explain.layout_files import write_layouts
from kvplan.explain.scenario import dcp_decodes, scenario, starts_for
from kvplan.explain.text import render, render_dcp
from kvplan._cli_args import float_arg, int_arg, int_list_arg, one_line, one_line_error

__all__ = ["EXIT_INCOMPATIBLE", "EXIT_INTERNAL", "EXIT_OK", "EXIT_USAGE", "MAX_LAYERS",
           "add_arguments", "run"]

#: What ``add_arguments`` returns: runs the parsed command line, returns the exit status.
Runner = Callable[[argparse.Namespace], int]
#: Exit statuses of ``kvplan explain``.
EXIT_OK, EXIT_INCOMPATIBLE, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
#: ``--backend`` choices: the transfer backends kvplan has adapters for (only ``ascend``
#: changes the pairing rule; a typo must not silently get the default).
BACKENDS = ("ascend", "mooncake", "nixl")
#: ``--layers`` bound: every layer becomes layout entries in memory, and no model comes close.
MAX_LAYERS = 1 << 16


EPILOG = f"""\
exit status: {EXIT_OK} every stage is compatible; {EXIT_INCOMPATIBLE} a stage is not (its report
  is printed); {EXIT_USAGE} bad input: an option, a layout file or a field in it (one line on
  stderr names it and the value); {EXIT_INTERNAL} internal error (a bug in kvplan: the traceback
  is printed).

Peers without layer ids at prefill PP > 1 pair by legacy positional slicing, which needs the
layer each prefill stage starts at. It is derived from published layer ids; when a stage or the
decode layout publishes none, explain refuses (exit {EXIT_USAGE}) unless --prefill-start-layer gives
it, one value per stage.
"""


def add_arguments(parser: argparse.ArgumentParser) -> Runner:
    """Fill the ``explain`` sub-parser; returns the runner (the ``cli.SUBCOMMANDS`` contract)."""
    from kvplan.presets import PRESETS

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # keep the epilog's lines
    setattr(parser, "error", one_line_error(parser))  # an instance attribute, not a subclass
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(PRESETS),
                     help="reference model (docs/design.md, Reference scenarios)")
    src.add_argument("--prefill", action="append", metavar="FILE.json",
                     help="prefill layout JSON (Layout.to_dict); repeat once per PP stage")
    parser.add_argument("--decode", metavar="FILE.json",
                        help="decode layout JSON (required with --prefill, refused with --preset)")
    parser.add_argument("--pages", type=int_arg(1), default=512,
                        help="pages the request moves, at least 1 (default 512)")
    parser.add_argument("--page-size", type=int_arg(1), default=None,
                        help="tokens per page for presets, at least 1 (default 1, SGLang's "
                             "default); layout files carry their own")
    parser.add_argument("--decode-page-size", type=int_arg(1), default=None,
                        help="tokens per decode page for presets, when it differs from the "
                             "prefill's --page-size (plans are then token-exact; default: the "
                             "same as --page-size)")
    parser.add_argument("--decode-dcp", type=int_arg(1), default=None, metavar="N",
                        help="for presets: the decode deals the request's tokens over N "
                             "decode-context-parallel ranks; prints which tokens each rank "
                             "holds and the blocks each rank's plan costs (default 1)")
    parser.add_argument("--dcp-interleave", type=int_arg(1), default=None, metavar="I",
                        help="with --decode-dcp: consecutive tokens per deal (default 1, "
                             "SGLang's token round robin; the decode page size gives vLLM's "
                             "block interleave)")
    parser.add_argument("--pp", type=int_arg(1), default=None,
                        help="prefill PP stages for presets (default 1)")
    parser.add_argument("--pp-split", metavar="N,N,...", type=int_list_arg(1, MAX_LAYERS, "20,28"),
                        help="layers per prefill stage for presets (default: even split)")
    parser.add_argument("--stage", type=int_arg(0), default=None,
                        help="explain only this prefill stage, counted from 0 (default: all)")
    parser.add_argument("--layout", choices=("per-layer", "cross-layer"), default=None,
                        help="KV memory of the preset's peers: per-layer (one buffer per layer "
                             "and K/V, default) or cross-layer (one pool per peer holding every "
                             "KV layer of a page side by side, vLLM's cross-layer layout; state "
                             "stays per layer). cross-layer also prints blocks per request for "
                             "both layouts")
    parser.add_argument("--layers", type=int_arg(1, MAX_LAYERS), default=None,
                        help="override the preset's layer count (e.g. 27 for kimi-linear; "
                             f"at most {MAX_LAYERS:,})")
    parser.add_argument("--fragmentation", type=float_arg(0.0, 1.0), default=0.0,
                        help="fraction of decode page boundaries that break a run: 0 = one "
                             "contiguous run, 1 = every page its own run (default 0)")
    parser.add_argument("--seed", type=int_arg(0), default=0,
                        help="seed for where the breaks fall, at least 0 (default 0)")
    parser.add_argument("--backend", choices=BACKENDS, default="mooncake",
                        help="pairing policy backend for select_pairing (default mooncake; "
                             "'ascend' applies Ascend's pairing rules, as "
                             "kvplan.select_pairing documents them)")
    parser.add_argument("--prefill-start-layer", metavar="N[,N,...]",
                        type=int_list_arg(0, MAX_START_LAYER, "0,31"), default=None,
                        help="first layer of each prefill stage, for legacy slicing of peers "
                             "without layer ids: one value per prefill stage in stage order "
                             "(or a single value when one stage is explained); default: derived "
                             "from the layer ids, refused when there are none")
    parser.add_argument("--max-blocks", type=int_arg(1), default=DEFAULT_MAX_BLOCKS,
                        help=f"blocks per engine call, at least 1 (default {DEFAULT_MAX_BLOCKS})")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the run-length histogram and bytes per layer "
                             "(needs matplotlib: the 'plot' extra)")
    parser.add_argument("--write-layouts", metavar="DIR",
                        help="also write the layouts as JSON (prefill-stageK.json, decode.json)")
    parser.add_argument("--json", action="store_true",
                        help="print the explanation as one JSON object instead of text (the "
                             "same figures, verdicts and warnings; exit status unchanged)")
    return run


def run(args: argparse.Namespace) -> int:
    """Run ``kvplan explain``: exit 0 if every stage is compatible, 1 if not, 2 on bad input,
    3 on an internal error (so that 1 never stands for a crash)."""
    try:
        return _run(args)
    except BrokenPipeError:
        raise  # the reader went away: the console script stops quietly
    except (ValueError, OSError) as err:  # KvPlanError is a ValueError
        print(f"kvplan explain: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        print("kvplan explain: out of memory for this request: lower --pages (or "
              "--fragmentation, which multiplies the blocks)", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # a bug, not bad input: show it, but never as exit 1 ("incompatible")
        traceback.print_exc()
        print("kvplan explain: internal error (the traceback above is a bug in kvplan)",
              file=sys.stderr)
        return EXIT_INTERNAL


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "decode_dcp", None) is not None or getattr(args, "dcp_interleave", None):
        return _run_dcp(args)
    cross = getattr(args, "layout", None) == "cross-layer"
    title, desc, stages, decode = scenario(args, cross_layer=cross)
    n_all = len(stages)
    if args.stage is not None:
        if not 0 <= args.stage < n_all:
            raise ValueError(f"--stage must be in 0..{n_all - 1}, got {args.stage}")
        stages = [stages[args.stage]]
    starts = starts_for(args, n_all)
    if args.write_layouts:
        write_layouts(args.write_layouts, stages, decode)
    e = explain(stages, decode, title=title, description=desc, pages=args.pages,
                fragmentation=args.fragmentation, seed=args.seed, backend=args.backend,
                prefill_start_layer=starts, max_blocks=args.max_blocks,
                layout="cross-layer" if cross else "per-layer")
    if cross:
        # The same scenario with per-layer buffers, for the blocks-per-request comparison.
        _, _, flat_stages, flat_decode = scenario(args)
        if args.stage is not None:
            flat_stages = [flat_stages[args.stage]]
        e.per_layer = explain(flat_stages, flat_decode, title=title, description=desc,
                              pages=args.pages, fragmentation=args.fragmentation,
                              seed=args.seed, backend=args.backend, prefill_start_layer=starts,
                              max_blocks=args.max_blocks)
    if args.plot:
        # Before printing: a plot that cannot be written is bad input, reported on its own.
        try:
            plot(e, args.plot)
        except ImportError as err:
            raise ValueError(str(err)) from None
        except (OSError, ValueError) as err:  # unwritable path, unknown image format
            raise ValueError(f"--plot {args.plot}: {one_line(err)}") from None
    if getattr(args, "json", False):
        _print_json(explanation_json(e))
        if args.plot:  # stdout holds the JSON object alone
            print(f"plot written to {args.plot}", file=sys.stderr)
    else:
        print(render(e))
        if args.plot:
            print(f"plot written to {args.plot}")
    return EXIT_OK if e.ok else EXIT_INCOMPATIBLE


def _print_json(obj: object) -> None:
    print(json.dumps(obj, indent=1, ensure_ascii=False, allow_nan=False))


def _run_dcp(args: argparse.Namespace) -> int:
    """``--decode-dcp N``: every prefill stage against every decode DCP rank."""
    title, desc, stages, decodes = dcp_decodes(args)
    if args.stage is not None:
        if not 0 <= args.stage < len(stages):
            raise ValueError(f"--stage must be in 0..{len(stages) - 1}, got {args.stage}")
        stages = [stages[args.stage]]
    e = explain_dcp(stages, decodes, title=title, description=desc, pages=args.pages,
                    backend=args.backend, max_blocks=args.max_blocks)
    if getattr(args, "json", False):
        _print_json(dcp_json(e))
    else:
        print(render_dcp(e))
    return EXIT_OK if e.ok else EXIT_INCOMPATIBLE
