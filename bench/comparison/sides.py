"""One request on both planners: SGLang's real manager and a cached ``kvplan.Template``, and
the check that their blocks are identical."""

from __future__ import annotations

from typing import Any

import numpy as np
from support import sglang_loader

from . import KVPLAN as kvplan
from .scenarios import Built

SESSION = "bench"


class SGLangSide:
    def __init__(self, sg, b: Built):
        sc = b.sc
        self.b = b
        kw = dict(is_mla_backend=sc.kind == "mla", pp_size=sc.pp_size,
                  prefill_start_layer=sc.start_layer)
        self.m_plan = sg.make_manager(handoff=False, **kw)
        self.m_hand = sg.make_manager(handoff=True, **kw)
        self.args = (b.src_ptrs, b.dst_ptrs, b.item_lens, b.src_pages, b.dst_pages)
        self.kw = dict(src_layer_ids=b.src_ids, dst_layer_ids=b.dst_ids)

    def plan(self):
        self.m_plan.blocks.calls.clear()
        rc = self.m_plan.send(*self.args, **self.kw)
        assert rc == 0

    def handoff(self):
        self.m_hand.engine.calls.clear()
        rc = self.m_hand.send(*self.args, **self.kw)
        assert rc == 0

    def result_lists(self):
        self.handoff()
        calls = self.m_hand.engine.calls
        assert len(calls) == 1, len(calls)
        _, s, d, n = calls[0]
        return s, d, n

    def reset(self):
        self.m_plan.blocks.calls.clear()
        self.m_hand.engine.calls.clear()


def kvplan_template(core: Any, b: Built) -> Any:
    """The scenario's template built through ``core``'s classes (``kvplan``, or another build's
    ``_core`` module: ``bench/build_ab.py``)."""
    sc = b.sc
    ctx = dict(page_size=sc.page_size)
    if sc.kind == "mla":
        src = core.Layout.mla(b.src_ptrs, b.src_lens, b.item_lens, **ctx)
        dst = core.Layout.mla(b.dst_ptrs, b.dst_lens, b.dst_item_lens, **ctx)
        fallback = sc.pp_size == 1
    elif sc.kind == "mha":
        h, hd = len(b.src_ptrs) // 2, len(b.dst_ptrs) // 2
        src = core.Layout.mha(b.src_ptrs[:h], b.src_ptrs[h:], b.src_lens[:h], b.src_lens[h:],
                              b.item_lens[:h], b.item_lens[h:], **ctx)
        dst = core.Layout.mha(b.dst_ptrs[:hd], b.dst_ptrs[hd:], b.dst_lens[:hd],
                              b.dst_lens[hd:], b.dst_item_lens[:hd], b.dst_item_lens[hd:], **ctx)
        fallback = sc.pp_size == 1
    else:
        src = core.Layout.hybrid_linear(sc.src_ids, b.src_ptrs, b.src_lens, b.item_lens,
                                        mla=False, pp_rank=sc.pp_rank, pp_size=sc.pp_size, **ctx)
        dst = core.Layout.hybrid_linear(sc.dst_ids, b.dst_ptrs, b.dst_lens, b.dst_item_lens,
                                        mla=False, **ctx)
        fallback = False
    return core.Template(src, dst, core.Pairing.by_layer_id(allow_positional_fallback=fallback))


class KvplanSide:
    def __init__(self, b: Built):
        self.b = b
        self.template = kvplan_template(kvplan, b)
        self.s, self.d = b.src_pages, b.dst_pages
        first = self.template.plan(self.s, self.d)
        self.n_blocks = int(first.n_blocks)
        self.out = np.empty((3, max(self.n_blocks, 1)), dtype=np.uint64)
        self.template.plan(self.s, self.d, out=self.out)  # warm the caller buffer
        del first
        self.engine = sglang_loader.RecordingEngine()
        self._keep, self._held = [], []
        self._misses0 = 0
        self.fresh_checked = 0

    def pooled(self):
        self.template.plan(self.s, self.d)

    def out_(self):
        self.template.plan(self.s, self.d, out=self.out)

    def fresh_before(self):
        """Untimed: take every pooled buffer this plan could reuse (hold them), so the timed
        calls all miss the pool and write into newly allocated, never-touched memory."""
        _, _, _, misses = kvplan._core.pool_stats()
        while True:
            self._held.append(self.template.plan(self.s, self.d))
            _, _, _, now = kvplan._core.pool_stats()
            if now > misses:
                break
        self._misses0 = now

    def fresh(self):
        self._keep.append(self.template.plan(self.s, self.d))

    def fresh_after(self):
        _, _, _, now = kvplan._core.pool_stats()
        assert now - self._misses0 == len(self._keep), "a fresh call reused a pooled buffer"
        self.fresh_checked += len(self._keep)
        self._keep.clear()
        self._held.clear()

    def handoff(self):
        self.engine.calls.clear()
        p = self.template.plan(self.s, self.d)
        s, d, n = p.as_lists()
        self.engine.batch_transfer_sync(SESSION, s, d, n)

    def reset(self):
        self._keep.clear()
        self.engine.calls.clear()

    def result(self):
        return self.template.plan(self.s, self.d)


def identical(sg_lists, plan) -> None:
    s, d, n = sg_lists
    assert plan.n_blocks == len(s), (plan.n_blocks, len(s))
    for name, ref, got in (("src", s, plan.src_addrs), ("dst", d, plan.dst_addrs),
                           ("len", n, plan.lengths)):
        ref_a = np.fromiter(ref, dtype=np.uint64, count=len(ref))
        got_a = np.asarray(got)
        if not np.array_equal(ref_a, got_a):
            bad = int(np.flatnonzero(ref_a != got_a)[0])
            raise AssertionError(f"{name} differs at block {bad}: sglang {ref[bad]} kvplan "
                                 f"{int(got_a[bad])}")
