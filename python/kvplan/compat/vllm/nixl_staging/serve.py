"""The prefill's listener: staged rounds for a decode's read, or a hold for its held check.

:func:`serve_rounds` answers a decode's opening message (and hands a held check to
:func:`serve_hold`); :func:`_decode_gone` stops the streams of a decode whose connection
closed; :func:`_refuse` is the failure message of a stream not served."""

from __future__ import annotations

import threading
from typing import Any

from kvplan.compat.vllm.grouped import GROUP_PAGES_KEY, GroupedRead
from kvplan.compat.vllm.nixl_layout import local_layout
from kvplan.compat.vllm.nixl_staging.groups import check_region_reads
from kvplan.compat.vllm.nixl_staging.leases import send_leases
from kvplan.compat.vllm.nixl_staging.names import HOLD_KEY
from kvplan.compat.vllm.nixl_staging.worker import _staging_log, kv_buffers, worker_staging


def serve_hold(worker: Any, opening: dict[str, Any], reply: Any) -> str:
    """The prefill's answer to a decode's held check (:func:`check_held`), on a thread of its
    own: the request is held as a staged stream holds it (:meth:`SendLeases.hold`, the one
    rule: vLLM still holds it, and the pages of each KV group the check names are the tail of
    vLLM's blocks of that group of it; a check of the one-group form, an older decode's,
    names one group's pages) and stays
    pinned for the stream timeout, by which vLLM's notification after the decode's read has
    normally freed it; the decode is answered with an acknowledgement, or refused naming the
    reason (logged once)."""
    from kvplan.staging import StagingError
    from kvplan.staging.wire import ACK, encode

    state = worker_staging(worker)
    stream = str(opening["stream"])
    peer = str(opening.get("peer", "?"))
    request = opening.get("request")
    grouped = "group_pages" in opening
    pages = _page_lists(opening.get("group_pages")) if grouped else \
        _page_lists([opening.get("src_pages")])
    if not isinstance(request, str) or not request or pages is None:
        _staging_log.error("kvplan staging: cannot check %r for %s: no request or pages",
                           stream, peer)
        _refuse(reply, stream, "bad_message", "the held check names no request and pages")
        return stream
    leases = send_leases(worker)
    hold_s = float(state.config.timeout_s)

    # a thread per check: the hold may wait up to the stream timeout for vLLM's block ids of
    # the request (its next step records them), and the listener thread answers every
    # decode's opening message; the pin itself ends by its deadline (no timer thread)
    def check() -> None:
        try:
            if grouped:
                leases.hold(worker, request, [], stream=stream, timeout_s=hold_s,
                            pin_s=hold_s, group_pages=pages)
            else:
                leases.hold(worker, request, pages[0], stream=stream, timeout_s=hold_s,
                            pin_s=hold_s)
        except StagingError as exc:
            _staging_log.error("kvplan staging: refused %r to %s: request %s: %s", stream,
                               peer, request, exc.detail)
            _refuse(reply, stream, exc.reason, exc.detail)
            return
        try:
            reply(encode(ACK, stream, writer=0, round_index=0))
        except Exception as exc:  # the decode fails the read on its own timeout
            _staging_log.warning("kvplan staging: could not answer %r: %s", stream, exc)

    threading.Thread(target=check, name=f"kvplan-staging-hold-{stream}", daemon=True).start()
    return stream


def _page_lists(value: Any) -> list[list[int]] | None:
    """A held check's pages as lists of ints (None: not a list of lists of ints)."""
    if not isinstance(value, list) or not all(isinstance(g, list) for g in value) or \
            not all(isinstance(p, int) and not isinstance(p, bool) for g in value for p in g):
        return None
    return [[int(p) for p in g] for g in value]


