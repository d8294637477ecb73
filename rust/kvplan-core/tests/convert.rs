//! Conversion templates in the core: plans of layouts without representations are the byte
//! plans, a bf16 → fp8 plan's rows and network land where the decode's pages and scales are,
//! and unconvertible pairs are refused naming both representations.

use kvplan_core::planners::convert::ConversionTemplate;
use kvplan_core::{
    Layout, LayoutContext, LayoutParts, PackBuffer, PlanError, Representation, Request, Side,
    Template, TemplateOptions,
};

const PAGE: u64 = 2;
const TOKEN: u64 = 8; // elements per token of one entry

/// One layer: `k` at `base` with `bytes` per element, plus a `k_scale` entry when `scale`
/// (float32 per token).
fn layout(base: u64, bytes: u64, repr: Option<&str>, scale: bool) -> Layout {
    one_layer(base, TOKEN, bytes, repr, scale.then_some(PAGE * 4), paged()).unwrap()
}

/// The context of the layouts below: pages of [`PAGE`] tokens, nothing else.
fn paged() -> LayoutContext {
    LayoutContext {
        page_size: PAGE,
        ..LayoutContext::default()
    }
}

/// One layer: `k` at `base` with `token` elements per token of `bytes` each, plus a `k_scale`
/// entry of `scale_item` bytes per page when given; `repr` is the `k` entry's representation.
fn one_layer(
    base: u64,
    token: u64,
    bytes: u64,
    repr: Option<&str>,
    scale_item: Option<u64>,
    context: LayoutContext,
) -> kvplan_core::Result<Layout> {
    let item = PAGE * token * bytes;
    let mut parts = LayoutParts {
        data_ptrs: vec![base],
        data_lens: vec![8 * item],
        item_lens: vec![item],
        layer_ids: vec![Some(0)],
        roles: vec!["k".into()],
        kinds: vec![],
        drafts: vec![],
    };
    if let Some(scale_item) = scale_item {
        parts.data_ptrs.push(base + (1 << 20));
        parts.data_lens.push(8 * scale_item);
        parts.item_lens.push(scale_item);
        parts.layer_ids.push(Some(0));
        parts.roles.push("k_scale".into());
    }
    let n = parts.data_ptrs.len();
    let layout = Layout::new(parts, context)?;
    let mut reprs = vec![None; n];
    reprs[0] = repr.map(|text| Representation::parse(text).unwrap());
    layout.with_representations(reprs)
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

/// Elements per token of the `mx` layouts below: two blocks of 32.
const MX_TOKEN: u64 = 64;

/// One layer of [`MX_TOKEN`] elements per token (see [`one_layer`]).
fn mx_layout(
    base: u64,
    bytes: u64,
    repr: Option<&str>,
    scale_item: Option<u64>,
) -> kvplan_core::Result<Layout> {
    one_layer(base, MX_TOKEN, bytes, repr, scale_item, paged())
}

#[test]
fn mx_scale_entries_hold_one_byte_per_block_of_32() {
    use kvplan_core::{MX_BLOCK, ScaleFormat, ScaleLayout};
    assert_eq!(ScaleLayout::Mx.code(), 4);
    assert_eq!(ScaleLayout::Mx.scale_format(), Some(ScaleFormat::E8m0));
    assert_eq!(ScaleLayout::PerTokenHead.scale_bytes(), 4);
    let blocks = MX_TOKEN / MX_BLOCK;
    let layout = mx_layout(1 << 30, 1, Some("fp8_e4m3:mx"), Some(PAGE * blocks)).unwrap();
    assert_eq!(layout.scale_entry(0), Some(1));
    // A float32-sized scale entry is the wrong size for E8M0 scales.
    let err = mx_layout(1 << 30, 1, Some("fp8_e4m3:mx"), Some(PAGE * blocks * 4)).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("entry 0") && text.contains("item_len 16") && text.contains("= 4"),
        "{text}"
    );
    for (repr, bytes, want) in [
        ("fp8_e5m2:mx", 1, "fp8_e4m3 only"),
        ("int8:mx", 1, "fp8_e4m3 only"),
        ("bf16:mx", 2, "carry no scales"),
    ] {
        let err = mx_layout(1 << 30, bytes, Some(repr), Some(PAGE * blocks)).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("entry 0") && text.contains(want),
            "{repr}: {text}"
        );
    }
    // 48 elements per token: not whole blocks.
    let parts = LayoutParts {
        data_ptrs: vec![1 << 30, (1 << 30) + (1 << 20)],
        data_lens: vec![8 * PAGE * 48, 8 * PAGE * 2],
        item_lens: vec![PAGE * 48, PAGE * 2],
        layer_ids: vec![Some(0), Some(0)],
        roles: vec!["k".into(), "k_scale".into()],
        kinds: vec![],
        drafts: vec![],
    };
    let context = LayoutContext {
        page_size: PAGE,
        ..LayoutContext::default()
    };
    let err = Layout::new(parts, context)
        .unwrap()
        .with_representations(vec![Representation::parse("fp8_e4m3:mx"), None])
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("entry 0") && text.contains("48 elements") && text.contains("of 32"),
        "{text}"
    );
}

