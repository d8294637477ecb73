"""SGLang 0.5.23 integration: its two planning helpers, and its KV managers' planning methods.

**Managers.** ``install(MooncakeKVManager)`` (and/or ``AscendKVManager``, ``NixlKVManager``) at start-up
replaces these methods on the class, with SGLang 0.5.23's exact signatures and return values;
``uninstall(cls)`` restores exactly what was there (docs/sglang.md has the full account):

* ``_send_kvcache_generic`` for the KV pool (``state_type`` None): a ``kvplan.Template`` per
  decode peer (cached by ``mooncake_session_id``, rebuilt when the peer's registration changes)
  plans the request in one call; blocks go to the engine in batches of at most
  ``max_blocks_per_batch`` (default 1,024), or one executor task per entry pair on the
  custom-memory-pool path. With SGLang's own ``MooncakeTransferEngine`` around a supported
  Mooncake engine each batch goes to Mooncake natively (the plan's columns, no Python lists;
  ``KVPLAN_MOONCAKE_NATIVE=0`` turns that off), else to ``self.engine.batch_transfer_sync``. The first non-zero engine status is returned, as SGLang returns its
  one call's status. Page-indexed state components (``state_type`` SWA KV, DSA index-K, QSA,
  ...) that publish layer ids are planned the same way, paired by layer id, after SGLang's own
  stride check and with its failure path (``conclude_failure``, -1); elided entries move
  nothing. State components without layer ids, HiSparse device destinations
  (``dst_device_data_indices``), KV-pool calls with ``dst_item_lens`` and compressed-MLA pools
  (``mla_compression_ratios``) are handed to SGLang's own method unchanged.
* ``send_kvcache``: SGLang's envelope check (``_validate_envelope_kv_layout``), then the above;
  HiSparse device destinations go to SGLang's own method.
* ``AscendKVManager.send_kvcache``: SGLang's dispatch kept: hybrid-linear MLA with PP > 1 pairs
  by layer id; otherwise PP > 1 slices positionally (NPU buffer groups per group, MHA K/V), and
  PP 1 pairs entry ``i`` with decode entry ``i``. HiSparse raises ``NotImplementedError`` as SGLang.
* ``_send_mamba_state``: state entries paired by layer id (positional fallback at PP 1), one
  block per pair from ``Template.plan_state``; SGLang's slot-size check kept.
* ``MooncakeKVManager._send_mamba_state_slice`` (attention TP sizes differ): state entries with
  a TP channel split on both sides (``Layout.with_state(channels=...)``) from SGLang's
  per-tensor dims, outer row counts and conv shard groups; the core plans the bytes of the
  decode rank's slot this prefill rank holds (a replicated state from one elected writer).
* ``MooncakeKVManager.send_kvcache_slice`` (prefill and decode attention TP sizes differ, MHA):
  a head-sliced ``kvplan.Template`` (NHD items; total KV heads, heads per rank, head bytes,
  page size and both TP sizes and ranks as SGLang derives them) per decode peer, one block per
  token slot and entry pair with runs merged, submitted as above; SGLang's two ``-1`` statuses
  are kept. A prefill rank holding replicated heads is planned as kvplan's elected replica
  for that decode rank (same heads, same offsets), so every rank SGLang's decode asks sends.
* ``MooncakeKVManager.send_kvcache_dcp`` (decode context parallelism): a kvplan template per
  decode peer and DCP rank (tokens dealt over the decode ranks, draft rows sent whole),
  entries paired by layer id; pack buffers, custom memory pools, head-sliced draft rows and
  chunks that start inside a decode virtual page are handed to SGLang's own method.

* ``MooncakeKVManager.send_kvcache_staged`` (prefill and decode attention TP sizes differ, MHA,
  through staging buffers): SGLang's gather kernel fills the prefill's staging buffer as in
  SGLang; a head-sliced template per decode peer plans where this writer's bytes go in the
  decode's staging region (SGLang's ``compute_staging_layout``) and the network blocks (one at
  PP 1, at most two per writer under PP), submitted as above; SGLang's ``-1`` fall-backs and its
  ``RuntimeError`` on a failed transfer are kept. When prefill heads are replicated over
  several writers of one region, each writer's template is its own rank's with
  ``replicas_send=True``, so every writer fills its own share as in SGLang; prefill PP without
  slot layer ids goes to SGLang's own method.
  :func:`staged_template` gives the decode the same plan over its own pools (its scatter).

* ``NixlKVManager`` (:mod:`.nixl`): ``_send_kvcache_generic``'s non-prepared path (so also
  ``send_kvcache`` and ``send_kvcache_dcp``, which dispatch to it) plans with a cached template
  and hands the blocks to the NIXL agent as SGLang's descriptor arrays; the manager's own KV
  buffers pair by the layer ids both peers registered. The prepared lists
  (``_prep_equal_tp_dlist``, ``_init_hetero_tp_prep_handle``) are one strided row per entry
  (pair) from a layout or the head-sliced template; ``_send_mamba_state`` one block per pair,
  ``_send_mamba_state_slice`` the slices of the Mooncake drop-in's TP-split state template.
  ``send_kvcache_staged`` at prefill PP 1 plans as the Mooncake manager's staged path does
  and posts its network blocks as NIXL descriptors (prefill PP goes to SGLang's own method).
  ``_init_mixed_equal_tp_prep_handles`` and ``send_kvcache_mixed`` (entries of several memory
  kinds) take the prepared lists and the indices into them from one template per segment
  (``Template.descriptor_runs``, ``Template.prepped_indices``); the
  prepared state plans (``_prepare_state_xfer``, ``_send_prepared_states``) are each state
  component's template's ``descriptor_runs`` and ``prepped_state_indices``
  (:mod:`.nixl_state`); ``send_kvcache_slice``'s indices stay SGLang's. A NIXL method whose signature is not
  SGLang 0.5.23's is refused with ``kvplan.IncompatibleHostError`` before anything is
  replaced.

Everything else (the
engine, sessions, bootstrap, state and aux sends, failure handling) stays SGLang's.

SGLang's seams are kept: each drop-in calls what SGLang's method calls on ``self`` at that
point (``_transfer_data`` with SGLang's block lists whenever it is not SGLang's own,
``_send_kvcache_generic`` with SGLang's keyword arguments, ``_await_transfer_futures``, a
replaced pointer-slicing helper through SGLang's own method) and reads only the attributes
SGLang's method reads there, so subclasses, wrappers and stand-in objects work as with SGLang.
The bounded engine batches above are the path taken when ``_transfer_data`` is SGLang's own.

Differences from SGLang's methods, each where SGLang moves wrong bytes, drops bytes, or fails
without naming the cause (the typed errors derive from ``kvplan.KvPlanError``, a ``ValueError``):

* Page index arrays of different lengths: SGLang sends nothing and returns 0 when exactly one
  side is empty (and raises ``ValueError`` otherwise); kvplan raises ``KvPlanError``. A negative
  prefill page, or one past the prefill buffer (``kv_data_lens``), is ``IndexBoundsError``
  (SGLang reads outside the buffer). The decode publishes no buffer lengths, so decode pages
  are bounded only by the address space.
* Decode item sizes: SGLang addresses the decode with the prefill's item length. When the
  decode's registration (``decode_kv_args_table[session].dst_kv_item_lens``) covers the entries,
  kvplan checks every pair and raises ``SizeMismatchError``; the Mamba slot check raises
  ``SizeMismatchError`` with SGLang's message instead of ``RuntimeError``.
* Pairing failures SGLang reports as ``RuntimeError`` (missing layer, one-sided ids, counts that
  do not fit) are ``PairingError``; an out-of-range positional slice, which SGLang turns into an
  ``IndexError`` or, with draft entries, into target layers written to the draft entry, is
  ``PairingError``.
* MHA peers without layer ids at PP > 1: SGLang guesses where the decode's V block starts from
  the entry counts (wrong for uneven splits and for a prefill stage with draft K/V, silently).
  kvplan needs the decode's KV layer count (``install(..., decode_kv_layers=N)`` or the instance
  attribute ``kvplan_decode_kv_layers``) and then slices correctly; without it, any stage whose
  entry count differs from the decode's raises ``PairingError``.
* NPU buffer groups: buffer counts that are not a whole multiple of ``kv_buf_groups`` raise
  ``LayoutError`` (SGLang divides with ``//`` and then fails with ``IndexError`` or ignores the
  extra buffer); a decode whose buffer count is not ``groups * (hidden_kv_layers +
  draft_kv_layers)`` raises ``LayoutError`` (SGLang's per-group offsets would be wrong).
* ``send_kvcache_slice``: a prefill rank that holds none of the decode rank's heads is a
  ``PairingError`` (SGLang writes its heads into the slots of other heads); a prefill item
  that is not ``page_size * heads_per_rank * head_bytes`` (SGLang's head size, from the
  decode's item), a decode item not divisible that way, or head and TP counts of which
  neither divides the other, are ``SizeMismatchError`` / ``LayoutError`` (SGLang truncates and
  reads or writes at wrong offsets); page lists of different lengths are ``KvPlanError`` and
  prefill pages past the buffer ``IndexBoundsError``, as for ``send_kvcache``.
* ``send_kvcache_staged``: a negative prefill page or one past the pool tensors is
  ``IndexBoundsError`` before SGLang's gather kernel runs (which would read outside the pool);
  pool tensors with another head count than SGLang's split, or a ``dst_kv_item_len`` that is not
  ``page_size`` x the decode's heads x the prefill's head bytes, are ``SizeMismatchError`` (SGLang
  gathers other heads' bytes, or the decode scatters at other offsets than the prefill staged);
  a decode peer without one of the prefill stage's layers is ``PairingError``.
* Engine calls: at most ``max_blocks_per_batch`` blocks per call (SGLang: one call per request,
  or per ``max_transfer_batch_indices`` pages); runs are maximal, so the block list may differ
  from SGLang's by merging, never in the bytes moved.

**Several requests per peer session.** SGLang 0.5.23's transfer worker takes one request (one
room) at a time from its queue and sends it to each of the room's decode sessions in turn, so
SGLang itself never hands kvplan several requests for one session. Where a caller holds several
(a worker that drains its queue), :func:`send_kvcache_batch` ``(manager, session, [(prefill
indices, decode indices), ...], dst_kv_ptrs, executor, dst_layer_ids)`` plans them as one
batch plan and returns one status per request, each request's own success or failure.

**Helpers.** Switch an engine by changing one import::

    # from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
    # from sglang.srt.disaggregation.utils import build_transfer_entry_pairs
    from kvplan.compat.sglang import build_transfer_entry_pairs, group_concurrent_contiguous

Both functions keep SGLang's signatures, return types (Python lists of Python ints; a list of
``(int, int)`` tuples), error types and messages, including SGLang's quirks that callers may
rely on: either side empty means "no runs", plain lists raise ``AttributeError``, layer ids are
tested for truthiness, extra decode entries are left unpaired, counts are compared with ``==``
(so ``3.0`` works wherever SGLang's code only compares it, and raises SGLang's ``TypeError``
where SGLang's ``range(n_src)`` does).

For every input not listed below, results and errors are identical to SGLang 0.5.23's. Run
boundaries are SGLang's ``np.diff(x) != 1`` in each array's own dtype, wrap-around included:
int32 ``[2**31-1, -2**31]`` and uint32 ``[2**32-1, 0]`` are one run, as numpy computes
``-2**31 - (2**31-1)`` and ``0 - (2**32-1)`` as 1 in those dtypes. The Rust core groups arrays
whose values are non-negative and below their dtype's maximum (where exact and wrap-around
differences agree); any other array is grouped with SGLang's own numpy expression.

The differences, all for inputs SGLang only handles by accident:

* ``group_concurrent_contiguous`` with an array that is not 1-D or whose dtype is not an integer
  dtype raises ``TypeError`` (kvplan's message) once both sides are non-empty and of equal size.
  SGLang instead groups float and object arrays by their differences (a run continues where
  the step is exactly 1), raises numpy's ``TypeError`` for bool arrays and numpy's
  ``ValueError`` for 0-d arrays, and for 2-D arrays returns rows split at positions computed
  from the last axis.
* ``group_concurrent_contiguous`` reads ndarray subclasses (e.g. ``np.ma.MaskedArray``) as plain
  arrays (``np.asarray``): a mask is ignored, and runs hold the underlying values. SGLang's
  result then follows the subclass's own ``np.diff`` and ``tolist`` (``None`` for masked values).
* ``build_transfer_entry_pairs`` compares layer ids that are ints (or have ``__index__``, like
  numpy integers) by integer value in the core; SGLang compares them through a dict. The two
  differ only for int subclasses that override ``__eq__`` or ``__hash__``. Other ids (floats,
  strings, tuples, ...) go through a dict here too, in SGLang's order.
* ``build_transfer_entry_pairs`` with counts too large to materialise: SGLang fails while
  building the list (``MemoryError``); kvplan fails before (``OverflowError`` past ``2**63``
  pairs, else ``MemoryError``).

The package is split by job, each module depending only on those below it: :mod:`.install`
(install / uninstall), :mod:`.dropins` (the drop-in methods; :mod:`.dcp` and :mod:`.staged`
the DCP and staged ones, :mod:`.nixl` the NIXL manager's), :mod:`.submit` (engine batches or
SGLang's seams), :mod:`.templates` (SGLang's call -> template), :mod:`.cache` (templates per
decode peer), :mod:`.layouts` (layout builders), :mod:`.settings`, :mod:`.seams`, and at the
bottom :mod:`.registry` (SGLang's originals); :mod:`.planning_helpers` holds the two helpers.
"""

from __future__ import annotations

from kvplan.compat.sglang.cache import TemplateCache, template_cache
from kvplan.compat.sglang.dropins import send_kvcache_batch
from kvplan.compat.sglang.install import REFUSED_STATUS, install, installed, uninstall
from kvplan.compat.sglang.layouts import layout_from_kv_args, layout_from_register_info
from kvplan.compat.sglang.planning_helpers import (
    build_transfer_entry_pairs,
    group_concurrent_contiguous,
)
from kvplan.compat.sglang.registry import REPLACED_METHODS
from kvplan.compat.sglang.settings import DEFAULT_MAX_BLOCKS_PER_BATCH
from kvplan.compat.sglang.staged import staged_template

__all__ = [
    "DEFAULT_MAX_BLOCKS_PER_BATCH",
    "REFUSED_STATUS",
    "REPLACED_METHODS",
    "TemplateCache",
    "build_transfer_entry_pairs",
    "group_concurrent_contiguous",
    "install",
    "installed",
    "layout_from_kv_args",
    "layout_from_register_info",
    "send_kvcache_batch",
    "staged_template",
    "template_cache",
    "uninstall",
]
