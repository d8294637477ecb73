//! Byte-level simulation of prefill TP ≠ decode TP (no network): the global KV of a few layers
//! is built as bytes, one per (layer, K/V plane, request token, head, byte), and written into
//! every rank's pools by the layout definitions alone (rank `r` of a side holds its heads; item
//! `p` of an entry is page `p`; token `t` of the request is slot `t % page_size` of page
//! `pages[t / page_size]`; an NHD item is `[slot][head][bytes]`, an HND item
//! `[head][slot][bytes]`). Every (prefill rank, decode rank) pair the peer function names is
//! planned, every block is applied with a memmove, and every decode rank's pool must equal what
//! a naive copier writes (each head of each token it holds, from the global KV) with no
//! destination byte written twice, so replicated heads, the MLA latent and replicated state have
//! exactly one sender. This covers page plans (equal page sizes and orders) and token plans
//! (different page sizes or memory orders, or `n_tokens` given) alike.

mod support;

use kvplan_core::Request;
use kvplan_core::{
    AsColumns, AttentionGeometry, Layout, MemoryOrder, Plan, Side, Template, TemplateOptions,
    TpSplit,
};
use support::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, heads, paged, with_slots};

const SLOTS: u64 = 3;
const SRC_SLOT: i64 = 1;
const DST_SLOT: i64 = 2;
/// Bytes of the whole (all-TP) sharded state item; each rank holds `SHARDED / tp`.
const SHARDED: u64 = 64;
/// Bytes of the replicated state item (equal on every rank).
const REPLICATED: u64 = 8;
const SENTINEL: u8 = 0xEE;
const SRC_BASE: u64 = 0x1000_0000;
const DST_BASE: u64 = 0x8000_0000;

#[derive(Clone, Copy, Debug)]
struct Case {
    heads: u32,
    tp_p: u32,
    tp_d: u32,
    /// Memory order of the prefill and the decode items.
    orders: (MemoryOrder, MemoryOrder),
    /// Tokens per page of the prefill and the decode.
    page_sizes: (u64, u64),
    mla: bool,
    pp_p: u32,
    pp_d: u32,
    layers: u32,
    /// Tokens of the request.
    tokens: u64,
    /// Whether `n_tokens` is passed to the plan (otherwise the pages' full tokens move).
    given: bool,
}

impl Case {
    fn page_plan(heads: u32, tp_p: u32, tp_d: u32, order: MemoryOrder, mla: bool) -> Self {
        Self {
            heads,
            tp_p,
            tp_d,
            orders: (order, order),
            page_sizes: (4, 4),
            mla,
            pp_p: 1,
            pp_d: 1,
            layers: 4,
            tokens: 16,
            given: false,
        }
    }

    fn order(&self, side: Side) -> MemoryOrder {
        side.pick(self.orders.0, self.orders.1)
    }

    fn page_size(&self, side: Side) -> u64 {
        side.pick(self.page_sizes.0, self.page_sizes.1)
    }

    /// The request's pages on one side, in token order: runs and breaks, never a repeat.
    fn pages(&self, side: Side) -> Vec<i64> {
        let needed = self.tokens.div_ceil(self.page_size(side)) as i64;
        let capacity = self.capacity(side) as i64;
        match side {
            // 0, 1, 3, 4, 5, …: a gap after the first run.
            Side::Src => (0..capacity)
                .filter(|&p| p != 2)
                .take(needed as usize)
                .collect(),
            // From the top, each pair swapped: cap-2, cap-1, cap-4, cap-3, …
            Side::Dst => (0..needed).map(|i| capacity - 1 - (i ^ 1)).collect(),
        }
    }

    /// Pages per pool: the request's and two more.
    fn capacity(&self, side: Side) -> u64 {
        self.tokens.div_ceil(self.page_size(side)) + 2
    }
}

/// One byte of the model's KV: layer, K/V plane, request token, head, byte.
fn kv_byte(layer: u32, plane: u64, token: u64, head: u32, byte: u64) -> u8 {
    let x = (u64::from(layer) * 7919 + plane * 104_729 + token * 97)
        .wrapping_add(u64::from(head) * 31 + byte * 5 + 1);
    (x ^ (x >> 7)) as u8
}

fn state_byte(layer: u32, which: u64, byte: u64) -> u8 {
    (u64::from(layer) * 37 + which * 101 + byte * 3 + 11) as u8
}

