//! Version 3 of the ABI: a layout with pools of their own (`kvplan_layout_new3`) and a request
//! giving each pool's pages and token range (`kvplan_prepare3`, `kvplan_plan_into3`) plan the
//! blocks the core plans for the same layouts and request; a version 2 window pool and its
//! version 3 pool table plan alike; bad pools are a status with a message, nothing written.

use std::ffi::CStr;
use std::ptr::{null, null_mut};

use kvplan_capi::{
    KVPLAN_NO_SLOT, KVPLAN_POOL_DST, KVPLAN_POOL_SRC, KVPLAN_WINDOW_DST, KVPLAN_WINDOW_SRC,
    KvplanLayout, KvplanLayoutDesc, KvplanLayoutDesc2, KvplanLayoutDesc3, KvplanPlanInfo,
    KvplanPool, KvplanPoolPages, KvplanPoolTokens, KvplanRequest2, KvplanRequest3, KvplanStatus,
    KvplanTemplate, kvplan_last_error_message, kvplan_layout_free, kvplan_layout_new2,
    kvplan_layout_new3, kvplan_plan_into2, kvplan_plan_into3, kvplan_template_free,
    kvplan_template_new,
};
use kvplan_core::{Layout, LayoutContext, PoolId, Request, Template, TemplateOptions};

const TOKEN: u64 = 16;
const ROW: u64 = 24;
const CAPACITY: u64 = 32;

fn last_message() -> String {
    // SAFETY: the library returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(kvplan_last_error_message()) }
        .to_str()
        .unwrap()
        .to_owned()
}

/// One side: two entries on 4-token pages, then two per pool `(page size, tokens per row)`.
struct Side {
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    items: Vec<u64>,
    ids: Vec<i64>,
    pools: Vec<KvplanPool>,
    entry_pools: Vec<u8>,
}

impl Side {
    fn new(base: u64, pools: &[(u64, u64)]) -> Self {
        let mut items = vec![4 * TOKEN; 2];
        let mut entry_pools = vec![0u8; 2];
        for (k, &(page, per_row)) in pools.iter().enumerate() {
            items.extend([page / per_row * ROW; 2]);
            entry_pools.extend([k as u8 + 1; 2]);
        }
        let n = items.len();
        Self {
            ptrs: (0..n as u64).map(|k| base + (k << 32)).collect(),
            lens: items.iter().map(|i| i * CAPACITY).collect(),
            items,
            ids: (0..n as i64).collect(),
            pools: pools
                .iter()
                .map(|&(page_size, tokens_per_row)| KvplanPool {
                    page_size,
                    tokens_per_row,
                })
                .collect(),
            entry_pools,
        }
    }

    fn base(&self) -> KvplanLayoutDesc {
        KvplanLayoutDesc {
            n_entries: self.items.len(),
            data_ptrs: self.ptrs.as_ptr(),
            data_lens: self.lens.as_ptr(),
            item_lens: self.items.as_ptr(),
            strides: null(),
            layer_ids: self.ids.as_ptr(),
            roles: null(),
            kinds: null(),
            page_size: 4,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            attention: null(),
        }
    }

    fn desc3(&self, windows: Option<&[u64]>) -> KvplanLayoutDesc3 {
        KvplanLayoutDesc3 {
            struct_size: size_of::<KvplanLayoutDesc3>(),
            base: self.base(),
            windows: windows.map_or(null(), <[u64]>::as_ptr),
            rings: null(),
            pools: self.pools.as_ptr(),
            n_pools: self.pools.len(),
            entry_pools: self.entry_pools.as_ptr(),
        }
    }

    fn core(&self) -> Layout {
        let ctx = LayoutContext {
            page_size: 4,
            ..LayoutContext::default()
        };
        let mut layout = Layout::mla(
            self.ptrs.clone(),
            self.lens.clone(),
            self.items.clone(),
            Some(self.ids.clone()),
            ctx,
        )
        .unwrap();
        for (k, pool) in self.pools.iter().enumerate() {
            layout = layout
                .with_pool(&[2 + 2 * k, 3 + 2 * k], pool.page_size, pool.tokens_per_row)
                .unwrap();
        }
        layout
    }
}

