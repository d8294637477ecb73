//! Decode context parallelism (DCP): the tokens of a request dealt over a peer's context-parallel
//! ranks.
//!
//! A layout with `dcp_size = N > 1` holds only some tokens of each request: deals of
//! `dcp_interleave = I` consecutive tokens go to ranks `0, 1, …, N−1` in turn, so global token
//! `t` lives on rank `(t / I) mod N`, at local token `(t / (I·N))·I + t mod I` of that rank, and
//! the rank's page list holds its local tokens in order (page `l / P`, slot `l mod P`).
//! `I = 1` is SGLang's token round robin; `I = P` is vLLM's block interleave.
//!
//! What this module decides, and nothing else does:
//! - the dealt [`TokenMap`] of a layout's target (non-draft) page entries, and the arithmetic of
//!   that map (which tokens a rank owns, where they sit locally);
//! - draft (speculative) entries are not dealt: on a DCP layout a draft item holds a whole
//!   *virtual page* of `P·N` tokens (the tokens the ranks' page `k` cover together), every rank
//!   holds every draft token, and each decode rank receives them from one source rank;
//! - state entries are not dealt either: every decode DCP rank receives the state, from one
//!   source rank (the same election as for drafts), as SGLang sends state to every decode rank;
//! - which (source rank, decode rank) pairs share tokens, and why a pair that shares none plans
//!   nothing.
//!
//! Pack plans (gathering the strided source rows one decode rank needs into a pack buffer, so
//! the network moves few destination-contiguous blocks) are in [`crate::planners::pack`].

use crate::model::pieces::TokenMap;
pub use crate::peer::layout::DcpContext;
use crate::peer::layout::Layout;

/// The token map of a layout's target (dealt) page entries.
pub fn token_map(layout: &Layout) -> TokenMap {
    let ctx = layout.context();
    if ctx.dcp.dealt() {
        TokenMap::Dealt {
            page_size: ctx.page_size,
            ranks: u64::from(ctx.dcp.size),
            rank: u64::from(ctx.dcp.rank),
            interleave: ctx.dcp.interleave,
        }
    } else {
        TokenMap::Paged {
            page_size: ctx.page_size,
        }
    }
}

/// The token map of a layout's draft entries: every token, pages of `page_size × dcp_size`.
pub(crate) fn draft_map(layout: &Layout) -> TokenMap {
    TokenMap::Paged {
        page_size: tokens_per_draft_item(layout),
    }
}

fn tokens_per_draft_item(layout: &Layout) -> u64 {
    let ctx = layout.context();
    ctx.page_size * u64::from(ctx.dcp.size) // checked not to overflow at validation
}

/// Slots one item of entry `entry` holds: its pool's rows per page (a token per row but in a
/// pool of rows), times `dcp_size` for a draft entry (the virtual page).
pub(crate) fn tokens_per_item(layout: &Layout, entry: usize) -> u64 {
    if layout.is_draft(entry) {
        tokens_per_draft_item(layout)
    } else {
        layout.entry_rows_per_page(entry)
    }
}

/// Whether either side deals tokens: every plan between them is a token plan.
pub(crate) fn dealt_pair(src: &Layout, dst: &Layout) -> bool {
    src.context().dcp.dealt() || dst.context().dcp.dealt()
}

/// Whether this source rank is the one that sends what is not dealt (draft tokens, state) to
/// this decode rank: source DCP rank `decode rank mod source size`, so the decode ranks are
/// spread over the source ranks and each receives once.
pub(crate) fn sends_undealt(src: &Layout, dst: &Layout) -> bool {
    let (s, d) = (src.context().dcp, dst.context().dcp);
    d.rank % s.size == s.rank
}