/// One rank's memory: a flat arena at `base`.
struct Rank {
    base: u64,
    arena: Vec<u8>,
    written: Vec<u8>,
    layout: Layout,
}

struct Plane {
    layer: u32,
    plane: u64, // 0 = K, 1 = V (MLA: 0)
}

/// The entries of a rank's pool in layout order: one latent plane per layer (MLA), or every
/// layer's K plane, then every layer's V plane (MHA).
fn planes_of(layers: &[u32], mla: bool) -> Vec<Plane> {
    let planes: &[u64] = if mla { &[0] } else { &[0, 1] };
    planes
        .iter()
        .flat_map(|&plane| layers.iter().map(move |&layer| Plane { layer, plane }))
        .collect()
}

fn layers_of(case: &Case, stage: u32, pp: u32) -> Vec<u32> {
    let per = case.layers / pp;
    (stage * per..(stage + 1) * per).collect()
}

/// Where one side keeps its bytes: per entry `entry_len` bytes of `capacity` items.
struct Geometry {
    first: u32,
    per_rank: u32,
    page_size: u64,
    order: MemoryOrder,
    item: u64,
    entry_len: u64,
}

impl Geometry {
    fn of(case: &Case, split: &TpSplit, side: Side, rank: u32) -> Self {
        let (first, _) = split.heads(side, rank);
        let per_rank = split.heads_per_rank(side);
        let page_size = case.page_size(side);
        let item = page_size * u64::from(per_rank) * HEAD_BYTES;
        Self {
            first,
            per_rank,
            page_size,
            order: case.order(side),
            item,
            entry_len: item * case.capacity(side),
        }
    }

    /// Offset in the arena of byte 0 of head `h` (model numbering) of slot `slot` of page
    /// `page` of entry `e`, straight from the definitions of NHD and HND items.
    fn at(&self, e: usize, page: u64, slot: u64, h: u32) -> usize {
        let k = u64::from(h - self.first);
        let inside = match self.order {
            MemoryOrder::Nhd => (slot * u64::from(self.per_rank) + k) * HEAD_BYTES,
            MemoryOrder::Hnd => (k * self.page_size + slot) * HEAD_BYTES,
        };
        (e as u64 * self.entry_len + page * self.item + inside) as usize
    }
}

/// Builds a rank's layout and fills its arena: a prefill rank holds the request's tokens (its
/// other bytes are noise, so a block reading the wrong page or slot is seen), a decode rank
/// holds sentinels.
fn rank(case: &Case, side: Side, tp_rank: u32, stage: u32) -> Rank {
    let split = TpSplit::new(case.heads, case.tp_p, case.tp_d).unwrap();
    let base = side.pick(SRC_BASE, DST_BASE);
    let (tp, pp) = side.pick((case.tp_p, case.pp_p), (case.tp_d, case.pp_d));
    let g = Geometry::of(case, &split, side, tp_rank);
    let layers = layers_of(case, stage, pp);
    let planes = planes_of(&layers, case.mla);
    let n = planes.len() as u64;
    let context = paged(g.page_size)
        .model_layers(u64::from(case.layers))
        .pp(stage, pp)
        .tp(tp_rank, tp)
        .attention(heads(case.heads, g.per_rank, g.order));
    let ids: Vec<i64> = layers.iter().map(|&l| i64::from(l)).collect();
    // Entries back to back: the arena offsets `Geometry::at` computes.
    let kind = if case.mla {
        KvLayout::mla
    } else {
        KvLayout::mha
    };
    let layout = kind(base, ids.clone(), g.item, g.entry_len)
        .context(context)
        .build();
    // State entries: a replicated and a sharded item per layer.
    let mut size = n * g.entry_len;
    let shard = SHARDED / u64::from(tp);
    let k = layers.len() as u64;
    let rep_ptrs: Vec<u64> = (0..k)
        .map(|i| base + size + i * REPLICATED * SLOTS)
        .collect();
    size += k * REPLICATED * SLOTS;
    let shard_ptrs: Vec<u64> = (0..k).map(|i| base + size + i * shard * SLOTS).collect();
    size += k * shard * SLOTS;
    let layout = with_slots(layout, "conv", rep_ptrs, SLOTS, REPLICATED, ids.clone());
    let layout = with_slots(layout, "temporal", shard_ptrs, SLOTS, shard, ids);
    let mut arena = vec![SENTINEL; size as usize];
    if side == Side::Src {
        arena
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i * 131 + 7) as u8 | 1);
        // Every token of the listed pages, the ones past the request included: a plan that
        // moves more tokens than asked writes bytes the decode must not have.
        let pages = case.pages(Side::Src);
        let tokens = pages.len() as u64 * g.page_size;
        fill_tokens(&mut arena, &g, &planes, &pages, tokens);
        fill_state(
            &mut arena,
            &layers,
            n * g.entry_len,
            SRC_SLOT as u64,
            tp_rank,
            shard,
        );
    }
    let written = vec![0; size as usize];
    Rank {
        base,
        arena,
        written,
        layout,
    }
}

