//! Caller fragments meet token plans and head slicing: planned byte-exactly where the
//! combination has one meaning, refused from the one check module (saying why) where it has
//! none. Each plan is copied between byte arenas and compared with a per-token, per-byte copier
//! written from the layout definitions; no destination byte is written twice.

mod support;

use kvplan_core::Request;
use kvplan_core::{
    Fragment, Fragments, GeometryOptions, Layout, MemoryOrder, PlanError, Template, TemplateOptions,
};
use support::layouts::{ContextBuilder, HEAD_BYTES, KvLayout, heads, paged};
use support::reference::check_plan;

const SRC: u64 = 0x10_0000;
const DST: u64 = 0x80_0000;
const PAGES: u64 = 4;

/// One layer's K entry at `base`: `PAGES` pages of `page_size` tokens, `heads` heads per rank.
fn layout(base: u64, page_size: u64, order: Option<(MemoryOrder, u32, u32)>) -> Layout {
    let per_rank = order.map_or(2, |(_, tp, _)| u64::from(2 / tp));
    let item = page_size * per_rank * HEAD_BYTES;
    let (tp, rank) = order.map_or((1, 0), |o| (o.1, o.2));
    let geometry = order.map(|(memory_order, tp, _)| heads(2, 2 / tp, memory_order));
    KvLayout::mla(base, [0], item, PAGES * item)
        .context(paged(page_size).tp(rank, tp).attention(geometry))
        .build()
}

/// Plans pages `pages` (`n` tokens) and compares the copied bytes with the reference.
fn check(
    t: &Template,
    src: &Layout,
    dst: &Layout,
    pages: (&[i64], &[i64]),
    n: Option<u64>,
    list: &[Fragment],
) -> kvplan_core::Plan {
    let request = Request::new(pages.0, pages.1, n);
    check_plan(t, src, dst, &request, Some(list))
}

fn template(src: &Layout, dst: &Layout, fragments: Vec<Fragment>) -> Result<Template, PlanError> {
    let geometry = GeometryOptions {
        fragments: Fragments::Every(fragments),
        coalesce: true,
    };
    Template::with_geometry(src, dst, TemplateOptions::default(), &geometry)
}

fn frag(src_off: u64, dst_off: u64, len: u64) -> Fragment {
    Fragment {
        src_off,
        dst_off,
        len,
    }
}

#[test]
fn per_token_fragments_with_n_tokens_and_with_different_memory_orders() {
    use MemoryOrder::{Hnd, Nhd};
    let pages: (&[i64], &[i64]) = (&[2, 0], &[1, 3]);
    // Token-major, no geometry: head 1 of every token to head 0 of the same token, 6 tokens.
    let (src, dst) = (layout(SRC, 4, None), layout(DST, 4, None));
    let list: Vec<_> = (0..4).map(|t| frag(t * 8 + 4, t * 8, 4)).collect();
    let t = template(&src, &dst, list.clone()).unwrap();
    let plan = check(&t, &src, &dst, pages, Some(6), &list);
    assert_eq!(plan.total_bytes, 6 * 4);
    // NHD -> HND at one page size (a token plan without n_tokens): head 1 of every token.
    let (src, dst) = (
        layout(SRC, 4, Some((Nhd, 1, 0))),
        layout(DST, 4, Some((Hnd, 1, 0))),
    );
    let list: Vec<_> = (0..4).map(|t| frag(t * 8 + 4, 16 + t * 4, 4)).collect();
    let t = template(&src, &dst, list.clone()).unwrap();
    assert!(t.by_token());
    let plan = check(&t, &src, &dst, pages, None, &list);
    assert_eq!(plan.total_bytes, 8 * 4);
}

#[test]
fn caller_fragments_are_restricted_to_the_heads_a_sliced_pair_moves() {
    use MemoryOrder::Nhd;
    // Prefill TP 2 rank 1 holds head 1 (4 bytes per token); decode TP 1 holds heads 0 and 1
    // (8 bytes per token): head slicing moves src byte 4t.. to dst byte 8t + 4.
    let (src, dst) = (
        layout(SRC, 4, Some((Nhd, 2, 1))),
        layout(DST, 4, Some((Nhd, 1, 0))),
    );
    let pages: (&[i64], &[i64]) = (&[0, 1], &[2, 3]);
    // Tokens 0 and 1 only (a sub-page transfer), agreeing with head slicing: a page plan.
    let list = [frag(0, 4, 4), frag(4, 12, 4)];
    let t = template(&src, &dst, list.to_vec()).unwrap();
    let plan = check(&t, &src, &dst, pages, None, &list);
    assert_eq!(plan.total_bytes, 2 * 2 * 4);
    // The same fragments with n_tokens do not move every token alike: refused, saying why.
    let err = t.plan(&Request::tokens(pages.0, pages.1, 6)).unwrap_err();
    assert!(
        matches!(err, PlanError::FragmentCombination { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("do not move the same bytes of every token"),
        "{err}"
    );
    // The first 2 bytes of the moved head of every token, 6 tokens: a head-sliced token plan.
    let list: Vec<_> = (0..4).map(|t| frag(t * 4, t * 8 + 4, 2)).collect();
    let t = template(&src, &dst, list.clone()).unwrap();
    let plan = check(&t, &src, &dst, pages, Some(6), &list);
    assert_eq!(plan.total_bytes, 6 * 2);
    // A fragment sending the moved head elsewhere than head slicing does has no destination.
    let err = template(&src, &dst, vec![frag(0, 0, 4)]).unwrap_err();
    assert!(
        matches!(err, PlanError::FragmentCombination { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("disagree on where the moved heads go"),
        "{err}"
    );
}

#[test]
fn fragments_between_different_page_sizes_are_refused_saying_why() {
    let (src, dst) = (layout(SRC, 4, None), layout(DST, 8, None));
    let err = template(&src, &dst, vec![frag(0, 0, 8)]).unwrap_err();
    assert!(
        matches!(err, PlanError::FragmentCombination { .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("prefill pages hold 4 tokens and decode pages 8"),
        "{text}"
    );
    assert_eq!(err.kind(), "fragments");
}
