"""Former path of :mod:`kvplan.compat.vllm.metrics`, kept so that imports of it keep working."""

from kvplan.compat.vllm.metrics import *  # noqa: F403
from kvplan.compat.vllm.metrics import __all__ as __all__
