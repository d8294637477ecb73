//! The one byte-level reference for plans: a naive copier written from the layout definitions,
//! token by token, head by head, byte by byte, and nothing of the planner's pieces, runs or
//! segments.
//!
//! Item `i` of an entry is the `item_len` bytes at `data_ptr + i × stride`. A page holds
//! `page_size` token slots; a side with attention geometry holds heads `first .. first +
//! heads_per_rank` of the model (rank `r` of TP `tp`: `(r / holders) × heads_per_rank`, with
//! `holders = max(1, tp / kv_heads)` ranks replicating each head) and places byte `b` of local
//! head `h` of slot `s` at `s × token + h × head + b` (token-major, `NHD`) or `h × page_size ×
//! head + s × head + b` (head-major, `HND`). A side without geometry is token-major with one
//! "head" of `item_len / page_size` bytes. Token `t` of a request sits in page `pages[t /
//! page_size]`, slot `t % page_size`, on each side (a delta request's tokens from its
//! `skip_tokens` on). A prefill rank sends a head its decode rank
//! also holds, and of replicated heads only the holder with `r_p mod R == r_d mod R` (every
//! holder, for a template built with `replicas_send`: [`reference_every_holder`]).
//!
//! Caller fragments `(src_off, dst_off, len)` are item offsets: the source byte at item offset
//! `o` goes to destination item offset `o − src_off + dst_off`; with head slicing only where
//! that is also where the head goes.

#![allow(dead_code)] // each test binary uses its own part

use kvplan_core::Request;
use kvplan_core::{Fragment, Layout, MemoryOrder, Plan, Template};

/// The bytes of every buffer of one layout, as one range of addresses.
pub struct Arena {
    pub base: u64,
    pub bytes: Vec<u8>,
}

impl Arena {
    fn span(layout: &Layout) -> (u64, usize) {
        let p = layout.parts();
        let base = *p.data_ptrs.iter().min().expect("a layout with entries");
        let end = p
            .data_ptrs
            .iter()
            .zip(&p.data_lens)
            .map(|(a, l)| a + l)
            .max()
            .unwrap();
        (base, (end - base) as usize)
    }

    /// Zeroed bytes covering `layout`'s buffers.
    pub fn zeroed(layout: &Layout) -> Self {
        let (base, len) = Self::span(layout);
        Self {
            base,
            bytes: vec![0; len],
        }
    }

    /// Bytes covering `layout`'s buffers, each a function of its address (never all alike).
    pub fn numbered(layout: &Layout) -> Self {
        let (base, len) = Self::span(layout);
        // Never 0, so a byte the plan fails to copy cannot match a zeroed destination.
        let byte = |a: u64| ((a.wrapping_mul(31) ^ (a >> 7) ^ (a >> 13)) % 255 + 1) as u8;
        Self {
            base,
            bytes: (0..len as u64).map(|i| byte(base + i)).collect(),
        }
    }

    fn at(&self, addr: u64) -> usize {
        (addr - self.base) as usize
    }
}

/// Copies `plan`'s blocks from `source` into `out`, asserting that every block is non-empty,
/// lies inside one registered buffer on each side, and writes no destination byte twice.
pub fn apply(src: &Layout, dst: &Layout, plan: &Plan, source: &Arena, out: &mut Arena) {
    let inside = |l: &Layout, addr: u64, len: u64| {
        let p = l.parts();
        p.data_ptrs
            .iter()
            .zip(&p.data_lens)
            .any(|(&b, &n)| addr >= b && addr + len <= b + n)
    };
    let mut written = vec![false; out.bytes.len()];
    for k in 0..plan.lengths.len() {
        let (s, d, len) = (plan.src_addrs[k], plan.dst_addrs[k], plan.lengths[k]);
        assert!(len > 0, "block {k} is empty");
        assert!(
            inside(src, s, len),
            "block {k} ({s:#x}, {len}) leaves the source buffers"
        );
        assert!(
            inside(dst, d, len),
            "block {k} ({d:#x}, {len}) leaves the destination buffers"
        );
        let (s, d, n) = (source.at(s), out.at(d), len as usize);
        assert!(
            written[d..d + n].iter().all(|w| !w),
            "block {k} writes a byte twice"
        );
        written[d..d + n].iter_mut().for_each(|w| *w = true);
        out.bytes[d..d + n].copy_from_slice(&source.bytes[s..s + n]);
    }
}

/// How one side places the bytes of its items.
#[derive(Clone, Copy)]
struct Side {
    page_size: u64,
    first_head: u64,
    heads: u64,
    head: u64,
    order: MemoryOrder,
    rank: u64,
    holders: u64,
}

impl Side {
    /// The side's geometry, or (none published) a token-major item of `item_len / page_size`
    /// bytes per token holding the heads `like` holds (one "head" of a whole token when neither
    /// side publishes any).
    fn of(layout: &Layout, item_len: u64, like: Option<Side>) -> Self {
        let c = layout.context();
        let token = item_len / c.page_size;
        let Some(g) = c.attention else {
            let (first_head, head) = like.map_or((0, token), |o| (o.first_head, o.head));
            return Self {
                page_size: c.page_size,
                first_head,
                heads: token / head,
                head,
                order: MemoryOrder::Nhd,
                rank: 0,
                holders: 1,
            };
        };
        let holders = u64::from((c.tp_size / g.total_kv_heads).max(1));
        let heads = u64::from(g.heads_per_rank);
        Self {
            page_size: c.page_size,
            first_head: u64::from(c.tp_rank) / holders * heads,
            heads,
            head: g.head_bytes(),
            order: g.memory_order,
            rank: u64::from(c.tp_rank),
            holders,
        }
    }

