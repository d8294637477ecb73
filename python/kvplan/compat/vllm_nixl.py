"""Former path of :mod:`kvplan.compat.vllm.nixl`, kept so that imports of it keep working."""

from kvplan.compat.vllm.nixl import *  # noqa: F403
from kvplan.compat.vllm.nixl import __all__ as __all__
