//! Layer-wise slices of one plan: the slices plus the seal tile the monolithic plan exactly
//! (every block once, nothing else), every byte of a slice belongs to an entry of its layer
//! group, every seal byte to an entry no group covers, and the work each slice reports is what
//! its blocks move. Page plans, token plans, TP head slicing, PP stages, cross-layer pools,
//! state and draft entries.

mod support;

use kvplan_core::Request;
use kvplan_core::{
    EntryTag, FlatBuffer, GeometryOptions, LayerGroups, LayerSlices, Layout, MemoryOrder,
    PlanSlices, PlanSummary, SliceKey, Template, TemplateOptions, WorkManifest,
};
use support::blocks::{of_columns, state_plan, triples};
use support::layouts::{
    ContextBuilder, HEAD_BYTES, KvLayout, heads, layer_pool, paged, with_slots,
};

/// Plans a request and returns its columns and summary.
fn plan(
    t: &Template,
    src: &[i64],
    dst: &[i64],
    n_tokens: Option<u64>,
) -> (Vec<[u64; 3]>, PlanSummary) {
    let (buffer, summary) = t
        .plan_into(&Request::new(src, dst, n_tokens), |shape| {
            FlatBuffer::try_zeroed(shape.n_blocks)
        })
        .unwrap();
    let (s, d, l) = buffer.into_columns(summary.n_blocks).unwrap();
    (of_columns(&s, &d, &l), summary)
}

/// The state plan of slot `src` to slot `dst` as blocks, with its summary.
fn state_blocks(t: &Template, src: i64, dst: i64) -> (Vec<[u64; 3]>, PlanSummary) {
    let (plan, summary) = state_plan(t, src, dst);
    (triples(&plan), summary)
}

/// The entry of `layout` whose item holds byte `addr` (items of entries never overlap, even in
/// a cross-layer pool).
fn owner(layout: &Layout, addr: u64) -> usize {
    let parts = layout.parts();
    (0..layout.n_entries())
        .find(|&e| {
            let (base, item, stride) =
                (parts.data_ptrs[e], parts.item_lens[e], layout.strides()[e]);
            addr >= base
                && item > 0
                && (addr - base) / stride < layout.capacity(e)
                && (addr - base) % stride < item
        })
        .unwrap_or_else(|| panic!("byte {addr:#x} is in no entry's item"))
}

/// Checks the tiling and ownership of one plan's slices; returns them.
fn check(
    t: &Template,
    src: &Layout,
    groups: &LayerGroups,
    blocks: &[[u64; 3]],
    summary: &PlanSummary,
) -> PlanSlices {
    let slices = LayerSlices::new(t, groups).unwrap();
    let cut = slices.of(t, summary);
    assert_eq!(cut.ranges.len(), slices.slices().len());
    let mut covered = vec![0u32; blocks.len()];
    let mut visit = |ranges: &[(usize, usize)], key: SliceKey, work: &kvplan_core::SliceWork| {
        let (mut n, mut bytes) = (0u64, 0u64);
        for &(a, b) in ranges {
            assert!(
                a < b && b <= blocks.len(),
                "range {a}..{b} of {}",
                blocks.len()
            );
            for (k, block) in blocks.iter().enumerate().take(b).skip(a) {
                covered[k] += 1;
                n += 1;
                bytes += block[2];
                for byte in block[0]..block[0] + block[2] {
                    let e = owner(src, byte);
                    // State entries go with their layer's group, as page entries do.
                    let got = groups.key(&EntryTag::of(src, e));
                    assert_eq!(got, key, "block {k} byte {byte:#x} (entry {e})");
                }
            }
        }
        assert_eq!((work.blocks, work.bytes), (n, bytes));
    };
    for ((spec, ranges), work) in slices.slices().iter().zip(&cut.ranges).zip(&cut.work) {
        assert_eq!(work.layer_group, spec.layer_group);
        visit(ranges, SliceKey::LayerGroup(spec.layer_group), work);
    }
    visit(&cut.seal_ranges, SliceKey::Seal, &cut.seal);
    assert!(
        covered.iter().all(|&c| c == 1),
        "each block in exactly one slice: {covered:?}"
    );
    assert_eq!(
        cut.work.iter().map(|w| w.bytes).sum::<u64>() + cut.seal.bytes,
        summary.total_bytes
    );
    cut
}

fn groupings() -> Vec<LayerGroups> {
    vec![
        LayerGroups::every_layer(),
        LayerGroups::fixed(3).unwrap(),
        LayerGroups::fixed(64).unwrap(),
        LayerGroups::sets(vec![vec![5, 0], vec![], vec![2, 3, 4]]).unwrap(),
        LayerGroups::fixed(2)
            .unwrap()
            .with_seal(&[1], &["idx".to_string()]),
    ]
}

