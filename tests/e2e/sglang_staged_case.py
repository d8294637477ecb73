"""The ``staged`` case of ``scripts/e2e-sglang``: kvplan's staged rounds between two kvplan
peers in live SGLang 0.5.23 servers (Mooncake TCP on loopback).

A prefill and a decode with kvplan installed (``KVPLAN_SGLANG_INSTALL=1``) and staging forced
on (``KVPLAN_STAGING=always``) through a 1 MiB arena in two round buffers, so the 250-token
prompt (4 KiB of KV a token on the tiny Llama) takes two rounds or more. The decode's KV pool
is small and fragmented first: concurrent filler requests, half of them stopping earlier than
the others, exhaust its free list while the long ones still hold every other slot, so SGLang's
allocator (which sorts its free list only when the list runs out) hands the scored prompts the
holes the short ones left, and the direct plan of each prompt is many descriptors. A second
decode runs kvplan without staging: the same prefill must take the direct path to it, say so
once, and its tokens must still equal the plain server's.
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import e2e_harness as harness
from e2e_harness import Results, Server

#: Both staging peers' environment (docs/sglang.md, "Staged transfers in rounds").
STAGED_ENV = {"KVPLAN_STAGING": "always", "KVPLAN_STAGING_ARENA_MIB": "1",
              "KVPLAN_STAGING_BUFFERS": "2", "KVPLAN_STAGING_TIMEOUT_S": "30"}
#: The prefill's line per staged request (``kvplan.compat.sglang.rounds.maybe_send``).
STAGED_LINE = re.compile(r"kvplan: staged request (\S+) to (\S+): (\d+) pages in (\d+) rounds, "
                         r"(\d+) network blocks \(direct plan: (\d+) blocks\)")
#: What the prefill says once per decode peer at negotiation (``kvplan.staging.FallbackLog``).
AGREED_SAID = "kvplan: staged transfers with peer"
DIRECT_SAID = "kvplan: direct transfers with peer"
STAGED_METRICS = ("kvplan:staged_network_blocks_per_request",
                  "kvplan:staged_rounds_per_request")
MIN_RATIO = 10

# The fillers: pairs of a short and a long request, sent together. On the tiny Llama, page
# size 1, the decode's pool is sized so that its free list runs out while the long fillers
# still decode, after the short ones ended: the merged free list is then the short ones' slots,
# every other one held by a long filler, and it has room for every scored prompt.
FILLER_PAIRS = 8
FILLER_PROMPT = 4
FILLER_SHORT = 150
FILLER_LONG = 190
DECODE_POOL = 2 * FILLER_PAIRS * (FILLER_PROMPT + FILLER_SHORT) + FILLER_PAIRS * 15
#: The decode's reserve per running request (SGLang's default, 512, would admit the fillers
#: one or two at a time into a pool this small).
DECODE_RESERVE = 16


@dataclass
class Hooks:
    """What the case takes from ``sglang_e2e`` (passed in: that module runs as ``__main__``)."""

    prompts: Callable[[], list[list[int]]]
    pd_generate: Callable[..., tuple[dict[str, Any], Any]]
    output_ids: Callable[[dict[str, Any]], list[int]]
    installed_check: Callable[..., str]
    max_new_tokens: int


def staged_servers(engine: Any, model: Any) -> tuple[Any, Any, Any]:
    """The staging prefill, the staging decode (small pool) and the decode without staging."""
    prefill = engine.server("kvplan-staged-prefill-p1", model, page_size=1, mode="prefill",
                            kvplan=True)
    decode = engine.server("kvplan-staged-decode-p1", model, page_size=1, mode="decode",
                           kvplan=True)
    off = engine.server("kvplan-staging-off-decode-p1", model, page_size=1, mode="decode",
                        kvplan=True)
    for server in (prefill, decode):
        server.env.update(STAGED_ENV)
    # later flags win in SGLang's argument parser
    decode.argv += ["--max-total-tokens", str(DECODE_POOL),
                    "--num-reserved-decode-tokens", str(DECODE_RESERVE)]
    return prefill, decode, off


def staged_rows(server: Server, offset: int = 0) -> list[dict[str, Any]]:
    rows = []
    for line in server.log_since(offset).splitlines():
        m = STAGED_LINE.search(line)
        if m:
            rows.append({"request": m[1], "peer": m[2], "pages": int(m[3]),
                         "rounds": int(m[4]), "network_blocks": int(m[5]),
                         "direct_blocks": int(m[6])})
    return rows


def metric_totals(server: Server) -> dict[str, float]:
    got: dict[str, float] = {}
    for line in harness.http_text(server.url + "/metrics").splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for series in STAGED_METRICS:
            for suffix in ("_sum", "_count"):
                if name == series + suffix:
                    got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


def fragment(hooks: Hooks, prefill: Any, decode: Any) -> str:
    rng = random.Random(20261206)
    bodies = []
    for _ in range(FILLER_PAIRS):
        for n in (FILLER_SHORT, FILLER_LONG):
            bodies.append(([rng.randrange(3, 512) for _ in range(FILLER_PROMPT)], n))
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(lambda b: hooks.output_ids(hooks.pd_generate(prefill, decode, *b)[0]),
                             bodies))
    got = [len(o) for o in outs]
    if got != [n for _, n in bodies]:
        raise AssertionError(f"fillers generated {got} tokens, wanted {[n for _, n in bodies]}")
    return (f"{len(bodies)} concurrent fillers ({FILLER_PAIRS} of {FILLER_SHORT} and "
            f"{FILLER_PAIRS} of {FILLER_LONG} tokens) through {decode.name}, pool "
            f"{DECODE_POOL} tokens, in {time.monotonic() - started:.0f} s")


def equal_tokens(hooks: Hooks, prefill: Any, decode: Any,
                 reference: Sequence[list[int]]) -> str:
    bad = []
    for ids, want in zip(hooks.prompts(), reference):
        got = hooks.output_ids(hooks.pd_generate(prefill, decode, ids)[0])
        if got != want:
            bad.append(f"len {len(ids)}: first difference at "
                       f"{harness.first_difference(got, want)}: {got} != {want}")
    if bad:
        raise AssertionError("; ".join(bad))
    return f"{len(reference)} prompts of lengths {[len(p) for p in hooks.prompts()]}: tokens equal"


def staged_counts(prefill: Any, offset: int, n_prompts: int) -> str:
    """Every staged request is in the prefill's /metrics (network blocks and rounds per
    request, summing to its logged lines); each scored prompt went staged."""
    rows, scored = staged_rows(prefill), staged_rows(prefill, offset)
    deadline = time.monotonic() + 30.0
    while True:  # the scheduler's samples reach /metrics through the multiprocess directory
        got = metric_totals(prefill)
        if got.get(STAGED_METRICS[0] + "_count", 0) >= len(rows) or \
                time.monotonic() > deadline:
            break
        time.sleep(1.0)
    blocks = (got.get(STAGED_METRICS[0] + "_sum", 0.0), got.get(STAGED_METRICS[0] + "_count", 0.0))
    rounds = (got.get(STAGED_METRICS[1] + "_sum", 0.0), got.get(STAGED_METRICS[1] + "_count", 0.0))
    detail = (f"prefill {STAGED_METRICS[0]} sum {blocks[0]:.0f} count {blocks[1]:.0f}, "
              f"{STAGED_METRICS[1]} sum {rounds[0]:.0f} count {rounds[1]:.0f}; "
              f"{len(rows)} staged requests logged")
    if len(scored) != n_prompts:
        raise AssertionError(detail + f"; {len(scored)} of the {n_prompts} scored prompts "
                             "went staged")
    if (blocks[1], rounds[1]) != (len(rows), len(rows)) or \
            blocks[0] != sum(r["network_blocks"] for r in rows) or \
            rounds[0] != sum(r["rounds"] for r in rows):
        raise AssertionError(detail + ": the metrics do not sum to the logged requests")
    return detail + "; per scored prompt (pages, rounds, network blocks): " + ", ".join(
        f"{r['pages']}/{r['rounds']}/{r['network_blocks']}" for r in scored)


def reduction(prefill: Any, offset: int) -> str:
    """Per scored prompt the direct plan's blocks beside the staged network blocks; the
    longest must take two rounds or more and at least MIN_RATIO times fewer descriptors."""
    rows = staged_rows(prefill, offset)
    if not rows:
        raise AssertionError("no staged request logged for the scored prompts")
    per = ", ".join(f"{r['pages']} pages {r['direct_blocks']} -> {r['network_blocks']}"
                    for r in rows)
    direct = sum(r["direct_blocks"] for r in rows)
    network = sum(r["network_blocks"] for r in rows)
    detail = (f"direct plan blocks -> staged network blocks: {per}; in all {direct} -> "
              f"{network} ({direct / max(network, 1):.1f}x)")
    long = max(rows, key=lambda r: r["pages"])
    ratio = long["direct_blocks"] / max(long["network_blocks"], 1)
    if long["rounds"] < 2 or ratio < MIN_RATIO:
        raise AssertionError(detail + f"; the longest prompt: {long['rounds']} rounds, "
                             f"{ratio:.1f}x (wanted >= 2 rounds and >= {MIN_RATIO}x)")
    return detail


def direct_when_off(hooks: Hooks, prefill: Any, off: Any,
                    reference: Sequence[list[int]]) -> str:
    """The decode without staging sends no kvplan frame: the prefill negotiates the direct
    path with it, says so once, stages none of its requests, and the tokens are equal."""
    offset = prefill.log_size()
    detail = equal_tokens(hooks, prefill, off, reference)
    since = prefill.log_since(offset)
    said = [line.strip() for line in since.splitlines() if DIRECT_SAID in line]
    if len(said) != 1:
        raise AssertionError(f"{detail}; but the prefill said the direct path {len(said)} "
                             f"times: {said[:3]}")
    staged = staged_rows(prefill, offset)
    if staged:
        raise AssertionError(f"{detail}; but {len(staged)} requests to it went staged")
    if any(k in off.log_since(0) for k in (AGREED_SAID, "staged request")):
        raise AssertionError(f"{detail}; but {off.name} logged staging")
    return (f"{detail} over the direct path; said once: "
            f"{said[0].split(DIRECT_SAID, 1)[1].strip()[:160]}")


def run_staged(engine: Any, model: Any, results: Results, reference: Sequence[list[int]],
               start: Callable[[Sequence[Server]], None], hooks: Hooks) -> None:
    prefill, decode, off = staged_servers(engine, model)
    group = [prefill, decode, off]
    try:
        started = time.monotonic()
        start(group)
        harness.log(f"staged: servers ready in {time.monotonic() - started:.0f} s")
        results.check("staged: kvplan installed in the three schedulers",
                      lambda: hooks.installed_check(*group))
        results.check("staged: decode pool fragmented",
                      lambda: fragment(hooks, prefill, decode))

        def agreed() -> str:
            said = [str(line).strip() for line in prefill.log_since(0).splitlines()
                    if AGREED_SAID in line]
            if len(said) != 1:
                raise AssertionError(f"the prefill said {len(said)} staged agreements: {said[:3]}")
            return "prefill: " + said[0].split("kvplan: ", 1)[1][:200]

        results.check("staged: both peers negotiated staging", agreed)
        offset = prefill.log_size()
        results.check("staged: kvplan staging in both schedulers (always, 1 MiB arena), "
                      "page size 1", lambda: equal_tokens(hooks, prefill, decode, reference))
        results.check("staged: rounds and network blocks per request in the prefill's "
                      "metrics", lambda: staged_counts(prefill, offset, len(reference)))
        results.check(f"staged: >= {MIN_RATIO}x fewer network descriptors than the direct "
                      "plan", lambda: reduction(prefill, offset))
        results.check("staged negative control: decode without staging",
                      lambda: direct_when_off(hooks, prefill, off, reference))
    finally:
        for s in group:
            s.stop()
