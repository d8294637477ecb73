"""Hypothesis strategies for deployments and requests, to check a planner or an engine against
:mod:`kvplan.testing.oracle` (as ``polars.testing.parametric`` does for data frames).

Importing this module needs ``hypothesis`` (``pip install hypothesis``); the rest of
:mod:`kvplan.testing` does not::

    from hypothesis import given
    from kvplan.testing.ranks import check_request
    from kvplan.testing.strategies import requests

    @given(requests())
    def test_every_byte(case):
        check_request(case.model, case.prefill, case.decode, case.src_pages, case.dst_pages,
                      n_tokens=case.n_tokens)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplan.testing.ranks import Model, Rank

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - exercised where hypothesis is missing
    raise ImportError("kvplan.testing.strategies needs hypothesis (pip install hypothesis); "
                      "kvplan.testing.oracle works without it") from exc

__all__ = ["Request", "models", "requests", "tp_sizes"]


@dataclass(frozen=True)
class Request:
    model: Model
    prefill: Rank
    decode: Rank
    src_pages: np.ndarray
    dst_pages: np.ndarray
    n_tokens: int | None


@st.composite
def tp_sizes(draw: Any, kv_heads: int, max_tp: int = 8) -> int:
    """A TP size that divides ``kv_heads`` or that ``kv_heads`` divides."""
    choices = [t for t in (1, 2, 4, 8) if t <= max_tp and (kv_heads % t == 0 or t % kv_heads == 0)]
    return int(draw(st.sampled_from(choices)))


@st.composite
def models(draw: Any) -> Model:
    mla = draw(st.booleans())
    kv_heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    state = draw(st.sampled_from([0, 0, 64]))
    return Model(layers=draw(st.integers(1, 3)), kv_heads=kv_heads,
                 head_dim=draw(st.sampled_from([2, 4])), dtype_size=draw(st.sampled_from([1, 2])),
                 mla=mla, state_bytes=state, sharded_state=draw(st.booleans()))


@st.composite
def requests(draw: Any, *, cross_layer: bool | None = None) -> Request:
    """A model, a prefill and a decode side (TP sizes, page sizes, memory orders, per-layer or
    cross-layer buffers) and one request: distinct pages on each side in token order, a token
    count that may end inside a page. ``decode.tp_rank`` is drawn; every prefill rank sends."""
    model = draw(models())
    tp_p, tp_d = draw(tp_sizes(model.kv_heads)), draw(tp_sizes(model.kv_heads))
    ps, pd = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    op, od = draw(st.sampled_from(["NHD", "HND"])), draw(st.sampled_from(["NHD", "HND"]))
    pools = [draw(st.booleans()) if cross_layer is None else cross_layer for _ in range(2)]
    n_tokens = draw(st.integers(1, 24))
    need_s, need_d = -(-n_tokens // ps), -(-n_tokens // pd)
    cap_s, cap_d = need_s + draw(st.integers(0, 3)), need_d + draw(st.integers(0, 3))
    src_pages = np.array(draw(st.permutations(range(cap_s)))[:need_s], dtype=np.int64)
    dst_pages = np.array(draw(st.permutations(range(cap_d)))[:need_d], dtype=np.int64)
    given = draw(st.booleans()) or n_tokens % ps != 0 or n_tokens % pd != 0 or \
        need_s * ps != need_d * pd
    prefill = Rank(0, tp_p, ps, op, cap_s, pools[0])
    decode = Rank(draw(st.integers(0, tp_d - 1)), tp_d, pd, od, cap_d, pools[1])
    return Request(model, prefill, decode, src_pages, dst_pages, n_tokens if given else None)
