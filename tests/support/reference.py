"""A small, deliberately naive pure-Python reference for kvplan's planning semantics.

Written from docs/semantics.md (Runs, Entry pairing, Legacy PP slicing, From pairs to blocks,
State entries) and docs/api.md, not from kvplan's code. Everything here is plain Python ints and
lists, O(n) loops, no numpy tricks, so that it is easy to check by reading. The property tests
compare kvplan against it.

Errors are raised as ``RefError(kind, message)`` where ``kind`` is one of ``"pairing"``,
``"size"``, ``"bounds"``, ``"value"``; tests map these to kvplan's exception classes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

U64_MAX = 2**64 - 1


class RefError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# --------------------------------------------------------------------------------------------
# 1. Runs (docs/semantics.md, Runs)
# --------------------------------------------------------------------------------------------


def group_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where BOTH sides step by exactly +1. Returns [(src_start, dst_start, n)]."""
    src = [int(x) for x in src]
    dst = [int(x) for x in dst]
    if len(src) == 0 or len(dst) == 0:
        return []
    if len(src) != len(dst):
        raise RefError("value", f"unequal lengths {len(src)} and {len(dst)}")
    if any(x < 0 for x in src) or any(x < 0 for x in dst):
        raise RefError("value", "negative index")
    runs: list[tuple[int, int, int]] = []
    s0, d0, n = src[0], dst[0], 1
    for i in range(1, len(src)):
        if src[i] - src[i - 1] == 1 and dst[i] - dst[i - 1] == 1:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = src[i], dst[i], 1
    runs.append((s0, d0, n))
    return runs


def plan_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """A plan's runs: taken greedily from the first page, each stepping by +1 on both sides or
    by -1 on both sides throughout. Returns [(lowest src page, lowest dst page, n)]: a run that
    descends copies the same pages as the ascending run from its lowest pages."""
    group_runs(src, dst)  # the same validation
    src = [int(x) for x in src]
    dst = [int(x) for x in dst]
    runs: list[tuple[int, int, int]] = []
    start, step = 0, 0  # step: 0 while the current run has one page
    for i in range(1, len(src) + 1):
        if i < len(src):
            ds, dd = src[i] - src[i - 1], dst[i] - dst[i - 1]
            if ds == dd and abs(ds) == 1 and step in (0, ds):
                step = ds
                continue
        low = i - 1 if step == -1 else start
        runs.append((src[low], dst[low], i - start))
        start, step = i, 0
    return runs


