//! Byte-level simulation of prefill TP ≠ decode TP (no network): the global KV of a few layers
//! is built as bytes, split into every rank's pools by its geometry, every (prefill rank,
//! decode rank) pair the peer function names is planned, every block is applied with a memmove,
//! and every decode rank's pool must equal the expected split with no destination byte written
//! twice (so replicated heads, the MLA latent and replicated state have exactly one sender).

use kvplan_core::{
    AsColumns, AttentionGeometry, Layout, LayoutContext, MemoryOrder, Side, Template,
    TemplateOptions, TpSplit,
};

const LAYERS: u32 = 4;
const TOKENS: u64 = 4; // tokens per page
const HEAD_BYTES: u64 = 4; // head_dim 2 × 2-byte elements
const PAGES: u64 = 6; // pages per pool
const SRC_PAGES: [i64; 4] = [0, 1, 3, 4];
const DST_PAGES: [i64; 4] = [5, 2, 3, 0];
const SLOTS: u64 = 3;
const SRC_SLOT: i64 = 1;
const DST_SLOT: i64 = 2;
/// Bytes of the whole (all-TP) sharded state item; each rank holds `SHARDED / tp`.
const SHARDED: u64 = 64;
/// Bytes of the replicated state item (equal on every rank).
const REPLICATED: u64 = 8;
const SENTINEL: u8 = 0xEE;

#[derive(Clone, Copy, Debug)]
struct Case {
    heads: u32,
    tp_p: u32,
    tp_d: u32,
    order: MemoryOrder,
    mla: bool,
    pp_p: u32,
    pp_d: u32,
}

/// One byte of the model's KV: layer, K/V plane, request page, token, head, byte.
fn kv_byte(layer: u32, plane: u64, page: u64, token: u64, head: u32, byte: u64) -> u8 {
    let x = (u64::from(layer) * 7919 + plane * 104_729 + page * 613 + token * 97)
        .wrapping_add(u64::from(head) * 31 + byte * 5 + 1);
    (x ^ (x >> 7)) as u8
}

fn state_byte(layer: u32, which: u64, byte: u64) -> u8 {
    (u64::from(layer) * 37 + which * 101 + byte * 3 + 11) as u8
}

/// One rank's memory: a flat arena; entry `e` lives at `base + offsets[e]`.
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

fn layers_of(stage: u32, pp: u32) -> Vec<u32> {
    let per = LAYERS / pp;
    (stage * per..(stage + 1) * per).collect()
}

/// The item of request page `page` of one plane on a rank holding heads `first..first+n`.
fn item_bytes(p: &Plane, page: u64, first: u32, n: u32, order: MemoryOrder) -> Vec<u8> {
    let mut out = Vec::new();
    match order {
        MemoryOrder::Nhd => {
            for t in 0..TOKENS {
                for h in first..first + n {
                    (0..HEAD_BYTES)
                        .for_each(|b| out.push(kv_byte(p.layer, p.plane, page, t, h, b)));
                }
            }
        }
        MemoryOrder::Hnd => {
            for h in first..first + n {
                for t in 0..TOKENS {
                    (0..HEAD_BYTES)
                        .for_each(|b| out.push(kv_byte(p.layer, p.plane, page, t, h, b)));
                }
            }
        }
    }
    out
}

