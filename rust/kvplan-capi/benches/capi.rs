//! The C ABI's plan call against the Rust `Template::plan_into` on the same request: a 61-layer
//! MLA pool, 32,768 fully fragmented pages (1,998,848 blocks), into warm caller columns.
//!
//! `cargo bench -p kvplan-capi --bench capi [-- ROUNDS]` samples the two interleaved (the side that
//! goes first alternating per round) and prints medians, minima and the ratios. The C ABI call is the exported
//! `extern "C"` function itself (registry lookup, pointer checks, panic guard, then the core),
//! called here through the rlib: the same machine code a C caller reaches through the cdylib,
//! less the PLT jump.

use std::hint::black_box;
use std::time::{Duration, Instant};

use kvplan_capi::{
    KVPLAN_NO_TOKENS, KvplanAttention, KvplanLayout, KvplanLayoutDesc, KvplanPlanInfo,
    KvplanRequest, KvplanStatus, KvplanTemplate, kvplan_layout_new, kvplan_plan_into,
    kvplan_template_new,
};
use kvplan_core::{Columns, Layout, LayoutContext, Request, Template, TemplateOptions};

const LAYERS: usize = 61;
const ITEM: u64 = 1152; // DeepSeek-V3 MLA latent, bf16, page size 1
const PAGES: usize = 32_768;

fn parts(base: u64) -> (Vec<u64>, Vec<u64>, Vec<u64>, Vec<i64>) {
    let ptrs = (0..LAYERS as u64).map(|l| base + l * (1 << 36)).collect();
    let lens = vec![ITEM * PAGES as u64; LAYERS];
    let items = vec![ITEM; LAYERS];
    let ids = (0..LAYERS as i64).collect();
    (ptrs, lens, items, ids)
}

fn rust_template() -> Template {
    let layout = |base| {
        let (ptrs, lens, items, ids) = parts(base);
        Layout::mla(ptrs, lens, items, Some(ids), LayoutContext::default()).unwrap()
    };
    Template::new(
        &layout(1 << 40),
        &layout(1 << 50),
        TemplateOptions::default(),
    )
    .unwrap()
}

fn c_template() -> *mut KvplanTemplate {
    let roles: Vec<*const std::ffi::c_char> = vec![c"kv".as_ptr(); LAYERS];
    let layout = |base| {
        let (ptrs, lens, items, ids) = parts(base);
        let desc = KvplanLayoutDesc {
            n_entries: LAYERS,
            data_ptrs: ptrs.as_ptr(),
            data_lens: lens.as_ptr(),
            item_lens: items.as_ptr(),
            strides: std::ptr::null(),
            layer_ids: ids.as_ptr(),
            roles: roles.as_ptr(),
            kinds: std::ptr::null(),
            page_size: 1,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            attention: std::ptr::null::<KvplanAttention>(),
        };
        let mut out: *mut KvplanLayout = std::ptr::null_mut();
        // SAFETY: every array holds LAYERS values and outlives the call.
        let status = unsafe { kvplan_layout_new(&raw const desc, &raw mut out) };
        assert_eq!(status, KvplanStatus::Ok);
        out
    };
    let (src, dst) = (layout(1 << 40), layout(1 << 50));
    let mut out: *mut KvplanTemplate = std::ptr::null_mut();
    // SAFETY: live layouts, null options, a writable out pointer.
    let status = unsafe { kvplan_template_new(src, dst, std::ptr::null(), &raw mut out) };
    assert_eq!(status, KvplanStatus::Ok);
    out
}

/// Every destination page breaks contiguity (the core bench's shuffle).
fn fragmented() -> (Vec<i64>, Vec<i64>) {
    let src: Vec<i64> = (0..PAGES as i64).collect();
    let mut dst = src.clone();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..dst.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        dst.swap(i, (state % (i as u64 + 1)) as usize);
    }
    for i in 1..dst.len() {
        if dst[i] == dst[i - 1] + 1 {
            dst.swap(i, 0);
        }
    }
    (src, dst)
}

fn time_rust(
    rust: &Template,
    src: &[i64],
    dst: &[i64],
    storage: &mut [u64],
    blocks: usize,
) -> Duration {
    let start = Instant::now();
    let (_, summary) = rust
        .plan_into(&Request::pages(black_box(src), black_box(dst)), |_| {
            Ok(Columns::from_flat(storage, blocks))
        })
        .unwrap();
    let elapsed = start.elapsed();
    assert_eq!(summary.n_blocks, blocks);
    elapsed
}

fn time_c(
    template: *mut KvplanTemplate,
    request: &KvplanRequest,
    out: &mut [u64],
    blocks: usize,
) -> Duration {
    let (s, rest) = out.split_at_mut(blocks);
    let (d, l) = rest.split_at_mut(blocks);
    let mut info = KvplanPlanInfo::default();
    let start = Instant::now();
    // SAFETY: the request's arrays and the three disjoint columns of `blocks` values live
    // across the call.
    let status = unsafe {
        kvplan_plan_into(
            template,
            black_box(request),
            s.as_mut_ptr(),
            d.as_mut_ptr(),
            l.as_mut_ptr(),
            blocks,
            &raw mut info,
        )
    };
    let elapsed = start.elapsed();
    assert_eq!(status, KvplanStatus::Ok);
    assert_eq!(info.n_blocks, blocks);
    elapsed
}

fn stats(samples: &mut [Duration]) -> (Duration, Duration) {
    samples.sort();
    (samples[samples.len() / 2], samples[0])
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(41);
    let (src, dst) = fragmented();
    let rust = rust_template();
    let c = c_template();
    let blocks = PAGES * LAYERS;
    let mut storage = vec![0u64; 3 * blocks];
    let request = KvplanRequest {
        src_pages: src.as_ptr(),
        n_src: src.len(),
        dst_pages: dst.as_ptr(),
        n_dst: dst.len(),
        n_tokens: KVPLAN_NO_TOKENS,
        skip_tokens: 0,
    };
    let (mut rust_times, mut c_times) = (Vec::new(), Vec::new());
    let mut c_out = vec![0u64; 3 * blocks];
    for round in 0..=rounds {
        // Alternate which side goes first, so neither always finds the caches the other left.
        let (rust_time, c_time) = if round % 2 == 0 {
            let r = time_rust(&rust, &src, &dst, &mut storage, blocks);
            (r, time_c(c, &request, &mut c_out, blocks))
        } else {
            let t = time_c(c, &request, &mut c_out, blocks);
            (time_rust(&rust, &src, &dst, &mut storage, blocks), t)
        };
        if round == 0 {
            assert_eq!(storage, c_out, "the C ABI plan differs from the Rust plan");
            continue; // warm-up round, not sampled
        }
        rust_times.push(rust_time);
        c_times.push(c_time);
    }
    let (rust_median, rust_min) = stats(&mut rust_times);
    let (c_median, c_min) = stats(&mut c_times);
    println!("request: 61-layer MLA, {PAGES} fully fragmented pages, {blocks} blocks, i64 indices");
    println!(
        "rounds: {rounds} interleaved (which side goes first alternates), one warm-up round left out"
    );
    println!("Rust Template::plan_into: median {rust_median:?}, min {rust_min:?}");
    println!("C ABI kvplan_plan_into:   median {c_median:?}, min {c_min:?}");
    println!(
        "ratio C/Rust: median {:.3}x, min/min {:.3}x (target: within 1.1x)",
        c_median.as_secs_f64() / rust_median.as_secs_f64(),
        c_min.as_secs_f64() / rust_min.as_secs_f64()
    );
}
