//! Version 4 of the ABI: a layout whose state entries declare a TP channel split
//! (`kvplan_layout_new4`) plans, between prefill and decode TP sizes, the blocks the core plans
//! for the same layouts (`Layout::with_state_channels`); a descriptor without splits plans as
//! version 3 does; bad splits are a status with a message naming the values, no handle made.

use std::ffi::{CStr, CString, c_char};
use std::ptr::{null, null_mut};

use kvplan_capi::{
    KVPLAN_ENTRY_PAGE, KVPLAN_ENTRY_STATE, KVPLAN_MAX_SHARD_GROUPS, KVPLAN_NO_SLOT,
    KVPLAN_NO_STATE_SPLIT, KVPLAN_NO_TOKENS, KvplanLayout, KvplanLayoutDesc, KvplanLayoutDesc3,
    KvplanLayoutDesc4, KvplanPlanInfo, KvplanRequest2, KvplanStatus, KvplanTemplate,
    kvplan_last_error_message, kvplan_layout_free, kvplan_layout_new3, kvplan_layout_new4,
    kvplan_plan_into2, kvplan_template_free, kvplan_template_new,
};
use kvplan_core::{
    Layout, LayoutContext, MAX_SHARD_GROUPS, Request, StateChannels, Template, TemplateOptions,
};

const SLOTS: u64 = 4;
const PAGE_ITEM: u64 = 64;
const PAGES: u64 = 16;
/// Bytes of the replicated entry's slot.
const REPLICATED: u64 = 40;

fn last_message() -> String {
    // SAFETY: the library returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(kvplan_last_error_message()) }
        .to_str()
        .unwrap()
        .to_owned()
}

/// One hybrid peer at TP `tp`: a KV page entry, then three state entries of layer 0: a conv
/// state of q|k|v sub-blocks (8, 8, 16 channels of 2 bytes) in 3 rows, a temporal state of 8
/// heads of 64 bytes in 1 row, and a replicated slot of `REPLICATED` bytes.
struct Side {
    tp: u32,
    rank: u32,
    ptrs: Vec<u64>,
    lens: Vec<u64>,
    items: Vec<u64>,
    ids: Vec<i64>,
    /// The strings `role_ptrs` points to, kept alive with it.
    _roles: Vec<CString>,
    role_ptrs: Vec<*const c_char>,
    kinds: Vec<u8>,
    channels: Vec<u64>,
    rows: Vec<u64>,
    counts: Vec<u8>,
    groups: Vec<u64>,
}

impl Side {
    fn new(base: u64, tp: u32, rank: u32) -> Self {
        let t = u64::from(tp);
        let (conv, temporal) = (3 * (32 / t) * 2, 8 / t * 64);
        let items = vec![PAGE_ITEM, conv, temporal, REPLICATED];
        let roles: Vec<CString> = ["kv", "mamba", "mamba", "mamba"]
            .into_iter()
            .map(|r| CString::new(r).unwrap())
            .collect();
        Self {
            tp,
            rank,
            ptrs: (0..4).map(|k| base + (k << 32)).collect(),
            lens: vec![
                PAGE_ITEM * PAGES,
                conv * SLOTS,
                temporal * SLOTS,
                REPLICATED * SLOTS,
            ],
            items,
            ids: vec![0; 4],
            role_ptrs: roles.iter().map(|r| r.as_ptr()).collect(),
            _roles: roles,
            kinds: vec![
                KVPLAN_ENTRY_PAGE,
                KVPLAN_ENTRY_STATE,
                KVPLAN_ENTRY_STATE,
                KVPLAN_ENTRY_STATE,
            ],
            channels: vec![KVPLAN_NO_STATE_SPLIT, 32 / t, 8 / t, 0],
            rows: vec![0, 3, 1, 1],
            counts: vec![0, 3, 0, 0],
            groups: vec![8, 8, 16],
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
            roles: self.role_ptrs.as_ptr(),
            kinds: self.kinds.as_ptr(),
            page_size: 16,
            tp_rank: self.rank,
            tp_size: self.tp,
            pp_rank: 0,
            pp_size: 1,
            attention: null(),
        }
    }

    fn desc4(&self) -> KvplanLayoutDesc4 {
        KvplanLayoutDesc4 {
            struct_size: size_of::<KvplanLayoutDesc4>(),
            base: self.base(),
            windows: null(),
            rings: null(),
            pools: null(),
            n_pools: 0,
            entry_pools: null(),
            state_channels: self.channels.as_ptr(),
            state_outer_rows: self.rows.as_ptr(),
            shard_group_counts: self.counts.as_ptr(),
            shard_groups: self.groups.as_ptr(),
            n_shard_groups: self.groups.len(),
        }
    }

