"""Which of SGLang's seams (the methods its send paths call on ``self``) a manager resolves to
SGLang's own function: kvplan's fast path stands in only for those."""

from __future__ import annotations

from typing import Any

from kvplan.compat.sglang.registry import ASCEND_MANAGER, sglang_impl


def owns_transfer_data(manager: Any) -> bool:
    return sglang_impl(manager, "_transfer_data") is not None


def mla_slicer(manager: Any) -> str | None:
    """Which of SGLang's ``get_mla_kv_ptrs_with_pp`` the manager uses: ``"common"`` (with the
    common ``_mla_kv_entry_span_with_pp``), ``"ascend"`` (NPU buffer groups), or None for
    anything else (kvplan then hands the call to SGLang's own method)."""
    impl = sglang_impl(manager, "get_mla_kv_ptrs_with_pp")
    if impl == ASCEND_MANAGER:
        return "ascend"
    if impl is not None and sglang_impl(manager, "_mla_kv_entry_span_with_pp") is not None:
        return "common"
    return None


def owns_mha_slicer(manager: Any) -> bool:
    return sglang_impl(manager, "get_mha_kv_ptrs_with_pp") is not None
