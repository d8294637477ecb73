//! Decode-context-parallel layout context: validation, the wire extension and its rules.

mod support;

use kvplan_core::exchange::wire::{EXT_DCP, decode, encode};
use kvplan_core::{DcpContext, Layout, PlanError};
use support::layouts::{ContextBuilder, dcp, paged};

/// Two MLA layers at fixed addresses with `dcp`; a `Result`, as these tests are about the
/// contexts a layout refuses.
fn mla(page_size: u64, dcp: DcpContext) -> Result<Layout, PlanError> {
    Layout::mla(
        vec![0x1000, 0x9000],
        vec![0x4000; 2],
        vec![64 * page_size; 2],
        Some(vec![0, 1]),
        paged(page_size).dcp(dcp),
    )
}

fn invalid(result: Result<Layout, PlanError>) -> String {
    match result {
        Err(PlanError::InvalidLayout { what }) => what,
        other => panic!("expected InvalidLayout, got {other:?}"),
    }
}

#[test]
fn bad_dcp_contexts_are_layout_errors_naming_the_values() {
    assert_eq!(
        invalid(mla(16, dcp(4, 4, 1))),
        "dcp_rank 4 must be below dcp_size 4"
    );
    assert!(
        invalid(mla(16, dcp(0, 0, 1))).starts_with("dcp_size must be at least 1"),
        "a zero size is named as the rule it breaks, not as a rank problem"
    );
    assert!(invalid(mla(16, dcp(2, 0, 0))).starts_with("dcp_interleave must be at least 1"));
    let what = invalid(mla(16, dcp(2, 1, 6)));
    assert!(
        what.contains("dcp_interleave 6 and page_size 16: one must divide the other"),
        "{what}"
    );
    // A deal of whole pages, a page of whole deals, and DCP 1 with any interleave are fine.
    for ok in [dcp(2, 1, 32), dcp(8, 7, 4), dcp(1, 0, 6), dcp(8, 3, 16)] {
        mla(16, ok).unwrap();
    }
}

#[test]
fn draft_entries_need_deals_that_divide_the_page() {
    let base = mla(16, dcp(2, 0, 32)).unwrap();
    let err = base
        .with_draft(vec![0x20000], vec![0x4000], vec![64 * 32], &[0], 2, None)
        .unwrap_err();
    match err {
        PlanError::InvalidLayout { what } => {
            assert!(what.contains("draft entry"), "{what}");
            assert!(what.contains("dcp_interleave 32"), "{what}");
        }
        other => panic!("{other:?}"),
    }
    let base = mla(16, dcp(2, 0, 16)).unwrap();
    base.with_draft(vec![0x20000], vec![0x4000], vec![64 * 32], &[0], 2, None)
        .unwrap();
}

#[test]
fn the_dcp_context_round_trips_on_the_wire() {
    for d in [dcp(8, 5, 1), dcp(2, 1, 64), dcp(1, 0, 3)] {
        let layout = mla(64, d).unwrap();
        let bytes = encode(&layout).unwrap();
        assert_eq!(decode(&bytes).unwrap(), layout);
        // The extension is present exactly when the context is not the default.
        let tag = EXT_DCP.to_le_bytes();
        let has = bytes.windows(2).any(|w| w == tag);
        assert_eq!(has, d != DcpContext::default(), "{d:?}");
    }
    // Without DCP a layout encodes exactly as before the extension existed: no context
    // extension at all (count 0 right after the device string).
    let plain = mla(64, DcpContext::default()).unwrap();
    let bytes = encode(&plain).unwrap();
    let device_end = 4 + 2 + 2 + 4 + 8 + 8 + 16 + 2 + "cpu".len();
    assert_eq!(&bytes[device_end..device_end + 2], &[0, 0]);
}

#[test]
fn a_decoded_dcp_context_is_validated() {
    let layout = mla(16, dcp(4, 3, 1)).unwrap();
    let mut bytes = encode(&layout).unwrap();
    // Patch the rank (u32 right after the tag and length) to 4, then fix the CRC.
    let tag = EXT_DCP.to_le_bytes();
    let at = bytes.windows(2).position(|w| w == tag).unwrap() + 4 + 4;
    bytes[at] = 4;
    let n = bytes.len() - 4;
    let crc = kvplan_core::exchange::wire::crc32(&bytes[..n]);
    bytes[n..].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(
        decode(&bytes),
        Err(PlanError::InvalidLayout { what }) if what == "dcp_rank 4 must be below dcp_size 4"
    ));
}
