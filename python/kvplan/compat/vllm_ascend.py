"""Former path of :mod:`kvplan.compat.vllm.ascend`, kept so that imports of it keep working."""

from kvplan.compat.vllm.ascend import *  # noqa: F403
from kvplan.compat.vllm.ascend import __all__ as __all__
