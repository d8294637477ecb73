//! A layout's entries as values: each entry carries its stride, representation and kind, whose
//! window (page entries, in a pool) or ring (state entries) is part of the kind; a layout lists
//! its pools; a request gives one page list per pool and a template keeps one index limit per
//! pool.

use kvplan_core::{
    Entry, EntryKind, IndexLimits, Indexing, Layout, LayoutContext, PlanError, Pool, PoolId,
    Request, Template, TemplateOptions,
};

/// Bytes of one token.
const TOKEN: u64 = 8;

/// Layer 0 full attention (4-token pages, `full_pages` of them), layer 1 a window of 6 tokens in
/// a pool of 2-token pages (`window_pages` of them), then one Mamba state entry of 4 slots with
/// a ring of 3 rows per slot.
fn hybrid(base: u64, full_pages: u64, window_pages: u64) -> Layout {
    Layout::mla(
        vec![base, base + 0x10_0000],
        vec![full_pages * 4 * TOKEN, window_pages * 2 * TOKEN],
        vec![4 * TOKEN, 2 * TOKEN],
        Some(vec![0, 1]),
        LayoutContext {
            page_size: 4,
            ..LayoutContext::default()
        },
    )
    .unwrap()
    .with_windows_in_pool(vec![None, Some(6)], Some(2))
    .unwrap()
    .with_state(
        "mamba",
        vec![base + 0x20_0000],
        vec![4 * 3 * 16],
        vec![16],
        vec![0],
    )
    .unwrap()
    .with_rings(vec![None, None, Some(3)])
    .unwrap()
}

#[test]
fn each_entry_carries_its_window_pool_or_ring_in_its_kind() {
    let layout = hybrid(1 << 32, 8, 16);
    let kinds: Vec<EntryKind> = layout.entries().iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EntryKind::PAGE,
            EntryKind::Page {
                pool: PoolId::WINDOW,
                window: Some(6)
            },
            EntryKind::State {
                ring: Some(3),
                channels: None,
            },
        ]
    );
    assert_eq!(
        layout.pools(),
        [
            Pool {
                id: PoolId::PAGES,
                page_size: 4,
                tokens_per_row: 1,
            },
            Pool {
                id: PoolId::WINDOW,
                page_size: 2,
                tokens_per_row: 1,
            },
        ]
    );
    let state: &Entry = layout.entry(2);
    assert_eq!(state.indexing(), Indexing::State);
    assert_eq!(
        (state.window(), state.ring(), state.pool()),
        (None, Some(3), None)
    );
    assert_eq!(
        (state.role.as_str(), state.stride, state.item_len),
        ("mamba", 16, 16)
    );
    // The list views read the entries.
    assert_eq!(layout.windows(), [None, Some(6), None]);
    assert_eq!(layout.rings(), [None, None, Some(3)]);
    assert_eq!(layout.entry_page_size(1), 2);
    assert_eq!(layout.entry_page_size(0), 4);
}

#[test]
fn a_layout_rebuilt_from_its_entries_is_the_same_layout() {
    let layout = hybrid(1 << 32, 8, 16);
    let rebuilt = Layout::from_entries(
        layout.entries().to_vec(),
        layout.context().clone(),
        layout.window_page_size(),
    )
    .unwrap();
    assert_eq!(rebuilt, layout);
    // And through the ingestion lists plus the setters.
    let parts = Layout::new(layout.parts(), layout.context().clone())
        .unwrap()
        .with_strides(layout.strides())
        .unwrap()
        .with_windows_in_pool(layout.windows(), layout.window_page_size())
        .unwrap()
        .with_rings(layout.rings())
        .unwrap();
    assert_eq!(parts, layout);
}

