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