/// Writes tokens `0..tokens` of every plane at `pages` (one side's request pages), every head
/// the rank holds.
fn fill_tokens(arena: &mut [u8], g: &Geometry, planes: &[Plane], pages: &[i64], tokens: u64) {
    for (e, p) in planes.iter().enumerate() {
        for t in 0..tokens {
            let (page, slot) = (pages[(t / g.page_size) as usize] as u64, t % g.page_size);
            for h in g.first..g.first + g.per_rank {
                let at = g.at(e, page, slot, h);
                for b in 0..HEAD_BYTES {
                    arena[at + b as usize] = kv_byte(p.layer, p.plane, t, h, b);
                }
            }
        }
    }
}

/// Writes slot `slot` of the replicated and the sharded state of `layers` (rank `r`'s share).
fn fill_state(arena: &mut [u8], layers: &[u32], start: u64, slot: u64, r: u32, shard: u64) {
    let k = layers.len() as u64;
    for (i, &layer) in layers.iter().enumerate() {
        let at = start + i as u64 * REPLICATED * SLOTS + slot * REPLICATED;
        for b in 0..REPLICATED {
            arena[(at + b) as usize] = state_byte(layer, 0, b);
        }
        let at = start + k * REPLICATED * SLOTS + i as u64 * shard * SLOTS + slot * shard;
        for b in 0..shard {
            arena[(at + b) as usize] = state_byte(layer, 1, u64::from(r) * shard + b);
        }
    }
}

fn apply(case: &Case, src: &Rank, dst: &mut Rank, blocks: (&[u64], &[u64], &[u64])) {
    for ((&s, &d), &n) in blocks.0.iter().zip(blocks.1).zip(blocks.2) {
        assert!(
            s >= src.base && s - src.base + n <= src.arena.len() as u64,
            "{case:?}"
        );
        assert!(
            d >= dst.base && d - dst.base + n <= dst.arena.len() as u64,
            "{case:?}"
        );
        let (s, d, n) = ((s - src.base) as usize, (d - dst.base) as usize, n as usize);
        dst.arena[d..d + n].copy_from_slice(&src.arena[s..s + n]);
        for w in &mut dst.written[d..d + n] {
            assert_eq!(*w, 0, "{case:?}: destination byte {d} written twice");
            *w = 1;
        }
    }
}

/// The request's KV plan: page indices on both sides, with `n_tokens` when the case gives it.
fn plan(case: &Case, t: &Template) -> Plan {
    let (src, dst) = (case.pages(Side::Src), case.pages(Side::Dst));
    t.plan(&Request::new(&src, &dst, case.given.then_some(case.tokens)))
        .unwrap()
}

