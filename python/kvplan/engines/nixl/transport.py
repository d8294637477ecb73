"""One NIXL agent: registration, peers, notifications, plan submission, prepping, teardown."""

from __future__ import annotations

import atexit
import importlib
import itertools
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvplan._core import KvPlanError, Layout, Template
from kvplan.engines._base import (
    Manifests,
    PlanLike,
    TransferError,
    TransferStats,
    Transport,
    integrity_notification,
)
from kvplan.engines.nixl.descriptors import (
    NIXL_STATUS_NAMES,
    U64,
    _nixl_status,
    descriptor_rows,
    memory_of,
)
from kvplan.engines.nixl.owner import Memory
from kvplan.engines.nixl.pending import NixlPending
from kvplan.engines.nixl.prepped import PreppedPair
from kvplan.integrity import Manifest, is_notification, read_notification

if TYPE_CHECKING:
    from kvplan.engines.streaming import StreamCompleteness

__all__ = ["DEFAULT_TIMEOUT", "NixlTransport"]

#: Seconds a transfer may stay in ``PROC`` before ``submit`` gives up (raises TransferError).
DEFAULT_TIMEOUT = 60.0

_names = itertools.count()
#: Transports whose agent is still alive. NIXL's agent and its UCX worker threads must be torn
#: down while the interpreter is whole: left to module teardown at exit, the agent's C++
#: destructor can run after the objects its threads still use are gone (a crash at exit).
_OPEN: weakref.WeakSet[NixlTransport] = weakref.WeakSet()


@atexit.register
def _close_open_transports() -> None:
    """Close, in creation order reversed, every transport the program left open, and drop
    their agents before the interpreter starts tearing modules down."""
    for transport in sorted(_OPEN, key=lambda t: t._created, reverse=True):
        transport.timeout = min(transport.timeout, 5.0)  # exit must not wait for a minute
        try:
            transport.close()
        except Exception:  # noqa: BLE001  (exit goes on; the agent is dropped below anyway)
            transport._agent = None


def _integrity_message(notification: bytes) -> bytes | None:
    """The completion message an integrity notification carries; None for any other
    notification (or a malformed one, which no waiter can match)."""
    if not is_notification(notification):
        return None
    try:
        return read_notification(notification)[0]
    except KvPlanError:
        return None


