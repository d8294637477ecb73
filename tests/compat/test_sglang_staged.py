"""SGLang 0.5.23's staged transfer (``MooncakeKVManager.send_kvcache_staged``), real code from
the wheel, on host memory.

SGLang's GPU gather and scatter kernels are replaced by recorders (``support.sglang_loader``);
``support.sglang_staging`` applies their byte-level semantics to the recorded calls, the
engine's blocks move bytes between numpy arrays, and the decode's pools are checked against the
ground truth: every decode head of every layer at the decode's pages.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from support.sglang_models import engine_blocks, load_loader, load_sglang_or_fail
from support.sglang_staging import StagedWorld, asked, run_gather

HEADS = (1, 2, 8, 16)
TPS = (1, 2, 4, 8)
CASES = [(h, p, d, pp) for h in HEADS for p in TPS for d in TPS for pp in (1, 2)]


@pytest.fixture(scope="module")
def sg() -> Any:
    sg = load_sglang_or_fail()
    load_loader().load_staging(sg)
    return sg


@pytest.fixture(autouse=True)
def _fresh_recorders(sg: Any) -> None:
    sg.gather_kernel.calls.clear()
    sg.scatter_kernel.calls.clear()


def sglang_round(sg: Any, world: StagedWorld, cls: type, r_p: int, stage: int) -> Any:
    """One prefill rank's ``send_kvcache_staged``: the recorded gather applied, the engine's
    blocks moved. Returns ``(status, blocks, manager)``."""
    mgr = world.manager(cls, stage, r_p)
    before = len(sg.gather_kernel.calls)
    rc = world.send(mgr)
    if len(sg.gather_kernel.calls) > before:
        call = sg.gather_kernel.calls[-1]
        assert call["staging_buffer"] is mgr.staging
        run_gather(call)
    blocks = engine_blocks(mgr.engine.calls)
    world.memory(mgr).apply(blocks)
    return rc, blocks, mgr


@pytest.mark.parametrize("heads,tp_p,tp_d,pp", CASES)
def test_sglang_staged_round_trip_on_host_memory(sg: Any, heads: int, tp_p: int, tp_d: int,
                                                 pp: int) -> None:
    """SGLang's own staged path, gather and scatter by their kernel semantics: the decode rank
    ends up with its heads (checks the loader, the semantics and the world together)."""
    for r_d in range(tp_d):
        world = StagedWorld(sg, heads=heads, tp_p=tp_p, tp_d=tp_d, r_d=r_d, pp=pp,
                            seed=heads * 100 + tp_p * 10 + tp_d)
        for stage in range(pp):
            for r_p in asked(tp_p, tp_d, r_d):
                rc, blocks, _ = sglang_round(sg, world, sg.MooncakeKVManager, r_p, stage)
                assert rc == 0 and blocks
        world.scatter()
        world.check_decode()


def test_staged_code_runs_from_the_wheel_without_stand_ins(sg: Any) -> None:
    visited = sg.verify_closure()
    for name in ("mooncake.conn.MooncakeKVManager.send_kvcache_staged",
                 "common.staging_buffer.compute_staging_layout",
                 "common.staging_buffer.compute_head_slice_params",
                 "common.staging_buffer.resolve_total_kv_heads",
                 "common.staging_buffer.StagingBuffer.fits",
                 "utils.build_transfer_entry_pairs"):
        assert f"sglang.srt.disaggregation.{name}" in visited
    import inspect

    assert str(inspect.signature(sg.gather_kernel)) == str(
        inspect.signature(sg.gather_kernel.real))
    with pytest.raises(TypeError):
        sg.gather_kernel(1, 2)  # does not bind to the real signature
    assert not sg.gather_kernel.calls
    np.testing.assert_equal(sg.compute_staging_layout(8, 2, 1, 8, 4, 16, 3),
                            (4, [4 * 1 * 16 * 3 * 2] * 4, 4 * 4 * 1 * 16 * 3 * 2))