/// Plans and applies every (prefill rank, decode rank) pair for the decode ranks `decode`, and
/// checks each decode rank's arena against the naive copier. Returns the templates built.
fn run_ranks(case: Case, decode: &[u32]) -> usize {
    let split = TpSplit::new(case.heads, case.tp_p, case.tp_d).unwrap();
    let mut templates = 0;
    let sources: Vec<Vec<Rank>> = (0..case.pp_p)
        .map(|stage| {
            (0..case.tp_p)
                .map(|r_p| rank(&case, Side::Src, r_p, stage))
                .collect()
        })
        .collect();
    for d_stage in 0..case.pp_d {
        for &r_d in decode {
            let mut dst = rank(&case, Side::Dst, r_d, d_stage);
            let peers = split.peers(Side::Dst, r_d).unwrap();
            for (s_stage, stage_sources) in (0..).zip(&sources) {
                // Decode PP 2: stage s receives from prefill stage s only (same layers).
                if case.pp_d > 1 && s_stage != d_stage {
                    continue;
                }
                for (r_p, src) in (0..).zip(stage_sources) {
                    let t = Template::new(&src.layout, &dst.layout, TemplateOptions::default())
                        .unwrap_or_else(|e| panic!("{case:?} {r_p}->{r_d}: {e}"));
                    templates += 1;
                    let plan = plan(&case, &t);
                    let mut state = kvplan_core::FlatBuffer::zeroed(t.state_pairs().len());
                    let n_state = t
                        .plan_into(&Request::slot(SRC_SLOT, DST_SLOT), |_| Ok(state.columns()))
                        .map(|(_, summary)| summary)
                        .unwrap()
                        .n_blocks;
                    if !peers.contains(&r_p) {
                        assert_eq!(plan.lengths.len() + n_state, 0, "{case:?} {r_p}->{r_d}");
                        assert!(t.empty_reason().is_some());
                        continue;
                    }
                    // A template moves no KV exactly when it says why.
                    assert_eq!(
                        plan.lengths.is_empty(),
                        t.empty_reason().is_some(),
                        "{case:?} {r_p}->{r_d}: {:?}",
                        t.empty_reason()
                    );
                    let blocks = (&plan.src_addrs[..], &plan.dst_addrs[..], &plan.lengths[..]);
                    apply(&case, src, &mut dst, blocks);
                    let (s, d, l) = state.into_columns(n_state).unwrap();
                    apply(&case, src, &mut dst, (&s, &d, &l));
                }
            }
            let want = expected(&case, &split, r_d, d_stage);
            if dst.arena != want {
                let at = dst.arena.iter().zip(&want).position(|(a, b)| a != b);
                panic!("{case:?} decode rank {r_d} stage {d_stage}: first wrong byte {at:?}");
            }
        }
    }
    templates
}

fn run(case: Case) -> usize {
    let decode: Vec<u32> = (0..case.tp_d).collect();
    run_ranks(case, &decode)
}

/// What a decode rank's arena holds after a correct transfer: the request's tokens of its
/// heads, and its state slot.
fn expected(case: &Case, split: &TpSplit, r_d: u32, stage: u32) -> Vec<u8> {
    let mut want = rank(case, Side::Dst, r_d, stage).arena;
    let g = Geometry::of(case, split, Side::Dst, r_d);
    let layers = layers_of(case, stage, case.pp_d);
    let planes = planes_of(&layers, case.mla);
    fill_tokens(&mut want, &g, &planes, &case.pages(Side::Dst), case.tokens);
    let shard = SHARDED / u64::from(case.tp_d);
    let start = planes.len() as u64 * g.entry_len;
    fill_state(&mut want, &layers, start, DST_SLOT as u64, r_d, shard);
    want
}

#[test]
fn every_tp_pair_moves_exactly_the_expected_bytes() {
    let mut cases = 0;
    for tp_p in [1, 2, 4, 8] {
        for tp_d in [1, 2, 4, 8] {
            for (pp_p, pp_d) in [(1, 1), (2, 1), (2, 2)] {
                for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
                    for (heads, mla) in [(1, false), (2, false), (8, false), (16, false), (1, true)]
                    {
                        run(Case {
                            pp_p,
                            pp_d,
                            ..Case::page_plan(heads, tp_p, tp_d, order, mla)
                        });
                        cases += 1;
                    }
                }
            }
        }
    }
    assert_eq!(cases, 16 * 3 * 2 * 5);
}