#[test]
fn bf16_to_mx_rows_say_e8m0_and_their_scales_land_in_the_scale_entry() {
    let blocks = MX_TOKEN / 32;
    let src = mx_layout(1 << 30, 2, Some("bf16"), None).unwrap();
    let dst = mx_layout(1 << 34, 1, Some("fp8_e4m3:mx"), Some(PAGE * blocks)).unwrap();
    let conversion = ConversionTemplate::new(&src, &dst, TemplateOptions::default()).unwrap();
    assert_eq!(conversion.side(), Side::Src);
    let plan = conversion
        .plan(&Request::pages(&[1i64, 2], &[3i64, 4]), staging(), None)
        .unwrap();
    assert_eq!(plan.rows.n_elems, [PAGE * MX_TOKEN, PAGE * MX_TOKEN]);
    assert_eq!(plan.rows.group_elems, [32, 32]);
    assert_eq!(plan.rows.scale_formats, [1, 1]);
    let scales = (1u64 << 34) + (1 << 20);
    assert_eq!(
        plan.rows.scale_dst_addrs,
        [scales + 3 * PAGE * blocks, scales + 4 * PAGE * blocks]
    );
    // One byte per block: the scale area is 1/32 of the converted bytes.
    assert_eq!(plan.scale_bytes * 32, plan.converted_bytes);
    assert_eq!(
        plan.rows.scale_addrs[1] - plan.rows.scale_addrs[0],
        PAGE * blocks
    );
    assert_eq!(
        plan.network.dst_addrs,
        [(1 << 34) + 3 * PAGE * MX_TOKEN, scales + 3 * PAGE * blocks]
    );
    assert_eq!(
        plan.network.lengths,
        [2 * PAGE * MX_TOKEN, 2 * PAGE * blocks]
    );
    // Network bytes: 33/64 of the bf16 bytes.
    assert_eq!(plan.network.total_bytes * 64, plan.gathered_bytes * 33);
}

#[test]
fn mx_to_bf16_is_dequantized_on_the_decode_from_the_prefill_scale_entry() {
    let blocks = MX_TOKEN / 32;
    let src = mx_layout(1 << 30, 1, Some("fp8_e4m3:mx"), Some(PAGE * blocks)).unwrap();
    let dst = mx_layout(1 << 34, 2, Some("bf16"), None).unwrap();
    let conversion = ConversionTemplate::new(&src, &dst, TemplateOptions::default()).unwrap();
    assert_eq!(conversion.side(), Side::Dst);
    let dst_staging = PackBuffer {
        addr: 1 << 41,
        size: 1 << 20,
    };
    let plan = conversion
        .plan(
            &Request::pages(&[1i64, 2], &[3i64, 5]),
            staging(),
            Some(dst_staging),
        )
        .unwrap();
    assert_eq!(plan.rows.group_elems, [32, 32]);
    assert_eq!(plan.rows.scale_formats, [1, 1]);
    assert_eq!(plan.scale_bytes, 2 * PAGE * blocks);
    let scales = (1u64 << 30) + (1 << 20);
    assert_eq!(
        plan.rows.scale_dst_addrs,
        [scales + PAGE * blocks, scales + 2 * PAGE * blocks]
    );
    assert_eq!(plan.rows.out_addrs[1], (1 << 34) + 5 * PAGE * MX_TOKEN * 2);
}

