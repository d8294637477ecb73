//! The token walks a token template holds are data: one lane per walk (all tokens, a sliding
//! window, a decode-context-parallel template's draft tokens), each with its token maps and the
//! page list (pool) it reads on each side, and every token piece names its lane.

use kvplan_core::{
    Lane, Layout, LayoutContext, PoolId, Request, Template, TemplateOptions, TokenMap, Walk,
};

const ITEM: u64 = 64; // 16 bytes a token, 4 tokens a page
const PAGES: u64 = 32;

/// Two MLA layers at `base` (4-token pages); with `window_pool`, the first layer's window
/// entry keeps its own pool of `window_pool`-token pages.
fn layout(base: u64, window: Option<u64>, window_pool: Option<u64>) -> Layout {
    let first_item = window_pool.map_or(ITEM, |size| ITEM / 4 * size);
    let ctx = LayoutContext {
        page_size: 4,
        ..LayoutContext::default()
    };
    let layout = Layout::mla(
        vec![base, base + (1 << 20)],
        vec![first_item * PAGES, ITEM * PAGES],
        vec![first_item, ITEM],
        Some(vec![0, 1]),
        ctx,
    )
    .unwrap();
    match window {
        Some(w) => layout
            .with_windows_in_pool(vec![Some(w), None], window_pool)
            .unwrap(),
        None => layout,
    }
}

fn lanes(src: &Layout, dst: &Layout) -> (Template, Vec<Lane>) {
    let t = Template::new(src, dst, TemplateOptions::default()).unwrap();
    let lanes = t.token_template().unwrap().lanes.clone();
    (t, lanes)
}

const PAGED: TokenMap = TokenMap::Paged { page_size: 4 };

#[test]
fn a_template_without_windows_walks_every_token_over_the_request_pages() {
    let (t, lanes) = lanes(&layout(1 << 32, None, None), &layout(1 << 40, None, None));
    let all = Lane {
        walk: Walk::All,
        maps: (PAGED, PAGED),
        pools: (PoolId::PAGES, PoolId::PAGES),
        tokens_per_row: 1,
    };
    assert_eq!(lanes, [all]);
    let tokens = t.token_template().unwrap();
    assert!(tokens.pieces.iter().all(|p| p.lane == 0));
}

#[test]
fn a_window_entry_follows_a_window_lane_after_the_target_lane() {
    let (t, lanes) = lanes(
        &layout(1 << 32, Some(6), None),
        &layout(1 << 40, Some(6), None),
    );
    assert_eq!(
        lanes.iter().map(|l| l.walk).collect::<Vec<_>>(),
        [Walk::All, Walk::Window(6)]
    );
    assert_eq!(lanes[1].pools, (PoolId::PAGES, PoolId::PAGES));
    let tokens = t.token_template().unwrap();
    // Layer 0 (the window entry) is the first pair: its piece follows the window lane.
    let lane_of_pair = |pair: usize| tokens.pieces[tokens.pair_pieces[pair].0].lane;
    assert_eq!((lane_of_pair(0), lane_of_pair(1)), (1, 0));
    // The window lane moves the last 6 of 14 tokens: 8..14 (pages 2 and 3), the target lane
    // all 14.
    let plan = t
        .plan(&Request::tokens(&[3i64, 4, 9, 1], &[10i64, 11, 2, 5], 14))
        .unwrap();
    assert_eq!(plan.lengths.iter().sum::<u64>(), (6 + 14) * 16);
}

#[test]
fn a_window_pool_on_one_side_is_that_side_s_pool_of_the_window_lane() {
    let (_, lanes) = lanes(
        &layout(1 << 32, Some(6), None),
        &layout(1 << 40, Some(6), Some(2)),
    );
    assert_eq!(
        lanes[1],
        Lane {
            walk: Walk::Window(6),
            maps: (PAGED, TokenMap::Paged { page_size: 2 }),
            pools: (PoolId::PAGES, PoolId::WINDOW),
            tokens_per_row: 1,
        }
    );
}