    /// The same layout built by the core, as `kvplan.Layout.with_state(channels=, ...)` does.
    fn core(&self) -> Layout {
        let context = LayoutContext {
            page_size: 16,
            tp_size: self.tp,
            tp_rank: self.rank,
            ..LayoutContext::default()
        };
        let t = u64::from(self.tp);
        Layout::mla(
            vec![self.ptrs[0]],
            vec![self.lens[0]],
            vec![self.items[0]],
            Some(vec![0]),
            context,
        )
        .unwrap()
        .with_state(
            "mamba",
            self.ptrs[1..].to_vec(),
            self.lens[1..].to_vec(),
            self.items[1..].to_vec(),
            vec![0; 3],
        )
        .unwrap()
        .with_state_channels(vec![
            None,
            Some(StateChannels::new(32 / t, 3, &[8, 8, 16]).unwrap()),
            Some(StateChannels::new(8 / t, 1, &[]).unwrap()),
            Some(StateChannels::new(0, 1, &[]).unwrap()),
        ])
        .unwrap()
    }
}

fn new4(desc: &KvplanLayoutDesc4) -> Result<*mut KvplanLayout, (KvplanStatus, String)> {
    let mut out: *mut KvplanLayout = null_mut();
    // SAFETY: a descriptor whose arrays hold as many values as it says; `out` writable.
    match unsafe { kvplan_layout_new4(desc, &raw mut out) } {
        KvplanStatus::Ok => Ok(out),
        status => {
            assert!(out.is_null());
            Err((status, last_message()))
        }
    }
}

fn template(
    src: *mut KvplanLayout,
    dst: *mut KvplanLayout,
) -> Result<*mut KvplanTemplate, (KvplanStatus, String)> {
    let mut out: *mut KvplanTemplate = null_mut();
    // SAFETY: live handles, default options, `out` writable.
    let status = unsafe { kvplan_template_new(src, dst, null(), &raw mut out) };
    assert_eq!(kvplan_layout_free(src), KvplanStatus::Ok);
    assert_eq!(kvplan_layout_free(dst), KvplanStatus::Ok);
    match status {
        KvplanStatus::Ok => Ok(out),
        status => Err((status, last_message())),
    }
}

type Blocks = [Vec<u64>; 3];

/// `kvplan_plan_into2` of a request of `pages` (may be empty) and slot `src_slot` ->
/// `dst_slot`.
fn plan2(t: *const KvplanTemplate, pages: (&[i64], &[i64]), slots: (i64, i64)) -> Blocks {
    let request = KvplanRequest2 {
        struct_size: size_of::<KvplanRequest2>(),
        src_pages: pages.0.as_ptr(),
        n_src: pages.0.len(),
        dst_pages: pages.1.as_ptr(),
        n_dst: pages.1.len(),
        n_tokens: KVPLAN_NO_TOKENS,
        skip_tokens: 0,
        src_slot: slots.0,
        dst_slot: slots.1,
        window_sides: 0,
        src_window_pages: null(),
        n_src_window: 0,
        dst_window_pages: null(),
        n_dst_window: 0,
    };
    let capacity = 128;
    let mut cols = [vec![0u64; capacity], vec![0; capacity], vec![0; capacity]];
    let mut info = KvplanPlanInfo::default();
    let [a, b, c] = &mut cols;
    // SAFETY: a live template, a valid request, three disjoint columns of `capacity` values.
    let status = unsafe {
        kvplan_plan_into2(
            t,
            &raw const request,
            a.as_mut_ptr(),
            b.as_mut_ptr(),
            c.as_mut_ptr(),
            capacity,
            &raw mut info,
        )
    };
    assert_eq!(status, KvplanStatus::Ok, "{}", last_message());
    for col in &mut cols {
        col.truncate(info.n_blocks);
    }
    cols
}

