//! `Template::plan_into` allocates nothing: the output is the caller's. Only allocations made
//! by this test's own thread while the flag is up are counted (the harness allocates from its
//! own threads, e.g. for output capture).

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
    let result = template.plan_into(&src, &dst, |_| {
        Ok(Columns::from_flat(&mut storage, capacity))
    });
    COUNTING.with(|c| c.set(false));

    assert_eq!(result.unwrap().1.n_blocks, capacity);
    assert_eq!(ALLOCATIONS.load(Relaxed), 0, "plan_into allocated");
}