fn new3(desc: &KvplanLayoutDesc3) -> Result<*mut KvplanLayout, (KvplanStatus, String)> {
    let mut out: *mut KvplanLayout = null_mut();
    // SAFETY: a valid descriptor whose arrays hold as many values as it says; `out` writable.
    match unsafe { kvplan_layout_new3(desc, &raw mut out) } {
        KvplanStatus::Ok => Ok(out),
        status => {
            assert!(out.is_null());
            Err((status, last_message()))
        }
    }
}

fn template(src: *mut KvplanLayout, dst: *mut KvplanLayout) -> *mut KvplanTemplate {
    let mut out: *mut KvplanTemplate = null_mut();
    // SAFETY: live handles, default options, `out` writable.
    let status = unsafe { kvplan_template_new(src, dst, null(), &raw mut out) };
    assert_eq!(status, KvplanStatus::Ok, "{}", last_message());
    assert_eq!(kvplan_layout_free(src), KvplanStatus::Ok);
    assert_eq!(kvplan_layout_free(dst), KvplanStatus::Ok);
    out
}

type Blocks = [Vec<u64>; 3];

/// `kvplan_plan_into3` of `request` into columns of `capacity` values.
fn plan3(
    t: *const KvplanTemplate,
    request: &KvplanRequest3,
    capacity: usize,
) -> Result<Blocks, (KvplanStatus, String)> {
    let mut cols = [vec![0u64; capacity], vec![0; capacity], vec![0; capacity]];
    let mut info = KvplanPlanInfo {
        n_blocks: 0,
        total_bytes: 0,
        n_runs: 0,
        n_pages: 0,
        skip_tokens: 0,
    };
    let [a, b, c] = &mut cols;
    // SAFETY: a live template, a valid request, three disjoint columns of `capacity` values.
    let status = unsafe {
        kvplan_plan_into3(
            t,
            request,
            a.as_mut_ptr(),
            b.as_mut_ptr(),
            c.as_mut_ptr(),
            capacity,
            &raw mut info,
        )
    };
    if status != KvplanStatus::Ok {
        return Err((status, last_message()));
    }
    for col in &mut cols {
        col.truncate(info.n_blocks);
    }
    Ok(cols)
}

fn request3<'a>(
    pages: (&'a [i64], &'a [i64]),
    n_tokens: i64,
    pool_pages: &'a [KvplanPoolPages],
    pool_tokens: &'a [KvplanPoolTokens],
) -> KvplanRequest3 {
    KvplanRequest3 {
        struct_size: size_of::<KvplanRequest3>(),
        src_pages: pages.0.as_ptr(),
        n_src: pages.0.len(),
        dst_pages: pages.1.as_ptr(),
        n_dst: pages.1.len(),
        n_tokens,
        skip_tokens: 0,
        src_slot: KVPLAN_NO_SLOT,
        dst_slot: KVPLAN_NO_SLOT,
        pool_pages: pool_pages.as_ptr(),
        n_pool_pages: pool_pages.len(),
        pool_tokens: pool_tokens.as_ptr(),
        n_pool_tokens: pool_tokens.len(),
    }
}

fn both(pool: u32, src: &[i64], dst: &[i64]) -> KvplanPoolPages {
    KvplanPoolPages {
        pool,
        sides: KVPLAN_POOL_SRC | KVPLAN_POOL_DST,
        src_pages: src.as_ptr(),
        n_src: src.len(),
        dst_pages: dst.as_ptr(),
        n_dst: dst.len(),
    }
}

