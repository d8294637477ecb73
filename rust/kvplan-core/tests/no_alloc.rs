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
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        if COUNTING.try_with(Cell::get).unwrap_or(false) {
            ALLOCATIONS.fetch_add(1, Relaxed);
        }
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
