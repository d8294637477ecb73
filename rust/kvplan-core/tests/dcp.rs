//! Byte-level reference for decode context parallelism (no network). Every byte of the global
//! KV is a function of (layer, entry role, global token, head, byte); each rank's pools are
//! filled from the layout definitions alone: a dealt side's rank holds global token `t` when
//! `(t / I) % N == rank`, at local token `(t / (I·N))·I + t % I`, slot `local % P` of page
//! `pages[local / P]`; draft items hold every token in virtual pages of `P·N` tokens; a TP rank
//! holds its heads (NHD items). Every (prefill PP stage, DCP rank, TP rank) × decode (DCP rank,
//! TP rank) pair is planned and applied, and every decode rank's pool must equal what a naive
//! per-token, per-head copier writes, with no destination byte written twice (so drafts, state
//! and replicated heads have exactly one sender) and no token missed. Configurations are sampled
//! deterministically from DCP {1,2,4,8}² × interleave {1, page size, other} × PP {1,2} × page
//! sizes × MLA/MHA/hybrid × draft.

mod support;

use kvplan_core::Request;
use kvplan_core::{
    DcpContext, GeometryOptions, LayerGroups, LayerSlices, Layout, MemoryOrder, PlanError,
    PlanSlices, Template, TemplateOptions,
};
use support::blocks::{scrambled_pages, state_plan};
use support::layouts::{
    ContextBuilder, HEAD_BYTES, KvLayout, dcp, heads, heads_per_rank, paged, with_slots,
};

const DRAFT_TOKEN: u64 = 6;
const STATE_ITEM: u64 = 12;
const STATE_SLOTS: u64 = 3;
const SRC_STATE_SLOT: i64 = 2;
const DST_STATE_SLOT: i64 = 1;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Model {
    Mla,
    Mha,
    /// MLA layers 1 and 3 of 4, state entries on layers 0 and 2.
    Hybrid,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    model: Model,
    /// DCP size and interleave of the prefill and the decode.
    dcp: ((u32, u64), (u32, u64)),
    page_sizes: (u64, u64),
    pp: u32,
    tp: (u32, u32),
    draft: bool,
    tokens: u64,
}

const LAYERS: i64 = 4;
const KV_HEADS: u32 = 2;

impl Case {
    fn heads(&self) -> u32 {
        if self.model == Model::Mha {
            KV_HEADS
        } else {
            1
        }
    }

    /// Attention layers (ids) of PP stage `stage` of `pp` (all layers for `pp = 1`).
    fn attention_layers(&self, stage: u32, pp: u32) -> Vec<i64> {
        let per = LAYERS / i64::from(pp);
        let ids = (i64::from(stage) * per)..(i64::from(stage) + 1) * per;
        match self.model {
            Model::Hybrid => ids.filter(|l| l % 2 == 1).collect(),
            _ => ids.collect(),
        }
    }

