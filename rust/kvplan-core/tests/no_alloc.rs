//! `Template::plan_into` allocates nothing: the output is the caller's. Only allocations made
//! by this test's own thread while the flag is up are counted (the harness allocates from its
//! own threads, e.g. for output capture).

use kvplan_core::Request;
use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kvplan_core::{Columns, Layout, LayoutContext, Template, TemplateOptions};

struct Counting;
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    // Bytes this thread allocated while its flag was up (`None`: not measuring).
    static MEASURED: Cell<Option<usize>> = const { Cell::new(None) };
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        if COUNTING.try_with(Cell::get).unwrap_or(false) {
            ALLOCATIONS.fetch_add(1, Relaxed);
        }
        let _ = MEASURED.try_with(|m| m.set(m.get().map(|n| n + layout.size())));
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn plan_into_never_allocates() {
    let layers = 61usize;
    let ptrs: Vec<u64> = (0..layers as u64)
        .map(|l| 0x1_0000_0000 * (l + 1))
        .collect();
    let ids = Some((0..layers as i64).collect());
    let layout = Layout::mla(
        ptrs,
        vec![1152 * 4096; layers],
        vec![1152; layers],
        ids,
        LayoutContext::default(),
    )
    .unwrap();
    let template = Template::new(&layout, &layout, TemplateOptions::default()).unwrap();
    let src: Vec<i32> = (0..4096).rev().collect();
    let dst: Vec<i32> = (0..4096).collect();
    let capacity = 4096 * layers;
    let mut storage = vec![0u64; 3 * capacity];

    COUNTING.with(|c| c.set(true));
    let result = template.plan_into(&Request::pages(&src, &dst), |_| {
        Ok(Columns::from_flat(&mut storage, capacity))
    });
    COUNTING.with(|c| c.set(false));

    assert_eq!(result.unwrap().1.n_blocks, capacity);
    assert_eq!(ALLOCATIONS.load(Relaxed), 0, "plan_into allocated");
}

#[test]
fn token_plan_into_never_allocates() {
    // Prefill pages of 16 tokens, decode pages of 64, fragmented on both sides.
    let layers = 61usize;
    let layout = |page_size: u64, base: u64| {
        let ptrs: Vec<u64> = (0..layers as u64).map(|l| base * (l + 1)).collect();
        let context = LayoutContext {
            page_size,
            ..LayoutContext::default()
        };
        let item = 1152 * page_size;
        Layout::mla(
            ptrs,
            vec![item * 4096; layers],
            vec![item; layers],
            Some((0..layers as i64).collect()),
            context,
        )
        .unwrap()
    };
    let template = Template::new(
        &layout(16, 0x1_0000_0000),
        &layout(64, 0x100_0000_0000),
        TemplateOptions::default(),
    )
    .unwrap();
    let src: Vec<i32> = (0..2048).rev().collect();
    let dst: Vec<i64> = (0..512).map(|p| 2 * p).collect();
    let capacity = 2048 * layers;
    let mut storage = vec![0u64; 3 * capacity];

    COUNTING.with(|c| c.set(true));
    let result = template.plan_into(&Request::tokens(&src, &dst, 32_000), |_| {
        Ok(Columns::from_flat(&mut storage, capacity))
    });
    COUNTING.with(|c| c.set(false));

    assert_eq!(result.unwrap().1.n_blocks, 2000 * layers);
    assert_eq!(ALLOCATIONS.load(Relaxed), 0, "a token plan_into allocated");
}

#[test]
fn fused_token_batch_allocates_nothing_per_block() {
    // Two token requests whose pages continue each other on both sides (prefill pages of 16
    // tokens, decode pages of 64, every other page on both sides): one segment whose boundary
    // blocks merge. Validation keeps a few values per request and per piece; the blocks are
    // written straight into the caller's output, with no scratch columns of a request's size.
    let layers = 61usize;
    let layout = |page_size: u64, base: u64| {
        let ptrs: Vec<u64> = (0..layers as u64).map(|l| base * (l + 1)).collect();
        let context = LayoutContext {
            page_size,
            ..LayoutContext::default()
        };
        let item = 1152 * page_size;
        Layout::mla(
            ptrs,
            vec![item * 4096; layers],
            vec![item; layers],
            Some((0..layers as i64).collect()),
            context,
        )
        .unwrap()
    };
    let template = Template::new(
        &layout(16, 0x1_0000_0000),
        &layout(64, 0x100_0000_0000),
        TemplateOptions::default(),
    )
    .unwrap();
    let dst_pages = 200i64;
    let src_pages = 4 * dst_pages;
    let every_other = |from: i64, n: i64| (0..n).map(|p| from + 2 * p).collect::<Vec<i64>>();
    let (src_a, dst_a) = (every_other(0, src_pages), every_other(0, dst_pages));
    let src_b = every_other(2 * src_pages - 1, src_pages);
    let dst_b = every_other(2 * dst_pages - 1, dst_pages);
    let n_tokens = 64 * dst_pages as u64;
    let requests = [
        Request::tokens(&src_a, &dst_a, n_tokens),
        Request::tokens(&src_b, &dst_b, n_tokens),
    ];
    let per_request = src_pages as usize * layers;
    let capacity = 2 * per_request;
    let mut storage = vec![0u64; 3 * capacity];

    MEASURED.with(|m| m.set(Some(0)));
    let result = template.batch().plan_into(&requests, |_| {
        Ok(Columns::from_flat(&mut storage, capacity))
    });
    let allocated = MEASURED.with(|m| m.replace(None)).unwrap_or(0);

    let summary = result.unwrap().1;
    assert_eq!(summary.n_segments(), 1);
    assert_ne!(summary.merged_classes(1), 0);
    assert_eq!(summary.n_blocks, capacity - layers);
    // One request's blocks as scratch columns would be 24 bytes a block.
    assert!(
        allocated < 64 * 1024,
        "planning a fused token batch allocated {allocated} bytes for {per_request} blocks a request"
    );
}