#[test]
fn from_entries_refuses_an_entry_of_a_pool_the_layout_does_not_keep() {
    let layout = hybrid(1 << 32, 8, 16);
    let err = Layout::from_entries(layout.entries().to_vec(), layout.context().clone(), None)
        .unwrap_err();
    assert!(
        matches!(&err, PlanError::InvalidLayout { what } if what.contains("entry 1 (kv) is in the window pool, but the layout keeps none")),
        "{err}"
    );
    // A window entry outside the pool of a layout that keeps one.
    let mut entries = layout.entries().to_vec();
    entries[1].kind = EntryKind::Page {
        pool: PoolId::PAGES,
        window: Some(6),
    };
    let err = Layout::from_entries(entries, layout.context().clone(), Some(2)).unwrap_err();
    assert!(err.to_string().contains("not in the window pool"), "{err}");
    // The setters' rules hold too: a stride below the item length.
    let mut entries = layout.entries().to_vec();
    entries[0].stride = 1;
    let err = Layout::from_entries(entries, layout.context().clone(), Some(2)).unwrap_err();
    assert!(err.to_string().contains("stride 1 is smaller"), "{err}");
}

#[test]
fn a_template_keeps_one_index_limit_per_pool() {
    // Prefill: 8 full pages, 16 window pages; decode: 5 full pages, 11 window pages.
    let (src, dst) = (hybrid(1 << 32, 8, 16), hybrid(1 << 40, 5, 11));
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    assert_eq!(t.index_limits(), IndexLimits { src: 8, dst: 5 });
    assert_eq!(t.pool_limits(PoolId::PAGES), t.index_limits());
    assert_eq!(
        t.pool_limits(PoolId::WINDOW),
        IndexLimits { src: 16, dst: 11 }
    );
    // A request's window page past the decode's window pool is refused by that pool's limit.
    let pages = [0i64, 1];
    let (src_window, dst_window) = ([0i64, 1, 2, 3], [0i64, 1, 2, 11]);
    let request = Request::tokens(&pages, &pages, 8)
        .with_window_pages(Some(&src_window[..]), Some(&dst_window[..]));
    // The error names the window pool's entry and capacity, and the page's position in the
    // window page list (not in the part of it the request reads, nor the full entry's).
    let err = t.prepare(&request).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::IndexOutOfRange {
                index: 11,
                position: 3,
                capacity: 11,
                entry: 1,
                ..
            }
        ),
        "{err:?}"
    );
    let dst_window = [0i64, 1, 2, 10];
    let request = Request::tokens(&pages, &pages, 8)
        .with_window_pages(Some(&src_window[..]), Some(&dst_window[..]));
    assert!(t.prepare(&request).is_ok());
}

#[test]
fn a_request_gives_one_page_list_per_pool() {
    let (pages, window) = ([3i64, 4], [7i64]);
    let request =
        Request::tokens(&pages, &pages, 8).with_pool_pages(PoolId::WINDOW, Some(&window[..]), None);
    assert_eq!(
        request.pool_lists(PoolId::PAGES),
        (Some(&pages[..]), Some(&pages[..]))
    );
    assert_eq!(
        request.pool_lists(PoolId::WINDOW),
        (Some(&window[..]), None)
    );
    // The request's own pages are its indices: a list given for that pool changes nothing.
    let same = request.with_pool_pages(PoolId::PAGES, Some(&window[..]), None);
    assert_eq!(same, request);
    assert_eq!(
        Request::slot(1, 2).pool_lists(PoolId::PAGES),
        (None::<&[i64]>, None::<&[i64]>)
    );
}

#[test]
fn an_index_error_of_a_delta_request_names_its_position_in_the_list() {
    let (src, dst) = (hybrid(1 << 32, 8, 16), hybrid(1 << 40, 5, 11));
    let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let window = [0i64, 1, 2, 3];
    // Skipping the first page's 4 tokens, the request reads from page position 1 on.
    let (src_pages, dst_pages) = ([0i64, 1], [0i64, 9]);
    let request = Request::tokens(&src_pages, &dst_pages, 8)
        .skipping(4)
        .with_window_pages(Some(&window[..]), Some(&window[..]));
    let err = t.prepare(&request).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::IndexOutOfRange {
                index: 9,
                position: 1,
                capacity: 5,
                entry: 0,
                ..
            }
        ),
        "{err:?}"
    );
    let dst_pages = [0i64, -2];
    let request = Request::tokens(&src_pages, &dst_pages, 8)
        .skipping(4)
        .with_window_pages(Some(&window[..]), Some(&window[..]));
    let err = t.prepare(&request).unwrap_err();
    assert!(
        matches!(
            err,
            PlanError::NegativeIndex {
                index: -2,
                position: 1,
                ..
            }
        ),
        "{err:?}"
    );
}