#[test]
fn a_pooled_request_plans_the_cores_blocks() {
    let (src, dst) = (
        Side::new(1 << 44, &[(8, 4), (4, 1)]),
        Side::new(2 << 44, &[(16, 4), (2, 1)]),
    );
    let t = template(
        new3(&src.desc3(None)).unwrap(),
        new3(&dst.desc3(None)).unwrap(),
    );
    let core = Template::new(&src.core(), &dst.core(), TemplateOptions::default()).unwrap();
    let pages: (Vec<i64>, Vec<i64>) = ((0..5).collect(), (10..15).collect());
    let (p1s, p1d): (Vec<i64>, Vec<i64>) = (vec![3, 1, 2], vec![7, 5]);
    let (p2s, p2d): (Vec<i64>, Vec<i64>) = ((20..25).collect(), (0..10).collect());
    let pool_pages = [both(1, &p1s, &p1d), both(2, &p2s, &p2d)];
    let pool_tokens = [KvplanPoolTokens {
        pool: 2,
        n_tokens: 18,
        skip_tokens: 6,
    }];
    let request = request3((&pages.0, &pages.1), 20, &pool_pages, &pool_tokens);
    let got = plan3(t, &request, 256).unwrap();
    let expected = core
        .plan(
            &Request::tokens(&pages.0, &pages.1, 20)
                .with_pool_pages(PoolId(1), Some(&p1s[..]), Some(&p1d[..]))
                .with_pool_pages(PoolId(2), Some(&p2s[..]), Some(&p2d[..]))
                .with_pool_tokens(PoolId(2), 18, 6),
        )
        .unwrap();
    assert!(!got[0].is_empty());
    assert_eq!(
        got,
        [expected.src_addrs, expected.dst_addrs, expected.lengths]
    );
    assert_eq!(kvplan_template_free(t), KvplanStatus::Ok);
}

#[test]
fn a_window_pool_as_a_pool_table_plans_as_version_2_does() {
    // Entries 2 and 3 keep 8-token windows in a pool of 2-token pages.
    let side = |base| Side::new(base, &[(2, 1)]);
    let (src, dst) = (side(1 << 44), side(2 << 44));
    let windows = [0, 0, 8, 8];
    let t3 = template(
        new3(&src.desc3(Some(&windows))).unwrap(),
        new3(&dst.desc3(Some(&windows))).unwrap(),
    );
    let new2 = |s: &Side| {
        let desc = KvplanLayoutDesc2 {
            struct_size: size_of::<KvplanLayoutDesc2>(),
            base: s.base(),
            windows: windows.as_ptr(),
            window_page_size: 2,
            rings: null(),
        };
        let mut out: *mut KvplanLayout = null_mut();
        // SAFETY: a valid descriptor; `out` writable.
        assert_eq!(
            unsafe { kvplan_layout_new2(&raw const desc, &raw mut out) },
            KvplanStatus::Ok
        );
        out
    };
    let t2 = template(new2(&src), new2(&dst));
    let pages: (Vec<i64>, Vec<i64>) = ((0..6).collect(), (6..12).collect());
    let window: (Vec<i64>, Vec<i64>) = ((0..12).collect(), (12..24).collect());
    let pool_pages = [both(1, &window.0, &window.1)];
    let got3 = plan3(
        t3,
        &request3((&pages.0, &pages.1), 22, &pool_pages, &[]),
        256,
    )
    .unwrap();
    let request2 = KvplanRequest2 {
        struct_size: size_of::<KvplanRequest2>(),
        src_pages: pages.0.as_ptr(),
        n_src: 6,
        dst_pages: pages.1.as_ptr(),
        n_dst: 6,
        n_tokens: 22,
        skip_tokens: 0,
        src_slot: KVPLAN_NO_SLOT,
        dst_slot: KVPLAN_NO_SLOT,
        window_sides: KVPLAN_WINDOW_SRC | KVPLAN_WINDOW_DST,
        src_window_pages: window.0.as_ptr(),
        n_src_window: 12,
        dst_window_pages: window.1.as_ptr(),
        n_dst_window: 12,
    };
    let mut cols = [vec![0u64; 256], vec![0; 256], vec![0; 256]];
    let [a, b, c] = &mut cols;
    // SAFETY: a live template, a valid request, three disjoint columns of 256 values.
    let status = unsafe {
        kvplan_plan_into2(
            t2,
            &raw const request2,
            a.as_mut_ptr(),
            b.as_mut_ptr(),
            c.as_mut_ptr(),
            256,
            null_mut(),
        )
    };
    assert_eq!(status, KvplanStatus::Ok, "{}", last_message());
    for col in &mut cols {
        col.truncate(got3[0].len());
    }
    assert!(!got3[0].is_empty());
    assert_eq!(got3, cols);
    assert_eq!(kvplan_template_free(t2), KvplanStatus::Ok);
    assert_eq!(kvplan_template_free(t3), KvplanStatus::Ok);
}

