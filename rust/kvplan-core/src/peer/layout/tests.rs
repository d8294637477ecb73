//! Unit tests of the layout: window pools, MHA order, NPU groups, draft bands and list checks.

use super::*;

fn ctx() -> LayoutContext {
    LayoutContext::default()
}

/// Two MLA entries at page size 1; entry 1's buffer holds 4 items.
fn two_layers() -> Layout {
    Layout::mla(
        vec![1 << 30, 1 << 31],
        vec![32, 64],
        vec![8, 16],
        Some(vec![0, 1]),
        LayoutContext {
            page_size: 1,
            ..ctx()
        },
    )
    .unwrap()
}

#[test]
fn a_window_is_checked_at_its_pools_page_size() {
    // 4 pool pages of 2 tokens hold a 5-token window, though 4 pages of the layout's 1 token
    // do not: the check runs once, at the page size the entry ends up with.
    let windows = vec![None, Some(5)];
    let pooled = two_layers()
        .with_windows_in_pool(windows.clone(), Some(2))
        .unwrap();
    assert_eq!(pooled.window_page_size(), Some(2));
    assert_eq!(pooled.entry_page_size(1), 2);
    // A layout with entries appended keeps the pool.
    let appended = pooled
        .with_state("mamba", vec![1 << 40], vec![64], vec![64], vec![9])
        .unwrap();
    assert_eq!(appended.window_page_size(), Some(2));
    // Without the pool, or with one too narrow, the window is refused.
    for pool in [None, Some(1)] {
        let err = two_layers()
            .with_windows_in_pool(windows.clone(), pool)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("a sliding window of 5 tokens is wider than the 4 tokens"),
            "{err}"
        );
    }
    // The pool's own rules still come first for a pool of page size 0.
    let err = two_layers()
        .with_windows_in_pool(windows, Some(0))
        .unwrap_err();
    assert!(
        err.to_string().contains("page_size must be at least 1"),
        "{err}"
    );
}

#[test]
fn mha_orders_k_then_v() {
    let l = Layout::mha(
        vec![1, 2],
        vec![3, 4],
        vec![10; 2],
        vec![20; 2],
        vec![5; 2],
        vec![10; 2],
        Some(vec![3, 7]),
        ctx(),
    )
    .unwrap();
    assert_eq!(l.parts().data_ptrs, vec![1, 2, 3, 4]);
    assert_eq!(
        l.parts().layer_ids,
        vec![Some(3), Some(7), Some(3), Some(7)]
    );
    assert_eq!(l.parts().roles, vec!["k", "k", "v", "v"]);
    assert_eq!(l.capacity(3), 2);
}

#[test]
fn npu_groups_refuse_truncation() {
    let l = Layout::npu_groups(
        vec![3, 7],
        vec![1, 2, 3, 4, 5, 6],
        vec![8; 6],
        vec![4; 6],
        None,
        ctx(),
    )
    .unwrap();
    assert_eq!(
        l.parts()
            .layer_ids
            .iter()
            .map(|x| x.unwrap())
            .collect::<Vec<_>>(),
        vec![3, 7, 3, 7, 3, 7]
    );
    assert_eq!(
        Layout::npu_groups(
            vec![3, 7],
            vec![1, 2, 3, 4, 5],
            vec![8; 5],
            vec![4; 5],
            None,
            ctx()
        ),
        Err(PlanError::GroupsNotWhole {
            entries: 5,
            layers: 2
        })
    );
}

#[test]
fn draft_band_remap() {
    let base = Layout::mla(vec![1], vec![8], vec![8], Some(vec![0]), ctx()).unwrap();
    let l = base
        .with_draft(
            vec![2; 6],
            vec![8; 6],
            vec![8; 6],
            &[0, 1, 2, 0, 1, 2],
            48,
            None,
        )
        .unwrap();
    let ids: Vec<i64> = l.parts().layer_ids[1..]
        .iter()
        .map(|x| x.unwrap())
        .collect();
    assert_eq!(ids, vec![48, 49, 50, 48, 49, 50]);
    let l = base
        .with_draft(vec![2; 4], vec![8; 4], vec![8; 4], &[5, 2, 5, 2], 48, None)
        .unwrap();
    let ids: Vec<i64> = l.parts().layer_ids[1..]
        .iter()
        .map(|x| x.unwrap())
        .collect();
    assert_eq!(ids, vec![48, 49, 48, 49]);
}

#[test]
fn draft_band_of_many_distinct_ids_completes() {
    // A quarter of a million distinct draft ids: a search of the ids seen so far per id
    // (the old numbering) is ~3e10 comparisons, hours in a debug build; a map is instant.
    let n = 1 << 18;
    let base = Layout::mla(vec![1], vec![8], vec![8], Some(vec![0]), ctx()).unwrap();
    let raw: Vec<i64> = (0..n as i64).rev().collect();
    let l = base
        .with_draft(vec![2; n], vec![8; n], vec![8; n], &raw, 10, None)
        .unwrap();
    assert_eq!(l.parts().layer_ids[1], Some(10));
    assert_eq!(l.parts().layer_ids[n], Some(10 + n as i64 - 1));
}

#[test]
fn list_lengths_and_overflow_are_checked() {
    let parts = LayoutParts {
        data_ptrs: vec![1, 2],
        data_lens: vec![1],
        item_lens: vec![1, 1],
        ..Default::default()
    };
    assert_eq!(
        Layout::new(parts, ctx()),
        Err(PlanError::ListLength {
            field: "data_lens",
            len: 1,
            expected: 2
        })
    );
    let parts = LayoutParts {
        data_ptrs: vec![u64::MAX],
        data_lens: vec![2],
        item_lens: vec![1],
        ..Default::default()
    };
    assert!(matches!(
        Layout::new(parts, ctx()),
        Err(PlanError::BufferOverflow { .. })
    ));
}
