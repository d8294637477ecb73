"""House rule: the engine adapters (``kvplan.compat``), ``kvplan explain`` and the handshake
report (``kvplan.report``) consume the core's answers; they never re-derive an address, a block
count, a head split or a batching loop. One concept, one place.

Their code (comments and string literals, f-strings included, left out) is scanned for the
arithmetic those concepts are made of. A line that matches must be in :data:`ALLOWED` with the
reason it is not a second copy of the core's rule (reproducing the engine's own argument to call
the engine, or sizing the request itself); an allowed line that no longer matches fails too, so
the list stays as short as the code needs. Read statically: nothing is imported.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: What the rule is about, as the arithmetic that re-derives it.
PATTERNS: dict[str, re.Pattern[str]] = {
    # an address: a pointer, base or address plus an offset (``ptr +``, ``get_ptr() +``)
    "address": re.compile(r"\b\w*(ptrs?|addrs?|base)\b(\[[^\]]*\]|\(\s*\))?\s*\)?\s*\+"),
    # an item or stride scaled: the address model (``* item_len``, ``stride *``)
    "item or stride": re.compile(r"[*/]\s*[\w.]*(item_lens?|stride)\w*\b"
                                 r"|\b\w*(item_lens?|stride)\w*\b(\[[^\]]*\])?\s*[*/]"),
    # pages to tokens or bytes (``page_size *``, ``* page_size``)
    "page size": re.compile(r"\bpage_sizes?\b(\[[^\]]*\])?\s*\*|\*\s*[\w.]*page_sizes?\b"),
    # TP head slicing (``heads // tp``, ``// tp_size``)
    "head split": re.compile(r"//\s*\w*(tp|heads?)\w*\b|\b\w*(heads?|tp)\w*\s*//"),
    # blocks counted by hand (``entries * runs``, ``runs * contiguous``)
    "block count": re.compile(r"\b(n_pages|pages|runs|n_runs|entries|n_entries)\s*\*\s*\w"
                              r"|\w\s*\*\s*(n_pages|runs|n_runs|entries|n_entries)\b"),
    # a batching loop of its own beside kvplan.engines._base.write_batches
    "batching loop": re.compile(r"\brange\(\s*0\s*,\s*\w+\s*,\s*\w+\s*\)"),
}

#: (file, the line's code stripped) -> why that line is not the core's rule written again.
_NIXL_SLICE_FORM = (
    "SGLang's prepared head-slice handle takes the slice count and index its own "
    "expand_page_indices_for_slice uses: read off the slice the core's plan placed (its "
    "stride and offset) and checked to tile the item, not a second head-split rule")

ALLOWED: dict[tuple[str, str], str] = {
    ("python/kvplan/compat/sglang/nixl.py",
     'if s_stride % piece or offset % piece or s_stride * g.page != src_items[i]:'):
        _NIXL_SLICE_FORM,
    ("python/kvplan/compat/sglang/nixl.py",
     'groups, group_idx = s_stride // piece, offset // piece'):
        _NIXL_SLICE_FORM,
    ("python/kvplan/compat/sglang/nixl.py",
     'elif (groups, group_idx) != (s_stride // piece, offset // piece):'):
        _NIXL_SLICE_FORM,
    ("python/kvplan/compat/vllm/templates.py", "src_ptr = lr.base_addr + src_off"):
        "an entry's base for the core: vLLM's region base plus the head-slice offset vLLM's "
        "own _get_sender_transfer_plan gives (vLLM's rule for its own TP ranks)",
    ("python/kvplan/compat/vllm/templates.py", "dst_ptr = rr.base_addr + dst_off"):
        "as src_ptr: the remote region base plus vLLM's own head-slice offset",
    ("python/kvplan/compat/sglang/layouts.py", "layout.data_ptrs + list(ptrs[i]),"):
        "list concatenation (the layout's pointers and the extra entries'), no arithmetic",
    ("python/kvplan/compat/sglang/dcp.py",
     "kernel_addrs = int(pack_buffer.get_ptr()) + np.concatenate(([0], np.cumsum(n * width)"
     "[:-1]))"):
        "SGLang's try_pack_dcp_src kernel argument reproduced: where SGLang's kernel puts each "
        "entry in the pack buffer, compared with kvplan's gather before the kernel is called",
    ("python/kvplan/compat/sglang/dcp.py",
     "or (page_stride != per_page * row_stride).any()"):
        "checks the core's gather against what SGLang's kernel does (rows back to back), to "
        "decide whether the kernel may run; no address is taken from it",
    ("python/kvplan/explain/analysis.py",
     "dst_count = -(-pages * src_size // page_size) if src_size != page_size else pages"):
        "sizes the explained request: the decode pages its prefill pages' tokens fill",
    ("python/kvplan/explain/analysis.py", "return pages * int(template.page_sizes[0])"):
        "sizes the explained request: the tokens of its full prefill pages, which the core "
        "then counts blocks for (n_token_blocks)",
    ("python/kvplan/explain/analysis.py", "if page_blocks == runs * contiguous:"):
        "compares two counts of the core's (the plan's blocks, n_blocks_for with one run) to "
        "word a warning; no count is taken from it",
    ("python/kvplan/explain/analysis.py", "return self.pages * self.page_size"):
        "the explained DCP request's tokens (its size, not a block count)",
    ("python/kvplan/explain/analysis.py", "tokens = pages * page_size"):
        "the explained DCP request's tokens (its size, not a block count)",
    ("python/kvplan/explain/scenario.py", "needed = -(-args.pages * page_size // decode_size)"):
        "sizes the decode pool of a preset: the decode pages the request's tokens fill",
    ("python/kvplan/report.py", "and src_strides[e.src_index] * e.dst_item_len"):
        "which paired entries to name in a warning (strides that differ in ratio to their "
        "items); the blocks it warns about are counted by the core (n_blocks_for) beside it",
    ("python/kvplan/report.py", "!= dst_strides[e.dst_index] * e.src_item_len]"):
        "the other side of the same comparison",
    ("python/kvplan/report.py", "tokens = pages * src.page_size"):
        "the compared request's tokens, which the core counts blocks for (n_token_blocks)",
    ("python/kvplan/report.py", "tokens = pages * ps"):
        "the compared request's tokens, which the core counts blocks for (n_token_blocks)",
    ("python/kvplan/compat/vllm/grouped.py",
     "pool_tokens={k + 1: (len(self.dst[g]) * page_size, 0)"):
        "sizes the request: each KV group's pool's token range, every token of the blocks "
        "vLLM reads whole (its pages times its page's tokens), which the core then plans",
}


def scanned_files(root: Path) -> list[Path]:
    pkg = root / "python" / "kvplan"
    return (sorted((pkg / "compat").rglob("*.py")) + sorted((pkg / "explain").rglob("*.py"))
            + [pkg / "report.py"])


def _code_lines(source: str) -> dict[int, str]:
    """Line number -> the line with every comment and string literal blanked out (an f-string
    whole, on every Python version: 3.12 tokenizes its parts)."""
    lines = source.splitlines()
    mask = [list(line) for line in lines]
    depth = 0
    fstring_start = getattr(tokenize, "FSTRING_START", None)
    fstring_end = getattr(tokenize, "FSTRING_END", None)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if fstring_start is not None and tok.type == fstring_start:
            depth += 1
        blank = depth > 0 or tok.type in (tokenize.COMMENT, tokenize.STRING)
        if fstring_end is not None and tok.type == fstring_end:
            depth -= 1
        if not blank:
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = mask[r - 1]
            lo = c0 if r == r0 else 0
            hi = c1 if r == r1 else len(row)
            row[lo:hi] = " " * (hi - lo)
    return {i + 1: "".join(row) for i, row in enumerate(mask) if "".join(row).strip()}


def findings(root: Path) -> list[tuple[str, int, str, str]]:
    """``(file, line number, pattern name, stripped source line)`` of every match."""
    out = []
    for path in scanned_files(root):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        rel = path.relative_to(root).as_posix()
        for number, code in _code_lines(source).items():
            for name, pattern in PATTERNS.items():
                if pattern.search(code):
                    out.append((rel, number, name, lines[number - 1].strip()))
    return out


def test_adapters_explain_and_report_take_addresses_and_counts_from_the_core() -> None:
    unexplained = [f"{rel}:{n}: [{name}] {line}" for rel, n, name, line in findings(ROOT)
                   if (rel, line) not in ALLOWED]
    assert not unexplained, (
        "address, block, head or batching arithmetic outside the core (ask the core, or add "
        "the line to ALLOWED with why it is not the core's rule):\n" + "\n".join(unexplained))


def test_every_allowed_line_is_still_there() -> None:
    seen = {(rel, line) for rel, _, _, line in findings(ROOT)}
    stale = [f"{rel}: {line}" for rel, line in ALLOWED if (rel, line) not in seen]
    assert not stale, "ALLOWED lines that no longer match (remove them):\n" + "\n".join(stale)


@pytest.mark.parametrize(("code", "name"), [
    ("hpr = max(1, heads // tp)", "head split"),
    ("replicas = max(1, tp_p // heads)", "head split"),
    ("n = entries * runs", "block count"),
    ("addr = ptr + i * item_len", "address"),
    ("addr = base + page * stride", "item or stride"),
    ("tokens = page_size * n", "page size"),
    ("for lo in range(0, n, cap):", "batching loop"),
])
def test_the_patterns_catch_what_they_name(code: str, name: str) -> None:
    assert PATTERNS[name].search(_code_lines(code)[1])


def test_comments_and_strings_are_not_scanned() -> None:
    source = ('x = 1  # heads // tp\ny = "ptr + 1"\nz = f"{entries * runs:,}"\n'
              '"""page_size * 2\n"""\n')
    assert not any(p.search(c) for c in _code_lines(source).values() for p in PATTERNS.values())


def test_the_bindings_template_stays_a_forwarder() -> None:
    """The bindings' ``Template`` converts and forwards: its planners live one file each
    (``batch.rs``, ``pack.rs``, ``staged.rs``, ``descriptors.rs``, ...), so the file that
    declares its methods stays under 450 lines; a method that grows a body belongs beside its
    planner."""
    path = ROOT / "rust" / "kvplan-py" / "src" / "template.rs"
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= 450, f"{path.relative_to(ROOT)} has {n} lines (at most 450)"