#[test]
fn split_state_plans_the_cores_blocks_between_tp_sizes() {
    // (prefill TP, rank) -> (decode TP, rank): TP 1 to each rank of TP 2, each rank of TP 2 to
    // TP 1, and equal TP sizes.
    let cases = [
        ((1, 0), (2, 0)),
        ((1, 0), (2, 1)),
        ((2, 0), (1, 0)),
        ((2, 1), (1, 0)),
        ((2, 1), (2, 1)),
    ];
    for ((tp_p, r_p), (tp_d, r_d)) in cases {
        let (src, dst) = (Side::new(1 << 44, tp_p, r_p), Side::new(2 << 44, tp_d, r_d));
        let t = template(new4(&src.desc4()).unwrap(), new4(&dst.desc4()).unwrap()).unwrap();
        let core = Template::new(&src.core(), &dst.core(), TemplateOptions::default()).unwrap();
        let case = format!("TP {tp_p} rank {r_p} -> TP {tp_d} rank {r_d}");

        let got = plan2(t, (&[], &[]), (2, 1));
        let want = core.plan(&Request::slot(2, 1)).unwrap();
        assert_eq!(
            got,
            [want.src_addrs, want.dst_addrs, want.lengths],
            "{case}"
        );
        // The conv state moves a slice per (row, sub-block) overlap between TP sizes.
        let conv_blocks = got[0].iter().filter(|&&a| (a >> 32) & 0xfff == 1).count();
        assert_eq!(conv_blocks, if tp_p == tp_d { 1 } else { 9 }, "{case}");
        // The replicated slot moves whole, from the one elected prefill rank only.
        let replicated: Vec<u64> = (0..got[0].len())
            .filter(|&k| (got[0][k] >> 32) & 0xfff == 3)
            .map(|k| got[2][k])
            .collect();
        let elected = r_p == r_d * tp_p / tp_d;
        assert_eq!(
            replicated,
            if elected { vec![REPLICATED] } else { vec![] },
            "{case}"
        );

        // Pages with the slots: the page plan, then the same split state plan.
        let (sp, dp) = ([0i64, 3, 5], [7i64, 1, 2]);
        let got = plan2(t, (&sp, &dp), (2, 1));
        let want = core
            .plan(&Request::pages(&sp, &dp).with_state_slot(2, 1))
            .unwrap();
        assert_eq!(
            got,
            [want.src_addrs, want.dst_addrs, want.lengths],
            "{case}"
        );
        assert_eq!(kvplan_template_free(t), KvplanStatus::Ok);
    }
}

#[test]
fn a_descriptor_without_splits_plans_as_version_3() {
    let side = |base| {
        let mut s = Side::new(base, 1, 0);
        s.channels.clear();
        s
    };
    let (src, dst) = (side(1 << 44), side(2 << 44));
    let unsplit = |s: &Side| KvplanLayoutDesc4 {
        state_channels: null(),
        state_outer_rows: null(),
        shard_group_counts: null(),
        shard_groups: null(),
        n_shard_groups: 0,
        ..s.desc4()
    };
    let v3 = |s: &Side| {
        let desc = KvplanLayoutDesc3 {
            struct_size: size_of::<KvplanLayoutDesc3>(),
            base: s.base(),
            windows: null(),
            rings: null(),
            pools: null(),
            n_pools: 0,
            entry_pools: null(),
        };
        let mut out: *mut KvplanLayout = null_mut();
        // SAFETY: a valid descriptor; `out` writable.
        let status = unsafe { kvplan_layout_new3(&raw const desc, &raw mut out) };
        assert_eq!(status, KvplanStatus::Ok, "{}", last_message());
        out
    };
    let t4 = template(new4(&unsplit(&src)).unwrap(), new4(&unsplit(&dst)).unwrap()).unwrap();
    let t3 = template(v3(&src), v3(&dst)).unwrap();
    let pages = ([0i64, 3], [2i64, 1]);
    let got = plan2(t4, (&pages.0, &pages.1), (1, 2));
    assert_eq!(got, plan2(t3, (&pages.0, &pages.1), (1, 2)));
    // One block per entry: two pages, three whole slots.
    assert_eq!(got[2], vec![PAGE_ITEM, PAGE_ITEM, 192, 512, REPLICATED]);
    assert_eq!(kvplan_template_free(t4), KvplanStatus::Ok);
    assert_eq!(kvplan_template_free(t3), KvplanStatus::Ok);
}

#[test]
fn the_most_shard_groups_is_the_cores() {
    assert_eq!(usize::from(KVPLAN_MAX_SHARD_GROUPS), MAX_SHARD_GROUPS);
}

/// A change to a TP 1 side and its descriptor.
type Edit = Box<dyn FnOnce(&mut Side, &mut KvplanLayoutDesc4)>;

/// `kvplan_layout_new4` of a TP 1 side changed by `edit`: its status and message.
fn refused(edit: impl FnOnce(&mut Side, &mut KvplanLayoutDesc4)) -> (KvplanStatus, String) {
    let mut side = Side::new(1 << 44, 1, 0);
    let mut desc = side.desc4();
    edit(&mut side, &mut desc);
    new4(&desc).expect_err("refused")
}

