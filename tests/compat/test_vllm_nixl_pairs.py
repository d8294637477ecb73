"""vLLM 0.34's NIXL ``_compute_desc_ids(..., pairs=(regions, keys), region_num_blocks,
ssm_regions)`` with kvplan installed: the same ids as vLLM's own method.

vLLM 0.34.0's real method (from its wheel, in a child process: a process loads one release)
and kvplan's replacement run on the same worker objects over sampled region pairs, block-size
ratios and counts (fixed seed); every result must be the same array (type, dtype, shape,
values). vLLM 0.34.0's own unit tests of the method (``test_nixl_connector_hma.py`` in its
sdist) run as written, on vLLM alone and with kvplan installed, with the same outcomes. Also
what kvplan refuses where vLLM returns another region's ids.
"""

from __future__ import annotations

import ast
import os
import random
from unittest.mock import MagicMock

import numpy as np
import pytest

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
from support.vllm_loader import (  # noqa: E402
    fetch_sdist_tests, load_vllm_nixl, ALL_TESTS)

import kvplan  # noqa: E402
from kvplan.compat import vllm as compat  # noqa: E402
from kvplan.compat.vllm import nixl as vllm_nixl  # noqa: E402

SEED = 20261205
SAMPLES = 1500
RELEASE = "vllm==0.34.0"


@pytest.fixture(scope="module")
def nixl():
    n = load_vllm_nixl()
    if vllm_nixl.host_form(n.NixlBaseConnectorWorker) != vllm_nixl.FORM_BY_PAIRS:
        pytest.skip(f"vLLM {n.version} has the region-group form (test_vllm_nixl.py); "
                    "test_vllm_034_release runs this file under vLLM 0.34.0")
    return n


@pytest.fixture
def installed(nixl):
    W = nixl.NixlConnectorWorker
    before = dict(W.__dict__)
    assert compat.install(W) == ("_compute_desc_ids",)
    yield W
    assert compat.uninstall(W) == ("_compute_desc_ids",)
    assert dict(W.__dict__) == before


def vllm_method(nixl):
    return nixl.NixlBaseConnectorWorker.__dict__["_compute_desc_ids"]


def worker(cls, **attrs):
    w = object.__new__(cls)
    defaults = dict(_has_mamba=False, _conv_decomp=None, _ssm_region_indices=[],
                    num_regions=0, block_len_per_layer=[])
    w.__dict__.update(defaults | attrs)
    return w


def scaled(count, ratio):
    return count if ratio is None else int(count * ratio)


def sample(rng):
    """One worker state and one call: pairs in any order, with repeats, some regions and some
    block lists unpaired (those lists hold ids no region could take: they are not read)."""
    n_regions = rng.randint(1, 8)
    by_region = rng.random() < 0.3  # region-mapped reads: one block list per region
    n_lists = n_regions if by_region else rng.randint(1, 3)
    ratio = rng.choice([None, None, None, 1, 2, 4, 0.5, 1.5])
    dst_num_blocks = rng.randint(1, 48)
    attrs = dict(num_regions=n_regions, block_len_per_layer=[256] * n_regions)
    if rng.random() < 0.15:  # before register_kv_caches: regions counted from the layers
        attrs["num_regions"] = 0
    region_num_blocks = ([rng.randint(1, 48) for _ in range(n_regions)]
                         if rng.random() < 0.5 else None)
    counts = ([scaled(c, ratio) for c in region_num_blocks] if region_num_blocks
              else [scaled(dst_num_blocks, ratio)] * n_regions)
    if by_region:
        regions = list(range(n_regions))
        rng.shuffle(regions)
        keys = list(regions)
    else:
        n_pairs = rng.randint(1, 2 * n_regions)
        regions = [rng.randrange(n_regions) for _ in range(n_pairs)]
        keys = [rng.randrange(n_lists) for _ in range(n_pairs)]
    block_ids = []
    for k in range(n_lists):
        readers = [r for r, key in zip(regions, keys) if key == k]
        bound = min((counts[r] for r in readers), default=0)
        if not readers:
            block_ids.append([rng.randrange(1000) for _ in range(rng.randint(0, 3))])
        else:
            n = rng.randint(0, 12) if bound > 0 else 0
            block_ids.append([rng.randrange(bound) for _ in range(n)])
    kwargs = dict(block_ids=tuple(block_ids) if rng.random() < 0.3 else block_ids,
                  dst_num_blocks=dst_num_blocks, block_size_ratio=ratio,
                  physical_blocks_per_logical=rng.choice([1, 1, 4]),
                  pairs=(regions, keys), region_num_blocks=region_num_blocks)
    if rng.random() < 0.3:
        kwargs["ssm_regions"] = None
    return attrs, kwargs


def assert_same(got, want):
    assert type(got) is type(want) is np.ndarray
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype,
                                                                  got.shape, want.shape)
    np.testing.assert_array_equal(got, want)


