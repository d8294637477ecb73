//! Why page pairs emit their blocks apart: for every page pair of a template, whether it
//! emits together with the pair before it and, if not, what keeps it apart (the rule of module
//! `coalesce`, asked of the template's own groups and pieces), and whether its blocks end at
//! every page (a page stride longer than what it moves per page).

use crate::peer_pair::coalesce::{JoinBlocker, join_blocker};
use crate::peer_pair::template::Template;

/// What keeps a page pair's blocks from being emitted with the pair before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coalescing {
    /// It emits with the pair before it (one group).
    Joined,
    /// The first pair that emits: nothing before it to join.
    First,
    /// It moves nothing (item length 0, or no heads to move between these TP ranks).
    Elided,
    /// The page rule would join it, but the template plans by token (sliding-window entries,
    /// different page sizes or memory orders, decode context parallelism), and a token plan
    /// emits every entry's blocks apart.
    ByToken,
    /// It, or the group before it, moves parts of its items (TP head slicing of head-major
    /// items, or the caller's fragments): fragment groups never widen.
    Fragments,
    /// Its item does not follow the group's (module `coalesce`'s rule).
    Join(JoinBlocker),
    /// The rule would join it, but the template keeps it apart: coalescing is off, or a layer
    /// group (layer-wise streaming) ends here.
    Options,
}

/// One page pair's coalescing, in the order of [`Template::page_pairs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairCoalescing {
    /// Whether it joins the pair before it, or what keeps it apart.
    pub coalescing: Coalescing,
    /// Whether some of its blocks end at every page instead of every run (a page stride longer
    /// than the bytes it moves per page on a side: pages are not back to back).
    pub per_page: bool,
}

/// The coalescing of every page pair of `template`.
pub fn coalescing(template: &Template) -> Vec<PairCoalescing> {
    let pieces = template.pieces();
    let blocks = template.blocks();
    let groups = blocks.groups();
    let whole = |g: usize| {
        let group = &groups[g];
        let piece = &pieces[group.first_piece];
        let pair = &template.page_pairs()[group.first_pair];
        group.n_pieces == 1 && piece.len == pair.item_len
    };
    let mut first_seen = false;
    blocks
        .pair_groups()
        .iter()
        .zip(template.page_pairs())
        .enumerate()
        .map(|(index, (group, pair))| {
            let Some(g) = *group else {
                return PairCoalescing {
                    coalescing: Coalescing::Elided,
                    per_page: false,
                };
            };
            // A token plan emits each entry's own pieces; a page plan its group's.
            let per_page = if template.by_token() {
                pair.src_stride > pair.item_len || pair.dst_stride > pair.dst_item_len
            } else {
                let of_group = &pieces[groups[g].first_piece..][..groups[g].n_pieces];
                of_group.iter().any(|p| !p.per_run())
            };
            let coalescing = if !std::mem::replace(&mut first_seen, true) {
                Coalescing::First
            } else if groups[g].first_pair != index {
                Coalescing::Joined
            } else if !whole(g) || !whole(g - 1) {
                Coalescing::Fragments
            } else {
                let last = &pieces[groups[g - 1].first_piece];
                join_blocker(last, &pieces[groups[g].first_piece])
                    .map_or(Coalescing::Options, Coalescing::Join)
            };
            // Pairs the page rule joins (or only the options keep apart) still emit apart in
            // a token plan; a pair the rule keeps apart is apart for that reason first.
            let coalescing = match coalescing {
                Coalescing::Joined | Coalescing::Options if template.by_token() => {
                    Coalescing::ByToken
                }
                other => other,
            };
            PairCoalescing {
                coalescing,
                per_page,
            }
        })
        .collect()
}
