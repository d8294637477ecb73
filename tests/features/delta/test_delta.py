"""Delta plans (``plan(..., skip_tokens=K)``): the decode holds a request's first K tokens (a
prefix it cached) and the plan moves tokens K.. only. Against the byte oracle: the decode starts
with the oracle's first K tokens, the delta is applied, and the decode must then hold exactly
the oracle's whole request, for any K (inside a page too), page-size ratios, TP slicing, memory
orders and cross-layer pools."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvplan
from kvplan.testing.ranks import Model, Rank, check_request, rank_memory
from kvplan.testing.strategies import Request, requests


@st.composite
def delta_requests(draw: st.DrawFn) -> tuple[Request, int]:
    case = draw(requests())
    n = case.n_tokens
    if n is None:  # whole pages on both sides
        n = min(len(case.src_pages) * case.prefill.page_size,
                len(case.dst_pages) * case.decode.page_size)
    return case, draw(st.integers(0, n))


@settings(max_examples=1500)
@given(delta_requests())
def test_the_held_prefix_and_the_delta_are_the_whole_request(drawn: tuple[Request, int]) -> None:
    case, skip = drawn
    check_request(case.model, case.prefill, case.decode, case.src_pages, case.dst_pages,
                  n_tokens=case.n_tokens, skip_tokens=skip)


def pair(page_sizes: tuple[int, int] = (4, 4)) -> tuple[kvplan.Template, Model]:
    model = Model(layers=2, kv_heads=2, head_dim=4, dtype_size=2)
    src = rank_memory(model, Rank(0, 1, page_sizes[0], "NHD", 16), seed=1)
    dst = rank_memory(model, Rank(0, 1, page_sizes[1], "NHD", 16))
    return kvplan.Template(src.layout, dst.layout), model


def test_a_page_template_plans_a_delta_by_token_and_moves_only_the_tail() -> None:
    t, model = pair()
    pages = np.arange(4, dtype=np.int64)
    whole = t.plan(pages, pages)
    token_bytes = whole.total_bytes // 16
    for skip in (0, 1, 3, 4, 5, 15, 16):
        delta = t.plan(pages, pages, skip_tokens=skip)
        assert delta.total_bytes == (16 - skip) * token_bytes, skip
        assert delta.skip_tokens == skip
    # Pages contiguous on both sides: still one block per entry pair.
    assert len(t.plan(pages, pages, skip_tokens=5)) == len(whole)


def test_pages_before_the_first_moved_token_are_not_read() -> None:
    t, _ = pair()
    pages = np.array([-1, -1, 2, 3], dtype=np.int64)  # the decode's cached prefix: not read
    delta = t.plan(pages, pages, skip_tokens=8)
    assert delta.total_bytes > 0
    with pytest.raises(kvplan.IndexBoundsError):
        t.plan(pages, pages, skip_tokens=7)  # token 7 lives in page position 1


def test_a_skip_past_the_request_is_refused_naming_both_counts() -> None:
    t, _ = pair((4, 2))
    src, dst = np.arange(3, dtype=np.int64), np.arange(5, dtype=np.int64)
    with pytest.raises(kvplan.KvPlanError, match="skip_tokens 11 is past the request's 10 "
                                                 "tokens") as e:
        t.plan(src, dst, n_tokens=10, skip_tokens=11)
    assert e.value.kind == "skip_tokens"
    assert len(t.plan(src, dst, n_tokens=10, skip_tokens=10)) == 0
    with pytest.raises(OverflowError):
        t.plan(src, dst, skip_tokens=-1)


def test_the_digest_covers_the_skip_count() -> None:
    t, _ = pair()
    pages = np.arange(4, dtype=np.int64)
    whole = t.plan(pages, pages)
    assert t.plan(pages, pages, skip_tokens=0).digest() == whole.digest()
    digests = {t.plan(pages, pages, skip_tokens=k).digest() for k in range(17)}
    assert len(digests) == 17
    # A delta that happens to move the same blocks as another plan still digests differently.
    aligned = t.plan(pages, pages, skip_tokens=4)
    tail = t.plan(pages[1:], pages[1:])
    assert [c.tolist() for c in (aligned.src_addrs, aligned.dst_addrs, aligned.lengths)] == \
        [c.tolist() for c in (tail.src_addrs, tail.dst_addrs, tail.lengths)]
    assert aligned.digest() != tail.digest()