class NixlTransport(Transport):
    """Writes plans with a NIXL agent (UCX backend by default).

    Args:
        name: agent name, unique among the agents that talk to each other (default
            ``kvplan-<host>-<pid>-<n>``). It is what peers pass as ``peer_session``.
        backends: NIXL backends to create (``["UCX"]``).
        timeout: default seconds a submitted transfer may stay in progress before ``submit``
            raises :class:`TransferError` (and releases, or cancels, its handles).
        max_blocks_per_batch: descriptors per NIXL transfer request (default: the whole plan
            in one request).
        agent: an already created ``nixl_agent`` to use instead of creating one.

    Raises:
        ImportError: ``nixl_cu12`` (or ``nixl``) is not installed.
        TransferError: the agent could not be created or has none of ``backends``.
    """

    engine_name = "nixl"
    default_max_blocks_per_batch = None
    status_names = NIXL_STATUS_NAMES

    def __init__(self, name: str | None = None, *, backends: Sequence[str] = ("UCX",),
                 timeout: float = DEFAULT_TIMEOUT, max_blocks_per_batch: int | None = None,
                 agent: Any = None) -> None:
        super().__init__(max_blocks_per_batch=max_blocks_per_batch)
        self._closed = True  # until the agent exists, nothing may call into it
        # Set when close() starts: pending transfers then stop polling handles close() owns.
        self._closing = False
        self.name = name or f"kvplan-{socket.gethostname()}-{os.getpid()}-{next(_names)}"
        self.timeout = timeout
        self._lock = threading.Lock()
        self._live: set[Any] = set()      # transfer handles not yet released
        self._stuck: list[Any] = []       # handles NIXL refused to release; retried at close
        self._dlists: set[Any] = set()    # prepped descriptor-list handles
        self._reg_descs: list[Any] = []   # what register_memory returned, for deregistration
        self._peers: dict[str, Memory] = {}  # peer name -> (mem type, dev id)
        self._notifs: dict[str, list[bytes]] = {}
        self._mem: Memory | None = None  # local (mem type, dev id)
        if agent is None:
            try:
                nixl_api = importlib.import_module("nixl_cu12._api")
            except ImportError:  # the CUDA-13 wheel names its package plainly
                nixl_api = importlib.import_module("nixl._api")
            nixl_agent, nixl_agent_config = nixl_api.nixl_agent, nixl_api.nixl_agent_config
            try:
                agent = nixl_agent(self.name, nixl_agent_config(backends=list(backends)))
            except Exception as exc:
                raise self._error(f"creating agent {self.name!r} raised {exc!r}", peer=None,
                                  status=None) from exc
        self._agent: Any = agent
        self._created = next(_names)
        _OPEN.add(self)
        missing = [b for b in backends if b not in getattr(agent, "backends", {})]
        if missing:
            raise self._error(f"agent {self.name!r} has no {missing} backend (plugins: "
                              f"{getattr(agent, 'plugin_list', '?')})", peer=None, status=None)
        self._closed = False

    # ------------------------------------------------------------------ engine hooks
    def _engine_session_id(self) -> str:
        return self.name

    def _engine_memory(self, device: str) -> None:
        # One agent registers one memory type and device: its descriptors name a single one.
        mem = memory_of(device)  # ValueError for a device NIXL has no memory type for
        if self._mem is not None and mem != self._mem:
            raise self._error(f"cannot register {mem[0]} device {mem[1]} memory: this agent "
                              f"already holds {self._mem[0]} device {self._mem[1]}", peer=None,
                              status=None)

    def _engine_register(self, ptrs: list[int], lens: list[int], device: str) -> int:
        mem_type, dev = memory_of(device)
        descs = self._agent.register_memory(
            [(p, n, dev, "") for p, n in zip(ptrs, lens)], mem_type)
        self._reg_descs.append(descs)
        self._mem = (mem_type, dev)
        return 0

    def _engine_unregister(self, ptrs: list[int]) -> int:
        while self._reg_descs:
            self._agent.deregister_memory(self._reg_descs.pop())
        return 0

    def _error_origin(self, msg: str) -> tuple[str, dict[str, Any]]:
        # Every error names the agent (once: request errors start with it already).
        return (msg if "agent " in msg else f"[agent {self.name!r}] {msg}"), {"agent": self.name}

    # ------------------------------------------------------------------ agent, peers
    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory), to ship to peers.

        Call it after :meth:`register`: peers can write only into memory it describes.
        """
        self._check_open()
        return bytes(self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes, device: str = "cpu") -> str:
        """Load a peer's :meth:`metadata`; returns its name (the ``peer_session`` to submit to).

        ``device`` is the peer layout's ``device``: it gives the memory type and device id of
        the remote descriptors.
        """
        self._check_open()
        remote = memory_of(device)
        try:
            name = self._agent.add_remote_agent(bytes(metadata))
        except Exception as exc:
            raise self._error(f"loading peer metadata ({len(metadata)} bytes) raised {exc!r}",
                              peer=None, status=_nixl_status(exc)[0]) from exc
        peer = name.decode() if isinstance(name, bytes) else str(name)
        self._peers[peer] = remote
        return peer

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (disconnects; later submits to it raise)."""
        self._check_open()
        self._peers.pop(peer, None)
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:  # already gone
            pass

    @property
    def peers(self) -> list[str]:
        """Names of the peers loaded with :meth:`add_peer`."""
        return sorted(self._peers)

    @property
    def live_handles(self) -> int:
        """Transfer handles held and not yet released (0 when nothing is in flight)."""
        with self._lock:
            return len(self._live) + len(self._stuck)

    # ------------------------------------------------------------------ notifications
    def notifications(self) -> dict[str, list[bytes]]:
        """Every notification received and not yet consumed, by sender (and consume them)."""
        self._check_open()
        self._poll_notifs()
        out, self._notifs = self._notifs, {}
        return out

    def wait_notification(self, peer: str, message: bytes, timeout: float = 30.0) -> None:
        """Block until ``peer`` sent notification ``message`` (consumed when found).

        A notification sent with ``submit(..., notif=message, manifest=...)`` counts too (its
        manifests are then dropped): a decode that does not verify still sees the completion.
        To verify, wait with :meth:`wait_manifests` instead.

        Raises:
            TransferError: it did not arrive within ``timeout`` seconds.
        """
        self._wait_for(peer, timeout, f"notification {message!r}",
                       lambda m: m == message or _integrity_message(m) == message)

    def wait_manifests(self, peer: str, message: bytes = b"", timeout: float = 30.0
                       ) -> list[Manifest]:
        """Block until ``peer``'s integrity notification carrying completion ``message``
        arrived (``submit(..., notif=message, manifest=...)``; consumed when found) and return
        its manifests, for :meth:`check_landed`.

        Raises:
            TransferError: it did not arrive within ``timeout`` seconds.
            KvPlanError: it arrived but is not a well-formed integrity notification.
        """
        found = self._wait_for(peer, timeout, f"integrity notification {message!r}",
                               lambda m: _integrity_message(m) == message)
        return read_notification(found)[1]

    def wait_stream(self, peer: str, message: bytes, timeout: float = 30.0
                    ) -> StreamCompleteness:
        """Wait up to ``timeout`` seconds for the final notification of ``peer``'s streamed
        request whose completion message is ``message`` (:mod:`kvplan.engines.streaming`) and
        check it against the slice receipts that arrived: complete, a slice missing (named),
        or still in flight when the final notification did not come in time. The request's
        receipts and final notification are consumed.

        Raises:
            KvPlanError: the final notification is malformed.
        """
        from kvplan.engines.streaming import check_stream, read_receipt

        def final_of(m: bytes) -> bool:
            return _integrity_message(m) == message

        try:
            final: bytes | None = self._wait_for(peer, timeout, "final notification", final_of)
        except TransferError:
            final = None
        self._poll_notifs()  # receipts posted before the final one
        got = self._notifs.get(peer, [])
        arrived, rest = [], []
        for m in got:
            receipt = read_receipt(m)
            if receipt is not None and receipt[1] == message:
                arrived.extend(receipt[0])
            else:
                rest.append(m)
        if final is not None:
            got[:] = rest
        return check_stream(final, arrived, message)

    def _wait_for(self, peer: str, timeout: float, what: str,
                  matches: Callable[[bytes], bool]) -> bytes:
        """The first notification from ``peer`` that ``matches`` (consumed), polled until
        ``timeout`` seconds passed."""
        self._check_open()
        deadline = time.monotonic() + timeout
        delay = 0.0
        while True:
            self._poll_notifs()
            got = self._notifs.get(peer, [])
            found = next((m for m in got if matches(m)), None)
            if found is not None:
                got.remove(found)
                return found
            if time.monotonic() > deadline:
                raise self._error(f"no {what} from {peer!r} in {timeout:g} s "
                                  f"(received from: {sorted(self._notifs)})", peer=peer,
                                  status=None)
            time.sleep(delay)
            delay = min(0.001 if delay == 0 else delay * 2, 0.01)

    def _poll_notifs(self) -> None:
        for sender, msgs in self._agent.get_new_notifs().items():
            key = sender.decode() if isinstance(sender, bytes) else str(sender)
            self._notifs.setdefault(key, []).extend(bytes(m) for m in msgs)

    # ------------------------------------------------------------------ submit
    def submit(self, plan: PlanLike, peer_session: str,
               max_blocks_per_batch: int | None = None, *, check_sources: bool = True,
               notif: bytes = b"", timeout: float | None = None,
               manifest: Manifests | None = None) -> TransferStats:
        """Write every block of ``plan`` to peer ``peer_session`` and wait for completion.

        Args:
            plan: a :class:`kvplan.TransferPlan` or any object with uint64 ``src_addrs``,
                ``dst_addrs`` and ``lengths``.
            peer_session: a name returned by :meth:`add_peer`.
            max_blocks_per_batch: descriptors per NIXL request (default: all in one).
            check_sources: verify first that every source lies in registered memory.
            notif: notification the peer receives once every block has landed (sent with the
                last request, which is posted after the others completed).
            timeout: seconds before giving up (default: the adapter's ``timeout``).
            manifest: the request's integrity manifests (:meth:`manifest`), given with its
                last plan: the notification becomes
                :func:`kvplan.integrity.pack_notification` of them carrying ``notif`` (the
                decode waits for it with :meth:`wait_manifests`), returned as
                :attr:`TransferStats.integrity` too.

        Raises:
            TransferError: NIXL refused a request (unknown peer, memory not registered on
                either side, length mismatch), a request ended in ``ERR`` or raised (peer
                died), or ``timeout`` passed. Every handle is released (or, if NIXL cannot
                cancel it, kept for :meth:`close`) before the error is raised.
        """
        return self.submit_async(plan, peer_session, max_blocks_per_batch,
                                 check_sources=check_sources, notif=notif,
                                 manifest=manifest).wait(timeout)

    def submit_async(self, plan: PlanLike, peer_session: str,
                     max_blocks_per_batch: int | None = None, *, check_sources: bool = True,
                     notif: bytes = b"", manifest: Manifests | None = None) -> NixlPending:
        """Create and post the plan's requests; return a handle to :meth:`NixlPending.wait` on.

        With several batches the notification goes with the last one, posted by ``wait`` (or
        ``done``) once the others completed, so it never overtakes data. A plan of no blocks
        still delivers ``notif``, as a bare NIXL notification: a decode rank that receives
        nothing from this prefill rank (no head in common) still waits for its completion.
        ``manifest``: as in :meth:`submit`.
        """
        integrity = integrity_notification(manifest, notif)
        return self._submit_async(
            plan, peer_session, max_blocks_per_batch, check_sources,
            lambda lengths: NixlPending(self, peer_session, lengths, notif=integrity or notif,
                                        mems=self._mems(peer_session, len(lengths))),
            integrity)

    def _notify(self, peer: str, notif: bytes) -> None:
        """A notification bound to no transfer (NIXL's ``send_notif``): what a request that
        moves no byte sends to say it is complete."""
        try:
            self._agent.send_notif(peer, notif)
        except Exception as exc:
            raise self._error(f"send_notif({notif!r}) to peer {peer!r} raised {exc!r}",
                              peer=peer, status=_nixl_status(exc)[0]) from exc

    def _mems(self, peer: str, n: int) -> tuple[Memory, Memory]:
        remote = self._peers.get(peer)
        if remote is None:
            raise self._error(f"unknown peer {peer!r}: load its metadata with add_peer() "
                              f"first (known: {self.peers})", peer=peer, status=None,
                              blocks=n)
        return self._mem or ("DRAM", 0), remote

    def _make(self, peer: str, index: int, lengths: U64, local_mem: Memory, remote_mem: Memory,
              src: U64, dst: U64, notif: bytes) -> Any:
        """One NIXL transfer request (not yet posted), tracked as live."""
        try:
            local = self._agent.get_xfer_descs(descriptor_rows(src, lengths, local_mem[1]),
                                               local_mem[0])
            remote = self._agent.get_xfer_descs(descriptor_rows(dst, lengths, remote_mem[1]),
                                                remote_mem[0])
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer, notif)
        except Exception as exc:
            raise self._request_error(peer, index, lengths, "initialize_xfer", exc) from exc
        with self._lock:
            self._live.add(handle)
        return handle

    def _release(self, handle: Any) -> bool:
        """Release one handle; False (and kept for close) when NIXL refuses."""
        # Under the lock: close() must not drop the agent while NIXL releases this handle.
        with self._lock:
            self._live.discard(handle)
            if self._closing:  # close() releases every handle it found itself
                return True
            try:
                self._agent.release_xfer_handle(handle)
                return True
            except Exception:
                self._stuck.append(handle)
                return False

    def _request_error(self, peer: str, index: int, lengths: U64, state: str,
                       cause: BaseException | None, *, extra: str = "") -> TransferError:
        status, name = _nixl_status(cause) if cause is not None else (None, state)
        if cause is not None:
            state = f"{state}: {name}"
        n_bytes = int(lengths.sum(dtype=np.uint64))
        msg = (f"agent {self.name!r} -> peer {peer!r}: request {index} ({len(lengths)} blocks, "
               f"{n_bytes} bytes) {state}")
        if cause is not None and str(cause).strip() != name:
            msg += f" ({cause!r})"
        if name == "NIXL_ERR_NOT_FOUND" and not extra:
            extra = ("a descriptor lies outside the memory registered here or described by "
                     "the peer's metadata")
        elif name == "NIXL_ERR_REMOTE_DISCONNECT" and not extra:
            extra = "the peer disconnected (died?); blocks may have partly landed"
        if extra:
            msg += f"; {extra}"
        err = self._error(msg, peer=peer, status=status, batch=index, blocks=len(lengths),
                          n_bytes=n_bytes)
        err.agent = self.name
        err.state = state
        return err

    # ------------------------------------------------------------------ prepped path
    def prep(self, src_layout: Layout, dst_layout: Layout, peer: str,
             template: Template | None = None) -> PreppedPair:
        """Prepare vLLM-style descriptor lists for one peer pair: the template's prepped
        descriptor tables (``template.descriptor_table("src")`` here, ``"dst"`` at the peer;
        the plan's address model), handed to ``prep_xfer_dlist`` once per side. Requests then
        travel as index arrays (:meth:`PreppedPair.indices`, :meth:`PreppedPair.submit`).

        ``template`` defaults to ``kvplan.Template(src_layout, dst_layout)``.

        Raises:
            KvPlanError: the template plans by token (different page sizes or memory orders),
                which whole-page descriptors cannot express: plan with ``Template.plan`` and
                send with :meth:`submit` instead.
            ValueError: a table holds 2**31 descriptors or more (NIXL's indices are int32).
            TransferError: NIXL refused a list, or the peer is unknown.
        """
        self._check_open()
        if template is None:
            template = Template(src_layout, dst_layout)
        local_mem, remote_mem = self._mems(peer, 0)
        src_addrs, src_lens = template.descriptor_table("src")
        dst_addrs, dst_lens = template.descriptor_table("dst")
        if max(len(src_lens), len(dst_lens)) >= 2**31:
            raise ValueError(f"a prepped list would hold {max(len(src_lens), len(dst_lens))} "
                             f"descriptors; NIXL's indices are int32 (at most 2**31 - 1)")
        handles: list[Any] = []
        try:
            # NIXL cannot prepare an empty list; a side without descriptors has no handle.
            for agent, addrs, lens, (mem_type, dev) in (
                    ("NIXL_INIT_AGENT", src_addrs, src_lens, local_mem),
                    (peer, dst_addrs, dst_lens, remote_mem)):
                handles.append(self._agent.prep_xfer_dlist(
                    agent, descriptor_rows(addrs, lens, dev), mem_type) if len(lens) else None)
        except Exception as exc:
            for h in handles:
                if h is not None:
                    h.release()
            raise self._error(f"prep_xfer_dlist towards {peer!r} raised {exc!r}", peer=peer,
                              status=_nixl_status(exc)[0]) from exc
        self._dlists.update(h for h in handles if h is not None)
        return PreppedPair(self, peer, template, handles[0], handles[1], src_lens, dst_lens)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Release every handle (waiting up to the timeout for transfers NIXL cannot cancel),
        deregister memory, drop the agent. Further calls raise."""
        if self._closed:
            return
        with self._lock:
            self._closing = True
            left = list(self._live) + self._stuck
            self._live.clear()
            self._stuck = []
        deadline = time.monotonic() + self.timeout
        for handle in left:
            while True:
                try:
                    self._agent.release_xfer_handle(handle)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        break  # NIXL keeps it on the agent's own leak list
                    time.sleep(0.01)
        for dl in list(self._dlists):
            try:
                dl.release()
            except Exception:
                pass
        self._dlists.clear()
        for peer in list(self._peers):
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:
                pass
        self._peers.clear()
        super().close()
        self._agent = None
        _OPEN.discard(self)
