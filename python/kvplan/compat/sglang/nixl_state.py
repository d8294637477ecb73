"""kvplan's prepared state plans for SGLang 0.5.23's ``NixlKVManager``: ``_prepare_state_xfer``
(once per decode peer) and ``_send_prepared_states`` (per request).

SGLang prepares, per decode peer, one strided NIXL descriptor list per side for the state
components it moves whole (Mamba, DSA, QSA, ... at PP 1, UCX on CUDA) and per request hands
``make_prepped_xfer`` the slot indices into them. kvplan keeps SGLang's dispatch (which
components are prepared, which stay on the per-request path, the peers that get none) and
plans the rest:

* ``_prepare_state_xfer``: per prepared component a :class:`kvplan.Template` of its live entry
  pairs (entries paired by the core as SGLang's own pairing rules ask: by layer id with the
  positional fallback at PP 1, positionally for the MHA split layouts; an entry with a null
  pointer or an empty item left out as SGLang leaves it out). The lists are the templates'
  ``Template.descriptor_runs``: one strided row ``(base, len, device, stride, slots)`` per
  entry pair, each with the core's slot limit of its component, so never more descriptors
  than SGLang's (whose rows hold every entry's own slot count). Paired entries of different
  item strides are SGLang's layout rejection (every transfer to that peer then fails), named
  by the core's :class:`kvplan.SizeMismatchError`.
* ``_send_prepared_states``: per component and slot, the indices are the template's
  ``Template.prepped_state_indices`` (the core's bounds: a slot at or past the component's
  slot limit or a negative one is :class:`kvplan.IndexBoundsError`), offset by where the
  component's rows start in the peer's lists. Every component's indices are computed and
  checked before SGLang's ``make_prepped_xfer`` and ``self._post_xfer`` run.

A subclass or an instance that replaces ``_send_prepared_states`` or one of SGLang's helpers
behind ``_prepare_state_xfer`` (``_plan_prepared_state_component``,
``_prepared_state_pairs``, ``_build_prepared_state_plan``) keeps SGLang's plans, and
``_send_prepared_states`` hands a plan kvplan did not build to SGLang's own method.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvplan import _core
from kvplan._core import Layout, Pairing, Template
from kvplan.compat.sglang.layouts import published_ids
from kvplan.compat.sglang.metrics import observe
from kvplan.compat.sglang.registry import NIXL_MANAGER, sglang_global, sglang_method

#: NIXL's prepared transfers take int32 descriptor indices.
_INT32_MAX = (1 << 31) - 1
#: SGLang's helpers behind its ``_prepare_state_xfer``; a replaced one keeps SGLang's plans.
_SGLANG_STATE_HELPERS = ("_plan_prepared_state_component", "_prepared_state_pairs",
                         "_build_prepared_state_plan")
_LIMIT = (1 << 64) - 1


@dataclass(frozen=True)
class PreparedComponent:
    """One state component of a peer's prepared lists: its template, its live entry pairs (the
    template's entry ``k`` is pair ``k``), and the first row of its runs in the prefill's and
    the decode's list."""

    template: Template
    pairs: tuple[tuple[int, int], ...]
    src_start: int
    dst_start: int


@dataclass(frozen=True)
class PreparedStates:
    """kvplan's prepared state plan of one decode peer (what SGLang's ``_PreparedStatePlan``
    is to its own methods): the two prepared list handles and the components they hold, by
    state component index."""

    src_handle: Any
    dst_handle: Any
    components: dict[int, PreparedComponent]


def prepared_states_are_kvplans(manager: Any) -> bool:
    """Whether kvplan plans ``manager``'s prepared states: its ``_send_prepared_states`` is
    kvplan's and SGLang's helpers behind ``_prepare_state_xfer`` are SGLang's own."""
    attrs = getattr(manager, "__dict__", None) or {}
    if any(name in attrs for name in ("_send_prepared_states", *_SGLANG_STATE_HELPERS)):
        return False
    send = getattr(type(manager), "_send_prepared_states", None)
    if not getattr(send, "_kvplan_dropin", False):
        return False
    return all(getattr(type(manager), name, None) is sglang_method(manager, name, NIXL_MANAGER)
               for name in _SGLANG_STATE_HELPERS)


def _entries(ptrs: Any, data_lens: Any, item_lens: Any, keep: list[int]
             ) -> tuple[list[int], list[int], list[int]]:
    bases = [int(ptrs[k]) for k in keep]
    items = [int(item_lens[k]) for k in keep]
    # a buffer is bounded by the address space; its registered length otherwise
    lens = [min(int(data_lens[k]), _LIMIT - b) for k, b in zip(keep, bases)]
    return bases, lens, items


