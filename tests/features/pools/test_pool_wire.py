"""Layouts with pools of their own on the wire: ``to_bytes`` carries each further pool (id,
page size, tokens per row) and each entry's pool, so ``from_bytes`` gives the same layout; a
damaged pool table is a KvPlanError naming the field."""

from __future__ import annotations

import random
import struct
import zlib

import pytest

import kvplan

TOKEN = 16


def pooled_layout(rng: random.Random) -> kvplan.Layout:
    """3 to 7 MLA entries on 4-token pages, some with windows, then 1 to 3 further pools of
    random entries, page sizes and rows (sometimes a window pool among them)."""
    n = rng.randint(3, 7)
    layout = kvplan.Layout([(1 << 30) + (i << 24) for i in range(n)], [64 * 64] * n, [64] * n,
                           list(range(n)), ["kv"] * n, page_size=4)
    windows = [rng.choice([None, None, 8, 12]) for _ in range(n)]
    layout = layout.with_windows(windows)
    free = list(range(n))
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.25 and any(windows) and len(layout.pools) == 1:
            layout = layout.with_windows(windows, window_page_size=rng.choice([2, 4, 8]))
            free = [i for i in free if layout.entry_pools[i] == 0]
            continue
        if len(free) < 2:
            break
        members = rng.sample(free, rng.randint(1, len(free) - 1))
        per_row = rng.choice([1, 2, 4])
        layout = layout.with_pool(members, per_row * rng.choice([1, 2, 4]),
                                  tokens_per_row=per_row)
        free = [i for i in free if i not in members]
    return layout


def test_every_layout_with_further_pools_round_trips() -> None:
    rng = random.Random(20261206)
    seen = 0
    for _ in range(200):
        layout = pooled_layout(rng)
        if len(layout.pools) == 1:
            continue
        seen += 1
        data = layout.to_bytes()
        back = kvplan.Layout.from_bytes(data)
        assert back == layout
        assert back.pools == layout.pools and back.entry_pools == layout.entry_pools
        assert back.to_bytes() == data
        assert back.fingerprint() == layout.fingerprint()
    assert seen >= 150


def test_a_damaged_pool_table_is_refused_naming_the_field() -> None:
    layout = kvplan.Layout([1 << 30, 1 << 31], [4096, 4096], [64, 64], [0, 1], ["kv", "kv"],
                           page_size=4).with_pool([1], 8, tokens_per_row=4)
    data = layout.to_bytes()
    at = data.index(struct.pack("<HH", 0x8007, 17))
    body = bytearray(data[:-4])
    body[at + 2] = 16
    del body[at + 4]
    damaged = bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))
    with pytest.raises(kvplan.KvPlanError, match="a pool table extension holds 16 bytes; it "
                       "must hold 1 to 7 records of 17 bytes"):
        kvplan.Layout.from_bytes(damaged)
