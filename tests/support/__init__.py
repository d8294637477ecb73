"""Test support: code the tests share and the benchmarks may reuse, never the other way round.

- ``sglang_loader``: SGLang 0.5.23's real planning code, executed from its wheel.
- ``sglang_models``: synthetic SGLang deployments and the ground truth of their bytes.
- ``engine_peers``: arenas, spawned peers and an independent byte oracle for real transfers.
- ``leak_workload``: the mixed plan-call workload whose RSS must stay flat.

How it is imported: ``tests/`` is not a package (the test modules import each other by their
bare names), so pytest puts ``tests/`` at the front of ``sys.path`` for every test module and
this package is ``support``. A benchmark does the same with one line,
``sys.path.insert(0, <repo>/tests)`` (``bench/harness/__init__.py``), and imports the same
``support.*`` modules. Nothing here imports from ``bench/``.
"""
