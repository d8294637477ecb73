"""Former path of :mod:`kvplan.compat.vllm.forms`, kept so that imports of it keep working."""

from kvplan.compat.vllm.forms import *  # noqa: F403
from kvplan.compat.vllm.forms import __all__ as __all__
