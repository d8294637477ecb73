//! The address-free identity of a layout and the compatibility verdicts: ids that do not move
//! with addresses or buffer lengths, a golden id that pins the encoding, and each semantic
//! mismatch refused while the planner's own gate decides the geometry.

use kvplan_core::{
    AttentionGeometry, Layout, LayoutContext, LayoutIdentity, MemoryOrder, Semantics, TransferMode,
    VerdictKind, compatibility,
};

fn context(tp_rank: u32, order: MemoryOrder) -> LayoutContext {
    LayoutContext {
        page_size: 16,
        tp_size: 2,
        tp_rank,
        num_model_layers: Some(2),
        attention: Some(AttentionGeometry::for_rank(8, 128, 2, 2, None, Some(order))),
        ..LayoutContext::default()
    }
}

/// Two MHA layers of 16-token pages (4 heads of 128 bf16 elements per rank).
fn mha(base: u64, pages: u64, tp_rank: u32, order: MemoryOrder) -> Layout {
    let item = 16 * 4 * 128 * 2;
    let mb = 1u64 << 24;
    Layout::mha(
        vec![base, base + mb],
        vec![base + 2 * mb, base + 3 * mb],
        vec![item * pages; 2],
        vec![item * pages; 2],
        vec![item; 2],
        vec![item; 2],
        Some(vec![0, 1]),
        context(tp_rank, order),
    )
    .unwrap()
}

fn semantics() -> Semantics {
    Semantics::new(
        "org/model".into(),
        "abc123".into(),
        r#"{"factor":1,"type":"yarn"}"#.into(),
        vec![],
        TransferMode::Push,
        false,
    )
}

#[test]
fn ids_ignore_addresses_and_buffer_lengths_and_class_ids_ignore_ranks() {
    let a = LayoutIdentity::new(&mha(1 << 32, 64, 0, MemoryOrder::Nhd), semantics());
    let b = LayoutIdentity::new(&mha(7 << 40, 100, 0, MemoryOrder::Nhd), semantics());
    let rank1 = LayoutIdentity::new(&mha(1 << 32, 64, 1, MemoryOrder::Nhd), semantics());
    assert_eq!(a.class_id(), b.class_id());
    assert_eq!(a.layout_id(), b.layout_id());
    assert_eq!(a.class_id(), rank1.class_id());
    assert_ne!(a.layout_id(), rank1.layout_id());
    assert!(a.class_id().len() <= 64 && a.class_id().is_ascii());
}

#[test]
fn golden_ids_pin_the_encoding() {
    let id = LayoutIdentity::new(&mha(1 << 32, 64, 0, MemoryOrder::Nhd), semantics());
    assert_eq!(
        id.class_id(),
        "kvc1-wrkgjwcvqz5simecp4bsapd3c6x43ftot6jhcsmdgymtmmuuozma"
    );
    assert_eq!(
        id.layout_id(),
        "kvl1-2zy23qc5vzcwrxfyksrv4k2vaddq7ucs3tfhgrs2ty2cfbi2hkaa"
    );
}

#[test]
fn memory_order_swapped_with_identical_sizes_changes_the_id() {
    let (a, b) = (
        mha(1 << 32, 64, 0, MemoryOrder::Nhd),
        mha(1 << 32, 64, 0, MemoryOrder::Hnd),
    );
    let (nhd, hnd) = (
        LayoutIdentity::new(&a, semantics()),
        LayoutIdentity::new(&b, semantics()),
    );
    assert_ne!(nhd.class_id(), hnd.class_id());
    let verdict = compatibility((&a, &nhd), (&b, &hnd));
    assert_eq!(verdict.kind, VerdictKind::PlannableWithConversion);
    assert!(verdict.reason.contains("NHD") && verdict.reason.contains("HND"));
}

#[test]
fn each_semantic_mismatch_is_refused_naming_both_values() {
    let layout = mha(1 << 32, 64, 0, MemoryOrder::Nhd);
    let base = semantics();
    let cases: Vec<(Semantics, [&str; 2])> = vec![
        (
            Semantics {
                rope: r#"{"factor":2,"type":"yarn"}"#.into(),
                ..base.clone()
            },
            ["factor\\\":1", "factor\\\":2"],
        ),
        (
            Semantics {
                revision: "def456".into(),
                ..base.clone()
            },
            ["abc123", "def456"],
        ),
        (
            Semantics {
                transfer: TransferMode::Pull,
                ..base.clone()
            },
            ["push", "pull"],
        ),
        (
            Semantics {
                drafts: vec!["org/eagle".into()],
                ..base.clone()
            },
            ["[]", "org/eagle"],
        ),
        (
            Semantics {
                cross_layer: true,
                ..base.clone()
            },
            ["false", "true"],
        ),
    ];
    let prefill = LayoutIdentity::new(&layout, base.clone());
    for (other, [ours, theirs]) in cases {
        let decode_layout = mha(9 << 40, 32, 0, MemoryOrder::Nhd);
        let decode = LayoutIdentity::new(&decode_layout, other);
        assert_ne!(prefill.class_id(), decode.class_id());
        let verdict = compatibility((&layout, &prefill), (&decode_layout, &decode));
        assert_eq!(verdict.kind, VerdictKind::Refused, "{}", verdict.reason);
        assert_eq!(verdict.refused_by, Some("semantics"));
        assert!(
            verdict.reason.contains(ours) && verdict.reason.contains(theirs),
            "{} names {ours} and {theirs}",
            verdict.reason
        );
    }
}

#[test]
fn the_gate_decides_geometry() {
    let (src, dst) = (
        mha(1 << 32, 64, 0, MemoryOrder::Nhd),
        mha(9 << 40, 32, 0, MemoryOrder::Nhd),
    );
    let prefill = LayoutIdentity::new(&src, semantics());
    let same = LayoutIdentity::new(&dst, semantics());
    assert_eq!(
        compatibility((&src, &prefill), (&dst, &same)).kind,
        VerdictKind::Plannable
    );
    let one_layer = Layout::mla(
        vec![9 << 40],
        vec![1 << 20],
        vec![1152],
        Some(vec![0]),
        LayoutContext::default(),
    )
    .unwrap();
    let other = LayoutIdentity::new(&one_layer, semantics());
    let verdict = compatibility((&src, &prefill), (&one_layer, &other));
    assert_eq!(verdict.kind, VerdictKind::Refused);
    assert_ne!(verdict.refused_by, Some("semantics"));
}
