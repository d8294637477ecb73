"""The TP-pair rules: which reads between differing TP sizes are staged, said once if not.

:func:`_tp_pair_staged` takes TP sizes that are equal or that vLLM slices heads between;
:func:`_say_unstaged` says once per prefill engine that its reads stay vLLM's."""

from __future__ import annotations

from typing import Any

from kvplan.compat.vllm.nixl_staging.worker import _staging_log


#: The worker attribute holding the prefill engines whose TP pair was said unstaged.
UNSTAGED_TP_ATTR = "_kvplan_unstaged_tp"


def _say_unstaged(worker: Any, engine: str, remote_tp: int, why: str) -> None:
    """Say once per prefill engine that its reads are vLLM's own (INFO: a configuration, not a
    failure)."""
    said = worker.__dict__.setdefault(UNSTAGED_TP_ATTR, set())
    if engine in said:
        return
    said.add(engine)
    _staging_log.info(
        "kvplan staging: reads of engine %s (TP %d) by this decode (TP %d) are vLLM's own: %s",
        engine, remote_tp, int(worker.__dict__.get("world_size", 1) or 1), why)


def _tp_pair_staged(worker: Any, engine: str, remote_tp: int, remote: Any, local: Any) -> bool:
    """Whether a read between the prefill's TP size ``remote_tp`` and this decode's may be
    staged: the same size; or one dividing the other (as vLLM's NIXL connector requires)
    with MLA (every rank holds the whole latent, read from one prefill rank), or with whole
    KV heads per rank on both sides in blocks whose heads are outermost (``remote`` and
    ``local`` ``HND``, the layout vLLM slices heads in: a decode rank's heads are one range
    of the prefill rank's block, or the prefill rank's one range of the decode's). KV heads
    fewer than a TP size (vLLM then reads one rank of those that hold a head alike) stay
    vLLM's. A pair not staged is said once per prefill engine."""
    local_tp = int(worker.__dict__.get("world_size", 1) or 1)
    if remote_tp == local_tp:
        return True
    if remote_tp < 1 or max(remote_tp, local_tp) % min(remote_tp, local_tp):
        why = "neither TP size divides the other"
    elif worker.__dict__.get("use_mla"):
        return True
    elif not remote.kv_heads or remote.kv_heads != local.kv_heads:
        why = f"the KV heads differ ({remote.kv_heads} and {local.kv_heads})"
    elif remote.kv_heads % max(remote_tp, local_tp):
        why = (f"{remote.kv_heads} KV heads are not whole per rank at TP "
               f"{max(remote_tp, local_tp)}")
    elif remote.memory_order != "HND" or local.memory_order != "HND":
        why = (f"head slices need blocks with the heads outermost (LBHNC) on both sides, not "
               f"{remote.memory_order} and {local.memory_order}")
    else:
        return True
    _say_unstaged(worker, engine, remote_tp, why)
    return False
