//! Multi-component layers: a decode component of a layer the prefill sends, of a role the
//! prefill has no entry of, is refused by name; a further occurrence of a sent role is not.

use kvplan_core::{Layout, LayoutContext, LayoutParts, PlanError, Side, Template, TemplateOptions};

fn layout(base: u64, ids: &[i64], roles: &[&str]) -> Layout {
    let n = ids.len();
    let parts = LayoutParts {
        data_ptrs: (0..n as u64).map(|k| base + (k << 20)).collect(),
        data_lens: vec![64 * 8; n],
        item_lens: vec![64; n],
        layer_ids: ids.iter().map(|&i| Some(i)).collect(),
        roles: roles.iter().map(ToString::to_string).collect(),
        ..LayoutParts::default()
    };
    Layout::new(parts, LayoutContext::default()).unwrap()
}

#[test]
fn a_component_the_prefill_lacks_is_a_missing_partner() {
    let src = layout(1 << 32, &[0, 1], &["nope", "nope"]);
    let dst = layout(1 << 40, &[0, 0, 1, 1], &["nope", "rope", "nope", "rope"]);
    match Template::new(&src, &dst, TemplateOptions::default()) {
        Err(PlanError::MissingPartner {
            side,
            entry,
            layer,
            role,
            ..
        }) => {
            assert_eq!(
                (side, entry, layer, role.as_str()),
                (Side::Dst, 1, 0, "rope")
            );
        }
        other => panic!("expected MissingPartner, got {other:?}"),
    }
    // The decode's layer 2 is not sent: its components are not this template's.
    let src = layout(1 << 32, &[0, 0], &["nope", "rope"]);
    let dst = layout(1 << 40, &[0, 0, 2], &["nope", "rope", "nope"]);
    assert!(Template::new(&src, &dst, TemplateOptions::default()).is_ok());
    // A second occurrence of a role the prefill sends pairs by occurrence: not refused.
    let dst = layout(1 << 40, &[0, 0, 0], &["nope", "rope", "nope"]);
    assert!(Template::new(&src, &dst, TemplateOptions::default()).is_ok());
}