/// MLA layers `ids` from `base`, `pages` pages of `item` bytes each, every buffer followed by
/// as many unused bytes.
fn mla(base: u64, ids: &[i64], item: u64, pages: u64, page_size: u64) -> Layout {
    KvLayout::mla(base, ids.to_vec(), item, item * pages)
        .spaced(item * pages * 2)
        .context(paged(page_size))
        .build()
}

const FRAGMENTED: ([i64; 6], [i64; 6]) = ([0, 1, 2, 5, 6, 9], [3, 4, 8, 1, 2, 0]);

#[test]
fn per_layer_page_plans_with_draft_and_state_tile_the_plan() {
    let ids: Vec<i64> = (0..6).collect();
    let with_extras = |base: u64| {
        let layout = mla(base, &ids, 16, 12, 1)
            .with_draft(
                vec![base + 0x10_0000],
                vec![16 * 12],
                vec![16],
                &[0],
                6,
                None,
            )
            .unwrap();
        let state = vec![base + 0x20_0000, base + 0x30_0000];
        with_slots(layout, "mamba", state, 4, 16, vec![1, 4])
    };
    let (src, dst) = (with_extras(0x1_000_000), with_extras(0x8_000_000));
    for groups in groupings() {
        for coalesce in [true, false] {
            let geometry = GeometryOptions {
                coalesce,
                ..GeometryOptions::default()
            };
            let t = Template::with_layer_groups(
                &src,
                &dst,
                TemplateOptions::default(),
                &geometry,
                &groups,
            )
            .unwrap();
            let (blocks, summary) = plan(&t, &FRAGMENTED.0, &FRAGMENTED.1, None);
            let cut = check(&t, &src, &groups, &blocks, &summary);
            // The draft entry (id 6 in the band above the model) is always seal.
            assert!(cut.seal.blocks >= 3, "{:?}", cut.seal);
            let (blocks, summary) = state_blocks(&t, 2, 3);
            let state = check(&t, &src, &groups, &blocks, &summary);
            // The state of layers 1 and 4 travels with their groups; only a layer no group
            // covers (or one marked for the seal) leaves its state to the seal.
            let state_key = |layer: i64| {
                let slices = LayerSlices::new(&t, &groups).unwrap();
                slices.slice_of_layer(layer).unwrap()
            };
            let sealed = [1, 4].iter().filter(|&&l| state_key(l).is_none()).count();
            assert_eq!(state.seal.blocks as usize, sealed);
            assert_eq!(
                state.work.iter().map(|w| w.blocks).sum::<u64>() as usize,
                2 - sealed
            );
            let peers = LayerSlices::new(&t, &groups).unwrap().peers();
            let m = cut.manifest(42, peers, Some(&state));
            assert_eq!(
                m.total_blocks() as usize,
                t.plan(&Request::pages(&FRAGMENTED.0, &FRAGMENTED.1))
                    .unwrap()
                    .lengths
                    .len()
                    + 2
            );
            assert_eq!(WorkManifest::from_bytes(&m.to_bytes()).unwrap(), m);
            // The manifest counts each slice's page and state blocks together.
            for ((slice, page), state) in m.slices.iter().zip(&cut.work).zip(&state.work) {
                assert_eq!(slice.blocks, page.blocks + state.blocks);
                assert_eq!(slice.bytes, page.bytes + state.bytes);
            }
        }
    }
}