def runs_as_lists(runs: list[tuple[int, int, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """SGLang's output shape: ([[src run values]], [[dst run values]])."""
    return (
        [list(range(s, s + n)) for s, _, n in runs],
        [list(range(d, d + n)) for _, d, n in runs],
    )


# --------------------------------------------------------------------------------------------
# 2. Entry pairing (docs/semantics.md, Entry pairing, plus kvplan's (id, role) keying)
# --------------------------------------------------------------------------------------------


def _published(ids) -> bool:
    return ids is not None and len(ids) > 0


def pair_entries(
    src_ids,
    dst_ids,
    n_src: int,
    n_dst: int,
    allow_positional_fallback: bool = False,
    src_roles=None,
    dst_roles=None,
) -> list[tuple[int, int]]:
    """SGLang's build_transfer_entry_pairs; keyed by (id, role) when both sides give roles.

    Without ids (positional pairing), roles given on both sides restrict pairs to equal roles.
    """
    if n_src == 0:
        return []
    has_src, has_dst = _published(src_ids), _published(dst_ids)
    if has_src != has_dst:
        if not allow_positional_fallback:
            raise RefError(
                "pairing", "Layer metadata must be provided by both PD peers or neither"
            )
        has_src = has_dst = False
    if has_src and has_dst:
        src_ids = [int(x) for x in src_ids]
        dst_ids = [int(x) for x in dst_ids]
        if len(src_ids) != n_src or len(dst_ids) != n_dst:
            raise RefError(
                "pairing",
                f"Layer metadata length must match transfer entries: src metadata={len(src_ids)} "
                f"entries={n_src}, dst metadata={len(dst_ids)} entries={n_dst}",
            )
        use_roles = src_roles is not None and dst_roles is not None
        if use_roles:
            src_keys = list(zip(src_ids, [str(r) for r in src_roles]))
            dst_keys = list(zip(dst_ids, [str(r) for r in dst_roles]))
        else:
            src_keys = list(src_ids)
            dst_keys = list(dst_ids)
        queues: dict = {}
        for j, key in enumerate(dst_keys):
            queues.setdefault(key, deque()).append(j)
        pairs = []
        for i, key in enumerate(src_keys):
            q = queues.get(key)
            if not q:
                layer = key[0] if use_roles else key
                raise RefError(
                    "pairing", f"Decode peer is missing a transfer entry for model layer {layer}"
                )
            pairs.append((i, q.popleft()))
        return pairs
    # positional
    if n_dst < n_src or (n_src != n_dst and not allow_positional_fallback):
        raise RefError(
            "pairing",
            f"PP-heterogeneous transfer requires layer ids on both peers; got src={n_src} "
            f"dst={n_dst} entries",
        )
    if src_roles is None or dst_roles is None:
        return [(i, i) for i in range(n_src)]
    # Both peers say what each entry holds: never pair different roles. The k-th entry of a
    # role pairs with the k-th entry of that role on the other side.
    src_roles = [str(r) for r in src_roles]
    dst_roles = [str(r) for r in dst_roles]
    if len(src_roles) != n_src or len(dst_roles) != n_dst:
        raise RefError("pairing", "role metadata length must match transfer entries")
    pairs = []
    for i, role in enumerate(src_roles):
        k = src_roles[:i].count(role)
        same = [j for j, r in enumerate(dst_roles) if r == role]
        if k >= len(same):
            raise RefError("pairing", f"decode has only {len(same)} entries of role {role!r}")
        pairs.append((i, same[k]))
    return pairs


# --------------------------------------------------------------------------------------------
# 3. Legacy positional PP slicing (docs/semantics.md) with the CORRECT semantics
# --------------------------------------------------------------------------------------------


def legacy_pp_pairs(
    kind: str,
    n_src: int,
    n_dst: int,
    prefill_start_layer: int,
    num_draft_entries: int = 0,
    decode_num_layers: Optional[int] = None,
) -> list[tuple[int, int]]:
    """Correct positional PP slicing (what SGLang intends, with bounds checks).

    MLA: dst = [L0..L(H-1), draft...]; stage entries [target..., draft...] -> target k pairs with
    dst start+k, draft k pairs with dst (n_dst - nd + k). Equal lengths: identity.
    MHA (no draft on the source): src = [K block, V block] (L each); dst = [K(H), V(H), extra...]
    with H = decode_num_layers, or n_dst // 2 when unknown. Equal halves: identity halves.
    """
    start = prefill_start_layer
    if n_src == 0:
        # An empty stage (e.g. a PP stage holding no full-attention layer) transfers nothing.
        # SGLang divides by zero here for MHA; api.md calls it a PairingError, kvplan's core
        # returns no pairs -- both are acceptable outcomes, tests accept either.
        return []
    if kind == "mla":
        nd = num_draft_entries
        if n_src == n_dst:
            return [(i, i) for i in range(n_src)]
        target = n_src - nd
        if nd < 0 or target < 0 or start < 0:
            raise RefError("pairing", "bad counts")
        if start + target > n_dst - nd or n_src > n_dst:
            raise RefError("pairing", "slice out of range")
        pairs = [(k, start + k) for k in range(target)]
        pairs += [(target + k, n_dst - nd + k) for k in range(nd)]
        return pairs
    if kind == "mha":
        if n_src % 2 != 0 or n_dst % 2 != 0:
            raise RefError("pairing", "odd MHA entry count")
        L, D = n_src // 2, n_dst // 2
        if L == D:  # equal layer counts: whole halves (start ignored)
            return [(i, i) for i in range(n_src)]
        if decode_num_layers is None:
            # Counts alone cannot tell an uneven PP split from appended draft K/V.
            raise RefError("pairing", "decode layer count unknown")
        H = decode_num_layers
        if H <= 0 or 2 * H > n_dst:
            raise RefError("pairing", "decode layer count does not fit its entries")
        if start < 0 or start + L > H:
            raise RefError("pairing", "slice out of range")
        return [(k, start + k) for k in range(L)] + [(L + k, H + start + k) for k in range(L)]
    raise RefError("value", f"unknown kind {kind!r}")


# --------------------------------------------------------------------------------------------
# 4. Layout model and block emission (docs/semantics.md, From pairs to blocks and State
#    entries; docs/api.md "Template and plan")
# --------------------------------------------------------------------------------------------


@dataclass
class RefLayout:
    ptrs: list[int]
    lens: list[int]
    items: list[int]
    ids: Optional[list[int]] = None
    roles: Optional[list[str]] = None
    kinds: Optional[list[str]] = None  # "page" / "state"; None = all page

    def __post_init__(self) -> None:
        n = len(self.ptrs)
        assert len(self.lens) == n and len(self.items) == n
        if self.ids is not None:
            assert len(self.ids) == n
        if self.roles is not None:
            assert len(self.roles) == n
        if self.kinds is None:
            self.kinds = ["page"] * n

    @property
    def n(self) -> int:
        return len(self.ptrs)

    def capacity(self, k: int) -> int:
        return self.lens[k] // self.items[k] if self.items[k] else 0

    def select(self, kind: str) -> list[int]:
        return [k for k in range(self.n) if self.kinds[k] == kind]


@dataclass
class RefPlan:
    pairs: list[tuple[int, int]]
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    pair_offsets: list[int] = field(default_factory=list)
    n_runs: int = 0

    @property
    def n_blocks(self) -> int:
        return len(self.lengths)

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths)


def template_pairs(
    src: RefLayout, dst: RefLayout, kind: str = "page", allow_positional_fallback: bool = False
) -> list[tuple[int, int]]:
    """Pairs (global entry indices) among entries of one kind, then the item-length check."""
    si, di = src.select(kind), dst.select(kind)

    def sub(lst, idx):
        return None if lst is None else [lst[k] for k in idx]

    local = pair_entries(
        sub(src.ids, si),
        sub(dst.ids, di),
        len(si),
        len(di),
        allow_positional_fallback,
        sub(src.roles, si),
        sub(dst.roles, di),
    )
    pairs = [(si[a], di[b]) for a, b in local]
    if kind == "page" and src.ids is not None and dst.ids is not None and \
            src.roles is not None and dst.roles is not None:
        # A decode entry of a layer the prefill sends, of a role the prefill has no entry of
        # for that layer: the decode would hold the layer without it (kvplan refuses it).
        sent = {src.ids[i] for i in si}
        keys = {(src.ids[i], src.roles[i]) for i in si}
        for j in di:
            if dst.ids[j] in sent and (dst.ids[j], dst.roles[j]) not in keys:
                raise RefError("pairing", f"the prefill sends layer {dst.ids[j]} without a "
                                          f"{dst.roles[j]} entry")
    for i, j in pairs:
        if src.items[i] != dst.items[j]:
            raise RefError(
                "size",
                f"item length mismatch layer {None if src.ids is None else src.ids[i]} "
                f"role {None if src.roles is None else src.roles[i]}: "
                f"{src.items[i]} != {dst.items[j]}",
            )
    return pairs


def plan_blocks(
    src: RefLayout,
    dst: RefLayout,
    pairs: list[tuple[int, int]],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> RefPlan:
    """For each entry pair (order), for each run (order): (sbase+s*L, dbase+d*L, n*L)."""
    src_pages = [int(x) for x in src_pages]
    dst_pages = [int(x) for x in dst_pages]
    if len(src_pages) != len(dst_pages):
        raise RefError("value", "unequal page list lengths")
    for i, j in pairs:
        if src.items[i] == 0:
            continue
        for p in src_pages:
            if p < 0 or p >= src.capacity(i):
                raise RefError("bounds", f"src index {p} capacity {src.capacity(i)}")
        for p in dst_pages:
            if p < 0 or p >= dst.capacity(j):
                raise RefError("bounds", f"dst index {p} capacity {dst.capacity(j)}")
    runs = plan_runs(src_pages, dst_pages)
    out = RefPlan(pairs=list(pairs), n_runs=len(runs))
    out.pair_offsets.append(0)
    for i, j in pairs:
        L = src.items[i]
        if L != 0:
            for s, d, n in runs:
                a, b, c = src.ptrs[i] + s * L, dst.ptrs[j] + d * L, n * L
                if a + c > U64_MAX or b + c > U64_MAX:
                    raise RefError("value", "u64 overflow")
                out.src.append(a)
                out.dst.append(b)
                out.lengths.append(c)
        out.pair_offsets.append(len(out.lengths))
    return out


def plan_state_blocks(
    src: RefLayout, dst: RefLayout, pairs: list[tuple[int, int]], src_slot: int, dst_slot: int
) -> RefPlan:
    """One block per paired state entry: (sptr + L*src_slot, dptr + L*dst_slot, L)."""
    return plan_blocks(src, dst, pairs, [src_slot], [dst_slot])


def plan_page_by_page(
    src: RefLayout,
    dst: RefLayout,
    pairs: list[tuple[int, int]],
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
) -> list[tuple[int, int, int]]:
    """Independent second oracle: one block per page, then merge adjacent blocks per pair."""
    blocks: list[tuple[int, int, int]] = []
    for i, j in pairs:
        L = src.items[i]
        if L == 0:
            continue
        cur: Optional[list[int]] = None
        for s, d in zip(src_pages, dst_pages):
            a, b = src.ptrs[i] + int(s) * L, dst.ptrs[j] + int(d) * L
            if cur is not None and cur[0] + cur[2] == a and cur[1] + cur[2] == b and (
                # a run continues only if both page indices stepped by +1 (not merely adjacent bytes)
                cur[3] + 1 == int(s) and cur[4] + 1 == int(d)
            ):
                cur[2] += L
                cur[3], cur[4] = int(s), int(d)
            else:
                if cur is not None:
                    blocks.append((cur[0], cur[1], cur[2]))
                cur = [a, b, L, int(s), int(d)]
        if cur is not None:
            blocks.append((cur[0], cur[1], cur[2]))
    return blocks