def test_sampled_requests_match_vllm(nixl, installed, monkeypatch):
    """The differential test: vLLM 0.34's method and the installed one on the same workers,
    and no sample falls back to vLLM's method."""
    declined = []
    real_lookup = vllm_nixl._vllm_method
    monkeypatch.setattr(vllm_nixl, "_vllm_method",
                        lambda cls: declined.append(cls) or real_lookup(cls))
    rng = random.Random(SEED)
    original = vllm_method(nixl)
    kinds = {"by_region": 0, "shared": 0, "ratio": 0, "empty": 0, "unsorted": 0}
    for i in range(SAMPLES):
        attrs, kwargs = sample(rng)
        w = worker(installed, **attrs)
        want = original(w, **kwargs)
        got = w._compute_desc_ids(**kwargs)
        try:
            assert_same(got, want)
        except AssertionError as exc:
            raise AssertionError(f"sample {i}: {attrs} {kwargs}: {exc}") from None
        regions, keys = kwargs["pairs"]
        kinds["by_region"] += regions == keys
        kinds["shared"] += len(set(regions)) < len(regions)
        kinds["ratio"] += kwargs["block_size_ratio"] not in (None, 1)
        kinds["empty"] += want.size == 0
        kinds["unsorted"] += keys != sorted(keys)
    assert declined == []
    assert min(kinds.values()) >= 30, kinds


def test_keyword_and_positional_calls(nixl, installed):
    """As vLLM 0.34's pull and push workers call it (keywords), and positionally."""
    w = worker(installed, num_regions=3, block_len_per_layer=[100] * 3)
    kwargs = dict(block_ids=([1], [2], [3]), dst_num_blocks=10, block_size_ratio=None,
                  physical_blocks_per_logical=1, region_num_blocks=[10, 10, 10],
                  pairs=([0, 1, 1, 1, 2], [0, 0, 1, 2, 2]))
    assert w._compute_desc_ids(**kwargs).tolist() == [1, 11, 12, 13, 23]
    assert_same(w._compute_desc_ids(([1], [2], [3]), 10, None, 1, ([0, 1, 1, 1, 2],
                                                                    [0, 0, 1, 2, 2])),
                vllm_method(nixl)(w, ([1], [2], [3]), 10, None, 1,
                                  ([0, 1, 1, 1, 2], [0, 0, 1, 2, 2])))


def mamba_worker(nixl, cls):
    kvi = nixl.vllm.kvi
    return worker(cls, _has_mamba=True, num_regions=2, block_len_per_layer=[100],
                  _conv_decomp=MagicMock(local_conv_offsets=[0, 1, 2]),
                  _ssm_region_indices=[0], _ple_group_index=None,
                  _group_spec_types=(kvi.FullAttentionSpec, kvi.MambaSpec))


@pytest.mark.parametrize("case", ["mamba", "numpy_pairs", "float_ids"])
def test_outside_the_core_falls_back_to_vllm(nixl, installed, case):
    original = vllm_method(nixl)
    if case == "mamba":
        w = mamba_worker(nixl, installed)
        kwargs = dict(block_ids=([3, 5], [1, 2]), dst_num_blocks=100, block_size_ratio=None,
                      physical_blocks_per_logical=1, pairs=([0, 1, 0], [0, 0, 1]))
    else:
        w = worker(installed, num_regions=2, block_len_per_layer=[100, 100])
        pairs = (np.array([0, 1]), np.array([0, 0])) if case == "numpy_pairs" else \
            ([0, 1], [0, 0])
        blocks = [[1.0, 2.0]] if case == "float_ids" else [[1, 2]]
        kwargs = dict(block_ids=blocks, dst_num_blocks=4, block_size_ratio=None,
                      physical_blocks_per_logical=1, pairs=pairs)
    assert_same(w._compute_desc_ids(**kwargs), original(w, **kwargs))


# --------------------------------------------------------------------------------------------
# What kvplan refuses where vLLM returns ids of another region
# --------------------------------------------------------------------------------------------
def test_block_past_its_region_is_refused(nixl, installed):
    """Region 0 holds 5 blocks: vLLM returns id 6 for its block 6, descriptor 1 of region 1."""
    w = worker(installed, num_regions=2, block_len_per_layer=[100, 100])
    kwargs = dict(block_ids=[[6]], dst_num_blocks=10, block_size_ratio=None,
                  physical_blocks_per_logical=1, region_num_blocks=[5, 10],
                  pairs=([0], [0]))
    assert vllm_method(nixl)(w, **kwargs).tolist() == [6]
    with pytest.raises(kvplan.IndexBoundsError) as err:
        w._compute_desc_ids(**kwargs)
    assert str(err.value) == ("KV group 0: block id 6 at position 0 is outside 0..5, the "
                              "blocks of descriptor region 0")


