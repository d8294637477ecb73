"""``kvplan explain``: what a plan will do for a model, a request size, a PP split, fragmentation.

For a preset (docs/design.md, Reference scenarios) or two layout JSON files (``Layout.to_dict``
format), it builds the template of every prefill PP stage against the decode peer (with the
pairing :func:`kvplan.select_pairing` picks for ``--backend``), plans one request and prints
entries paired, runs, blocks, bytes, a run-length histogram, bytes per layer and warnings.
``--plot FILE.png`` draws the histogram and bytes per layer (matplotlib, the ``plot`` extra,
imported only then).

Page lists: the prefill pages are ``0 .. pages-1`` (contiguous); the decode pages come from a
free list in which a fraction ``--fragmentation`` of the page boundaries is broken (0: one run;
1: every page its own run), chosen reproducibly from ``--seed``.

Peers without layer ids at prefill PP > 1 pair by legacy positional slicing, which needs the
layer each prefill stage starts at. It is derived from published ids; when it cannot be,
``explain`` refuses (as ``PairingChoice.template`` does) unless ``--prefill-start-layer`` gives
one value per stage: a wrong start would silently plan a stage onto another stage's layers.

``--layout cross-layer`` (presets only) builds every peer with one cross-layer KV pool
(``ModelPreset.layout(..., cross_layer=True)``: per page, the items of all the peer's KV layers
side by side; state per layer), explains that, and adds a table of blocks per request for the
per-layer and the cross-layer layout of the same model, request and split.

Exit status: 0 every stage is compatible, 1 a stage is not (its report is printed), 2 bad input
(one line on stderr naming the option or layout field and the value), 3 internal error (a bug:
the traceback is printed), so that 1 always means "incompatible".

The package: :mod:`~kvplan.explain.analysis` (:func:`explain`, the library function),
:mod:`~kvplan.explain.text` (:func:`render`), :mod:`~kvplan.explain.figure` (:func:`plot`),
:mod:`~kvplan.explain.layout_files` (layout JSON files), :mod:`~kvplan.explain.scenario` (the
stages a command line describes) and :mod:`~kvplan.explain.command` (arguments and exit statuses).
"""

from __future__ import annotations

from kvplan.explain.analysis import (
    DEFAULT_MAX_BLOCKS as DEFAULT_MAX_BLOCKS,
    DcpExplanation,
    DcpRankCost as DcpRankCost,
    DcpRankResult as DcpRankResult,
    LIST_NS_PER_ELEMENT as LIST_NS_PER_ELEMENT,
    MAX_START_LAYER as MAX_START_LAYER,
    SMALL_BLOCK_BYTES as SMALL_BLOCK_BYTES,
    Explanation,
    StageResult,
    decode_pages as decode_pages,
    explain,
    explain_dcp,
    histogram as histogram,
)
from kvplan.explain.command import (
    EPILOG as EPILOG,
    EXIT_INCOMPATIBLE as EXIT_INCOMPATIBLE,
    EXIT_INTERNAL as EXIT_INTERNAL,
    EXIT_OK as EXIT_OK,
    EXIT_USAGE as EXIT_USAGE,
    MAX_LAYERS as MAX_LAYERS,
    Runner as Runner,
    add_arguments,
    run,
)
from kvplan.explain.figure import plot as plot
from kvplan.explain.layout_files import load_layout as load_layout
from kvplan.explain.text import render, render_dcp

# The public names; the other names imported above stay importable from here as before.
__all__ = ["DcpExplanation", "Explanation", "StageResult", "add_arguments", "explain",
           "explain_dcp", "render", "render_dcp", "run"]

# The module's former private name, used by callers that load layout files the way the CLI does.
_load_layout = load_layout
