"""Host-memory stand-ins for SGLang 0.5.23's staged transfer (``send_kvcache_staged``) and the
byte-level meaning of its two GPU kernels, for the drop-in tests.

SGLang's staged path moves one request's KV in three steps: the prefill's
``gather_all_layers_to_staging`` packs the heads it sends into its staging buffer, the engine
moves ``transfer_blocks`` from there into the decode's staging region, and the decode's
``scatter_staging_to_kv`` unpacks every writer's part of the region into its pages. The kernels
need torch on a GPU; the loader replaces them with recorders (``support.sglang_loader``), and
this module gives what they would write, from their definitions in ``staging_buffer.py``:

* a pool tensor is ``[pool tokens][heads of this rank][head_dim]`` (token ``page * page_size +
  t`` of page ``page``);
* the gather writes, from the staging buffer's start, every K layer then every V layer (the
  prefill's slot order), each ``[request tokens][sent heads][head_dim]`` for the heads
  ``src_head_start .. + num_heads`` of the prefill rank, tokens in page-list order;
* the decode region holds one part per writer (``compute_staging_layout``: writer ``w`` at the
  sum of the earlier writers' bytes), each laid out like a gather over the decode's slots (all
  decode K layers then all decode V layers); the scatter writes writer ``w``'s part into the
  heads starting at ``compute_head_slice_params(tp_p, tp_d, w, dst_tp_rank, heads)[2]`` of every
  decode slot, writers in order (a later writer's bytes win).

Memory is numpy: :class:`HostTensor` wraps an array as the pool tensors SGLang reads
(``shape``, ``element_size()``, ``data_ptr()``), :func:`staging_buffer` builds SGLang's real
``StagingBuffer`` (its ``get_ptr`` / ``get_size`` / ``fits``) over a numpy array, and
:class:`HostMemory` moves engine blocks between registered arrays by address, refusing a block
that leaves them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]


class HostTensor:
    """A pool tensor of one layer on the host: ``[pool tokens, heads, head_dim]`` of ``dtype``,
    with the three methods SGLang's staged path reads."""

    def __init__(self, array: npt.NDArray[Any]):
        assert array.ndim == 3 and array.flags.c_contiguous
        self.array = array
        self.shape = array.shape
        self.dtype = array.dtype

    def element_size(self) -> int:
        return int(self.array.itemsize)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def bytes(self) -> U8:
        """The tensor's memory as bytes (a view)."""
        return self.array.reshape(-1).view(np.uint8)


def pool(rng: np.random.Generator, tokens: int, heads: int, head_dim: int,
         dtype: Any = np.uint16) -> HostTensor:
    """A pool tensor filled with random values."""
    info = np.iinfo(dtype)
    a = rng.integers(info.min, info.max, size=(tokens, heads, head_dim), endpoint=True)
    return HostTensor(np.ascontiguousarray(a.astype(dtype)))


def staging_buffer(sg: Any, nbytes: int, fill: int = 0xEE) -> Any:
    """SGLang's own ``StagingBuffer`` (built without its GPU ``__init__``) over a host array of
    ``nbytes`` bytes filled with ``fill``: ``get_ptr()``, ``get_size()`` and ``fits()`` are the
    wheel's. The array is its ``buffer`` attribute, as in SGLang (a uint8 tensor there)."""
    buf = object.__new__(sg.StagingBuffer)
    buf.buffer = np.full(max(nbytes, 1), fill, dtype=np.uint8)
    buf.data_ptr = int(buf.buffer.ctypes.data)
    buf.size_bytes = int(nbytes)
    return buf


def _tokens(pages: Sequence[int], page_size: int) -> npt.NDArray[np.int64]:
    p = np.asarray(pages, dtype=np.int64)
    return (p[:, None] * page_size + np.arange(page_size)).reshape(-1)


def gather_semantics(call: dict[str, Any]) -> U8:
    """The bytes SGLang's ``gather_all_layers_to_staging`` writes from the staging buffer's
    start for one recorded call (its arguments by name)."""
    tokens = _tokens(call["page_indices_np"], call["page_size"])
    h0, nh = call["src_head_start"], call["num_heads"]
    parts = [t.array[tokens, h0:h0 + nh, :].reshape(-1).view(np.uint8)
             for t in (*call["k_buffers"], *call["v_buffers"])]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def run_gather(call: dict[str, Any]) -> int:
    """Apply :func:`gather_semantics` to the call's staging buffer; returns the bytes written."""
    data = gather_semantics(call)
    buf = call["staging_buffer"]
    assert data.size <= buf.size_bytes, "the gather would overrun the staging buffer"
    buf.buffer[:data.size] = data
    return int(data.size)