/// Token plans re-slice heads exactly as page plans do: TP {1,2,4,8}² × kv_heads {1 (MLA), 2,
/// 8} × page sizes {1,16,64}² × memory orders {NHD,HND}², with and without `n_tokens`. Every
/// prefill rank of a sampled set of decode ranks (the first, the last, and one between when
/// there is one); a deterministic half of the order pairs per case, alternating, keeps the run
/// short while every order pair meets every page-size pair and TP pair.
#[test]
fn token_plans_slice_heads_across_page_sizes_and_orders() {
    use MemoryOrder::{Hnd, Nhd};
    let orders = [(Nhd, Nhd), (Hnd, Hnd), (Nhd, Hnd), (Hnd, Nhd)];
    let (mut templates, mut k) = (0, 0usize);
    for tp_p in [1, 2, 4, 8] {
        for tp_d in [1u32, 2, 4, 8] {
            let mut decode = vec![0, tp_d - 1];
            if tp_d > 2 {
                decode.insert(1, tp_d / 2 - 1);
            }
            decode.dedup();
            for (heads, mla) in [(1, true), (2, false), (8, false)] {
                for ps in [1, 16, 64] {
                    for pd in [1, 16, 64] {
                        for given in [false, true] {
                            for &orders in orders.iter().skip(k % 2).step_by(2) {
                                let case = Case {
                                    orders,
                                    page_sizes: (ps, pd),
                                    layers: 2,
                                    // 128 tokens fill whole pages of every size; 100 end in a
                                    // partial page of 16 and of 64 tokens.
                                    tokens: if given { 100 } else { 128 },
                                    given,
                                    ..Case::page_plan(heads, tp_p, tp_d, Nhd, mla)
                                };
                                templates += run_ranks(case, &decode);
                            }
                            k += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(templates > 5_000, "{templates}");
}

/// A change to a layout's attention geometry.
type Change = fn(&mut AttentionGeometry);

/// A layout like `layout` with `page_size` tokens per page (items and buffers rescaled from 4
/// tokens per page, state unchanged) and its attention geometry changed by `change`.
fn repaged(layout: &Layout, page_size: u64, change: Change) -> Layout {
    let mut ctx = layout.context().clone();
    change(ctx.attention.as_mut().unwrap());
    ctx.page_size = page_size;
    let mut parts = layout.parts().clone();
    for k in 0..parts.item_lens.len() {
        if parts.kinds[k] == kvplan_core::Indexing::Page {
            parts.item_lens[k] = parts.item_lens[k] / 4 * page_size;
            parts.data_lens[k] = parts.data_lens[k] / 4 * page_size;
        }
    }
    Layout::new(parts, ctx).unwrap()
}

#[test]
fn geometry_differences_are_errors_naming_both_values() {
    let case = Case::page_plan(8, 2, 4, MemoryOrder::Nhd, false);
    let src = rank(&case, Side::Src, 0, 0);
    // Memory orders differ while heads are re-sliced: a token plan that moves the decode's
    // heads (covered byte for byte above), no longer an error.
    let hnd = Case {
        orders: (MemoryOrder::Hnd, MemoryOrder::Hnd),
        ..case
    };
    let dst = rank(&hnd, Side::Dst, 0, 0);
    let t = Template::new(&src.layout, &dst.layout, TemplateOptions::default()).unwrap();
    assert!(t.by_token() && t.empty_reason().is_none());
    // The geometry refusals hold whatever the page sizes (4 -> 4 and 4 -> 16 tokens per page)
    // and memory orders.
    let dst = rank(&case, Side::Dst, 0, 0);
    let changes: [(Change, &str); 3] = [
        (
            |g| (g.head_dim, g.dtype_size) = (4, 1),
            "head slicing: head dims differ (prefill 2, decode 4)",
        ),
        (
            |g| g.heads_per_rank = 1,
            "head slicing: decode publishes heads_per_rank 1 but kv_heads 8 over TP size 4 \
             gives 2 per rank",
        ),
        (
            |g| g.total_kv_heads = 16,
            "head slicing: model KV head counts (kv_heads) differ (prefill 8, decode 16)",
        ),
    ];
    for page_size in [4, 16] {
        for (change, message) in changes {
            for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
                let other = repaged(&dst.layout, page_size, change);
                let mut ctx = other.context().clone();
                ctx.attention.as_mut().unwrap().memory_order = order;
                let other = Layout::new(other.parts().clone(), ctx).unwrap();
                let err =
                    Template::new(&src.layout, &other, TemplateOptions::default()).unwrap_err();
                assert!(
                    err.to_string().starts_with(message),
                    "page size {page_size}, {order:?}: {err}"
                );
                assert_eq!(err.class(), kvplan_core::ErrorClass::SizeMismatch);
            }
        }
    }
}

#[test]
fn nhd_moves_one_block_per_token_slot_and_hnd_one_per_page() {
    for (order, per_page) in [(MemoryOrder::Nhd, 4), (MemoryOrder::Hnd, 1)] {
        let case = Case::page_plan(8, 8, 2, order, false);
        let src = rank(&case, Side::Src, 5, 0);
        let dst = rank(&case, Side::Dst, 1, 0);
        let t = Template::new(&src.layout, &dst.layout, TemplateOptions::default()).unwrap();
        let plan = plan(&case, &t);
        assert_eq!(plan.lengths.len(), 2 * 4 * 4 * per_page);
        assert!(t.empty_reason().is_none());
        let other = rank(&case, Side::Src, 1, 0);
        let t = Template::new(&other.layout, &dst.layout, TemplateOptions::default()).unwrap();
        assert_eq!(
            t.empty_reason().unwrap(),
            "prefill rank 1 holds head 1 and decode rank 1 holds heads 4–7: no head in common"
        );
    }
}
