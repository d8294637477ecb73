//! Per-pool token ranges (`Request::with_pool_tokens`): a further pool moves its own tokens,
//! as vLLM sets each KV-cache group's block count apart; the plan is the blocks of the
//! separate per-pool templates' plans.

use kvplan_core::{Layout, LayoutContext, PlanError, PoolId, Request, Template, TemplateOptions};

const ROW: u64 = 24;
const PAGES: u64 = 16;
const POOL_ITEM: u64 = 8 / 4 * ROW;

fn ctx() -> LayoutContext {
    LayoutContext {
        page_size: 4,
        ..LayoutContext::default()
    }
}

/// Two MLA layers at `base`: the first on the request's 4-token pages, the second in pool 1
/// (8 tokens per page, 4 per row).
fn pooled(base: u64) -> Layout {
    Layout::mla(
        vec![base, base + (1 << 20)],
        vec![64 * PAGES, POOL_ITEM * PAGES],
        vec![64, POOL_ITEM],
        Some(vec![0, 1]),
        ctx(),
    )
    .unwrap()
    .with_pool(&[1], 8, 4)
    .unwrap()
}

/// The first layer alone.
fn pages_part(base: u64) -> Layout {
    Layout::mla(vec![base], vec![64 * PAGES], vec![64], Some(vec![0]), ctx()).unwrap()
}

/// The second layer alone, in pool 1 (pool 0 keeps no entry).
fn pool_part(base: u64) -> Layout {
    Layout::mla(
        vec![base + (1 << 20)],
        vec![POOL_ITEM * PAGES],
        vec![POOL_ITEM],
        Some(vec![1]),
        ctx(),
    )
    .unwrap()
    .with_pool(&[0], 8, 4)
    .unwrap()
}

fn template(src: &Layout, dst: &Layout) -> Template {
    Template::new(src, dst, TemplateOptions::default()).unwrap()
}

fn blocks(plans: &[&kvplan_core::Plan]) -> Vec<(u64, u64, u64)> {
    let mut all: Vec<_> = plans
        .iter()
        .flat_map(|p| {
            (0..p.src_addrs.len()).map(|k| (p.src_addrs[k], p.dst_addrs[k], p.lengths[k]))
        })
        .collect();
    all.sort_unstable();
    all
}

#[test]
fn a_pool_with_its_own_range_plans_the_per_pool_templates_blocks() {
    let (s, d) = (1 << 30, 1 << 40);
    let t = template(&pooled(s), &pooled(d));
    let (src, dst): (Vec<i64>, Vec<i64>) = ((0..4).collect(), (4..8).collect());
    let (psrc, pdst): (Vec<i64>, Vec<i64>) = (vec![3, 1, 2], vec![0, 5, 6]);
    // The request's pages move tokens 5..14; pool 1 moves tokens 0..24 (rows 0..6).
    let request = Request::tokens(&src, &dst, 14)
        .skipping(5)
        .with_pool_pages(PoolId(1), Some(&psrc[..]), Some(&pdst[..]))
        .with_pool_tokens(PoolId(1), 24, 0);
    let plan = t.plan(&request).unwrap();
    assert_eq!(plan.total_bytes, 9 * 16 + 6 * ROW);
    let pages = template(&pages_part(s), &pages_part(d))
        .plan(&Request::tokens(&src, &dst, 14).skipping(5))
        .unwrap();
    let empty: [i64; 0] = [];
    let pool = template(&pool_part(s), &pool_part(d))
        .plan(&Request::tokens(&empty, &empty, 24).with_pool_pages(
            PoolId(1),
            Some(&psrc[..]),
            Some(&pdst[..]),
        ))
        .unwrap();
    assert_eq!(blocks(&[&plan]), blocks(&[&pages, &pool]));
    // A range equal to the request's plans as the request without one.
    let same = Request::tokens(&src, &dst, 14).skipping(5).with_pool_pages(
        PoolId(1),
        Some(&psrc[..]),
        Some(&pdst[..]),
    );
    assert_eq!(
        t.plan(&same.with_pool_tokens(PoolId(1), 14, 5)).unwrap(),
        t.plan(&same).unwrap()
    );
}

#[test]
fn a_pool_the_request_does_not_touch_gets_no_pages_and_moves_nothing() {
    let t = template(&pooled(1 << 30), &pooled(1 << 40));
    let (src, dst): (Vec<i64>, Vec<i64>) = ((0..2).collect(), (2..4).collect());
    let empty: [i64; 0] = [];
    let request = Request::tokens(&src, &dst, 8)
        .with_pool_pages(PoolId(1), Some(&empty[..]), Some(&empty[..]))
        .with_pool_tokens(PoolId(1), 0, 0);
    assert_eq!(t.plan(&request).unwrap().total_bytes, 8 * 16);
}

