"""What Python reads from the core instead of re-deriving it: the typed kind of an error, the
role classification, the page-or-token choice and the block offsets of every plan."""

from __future__ import annotations

import numpy as np
import pytest

import kvplan
from kvplan import Layout, SizeMismatchError, compare
from kvplan import _core
from kvplan._roles import MHA_ROLES


def mha(base: int, *, head_dim: int = 2, page_size: int = 4, **ctx: object) -> Layout:
    tp = int(ctx.get("tp_size", 1))  # type: ignore[call-overload]
    item = page_size * (2 // tp) * head_dim * 2
    return Layout.mha([base], [base + 0x10000], [item * 8], [item * 8], item, item,
                      layer_ids=[0], page_size=page_size, kv_heads=2, head_dim=head_dim,
                      dtype_size=2, **ctx)  # type: ignore[arg-type]


def test_errors_carry_the_core_kind_and_the_report_reads_it_not_the_message():
    with pytest.raises(SizeMismatchError) as head:
        kvplan.Template(mha(0x1000), mha(0x100000, head_dim=4))
    assert head.value.kind == "head_slicing"
    assert str(head.value).startswith("head slicing: head dims differ")
    # Same class, other family: plain item size mismatch.
    small = Layout.mla([0x1000], [1024], 64, [0])
    large = Layout.mla([0x100000], [1024], 128, [0])
    with pytest.raises(SizeMismatchError) as size:
        kvplan.Template(small, large)
    assert size.value.kind == "size_mismatch"
    report = compare(small, large)
    assert [e.src_index for e in report.size_mismatches] == [0]
    # A head-sliced item of the wrong size is a head-slicing problem, not a size mismatch.
    p = mha(0x1000, tp_size=2, tp_rank=0)
    d = Layout.mha([0x100000], [0x110000], [1 << 12] * 1, [1 << 12], 40, 40, layer_ids=[0],
                   page_size=4, kv_heads=2, head_dim=2, dtype_size=2)
    report = compare(p, d)
    assert not report.compatible and report.size_mismatches == ()
    assert report.entries[0].exception is not None
    assert report.entries[0].exception.kind == "head_slicing"
    assert kvplan.KvPlanError("raised by Python").kind == "other"


def test_roles_and_the_token_choice_come_from_the_core():
    assert MHA_ROLES == frozenset(_core.MHA_ROLES) == frozenset({"k", "v"})
    assert _core.needs_tokens(mha(0x1000, page_size=4), mha(0x100000, page_size=8))
    assert _core.needs_tokens(mha(0x1000), mha(0x100000, memory_order="HND"))
    assert not _core.needs_tokens(mha(0x1000), mha(0x100000))


def test_block_offsets_partition_page_token_and_state_plans():
    src = Layout.mla([0x1000, 0x9000], [4096, 4096], 64, [0, 1]).with_state(
        "conv", [0x20000, 0x30000], [1024, 1024], [0, 32], [0, 1])
    dst = Layout.mla([0x100000, 0x109000], [4096, 4096], 64, [0, 1]).with_state(
        "conv", [0x120000, 0x130000], [1024, 1024], [0, 32], [0, 1])
    t = kvplan.Template(src, dst)
    pages = np.array([0, 1, 3], dtype=np.int64)
    page_plan = t.plan(pages, pages)
    assert list(page_plan.pair_offsets) == [0, 2, 4] and list(page_plan.group_offsets) == [0, 2, 4]
    token_plan = t.plan(pages, pages, n_tokens=2)
    assert list(token_plan.pair_offsets) == [0, 1, 2]
    state = t.plan_state(1, 2)
    # The elided state pair owns no block, the other one block.
    assert list(state.pair_offsets) == [0, 0, 1] and list(state.pair_groups) == [-1, 0]
    assert state.pair_blocks(1) == slice(0, 1, 1)
    with pytest.raises(IndexError):
        state.group_blocks(1)