def scatter_semantics(staging_view: U8, k_buffers: Sequence[HostTensor],
                      v_buffers: Sequence[HostTensor], page_idx: Sequence[int], page_size: int,
                      prefill_attn_tp_size: int, decode_attn_tp_size: int, dst_tp_rank: int,
                      total_kv_heads: int, head_slice_params: Callable[..., Any]) -> None:
    """What SGLang's ``scatter_staging_to_kv`` writes into the decode's pool tensors (in place),
    reading the decode staging region ``staging_view`` (bytes from the region's start).
    ``head_slice_params`` is SGLang's ``compute_head_slice_params``."""
    tokens = _tokens(page_idx, page_size)
    writers = (prefill_attn_tp_size // max(1, decode_attn_tp_size)
               if prefill_attn_tp_size > decode_attn_tp_size else 1)
    offset = 0
    for w in range(writers):
        _, nh, h0, _ = head_slice_params(prefill_attn_tp_size, decode_attn_tp_size, w,
                                         dst_tp_rank, total_kv_heads)
        for t in (*k_buffers, *v_buffers):
            n = len(tokens) * nh * t.shape[-1] * t.element_size()
            part = staging_view[offset:offset + n]
            assert part.size == n, "the scatter would read past the staging region"
            t.array[tokens, h0:h0 + nh, :] = part.view(t.dtype).reshape(len(tokens), nh, -1)
            offset += n


def run_scatter(call: dict[str, Any], head_slice_params: Callable[..., Any]) -> None:
    """Apply :func:`scatter_semantics` to one recorded ``scatter_staging_to_kv`` call."""
    scatter_semantics(call["staging_buffer_view"], call["k_buffers"], call["v_buffers"],
                      call["page_idx_tensor"], call["page_size"], call["prefill_attn_tp_size"],
                      call["decode_attn_tp_size"], call["dst_tp_rank"], call["total_kv_heads"],
                      head_slice_params)


class HostMemory:
    """Registered host arrays addressed by their real addresses; :meth:`apply` moves engine
    blocks ``(src, dst, length)`` between them as an engine would, and fails on a block that
    does not lie inside one registered array."""

    def __init__(self, arrays: Iterable[npt.NDArray[Any]] = ()):
        self.regions: list[tuple[int, U8]] = []
        for a in arrays:
            self.add(a)

    def add(self, array: npt.NDArray[Any]) -> None:
        b = array.reshape(-1).view(np.uint8)
        self.regions.append((int(b.ctypes.data), b))

    def view(self, addr: int, length: int) -> U8:
        for base, b in self.regions:
            if base <= addr and addr + length <= base + b.size:
                return b[addr - base:addr - base + length]
        raise AssertionError(f"block [{addr:#x}, +{length}) is outside every registered array")

    def apply(self, blocks: Iterable[tuple[int, int, int]]) -> None:
        for src, dst, length in blocks:
            self.view(dst, length)[:] = self.view(src, length)


def byte_map(blocks: Iterable[tuple[int, int, int]]) -> dict[int, int]:
    """Destination byte -> source byte of a block list; a destination byte written twice
    fails (block lists compare equal as byte maps however they are merged)."""
    out: dict[int, int] = {}
    for src, dst, length in blocks:
        for k in range(length):
            assert dst + k not in out, f"destination byte {dst + k:#x} written twice"
            out[dst + k] = src + k
    return out