#[test]
fn pool_ranges_are_refused_typed_naming_the_pool() {
    let t = template(&pooled(1 << 30), &pooled(1 << 40));
    let pages: Vec<i64> = (0..2).collect();
    let base = Request::tokens(&pages, &pages, 8).with_pool_pages(
        PoolId(1),
        Some(&pages[..1]),
        Some(&pages[..]),
    );
    let err = t
        .prepare(&base.with_pool_tokens(PoolId(1), 16, 0))
        .unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::TokenCount {
                side: kvplan_core::Side::Src,
                n_tokens: 16,
                needed: 2,
                given: 1,
                ..
            }
        ),
        "{err}"
    );
    let err = t
        .prepare(&base.with_pool_tokens(PoolId(1), 4, 6))
        .unwrap_err();
    assert!(
        matches!(&err, PlanError::Geometry { what } if what.contains("pool_tokens of pool 1: skip_tokens 6 is past its n_tokens 4")),
        "{err}"
    );
    let err = t
        .prepare(&base.with_pool_tokens(PoolId(2), 4, 0))
        .unwrap_err();
    assert!(
        matches!(&err, PlanError::Geometry { what } if what.contains("neither side's layout keeps a pool 2")),
        "{err}"
    );
}

/// Byte memory of one plan run: a source byte nothing wrote is a function of its address.
#[derive(Default)]
struct Memory(std::collections::HashMap<u64, u8>);

impl Memory {
    fn byte(&self, addr: u64) -> u8 {
        self.0
            .get(&addr)
            .copied()
            .unwrap_or_else(|| (addr.wrapping_mul(0x9E37_79B9) >> 11) as u8)
    }

    fn copy(&mut self, src: &[u64], dst: &[u64], lengths: &[u64]) {
        for k in 0..lengths.len() {
            for b in 0..lengths[k] {
                let v = self.byte(src[k] + b);
                self.0.insert(dst[k] + b, v);
            }
        }
    }

    fn run(&mut self, plan: &kvplan_core::Plan) {
        self.copy(&plan.src_addrs, &plan.dst_addrs, &plan.lengths);
    }

    /// The bytes written at or above `from` (the decode's pages), by address.
    fn decode(&self, from: u64, below: u64) -> std::collections::BTreeMap<u64, u8> {
        self.0
            .iter()
            .filter(|(a, _)| (from..below).contains(*a))
            .map(|(&a, &v)| (a, v))
            .collect()
    }
}

#[test]
fn packed_staged_and_round_plans_of_pool_ranges_land_as_the_direct_plan() {
    use kvplan_core::{PackBuffer, PackPlanner, RoundsPlanner, StagedPlanner, StagingRegion};
    let (s, d) = (1u64 << 30, 1u64 << 40);
    let t = template(&pooled(s), &pooled(d));
    let (src, dst): (Vec<i64>, Vec<i64>) = ((0..4).collect(), vec![7, 4, 5, 6]);
    let (psrc, pdst): (Vec<i64>, Vec<i64>) = (vec![3, 1, 2, 9], vec![0, 5, 6, 8]);
    let staging = |addr| StagingRegion {
        addr,
        size: 1 << 20,
    };
    let decode = |m: &Memory| m.decode(d, d + (1 << 30));
    // Pool 1 moving more, fewer, or a later range of tokens than the request's pages.
    for (n, skip) in [(24, 0), (6, 0), (22, 3), (14, 0)] {
        let request = Request::tokens(&src, &dst, 14)
            .with_pool_pages(PoolId(1), Some(&psrc[..]), Some(&pdst[..]))
            .with_pool_tokens(PoolId(1), n, skip);
        let what = format!("pool 1 range ({n}, {skip})");
        let direct = t.plan(&request).unwrap();
        let mut want = Memory::default();
        want.run(&direct);
        let want = decode(&want);
        assert_eq!(want.len() as u64, direct.total_bytes, "{what}");
        assert!(direct.total_bytes > 14 * 16, "{what}: pool 1 moves rows");

        let packed = PackPlanner::new(&t)
            .plan(
                &request,
                PackBuffer {
                    addr: 1 << 50,
                    size: 1 << 20,
                },
            )
            .unwrap();
        let mut m = Memory::default();
        m.run(&packed.gather);
        m.run(&packed.network);
        assert_eq!(decode(&m), want, "packed, {what}");

        let staged = StagedPlanner::new(&t)
            .plan(&request, staging(1 << 50), staging(1 << 52))
            .unwrap();
        let mut m = Memory::default();
        m.run(&staged.gather);
        m.run(&staged.network);
        m.run(&staged.scatter);
        assert_eq!(decode(&m), want, "staged, {what}");

        // Round buffers of 40 bytes: rounds split blocks of either pool.
        let rounds = RoundsPlanner::new(&t)
            .plan(&request, staging(1 << 50), staging(1 << 52), 2)
            .unwrap();
        assert_eq!(rounds.bytes, direct.total_bytes, "{what}");
        let small = |addr| StagingRegion { addr, size: 80 };
        let rounds = RoundsPlanner::new(&t)
            .plan(&request, small(1 << 50), small(1 << 52), 2)
            .unwrap();
        assert_eq!(
            rounds.len() as u64,
            direct.total_bytes.div_ceil(40),
            "{what}"
        );
        let mut m = Memory::default();
        for k in 0..rounds.len() {
            for stage in [&rounds.gather, &rounds.network, &rounds.scatter] {
                m.run(&stage.round(k));
            }
        }
        assert_eq!(decode(&m), want, "rounds, {what}");
    }
}
