"""Plan and content digests through the Python API: the decode recomputes the prefill's plan
digest from the handshake's layout bytes (also in another process), content digests read
numpy arrays and memoryviews without a copy, every block must lie inside a buffer, and
``verify`` names what differs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import kvplan
from kvplan import integrity
from kvplan.integrity import IntegrityError, Manifest, build_manifest, verify

ITEM, PAGES, LAYERS = 256, 12, 3
SRC_PAGES = np.array([0, 1, 2, 7, 9], dtype=np.int64)
DST_PAGES = np.array([5, 6, 3, 4, 11], dtype=np.int32)


def arena(seed: int) -> np.ndarray:
    """K then V buffers of every layer back to back, deterministic contents."""
    return np.random.default_rng(seed).integers(0, 256, 2 * LAYERS * PAGES * ITEM, dtype=np.uint8)


def mha(mem: np.ndarray, *, page_size: int = 1, ids: list[int] | None = None) -> kvplan.Layout:
    base, entry = mem.ctypes.data, PAGES * ITEM
    k = [base + 2 * layer * entry for layer in range(LAYERS)]
    v = [base + (2 * layer + 1) * entry for layer in range(LAYERS)]
    return kvplan.Layout.mha(k, v, [entry] * LAYERS, [entry] * LAYERS, ITEM, ITEM,
                             layer_ids=ids or list(range(LAYERS)), page_size=page_size)


def copy(plan: kvplan.TransferPlan, src: np.ndarray, dst: np.ndarray) -> None:
    s0, d0 = src.ctypes.data, dst.ctypes.data
    for s, d, n in zip(*plan.as_lists()):
        dst[d - d0:d - d0 + n] = src[s - s0:s - s0 + n]


@pytest.fixture
def peers():
    src, dst = arena(1), arena(2)
    s_layout, d_layout = mha(src), mha(dst)
    template = kvplan.Template(s_layout, d_layout)
    plan = template.plan(SRC_PAGES, DST_PAGES)
    copy(plan, src, dst)
    return src, dst, s_layout, d_layout, template, plan


def test_decode_recomputes_the_plan_digest_from_the_handshake(peers):
    src, dst, s_layout, d_layout, template, plan = peers
    wire = s_layout.to_bytes()
    again = kvplan.Template(kvplan.Layout.from_bytes(wire), kvplan.Layout.from_bytes(d_layout.to_bytes()))
    replanned = again.plan(SRC_PAGES.astype(np.int32), DST_PAGES.astype(np.int64))
    assert replanned.digest() == plan.digest()
    assert plan.layout_fingerprints == (s_layout.fingerprint(), d_layout.fingerprint())
    # Another process, from the same bytes, computes the same digest.
    code = (
        "import sys, numpy as np, kvplan;"
        "s = kvplan.Layout.from_bytes(bytes.fromhex(sys.argv[1]));"
        "d = kvplan.Layout.from_bytes(bytes.fromhex(sys.argv[2]));"
        f"p = kvplan.Template(s, d).plan(np.array({SRC_PAGES.tolist()}), np.array({DST_PAGES.tolist()}));"
        "print(p.digest())"
    )
    out = subprocess.run([sys.executable, "-c", code, wire.hex(), d_layout.to_bytes().hex()],
                         check=True, capture_output=True, text=True).stdout
    assert int(out) == plan.digest()
    # A different request, or a different layout, is a different digest.
    assert template.plan(SRC_PAGES, DST_PAGES[::-1].copy()).digest() != plan.digest()
    assert kvplan.Template(mha(src, page_size=1, ids=[0, 1, 5]),
                           mha(dst, ids=[0, 1, 5])).plan(SRC_PAGES, DST_PAGES).digest() != plan.digest()


def test_content_digests_agree_after_a_copy_and_read_any_buffer(peers):
    src, dst, *_, plan = peers
    sent = plan.content_digest("src", [src])
    assert plan.content_digest("dst", [dst]) == sent
    # Any buffer-protocol object, any dtype, several buffers, no copy needed.
    halves = [memoryview(dst[: dst.size // 2]), dst[dst.size // 2:].view(np.uint16)]
    assert plan.content_digest("dst", halves) == sent
    pairs = plan.pair_content_digests("dst", [dst])
    assert pairs.dtype == np.uint64 and len(pairs) == plan.n_pairs
    assert kvplan._core.combine_pair_digests(pairs) == sent
    # A byte the plan does not cover does not count; one it covers does.
    dst[0] ^= 1  # page 0 of layer 0's K buffer is never a destination
    assert plan.content_digest("dst", [dst]) == sent
    d0 = plan.dst_addrs[plan.pair_offsets[4]] - dst.ctypes.data
    dst[d0 + 3] ^= 0x80
    after = plan.pair_content_digests("dst", [dst])
    assert [p for p in range(plan.n_pairs) if after[p] != pairs[p]] == [4]


def test_every_block_must_lie_inside_one_buffer(peers):
    src, dst, *_, plan = peers
    with pytest.raises(kvplan.IndexBoundsError, match=r"src block \d+ at \[0x[0-9a-f]+, \+256 bytes\)"):
        plan.content_digest("src", [src[:-3 * ITEM]])
    # Split where a block straddles the two pieces: refused, never read across.
    first = int(plan.src_addrs[0] - src.ctypes.data)
    with pytest.raises(kvplan.IndexBoundsError, match="does not lie inside one of the 2 buffers"):
        plan.content_digest("src", [src[: first + 10], src[first + 10:]])
    with pytest.raises(kvplan.IndexBoundsError, match="no buffers were given"):
        plan.content_digest("dst", [])
    with pytest.raises(TypeError, match="not C-contiguous"):
        plan.content_digest("src", [src[::2]])
    with pytest.raises(TypeError, match=r"buffers\[0\] \(int\)"):
        plan.content_digest("src", [3])
    with pytest.raises(kvplan.KvPlanError, match='side must be "src" or "dst"'):
        plan.content_digest("decode", [dst])  # type: ignore[arg-type]


def manifests(peers, *, src_pages=SRC_PAGES, dst_pages=DST_PAGES):
    src, dst, s_layout, d_layout, template, plan = peers
    sent = build_manifest(plan, "src", [src], src_pages=src_pages, dst_pages=dst_pages)
    return sent, plan


def test_manifest_round_trips_and_rejects_garbage(peers):
    sent, _ = manifests(peers)
    assert Manifest.from_bytes(sent.to_bytes()) == sent
    assert len(sent.to_bytes()) == 84 + 8 * sent.n_pairs
    with pytest.raises(kvplan.KvPlanError, match="not a kvplan integrity manifest"):
        Manifest.from_bytes(b"nope")
    with pytest.raises(kvplan.KvPlanError, match="announces 6 pair digests"):
        Manifest.from_bytes(sent.to_bytes()[:-8])


def check(peers, received, *, plan=None, dst_pages=DST_PAGES, src_pages=SRC_PAGES, dst=None):
    src, dst0, s_layout, d_layout, template, plan0 = peers
    plan = plan or plan0
    mine = build_manifest(plan, "dst", [dst0 if dst is None else dst],
                          src_pages=src_pages, dst_pages=dst_pages)
    verify(received, mine, template=template, src_layout=s_layout, dst_layout=d_layout)


def test_verify_accepts_a_clean_transfer_and_names_each_difference(peers):
    src, dst, s_layout, d_layout, template, plan = peers
    sent, _ = manifests(peers)
    check(peers, sent.to_bytes())
    # Different layout version on the prefill.
    other = kvplan.Template(mha(src, page_size=2), mha(dst, page_size=2))
    moved = other.plan(SRC_PAGES[:2], DST_PAGES[:2].astype(np.int64))
    stale = build_manifest(moved, "src", [src], src_pages=SRC_PAGES[:2], dst_pages=DST_PAGES[:2])
    with pytest.raises(IntegrityError, match="prefill layout fingerprint differs") as info:
        check(peers, stale)
    assert info.value.what == "layout" and "prefill pp 0/1 tp 0/1 -> decode" in info.value.template
    # The decode expected other pages.
    with pytest.raises(IntegrityError, match=r"the decode \(dst\) page list differs") as info:
        check(peers, sent, dst_pages=DST_PAGES[::-1].copy())
    assert info.value.what == "pages"
    # Content: one byte of layer 2's V item.
    p = 5
    d0 = plan.dst_addrs[plan.pair_offsets[p]] - dst.ctypes.data
    dst[d0] ^= 1
    with pytest.raises(IntegrityError, match=r"1 of 6 entry pairs differ; first: pair 5 "
                                             r"\(layer 2, role v, decode entry 5\)") as info:
        check(peers, sent)
    assert (info.value.what, info.value.pair, info.value.layer, info.value.role) == ("content", 5, 2, "v")
    assert isinstance(info.value, kvplan.KvPlanError)


def test_verify_names_block_count_and_plan_differences(peers):
    src, dst, s_layout, d_layout, template, plan = peers
    sent, _ = manifests(peers)
    uncoalesced = kvplan.Template(s_layout, d_layout, coalesce=False).plan(SRC_PAGES, DST_PAGES)
    assert uncoalesced.digest() == plan.digest()  # packed buffers: nothing to coalesce
    # A forged manifest with the same counts but other blocks: the plan digest says so.
    forged = Manifest(**{**sent.__dict__, "plan_digest": sent.plan_digest ^ 1})
    with pytest.raises(IntegrityError, match="same layouts, pages and block count but different blocks"):
        check(peers, forged)
    fewer = Manifest(**{**sent.__dict__, "n_blocks": sent.n_blocks - 1})
    with pytest.raises(IntegrityError, match=f"the prefill planned {sent.n_blocks - 1} blocks"):
        check(peers, fewer)
    assert integrity.template_label(s_layout, d_layout) == "prefill pp 0/1 tp 0/1 -> decode pp 0/1 tp 0/1"