def component_template(manager: Any, peer_info: Any, index: int
                       ) -> tuple[Template, list[tuple[int, int]]] | str:
    """The template of prepared state component ``index`` for decode peer ``peer_info`` and
    its live entry pairs ``(prefill entry, decode entry)`` (the template's entry ``k`` is pair
    ``k``), or
    SGLang's reason (``"tp-layout"``, ``"pool-geometry"``, ``"entry-pairing"``,
    ``"no-entries"``) for leaving the component to the per-request path.

    SGLang decides which components it can prepare (its ``_state_component_is_whole_slot``
    and ``_state_slot_capacities``, called); the core pairs the entries (by layer id with the
    positional fallback at PP 1; positionally, equal counts only, for an MHA backend's split
    layouts) and the template holds the live pairs, one state pair each, positionally.

    Raises:
        SizeMismatchError: Two paired live entries have different item strides (SGLang's
            layout rejection of the peer).
    """
    nth = sglang_global("_nth", NIXL_MANAGER)
    capacities = sglang_global("_state_slot_capacities", NIXL_MANAGER)
    kv_args = manager.kv_args
    state_type = kv_args.state_types[index]
    if not manager._state_component_is_whole_slot(state_type=state_type,
                                                  decode_tp_size=peer_info.decode_tp_size):
        return "tp-layout"
    src = (nth(kv_args.state_data_ptrs, index), nth(kv_args.state_data_lens, index),
           nth(kv_args.state_item_lens, index))
    dst = (nth(peer_info.dst_state_data_ptrs, index), nth(peer_info.dst_state_data_lens, index),
           nth(peer_info.dst_state_item_lens, index))
    src_caps = capacities(ptrs=src[0], data_lens=src[1], item_lens=src[2])
    dst_caps = capacities(ptrs=dst[0], data_lens=dst[1], item_lens=dst[2])
    if src_caps is None or dst_caps is None:
        return "pool-geometry"
    n_src, n_dst = len(src[0]), len(dst[0])
    flat = manager.is_mla_backend or state_type in sglang_global("_FLAT_STATE_TYPES",
                                                                 NIXL_MANAGER)
    try:
        if not flat:  # the MHA split layouts pair by position, counts equal
            if n_src != n_dst:
                return "entry-pairing"
            pairs = _core.pair_entries(None, None, n_src, n_dst)
        elif n_src != n_dst and getattr(kv_args, "mla_compression_ratios", None):
            return "entry-pairing"
        else:
            pairs = _core.pair_entries(published_ids(nth(kv_args.state_layer_ids, index)),
                                       published_ids(nth(peer_info.dst_state_layer_ids, index)),
                                       n_src, n_dst, manager.pp_size == 1)
    except _core.PairingError:
        return "entry-pairing"
    live = [(int(s), int(d)) for s, d in pairs.tolist() if src_caps[s] and dst_caps[d]]
    if not live:
        return "no-entries"
    s_bases, s_lens, s_items = _entries(*src, [s for s, _ in live])
    d_bases, d_lens, d_items = _entries(*dst, [d for _, d in live])
    kinds = ["state"] * len(live)
    try:
        template = Template(Layout(s_bases, s_lens, s_items, kinds=kinds),
                            Layout(d_bases, d_lens, d_items, kinds=kinds), Pairing.positional())
    except _core.KvPlanError as e:
        raise _in_component(e, index, live) from e
    return template, live


def _in_component(err: _core.KvPlanError, index: int, live: list[tuple[int, int]]
                  ) -> _core.KvPlanError:
    """``err`` (its class and kind kept) with the component and its entry pairs named: the
    core's entry ``k`` is the component's ``k``-th live pair."""
    out = type(err)(f"state component {index}, entry k being its k-th live pair of "
                    f"(prefill entry, decode entry) {live}: {err}")
    if hasattr(err, "kind"):
        out.kind = err.kind
    return out


def run_rows(runs: npt.NDArray[np.uint64], device: int) -> list[tuple[int, int, int, int, int]]:
    """A template's runs ``(base, len, stride, count)`` as NIXL's strided rows."""
    return [(int(b), int(n), int(device), int(s), int(c)) for b, n, s, c in runs.tolist()]


