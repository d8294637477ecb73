"""Routing the round protocol's messages to the stream they belong to.

An engine's side channel (vLLM's zmq socket, SGLang's bootstrap connection) hands every
staging message it receives to :meth:`Router.deliver`; the router passes it to the handler of
its ``(request, writer)`` stream: a :class:`kvplan.staging.ReceiveStaged` on the decode, the
ack queue of a :func:`kvplan.staging.send_staged` on the prefill. A message that arrives before
its stream is opened (the prefill's first round can overtake the decode's bookkeeping) is kept,
at most :attr:`Router.max_early` of them, and handed over when the stream opens.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from kvplan.staging.wire import request_of

__all__ = ["Router"]

Handler = Callable[[bytes], None]
_log = logging.getLogger("kvplan.staging")


class Router:
    """Staging messages by ``(request, writer)`` stream."""

    def __init__(self, max_early: int = 4096) -> None:
        self.max_early = max_early
        self._handlers: dict[tuple[str, int], Handler] = {}
        self._early: OrderedDict[tuple[str, int], list[bytes]] = OrderedDict()
        self._n_early = 0
        # Recently closed streams, whose stragglers (a late ack) are dropped, not kept.
        self._closed: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._lock = threading.Lock()
        #: Messages dropped: unreadable, or for a closed stream, or early ones over the bound.
        self.dropped = 0

    def open(self, request: str, writer: int, handler: Handler) -> None:
        """Route ``(request, writer)``'s messages to ``handler`` from now on, first those
        that arrived early (in arrival order, in this thread). Opening an open stream replaces
        its handler; opening a closed one opens it again."""
        key = (request, writer)
        while True:
            # messages that arrive while early ones are handed over are kept too, so the
            # handler sees every message in arrival order
            with self._lock:
                self._closed.pop(key, None)
                early = self._early.pop(key, [])
                self._n_early -= len(early)
                if not early:
                    self._handlers[key] = handler
                    return
            for data in early:
                handler(data)

    def is_open(self, request: str, writer: int) -> bool:
        """Whether ``(request, writer)``'s messages go to a handler now."""
        with self._lock:
            return (request, writer) in self._handlers

    def close(self, request: str, writer: int | None = None, *,
              handler: Handler | None = None) -> None:
        """Stop routing the request's stream (every writer's with ``writer=None``); later
        messages for it are dropped. With ``handler``, only while that handler still routes
        it: a stream opened again under the same name since keeps its new handler."""
        with self._lock:
            if handler is not None and not any(
                    h == handler for k, h in self._handlers.items()
                    if k[0] == request and writer in (None, k[1])):
                return
            for key in [k for k in (*self._handlers, *self._early)
                        if k[0] == request and writer in (None, k[1])]:
                self._handlers.pop(key, None)
                self._n_early -= len(self._early.pop(key, []))
                self._closed[key] = None
            if writer is not None:
                self._closed[(request, writer)] = None
            while len(self._closed) > self.max_early:
                self._closed.popitem(last=False)

    def deliver(self, data: bytes) -> bool:
        """Hand one message to its stream; False when it was dropped or kept for later (when
        the early messages reach :attr:`max_early`, the oldest stream's are dropped)."""
        key = request_of(data)
        if key is None:
            with self._lock:
                self.dropped += 1
            _log.debug("kvplan: dropped an unreadable staging message of %d bytes", len(data))
            return False
        with self._lock:
            handler = self._handlers.get(key)
            if handler is None:
                if key in self._closed:
                    self.dropped += 1
                    return False
                while self._n_early >= self.max_early and self._early:
                    _, stale = self._early.popitem(last=False)  # the oldest stream's
                    self._n_early -= len(stale)
                    self.dropped += len(stale)
                self._early.setdefault(key, []).append(bytes(data))
                self._n_early += 1
                return False
        handler(data)
        return True