def test_negative_region_or_key_is_refused(nixl, installed):
    """numpy and Python indexing wrap a negative region or key to the last one; kvplan
    names the pair."""
    w = worker(installed, num_regions=2, block_len_per_layer=[100, 100])
    base = dict(block_ids=[[1], [2]], dst_num_blocks=10, block_size_ratio=None,
                physical_blocks_per_logical=1)
    assert vllm_method(nixl)(w, **base, pairs=([-1], [0])).tolist() == [11]
    with pytest.raises(kvplan.LayoutError, match="pair 0 reads region -1 but there are 2 "
                       "descriptor regions"):
        w._compute_desc_ids(**base, pairs=([-1], [0]))
    assert vllm_method(nixl)(w, **base, pairs=([0], [-1])).tolist() == [2]
    with pytest.raises(kvplan.LayoutError, match="pair 0 reads block list -1 but the request "
                       "has 2 block lists"):
        w._compute_desc_ids(**base, pairs=([0], [-1]))
    with pytest.raises(kvplan.LayoutError, match="2 paired regions for 1 pair keys"):
        w._compute_desc_ids(**base, pairs=([0, 1], [0]))


# --------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["NixlConnectorWorker", "NixlPullConnectorWorker",
                                  "NixlPushConnectorWorker", "NixlBaseConnectorWorker"])
def test_install_restores_exactly(nixl, name):
    cls = getattr(nixl, name)
    base = nixl.NixlBaseConnectorWorker
    vllm_fn = base.__dict__["_compute_desc_ids"]
    before = dict(cls.__dict__)
    assert compat.install(cls) == ("_compute_desc_ids",)
    assert compat.install(cls) == ()
    assert cls.__dict__["_compute_desc_ids"] is vllm_nixl._compute_paired_desc_ids
    assert compat.uninstall(cls) == ("_compute_desc_ids",)
    assert dict(cls.__dict__) == before
    assert cls._compute_desc_ids is vllm_fn


# --------------------------------------------------------------------------------------------
# vLLM 0.34.0's own unit tests of _compute_desc_ids, as written in its sdist
# --------------------------------------------------------------------------------------------
UPSTREAM_FILE = "test_nixl_connector_hma.py"
UPSTREAM_HELPER = "_make_mock_worker_for_desc_ids"
UPSTREAM_TESTS = (
    "test_shared_nixl_region_reads_once_per_paired_group",
    "test_get_block_descs_ids_hybrid_ssm",
    "test_get_block_descs_ids_selects_attention_regions_by_group",
    "test_get_block_descs_ids_uses_per_region_pool_capacity",
    "test_get_block_descs_ids_kernel_block_mismatch",
    "test_get_block_descs_ids_hetero_block_size_hybrid",
)


def upstream_functions(nixl):
    """The helper and the tests, their source exactly as in the sdist, compiled against the
    loaded modules (their own imports resolve to the loaded vLLM modules)."""
    path = os.path.join(fetch_sdist_tests(), UPSTREAM_FILE)
    with open(path) as f:
        source = f.read()
    tree = ast.parse(source)
    wanted = {UPSTREAM_HELPER, *UPSTREAM_TESTS}
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in nodes} == wanted, sorted(wanted - {n.name for n in nodes})
    for node in nodes:  # vLLM's marks (cpu_test) are its CI's, not registered here
        node.decorator_list = []
    kvi = nixl.vllm.kvi
    namespace = dict(pytest=pytest, FullAttentionSpec=kvi.FullAttentionSpec,
                     MambaSpec=kvi.MambaSpec, bw=nixl.base_worker)
    module = ast.Module(body=nodes, type_ignores=[])
    exec(compile(module, path, "exec"), namespace)  # noqa: S102 - vLLM's own test code
    return namespace


def outcome(function):
    try:
        function()
    except Exception as exc:  # the outcome compared, whatever it is
        return f"{type(exc).__name__}: {exc}"
    return "passed"


def test_vllm_unit_tests_as_written_equal_outcomes(nixl):
    namespace = upstream_functions(nixl)
    W = nixl.NixlConnectorWorker
    alone = {name: outcome(namespace[name]) for name in UPSTREAM_TESTS}
    before = dict(W.__dict__)
    compat.install(W)
    try:
        assert W.__dict__["_compute_desc_ids"] is vllm_nixl._compute_paired_desc_ids
        with_kvplan = {name: outcome(namespace[name]) for name in UPSTREAM_TESTS}
    finally:
        compat.uninstall(W)
    if "__annotations__" not in before and "__annotations__" in W.__dict__:
        del W.__annotations__  # created by MagicMock(spec=...) reading the class
    assert alone == dict.fromkeys(UPSTREAM_TESTS, "passed")
    assert with_kvplan == alone


#: What runs again in the child pytest of each other vLLM release (tests/compat/test_other_releases.py
#: gathers every file's list; ``ALL_TESTS``: the whole file).
RERUN_UNDER_RELEASES = {RELEASE: ALL_TESTS}
