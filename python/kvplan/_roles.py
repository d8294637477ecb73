"""Entry roles that mean more than a label, for the modules that read layouts.

The core names the roles of the layouts it builds (``Layout.mha`` gives its entries ``k`` and
``v``) and classifies them; the pairing policy and the compatibility report both need to
recognise them, and read the core's classification here, below both.
"""

from __future__ import annotations

from kvplan import _core

__all__ = ["MHA_ROLES"]

#: Roles of the separate K and V entries of an MHA layout: K/V heads are sharded between TP
#: ranks (an MLA latent, role ``kv``, and NPU buffer groups, ``g0``, ``g1``, ..., are not).
MHA_ROLES = frozenset(_core.MHA_ROLES)