#[test]
fn mx_and_per_token_do_not_requantize_into_each_other() {
    let blocks = MX_TOKEN / 32;
    let mx = mx_layout(1 << 30, 1, Some("fp8_e4m3:mx"), Some(PAGE * blocks)).unwrap();
    let per_token = mx_layout(1 << 34, 1, Some("fp8_e4m3:per_token"), Some(PAGE * 4)).unwrap();
    for (src, dst) in [(&mx, &per_token), (&per_token, &mx)] {
        let err = ConversionTemplate::new(src, dst, TemplateOptions::default()).unwrap_err();
        let text = err.to_string();
        assert_eq!(err.kind(), "conversion", "{text}");
        assert!(
            text.contains("fp8_e4m3:mx") && text.contains("fp8_e4m3:per_token"),
            "{text}"
        );
    }
    // The same representation on both sides: a byte copy, scale entries included.
    let other = mx_layout(1 << 34, 1, Some("fp8_e4m3:mx"), Some(PAGE * blocks)).unwrap();
    let conversion = ConversionTemplate::new(&mx, &other, TemplateOptions::default()).unwrap();
    assert!(!conversion.converts());
    let request = Request::pages(&[1i64], &[6i64]);
    let plan = conversion.plan(&request, staging(), None).unwrap();
    assert!(plan.rows.is_empty());
    let direct = Template::new(&mx, &other, TemplateOptions::default())
        .unwrap()
        .plan(&request)
        .unwrap();
    assert_eq!(plan.network.dst_addrs, direct.dst_addrs);
    assert!(
        direct
            .dst_addrs
            .contains(&((1 << 34) + (1 << 20) + 6 * PAGE * blocks))
    );
}

/// One MHA layer of 8 KV heads of 16 elements at TP rank 0 of `tp`: `k` in `dtype` (an mx
/// layout gets its E8M0 `k_scale` entry).
fn tp_layout(base: u64, tp: u32, repr: &str) -> Layout {
    let rep = Representation::parse(repr).unwrap();
    let heads = 8 / u64::from(tp);
    let scale_item = rep.scales.per_token().then_some(PAGE * heads * 16 / 32);
    let context = LayoutContext {
        tp_size: tp,
        attention: Some(kvplan_core::AttentionGeometry::for_rank(
            8,
            16,
            rep.dtype.size(),
            tp,
            None,
            None,
        )),
        ..paged()
    };
    let size = u64::from(rep.dtype.size());
    one_layer(base, heads * 16, size, Some(repr), scale_item, context).unwrap()
}

#[test]
fn mx_across_a_head_split_needs_whole_blocks_per_rank() {
    // Prefill TP 8 (one 16-element head per rank) into decode TP 2: half a block per prefill
    // rank, refused at build naming both representations.
    let err = ConversionTemplate::new(
        &tp_layout(1 << 30, 8, "bf16"),
        &tp_layout(1 << 34, 2, "fp8_e4m3:mx"),
        TemplateOptions::default(),
    )
    .unwrap_err();
    let text = err.to_string();
    assert_eq!(err.kind(), "conversion", "{text}");
    assert!(
        text.contains("bf16") && text.contains("fp8_e4m3:mx") && text.contains("16 elements"),
        "{text}"
    );
    // TP 4 (two heads: one block per rank) into TP 2 (two blocks per token) plans.
    let conversion = ConversionTemplate::new(
        &tp_layout(1 << 30, 4, "bf16"),
        &tp_layout(1 << 34, 2, "fp8_e4m3:mx"),
        TemplateOptions::default(),
    )
    .unwrap();
    let plan = conversion
        .plan(&Request::pages(&[0i64], &[1i64]), staging(), None)
        .unwrap();
    assert!(plan.rows.group_elems.iter().all(|&g| g == 32));
    assert_eq!(plan.scale_bytes * 32, plan.converted_bytes);
}