/// Why the two sides' dealt tokens never meet, when they do not (`None`: they share tokens).
pub(crate) fn no_shared_tokens(src: &Layout, dst: &Layout) -> Option<String> {
    let maps = (token_map(src), token_map(dst));
    if shares_tokens(maps) {
        return None;
    }
    Some(format!(
        "prefill {} and decode {} hold no token in common: no target KV moves between them \
         (the decode rank's tokens come from other prefill ranks)",
        src.context().dcp.describe(),
        dst.context().dcp.describe()
    ))
}

/// Whether some token lives on both maps' ranks: checked over one period of both deal patterns
/// (their tokens repeat with period `lcm(I_s·N_s, I_d·N_d)`), segment by segment.
pub(crate) fn shares_tokens(maps: (TokenMap, TokenMap)) -> bool {
    let period = |m: TokenMap| match m {
        TokenMap::Paged { .. } => 1,
        TokenMap::Dealt {
            ranks, interleave, ..
        } => ranks * interleave,
    };
    let (src_period, dst_period) = (period(maps.0), period(maps.1));
    let lcm = (src_period / gcd(src_period, dst_period)).saturating_mul(dst_period);
    let mut token = 0u64;
    while token < lcm {
        let on_src = maps.0.next_owned(token);
        let on_both = maps.1.next_owned(on_src);
        if on_both == on_src {
            return on_src < lcm;
        }
        token = on_both;
    }
    false
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl TokenMap {
    /// Whether global token `t` lives on this map's rank (always, for a paged map).
    pub fn owns(self, t: u64) -> bool {
        match self {
            TokenMap::Paged { .. } => true,
            TokenMap::Dealt {
                ranks,
                rank,
                interleave,
                ..
            } => (t / interleave) % ranks == rank,
        }
    }

    /// The first token at or after `t` that lives on this map's rank (`u64::MAX` past the end).
    pub(crate) fn next_owned(self, t: u64) -> u64 {
        match self {
            TokenMap::Paged { .. } => t,
            TokenMap::Dealt {
                ranks,
                rank,
                interleave,
                ..
            } => {
                let deal = t / interleave;
                let owner = deal % ranks;
                if owner == rank {
                    return t;
                }
                let ahead = (rank + ranks - owner) % ranks;
                (deal + ahead).saturating_mul(interleave)
            }
        }
    }

    /// Local token (position among this rank's tokens) of an owned global token.
    pub fn local(self, t: u64) -> u64 {
        match self {
            TokenMap::Paged { .. } => t,
            TokenMap::Dealt {
                ranks, interleave, ..
            } => t / (interleave * ranks) * interleave + t % interleave,
        }
    }

    /// Consecutive global tokens from an owned `t` that stay on this rank (`u64::MAX`: all).
    pub fn run_left(self, t: u64) -> u64 {
        match self {
            TokenMap::Paged { .. } => u64::MAX,
            TokenMap::Dealt { interleave, .. } => interleave - t % interleave,
        }
    }

    /// How many of the first `n` global tokens live on this rank.
    pub fn local_count(self, n: u64) -> u64 {
        match self {
            TokenMap::Paged { .. } => n,
            TokenMap::Dealt {
                ranks,
                rank,
                interleave,
                ..
            } => {
                let cycle = interleave * ranks;
                let rest = (n % cycle).saturating_sub(rank * interleave);
                n / cycle * interleave + rest.min(interleave)
            }
        }
    }

    /// The global tokens below `n` this map's rank holds, as `(first global token, tokens)`
    /// ranges in order (a whole-request range for a paged map).
    pub fn owned_ranges(self, n: u64) -> impl Iterator<Item = (u64, u64)> {
        let mut t = 0u64;
        std::iter::from_fn(move || {
            t = self.next_owned(t);
            if t >= n {
                return None;
            }
            let len = self.run_left(t).min(n - t);
            let start = t;
            t += len;
            Some((start, len))
        })
    }
}

/// A segment of a token walk over two maps: `n` global tokens from `t` that both sides hold,
/// inside one page on each side, with each side's local token and its (page, slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DealtSegment {
    pub t: u64,
    pub n: u64,
    pub local: (u64, u64),
    /// Position in each side's page list (`local / page_size`).
    pub page: (u64, u64),
    /// Slot in that page (`local % page_size`).
    pub slot: (u64, u64),
}

