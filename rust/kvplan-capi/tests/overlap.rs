//! Outputs that overlap an input are refused before anything is written (found by the ctypes
//! fuzz target, tests/robustness/test_capi_fuzz.py): the plan's info placed inside the request
//! struct or inside a column, the prepared info inside the request, a layout handle written
//! over its own descriptor. Each call returns `KVPLAN_STATUS_INVALID_ARGUMENT` naming both
//! arguments, and every input is left as it was.

use std::ffi::CStr;
use std::ptr::{null, null_mut};

use kvplan_capi::{
    KVPLAN_NO_TOKENS, KvplanLayout, KvplanLayoutDesc, KvplanPlanInfo, KvplanRequest, KvplanStatus,
    KvplanTemplate, kvplan_last_error_message, kvplan_layout_free, kvplan_layout_new,
    kvplan_plan_into, kvplan_prepare, kvplan_template_free, kvplan_template_new,
};

const ITEM: u64 = 512;

fn last_message() -> String {
    // SAFETY: the library returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(kvplan_last_error_message()) }
        .to_str()
        .unwrap()
        .to_owned()
}

/// A two-layer template (64 pages of 512 bytes per layer on each side).
fn template() -> *mut KvplanTemplate {
    let layout = |base: u64| {
        let ptrs = [base, base + (1 << 30)];
        let lens = [ITEM * 64; 2];
        let items = [ITEM; 2];
        let ids = [0i64, 1];
        let desc = KvplanLayoutDesc {
            n_entries: 2,
            data_ptrs: ptrs.as_ptr(),
            data_lens: lens.as_ptr(),
            item_lens: items.as_ptr(),
            strides: null(),
            layer_ids: ids.as_ptr(),
            roles: null(),
            kinds: null(),
            page_size: 16,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
            attention: null(),
        };
        let mut out: *mut KvplanLayout = null_mut();
        // SAFETY: a valid descriptor whose arrays hold 2 values; `out` is writable.
        assert_eq!(
            unsafe { kvplan_layout_new(&raw const desc, &raw mut out) },
            KvplanStatus::Ok
        );
        out
    };
    let (src, dst) = (layout(1 << 32), layout(1 << 40));
    let mut out: *mut KvplanTemplate = null_mut();
    // SAFETY: live handles, default options, `out` writable.
    let status = unsafe { kvplan_template_new(src, dst, null(), &raw mut out) };
    assert_eq!(status, KvplanStatus::Ok, "{}", last_message());
    assert_eq!(kvplan_layout_free(src), KvplanStatus::Ok);
    assert_eq!(kvplan_layout_free(dst), KvplanStatus::Ok);
    out
}

/// The request struct's bytes, to check that a refused call left it as it was.
fn bytes_of(request: &KvplanRequest) -> Vec<u8> {
    let start = std::ptr::from_ref(request).cast::<u8>();
    // SAFETY: the struct is live and `size_of` bytes long.
    unsafe { std::slice::from_raw_parts(start, size_of::<KvplanRequest>()) }.to_vec()
}

#[test]
fn plan_info_inside_the_request_is_refused() {
    let template = template();
    let (src, dst) = ([3i64, 4, 9], [10i64, 11, 2]);
    let mut request = KvplanRequest {
        src_pages: src.as_ptr(),
        n_src: 3,
        dst_pages: dst.as_ptr(),
        n_dst: 3,
        n_tokens: KVPLAN_NO_TOKENS,
        skip_tokens: 0,
    };
    let before = bytes_of(&request);
    let mut columns = [[0u64; 8]; 3];
    let [a, b, c] = &mut columns;
    let info = std::ptr::from_mut(&mut request).cast::<KvplanPlanInfo>();
    // SAFETY: the request and its arrays are valid; the columns hold 8 values each; `info`
    // points to writable memory the size of a `KvplanPlanInfo` (the request struct is as large).
    let status = unsafe {
        kvplan_plan_into(
            template,
            &raw const request,
            a.as_mut_ptr(),
            b.as_mut_ptr(),
            c.as_mut_ptr(),
            8,
            info,
        )
    };
    assert_eq!(status, KvplanStatus::InvalidArgument);
    let message = last_message();
    assert!(message.starts_with("info ["), "{message}");
    assert!(message.contains("overlaps request ["), "{message}");
    assert_eq!(
        bytes_of(&request),
        before,
        "the refused call wrote into the request"
    );

    // The same for the info of kvplan_prepare.
    // SAFETY: as above.
    let status = unsafe { kvplan_prepare(template, &raw const request, info) };
    assert_eq!(status, KvplanStatus::InvalidArgument);
    assert!(last_message().contains("overlaps request ["));
    assert_eq!(bytes_of(&request), before);
    assert_eq!(kvplan_template_free(template), KvplanStatus::Ok);
}

#[test]
fn plan_info_inside_a_column_is_refused() {
    let template = template();
    let (src, dst) = ([3i64, 4, 9], [10i64, 11, 2]);
    let request = KvplanRequest {
        src_pages: src.as_ptr(),
        n_src: 3,
        dst_pages: dst.as_ptr(),
        n_dst: 3,
        n_tokens: KVPLAN_NO_TOKENS,
        skip_tokens: 0,
    };
    let mut columns = [[0u64; 8]; 3];
    let [a, b, c] = &mut columns;
    let info = a.as_mut_ptr().cast::<KvplanPlanInfo>();
    // SAFETY: as in the test above; `info` points to 5 writable values of the first column.
    let status = unsafe {
        kvplan_plan_into(
            template,
            &raw const request,
            a.as_mut_ptr(),
            b.as_mut_ptr(),
            c.as_mut_ptr(),
            8,
            info,
        )
    };
    assert_eq!(status, KvplanStatus::InvalidArgument);
    let message = last_message();
    assert!(message.starts_with("src_addrs ["), "{message}");
    assert!(message.contains("overlaps info ["), "{message}");
    assert_eq!(
        columns, [[0u64; 8]; 3],
        "the refused call wrote into the columns"
    );
    assert_eq!(kvplan_template_free(template), KvplanStatus::Ok);
}

#[test]
fn a_layout_handle_over_its_descriptor_is_refused() {
    let (ptrs, lens, items) = ([1u64 << 32], [ITEM * 64], [ITEM]);
    let mut desc = KvplanLayoutDesc {
        n_entries: 1,
        data_ptrs: ptrs.as_ptr(),
        data_lens: lens.as_ptr(),
        item_lens: items.as_ptr(),
        strides: null(),
        layer_ids: null(),
        roles: null(),
        kinds: null(),
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
        pp_rank: 0,
        pp_size: 1,
        attention: null(),
    };
    let out = std::ptr::from_mut(&mut desc).cast::<*mut KvplanLayout>();
    // SAFETY: a valid descriptor; `out` points to writable memory for one pointer (the first
    // field of the descriptor).
    let status = unsafe { kvplan_layout_new(&raw const desc, out) };
    assert_eq!(status, KvplanStatus::InvalidArgument);
    assert!(
        last_message().contains("overlaps desc ["),
        "{}",
        last_message()
    );
    assert_eq!(
        desc.n_entries, 1,
        "the refused call wrote into the descriptor"
    );
}