#[test]
fn buffers_at_2_pow_63_and_above_convert_as_they_do_below() {
    // Conversion plans place the converted side in a virtual space at twice its addresses'
    // distance from its lowest buffer: buffers at 2^63 and above plan exactly as the same
    // buffers lower down, every address on that side moved by the same amount.
    let high = (1u64 << 63) + (1 << 34);
    let request = Request::pages(&[1i64, 2, 5], &[3i64, 4, 0]);
    // Quantizing on the prefill: the decode is the converted (widened) side.
    let src = layout(1 << 30, 2, Some("bf16"), false);
    let plans: Vec<_> = [1u64 << 34, high]
        .into_iter()
        .map(|base| {
            let dst = layout(base, 1, Some("fp8_e4m3:per_token"), true);
            ConversionTemplate::new(&src, &dst, TemplateOptions::default())
                .unwrap()
                .plan(&request, staging(), None)
                .unwrap()
        })
        .collect();
    let moved = high - (1 << 34);
    let (low, up) = (&plans[0], &plans[1]);
    assert!(!low.network.dst_addrs.is_empty());
    assert_eq!(
        up.network.dst_addrs,
        low.network
            .dst_addrs
            .iter()
            .map(|a| a + moved)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        up.rows.scale_dst_addrs,
        low.rows
            .scale_dst_addrs
            .iter()
            .map(|a| a + moved)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        (&up.gather, &up.network.src_addrs, &up.network.lengths),
        (&low.gather, &low.network.src_addrs, &low.network.lengths)
    );
    assert_eq!(up.rows.in_addrs, low.rows.in_addrs);
    assert_eq!(up.rows.out_addrs, low.rows.out_addrs);
    // Dequantizing on the decode: the prefill is the converted side.
    let blocks = MX_TOKEN / 32;
    let dst = mx_layout(1 << 34, 2, Some("bf16"), None).unwrap();
    let dst_staging = PackBuffer {
        addr: 1 << 41,
        size: 1 << 20,
    };
    let plans: Vec<_> = [1u64 << 30, (1 << 63) + (1 << 30)]
        .into_iter()
        .map(|base| {
            let src = mx_layout(base, 1, Some("fp8_e4m3:mx"), Some(PAGE * blocks)).unwrap();
            ConversionTemplate::new(&src, &dst, TemplateOptions::default())
                .unwrap()
                .plan(&request, staging(), Some(dst_staging))
                .unwrap()
        })
        .collect();
    let (low, up) = (&plans[0], &plans[1]);
    assert!(!low.gather.src_addrs.is_empty());
    assert_eq!(
        up.gather.src_addrs,
        low.gather
            .src_addrs
            .iter()
            .map(|a| a + (1 << 63))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        up.rows.scale_dst_addrs,
        low.rows
            .scale_dst_addrs
            .iter()
            .map(|a| a + (1 << 63))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        (&up.network, &up.rows.out_addrs, &up.scatter),
        (&low.network, &low.rows.out_addrs, &low.scatter)
    );
}

#[test]
fn converted_buffers_spanning_2_pow_63_bytes_are_a_typed_refusal() {
    // Two layers, one near the bottom of the address space and one above 2^63: twice their
    // distance does not fit in 64 bits. Refused as an overflow naming why, never wrapped.
    let src = Layout::new(
        LayoutParts {
            data_ptrs: vec![1 << 30, 1 << 31],
            data_lens: vec![1 << 10; 2],
            item_lens: vec![PAGE * TOKEN * 2; 2],
            layer_ids: vec![Some(0), Some(1)],
            roles: vec!["k".into(); 2],
            kinds: vec![],
            drafts: vec![],
        },
        paged(),
    )
    .unwrap()
    .with_representations(vec![Representation::parse("bf16"); 2])
    .unwrap();
    let dst = Layout::new(
        LayoutParts {
            data_ptrs: vec![1 << 20, (1 << 63) + (1 << 20), 1 << 25, 1 << 26],
            data_lens: vec![1 << 10; 4],
            item_lens: vec![PAGE * TOKEN, PAGE * TOKEN, PAGE * 4, PAGE * 4],
            layer_ids: vec![Some(0), Some(1), Some(0), Some(1)],
            roles: vec!["k".into(), "k".into(), "k_scale".into(), "k_scale".into()],
            kinds: vec![],
            drafts: vec![],
        },
        paged(),
    )
    .unwrap()
    .with_representations(vec![
        Representation::parse("fp8_e4m3:per_token"),
        Representation::parse("fp8_e4m3:per_token"),
        None,
        None,
    ])
    .unwrap();
    let err = ConversionTemplate::new(&src, &dst, TemplateOptions::default()).unwrap_err();
    assert!(matches!(err, PlanError::Overflow { .. }), "{err}");
    assert!(err.to_string().contains("span 2^63 bytes or more"), "{err}");
}