#[test]
fn bad_splits_are_refused_naming_the_values() {
    let cases: Vec<(Edit, KvplanStatus, &[&str])> = vec![
        // Channels out of range: 7 channels in 3 rows do not divide the conv item (192 bytes).
        (
            Box::new(|s, d| {
                s.channels[1] = 7;
                d.state_channels = s.channels.as_ptr();
            }),
            KvplanStatus::Layout,
            &["entry 1", "192", "3 rows of 7 channels"],
        ),
        // Shard groups that do not sum to channels x TP size.
        (
            Box::new(|s, d| {
                s.groups = vec![8, 8, 8];
                d.shard_groups = s.groups.as_ptr();
            }),
            KvplanStatus::Layout,
            &["[8, 8, 8]", "24", "32"],
        ),
        // More shard groups than the core keeps.
        (
            Box::new(|s, d| {
                s.counts[1] = 5;
                s.groups = vec![8, 8, 8, 4, 4];
                d.shard_group_counts = s.counts.as_ptr();
                d.shard_groups = s.groups.as_ptr();
                d.n_shard_groups = 5;
            }),
            KvplanStatus::Layout,
            &["entry 1", "at most 4 shard groups, got 5"],
        ),
        // 0 rows.
        (
            Box::new(|s, d| {
                s.rows[1] = 0;
                d.state_outer_rows = s.rows.as_ptr();
            }),
            KvplanStatus::Layout,
            &[
                "entry 1",
                "state_channels[1] = 32",
                "at least 1 outer row, got 0",
            ],
        ),
        // A split on a page entry.
        (
            Box::new(|s, d| {
                s.channels[0] = 1;
                s.rows[0] = 1;
                d.state_channels = s.channels.as_ptr();
                d.state_outer_rows = s.rows.as_ptr();
            }),
            KvplanStatus::Layout,
            &["entry 0", "applies to state entries"],
        ),
        // A null array with a non-zero count.
        (
            Box::new(|_, d| d.shard_groups = null()),
            KvplanStatus::NullPointer,
            &["shard_groups is null but its length is 3"],
        ),
        // Counts and values of unequal lengths.
        (
            Box::new(|_, d| d.n_shard_groups = 2),
            KvplanStatus::InvalidArgument,
            &["shard_group_counts sum to 3 shard groups, but n_shard_groups is 2"],
        ),
        (
            Box::new(|_, d| d.shard_group_counts = null()),
            KvplanStatus::InvalidArgument,
            &["shard_group_counts is null: it gives 0 shard groups, but n_shard_groups is 3"],
        ),
        // Rows or groups without channels, or on an entry without a split.
        (
            Box::new(|_, d| d.state_channels = null()),
            KvplanStatus::InvalidArgument,
            &["state_outer_rows is not null, but state_channels is null"],
        ),
        (
            Box::new(|s, d| {
                s.rows[0] = 1;
                d.state_outer_rows = s.rows.as_ptr();
            }),
            KvplanStatus::InvalidArgument,
            &["state_outer_rows[0] is 1", "KVPLAN_NO_STATE_SPLIT"],
        ),
        (
            Box::new(|s, d| {
                s.counts = vec![1, 2, 0, 0];
                d.shard_group_counts = s.counts.as_ptr();
            }),
            KvplanStatus::InvalidArgument,
            &[
                "shard_group_counts[0] is 1 (groups [8])",
                "KVPLAN_NO_STATE_SPLIT",
            ],
        ),
        // A version 3 descriptor's size.
        (
            Box::new(|_, d| d.struct_size = size_of::<KvplanLayoutDesc3>()),
            KvplanStatus::InvalidArgument,
            &["struct_size"],
        ),
    ];
    for (k, (edit, status, words)) in cases.into_iter().enumerate() {
        let (got, message) = refused(edit);
        assert_eq!(got, status, "case {k}: {message}");
        for word in words {
            assert!(
                message.contains(word),
                "case {k}: {word:?} not in {message:?}"
            );
        }
    }
}

#[test]
fn sides_that_split_differently_are_refused_at_the_template() {
    let src = Side::new(1 << 44, 1, 0);
    let mut dst = Side::new(2 << 44, 2, 0);
    // The decode's conv state in 2 rows of 16 channels of 2 bytes: other rows than the
    // prefill's 3.
    dst.rows[1] = 2;
    dst.items[1] = 2 * 16 * 2;
    dst.lens[1] = 2 * 16 * 2 * SLOTS;
    let (status, message) =
        template(new4(&src.desc4()).unwrap(), new4(&dst.desc4()).unwrap()).unwrap_err();
    assert_eq!(status, KvplanStatus::HeadSlicing, "{message}");
    assert!(message.contains("outer rows"), "{message}");
    assert!(message.contains('3') && message.contains('2'), "{message}");
}

#[test]
fn a_slot_request_without_slots_moves_no_state() {
    // Sanity of the helper: a page request on a split template plans only the pages.
    let (src, dst) = (Side::new(1 << 44, 1, 0), Side::new(2 << 44, 2, 1));
    let t = template(new4(&src.desc4()).unwrap(), new4(&dst.desc4()).unwrap()).unwrap();
    let got = plan2(t, (&[0, 3], &[4, 1]), (KVPLAN_NO_SLOT, KVPLAN_NO_SLOT));
    assert_eq!(got[2], vec![PAGE_ITEM, PAGE_ITEM]);
    assert_eq!(kvplan_template_free(t), KvplanStatus::Ok);
}
