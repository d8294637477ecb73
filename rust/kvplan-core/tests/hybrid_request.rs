//! A hybrid model's whole request as one value: a page request that carries each side's state
//! slot too ([`Request::with_state_slot`]) is planned by one `prepare` into one plan, its page
//! (or token) blocks followed by its state slots' blocks and its ring rows.
//!
//! The reference is the two requests planned apart, as callers did before: the page request,
//! then the slot request `Request::slot(src, dst)` (with `n_tokens` as its ring positions when
//! the template has ring-state entries). The combined plan must be their concatenation, byte
//! for byte, over seeded cases with rings, windows, a further pool and TP head slices; a batch
//! of combined requests must hold each one's own plan.
//!
//! Staged plans and rounds take the same requests (and slot requests, ring rows and TP-sliced
//! state) from the direct plan's blocks: run on byte memory, their gather, network and scatter
//! (every round's, through arenas of a few bytes per round buffer up to more than the request)
//! must write exactly the bytes the direct plan writes, each once, staging inside its regions.

mod support;

use std::collections::HashMap;

use kvplan_core::rules::heads::staging_writer;
use kvplan_core::{
    Arena, Layout, LayoutContext, MemoryOrder, PackBuffer, PackPlanner, PeerRanks, Plan, PlanError,
    PoolId, Request, RoundsPlanner, Side, StagedPlanner, StagingRegion, StateChannels, Template,
    TemplateOptions,
};
use support::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, heads, paged, with_slots};

/// A small deterministic generator (xorshift64*), seeded per test.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }

    /// `n` distinct pages of `0..capacity`, shuffled (so runs vary from one to one per page).
    fn pages(&mut self, n: usize, capacity: u64) -> Vec<i64> {
        let mut all: Vec<i64> = (0..capacity as i64).collect();
        for i in (1..all.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            all.swap(i, j);
        }
        if self.below(2) == 0 {
            all[..n].sort_unstable();
        }
        all.truncate(n);
        all
    }
}

/// The state part of a request as callers planned it apart: the slot request, with the
/// request's `n_tokens` as ring positions where the template has ring-state pairs.
fn state_request(t: &Template, (s, d): (i64, i64), n_tokens: Option<u64>) -> Request<'static> {
    Request {
        n_tokens: n_tokens.filter(|_| !t.ring_lanes().is_empty()),
        ..Request::slot(s, d)
    }
}

/// Plans `pages` with slots `slot` both ways and checks the combined plan is the page plan
/// followed by the state plan; returns the combined plan.
fn check_combined(t: &Template, pages: &Request<'_>, slot: (i64, i64), case: &str) -> Plan {
    let combined = pages.with_state_slot(slot.0, slot.1);
    let whole = t.plan(&combined).unwrap_or_else(|e| panic!("{case}: {e}"));
    let page_plan = t.plan(pages).unwrap();
    let state_plan = t.plan(&state_request(t, slot, pages.n_tokens)).unwrap();
    let cat = |f: fn(&Plan) -> &Vec<u64>| -> Vec<u64> {
        f(&page_plan)
            .iter()
            .chain(f(&state_plan))
            .copied()
            .collect()
    };
    assert_eq!(whole.src_addrs, cat(|p| &p.src_addrs), "{case}");
    assert_eq!(whole.dst_addrs, cat(|p| &p.dst_addrs), "{case}");
    assert_eq!(whole.lengths, cat(|p| &p.lengths), "{case}");
    assert_eq!(
        whole.total_bytes,
        page_plan.total_bytes + state_plan.total_bytes,
        "{case}"
    );
    assert_eq!(whole.n_runs, page_plan.n_runs + state_plan.n_runs, "{case}");
    let at = page_plan.lengths.len();
    let mut offsets = page_plan.pair_offsets.clone();
    offsets.extend(state_plan.pair_offsets[1..].iter().map(|o| o + at));
    assert_eq!(whole.pair_offsets, offsets, "{case}");
    assert_eq!(*whole.pair_offsets.last().unwrap(), whole.lengths.len());
    // The one gate counts what the plan holds, before it exists.
    let summary = t.prepare(&combined).unwrap();
    assert_eq!(summary.n_blocks, whole.lengths.len(), "{case}");
    assert_eq!(summary.total_bytes, whole.total_bytes, "{case}");
    // Staged and in rounds (a delta request is planned directly only), with its slot and as
    // the slot request alone.
    if pages.skip_tokens == 0 {
        let seed = whole.total_bytes ^ whole.lengths.len() as u64;
        let sends = check_staged(t, &combined, seed, case);
        // A rank that is no arena sender moves no page bytes in rounds, only state.
        assert!(sends || t.plan(pages).unwrap().total_bytes == 0, "{case}");
        check_staged(t, &state_request(t, slot, pages.n_tokens), seed, case);
    }
    whole
}