#[test]
fn bad_pools_are_a_status_and_a_message() {
    let side = Side::new(1 << 44, &[(8, 4)]);
    // An entry in a pool the table does not hold.
    let mut bad = Side::new(1 << 44, &[(8, 4)]);
    bad.entry_pools[1] = 2;
    let (status, message) = new3(&bad.desc3(None)).unwrap_err();
    assert_eq!(status, KvplanStatus::InvalidArgument);
    assert!(
        message.contains("entry_pools[1] is 2, but the layout keeps 1 pools"),
        "{message}"
    );
    // A pool of 0 tokens per row: the core's layout check names the pool and values.
    bad = Side::new(1 << 44, &[(8, 4)]);
    bad.pools[0].tokens_per_row = 0;
    let (status, message) = new3(&bad.desc3(None)).unwrap_err();
    assert_eq!(status, KvplanStatus::Layout);
    assert!(message.contains("pool 1: page_size and tokens_per_row must be at least 1"));
    // Too few pages of a pool: nothing written, the message names the pool and side.
    let t = template(
        new3(&side.desc3(None)).unwrap(),
        new3(&Side::new(2 << 44, &[(8, 4)]).desc3(None)).unwrap(),
    );
    let pages: Vec<i64> = (0..4).collect();
    let short = [both(1, &pages[..1], &pages[..2])];
    let (_, message) = plan3(t, &request3((&pages, &pages), 16, &short, &[]), 64).unwrap_err();
    assert!(
        message.contains("n_tokens 16 needs 2 src pool 1 pages of 8 tokens, but 1 were given"),
        "{message}"
    );
    // A pool id outside 1 to 7, and a pool given twice.
    for (pool, what) in [
        (0, "pool_pages[0].pool is 0"),
        (8, "pool_pages[0].pool is 8"),
    ] {
        let given = [both(pool, &pages[..2], &pages[..2])];
        let (status, message) =
            plan3(t, &request3((&pages, &pages), 16, &given, &[]), 64).unwrap_err();
        assert_eq!(status, KvplanStatus::InvalidArgument);
        assert!(message.contains(what), "{message}");
    }
    let twice = [
        both(1, &pages[..2], &pages[..2]),
        both(1, &pages[..2], &pages[..2]),
    ];
    let (_, message) = plan3(t, &request3((&pages, &pages), 16, &twice, &[]), 64).unwrap_err();
    assert!(
        message.contains("pool_pages gives pool 1 twice"),
        "{message}"
    );
    // A column over a pool's pages.
    let given = [both(1, &pages[..2], &pages[..2])];
    let request = request3((&pages, &pages), 16, &given, &[]);
    let mut cols = [vec![0u64; 64], vec![0; 64]];
    let [b, c] = &mut cols;
    // SAFETY: a live template and a valid request; the first column is the request's own pool
    // page array (refused before anything is written).
    let status = unsafe {
        kvplan_plan_into3(
            t,
            &raw const request,
            pages.as_ptr().cast_mut().cast(),
            b.as_mut_ptr(),
            c.as_mut_ptr(),
            2,
            null_mut(),
        )
    };
    assert_eq!(status, KvplanStatus::InvalidArgument);
    assert!(last_message().contains("overlap"), "{}", last_message());
    assert_eq!(pages, (0..4).collect::<Vec<i64>>());
    assert_eq!(kvplan_template_free(t), KvplanStatus::Ok);
}