def serve_rounds(worker: Any, data: bytes, reply: Any) -> str:
    """The prefill's answer to a decode's opening message (its listener's ``on_open``):
    negotiate with the decode's staging message, plan the same rounds with this worker's own
    layout as the source (at its own block size, which the decode's message must name for it;
    the decode's may be a multiple of it), and run :func:`kvplan.staging.send_staged` in pull mode on a thread
    of its own: first the request is held (:meth:`SendLeases.hold`: vLLM still holds it, and
    the stream's prefill pages are vLLM's blocks of it; of a read of several KV groups, each
    group's pages the tail of vLLM's blocks of that group, and the request planned from the
    groups' pages and the groups read into each region, which must be this prefill's own
    regions' groups: :class:`GroupedRead`), then each round gathered into this
    worker's arena and announced for the decode to read; it ends after the decode's last
    acknowledgement, and the hold with it. A request it cannot serve (a message it cannot
    plan from, a request vLLM no longer holds, pages that are not the request's) is refused
    with a failure message: the decode's read fails, vLLM's failed-receive path. vLLM frees
    the request's blocks on the decode's notification, which the decode sends after the last
    round's scatter, so after every gather; its lease cannot expire while the stream is held."""
    import threading

    import numpy as np

    import kvplan
    from kvplan.compat.vllm import staging as vstaging
    from kvplan.staging import AckQueue, StagingError, local_copy, send_staged

    state = worker_staging(worker)
    opening = vstaging._read_open(data)
    if HOLD_KEY in opening:  # a held check before the decode's direct read
        return serve_hold(worker, opening, reply)
    stream = str(opening["stream"])
    peer = str(opening.get("peer", "?"))
    try:
        request = opening.get("request")
        if not isinstance(request, str) or not request:
            raise StagingError.make(stream, 0, "bad_message",
                                    "the opening message names no request of this prefill")
        agreement = state.agreement(peer, opening["capabilities"], sending=True,
                                    remote_rank=int(opening["rank"]))
        if not agreement.staged:
            raise StagingError.make(stream, 0, "bad_message",
                                    f"no staging agreement with {peer}: {agreement.reason}")
        layout = local_layout(worker)
        if layout is None or not vstaging.host_kv(worker):
            raise StagingError.make(stream, 0, "bad_message",
                                    "this prefill's KV regions take no staged rounds")
        dst_layout = kvplan.Layout.from_dict(opening["dst_layout"])
        # both sides plan the rounds with this prefill's block size (the decode's may differ)
        seen = kvplan.Layout.from_dict(opening["src_layout"]).page_size
        if seen != layout.page_size:
            raise StagingError.make(
                stream, 0, "bad_message", f"the decode plans this prefill's blocks as "
                f"{seen} tokens each; they hold {layout.page_size}")
        arenas = dict(src_arena=agreement.src_arena, dst_arena=agreement.dst_arena,
                      buffers=agreement.buffers)
        group_pages: list[list[int]] | None = None
        if GROUP_PAGES_KEY in opening:  # a read of several KV groups: the decode's request
            grouped = GroupedRead.from_message(opening)
            why = grouped if isinstance(grouped, str) else \
                check_region_reads(worker, grouped.reads, len(grouped.src))
            if isinstance(grouped, str) or why is not None:
                raise StagingError.make(stream, 0, "bad_message", str(why))
            page = GroupedRead.pool_page_size(layout, dst_layout)
            template: Any = kvplan.Template(grouped.layout(layout, page), dst_layout,
                                            kvplan.Pairing.positional())
            rounds = template.plan_rounds(grouped.request(page), **arenas)
            src_pages: list[int] = []
            group_pages = [list(g) for g in grouped.src]
        else:
            template = kvplan.Template(layout, dst_layout, kvplan.Pairing.positional())
            src_pages = [int(p) for p in opening["src_pages"]]
            rounds = template.plan_rounds(np.asarray(src_pages, np.int64),
                                          np.asarray(opening["dst_pages"], np.int64),
                                          **arenas)
        gather = local_copy(kv_buffers(worker), [state.arena.array])
    except (kvplan.KvPlanError, StagingError, KeyError, TypeError, ValueError) as exc:
        _staging_log.error("kvplan staging: cannot serve %r to %s: %s", stream, peer, exc)
        _refuse(reply, stream, "bad_message", f"{type(exc).__name__}: {exc}")
        return stream
    leases = send_leases(worker)
    acks = AckQueue()
    state.router.open(stream, 0, acks.put)

    def send() -> None:
        held = False
        try:
            try:
                leases.hold(worker, request, src_pages, stream=stream,
                            timeout_s=state.config.timeout_s, group_pages=group_pages)
            except StagingError as exc:
                # logged once, naming the request; nothing was gathered
                _staging_log.error("kvplan staging: refused %r to %s: request %s: %s",
                                   stream, peer, request, exc.detail)
                _refuse(reply, stream, exc.reason, exc.detail)
                return
            held = True
            send_staged(rounds, None, peer, reply, request=stream, acks=acks, writer=0,
                        gather=gather, buffers=agreement.buffers, src_lock=state.arena.lock,
                        timeout_s=state.config.patience(state.lease_s), pull=True)
        except StagingError as exc:
            if exc.reason == "peer_failed" and exc.detail.startswith("cancelled: "):
                # the decode stopped it (vLLM there finished the request): not a failure here
                _staging_log.info("kvplan staging: %s cancelled %r: %s", peer, stream,
                                  exc.detail)
            else:
                _staging_log.warning("kvplan staging: serving %r to %s failed: %s", stream,
                                     peer, exc)
        finally:
            if held:  # the last round acknowledged, or the stream failed: once
                leases.release(request)
            leases.ended(stream)
            state.router.close(stream)

    thread = threading.Thread(target=send, name=f"kvplan-staging-serve-{stream}",
                              daemon=True)
    leases.started(stream, acks, thread)
    thread.start()
    return stream


def _decode_gone(worker: Any, streams: list[str]) -> None:
    """The prefill's listener lost a decode's connection (its ``on_close``): each of
    ``streams`` still being served stops now (after the gather in progress), as if the decode
    had failed it (``peer_failed``), and its hold on the request ends, instead of waiting out
    the staging timeout for an acknowledgement that cannot come."""
    from kvplan.staging.wire import FAIL, encode

    leases = send_leases(worker)
    with leases.lock:
        serving = [(s, leases.streams[s][0]) for s in streams if s in leases.streams]
    for stream, acks in serving:
        acks.put(encode(FAIL, stream, writer=0, round_index=0,
                        payload=b"peer_gone: the decode's staging channel closed"))


def _refuse(reply: Any, stream: str, reason: str, detail: str) -> None:
    """The prefill's failure message for a stream it does not serve (the decode fails it
    ``peer_failed``, naming ``reason``); a reply that cannot be sent is logged."""
    from kvplan.staging.wire import FAIL, encode

    try:
        reply(encode(FAIL, stream, writer=0, round_index=0,
                     payload=f"{reason}: {detail}".encode()[:4096]))
    except Exception as exc:
        _staging_log.warning("kvplan staging: could not refuse %r: %s", stream, exc)
