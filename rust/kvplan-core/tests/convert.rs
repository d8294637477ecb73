//! Conversion templates in the core: plans of layouts without representations are the byte
//! plans, a bf16 → fp8 plan's rows and network land where the decode's pages and scales are,
//! and unconvertible pairs are refused naming both representations.

use kvplan_core::convert::ConversionTemplate;
use kvplan_core::{
    Layout, LayoutContext, LayoutParts, PackBuffer, PlanError, Representation, Request, Side,
    Template, TemplateOptions,
};

const PAGE: u64 = 2;
const TOKEN: u64 = 8; // elements per token of one entry

/// One layer: `k` at `base` with `bytes` per element, plus a `k_scale` entry when `scale`.
fn layout(base: u64, bytes: u64, repr: Option<&str>, scale: bool) -> Layout {
    let item = PAGE * TOKEN * bytes;
    let mut parts = LayoutParts {
        data_ptrs: vec![base],
        data_lens: vec![8 * item],
        item_lens: vec![item],
        layer_ids: vec![Some(0)],
        roles: vec!["k".into()],
        kinds: vec![],
        drafts: vec![],
    };
    if scale {
        parts.data_ptrs.push(base + (1 << 20));
        parts.data_lens.push(8 * PAGE * 4);
        parts.item_lens.push(PAGE * 4);
        parts.layer_ids.push(Some(0));
        parts.roles.push("k_scale".into());
    }
    let context = LayoutContext {
        page_size: PAGE,
        ..LayoutContext::default()
    };
    let n = parts.data_ptrs.len();
    let layout = Layout::new(parts, context).unwrap();
    match repr {
        None => layout,
        Some(text) => {
            let mut reprs = vec![None; n];
            reprs[0] = Representation::parse(text);
            layout.with_representations(reprs).unwrap()
        }
    }
}

fn staging() -> PackBuffer {
    PackBuffer {
        addr: 1 << 40,
        size: 1 << 20,
    }
}

#[test]
fn without_representations_the_network_is_the_byte_plan() {
    let (src, dst) = (
        layout(1 << 30, 2, None, false),
        layout(1 << 34, 2, None, false),
    );
    let request = Request::pages(&[1i64, 2, 5], &[3i64, 4, 0]);
    let direct = Template::new(&src, &dst, TemplateOptions::default())
        .unwrap()
        .plan(&request)
        .unwrap();
    let conversion = ConversionTemplate::new(&src, &dst, TemplateOptions::default()).unwrap();
    assert!(!conversion.converts());
    let plan = conversion.plan(&request, staging(), None).unwrap();
    assert!(plan.rows.is_empty());
    assert_eq!(plan.network.dst_addrs, direct.dst_addrs);
    assert_eq!(plan.network.lengths, direct.lengths);
}

#[test]
fn bf16_to_fp8_rows_and_network_land_on_the_decode_pages_and_scales() {
    let src = layout(1 << 30, 2, Some("bf16"), false);
    let dst = layout(1 << 34, 1, Some("fp8_e4m3:per_token"), true);
    let conversion = ConversionTemplate::new(&src, &dst, TemplateOptions::default()).unwrap();
    assert_eq!(conversion.side(), Side::Src);
    let plan = conversion
        .plan(&Request::pages(&[1i64, 2], &[3i64, 4]), staging(), None)
        .unwrap();
    // Two pages in one run: one gather block, one row per page, values then scales.
    assert_eq!(plan.gather.lengths, [2 * PAGE * TOKEN * 2]);
    assert_eq!(plan.rows.n_elems, [PAGE * TOKEN, PAGE * TOKEN]);
    assert_eq!(plan.rows.group_elems, [TOKEN, TOKEN]);
    let scales = (1u64 << 34) + (1 << 20);
    assert_eq!(
        plan.rows.scale_dst_addrs,
        [scales + 3 * PAGE * 4, scales + 4 * PAGE * 4]
    );
    assert_eq!(
        plan.network.dst_addrs,
        [(1 << 34) + 3 * PAGE * TOKEN, scales + 3 * PAGE * 4]
    );
    assert_eq!(plan.network.lengths, [2 * PAGE * TOKEN, 2 * PAGE * 4]);
    assert_eq!(
        plan.network.total_bytes * 2,
        plan.gathered_bytes + 2 * plan.scale_bytes
    );
    let small = PackBuffer {
        addr: 1 << 40,
        size: plan.staging_bytes - 1,
    };
    let err = conversion
        .plan(&Request::pages(&[1i64, 2], &[3i64, 4]), small, None)
        .unwrap_err();
    assert_eq!(err.kind(), "staging_too_small");
}

#[test]
fn unconvertible_pairs_name_both_representations() {
    let src = layout(1 << 30, 1, Some("fp8_e4m3:per_token"), true);
    let dst = layout(1 << 34, 1, Some("int8:per_token"), true);
    let err = ConversionTemplate::new(&src, &dst, TemplateOptions::default()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, PlanError::Conversion { .. }), "{text}");
    assert!(
        text.contains("fp8_e4m3:per_token") && text.contains("int8:per_token"),
        "{text}"
    );
    // A byte-copy template refuses the same pair rather than reinterpreting the bytes.
    let err = Template::new(&src, &dst, TemplateOptions::default()).unwrap_err();
    assert_eq!(err.kind(), "conversion");
}
