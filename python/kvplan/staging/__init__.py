"""Staged transfers between kvplan peers, engine-neutral: what the vLLM Mooncake and NIXL
connectors and the SGLang Mooncake drop-in call to move a request in bounded rounds through
two registered arenas (docs/staging.md).

* :class:`StagingConfig`: the settings (``kv_connector_extra_config`` keys, SGLang's
  environment).
* :class:`StagingArena`: the page-aligned host memory each side registers at start-up.
* :class:`Capabilities`, :func:`negotiate`: the handshake's staging message and the pure
  decision (:class:`StagingAgreement` or :class:`DirectFallback`), :class:`FallbackLog` to say a
  fallback once per peer.
* :func:`choose_path`: staged or direct for one request (``Template.transfer_advice`` with the
  engine's costs); :func:`startup_costs` settles those costs once at start-up (given, else
  measured by :func:`loopback_costs`).
* :func:`send_staged` (prefill), :class:`ReceiveStaged` (decode): the round protocol, its
  messages carried by the engine's side channel through a callable and a :class:`Router`;
  in pull mode (``send_staged(..., pull=True)``) the decode reads each round itself, e.g.
  with :class:`NixlRoundReader` as the receiver's ``fetch``.
* :class:`StagingError`: how a staged request fails, once.
* :func:`local_copy`: a round's gather or scatter on host memory (``kvplan.copy_local``);
  :func:`host_memory` says whether KV buffers are host memory it may touch, :func:`host_views`
  makes arrays of them.
* :class:`FrameConnection`, :class:`FrameListener`: kvplan's own length-framed TCP side
  channel for the round protocol's messages (:class:`Framing`, :class:`ChannelError`).
"""

from __future__ import annotations

from kvplan.staging.arena import PAGE, StagingArena
from kvplan.staging.channel import (
    CHANNEL_REASONS,
    ChannelError,
    FrameConnection,
    FrameListener,
    Framing,
    parse_address,
)
from kvplan.staging.choice import PathChoice, choose_path
from kvplan.staging.config import ENV_VARS, STAGING_OPTIONS, StagingConfig, format_costs
from kvplan.staging.copies import local_copy
from kvplan.staging.costs import loopback_costs, startup_costs
from kvplan.staging.errors import REASONS, StagingError
from kvplan.staging.memory import host_memory, host_views
from kvplan.staging.negotiation import (
    PROTOCOL_VERSION,
    ArenaInfo,
    Capabilities,
    DirectFallback,
    FallbackLog,
    Negotiated,
    StagingAgreement,
    negotiate,
)
from kvplan.staging.network import NetworkHandle, NixlRoundReader, RoundEngine, round_engine
from kvplan.staging.receiver import ArenaShares, ReceiveStaged
from kvplan.staging.router import Router
from kvplan.staging.sender import AckQueue, SendReport, send_staged

__all__ = ["CHANNEL_REASONS", "ENV_VARS", "PAGE", "PROTOCOL_VERSION", "REASONS",
           "STAGING_OPTIONS", "AckQueue", "ArenaShares",
           "ArenaInfo", "Capabilities", "ChannelError", "DirectFallback", "FallbackLog",
           "FrameConnection", "FrameListener", "Framing", "NetworkHandle", "NixlRoundReader",
           "Negotiated", "PathChoice", "ReceiveStaged", "RoundEngine", "Router", "SendReport",
           "StagingAgreement", "StagingArena", "StagingConfig", "StagingError", "choose_path",
           "format_costs", "host_memory", "host_views", "local_copy", "loopback_costs",
           "negotiate", "parse_address", "round_engine", "send_staged", "startup_costs"]
