//! `coalescing`: per page pair, whether it emits with the pair before it or what keeps it
//! apart, checked against the blocks the plan emits.

use kvplan_core::{
    Coalescing, JoinBlocker, Layout, LayoutContext, Request, Side, Template, TemplateOptions,
    coalescing,
};

fn kinds(template: &Template) -> Vec<Coalescing> {
    coalescing(template).iter().map(|p| p.coalescing).collect()
}

#[test]
fn a_pool_joins_and_separate_buffers_stay_apart() {
    let pool = |base: u64| {
        Layout::cross_layer(
            base,
            4 * 64 * 8,
            Some(vec![0, 1, 2, 3]),
            vec![64; 4],
            None,
            LayoutContext::default(),
        )
        .unwrap()
    };
    let t = Template::new(&pool(1 << 32), &pool(1 << 40), TemplateOptions::default()).unwrap();
    assert_eq!(
        kinds(&t),
        [
            Coalescing::First,
            Coalescing::Joined,
            Coalescing::Joined,
            Coalescing::Joined
        ]
    );
    assert!(coalescing(&t).iter().all(|p| !p.per_page));
    let pages = [0i64, 1, 2];
    assert_eq!(
        t.plan(&Request::pages(&pages, &pages))
            .unwrap()
            .lengths
            .len(),
        1
    );

    let apart = |base: u64| {
        Layout::mla(
            vec![base, base + (1 << 20)],
            vec![64 * 8; 2],
            vec![64; 2],
            Some(vec![0, 1]),
            LayoutContext::default(),
        )
        .unwrap()
    };
    let t = Template::new(&apart(1 << 32), &apart(1 << 40), TemplateOptions::default()).unwrap();
    assert_eq!(
        kinds(&t),
        [
            Coalescing::First,
            Coalescing::Join(JoinBlocker::Apart(Side::Src))
        ]
    );
    assert_eq!(
        t.plan(&Request::pages(&pages, &pages))
            .unwrap()
            .lengths
            .len(),
        2
    );
}