#[test]
fn a_group_of_a_cross_layer_pool_is_one_strided_piece_per_run() {
    // Pool to pool, 8 layers of 16 bytes per page: with groups of 4 the template has two
    // pieces, each a group's 64 touching bytes of every page (strided: one block per page).
    let pool = |base| layer_pool(base, 16, (0..8).collect(), vec![16; 8], paged(1));
    let (src, dst) = (pool(0x10_0000), pool(0x90_0000));
    let groups = LayerGroups::fixed(4).unwrap();
    let t = Template::with_layer_groups(
        &src,
        &dst,
        TemplateOptions::default(),
        &GeometryOptions::default(),
        &groups,
    )
    .unwrap();
    assert_eq!(t.blocks().groups().len(), 2);
    let (blocks, summary) = plan(&t, &FRAGMENTED.0, &FRAGMENTED.1, None);
    assert_eq!(summary.n_runs(), 4);
    let cut = check(&t, &src, &groups, &blocks, &summary);
    assert_eq!(
        cut.work.iter().map(|w| w.blocks).collect::<Vec<_>>(),
        [6, 6]
    );
    assert!(blocks.iter().all(|b| b[2] == 64));
    // Built without the groups, the pool is one coalesced piece: slicing it by 4 is refused,
    // naming the pairs; the whole model as one group is fine.
    let plain = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
    let err = LayerSlices::new(&plain, &groups).unwrap_err().to_string();
    assert!(
        err.contains(
            "page pair 0 (layer 0, layer group 0) and page pair 4 (layer 4, layer group 1)"
        ),
        "{err}"
    );
    LayerSlices::new(&plain, &LayerGroups::fixed(8).unwrap()).unwrap();
    // PP: a stage holding layers 4..8 of the pool; fixed groups by global id.
    let stage = layer_pool(0x10_0000, 16, (4..8).collect(), vec![16; 4], paged(1));
    for groups in groupings() {
        let t = Template::with_layer_groups(
            &stage,
            &dst,
            TemplateOptions::default(),
            &GeometryOptions::default(),
            &groups,
        )
        .unwrap();
        let (blocks, summary) = plan(&t, &FRAGMENTED.0, &FRAGMENTED.1, None);
        check(&t, &stage, &groups, &blocks, &summary);
    }
}

#[test]
fn token_plans_and_head_slicing_tile_the_plan() {
    // MHA, 2 KV heads per prefill rank of 4, head 4 bytes; prefill TP 2 (rank 1) → decode TP 1;
    // page sizes 2 → 4 (a token plan) and 4 → 4 (a page plan with head fragments).
    let layout = |base: u64, tp_size: u32, tp_rank: u32, page_size: u64| {
        let per_rank = 4 / tp_size;
        let item = page_size * u64::from(per_rank) * HEAD_BYTES;
        let context =
            paged(page_size)
                .tp(tp_rank, tp_size)
                .attention(heads(4, per_rank, MemoryOrder::Nhd));
        KvLayout::mha(base, 0..5, item, item * 16)
            .spaced(item * 32)
            .v_at(base + 0x8000)
            .context(context)
            .build()
    };
    for (ps_src, ps_dst) in [(2, 4), (4, 4), (4, 2)] {
        let src = layout(0x100_0000, 2, 1, ps_src);
        let dst = layout(0x900_0000, 1, 0, ps_dst);
        for groups in groupings() {
            let t = Template::with_layer_groups(
                &src,
                &dst,
                TemplateOptions::default(),
                &GeometryOptions::default(),
                &groups,
            )
            .unwrap();
            let src_pages: Vec<i64> = vec![0, 1, 3, 4, 7, 8, 9, 12];
            let dst_pages: Vec<i64> = vec![2, 3, 5, 6, 10, 11, 14, 15];
            let n_tokens = Some(13);
            let (blocks, summary) = plan(&t, &src_pages, &dst_pages, n_tokens);
            assert!(matches!(summary.unit, kvplan_core::PlanUnit::Tokens(_)));
            check(&t, &src, &groups, &blocks, &summary);
            if ps_src == ps_dst {
                let (blocks, summary) = plan(&t, &src_pages, &dst_pages, None);
                assert!(!matches!(summary.unit, kvplan_core::PlanUnit::Tokens(_)));
                check(&t, &src, &groups, &blocks, &summary);
            }
        }
    }
}

#[test]
fn ready_layers_are_keyed_by_global_id_and_unknown_layers_are_refused() {
    let stage = mla(0x10_0000, &[4, 5, 6, 7], 16, 8, 1);
    let decode = mla(0x90_0000, &(0..8).collect::<Vec<_>>(), 16, 8, 1);
    let t = Template::new(&stage, &decode, TemplateOptions::default()).unwrap();
    let slices = LayerSlices::new(&t, &LayerGroups::fixed(3).unwrap()).unwrap();
    let layers: Vec<Vec<i64>> = slices.slices().iter().map(|s| s.layers.clone()).collect();
    assert_eq!(layers, [vec![], vec![4, 5], vec![6, 7]]);
    assert_eq!(slices.slice_of_layer(5).unwrap(), Some(1));
    assert_eq!(slices.slice_of_layer(6).unwrap(), Some(2));
    // Another stage's layer completes nothing here; a layer the model has not is an error.
    assert_eq!(slices.slice_of_layer(1).unwrap(), None);
    let err = slices.slice_of_layer(8).unwrap_err().to_string();
    assert!(
        err.contains("layer 8 is not a layer") && err.contains("streams layers 4-7"),
        "{err}"
    );
    assert!(slices.slice_of_layer(-1).is_err());
    let sets = LayerSlices::new(&t, &LayerGroups::sets(vec![vec![4, 5]]).unwrap()).unwrap();
    // 6 is in no caller set but is an entry of this template (sent with the seal).
    assert_eq!(sets.slice_of_layer(6).unwrap(), None);
    // So is a layer of another stage in no caller set: the answer for a model layer does not
    // depend on which stage is asked.
    assert_eq!(sets.slice_of_layer(2).unwrap(), None);
    assert_eq!(sets.slice_of_layer(7).unwrap(), None);
    assert!(sets.slice_of_layer(9).is_err());
    assert!(sets.slice_of_layer(-1).is_err());
    assert!(LayerGroups::sets(vec![vec![1], vec![1, 2]]).is_err());
    assert!(LayerGroups::fixed(0).is_err());
}