    fn pair(src: &Layout, dst: &Layout, items: (u64, u64)) -> (Self, Self) {
        let with = |l: &Layout, item| l.context().attention.map(|_| Self::of(l, item, None));
        let (s, d) = (with(src, items.0), with(dst, items.1));
        (
            s.unwrap_or_else(|| Self::of(src, items.0, d)),
            d.unwrap_or_else(|| Self::of(dst, items.1, s)),
        )
    }

    /// Item offset of byte `b` of global head `h` in slot `slot` (`None`: not held).
    fn offset(&self, slot: u64, h: u64, b: u64) -> Option<u64> {
        let local = h.checked_sub(self.first_head).filter(|&l| l < self.heads)?;
        Some(match self.order {
            MemoryOrder::Nhd => slot * self.heads * self.head + local * self.head + b,
            MemoryOrder::Hnd => local * self.page_size * self.head + slot * self.head + b,
        })
    }
}

/// The destination bytes after the request moves `source` for every page pair of `template`
/// (which entries pair is the pairing's business, tested on its own), with `fragments` given
/// for every pair (`None`: the whole item).
pub fn reference(
    template: &Template,
    src: &Layout,
    dst: &Layout,
    request: &Request<'_>,
    fragments: Option<&[Fragment]>,
    source: &Arena,
) -> Arena {
    copy_reference(template, src, dst, request, fragments, source, false)
}

/// As [`reference`], for a template whose replicated heads are sent by every holder
/// (`TemplateOptions::replicas_send`), not only the elected one.
pub fn reference_every_holder(
    template: &Template,
    src: &Layout,
    dst: &Layout,
    request: &Request<'_>,
    source: &Arena,
) -> Arena {
    copy_reference(template, src, dst, request, None, source, true)
}

fn copy_reference(
    template: &Template,
    src: &Layout,
    dst: &Layout,
    request: &Request<'_>,
    fragments: Option<&[Fragment]>,
    source: &Arena,
    every_holder_sends: bool,
) -> Arena {
    let mut out = Arena::zeroed(dst);
    let (ps, pd) = (src.context().page_size, dst.context().page_size);
    let (src_pages, dst_pages) = request.page_lists("the reference").unwrap();
    let n = request
        .n_tokens
        .unwrap_or_else(|| (src_pages.len() as u64 * ps).min(dst_pages.len() as u64 * pd));
    for pair in template.page_pairs() {
        let (e_s, e_d) = (pair.src_entry, pair.dst_entry);
        let items = (src.parts().item_lens[e_s], dst.parts().item_lens[e_d]);
        if items.0 == 0 {
            continue; // an elided entry moves nothing
        }
        let (s_side, d_side) = Side::pair(src, dst, items);
        let sliced = (s_side.first_head, s_side.heads) != (d_side.first_head, d_side.heads);
        let sends = every_holder_sends
            || s_side.holders == 1
            || s_side.rank % s_side.holders == d_side.rank % s_side.holders;
        // A delta request moves its tokens from `skip_tokens` on; the decode holds the rest.
        // A sliding-window entry holds only the request's last `w` tokens live.
        let first = match src.windows()[e_s] {
            Some(w) => request.skip_tokens.max(n.saturating_sub(w)),
            None => request.skip_tokens,
        };
        for t in first..n {
            let (s_slot, d_slot) = (t % ps, t % pd);
            let s_page = src_pages[(t / ps) as usize] as u64;
            let d_page = dst_pages[(t / pd) as usize] as u64;
            let s_item = src.parts().data_ptrs[e_s] + s_page * src.strides()[e_s];
            let d_item = dst.parts().data_ptrs[e_d] + d_page * dst.strides()[e_d];
            for h in s_side.first_head..s_side.first_head + s_side.heads {
                for b in 0..s_side.head {
                    let from = s_side.offset(s_slot, h, b).unwrap();
                    let natural = d_side.offset(d_slot, h, b).filter(|_| sends);
                    let to = match fragments {
                        None => natural,
                        Some(list) => list
                            .iter()
                            .find(|f| (f.src_off..f.src_off + f.len).contains(&from))
                            .map(|f| from - f.src_off + f.dst_off)
                            .filter(|&to| !sliced || natural == Some(to)),
                    };
                    if let Some(to) = to {
                        let byte = source.bytes[source.at(s_item + from)];
                        let at = out.at(d_item + to);
                        out.bytes[at] = byte;
                    }
                }
            }
        }
    }
    out
}

/// Plans the request, copies it between arenas and asserts the result equals the reference
/// (and that the plan's byte total is what the reference moved when `bytes` is given).
pub fn check_plan(
    template: &Template,
    src: &Layout,
    dst: &Layout,
    request: &Request<'_>,
    fragments: Option<&[Fragment]>,
) -> Plan {
    let plan = template.plan(request).unwrap();
    let source = Arena::numbered(src);
    let mut got = Arena::zeroed(dst);
    apply(src, dst, &plan, &source, &mut got);
    let want = reference(template, src, dst, request, fragments, &source);
    assert!(got.bytes == want.bytes, "plan differs from the reference");
    plan
}
