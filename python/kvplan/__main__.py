"""``python -m kvplan``: the ``kvplan`` console script, for environments without the script on
PATH (``python -m kvplan explain --preset deepseek-v3``)."""

from __future__ import annotations

import sys

from kvplan.cli import main

if __name__ == "__main__":
    sys.exit(main())
