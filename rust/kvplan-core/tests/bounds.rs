//! Every public request entry of the core keeps every block inside its entry's registered buffer
//! and writes no destination byte twice, on its own: whatever the template (packed, strided,
//! cross-layer pools that coalesce, caller fragments, head-sliced HND/NHD, token plans across
//! page sizes and memory orders, head-sliced token plans, state), `Template::prepare`,
//! `plan_into` and `plan` choose the page or the token path themselves, with or without
//! `n_tokens`. Buffers of one side are 1 MiB apart, so a block running past its buffer lands in
//! no registered buffer at all.

mod support;

use kvplan_core::Request;
use kvplan_core::{
    Columns, Fragment, Fragments, GeometryOptions, Indexing, Layout, MemoryOrder, Plan, PlanError,
    PlanUnit, Template, TemplateOptions,
};
use support::blocks::{buffers, state_plan};
use support::layouts::{
    ContextBuilder, HEAD_BYTES, KvLayout, heads_per_rank, kv_pool, paged, tp_heads, with_slots,
};

const GAP: u64 = 1 << 20;
const LAYERS: i64 = 2;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Memory {
    Packed,
    /// Items padded by 8 bytes.
    Strided,
    /// One cross-layer pool: every layer's K and V item of a page side by side.
    Pool,
}

#[derive(Clone, Copy, Debug)]
struct Spec {
    memory: Memory,
    page_size: u64,
    /// Published attention geometry: memory order, kv_heads, TP rank and size.
    geometry: Option<(MemoryOrder, u32, u32, u32)>,
    capacity: u64,
    state: bool,
}

impl Spec {
    fn plain(memory: Memory, page_size: u64) -> Self {
        Self {
            memory,
            page_size,
            geometry: None,
            capacity: 9,
            state: false,
        }
    }

    fn sliced(memory: Memory, page_size: u64, order: MemoryOrder, tp: (u32, u32)) -> Self {
        Self {
            geometry: Some((order, 8, tp.0, tp.1)),
            state: true,
            ..Self::plain(memory, page_size)
        }
    }

    fn heads_per_rank(&self) -> u64 {
        self.geometry
            .map_or(2, |(_, heads, _, tp)| u64::from(heads_per_rank(heads, tp)))
    }

    fn layout(&self, base: u64) -> Layout {
        let item = self.page_size * self.heads_per_rank() * HEAD_BYTES;
        let (rank, tp) = self.geometry.map_or((0, 1), |g| (g.2, g.3));
        let geometry = self
            .geometry
            .map(|(order, heads, _, tp)| tp_heads(heads, tp, order));
        let ctx = paged(self.page_size).tp(rank, tp).attention(geometry);
        let layout = match self.memory {
            Memory::Pool => kv_pool(base, self.capacity, 0..LAYERS, item, ctx),
            Memory::Packed | Memory::Strided => {
                let stride = item + if self.memory == Memory::Strided { 8 } else { 0 };
                KvLayout::mha(base, 0..LAYERS, item, self.capacity * stride)
                    .spaced(GAP)
                    .stride(stride)
                    .context(ctx)
                    .build()
            }
        };
        if !self.state {
            return layout;
        }
        // A replicated and a TP-sharded state entry per layer, 3 slots each.
        let at = |k: u64| base + (8 + k) * GAP;
        let ids: Vec<i64> = (0..LAYERS).collect();
        let layout = with_slots(layout, "conv", (0..2).map(at).collect(), 3, 8, ids.clone());
        let shard = 64 / u64::from(tp);
        with_slots(layout, "temporal", (2..4).map(at).collect(), 3, shard, ids)
    }
}

/// Every block inside one registered buffer on each side; no destination byte twice.
fn check_blocks(what: &str, src: &Layout, dst: &Layout, plan: &Plan) {
    let (src_buffers, dst_buffers) = (buffers(src), buffers(dst));
    let inside = |list: &[(u64, u64)], at: u64, len: u64| {
        list.iter().any(|&(a, b)| a <= at && at + len <= b)
    };
    let mut written: Vec<(u64, u64)> = Vec::new();
    for k in 0..plan.lengths.len() {
        let (s, d, len) = (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]);
        assert!(len > 0, "{what}: empty block {k}");
        assert!(
            inside(&src_buffers, s, len),
            "{what}: block {k} reads {s:#x}+{len} outside every prefill buffer"
        );
        assert!(
            inside(&dst_buffers, d, len),
            "{what}: block {k} writes {d:#x}+{len} outside every decode buffer"
        );
        written.push((d, d + len));
    }
    written.sort_unstable();
    for w in written.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "{what}: destination bytes {:#x}..{:#x} written twice",
            w[1].0,
            w[0].1.min(w[1].1)
        );
    }
    assert_eq!(
        plan.lengths.iter().sum::<u64>(),
        plan.total_bytes,
        "{what}: total bytes"
    );
}

