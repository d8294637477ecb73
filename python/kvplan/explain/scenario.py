"""What ``kvplan explain``'s command line describes: the prefill stages and the decode peer,
built from a preset or loaded from layout files, and the start layers of the stages explained."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvplan.explain.layout_files import load_layout
from kvplan.explain.words import one_line

__all__ = ["check_options", "dcp_decodes", "scenario", "starts_for"]


def check_options(args: argparse.Namespace) -> None:
    """Refuse options the chosen input ignores (a silently ignored option is a wrong answer)."""
    if args.preset:
        if args.decode:
            raise ValueError("--decode is for layout files (with --prefill); a preset builds "
                             "its own decode layout")
        if args.pp is not None and args.pp_split is not None and args.pp != len(args.pp_split):
            raise ValueError(f"--pp {args.pp} disagrees with --pp-split {_pp_text(args)} "
                             f"({len(args.pp_split)} stages)")
        from kvplan.presets import get_preset

        components = get_preset(args.preset).layer_components()
        if getattr(args, "layout", None) == "cross-layer" and components:
            raise ValueError(f"--layout cross-layer: preset {args.preset!r} keeps each layer in "
                             f"{len(components)} buffers of their own "
                             f"({', '.join(c.role for c in components)}); it is laid out "
                             f"per-layer only")
        return
    given = [opt for opt, value in (("--page-size", args.page_size),
                                    ("--decode-dcp", getattr(args, "decode_dcp", None)),
                                    ("--dcp-interleave", getattr(args, "dcp_interleave", None)),
                                    ("--decode-page-size", args.decode_page_size),
                                    ("--pp", args.pp), ("--pp-split", args.pp_split),
                                    ("--layers", args.layers),
                                    ("--layout", getattr(args, "layout", None)))
             if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} only apply to --preset; layout files carry their "
                         f"own page size, PP split, layers and memory layout")
    if not args.decode:
        raise ValueError("--prefill needs --decode FILE.json")


def _pp_text(args: argparse.Namespace) -> str:
    return ",".join(map(str, args.pp_split))


def scenario(args: argparse.Namespace, cross_layer: bool = False
              ) -> tuple[str, str, list[tuple[str, Any]], Any]:
    """(title, description, prefill stages, decode) from the command line; for presets with
    ``cross_layer``, every peer's KV in one cross-layer pool."""
    from kvplan import KvPlanError
    from kvplan.presets import DECODE_BASE, PREFILL_BASE, get_preset, split_layers

    check_options(args)
    if args.preset:
        preset = get_preset(args.preset, args.layers)
        counts = args.pp_split
        pp = len(counts) if counts else (args.pp or 1)
        page_size = args.page_size or 1
        try:
            splits = split_layers(preset.num_layers, pp, counts)
        except KvPlanError as err:
            option = f"--pp-split {_pp_text(args)}" if counts else f"--pp {pp}"
            raise ValueError(f"{option}: {err}") from None
        # Pools large enough for the request (with its fragmentation gaps) on both sides.
        capacity = args.pages + round(args.fragmentation * (args.pages - 1))
        try:
            stages = [
                (f"stage {k}/{pp}" if pp > 1 else "prefill",
                 preset.layout(list(r), page_size=page_size, capacity=capacity,
                               base=PREFILL_BASE + k * (1 << 40), pp_rank=k, pp_size=pp,
                               cross_layer=cross_layer))
                for k, r in enumerate(splits)
            ]
            decode_size = args.decode_page_size or page_size
            decode_capacity = capacity
            if decode_size != page_size:
                # The request's tokens in decode pages, plus the fragmentation gaps.
                needed = -(-args.pages * page_size // decode_size)
                decode_capacity = needed + round(args.fragmentation * (needed - 1))
            decode = preset.layout(list(range(preset.num_layers)), page_size=decode_size,
                                   capacity=decode_capacity, base=DECODE_BASE,
                                   cross_layer=cross_layer)
        except KvPlanError as err:
            # The preset's own rule refuses the page size (a row of several tokens, a window
            # wider than the pool): say that, not a size problem.
            raise ValueError(f"--preset {preset.key} with --page-size {page_size} and --pages "
                             f"{args.pages}: {one_line(err)}") from None
        except OverflowError as err:
            # Page size x pages sizes the synthetic pools; past 2**64 bytes of address space
            # the layout cannot be built.
            raise ValueError(
                f"--page-size {page_size} with --pages {args.pages}: {preset.name}'s KV pools "
                f"({capacity:,} pages × {preset.kv_bytes_per_token * page_size:,} B per page) "
                f"do not fit in a 64-bit address space ({one_line(err)})") from None
        split_text = " | ".join(f"{r.start}–{r.stop - 1}" for r in splits)
        sizes = (f"page_size {page_size}" if decode.page_size == page_size
                 else f"page_size {page_size} prefill, {decode.page_size} decode")
        desc = (f"{preset.description}; prefill PP {pp} (layers {split_text}), decode PP 1, "
                f"{sizes}"
                + ("; cross-layer KV pools (state per layer)" if cross_layer else ""))
        title = f"{preset.name}" + (f" ({preset.num_layers} layers)" if args.layers else "")
        return title, desc, stages, decode
    stages = []
    for k, path in enumerate(args.prefill):
        layout = load_layout(path, "--prefill")
        stages.append((f"stage {layout.pp_rank}/{layout.pp_size}" if layout.pp_size > 1
                       else f"prefill {k}" if len(args.prefill) > 1 else "prefill", layout))
    decode = load_layout(args.decode, "--decode")
    title = f"{', '.join(os.path.basename(p) for p in args.prefill)} -> " \
            f"{os.path.basename(args.decode)}"
    return title, "layouts from JSON files", stages, decode


def starts_for(args: argparse.Namespace, n_stages: int) -> list[int | None] | None:
    """``--prefill-start-layer`` for the stages explained (after ``--stage``)."""
    values = args.prefill_start_layer
    if values is None:
        return None
    if len(values) == 1 and (n_stages == 1 or args.stage is not None):
        return [values[0]]
    if len(values) != n_stages:
        raise ValueError(f"--prefill-start-layer: {len(values)} value(s) for {n_stages} "
                         f"prefill stages; give one per stage, in stage order")
    return list(values) if args.stage is None else [values[args.stage]]


def dcp_decodes(args: argparse.Namespace) -> tuple[str, str, list[tuple[str, Any]], list[Any]]:
    """(title, description, prefill stages, decode layout of every DCP rank) for
    ``--decode-dcp N``: the preset's decode, its tokens dealt over N ranks."""
    from kvplan import KvPlanError
    from kvplan.presets import DECODE_BASE, get_preset

    refused = [opt for opt, given in (("--prefill", not args.preset),
                                      ("--layout", getattr(args, "layout", None) is not None),
                                      ("--fragmentation", args.fragmentation != 0.0),
                                      ("--plot", bool(args.plot)),
                                      ("--write-layouts", bool(args.write_layouts)),
                                      ("--prefill-start-layer",
                                       args.prefill_start_layer is not None))
               if given]
    if refused:
        raise ValueError(f"--decode-dcp explains a preset with per-layer buffers and "
                         f"consecutive pages; it does not take {', '.join(refused)}")
    size = args.decode_dcp or 1
    interleave = args.dcp_interleave or 1
    title, desc, stages, decode = scenario(args)
    preset = get_preset(args.preset, args.layers)
    decodes = []
    for rank in range(size):
        try:
            decodes.append(preset.layout(list(range(preset.num_layers)),
                                         page_size=decode.page_size,
                                         capacity=decode.entries("page")[0].capacity,
                                         base=DECODE_BASE,
                                         dcp_size=size, dcp_rank=rank,
                                         dcp_interleave=interleave))
        except KvPlanError as err:
            raise ValueError(f"--decode-dcp {size} --dcp-interleave {interleave}: "
                             f"{one_line(err)}") from None
    return title, f"{desc}; decode DCP {size} (interleave {interleave})", stages, decodes
