"""The torch executor beside the NumPy one: :class:`kvplan.torch.TorchExecutor`, named here.

Importing this module imports torch (as ``import kvplan.torch`` does, with the same
``ImportError`` naming the ``kvplan[torch]`` extra when it is missing); ``import kvplan.exec``
does not.
"""

from kvplan.torch import BlockColumns, TorchExecutor

__all__ = ["BlockColumns", "TorchExecutor"]