/// One side of a token walk, advanced incrementally: the walk only moves forward, so each
/// side keeps the deal it is in (or the next one it owns) and the page and slot of its last
/// local token, and the per-segment arithmetic is additions (a division only when a side's
/// local token jumps by a page or more: a paged side skipping the other side's deals).
#[derive(Debug, Clone, Copy)]
struct Cursor {
    map: TokenMap,
    /// First token of the owned deal at or after the last query, its end (exclusive) and the
    /// local token of its first token; a paged side owns one deal of every token.
    start: u64,
    end: u64,
    local_start: u64,
    /// The last local token placed, and its page and slot.
    local: u64,
    page: u64,
    slot: u64,
}

impl Cursor {
    fn new(map: TokenMap) -> Self {
        let (start, end) = match map {
            TokenMap::Paged { .. } => (0, u64::MAX),
            TokenMap::Dealt {
                rank, interleave, ..
            } => (rank * interleave, (rank + 1) * interleave),
        };
        Self {
            map,
            start,
            end,
            local_start: 0,
            local: 0,
            page: 0,
            slot: 0,
        }
    }

    /// The first token at or after `t` this side holds (`t` never decreases between calls).
    fn next_owned(&mut self, t: u64) -> u64 {
        if let TokenMap::Dealt {
            ranks, interleave, ..
        } = self.map
            && self.end <= t
        {
            // Skip whole cycles of `ranks` deals at once, then the deal `t` may be in.
            let cycle = interleave * ranks;
            let past = t - self.end;
            // Most steps go just past this deal's end: no division then.
            let behind = if past < cycle { 1 } else { past / cycle + 1 };
            self.start = self.start.saturating_add(behind.saturating_mul(cycle));
            self.end = self.start.saturating_add(interleave);
            self.local_start += behind * interleave;
        }
        t.max(self.start)
    }

    /// Local token, page and slot of an owned token `t` at or after the last one placed, and
    /// the tokens from `t` that stay on this side's deal and page.
    fn place(&mut self, t: u64) -> (u64, u64, u64, u64) {
        let size = self.map.page_size();
        let local = match self.map {
            TokenMap::Paged { .. } => t,
            TokenMap::Dealt { .. } => self.local_start + (t - self.start),
        };
        let ahead = local - self.local;
        if ahead < size {
            self.slot += ahead;
            if self.slot >= size {
                self.slot -= size;
                self.page += 1;
            }
        } else {
            (self.page, self.slot) = (local / size, local % size);
        }
        self.local = local;
        let left = (self.end - t).min(size - self.slot);
        (local, self.page, self.slot, left)
    }
}

