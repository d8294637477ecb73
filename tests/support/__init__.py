"""Test support: code the tests share and the benchmarks may reuse, never the other way round.

- ``sglang_loader``: SGLang 0.5.23's real planning code, executed from its wheel.
- ``package_shells``: the package shells, stand-in modules, meta-path finder and stand-in
  reachability walk the SGLang and vLLM loaders share, and their unpacked-download cache.
- ``sglang_models``: synthetic SGLang deployments and the ground truth of their bytes.
- ``sglang_staging``: host-memory pools and staging buffers for SGLang's staged path, and the
  bytes its GPU gather and scatter kernels write.
- ``engine_peers``: arenas, spawned peers, the ``Engine`` handle of the ``engine`` fixture, and
  the expected decode arena of real transfers, computed by ``kvplan.testing.oracle``.
- ``leak_workload``: the mixed plan-call workload whose RSS must stay flat.
- ``vllm_loader`` / ``vllm_cases``: vLLM's real connector code from its wheel, and the cases
  the drop-in tests and benchmark share.
- ``vllm_nixl`` / ``vllm_nixl_pair``: vLLM's real NIXL connector workers under kvplan's
  connector, and a handshaken prefill and decode pair of them with real NIXL agents (the
  staged-read tests and the NIXL staged benchmark).
- ``memfabric_standins``: the Ascend engine's recorded signatures and in-process stand-ins.
- ``reference``: the naive pairing and block-list reference the property and robustness suites
  compare plans with; ``robustness_checks``: the plan invariants and the isolated-subprocess
  runner those suites share.

How it is imported: ``tests/`` and its folders are not packages; ``tests/conftest.py`` puts
``tests/`` at the front of ``sys.path`` before any test module is collected, so this package is
``support`` from every folder. Test modules never import each other, only this package. A benchmark does the same with one line,
``sys.path.insert(0, <repo>/tests)`` (``bench/harness/__init__.py``), and imports the same
``support.*`` modules. Nothing here imports from ``bench/``.
"""