    fn state_layers(&self, stage: u32, pp: u32) -> Vec<i64> {
        let per = LAYERS / i64::from(pp);
        match self.model {
            Model::Hybrid => ((i64::from(stage) * per)..(i64::from(stage) + 1) * per)
                .filter(|l| l % 2 == 0)
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// One peer: its layout, its arena, the page list of its DCP rank.
struct Peer {
    layout: Layout,
    base: u64,
    bytes: Vec<u8>,
    pages: Vec<i64>,
}

/// What one byte of the global KV is: a function of its coordinates.
fn value(layer: i64, plane: u64, token: u64, head: u64, byte: u64) -> u8 {
    let x = (layer as u64 + 1)
        .wrapping_mul(0x9E37_79B9)
        .wrapping_add(plane.wrapping_mul(0x85EB_CA6B))
        .wrapping_add(token.wrapping_mul(0xC2B2_AE35))
        .wrapping_add(head.wrapping_mul(0x27D4_EB2F))
        .wrapping_add(byte.wrapping_mul(0x1656_67B1));
    ((x ^ (x >> 13) ^ (x >> 29)) % 251 + 1) as u8
}

/// Planes of a layer: 0 = latent (MLA) or K, 1 = V, 2 = draft, 3 = state.
const DRAFT_PLANE: u64 = 2;
const STATE_PLANE: u64 = 3;

#[allow(clippy::too_many_arguments)]
fn peer(
    case: &Case,
    decode: bool,
    stage: u32,
    pp: u32,
    dcp: DcpContext,
    tp: (u32, u32),
    base: u64,
) -> Peer {
    let page_size = if decode {
        case.page_sizes.1
    } else {
        case.page_sizes.0
    };
    let per_rank = heads_per_rank(case.heads(), tp.1);
    let token = u64::from(per_rank) * HEAD_BYTES;
    let item = token * page_size;
    let ranks = u64::from(dcp.size);
    let draft_item = DRAFT_TOKEN * page_size * ranks;
    // Capacity: enough pages for every local token and every virtual page, plus spares.
    let map = kvplan_core::rules::dcp::token_map(
        &KvLayout::mla(0, [], 0, 0)
            .context(paged(page_size).dcp(dcp))
            .build(),
    );
    let virtual_pages = case.tokens.div_ceil(page_size * ranks);
    let needed = map
        .pages_for(case.tokens)
        .max(if case.draft { virtual_pages } else { 0 });
    let capacity = needed + 3;
    let seed = base ^ (u64::from(dcp.rank) * 77) ^ u64::from(decode);
    let pages = scrambled_pages(needed, capacity, seed);
    let context = paged(page_size)
        .model_layers(LAYERS as u64)
        .pp(stage, pp)
        .tp(tp.0, tp.1)
        .attention(heads(case.heads(), per_rank, MemoryOrder::Nhd))
        .dcp(dcp);
    let ids = case.attention_layers(stage, pp);
    let span = capacity * item;
    let kind = if case.model == Model::Mha {
        KvLayout::mha
    } else {
        KvLayout::mla
    };
    // Each buffer 64 bytes past the one before, the state and draft buffers after them.
    let entries = kind(base, ids, item, span)
        .spaced(span + 64)
        .context(context);
    let mut at = entries.end();
    let mut layout = entries.build();
    let mut next = |len: u64| {
        let ptr = at;
        at += len + 64;
        ptr
    };
    let states = case.state_layers(stage, pp);
    if !states.is_empty() {
        let ptrs = states
            .iter()
            .map(|_| next(STATE_ITEM * STATE_SLOTS))
            .collect();
        layout = with_slots(layout, "mamba", ptrs, STATE_SLOTS, STATE_ITEM, states);
    }
    // Drafts: one MLA-style draft layer, on the last prefill stage only.
    if case.draft && (decode || stage + 1 == pp) {
        let len = capacity * draft_item;
        let ptr = next(len);
        layout = layout
            .with_draft(vec![ptr], vec![len], vec![draft_item], &[0], LAYERS, None)
            .unwrap();
    }
    let size = (at - base) as usize;
    let mut peer = Peer {
        layout,
        base,
        bytes: vec![0; size],
        pages,
    };
    if !decode {
        fill(case, &mut peer);
    }
    peer
}

/// The head range a TP rank holds.
fn held_heads(case: &Case, layout: &Layout) -> std::ops::Range<u64> {
    let ctx = layout.context();
    let h = u64::from(case.heads());
    let per = (h / u64::from(ctx.tp_size)).max(1);
    let first = if h >= u64::from(ctx.tp_size) {
        u64::from(ctx.tp_rank) * per
    } else {
        u64::from(ctx.tp_rank) * h / u64::from(ctx.tp_size)
    };
    first..first + per
}

/// Every byte a peer should hold, by the layout definitions: `(address offset, value)`.
fn expected(case: &Case, peer: &Peer) -> Vec<(usize, u8)> {
    let layout = &peer.layout;
    let ctx = layout.context();
    let parts = layout.parts();
    let dcp = ctx.dcp;
    let heads = held_heads(case, layout);
    let mut out = Vec::new();
    for e in 0..layout.n_entries() {
        let layer = parts.layer_ids[e].unwrap();
        let ptr = parts.data_ptrs[e] - peer.base;
        if parts.kinds[e] == kvplan_core::Indexing::State {
            continue; // state_bytes
        }
        if layout.is_draft(e) {
            let vp = ctx.page_size * u64::from(dcp.size);
            for t in 0..case.tokens {
                let page = peer.pages[(t / vp) as usize] as u64;
                let at = ptr + page * parts.item_lens[e] + (t % vp) * DRAFT_TOKEN;
                for b in 0..DRAFT_TOKEN {
                    out.push(((at + b) as usize, value(layer, DRAFT_PLANE, t, 0, b)));
                }
            }
            continue;
        }
        let plane = u64::from(parts.roles[e] == "v");
        let (i, n) = (dcp.interleave, u64::from(dcp.size));
        for t in 0..case.tokens {
            if (t / i) % n != u64::from(dcp.rank) {
                continue;
            }
            let local = (t / (i * n)) * i + t % i;
            let page = peer.pages[(local / ctx.page_size) as usize] as u64;
            let slot = local % ctx.page_size;
            let token = (heads.end - heads.start) * HEAD_BYTES;
            let at = ptr + page * parts.item_lens[e] + slot * token;
            for (k, h) in heads.clone().enumerate() {
                for b in 0..HEAD_BYTES {
                    let off = at + k as u64 * HEAD_BYTES + b;
                    out.push((off as usize, value(layer, plane, t, h, b)));
                }
            }
        }
    }
    out
}

fn state_bytes(peer: &Peer, slot: i64) -> Vec<(usize, u8)> {
    let parts = peer.layout.parts();
    let mut out = Vec::new();
    for e in peer.layout.entries_of_kind(kvplan_core::Indexing::State) {
        let layer = parts.layer_ids[e].unwrap();
        let at = parts.data_ptrs[e] - peer.base + slot as u64 * STATE_ITEM;
        for b in 0..STATE_ITEM {
            out.push(((at + b) as usize, value(layer, STATE_PLANE, 0, 0, b)));
        }
    }
    out
}

fn fill(case: &Case, peer: &mut Peer) {
    let mut bytes = std::mem::take(&mut peer.bytes);
    for (at, v) in expected(case, peer)
        .into_iter()
        .chain(state_bytes(peer, SRC_STATE_SLOT))
    {
        bytes[at] = v;
    }
    peer.bytes = bytes;
}

fn apply(
    src: &Peer,
    dst: &mut Peer,
    written: &mut [bool],
    blocks: (&[u64], &[u64], &[u64]),
    what: &str,
) {
    for k in 0..blocks.0.len() {
        let s = (blocks.0[k] - src.base) as usize;
        let d = (blocks.1[k] - dst.base) as usize;
        let len = blocks.2[k] as usize;
        assert!(len > 0, "{what}: empty block");
        for j in 0..len {
            assert!(
                !written[d + j],
                "{what}: destination byte {} written twice",
                d + j
            );
            written[d + j] = true;
        }
        dst.bytes[d..d + len].copy_from_slice(&src.bytes[s..s + len]);
    }
}

fn run(case: &Case) {
    let ((sn, si), (dn, di)) = case.dcp;
    let what = format!("{case:?}");
    let mut sources = Vec::new();
    for stage in 0..case.pp {
        for rank in 0..sn {
            for tp in 0..case.tp.0 {
                let base = 0x1000_0000 * (1 + u64::from(stage * 16 + rank * 4 + tp));
                sources.push(peer(
                    case,
                    false,
                    stage,
                    case.pp,
                    dcp(sn, rank, si),
                    (tp, case.tp.0),
                    base,
                ));
            }
        }
    }
    for rank in 0..dn {
        for tp in 0..case.tp.1 {
            let base = 0x4_0000_0000 + 0x1000_0000 * u64::from(rank * 4 + tp);
            let mut dst = peer(case, true, 0, 1, dcp(dn, rank, di), (tp, case.tp.1), base);
            let mut written = vec![false; dst.bytes.len()];
            for src in &sources {
                let t = Template::new(&src.layout, &dst.layout, TemplateOptions::default())
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let plan = t
                    .plan(&Request::tokens(&src.pages, &dst.pages, case.tokens))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let moved: u64 = plan.lengths.iter().sum();
                assert_eq!(moved, plan.total_bytes, "{what}");
                // A rank pair whose deals never meet (checked token by token over one period
                // of both patterns) moves no target byte and says why; a reason means nothing
                // moves.
                let (s, d) = (src.layout.context().dcp, dst.layout.context().dcp);
                let period = u64::from(s.size) * s.interleave * u64::from(d.size) * d.interleave;
                let never = (0..period).all(|t| {
                    (t / s.interleave) % u64::from(s.size) != u64::from(s.rank)
                        || (t / d.interleave) % u64::from(d.size) != u64::from(d.rank)
                });
                if never && !case.draft && !t.page_pairs().is_empty() {
                    assert!(t.empty_reason().is_some(), "{what}: no reason");
                }
                if t.empty_reason().is_some() {
                    assert!(plan.lengths.is_empty(), "{what}: a reason but blocks");
                }
                apply(
                    src,
                    &mut dst,
                    &mut written,
                    (&plan.src_addrs, &plan.dst_addrs, &plan.lengths),
                    &what,
                );
                let (state, _) = state_plan(&t, SRC_STATE_SLOT, DST_STATE_SLOT);
                let blocks = (
                    &state.src_addrs[..],
                    &state.dst_addrs[..],
                    &state.lengths[..],
                );
                apply(src, &mut dst, &mut written, blocks, &what);
                check_slice_work(case, src, &dst, &what);
            }
            let mut want = vec![0u8; dst.bytes.len()];
            for (at, v) in expected(case, &dst)
                .into_iter()
                .chain(state_bytes(&dst, DST_STATE_SLOT))
            {
                want[at] = v;
            }
            if dst.bytes != want {
                let at = (0..want.len()).find(|&k| dst.bytes[k] != want[k]).unwrap();
                panic!(
                    "{what}: decode DCP rank {rank} TP rank {tp}: byte {at} is {} but should be {}",
                    dst.bytes[at], want[at]
                );
            }
        }
    }
}

/// The work each layer slice reports (blocks, bytes) is what its block ranges of the plan hold,
/// for page plans and state plans alike: a decode that counts received bytes against the
/// manifest must see exactly the plan's bytes, whatever share of the tokens this rank holds.
fn check_slice_work(case: &Case, src: &Peer, dst: &Peer, what: &str) {
    let sum = |ranges: &[(usize, usize)], lengths: &[u64]| -> (u64, u64) {
        let blocks = ranges.iter().map(|(a, b)| (b - a) as u64).sum();
        let bytes = ranges.iter().flat_map(|&(a, b)| &lengths[a..b]).sum();
        (blocks, bytes)
    };
    let compare = |cut: &PlanSlices, lengths: &[u64], total: u64, kind: &str| {
        for (k, (ranges, work)) in cut.ranges.iter().zip(&cut.work).enumerate() {
            let got = (work.blocks, work.bytes);
            assert_eq!(got, sum(ranges, lengths), "{what}: {kind} slice {k}");
        }
        let seal = (cut.seal.blocks, cut.seal.bytes);
        assert_eq!(seal, sum(&cut.seal_ranges, lengths), "{what}: {kind} seal");
        let reported = cut.work.iter().map(|w| w.bytes).sum::<u64>() + cut.seal.bytes;
        assert_eq!(reported, total, "{what}: {kind} bytes over all slices");
    };
    for groups in [LayerGroups::every_layer(), LayerGroups::fixed(2).unwrap()] {
        let t = Template::with_layer_groups(
            &src.layout,
            &dst.layout,
            TemplateOptions::default(),
            &GeometryOptions::default(),
            &groups,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let slices = LayerSlices::new(&t, &groups).unwrap_or_else(|e| panic!("{what}: {e}"));
        let tokens = Some(case.tokens);
        let plan = t
            .plan(&Request::new(&src.pages, &dst.pages, tokens))
            .unwrap();
        let summary = t
            .prepare(&Request::new(&src.pages, &dst.pages, tokens))
            .unwrap();
        let cut = slices.of(&t, &summary);
        compare(&cut, &plan.lengths, plan.total_bytes, "page");
        let (plan, state) = state_plan(&t, SRC_STATE_SLOT, DST_STATE_SLOT);
        compare(
            &slices.of(&t, &state),
            &plan.lengths,
            state.total_bytes,
            "state",
        );
    }
}

/// Deterministic sample of the configuration space.
fn cases() -> Vec<Case> {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    let sizes = [1u32, 2, 4, 8];
    let pages = [1u64, 2, 4, 16];
    let mut out = Vec::new();
    while out.len() < 400 {
        let model = [Model::Mla, Model::Mha, Model::Hybrid][next(3) as usize];
        let page_sizes = (pages[next(4) as usize], pages[next(4) as usize]);
        let interleave = |page: u64, pick: u64| match pick {
            0 => 1,
            1 => page,
            _ => page * 2, // a deal of whole pages ("other")
        };
        let dcp = (
            (sizes[next(4) as usize], interleave(page_sizes.0, next(3))),
            (sizes[next(4) as usize], interleave(page_sizes.1, next(3))),
        );
        let tp = if model == Model::Mha {
            (1 + next(2) as u32, 1 + next(2) as u32)
        } else {
            (1, 1 + next(2) as u32)
        };
        let mut draft = next(2) == 0;
        // A draft item is a virtual page: it needs deals that divide the page, and (MHA) no
        // head re-slicing of a draft that is not split by heads.
        if dcp.0.1 > page_sizes.0 || dcp.1.1 > page_sizes.1 || (model == Model::Mha && tp.0 != tp.1)
        {
            draft = false;
        }
        let tokens = [0u64, 1, 7, 33, 70][next(5) as usize];
        out.push(Case {
            model,
            dcp,
            page_sizes,
            pp: 1 + next(2) as u32,
            tp,
            draft,
            tokens,
        });
    }
    out
}

#[test]
fn every_decode_dcp_rank_gets_exactly_its_tokens() {
    let all = cases();
    // The sample covers every value of every axis.
    for size in [1, 2, 4, 8] {
        assert!(all.iter().any(|c| c.dcp.0.0 == size) && all.iter().any(|c| c.dcp.1.0 == size));
    }
    assert!(all.iter().any(|c| c.draft && c.dcp.1.0 > 1 && c.pp == 2));
    assert!(
        all.iter()
            .any(|c| c.model == Model::Hybrid && c.dcp.1.0 > 1)
    );
    for case in &all {
        run(case);
    }
}

#[test]
fn sglang_worked_example_of_token_round_robin() {
    // Prefill pages [5, 9] of 2 tokens, decode DCP 2 rank 1 page [2], 4 tokens: target rows
    // 11, 19 -> 4, 5; draft rows 10, 11, 18, 19 -> 8, 9, 10, 11 (virtual page of 4 rows).
    let row = 8u64;
    let src = KvLayout::mla(0, [0], 2 * row, 1 << 16)
        .context(paged(2))
        .build()
        .with_draft(vec![1 << 20], vec![1 << 16], vec![2 * row], &[0], 1, None)
        .unwrap();
    let dst = KvLayout::mla(1 << 24, [0], 2 * row, 1 << 16)
        .context(paged(2).dcp(dcp(2, 1, 1)))
        .build()
        .with_draft(vec![1 << 28], vec![1 << 16], vec![4 * row], &[0], 1, None)
        .unwrap();
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let plan = t.plan(&Request::tokens(&[5i64, 9], &[2i64], 4)).unwrap();
    let rows = |addrs: &[u64], base: u64| -> Vec<u64> {
        addrs.iter().map(|a| (a - base) / row).collect::<Vec<_>>()
    };
    assert_eq!(rows(&plan.src_addrs[..2], 0), vec![11, 19]);
    assert_eq!(rows(&plan.dst_addrs[..2], 1 << 24), vec![4, 5]);
    assert_eq!(plan.lengths[..2], [row, row]);
    // Draft: rows 10,11 and 18,19 of the source, 8..12 of the decode (two source runs).
    assert_eq!(rows(&plan.src_addrs[2..], 1 << 20), vec![10, 18]);
    assert_eq!(rows(&plan.dst_addrs[2..], 1 << 28), vec![8, 10]);
    assert_eq!(plan.lengths[2..], [2 * row, 2 * row]);
}

#[test]
fn rank_pairs_that_share_no_token_plan_nothing_and_say_why() {
    let layout = |rank: u32, base: u64| {
        KvLayout::mla(base, [0], 64, 1 << 12)
            .context(paged(4).dcp(dcp(2, rank, 1)))
            .build()
    };
    let t = Template::new(
        &layout(0, 0),
        &layout(1, 1 << 20),
        TemplateOptions::default(),
    )
    .unwrap();
    let plan = t
        .plan(&Request::tokens(&[0i64, 1], &[0i64, 1], 16))
        .unwrap();
    assert!(plan.lengths.is_empty());
    let reason = t.empty_reason().unwrap();
    assert!(
        reason.contains("prefill DCP rank 0 of 2 (interleave 1) and decode DCP rank 1 of 2"),
        "{reason}"
    );
    // Equal ranks of equal layouts: one block per run, nothing to explain.
    let t = Template::new(
        &layout(1, 0),
        &layout(1, 1 << 20),
        TemplateOptions::default(),
    )
    .unwrap();
    assert!(t.empty_reason().is_none());
    let plan = t
        .plan(&Request::tokens(&[0i64, 1], &[0i64, 1], 16))
        .unwrap();
    assert_eq!(plan.lengths, vec![8 * 16]);
    // A dealt template needs the request's global token count.
    let err = t.plan(&Request::pages(&[0i64, 1], &[0i64, 1])).unwrap_err();
    assert!(matches!(err, PlanError::Geometry { what } if what.contains("needs n_tokens")));
    // Too few pages for the rank's share of the tokens.
    let err = t
        .plan(&Request::tokens(&[0i64], &[0i64, 1], 16))
        .unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::TokenCount {
                needed: 2,
                given: 1,
                ..
            }
        ),
        "{err}"
    );
}