/// The segments of the first `n_tokens` global tokens both maps hold, in token order: cut at
/// every deal edge and local page edge of either side (the arithmetic of [`TokenMap::owns`],
/// [`TokenMap::local`] and the page size, done incrementally).
pub(crate) fn dealt_segments(
    n_tokens: u64,
    maps: (TokenMap, TokenMap),
) -> impl Iterator<Item = DealtSegment> {
    let (mut cs, mut cd) = (Cursor::new(maps.0), Cursor::new(maps.1));
    let mut t = 0u64;
    std::iter::from_fn(move || {
        // The next token both hold: alternate until both agree (each step moves forward).
        loop {
            if t >= n_tokens {
                return None;
            }
            let s = cs.next_owned(t);
            let d = cd.next_owned(s);
            if d == s {
                t = s;
                break;
            }
            t = d;
        }
        if t >= n_tokens {
            return None;
        }
        let (ls, ps, ss, left_s) = cs.place(t);
        let (ld, pd, sd, left_d) = cd.place(t);
        let n = left_s.min(left_d).min(n_tokens - t);
        let seg = DealtSegment {
            t,
            n,
            local: (ls, ld),
            page: (ps, pd),
            slot: (ss, sd),
        };
        t += n;
        Some(seg)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dealt(page_size: u64, ranks: u64, rank: u64, interleave: u64) -> TokenMap {
        TokenMap::Dealt {
            page_size,
            ranks,
            rank,
            interleave,
        }
    }

    #[test]
    fn the_map_is_the_definition() {
        for (ranks, interleave) in [(2, 1), (4, 1), (4, 16), (8, 3), (3, 5)] {
            for rank in 0..ranks {
                let m = dealt(16, ranks, rank, interleave);
                let mut local = 0;
                for t in 0..500u64 {
                    let owns = (t / interleave) % ranks == rank;
                    assert_eq!(m.owns(t), owns);
                    let next = (t..t + interleave * ranks)
                        .find(|&u| (u / interleave) % ranks == rank)
                        .unwrap();
                    assert_eq!(m.next_owned(t), next);
                    assert_eq!(m.local_count(t), local);
                    if owns {
                        assert_eq!(
                            m.local(t),
                            (t / (interleave * ranks)) * interleave + t % interleave
                        );
                        assert_eq!(m.local(t), local);
                        local += 1;
                    }
                }
            }
        }
    }

    /// The incremental walk against the definition: every token both ranks hold, once, in
    /// order, at its local token, page and slot, segments inside one deal and page per side.
    #[test]
    fn the_walk_is_the_definition() {
        let maps = [
            TokenMap::Paged { page_size: 4 },
            TokenMap::Paged { page_size: 3 },
            dealt(4, 2, 1, 1),
            dealt(4, 4, 3, 1),
            dealt(2, 4, 0, 2),
            dealt(8, 3, 2, 5),
            dealt(1, 8, 7, 1),
            dealt(16, 2, 0, 16),
        ];
        for &a in &maps {
            for &b in &maps {
                for n in [0u64, 1, 7, 40, 203] {
                    let mut want = Vec::new();
                    for t in 0..n {
                        if a.owns(t) && b.owns(t) {
                            let (la, lb) = (a.local(t), b.local(t));
                            want.push((t, la, lb));
                        }
                    }
                    let mut got = Vec::new();
                    for seg in dealt_segments(n, (a, b)) {
                        assert!(seg.n >= 1);
                        let (pa, pb) = (a.page_size(), b.page_size());
                        assert_eq!(seg.page, (seg.local.0 / pa, seg.local.1 / pb));
                        assert_eq!(seg.slot, (seg.local.0 % pa, seg.local.1 % pb));
                        assert!(seg.slot.0 + seg.n <= pa && seg.slot.1 + seg.n <= pb);
                        for k in 0..seg.n {
                            got.push((seg.t + k, seg.local.0 + k, seg.local.1 + k));
                        }
                        assert!(a.run_left(seg.t) >= seg.n && b.run_left(seg.t) >= seg.n);
                    }
                    assert_eq!(got, want, "{a:?} {b:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn shared_tokens_between_rank_pairs() {
        // Equal layouts: only equal ranks meet.
        assert!(shares_tokens((dealt(4, 4, 1, 1), dealt(4, 4, 1, 1))));
        assert!(!shares_tokens((dealt(4, 4, 1, 1), dealt(4, 4, 2, 1))));
        // DCP 2 -> 4 at interleave 1: rank 0 (even tokens) meets ranks 0 and 2 only.
        assert!(shares_tokens((dealt(4, 2, 0, 1), dealt(4, 4, 2, 1))));
        assert!(!shares_tokens((dealt(4, 2, 0, 1), dealt(4, 4, 1, 1))));
        // Different interleaves meet everywhere.
        assert!(shares_tokens((dealt(4, 2, 0, 4), dealt(4, 4, 3, 1))));
        assert!(shares_tokens((
            TokenMap::Paged { page_size: 4 },
            dealt(4, 8, 7, 1)
        )));
    }
}