/// Distinct pages below `capacity`, the last one included, in a scrambled order with runs.
fn pages(n: u64, capacity: u64, salt: u64) -> Vec<i64> {
    let mut v: Vec<i64> = (0..capacity as i64).collect();
    v.rotate_left((salt % capacity) as usize);
    for k in (0..v.len().saturating_sub(1)).step_by(3) {
        v.swap(k, k + 1);
    }
    v.truncate(n as usize);
    v
}

/// Plans every request shape through `plan`, `plan_into` and `prepare` and checks the blocks.
fn drive(what: &str, src: &Layout, dst: &Layout, geometry: &GeometryOptions) -> usize {
    let options = TemplateOptions::default();
    let t = Template::with_geometry(src, dst, options, geometry)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (ps, pd) = t.page_sizes();
    let page_capacity = |l: &Layout| {
        (0..l.n_entries())
            .filter(|&e| l.parts().kinds[e] == Indexing::Page)
            .map(|e| l.capacity(e))
            .min()
            .unwrap()
    };
    let (cs, cd) = (page_capacity(src), page_capacity(dst));
    let mut plans = 0;
    for salt in 0..3u64 {
        // Page-shaped requests (equal lengths), then token-shaped ones (each side's own pages).
        let n_pages = cs.min(cd) - salt;
        let requests = [
            (pages(n_pages, cs, salt), pages(n_pages, cd, salt + 1), None),
            (pages(cs, cs, salt), pages(cd, cd, salt + 2), None),
            (
                pages(cs, cs, salt),
                pages(cd, cd, salt),
                Some((cs * ps).min(cd * pd) - 5),
            ),
            (pages(cs, cs, salt), pages(cd, cd, salt), Some(1 + salt)),
        ];
        for (sp, dp, n_tokens) in requests {
            let label = format!("{what}: {sp:?} -> {dp:?}, n_tokens {n_tokens:?}");
            let planned = t.plan(&Request::new(&sp, &dp, n_tokens));
            let plan = match planned {
                Ok(plan) => plan,
                // Refusals are errors, never blocks: unequal lengths of a page request, user
                // fragments with a token request.
                Err(PlanError::LengthMismatch { .. }) if !t.by_token() && n_tokens.is_none() => {
                    continue;
                }
                Err(PlanError::Geometry { .. } | PlanError::FragmentCombination { .. })
                    if geometry.fragments != Fragments::Whole =>
                {
                    continue;
                }
                Err(e) => panic!("{label}: {e}"),
            };
            check_blocks(&label, src, dst, &plan);
            // plan_into and prepare agree with plan, and pick the same path.
            let shape = t.prepare(&Request::new(&sp, &dp, n_tokens)).unwrap();
            assert_eq!(shape.n_blocks, plan.lengths.len(), "{label}");
            let by_token = matches!(shape.unit, PlanUnit::Tokens(_));
            assert_eq!(by_token, t.by_token() || n_tokens.is_some(), "{label}");
            let mut storage = vec![0u64; 3 * shape.n_blocks];
            let (_, summary) = t
                .plan_into(&Request::new(&sp, &dp, n_tokens), |s| {
                    Ok(Columns::from_flat(&mut storage, s.n_blocks))
                })
                .unwrap();
            assert_eq!(
                matches!(summary.unit, kvplan_core::PlanUnit::Tokens(_)),
                by_token,
                "{label}"
            );
            let n = summary.n_blocks;
            assert_eq!(storage[..n], plan.src_addrs[..], "{label}");
            assert_eq!(storage[2 * n..], plan.lengths[..], "{label}");
            plans += 1;
        }
        // State slots, the last one included.
        for (s, d) in [(0, 2), (2, 0), (salt as i64, 1)] {
            let (plan, _) = state_plan(&t, s, d);
            check_blocks(&format!("{what}: state {s} -> {d}"), src, dst, &plan);
        }
    }
    plans
}

#[test]
fn a_token_template_planned_through_the_core_stays_in_bounds() {
    // Prefill 64 tokens per page, decode 16: the page path copied a 64-token item into a
    // 16-token slot, ending 0x180 bytes past the decode buffer.
    let src = Spec::plain(Memory::Packed, 64).layout(0x1000_0000);
    let dst = Spec {
        capacity: 16,
        ..Spec::plain(Memory::Packed, 16)
    }
    .layout(0x8000_0000);
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let plan = t.plan(&Request::pages(&[0i64], &[15i64])).unwrap();
    check_blocks("64 -> 16, page 0 -> 15", &src, &dst, &plan);
    assert_eq!(plan.total_bytes, 16 * 2 * HEAD_BYTES * 4);
    let shape = t.prepare(&Request::pages(&[0i64], &[15i64])).unwrap();
    assert!(matches!(shape.unit, PlanUnit::Tokens(_)));
}