def range_map(blocks: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The same comparison as :func:`byte_map` for large blocks: maximal ``(dst, src, length)``
    runs sorted by destination (equal for two lists iff their byte maps are equal)."""
    out: list[list[int]] = []
    for src, dst, length in sorted((b for b in blocks if b[2]), key=lambda b: b[1]):
        if out:
            pd, ps, pn = out[-1]
            assert pd + pn <= dst, f"destination bytes written twice at {dst:#x}"
            if pd + pn == dst and ps + pn == src:
                out[-1][2] += length
                continue
        out.append([dst, src, length])
    return [(d, s, n) for d, s, n in out]


# --------------------------------------------------------------------------------------------
# A staged deployment: prefill TP x PP ranks writing into one decode rank's staging region
# --------------------------------------------------------------------------------------------
SESSION = "decode-peer:1"
POOL_PAGES = 16  # pages of every pool tensor


def first_head(heads: int, tp: int, rank: int) -> int:
    """The first global KV head of TP rank ``rank`` (SGLang's MHA pools: an even split, or
    ``tp / heads`` consecutive ranks holding one head)."""
    return rank * heads // tp if heads >= tp else rank // (tp // heads)


def asked(tp_p: int, tp_d: int, r_d: int) -> list[int]:
    """Prefill TP ranks SGLang 0.5.23's decode rank ``r_d`` asks for KV (its target ranks)."""
    if tp_d > tp_p:
        return [r_d // (tp_d // tp_p)]
    k = tp_p // tp_d
    return list(range(r_d * k, (r_d + 1) * k))


class StagedWorld:
    """One request of ``layers`` MHA layers, ``heads`` KV heads of ``head_dim`` uint16 values,
    pages of ``page`` tokens, from prefill TP ``tp_p`` x PP ``pp`` to decode rank ``r_d`` of TP
    ``tp_d`` (PP 1), all on host memory.

    ``truth[kind][layer]`` is ``[request tokens, heads, head_dim]``; every prefill rank's pools
    hold its heads of it at ``src_pages`` (other pool tokens random), the decode's pools are
    random; :meth:`check_decode` says whether the decode rank's pools hold its heads at
    ``dst_pages``. The decode staging region is ``region`` bytes at ``region_offset`` of a
    larger array (so an overrun shows)."""

    def __init__(self, sg: Any, *, heads: int, tp_p: int, tp_d: int, r_d: int, pp: int = 1,
                 layers: int = 4, page: int = 2, head_dim: int = 4,
                 src_pages: Sequence[int] = (3, 0, 7), dst_pages: Sequence[int] = (5, 9, 2),
                 ids: bool = True, seed: int = 0, region_slack: int = 0,
                 src_staging_slack: int = 0):
        self.sg, self.heads, self.tp_p, self.tp_d, self.r_d = sg, heads, tp_p, tp_d, r_d
        self.pp, self.layers, self.page, self.head_dim, self.ids = pp, layers, page, head_dim, ids
        self.src_pages = np.asarray(src_pages, dtype=np.int32)
        self.dst_pages = np.asarray(dst_pages, dtype=np.int32)
        self.rng = np.random.default_rng(seed)
        n_tokens = len(self.src_pages) * page
        self.truth = {kind: [self.rng.integers(0, 1 << 16, size=(n_tokens, heads, head_dim),
                                               dtype=np.uint16) for _ in range(layers)]
                      for kind in "kv"}
        self.src_hpr = max(1, heads // tp_p)
        self.dst_hpr = max(1, heads // tp_d)
        self.head_bytes = head_dim * 2
        writers = tp_p // tp_d if tp_p > tp_d else 1
        sent = self.src_hpr if tp_p > tp_d else self.dst_hpr
        self.writer_bytes = n_tokens * sent * self.head_bytes * layers * 2
        self.region = writers * self.writer_bytes + region_slack
        self.region_offset = 64
        self.decode_memory = np.full(self.region_offset + self.region + 64, 0xEE, np.uint8)
        self.decode = {kind: [pool(self.rng, POOL_PAGES * page, self.dst_hpr, head_dim)
                              for _ in range(layers)] for kind in "kv"}
        self.src_staging_slack = src_staging_slack

    # the two sides' lists -------------------------------------------------------------------
    def stage_layers(self, stage: int) -> list[int]:
        n = self.layers // self.pp
        return list(range(stage * n, (stage + 1) * n))

    @property
    def region_ptr(self) -> int:
        return int(self.decode_memory.ctypes.data) + self.region_offset

    def region_view(self) -> U8:
        return self.decode_memory[self.region_offset:self.region_offset + self.region]

    def dst_layer_ids(self) -> list[int]:
        return list(range(self.layers)) * 2

    def dst_item_len(self) -> int:
        return self.page * self.dst_hpr * self.head_bytes

    def prefill_pools(self, stage: int, r_p: int) -> tuple[list[HostTensor], list[HostTensor]]:
        first = first_head(self.heads, self.tp_p, r_p)
        src_tokens = _tokens(self.src_pages, self.page)
        inside = (src_tokens >= 0) & (src_tokens < POOL_PAGES * self.page)  # bad pages: none
        out: dict[str, list[HostTensor]] = {}
        for kind in "kv":
            out[kind] = []
            for layer in self.stage_layers(stage):
                t = pool(self.rng, POOL_PAGES * self.page, self.src_hpr, self.head_dim)
                t.array[src_tokens[inside]] = self.truth[kind][layer][
                    inside, first:first + self.src_hpr]
                out[kind].append(t)
        return out["k"], out["v"]

    def manager(self, cls: type, stage: int, r_p: int, *, engine: Any = None,
                **attrs: Any) -> Any:
        """SGLang's real ``cls`` (built without ``__init__``) for prefill TP rank ``r_p`` of PP
        stage ``stage``, with its pools in ``kv_buffer_tensors`` and a staging buffer of the
        bytes it gathers (plus ``src_staging_slack``) as ``mgr.staging``."""
        from support import sglang_loader

        k, v = self.prefill_pools(stage, r_p)
        lids = self.stage_layers(stage) * 2 if self.ids else []
        kv_args = _ns(
            kv_data_ptrs=[t.data_ptr() for t in (*k, *v)],
            kv_data_lens=[t.nbytes for t in (*k, *v)],
            kv_item_lens=[self.page * self.src_hpr * self.head_bytes] * (2 * len(k)),
            kv_layer_ids=lids, page_size=self.page, total_kv_head_num=self.heads,
            kv_head_num=self.src_hpr, engine_rank=r_p, pp_rank=stage,
            prefill_start_layer=self.stage_layers(stage)[0])
        mgr = sglang_loader.manager_object(
            self.sg, cls, kv_args=kv_args, engine=engine, attn_tp_size=self.tp_p,
            pp_size=self.pp, kv_buffer_tensors=dict(
                k_buffers=k, v_buffers=v, page_size=self.page,
                slot_layer_ids=list(lids)), **attrs)
        sent = self.src_hpr if self.tp_p > self.tp_d else self.dst_hpr
        gathered = len(self.src_pages) * self.page * sent * self.head_bytes * 2 * len(k)
        mgr.staging = staging_buffer(self.sg, gathered + self.src_staging_slack)
        return mgr

    def send(self, mgr: Any, **overrides: Any) -> Any:
        """``mgr.send_kvcache_staged(...)`` as SGLang's ``PrefillStagingStrategy`` calls it."""
        return mgr.send_kvcache_staged(**self.call(mgr, **overrides))

    def call(self, mgr: Any, **overrides: Any) -> dict[str, Any]:
        """The keyword arguments of that call."""
        kw: dict[str, Any] = dict(
            mooncake_session_id=SESSION, prefill_kv_indices=self.src_pages,
            dst_staging_ptr=self.region_ptr, dst_staging_size=self.region,
            dst_tp_rank=self.r_d, dst_attn_tp_size=self.tp_d, dst_kv_item_len=self.dst_item_len(),
            dst_layer_ids=self.dst_layer_ids(), staging_buffer=mgr.staging,
            dst_slot_layer_ids=self.dst_layer_ids() if self.ids else None)
        kw.update(overrides)
        return kw

    def memory(self, mgr: Any) -> HostMemory:
        """The engine's view: the prefill staging buffer and the decode's memory."""
        return HostMemory([mgr.staging.buffer, self.decode_memory])

    def scatter(self) -> None:
        """The decode's ``scatter_staging_to_kv`` over the whole region, as SGLang calls it."""
        scatter_semantics(self.region_view(), self.decode["k"], self.decode["v"],
                          self.dst_pages, self.page, self.tp_p, self.tp_d, self.r_d,
                          self.heads, self.sg.compute_head_slice_params)

    def check_decode(self) -> None:
        """The decode rank's pools hold its heads of the truth at ``dst_pages``."""
        first = first_head(self.heads, self.tp_d, self.r_d)
        tokens = _tokens(self.dst_pages, self.page)
        for kind in "kv":
            for layer in range(self.layers):
                got = self.decode[kind][layer].array[tokens]
                want = self.truth[kind][layer][:, first:first + self.dst_hpr]
                assert np.array_equal(got, want), (kind, layer)


def _ns(**kw: Any) -> Any:
    import types

    return types.SimpleNamespace(**kw)