#[test]
fn manifest_wire_round_trip_and_refusals() {
    let stage = mla(0x10_0000, &[0, 1, 2, 3], 16, 8, 1);
    let t = Template::new(&stage, &stage, TemplateOptions::default()).unwrap();
    let groups = LayerGroups::fixed(2).unwrap();
    let slices = LayerSlices::new(&t, &groups).unwrap();
    let (blocks, summary) = plan(&t, &[0, 1, 5], &[2, 3, 4], None);
    let cut = check(&t, &stage, &groups, &blocks, &summary);
    let m = cut.manifest(7, slices.peers(), None);
    assert_eq!(
        (m.total_blocks(), m.total_bytes()),
        (blocks.len() as u64, summary.total_bytes)
    );
    let bytes = m.to_bytes();
    assert_eq!(bytes.len(), 52 + 24 * 2 + 20);
    assert_eq!(WorkManifest::from_bytes(&bytes).unwrap(), m);
    let mut bad = bytes.clone();
    bad[20] ^= 1;
    assert!(
        WorkManifest::from_bytes(&bad)
            .unwrap_err()
            .to_string()
            .contains("CRC-32")
    );
    assert!(WorkManifest::from_bytes(&bytes[..bytes.len() - 1]).is_err());
    let mut version = bytes;
    version[4] = 9;
    assert!(
        WorkManifest::from_bytes(&version)
            .unwrap_err()
            .to_string()
            .contains("version 9")
    );
}

#[test]
fn a_linear_attention_layer_streams_its_state_with_its_group() {
    // Layers 0 and 2 are paged (attention), layers 1 and 3 hold only per-request state (a
    // linear-attention layer's recurrent state): their state waits for their own ready signal
    // and goes with their group; a state entry of layer 9 (in no caller set) stays in the seal.
    let with_state = |base: u64| {
        mla(base, &[0, 2], 16, 8, 1)
            .with_state(
                "recurrent",
                vec![base + 0x20_0000, base + 0x30_0000, base + 0x40_0000],
                vec![64 * 4, 32 * 4, 8 * 4],
                vec![64, 32, 8],
                vec![1, 3, 9],
            )
            .unwrap()
    };
    let (src, dst) = (with_state(0x1_000_000), with_state(0x8_000_000));
    let groups = LayerGroups::sets(vec![vec![0, 1], vec![2, 3]]).unwrap();
    let t = Template::with_layer_groups(
        &src,
        &dst,
        TemplateOptions::default(),
        &GeometryOptions::default(),
        &groups,
    )
    .unwrap();
    let slices = LayerSlices::new(&t, &groups).unwrap();
    let layers: Vec<Vec<i64>> = slices.slices().iter().map(|s| s.layers.clone()).collect();
    assert_eq!(layers, [vec![0, 1], vec![2, 3]]);
    assert_eq!(slices.slice_of_layer(3).unwrap(), Some(1));
    assert_eq!(slices.slice_of_layer(9).unwrap(), None);
    let (blocks, summary) = state_blocks(&t, 1, 2);
    let state = check(&t, &src, &groups, &blocks, &summary);
    assert_eq!(state.ranges, [vec![(0, 1)], vec![(1, 2)]]);
    assert_eq!(
        state.work.iter().map(|w| w.bytes).collect::<Vec<_>>(),
        [64, 32]
    );
    assert_eq!((state.seal.blocks, state.seal.bytes), (1, 8));
    assert_eq!(state.seal_ranges, [(2, 3)]);
    let (blocks, summary) = plan(&t, &[0, 1, 5], &[2, 3, 4], None);
    let pages = check(&t, &src, &groups, &blocks, &summary);
    let m = pages.manifest(3, slices.peers(), Some(&state));
    assert_eq!(m.slices[1].bytes, pages.work[1].bytes + 32);
    assert_eq!(m.seal.bytes, 8);
    assert_eq!(m.total_bytes(), summary.total_bytes + 64 + 32 + 8);
}