#[test]
fn every_template_kind_stays_in_bounds_through_every_entry() {
    use Memory::{Packed, Pool, Strided};
    use MemoryOrder::{Hnd, Nhd};
    let whole = GeometryOptions::default();
    let fragments = GeometryOptions {
        fragments: Fragments::Every(vec![
            Fragment {
                src_off: 0,
                dst_off: 8,
                len: 8,
            },
            Fragment {
                src_off: 16,
                dst_off: 0,
                len: 4,
            },
        ]),
        coalesce: true,
    };
    let uncoalesced = GeometryOptions {
        coalesce: false,
        ..GeometryOptions::default()
    };
    // Fragments selecting the same bytes of every token: also planned with n_tokens.
    let every_token = |f: &dyn Fn(u64) -> Fragment| GeometryOptions {
        fragments: Fragments::Every((0..16).map(f).collect()),
        coalesce: true,
    };
    let first_head = every_token(&|t| Fragment {
        src_off: t * 8,
        dst_off: t * 8,
        len: 4,
    });
    // Head 5 of prefill TP 8 rank 5 (4 bytes per token) into decode TP 2 rank 1 (heads 4–7):
    // the fragments agree with head slicing, so they compose.
    let moved_head = every_token(&|t| Fragment {
        src_off: t * 4,
        dst_off: t * 16 + 4,
        len: 4,
    });
    let mut cases: Vec<(String, Spec, Spec, &GeometryOptions)> = vec![];
    let mut add = |what: &str, s: Spec, d: Spec, g| cases.push((what.to_string(), s, d, g));
    add(
        "packed",
        Spec::plain(Packed, 16),
        Spec::plain(Packed, 16),
        &whole,
    );
    add(
        "strided",
        Spec::plain(Strided, 16),
        Spec::plain(Packed, 16),
        &whole,
    );
    add(
        "pool coalesced",
        Spec::plain(Pool, 16),
        Spec::plain(Pool, 16),
        &whole,
    );
    add(
        "pool uncoalesced",
        Spec::plain(Pool, 16),
        Spec::plain(Pool, 16),
        &uncoalesced,
    );
    add(
        "pool to strided",
        Spec::plain(Pool, 16),
        Spec::plain(Strided, 16),
        &whole,
    );
    add(
        "fragments",
        Spec::plain(Strided, 16),
        Spec::plain(Packed, 16),
        &fragments,
    );
    add(
        "per-token fragments",
        Spec::plain(Strided, 16),
        Spec::plain(Packed, 16),
        &first_head,
    );
    add(
        "head-sliced NHD with fragments",
        Spec::sliced(Packed, 16, Nhd, (5, 8)),
        Spec::sliced(Strided, 16, Nhd, (1, 2)),
        &moved_head,
    );
    for order in [Nhd, Hnd] {
        for (r_p, r_d) in [(5, 1), (0, 1), (1, 0)] {
            let s = Spec::sliced(Packed, 16, order, (r_p, 8));
            let d = Spec::sliced(Strided, 16, order, (r_d, 2));
            add(&format!("head-sliced {order:?} {r_p}->{r_d}"), s, d, &whole);
            let s = Spec::sliced(Pool, 16, order, (r_d, 2));
            let d = Spec::sliced(Packed, 16, order, (r_p, 8));
            add(
                &format!("head-sliced pool {order:?} {r_d}->{r_p}"),
                s,
                d,
                &whole,
            );
        }
    }
    for (ps, pd) in [(64, 16), (16, 64), (1, 16), (16, 16)] {
        for (os, od) in [(Nhd, Nhd), (Nhd, Hnd), (Hnd, Nhd), (Hnd, Hnd)] {
            let geometry = |memory, size, order| Spec {
                geometry: Some((order, 2, 0, 1)),
                ..Spec::plain(memory, size)
            };
            let (s, d) = (geometry(Strided, ps, os), geometry(Pool, pd, od));
            add(&format!("token {ps}->{pd} {os:?}->{od:?}"), s, d, &whole);
            for (tp, (r_p, r_d)) in [((8, 2), (5, 1)), ((8, 2), (0, 1)), ((2, 8), (1, 6))] {
                let s = Spec::sliced(Packed, ps, os, (r_p, tp.0));
                let d = Spec::sliced(Strided, pd, od, (r_d, tp.1));
                let what =
                    format!("head-sliced token {ps}->{pd} {os:?}->{od:?} TP {tp:?} {r_p}->{r_d}");
                add(&what, s, d, &whole);
            }
        }
    }
    add(
        "no geometry 64->16",
        Spec::plain(Packed, 64),
        Spec::plain(Strided, 16),
        &whole,
    );
    let mut plans = 0;
    for (what, s, d, g) in &cases {
        plans += drive(what, &s.layout(0x1000_0000), &d.layout(0x8000_0000), g);
    }
    assert!(plans > 500, "{plans}");
}