def _prepare_state_xfer(self: Any, peer_info: Any) -> None:
    """kvplan's ``NixlKVManager._prepare_state_xfer`` (SGLang 0.5.23 signature): SGLang's
    bookkeeping and logs, each prepared component's template (:func:`component_template`) and
    lists from the templates' runs (see the module docstring)."""
    if not prepared_states_are_kvplans(self):
        original = sglang_method(self, "_prepare_state_xfer", NIXL_MANAGER)
        return original(self, peer_info)  # type: ignore[no-any-return]
    logger = sglang_global("logger", NIXL_MANAGER)
    peer_name = peer_info.agent_name
    self._prepared_state_plans.pop(peer_name, None)
    self._state_layout_rejections.pop(peer_name, None)
    if not self._prepared_state_components:
        return None
    if peer_info.dst_dcp_size != 1 or peer_info.requires_dcp_relayout:
        reason: str | None = "dcp-peer"
    elif not peer_info.dst_state_data_lens:
        reason = "no-decode-pool-lengths"
    else:
        reason = None
    if reason is not None:
        logger.info("NIXL prepared state: peer=%s all generic reason=%s", peer_name, reason)
        return None
    planned: dict[int, tuple[Template, list[tuple[int, int]]]] = {}
    skipped: list[str] = []
    rejected: list[str] = []
    for index in sorted(self._prepared_state_components):
        try:
            out = component_template(self, peer_info, index)
        except _core.SizeMismatchError as e:
            rejected.append(f"NIXL prepared state ({self.kv_args.state_types[index]}) for peer "
                            f"{peer_name}: {e}")
            continue
        except _core.KvPlanError as e:
            # any other layout the core does not take: the per-request path plans it (or
            # refuses it, naming the values), never the bootstrap thread
            skipped.append(f"{index}:kvplan {type(e).__name__}: {e}")
            continue
        if isinstance(out, str):
            skipped.append(f"{index}:{out}")
        else:
            planned[index] = out
    if rejected:
        # as SGLang: every transfer to this peer fails, not the bootstrap thread
        self._state_layout_rejections[peer_name] = "; ".join(rejected)
        logger.error("NIXL state layout rejected: peer=%s %s", peer_name, rejected)
        return None
    plan = _build_plan(self, peer_info, planned)
    if plan is not None:
        self._prepared_state_plans[peer_name] = plan
    logger.info("NIXL prepared state: peer=%s prepared=%s generic=%s", peer_name,
                sorted(plan.components) if plan is not None else [], skipped)
    return None


def _build_plan(self: Any, peer_info: Any,
                planned: dict[int, tuple[Template, list[tuple[int, int]]]]
                ) -> PreparedStates | None:
    """The peer's two prepared lists (each component's runs, in component order) and the
    plan; None where SGLang's is None (nothing planned, no strided descriptors, indices past
    NIXL's int32, a list NIXL did not prepare)."""
    logger = sglang_global("logger", NIXL_MANAGER)
    if not planned or not self._use_strided_descs:
        return None
    peer_name = peer_info.agent_name
    src_rows: list[tuple[int, int, int, int, int]] = []
    dst_rows: list[tuple[int, int, int, int, int]] = []
    components: dict[int, PreparedComponent] = {}
    src_total = dst_total = 0
    for index, (template, live) in planned.items():
        src_runs = template.descriptor_runs("src")
        dst_runs = template.descriptor_runs("dst")
        components[index] = PreparedComponent(template, tuple(live), src_total, dst_total)
        src_rows += run_rows(src_runs, self.kv_args.gpu_id)
        dst_rows += run_rows(dst_runs, peer_info.gpu_id)
        src_total += int(src_runs[:, 3].sum(dtype=object))
        dst_total += int(dst_runs[:, 3].sum(dtype=object))
    if max(src_total, dst_total) > _INT32_MAX:  # SGLang's bound, NIXL's int32 indices
        logger.warning("NIXL prepared state: peer=%s all generic reason=index-space", peer_name)
        return None
    try:
        # strided rows only: a state pool holds millions of slots
        src_handle = self.agent.prep_xfer_dlist("", self._pack_stride_descs(src_rows), "VRAM")
        dst_handle = self.agent.prep_xfer_dlist(peer_name, self._pack_stride_descs(dst_rows),
                                                "VRAM")
    except TypeError:
        logger.warning_once("Installed NIXL does not support strided descriptors; "
                            "state transfers stay generic.")
        self._use_strided_descs = False
        return None
    except Exception as e:
        logger.warning("NIXL prepared state: peer=%s all generic, dlist creation failed: %s",
                       peer_name, e)
        return None
    if src_handle is None or dst_handle is None:
        return None
    return PreparedStates(src_handle, dst_handle, components)


