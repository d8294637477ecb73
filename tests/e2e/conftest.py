"""Nothing here is a pytest test: the end-to-end drivers start real servers and are run by
``scripts/e2e-vllm`` (and their siblings), never by pytest."""

collect_ignore_glob = ["*.py", "*/*.py"]