// ---------------------------------------------------------------- staged plans, rounds

const SRC_STAGING: u64 = 0x5000_0000_0000;
const DST_STAGING: u64 = 0x6000_0000_0000;

/// The byte a source address holds: a hash of the address, so a misplaced block shows.
fn source_byte(addr: u64) -> u8 {
    (addr.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
}

/// Runs `plan`'s blocks from `from` (or the source bytes when `None`) into `to`; every
/// destination byte must lie in `window` and, when `once`, be written once.
fn run(
    plan: (&[u64], &[u64], &[u64]),
    from: Option<&HashMap<u64, u8>>,
    to: &mut HashMap<u64, u8>,
    (window, once): ((u64, u64), bool),
    what: &str,
) {
    let (src, dst, len) = plan;
    for k in 0..len.len() {
        let (s, d, l) = (src[k], dst[k], len[k]);
        assert!(l > 0, "{what}: empty block {k}");
        assert!(
            d >= window.0 && d + l <= window.1,
            "{what}: block {k} [{d:#x}, +{l}) leaves [{:#x}, {:#x})",
            window.0,
            window.1
        );
        for i in 0..l {
            let byte = match from {
                Some(from) => *from
                    .get(&(s + i))
                    .unwrap_or_else(|| panic!("{what}: block {k} reads unwritten {:#x}", s + i)),
                None => source_byte(s + i),
            };
            let before = to.insert(d + i, byte);
            assert!(
                !once || before.is_none(),
                "{what}: {:#x} written twice",
                d + i
            );
        }
    }
}

fn columns(plan: &Plan) -> (&[u64], &[u64], &[u64]) {
    (&plan.src_addrs, &plan.dst_addrs, &plan.lengths)
}

/// Plans `request` directly, staged and in rounds (a round buffer drawn from `seed`), runs each
/// on byte memory and asserts the decode's bytes are the direct plan's. A staged plan whose
/// decode region is laid out in slots (several writers) must refuse moving state as a geometry
/// error, and rounds of a prefill rank that is no arena sender as one; both only then.
/// Returns whether the rounds were planned (not refused for a rank that is no sender).
fn check_staged(t: &Template, request: &Request<'_>, seed: u64, case: &str) -> bool {
    let direct = t.plan(request).unwrap_or_else(|e| panic!("{case}: {e}"));
    let mut want = HashMap::new();
    let everywhere = (0, u64::MAX);
    run(columns(&direct), None, &mut want, (everywhere, true), case);

    let region = |addr| StagingRegion {
        addr,
        size: 1 << 30,
    };
    let staged = StagedPlanner::new(t).plan(request, region(SRC_STAGING), region(DST_STAGING));
    match staged {
        Ok(staged) => {
            assert_eq!(staged.src_staging_bytes, direct.total_bytes, "{case}");
            assert_eq!(staged.direct_blocks, direct.lengths.len(), "{case}");
            for part in [&staged.gather, &staged.scatter] {
                assert_eq!(part.pair_offsets.len(), direct.pair_offsets.len(), "{case}");
                assert_eq!(
                    part.pair_offsets.last(),
                    Some(&part.lengths.len()),
                    "{case}"
                );
            }
            let (mut src_staging, mut dst_staging, mut got) =
                (HashMap::new(), HashMap::new(), HashMap::new());
            let src_window = (SRC_STAGING, SRC_STAGING + staged.src_staging_bytes);
            let (lo, hi) = staged.dst_staging_range;
            let mut dst_window = (DST_STAGING + lo, DST_STAGING + hi);
            if staged.writer.1 == 1 {
                // One writer: its share is the region the plan needs.
                dst_window = (DST_STAGING, DST_STAGING + staged.dst_staging_bytes);
            }
            let gather = (src_window, true);
            run(
                columns(&staged.gather),
                None,
                &mut src_staging,
                gather,
                case,
            );
            let network = (dst_window, true);
            run(
                columns(&staged.network),
                Some(&src_staging),
                &mut dst_staging,
                network,
                case,
            );
            let scatter = (everywhere, true);
            run(
                columns(&staged.scatter),
                Some(&dst_staging),
                &mut got,
                scatter,
                case,
            );
            assert!(
                got == want,
                "{case}: the staged plan writes other bytes than the direct one"
            );
            let counts = StagedPlanner::new(t).counts(request).unwrap();
            assert_eq!(
                counts.network_blocks,
                staged.network.lengths.len(),
                "{case}"
            );
        }
        Err(PlanError::Geometry { what }) if what.contains("state slots have no slot") => {
            let (prefill, decode) = (PeerRanks::of(t.layouts().0), PeerRanks::of(t.layouts().1));
            let (_, writers) =
                staging_writer(prefill.tp_size, prefill.tp_rank, decode.tp_size).unwrap();
            assert!(
                writers > 1 || prefill.pp_size > 1,
                "{case}: refused with one writer: {what}"
            );
        }
        Err(other) => panic!("{case}: staged: {other}"),
    }

    // Rounds: first their senders (any arena), then a round buffer of a few bytes, of about
    // a tenth of the request, or of more than the request.
    let whole = |addr| Arena {
        addr,
        size: 1 << 32,
    };
    let probe = RoundsPlanner::new(t).plan(request, whole(SRC_STAGING), whole(DST_STAGING), 1);
    let senders = match probe {
        Ok(rounds) => rounds.sender.1,
        Err(PlanError::Geometry { what }) if what.contains("senders") => {
            assert!(direct.total_bytes > 0, "{case}");
            assert!(what.contains("replicas_send"), "{case}: {what}");
            return false;
        }
        Err(other) => panic!("{case}: rounds: {other}"),
    };
    let buffers = 1 + (seed % 2) as u32;
    let buffer_bytes = match seed % 3 {
        0 => 1 + seed % 7,
        1 => direct.total_bytes / 10 + 1,
        _ => direct.total_bytes + 5,
    };
    let src_arena = Arena {
        addr: SRC_STAGING,
        size: buffer_bytes * u64::from(buffers),
    };
    let dst_arena = Arena {
        addr: DST_STAGING,
        size: buffer_bytes * u64::from(buffers) * u64::from(senders),
    };
    let rounds = RoundsPlanner::new(t)
        .plan(request, src_arena, dst_arena, buffers)
        .unwrap_or_else(|e| panic!("{case}: rounds: {e}"));
    assert_eq!(rounds.bytes, direct.total_bytes, "{case}");
    assert_eq!(rounds.buffer_bytes, buffer_bytes, "{case}");
    assert_eq!(
        rounds.len() as u64,
        direct.total_bytes.div_ceil(buffer_bytes),
        "{case}: the fewest rounds"
    );
    let (mut src_buffers, mut dst_buffers, mut got) =
        (HashMap::new(), HashMap::new(), HashMap::new());
    let mut offset = 0;
    for (k, manifest) in rounds.manifests.iter().enumerate() {
        assert_eq!(manifest.index as usize, k, "{case}");
        assert_eq!(manifest.n_rounds as usize, rounds.len(), "{case}");
        assert_eq!(manifest.offset, offset, "{case}");
        assert_eq!(manifest.total_bytes, direct.total_bytes, "{case}");
        assert!(
            manifest.bytes > 0 && manifest.bytes <= buffer_bytes,
            "{case}"
        );
        offset += manifest.bytes;
        let b = u64::from(manifest.buffer);
        assert_eq!(b, k as u64 % u64::from(buffers), "{case}");
        let src_window = (
            SRC_STAGING + b * buffer_bytes,
            SRC_STAGING + b * buffer_bytes + manifest.bytes,
        );
        let (lo, hi) = manifest.dst_bytes_range();
        assert!(
            lo >= rounds.dst_share.0 && hi <= rounds.dst_share.1,
            "{case}: round {k} leaves its sender's share"
        );
        let dst_window = (DST_STAGING + lo, DST_STAGING + hi);
        let (gather, network, scatter) = (
            rounds.gather.round(k),
            rounds.network.round(k),
            rounds.scatter.round(k),
        );
        assert_eq!(network.lengths, [manifest.bytes], "{case}");
        assert_eq!(network.src_addrs[0], src_window.0, "{case}");
        assert_eq!(network.dst_addrs[0], dst_window.0, "{case}");
        run(
            columns(&gather),
            None,
            &mut src_buffers,
            (src_window, false),
            case,
        );
        run(
            columns(&network),
            Some(&src_buffers),
            &mut dst_buffers,
            (dst_window, false),
            case,
        );
        for (&s, &l) in scatter.src_addrs.iter().zip(&scatter.lengths) {
            assert!(
                s >= dst_window.0 && s + l <= dst_window.1,
                "{case}: scatter reads outside"
            );
        }
        run(
            columns(&scatter),
            Some(&dst_buffers),
            &mut got,
            (everywhere, true),
            case,
        );
    }
    assert_eq!(offset, direct.total_bytes, "{case}");
    assert!(
        got == want,
        "{case}: rounds write other bytes than the direct plan"
    );
    true
}

/// A batch of `requests` (each carrying a slot or not) holds each request's own plan.
fn check_batch(t: &Template, requests: &[Request<'_>], case: &str) {
    let batch = t
        .batch()
        .plan(requests)
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    for (r, request) in requests.iter().enumerate() {
        let single = t.plan(request).unwrap();
        let range = batch.summary.request_blocks(r).unwrap();
        assert_eq!(
            batch.src_addrs[range.clone()],
            single.src_addrs[..],
            "{case} {r}"
        );
        assert_eq!(
            batch.dst_addrs[range.clone()],
            single.dst_addrs[..],
            "{case} {r}"
        );
        assert_eq!(batch.lengths[range], single.lengths[..], "{case} {r}");
    }
}

// ------------------------------------------------------------------------------ rings

const ROW: u64 = 24;
const PAGE: u64 = 64;
const SLOTS: u64 = 4;

/// A full-attention MLA layer (16 pages of `page_size` tokens), a plain state entry and two
/// ring-state entries of `rings` rows per slot, `stride` bytes apart.
fn ring_peer(base: u64, page_size: u64, rings: u64, stride: u64) -> Layout {
    let kv = Layout::mla(
        vec![base],
        vec![16 * PAGE],
        vec![PAGE],
        Some(vec![0]),
        LayoutContext {
            page_size,
            ..LayoutContext::default()
        },
    )
    .unwrap();
    let ring_bytes = SLOTS * rings * stride;
    kv.with_state(
        "conv",
        vec![base + 0x1_0000],
        vec![SLOTS * 40],
        vec![40],
        vec![1],
    )
    .unwrap()
    .with_state(
        "compressor",
        vec![base + 0x2_0000, base + 0x3_0000],
        vec![ring_bytes; 2],
        vec![ROW; 2],
        vec![0, 1],
    )
    .unwrap()
    .with_strides(vec![PAGE, 40, stride, stride])
    .unwrap()
    .with_rings(vec![None, None, Some(rings), Some(rings)])
    .unwrap()
}

#[test]
fn a_request_with_rings_is_its_pages_then_its_slots_then_its_ring_rows() {
    let mut rng = Rng(0x5EED_0001);
    let mut cases = 0;
    for (rs, rd) in [(3, 5), (4, 4), (7, 2)] {
        for (stride_s, stride_d) in [(ROW, ROW), (ROW + 8, ROW)] {
            let (src, dst) = (
                ring_peer(0x1000_0000, 4, rs, stride_s),
                ring_peer(0x9000_0000, 4, rd, stride_d),
            );
            let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
            assert_eq!(t.ring_lanes().len(), 2);
            for _ in 0..6 {
                let n_pages = 1 + rng.below(8) as usize;
                let (sp, dp) = (rng.pages(n_pages, 16), rng.pages(n_pages, 16));
                let slot = (rng.below(SLOTS) as i64, rng.below(SLOTS) as i64);
                // Whole pages (slots only: no ring positions), then token counts.
                let page_request = Request::pages(&sp, &dp);
                check_combined(&t, &page_request, slot, &format!("R {rs}->{rd} pages"));
                let n = 1 + rng.below(n_pages as u64 * 4);
                let case = format!("R {rs}->{rd}, strides {stride_s}/{stride_d}, n {n}");
                let tokens = Request::tokens(&sp, &dp, n);
                let plan = check_combined(&t, &tokens, slot, &case);
                // The ring rows of the last min(R_p, R_d, n) positions are in it.
                let rows = rs.min(rd).min(n) * 2 * ROW;
                let slots_bytes = 40;
                let pages_bytes = t.plan(&tokens).unwrap().total_bytes;
                assert_eq!(plan.total_bytes, pages_bytes + slots_bytes + rows, "{case}");
                // A delta request moves its tail of tokens, and the whole state.
                let k = rng.below(n + 1);
                check_combined(&t, &tokens.skipping(k), slot, &format!("{case}, skip {k}"));
                cases += 3;
            }
        }
    }
    assert_eq!(cases, 3 * 2 * 6 * 3);
}

// ---------------------------------------------------------------------------- windows

const TOKEN: u64 = 8;
const WINDOW_AT: u64 = 0x10_0000;

/// A full layer and a sliding-window layer (`window` tokens; in a pool of `pool`-token pages
/// when given), plus one state entry.
fn window_peer(base: u64, page_size: u64, pool: Option<u64>, window: u64) -> Layout {
    let (full, win) = (page_size * TOKEN, pool.unwrap_or(page_size) * TOKEN);
    let layout = Layout::mla(
        vec![base, base + WINDOW_AT],
        vec![32 * full, 32 * win],
        vec![full, win],
        Some(vec![0, 1]),
        LayoutContext {
            page_size,
            ..LayoutContext::default()
        },
    )
    .unwrap()
    .with_windows_in_pool(vec![None, Some(window)], pool)
    .unwrap();
    with_slots(layout, "mamba", vec![base + 0x40_0000], 8, 96, vec![2])
}

#[test]
fn a_request_with_windows_and_window_pages_is_its_tokens_then_its_slots() {
    let mut rng = Rng(0x5EED_0002);
    for (ps, pd, pool) in [
        (4, 4, None),
        (4, 8, None),
        (4, 4, Some(16)),
        (2, 4, Some(8)),
    ] {
        for window in [3, 8, 20] {
            let (src, dst) = (
                window_peer(0x1000_0000, ps, pool, window),
                window_peer(0x9000_0000, pd, pool, window),
            );
            let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
            for _ in 0..5 {
                let n = 1 + rng.below(40);
                let (sp, dp) = (
                    rng.pages(n.div_ceil(ps) as usize, 32),
                    rng.pages(n.div_ceil(pd) as usize, 32),
                );
                let q = pool.unwrap_or(n);
                let (sw, dw) = (
                    rng.pages(n.div_ceil(q) as usize, 32),
                    rng.pages(n.div_ceil(q) as usize, 32),
                );
                let mut request = Request::tokens(&sp, &dp, n);
                if pool.is_some() {
                    request = request.with_window_pages(Some(&sw[..]), Some(&dw[..]));
                }
                let slot = (rng.below(8) as i64, rng.below(8) as i64);
                let case = format!("P {ps}->{pd}, pool {pool:?}, window {window}, n {n}");
                check_combined(&t, &request, slot, &case);
                let k = rng.below(n + 1);
                check_combined(&t, &request.skipping(k), slot, &format!("{case}, skip {k}"));
            }
        }
    }
}

// ------------------------------------------------------------------------ further pools

/// Two MLA layers (4-token pages), the second in a pool of its own (`pool_page` tokens per
/// page, `per_row` tokens per row), plus two state entries.
fn pool_peer(base: u64, pool_page: u64, per_row: u64) -> Layout {
    let pool_item = pool_page / per_row * ROW;
    let layout = Layout::mla(
        vec![base, base + (1 << 20)],
        vec![64 * 16, pool_item * 16],
        vec![64, pool_item],
        Some(vec![0, 1]),
        LayoutContext {
            page_size: 4,
            ..LayoutContext::default()
        },
    )
    .unwrap()
    .with_pool(&[1], pool_page, per_row)
    .unwrap();
    let ptrs = vec![base + (2 << 20), base + (3 << 20)];
    with_slots(layout, "state", ptrs, 6, 48, vec![2, 3])
}

#[test]
fn a_request_with_a_further_pool_is_its_tokens_then_its_slots() {
    let mut rng = Rng(0x5EED_0003);
    for (ps, pd) in [(8, 16), (16, 16), (16, 8)] {
        let (src, dst) = (pool_peer(1 << 30, ps, 4), pool_peer(1 << 40, pd, 4));
        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        for _ in 0..8 {
            let n = 1 + rng.below(60);
            let (sp, dp) = (
                rng.pages(n.div_ceil(4) as usize, 16),
                rng.pages(n.div_ceil(4) as usize, 16),
            );
            let (sq, dq) = (
                rng.pages(n.div_ceil(ps) as usize, 16),
                rng.pages(n.div_ceil(pd) as usize, 16),
            );
            let request = Request::tokens(&sp, &dp, n).with_pool_pages(
                PoolId(1),
                Some(&sq[..]),
                Some(&dq[..]),
            );
            let slot = (rng.below(6) as i64, rng.below(6) as i64);
            let case = format!("pool pages {ps}->{pd}, n {n}");
            check_combined(&t, &request, slot, &case);
            let k = rng.below(n + 1);
            check_combined(&t, &request.skipping(k), slot, &format!("{case}, skip {k}"));
        }
    }
}

// ---------------------------------------------------------------------- TP head slices

/// One rank of TP `tp`: MHA K and V of two layers (4 KV heads in all, `order`), a replicated
/// and a sharded state entry per layer (the sharded one `64 / tp` bytes per slot).
fn tp_rank(base: u64, tp: u32, rank: u32, order: MemoryOrder) -> Layout {
    let per_rank = 4 / tp;
    let item = 4 * u64::from(per_rank) * HEAD_BYTES;
    let ids = vec![0i64, 1];
    let context = paged(4)
        .model_layers(2)
        .tp(rank, tp)
        .attention(heads(4, per_rank, order));
    let layout = KvLayout::mha(base, ids.clone(), item, 16 * item)
        .context(context)
        .build();
    let at = base + 0x10_0000;
    let shard = 64 / u64::from(tp);
    let layout = with_slots(layout, "conv", vec![at, at + 0x1000], 3, 8, ids.clone());
    with_slots(
        layout,
        "temporal",
        vec![at + 0x2000, at + 0x3000],
        3,
        shard,
        ids,
    )
}

#[test]
fn a_request_between_tp_sizes_is_its_head_slices_then_its_state_fragments() {
    let mut rng = Rng(0x5EED_0004);
    for (tp_p, tp_d) in [(1, 2), (2, 1), (2, 4), (1, 1)] {
        for order in [MemoryOrder::Nhd, MemoryOrder::Hnd] {
            let mut received = vec![0u64; tp_d as usize];
            for r_d in 0..tp_d {
                for r_p in 0..tp_p {
                    let src = tp_rank(0x1000_0000, tp_p, r_p, order);
                    let dst = tp_rank(0x9000_0000, tp_d, r_d, order);
                    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
                    let n_pages = 1 + rng.below(6) as usize;
                    let (sp, dp) = (rng.pages(n_pages, 16), rng.pages(n_pages, 16));
                    let slot = (rng.below(3) as i64, rng.below(3) as i64);
                    let case = format!("TP {tp_p}->{tp_d}, ranks {r_p}->{r_d}, {order:?}");
                    let request = Request::pages(&sp, &dp);
                    let plan = check_combined(&t, &request, slot, &case);
                    let state_bytes = plan.total_bytes - t.plan(&request).unwrap().total_bytes;
                    // Each decode rank gets each state item once (the replicated one from
                    // one prefill rank, its share of the sharded one from the ranks that hold
                    // it): summed over the prefill ranks below.
                    received[r_d as usize] += state_bytes;
                }
            }
            let per_rank = 2 * (8 + 64 / u64::from(tp_d));
            assert_eq!(received, vec![per_rank; tp_d as usize], "TP {tp_p}->{tp_d}");
        }
    }
}

// -------------------------------------------------------------------- TP-sliced state

/// One rank of TP `tp`: two MLA layers and a state entry per layer whose 16 channels (2
/// bytes each) are split over the TP ranks as two sub-blocks of 8 channels: between different
/// TP sizes each state pair moves several byte slices of a slot.
fn sliced_rank(base: u64, tp: u32, rank: u32) -> Layout {
    let t = u64::from(tp);
    let pages = KvLayout::mla(base, [0, 1], 64, 64 * 16)
        .context(paged(4).tp(rank, tp))
        .build();
    let channels = StateChannels::new(16 / t, 1, &[8, 8]).unwrap();
    with_slots(
        pages,
        "ssm",
        vec![base + (1 << 24), base + (1 << 25)],
        8,
        32 / t,
        vec![0, 1],
    )
    .with_state_channels(vec![None, None, Some(channels), Some(channels)])
    .unwrap()
}

#[test]
fn tp_sliced_state_is_staged_and_in_rounds_as_planned_directly() {
    let mut rng = Rng(0x5EED_0006);
    let (mut sliced, mut refused) = (0, 0);
    for (tp_p, tp_d) in [(1, 2), (2, 1), (2, 4), (4, 2), (1, 1)] {
        for r_d in 0..tp_d {
            for r_p in 0..tp_p {
                let src = sliced_rank(0x1000_0000, tp_p, r_p);
                let dst = sliced_rank(0x9000_0000_0000, tp_d, r_d);
                let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
                let n_pages = 1 + rng.below(6) as usize;
                let (sp, dp) = (rng.pages(n_pages, 16), rng.pages(n_pages, 16));
                let slot = (rng.below(8) as i64, rng.below(8) as i64);
                let case = format!("sliced TP {tp_p}->{tp_d}, ranks {r_p}->{r_d}");
                let request = Request::pages(&sp, &dp);
                let combined = request.with_state_slot(slot.0, slot.1);
                sliced += usize::from(t.asked_by(&combined).sliced_state_pairs > 0);
                // A writer that sends state slices but no pages (whole MLA items come from
                // one rank) is no arena sender unless every writer sends: replicas_send.
                let every_writer = TemplateOptions {
                    replicas_send: true,
                    ..TemplateOptions::default()
                };
                let replicas = Template::new(&src, &dst, every_writer).unwrap();
                for seed in 0..3 {
                    for r in [combined, Request::slot(slot.0, slot.1)] {
                        if !check_staged(&t, &r, seed, &case) {
                            refused += 1;
                            assert!(check_staged(&replicas, &r, seed, &case), "{case}");
                        }
                    }
                }
            }
        }
    }
    assert!(sliced > 0, "some TP pairs slice their state");
    assert!(refused > 0, "some writers send state slices and no pages");
}

// ------------------------------------------------------------------------------ batches

#[test]
fn a_batch_of_combined_requests_holds_each_ones_own_plan() {
    let mut rng = Rng(0x5EED_0005);
    let (src, dst) = (
        ring_peer(0x1000_0000, 4, 3, ROW),
        ring_peer(0x9000_0000, 4, 5, ROW),
    );
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    for round in 0..6 {
        // Disjoint decode pages and slots: four requests of 4 pages each.
        let dst_all = rng.pages(16, 16);
        let src_all: Vec<Vec<i64>> = (0..4).map(|_| rng.pages(4, 16)).collect();
        let n = |r: usize| 1 + (r as u64 * 5 + round) % 16;
        let requests: Vec<Request<'_>> = (0..4)
            .map(|r| {
                let base = if r % 2 == 0 {
                    Request::tokens(&src_all[r], &dst_all[r * 4..r * 4 + 4], n(r))
                } else {
                    Request::pages(&src_all[r], &dst_all[r * 4..r * 4 + 4])
                };
                if r == 3 && round % 2 == 1 {
                    base
                } else {
                    base.with_state_slot(r as i64 % 4, 3 - r as i64)
                }
            })
            .collect();
        check_batch(&t, &requests, &format!("round {round}"));
    }
}

#[test]
fn two_combined_requests_writing_one_decode_slot_are_refused_in_a_batch() {
    let (src, dst) = (
        ring_peer(0x1000_0000, 4, 3, ROW),
        ring_peer(0x9000_0000, 4, 5, ROW),
    );
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let (a, b) = ([0i64, 1], [2i64, 3]);
    let requests = [
        Request::pages(&a, &a).with_state_slot(0, 2),
        Request::pages(&b, &b).with_state_slot(1, 2),
    ];
    let err = t.batch().plan(&requests).unwrap_err();
    assert_eq!(
        err,
        PlanError::RequestsOverlap {
            what: "state slot",
            index: 2,
            first: 0,
            second: 1,
        }
    );
}

// ------------------------------------------------------------------------------ refusals

#[test]
fn a_bad_slot_on_a_combined_request_is_refused_naming_it() {
    let (src, dst) = (
        ring_peer(0x1000_0000, 4, 3, ROW),
        ring_peer(0x9000_0000, 4, 5, ROW),
    );
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let pages = [0i64, 1];
    let request = Request::pages(&pages, &pages);
    assert_eq!(
        t.plan(&request.with_state_slot(-1, 0)).unwrap_err(),
        PlanError::NegativeIndex {
            side: Side::Src,
            index: -1,
            position: 0,
        }
    );
    match t
        .plan(&request.with_state_slot(0, SLOTS as i64))
        .unwrap_err()
    {
        PlanError::IndexOutOfRange {
            side: Side::Dst,
            index,
            capacity,
            ..
        } => assert_eq!((index, capacity), (SLOTS as i64, SLOTS)),
        other => panic!("{other:?}"),
    }
    // A bad page is refused before the slot is looked at, as the page request alone.
    let past = [0i64, 99];
    assert_eq!(
        t.plan(&Request::pages(&past, &past).with_state_slot(0, 0))
            .unwrap_err(),
        t.plan(&Request::pages(&past, &past)).unwrap_err()
    );
}

#[test]
fn a_slot_on_a_template_without_state_is_refused_naming_it() {
    let layout = |base: u64| {
        Layout::mla(
            vec![base],
            vec![16 * PAGE],
            vec![PAGE],
            Some(vec![0]),
            LayoutContext::default(),
        )
        .unwrap()
    };
    let t = Template::new(
        &layout(0x1000_0000),
        &layout(0x9000_0000),
        TemplateOptions::default(),
    )
    .unwrap();
    let pages = [0i64, 1];
    let err = t
        .plan(&Request::pages(&pages, &pages).with_state_slot(1, 2))
        .unwrap_err();
    assert!(
        matches!(&err, PlanError::Geometry { what } if what.contains("state slot (1, 2)")
            && what.contains("pairs no state entries")),
        "{err:?}"
    );
}

#[test]
fn planners_that_plan_pages_or_a_slot_refuse_both_naming_the_feature() {
    let (src, dst) = (
        ring_peer(0x1000_0000, 4, 4, ROW),
        ring_peer(0x9000_0000, 4, 4, ROW),
    );
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let pages = [0i64, 1];
    let request = Request::pages(&pages, &pages).with_state_slot(1, 2);
    let pack = PackBuffer {
        addr: 0x7000_0000,
        size: 1 << 20,
    };
    let err = PackPlanner::new(&t)
        .plan(&request, pack)
        .map(|_| ())
        .unwrap_err();
    match err {
        PlanError::Unsupported {
            planner,
            feature,
            why,
        } => {
            assert_eq!((planner, feature), ("plan_packed", "pages_with_state"));
            assert!(why.contains("state slot (1, 2)"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    // A slot request keeps its own shorthand, and a page request without a slot is unchanged.
    assert!(
        PackPlanner::new(&t)
            .plan(&Request::slot(1, 2), pack)
            .is_ok()
    );
    assert!(
        PackPlanner::new(&t)
            .plan(&Request::pages(&pages, &pages), pack)
            .is_ok()
    );
}
