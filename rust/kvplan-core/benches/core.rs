//! Core microbenchmarks: run grouping, pairing and block emission from 61 to 10M blocks, and a
//! batch of 256 small requests.
//!
//! `cargo bench -p kvplan-core --bench core` prints time per call (divide by the block count in
//! the argument for ns/block) and, through `AllocProfiler`, allocations per call.

use divan::{AllocProfiler, Bencher, black_box};
use kvplan_core::{
    Columns, EntryMetadata, Layout, LayoutContext, Template, TemplateOptions, group_contiguous,
    pair_entries,
};
use kvplan_core::{FlatRequests, Request};

#[global_allocator]
static ALLOC: AllocProfiler = AllocProfiler::system();

fn main() {
    divan::main();
}

const LAYERS: usize = 61;
const ITEM: u64 = 1152; // DeepSeek-V3 MLA latent, bf16, page size 1

fn mla_template(pages: usize) -> Template {
    let layout = |base: u64| {
        let ptrs = (0..LAYERS as u64).map(|l| base + l * (1 << 36)).collect();
        let ids = Some((0..LAYERS as i64).collect());
        Layout::mla(
            ptrs,
            vec![ITEM * pages as u64; LAYERS],
            vec![ITEM; LAYERS],
            ids,
            LayoutContext::default(),
        )
        .unwrap()
    };
    Template::new(
        &layout(1 << 40),
        &layout(1 << 50),
        TemplateOptions::default(),
    )
    .unwrap()
}

/// Fully fragmented: every destination page breaks contiguity (a deterministic shuffle).
fn fragmented(pages: usize) -> (Vec<i32>, Vec<i32>) {
    let src: Vec<i32> = (0..pages as i32).collect();
    let mut dst = src.clone();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..dst.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        dst.swap(i, (state % (i as u64 + 1)) as usize);
    }
    // A shuffle may leave a few ascending neighbours; break them so every page is its own run.
    for i in 1..dst.len() {
        if dst[i] == dst[i - 1] + 1 {
            dst.swap(i, 0);
        }
    }
    (src, dst)
}

/// Emission into a warm caller buffer (steady state): blocks = 61 × pages.
#[divan::bench(args = [1, 16, 1024, 32_768, 163_935])]
fn emit_fragmented_warm(bencher: Bencher<'_, '_>, pages: usize) {
    let template = mla_template(pages);
    let (src, dst) = fragmented(pages);
    let blocks = pages * LAYERS;
    let mut storage = vec![0u64; 3 * blocks];
    bencher
        .counter(divan::counter::ItemsCount::new(blocks))
        .bench_local(|| {
            template
                .plan_into(&Request::pages(black_box(&src), black_box(&dst)), |_| {
                    Ok(Columns::from_flat(&mut storage, blocks))
                })
                .unwrap()
                .1
        });
}

/// Emission into freshly allocated memory every call (what a pool avoids).
#[divan::bench(args = [32_768])]
fn emit_fragmented_fresh(bencher: Bencher<'_, '_>, pages: usize) {
    let template = mla_template(pages);
    let (src, dst) = fragmented(pages);
    bencher
        .counter(divan::counter::ItemsCount::new(pages * LAYERS))
        .bench_local(|| {
            template
                .plan(&Request::pages(black_box(&src), black_box(&dst)))
                .unwrap()
        });
}

/// A contiguous request: one run, so 61 blocks whatever the page count (per-call overhead).
#[divan::bench(args = [1, 32_768])]
fn emit_contiguous_warm(bencher: Bencher<'_, '_>, pages: usize) {
    let template = mla_template(pages);
    let src: Vec<i32> = (0..pages as i32).collect();
    let mut storage = vec![0u64; 3 * LAYERS];
    bencher
        .counter(divan::counter::ItemsCount::new(LAYERS))
        .bench_local(|| {
            template
                .plan_into(&Request::pages(black_box(&src), black_box(&src)), |_| {
                    Ok(Columns::from_flat(&mut storage, LAYERS))
                })
                .unwrap()
                .1
        });
}

#[divan::bench(args = [1024, 32_768, 1_048_576])]
fn group_runs_fragmented(bencher: Bencher<'_, '_>, pages: usize) {
    let (src, dst) = fragmented(pages);
    bencher
        .counter(divan::counter::ItemsCount::new(pages))
        .bench_local(|| group_contiguous(black_box(&src), black_box(&dst)).unwrap());
}

/// Identity pairing of a PP stage (30 layers of 61) against a full decode, K and V duplicated.
#[divan::bench(args = [61, 1_000])]
fn pair_layer_ids(bencher: Bencher<'_, '_>, layers: usize) {
    let dst_ids: Vec<i64> = (0..layers as i64).chain(0..layers as i64).collect();
    let src_ids: Vec<i64> = (layers as i64 / 2..layers as i64)
        .chain(layers as i64 / 2..layers as i64)
        .collect();
    bencher.bench_local(|| {
        pair_entries(
            EntryMetadata::ids(Some(black_box(&src_ids)), src_ids.len()),
            EntryMetadata::ids(Some(black_box(&dst_ids)), dst_ids.len()),
            false,
        )
        .unwrap()
    });
}

/// A batch of 256 requests of 16 pages each, given flat (`FlatRequests`), each request at its
/// own 16-page slot of a 8,192-page pool on each side (slots shuffled independently): every
/// request is a segment of its own, 61 blocks each. Planned into a warm caller buffer.
#[divan::bench]
fn batch_flat_scattered(bencher: Bencher<'_, '_>) {
    const REQUESTS: usize = 256;
    const PAGES: usize = 16;
    let template = mla_template(8192);
    let slots = |seed: u64| -> Vec<i32> {
        let mut slots: Vec<i32> = (0..(8192 / PAGES) as i32).collect();
        let mut state = seed;
        for i in (1..slots.len()).rev() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            slots.swap(i, (state % (i as u64 + 1)) as usize);
        }
        slots.truncate(REQUESTS);
        slots
    };
    let pages = |slots: Vec<i32>| -> Vec<i32> {
        let first = slots.into_iter().map(|s| s * PAGES as i32);
        first.flat_map(|p| p..p + PAGES as i32).collect()
    };
    let src = pages(slots(0x9E37_79B9_7F4A_7C15));
    let dst = pages(slots(0x2545_F491_4F6C_DD1D));
    let offsets: Vec<i64> = (0..=REQUESTS as i64).map(|r| r * PAGES as i64).collect();
    let blocks = REQUESTS * LAYERS;
    let mut storage = vec![0u64; 3 * blocks];
    bencher
        .counter(divan::counter::ItemsCount::new(blocks))
        .bench_local(|| {
            let flat = FlatRequests::new(black_box(&src), black_box(&dst), &offsets);
            let requests = flat.requests().unwrap();
            template
                .batch()
                .plan_into(&requests, |_| Ok(Columns::from_flat(&mut storage, blocks)))
                .unwrap()
                .1
                .n_blocks
        });
}