/// Builds a rank's layout and fills its arena: a prefill rank holds the request's pages (and
/// its state slot), a decode rank holds sentinels.
fn rank(case: &Case, side: Side, tp_rank: u32, stage: u32, base: u64) -> Rank {
    let split = TpSplit::new(case.heads, case.tp_p, case.tp_d).unwrap();
    let (tp, pp) = side.pick((case.tp_p, case.pp_p), (case.tp_d, case.pp_d));
    let (first, _) = split.heads(side, tp_rank);
    let per_rank = split.heads_per_rank(side);
    let item = TOKENS * u64::from(per_rank) * HEAD_BYTES;
    let layers = layers_of(stage, pp);
    let planes = planes_of(&layers, case.mla);
    let entry_len = item * PAGES;
    let n = planes.len() as u64;
    let ptrs: Vec<u64> = (0..n).map(|e| base + e * entry_len).collect();
    let ctx = LayoutContext {
        page_size: TOKENS,
        num_model_layers: Some(u64::from(LAYERS)),
        pp_rank: stage,
        pp_size: pp,
        tp_rank,
        tp_size: tp,
        attention: Some(AttentionGeometry {
            total_kv_heads: case.heads,
            heads_per_rank: per_rank,
            head_dim: 2,
            dtype_size: 2,
            memory_order: case.order,
        }),
        ..LayoutContext::default()
    };
    let ids: Vec<i64> = layers.iter().map(|&l| i64::from(l)).collect();
    let mut layout = if case.mla {
        Layout::mla(
            ptrs,
            vec![entry_len; n as usize],
            vec![item; n as usize],
            Some(ids.clone()),
            ctx,
        )
    } else {
        let h = (n / 2) as usize;
        Layout::mha(
            ptrs[..h].to_vec(),
            ptrs[h..].to_vec(),
            vec![entry_len; h],
            vec![entry_len; h],
            vec![item; h],
            vec![item; h],
            Some(ids.clone()),
            ctx,
        )
    }
    .unwrap();
    let mut size = n * entry_len;
    // State entries (MHA only): a replicated and a sharded item per layer.
    let state = !case.mla;
    let shard = SHARDED / u64::from(tp);
    if state {
        let k = layers.len() as u64;
        let rep_ptrs: Vec<u64> = (0..k)
            .map(|i| base + size + i * REPLICATED * SLOTS)
            .collect();
        size += k * REPLICATED * SLOTS;
        let shard_ptrs: Vec<u64> = (0..k).map(|i| base + size + i * shard * SLOTS).collect();
        size += k * shard * SLOTS;
        let k = k as usize;
        layout = layout
            .with_state(
                "conv",
                rep_ptrs,
                vec![REPLICATED * SLOTS; k],
                vec![REPLICATED; k],
                ids.clone(),
            )
            .unwrap()
            .with_state(
                "temporal",
                shard_ptrs,
                vec![shard * SLOTS; k],
                vec![shard; k],
                ids.clone(),
            )
            .unwrap();
    }
    let mut arena = vec![SENTINEL; size as usize];
    if side == Side::Src {
        for (e, p) in planes.iter().enumerate() {
            for (i, &page) in SRC_PAGES.iter().enumerate() {
                let at = e as u64 * entry_len + page as u64 * item;
                let bytes = item_bytes(p, i as u64, first, per_rank, case.order);
                arena[at as usize..(at + item) as usize].copy_from_slice(&bytes);
            }
        }
        if state {
            fill_state(
                &mut arena,
                &layers,
                n * entry_len,
                SRC_SLOT as u64,
                tp_rank,
                shard,
            );
        }
    }
    let written = vec![0; size as usize];
    Rank {
        base,
        arena,
        written,
        layout,
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

fn apply(src: &Rank, dst: &mut Rank, blocks: (&[u64], &[u64], &[u64])) {
    for ((&s, &d), &n) in blocks.0.iter().zip(blocks.1).zip(blocks.2) {
        let (s, d, n) = ((s - src.base) as usize, (d - dst.base) as usize, n as usize);
        dst.arena[d..d + n].copy_from_slice(&src.arena[s..s + n]);
        for w in &mut dst.written[d..d + n] {
            assert_eq!(*w, 0, "destination byte {d} written twice");
            *w = 1;
        }
    }
}

fn run(case: Case) {
    let split = TpSplit::new(case.heads, case.tp_p, case.tp_d).unwrap();
    for d_stage in 0..case.pp_d {
        for r_d in 0..case.tp_d {
            let mut dst = rank(&case, Side::Dst, r_d, d_stage, 0x8000_0000);
            let peers = split.peers(Side::Dst, r_d).unwrap();
            for s_stage in 0..case.pp_p {
                // Decode PP 2: stage s receives from prefill stage s only (same layers).
                if case.pp_d > 1 && s_stage != d_stage {
                    continue;
                }
                for r_p in 0..case.tp_p {
                    let src = rank(&case, Side::Src, r_p, s_stage, 0x1000_0000);
                    let t = Template::new(&src.layout, &dst.layout, TemplateOptions::default())
                        .unwrap_or_else(|e| panic!("{case:?} {r_p}->{r_d}: {e}"));
                    let plan = t.plan(&SRC_PAGES, &DST_PAGES).unwrap();
                    let mut state = kvplan_core::FlatBuffer::zeroed(t.state_pairs().len());
                    let n_state = t
                        .plan_state_into(SRC_SLOT, DST_SLOT, state.columns())
                        .unwrap()
                        .n_blocks;
                    if !peers.contains(&r_p) {
                        assert_eq!(plan.lengths.len() + n_state, 0, "{case:?} {r_p}->{r_d}");
                        assert!(t.empty_reason().is_some());
                        continue;
                    }
                    if plan.lengths.is_empty() {
                        assert!(t.empty_reason().is_some(), "{case:?} {r_p}->{r_d}");
                    }
                    apply(
                        &src,
                        &mut dst,
                        (&plan.src_addrs, &plan.dst_addrs, &plan.lengths),
                    );
                    let (s, d, l) = state.into_columns(n_state).unwrap();
                    apply(&src, &mut dst, (&s, &d, &l));
                }
            }
            let mut want = rank(&case, Side::Dst, r_d, d_stage, 0x8000_0000);
            fill_expected(&case, &split, r_d, d_stage, &mut want);
            assert!(
                dst.arena == want.arena,
                "{case:?} decode rank {r_d} stage {d_stage}"
            );
        }
    }
}

fn fill_expected(case: &Case, split: &TpSplit, r_d: u32, stage: u32, want: &mut Rank) {
    let (first, _) = split.heads(Side::Dst, r_d);
    let per = split.heads_per_rank(Side::Dst);
    let item = TOKENS * u64::from(per) * HEAD_BYTES;
    let layers = layers_of(stage, case.pp_d);
    let planes = planes_of(&layers, case.mla);
    let entry_len = item * PAGES;
    for (e, p) in planes.iter().enumerate() {
        for (i, &page) in DST_PAGES.iter().enumerate() {
            let at = e as u64 * entry_len + page as u64 * item;
            let bytes = item_bytes(p, i as u64, first, per, case.order);
            want.arena[at as usize..(at + item) as usize].copy_from_slice(&bytes);
        }
    }
    if !case.mla {
        let shard = SHARDED / u64::from(case.tp_d);
        let start = planes.len() as u64 * entry_len;
        fill_state(&mut want.arena, &layers, start, DST_SLOT as u64, r_d, shard);
    }
}

#[test]
fn every_tp_pair_moves_exactly_the_expected_bytes() {
    let mut cases = 0;
    for tp_p in [1, 2, 4, 8] {
        for tp_d in [1, 2, 4, 8] {
            for (pp_p, pp_d) in [(1, 1), (2, 1), (2, 2)] {
                for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
                    for heads in [1, 2, 8, 16] {
                        run(Case {
                            heads,
                            tp_p,
                            tp_d,
                            order,
                            mla: false,
                            pp_p,
                            pp_d,
                        });
                        cases += 1;
                    }
                    run(Case {
                        heads: 1,
                        tp_p,
                        tp_d,
                        order,
                        mla: true,
                        pp_p,
                        pp_d,
                    });
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 16 * 3 * 2 * 5);
}

#[test]
fn geometry_differences_are_errors_naming_both_values() {
    let case = Case {
        heads: 8,
        tp_p: 2,
        tp_d: 4,
        order: MemoryOrder::Nhd,
        mla: false,
        pp_p: 1,
        pp_d: 1,
    };
    let src = rank(&case, Side::Src, 0, 0, 0x1000);
    let hnd = Case {
        order: MemoryOrder::Hnd,
        ..case
    };
    let dst = rank(&hnd, Side::Dst, 0, 0, 0x8000);
    let err = Template::new(&src.layout, &dst.layout, TemplateOptions::default()).unwrap_err();
    // Different memory orders are planned token by token, which cannot re-slice heads too.
    assert_eq!(
        err.to_string(),
        "head slicing: prefill TP 2 x 4 heads (4 tokens per page, NHD) and decode TP 4 x 2 heads \
         (4 tokens per page, HND): re-slicing heads between TP sizes and re-paging tokens \
         (different page sizes or memory orders) in one plan is not supported yet"
    );
    assert_eq!(err.class(), kvplan_core::ErrorClass::SizeMismatch);
}

#[test]
fn nhd_moves_one_block_per_token_slot_and_hnd_one_per_page() {
    for (order, per_page) in [(MemoryOrder::Nhd, TOKENS as usize), (MemoryOrder::Hnd, 1)] {
        let case = Case {
            heads: 8,
            tp_p: 8,
            tp_d: 2,
            order,
            mla: true,
            pp_p: 1,
            pp_d: 1,
        };
        let case = Case { mla: false, ..case };
        let src = rank(&case, Side::Src, 5, 0, 0x1000_0000);
        let dst = rank(&case, Side::Dst, 1, 0, 0x8000_0000);
        let t = Template::new(&src.layout, &dst.layout, TemplateOptions::default()).unwrap();
        let plan = t.plan(&SRC_PAGES, &DST_PAGES).unwrap();
        assert_eq!(
            plan.lengths.len(),
            2 * LAYERS as usize * SRC_PAGES.len() * per_page
        );
        assert!(t.empty_reason().is_none());
        let other = rank(&case, Side::Src, 1, 0, 0x1000_0000);
        let t = Template::new(&other.layout, &dst.layout, TemplateOptions::default()).unwrap();
        assert_eq!(
            t.empty_reason().unwrap(),
            "prefill rank 1 holds head 1 and decode rank 1 holds heads 4–7: no head in common"
        );
    }
}
