"""Helpers for tests that move real bytes between processes through a transfer engine.

Public, so that a serving engine's own integration tests can use them (as ``polars.testing`` or
``numpy.testing`` serve their users); ``kvplan demo`` runs on them too. Importing
:mod:`kvplan.testing` imports no engine: peer processes import theirs when they start.

- :class:`PeerSpec` / :class:`Entry`: a peer's buffers as plain, picklable data (offsets in an
  arena); :func:`preset_peer` and :func:`model_peers` derive them from a
  :class:`kvplan.presets.ModelPreset` (per-layer buffers, or with ``cross_layer=True`` one
  cross-layer pool of strided entries); :func:`build_layout` gives the :class:`kvplan.Layout` a
  peer publishes.
- :class:`Arena`: memory shared between the test and its peer processes (a mapped file);
  :func:`fill_source` fills sources with bytes that never equal :data:`SENTINEL`, the byte
  destinations start with.
- :class:`PeerProcess`: a spawned process that owns an engine (Mooncake or NIXL), registers
  its arena, publishes session id and wire layout, and plans and submits on command.
- :func:`first_wrong_byte`: checks a whole destination arena against the expected moves.
- :mod:`kvplan.testing.oracle`: the byte-level oracle (:func:`reference_copy`: what a correct
  transfer writes, token by token and head by head, from the layout definitions alone, with
  TP head slicing, page sizes, memory orders, DCP deals and caller-given fragments),
  :func:`apply_plan` (a plan's blocks as memmoves between :class:`Memory` objects) and
  ``apply_staged`` (a staged plan's gather, network and scatter).
- :mod:`kvplan.testing.ranks`: one TP rank's KV cache in a numpy arena and its layout, and
  :func:`~kvplan.testing.ranks.check_request` (every prefill rank into one decode rank, checked
  against the oracle).
- :mod:`kvplan.testing.faults`: lifecycle faults replayed in host memory
  (:func:`~kvplan.testing.faults.replay_late_writers`: abort, reuse and an aborted request's
  late writer, against :mod:`kvplan.leases`).
- :mod:`kvplan.testing.fixtures`: the planning fixtures engines share, as plain data
  (:class:`PlanningFixture`: layouts, a request and the oracle's byte map) for MHA and MLA
  with PP, equal TP, TP head slices, DCP, staging and hybrid state (:func:`fixtures`).
- :mod:`kvplan.testing.strategies`: hypothesis strategies for those deployments and requests;
  the only module here that needs hypothesis, and not imported by this package.
"""

from kvplan.testing.fixtures import PlanningFixture, fixtures
from kvplan.testing.memory import SENTINEL, Arena, arena_dir, fill_source
from kvplan.testing.oracle import Memory, apply_plan, reference_copy
from kvplan.testing.peers import ENGINE_ENV, ENGINES, PeerFailure, PeerProcess
from kvplan.testing.specs import (
    Entry,
    ModelPeers,
    PeerSpec,
    build_layout,
    cross_layer_entries,
    model_peers,
    pack_entries,
    preset_peer,
)
from kvplan.testing.verify import expected_moves, first_wrong_byte

__all__ = [
    "ENGINE_ENV",
    "ENGINES",
    "SENTINEL",
    "Arena",
    "Entry",
    "Memory",
    "ModelPeers",
    "PeerFailure",
    "PeerProcess",
    "PeerSpec",
    "PlanningFixture",
    "apply_plan",
    "arena_dir",
    "build_layout",
    "cross_layer_entries",
    "expected_moves",
    "fill_source",
    "fixtures",
    "first_wrong_byte",
    "model_peers",
    "pack_entries",
    "preset_peer",
    "reference_copy",
]