def _slots(values: Any, side: str, index: int) -> list[int]:
    array = np.asarray(values)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise _core.KvPlanError(
            f"state component {index}: {side} state indices must be a 1-D integer sequence, "
            f"got {array.ndim}-D dtype {array.dtype}")
    return [int(v) for v in array.tolist()]


def state_selectors(self: Any, plan: PreparedStates, prefill_state_indices: Any,
                    dst_state_indices: Any) -> tuple[npt.NDArray[np.int32],
                                                     npt.NDArray[np.int32]] | None:
    """A request's indices into the peer's prepared lists, every component's (entry major,
    slot minor within a component, as SGLang orders them), or None when no component has
    indices. Refused, before anything is posted: different prefill and decode index counts
    of a component, other than one index for a Mamba component (:class:`kvplan.KvPlanError`),
    a negative slot or one at or past the component's slots on either side
    (:class:`kvplan.IndexBoundsError`, from the core)."""
    nth = sglang_global("_nth", NIXL_MANAGER)
    mamba = sglang_global("StateType", NIXL_MANAGER).MAMBA
    src_parts: list[npt.NDArray[np.int64]] = []
    dst_parts: list[npt.NDArray[np.int64]] = []
    for index, component in plan.components.items():
        src_indices = nth(prefill_state_indices, index, default=None)
        dst_indices = nth(dst_state_indices, index)
        if src_indices is None or len(src_indices) == 0:
            continue
        if len(src_indices) != len(dst_indices):
            raise _core.KvPlanError(
                f"state component {index}: {len(src_indices)} prefill state indices but "
                f"{len(dst_indices)} decode ones")
        if self.kv_args.state_types[index] == mamba and len(src_indices) != 1:
            raise _core.KvPlanError(
                f"state component {index} (Mamba): {len(src_indices)} state indices, a Mamba "
                f"state has one slot per request")
        src_slots = _slots(src_indices, "prefill", index)
        dst_slots = _slots(dst_indices, "decode", index)
        try:
            pairs = [component.template.prepped_state_indices(s, d)
                     for s, d in zip(src_slots, dst_slots)]
        except _core.KvPlanError as e:
            raise _in_component(e, index, list(component.pairs)) from e
        # (slots, entries) -> entry major, as SGLang's selectors
        src_parts.append(np.stack([p[0] for p in pairs]).T.ravel() + component.src_start)
        dst_parts.append(np.stack([p[1] for p in pairs]).T.ravel() + component.dst_start)
    if not src_parts:
        return None
    src, dst = np.concatenate(src_parts), np.concatenate(dst_parts)
    for side, values in (("source", src), ("destination", dst)):
        if values.size and int(values.max()) > _INT32_MAX:
            raise _core.IndexBoundsError(
                f"{side} prepared state index {int(values.max())} exceeds NIXL's int32 "
                f"indices (at most {_INT32_MAX})")
    return src.astype(np.int32), dst.astype(np.int32)


def _send_prepared_states(self: Any, *, plan: Any, prefill_state_indices: Any,
                          dst_state_indices: Any) -> Iterator[Any]:
    """kvplan's ``NixlKVManager._send_prepared_states`` (SGLang 0.5.23 signature): the
    request's indices (:func:`state_selectors`, all checked first), then SGLang's one
    ``make_prepped_xfer("WRITE", ...)``, the handle yielded to the chunk before
    ``self._post_xfer`` posts it. A plan kvplan did not build goes to SGLang's own method."""
    if not isinstance(plan, PreparedStates):
        original = sglang_method(self, "_send_prepared_states", NIXL_MANAGER)
        return original(self, plan=plan,  # type: ignore[no-any-return]
                        prefill_state_indices=prefill_state_indices,
                        dst_state_indices=dst_state_indices)
    started = time.perf_counter()
    selectors = state_selectors(self, plan, prefill_state_indices, dst_state_indices)
    observe(time.perf_counter() - started, 0 if selectors is None else len(selectors[0]))
    if selectors is None:
        return iter(())
    return _post_prepared(self, plan, *selectors)


def _post_prepared(self: Any, plan: PreparedStates, src: npt.NDArray[np.int32],
                   dst: npt.NDArray[np.int32]) -> Iterator[Any]:
    handle = self.agent.make_prepped_xfer("WRITE", plan.src_handle, src, plan.dst_handle, dst)
    if not handle:
        raise RuntimeError("Failed to create prepared state transfer")
    # the chunk owns the handle before posting, so a failed post settles too (as SGLang)
    yield handle
    self._post_xfer(handle, "Failed to post prepared state transfer")
