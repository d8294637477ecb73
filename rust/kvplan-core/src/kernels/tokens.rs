//! Token-exact planning: prefill and decode with different tokens per page (or a partial last
//! page at the same page size).
//!
//! Token `t` of a request lives at source page `src_pages[t / P_s]`, slot `t % P_s`, and at
//! destination page `dst_pages[t / P_d]`, slot `t % P_d`. The request is cut into *segments*:
//! maximal token ranges inside one source page and one destination page (their edges are the
//! multiples of `P_s` and of `P_d`, so every segment is a whole number of `gcd(P_s, P_d)`-token
//! units, except a partial last one). Each entry pair becomes one or more [`Piece`]s, fixed
//! at template time, each side with its own tokens per page in its [`TokenMap`]:
//!
//! - token-major items (`NHD`, also every layout that publishes no attention geometry, and MLA
//!   latents): one piece per pair, the whole token (`token bytes = item_len / page_size`);
//! - head-major items (`HND`: `[heads][tokens][head bytes]`, on either side): one piece per
//!   head, `head_dim * dtype_size` bytes per token;
//! - a head slicing (TP sizes differ) moves only its heads, each side at its own offsets, and
//!   caller fragments are read as the bytes of every token they select (`check::per_token`).
//!
//! A piece moves `len` bytes per token, from `src_base + page * src_page_stride + slot *
//! src_slot` (likewise on the destination). When `len` equals both slot strides, the tokens of a
//! segment are contiguous on both sides and the segment is one block; consecutive segments merge
//! into one block when they are also contiguous across the edge between them (a page edge on a
//! side is contiguous only when the next page index is the previous plus one and that side's
//! pages are packed, `page_stride == page_size * slot`). Otherwise (a token-major side against a
//! head-major side) each token is its own block. Blocks are piece major (pairs in planning
//! order, heads in order), token minor.
//!
//! Nothing here allocates per request: a counting pass over the segment edges gives the block
//! count of every piece class, and emission writes each piece's blocks straight into the output
//! (a piece with the same strides as the last one of its lane is that piece's blocks shifted by the
//! difference of their bases).

use crate::error::{PlanError, Result, Side};
use crate::model::pieces::{
    Fragment, Lane, MAX_LANES, PIECE_CLASSES, PairSpec, Piece, PieceSide, TOKEN_CLASSES, TokenMap,
    Walk,
};
use crate::model::plan::{Columns, TokenShape};
use crate::model::runs::PageIndex;
use crate::peer::entry::{POOLS, PoolId};
use crate::peer::layout::{Layout, MemoryOrder};
use crate::rules::check::{TokenFrame, compose, memory_order, per_token, whole_tokens};
use crate::rules::heads::HeadSlicing;

/// A template's token pieces, built once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenTemplate {
    /// The token walks its pieces follow ([`Piece::lane`] indexes this list). Lane 0 walks
    /// every token of the request over each side's token map and the request's pages, and is
    /// there even without pieces (it gives a request its length and its pages); every other
    /// lane has pieces, in the order its first piece appears.
    pub lanes: Vec<Lane>,
    /// Whether either side deals tokens over decode context-parallel ranks.
    pub dealt: bool,
    /// Why a decode-context-parallel template moves no token (its ranks share none).
    pub empty_reason: Option<String>,
    /// Pieces in block order (page pairs in planning order, heads next).
    pub pieces: Vec<Piece>,
    /// Per page pair: its pieces, `pieces[start..end]` (empty for an elided pair).
    pub pair_pieces: Vec<(usize, usize)>,
    /// Pieces per class.
    pub class_pieces: [usize; TOKEN_CLASSES],
    /// Bytes moved per token (sum of piece lengths).
    pub bytes_per_token: u64,
    /// Bytes moved per token of each lane.
    pub lane_bytes: [u64; MAX_LANES],
    /// The sliding window of the template's window entries, in tokens, whether or not this
    /// rank pair moves bytes of them (one window per template: `check` refuses two sizes).
    pub window: Option<u64>,
    /// The contiguous pieces (a class above 0) whose shape differs from the contiguous piece
    /// before them in their lane, by position: every other contiguous piece's blocks are the
    /// blocks of the last of these in its lane, shifted by the difference of their bases.
    pub(crate) shape_heads: Vec<usize>,
}

impl TokenTemplate {
    /// Token pieces for `page_pairs`; an error says why tokens cannot be mapped (items that
    /// are not whole tokens, different token sizes, a head-major item whose size disagrees with
    /// its geometry, caller fragments that do not select the same bytes of every token). With a
    /// head slicing, only the heads it sends move, at each side's own offsets (restricted to
    /// the caller's fragments, if any); a pair that is not the elected sender, or holds no head
    /// of the decode rank, has no pieces.
    ///
    /// # Errors
    /// [`PlanError::TokenSize`], [`PlanError::TokenBytes`], [`PlanError::HeadLayout`],
    /// [`PlanError::HeadMismatch`], [`PlanError::FragmentCombination`], [`PlanError::Geometry`].
    pub(crate) fn build(
        src: &Layout,
        dst: &Layout,
        page_pairs: &[PairSpec],
        given: &[Option<Vec<Fragment>>],
        heads: Option<&HeadSlicing>,
        labels: (&[String], &[String]),
    ) -> Result<Self> {
        // Decode context parallelism (module `dcp`): target entries use each side's dealt
        // token map; draft entries are not dealt (their own lane, virtual pages, sent by one
        // source rank to each decode rank); a rank pair that shares no token moves no target
        // bytes.
        let dealt = crate::rules::dcp::dealt_pair(src, dst);
        let target = Lane {
            walk: Walk::All,
            maps: (
                crate::rules::dcp::token_map(src),
                crate::rules::dcp::token_map(dst),
            ),
            pools: (PoolId::PAGES, PoolId::PAGES),
            tokens_per_row: 1,
        };
        let draft_lane = Lane {
            walk: Walk::DraftWhole,
            maps: (
                crate::rules::dcp::draft_map(src),
                crate::rules::dcp::draft_map(dst),
            ),
            ..target
        };
        // An entry in a pool of its own (a window pool, a further pool) places its tokens (or
        // rows) in that pool's pages; any other entry, as the request's other tokens.
        let entry_side = |layout: &Layout, entry: usize, map: TokenMap| match layout
            .entry(entry)
            .pool()
            .filter(|&p| p != PoolId::PAGES)
        {
            Some(id) => {
                let pool = layout.pool(id).copied();
                let rows = pool.map_or(1, |p| p.tokens_per_row.max(1));
                let page_size = pool.map_or(1, |p| p.rows_per_page().max(1));
                (TokenMap::Paged { page_size }, id, rows)
            }
            None => (map, PoolId::PAGES, 1),
        };
        if dealt && (src.has_further_pools() || dst.has_further_pools()) {
            return Err(PlanError::Geometry {
                what: "window entries (or a further pool's entries) in a pool of their own on \
                       one side and tokens dealt over decode context-parallel ranks on the other \
                       are not supported together"
                    .into(),
            });
        }
        let sends_undealt = crate::rules::dcp::sends_undealt(src, dst);
        let shares = !dealt || crate::rules::dcp::shares_tokens(target.maps);
        let orders = (memory_order(src), memory_order(dst));
        let attention = (src.context().attention, dst.context().attention);
        let label = |side: Side, entry: usize| {
            side.pick(labels.0, labels.1)
                .get(entry)
                .cloned()
                .unwrap_or_default()
        };
        let moves = heads.is_none_or(HeadSlicing::moves_pages);
        let sliced = heads.and_then(HeadSlicing::sliced_heads);
        let mut lanes = vec![target];
        let mut pieces = Vec::new();
        let mut pair_pieces = Vec::with_capacity(page_pairs.len());
        for (index, (pair, given)) in page_pairs.iter().zip(given).enumerate() {
            let start = pieces.len();
            let pair_label = || format!("page pair {index} ({})", label(Side::Src, pair.src_entry));
            let draft = dealt && src.is_draft(pair.src_entry);
            if dealt && draft != dst.is_draft(pair.dst_entry) {
                return Err(PlanError::Geometry {
                    what: format!(
                        "{}: a draft entry paired with a target entry; under decode context \
                         parallelism draft tokens are not dealt and target tokens are, so both \
                         sides must mark the pair alike",
                        pair_label()
                    ),
                });
            }
            let window = src.entry(pair.src_entry).window();
            if window.is_some() && draft {
                return Err(PlanError::Geometry {
                    what: format!(
                        "{}: a draft entry with a sliding window under decode context \
                         parallelism (draft tokens are sent whole to every rank; a window of \
                         them is not supported)",
                        pair_label()
                    ),
                });
            }
            let lane = if draft {
                draft_lane
            } else {
                let (src_map, src_pool, src_rows) = entry_side(src, pair.src_entry, target.maps.0);
                let (dst_map, dst_pool, dst_rows) = entry_side(dst, pair.dst_entry, target.maps.1);
                if src_rows != dst_rows {
                    return Err(PlanError::Geometry {
                        what: format!(
                            "{}: a row holds {src_rows} tokens on the prefill side and \
                             {dst_rows} on the decode side; rows of a compressed cache move \
                             whole, so both sides' pools must keep the same tokens per row",
                            pair_label()
                        ),
                    });
                }
                Lane {
                    walk: window.map_or(Walk::All, Walk::Window),
                    maps: (src_map, dst_map),
                    pools: (src_pool, dst_pool),
                    tokens_per_row: src_rows,
                }
            };
            let maps = lane.maps;
            let sizes = (maps.0.page_size(), maps.1.page_size());
            // Elided pairs (source item 0, as page plans elide them), pairs of a rank pair
            // that moves no heads, and (DCP) tokens this rank pair does not exchange have no
            // pieces.
            let exchanged = if draft { sends_undealt } else { shares };
            if pair.item_len == 0 || !moves || !exchanged {
                pair_pieces.push((start, start));
                continue;
            }
            // Bytes of one token per side, bytes per head, and the bytes of a token that move.
            let (tokens, head, moved) = if let (Some(sliced), Some(slicing)) = (sliced, heads) {
                // Each side's item is what its own geometry implies (checked by
                // `check_pairs` too; re-checked here because every offset below relies on it).
                slicing
                    .check_page_items(
                        pair.item_len,
                        pair.dst_item_len,
                        (
                            src.entry_page_size(pair.src_entry),
                            dst.entry_page_size(pair.dst_entry),
                        ),
                    )
                    .map_err(|problem| PlanError::HeadMismatch {
                        entry: None,
                        problem,
                    })?;
                let head = sliced.head_bytes;
                let tokens = (sliced.src_heads * head, sliced.dst_heads * head);
                let moved = Fragment {
                    src_off: sliced.src_skip * head,
                    dst_off: sliced.dst_skip * head,
                    len: sliced.count * head,
                };
                (tokens, head, moved)
            } else {
                let (token, head) = whole_tokens(pair, sizes, orders, attention, &label)?;
                let whole = Fragment {
                    src_off: 0,
                    dst_off: 0,
                    len: token,
                };
                ((token, token), head, whole)
            };
            let ranges = match given {
                None => vec![moved],
                Some(list) => {
                    let frame = |side: Side| TokenFrame {
                        page_size: side.pick(sizes.0, sizes.1),
                        token: side.pick(tokens.0, tokens.1),
                        head,
                        order: side.pick(orders.0, orders.1),
                    };
                    let wanted =
                        per_token(list, (frame(Side::Src), frame(Side::Dst)), &pair_label)?;
                    if sliced.is_some() {
                        compose(&wanted, &[moved], &pair_label)?
                    } else {
                        wanted
                    }
                }
            };
            // A lane other than the target one is listed once a piece follows it.
            let position = lanes.iter().position(|l| *l == lane);
            let at = position.unwrap_or(lanes.len());
            if at >= MAX_LANES {
                return Err(PlanError::Geometry {
                    what: format!(
                        "{}: its tokens would be a token walk beyond the {MAX_LANES} one \
                         template holds ({:?})",
                        pair_label(),
                        lanes.iter().map(|l| l.walk).collect::<Vec<_>>()
                    ),
                });
            }
            push_pieces(&mut pieces, pair, &ranges, head, tokens, orders, (maps, at));
            if position.is_none() && pieces.len() > start {
                lanes.push(lane);
            }
            pair_pieces.push((start, pieces.len()));
        }
        let mut template = Self {
            lanes,
            dealt,
            empty_reason: None,
            pieces,
            pair_pieces,
            class_pieces: [0; TOKEN_CLASSES],
            bytes_per_token: 0,
            lane_bytes: [0; MAX_LANES],
            // One window per template (check.rs refuses two sizes).
            window: page_pairs
                .iter()
                .find_map(|pair| src.entry(pair.src_entry).window()),
            shape_heads: Vec::new(),
        };
        let overflow = PlanError::Overflow {
            what: "bytes per token",
        };
        for k in 0..template.pieces.len() {
            let piece = template.pieces[k];
            let class = piece.class();
            template.class_pieces[class] += 1;
            let lane = &mut template.lane_bytes[class / PIECE_CLASSES];
            *lane = lane.checked_add(piece.len).ok_or(overflow.clone())?;
        }
        template.bytes_per_token = template
            .lane_bytes
            .iter()
            .try_fold(0u64, |sum, &bytes| sum.checked_add(bytes))
            .ok_or(overflow)?;
        let mut last: [Option<&Piece>; MAX_LANES] = [None; MAX_LANES];
        for (k, piece) in template.pieces.iter().enumerate() {
            if piece.token_class() == 0 {
                continue;
            }
            if !last[piece.lane].is_some_and(|before| before.same_shape(piece)) {
                template.shape_heads.push(k);
            }
            last[piece.lane] = Some(piece);
        }
        if dealt && template.pieces.is_empty() {
            template.empty_reason = crate::rules::dcp::no_shared_tokens(src, dst);
        }
        Ok(template)
    }

    /// The lanes with their positions (lane 0 first).
    pub(crate) fn lanes(&self) -> impl Iterator<Item = (usize, &Lane)> + '_ {
        self.lanes.iter().enumerate()
    }

    /// How each side places the request's tokens (lane 0's maps).
    pub fn maps(&self) -> (TokenMap, TokenMap) {
        self.lanes[0].maps
    }

    /// Whether either side deals tokens over decode context-parallel ranks.
    pub fn dealt(&self) -> bool {
        self.dealt
    }

    /// Whether lane `at` reads its page lists: a lane of the request's pages with no pieces
    /// (every entry sits in further pools) reads none, so it asks for no pages and such a
    /// request may give empty page arrays.
    fn reads_pages(&self, at: usize, lane: &Lane) -> bool {
        self.moving(at) || lane.pools != (PoolId::PAGES, PoolId::PAGES)
    }

    /// Whether lane `lane` has pieces.
    fn moving(&self, lane: usize) -> bool {
        self.class_pieces[lane * PIECE_CLASSES..(lane + 1) * PIECE_CLASSES]
            .iter()
            .any(|&k| k > 0)
    }

    /// Per pool, the leading pages of each side's list that hold no token a lane with pieces
    /// reading that list moves of a request moving tokens `first..n` (each lane from its own
    /// walk's start): the pages such a request never reads.
    /// (`ranges`: per pool, its own `(first, n)`; each lane the range of [`lane_pool`].)
    pub(crate) fn first_pages_in(&self, ranges: &PoolRanges) -> [(usize, usize); POOLS] {
        let first = ranges[PoolId::PAGES.index()].0;
        let first_page = |map: TokenMap, token: u64| {
            usize::try_from(map.local_count(token) / map.page_size()).unwrap_or(usize::MAX)
        };
        let mut pages = [(usize::MAX, usize::MAX); POOLS];
        for (_, lane) in self.lanes().filter(|&(at, _)| self.moving(at)) {
            let (first, n) = ranges[lane_pool(lane).index()];
            let (token, _) = lane.slots(first, n);
            let (src, dst) = (&mut pages[lane.pools.0.index()].0, lane.pools.1.index());
            *src = (*src).min(first_page(lane.maps.0, token));
            pages[dst].1 = pages[dst].1.min(first_page(lane.maps.1, token));
        }
        // No lane reads a list: nothing is read past the first moved token either (a window
        // pool's list, read by no piece, is not read at all).
        let maps = self.maps();
        for pool in PoolId::ALL {
            let unread = |map: TokenMap| {
                if pool == PoolId::PAGES {
                    first_page(map, first)
                } else {
                    0
                }
            };
            let (src, dst) = &mut pages[pool.index()];
            if *src == usize::MAX {
                *src = unread(maps.0);
            }
            if *dst == usize::MAX {
                *dst = unread(maps.1);
            }
        }
        pages
    }

    /// Leading pages of each side's list (its pages, not its window pages) that hold the first
    /// `n` global tokens of every lane reading it.
    pub fn pages_needed(&self, n: u64) -> (u64, u64) {
        self.list_pages_needed(n)[PoolId::PAGES.index()]
    }

    /// Per pool, the leading pages of each side's list that hold the first `n` global tokens of
    /// every lane reading it (0 for a list no lane reads).
    pub(crate) fn list_pages_needed(&self, n: u64) -> [(u64, u64); POOLS] {
        self.list_pages_needed_in(&[(0, n); POOLS])
    }

    /// [`TokenTemplate::list_pages_needed`] with each lane's end from the range of its pool
    /// ([`lane_pool`]) in `ranges`.
    pub(crate) fn list_pages_needed_in(&self, ranges: &PoolRanges) -> [(u64, u64); POOLS] {
        let mut needed = [(0, 0); POOLS];
        for (_, lane) in self
            .lanes()
            .filter(|&(at, lane)| self.reads_pages(at, lane))
        {
            let (_, end) = lane.slots(0, ranges[lane_pool(lane).index()].1);
            let src = &mut needed[lane.pools.0.index()].0;
            *src = (*src).max(lane.maps.0.pages_for(end));
            let dst = &mut needed[lane.pools.1.index()].1;
            *dst = (*dst).max(lane.maps.1.pages_for(end));
        }
        needed
    }
}

/// Per pool, the global tokens `(first, n)` its lanes move: `first..n`.
pub(crate) type PoolRanges = [(u64, u64); POOLS];

/// The pool whose token range a lane walks: the further pool it reads (the source side's when
/// both read one), else the request's pages.
pub(crate) fn lane_pool(lane: &Lane) -> PoolId {
    if lane.pools.0 == PoolId::PAGES {
        lane.pools.1
    } else {
        lane.pools.0
    }
}

/// A request's page lists per pool (its pages, then each further pool's), each lane reading
/// the lists of its own pools.
pub(crate) struct LaneLists<'x, S: ?Sized, D: ?Sized> {
    /// Each pool's list of each side (a side without that pool: any list, no lane reads it).
    pub(crate) pools: [(&'x S, &'x D); POOLS],
}

impl<'x, S: ?Sized, D: ?Sized> LaneLists<'x, S, D> {
    /// Every pool reading the same lists.
    pub(crate) fn same(src: &'x S, dst: &'x D) -> Self {
        Self {
            pools: [(src, dst); POOLS],
        }
    }

    /// The lists `lane` reads.
    fn of(&self, lane: &Lane) -> (&'x S, &'x D) {
        (
            self.pools[lane.pools.0.index()].0,
            self.pools[lane.pools.1.index()].1,
        )
    }
}

/// The pieces of one pair moving `ranges` of every token (offsets inside a token, head by
/// head): one piece per range when both sides are token-major (contiguous within a token on
/// each side), else one piece per head of each range.
fn push_pieces(
    pieces: &mut Vec<Piece>,
    pair: &PairSpec,
    ranges: &[Fragment],
    head: u64,
    tokens: (u64, u64),
    orders: (MemoryOrder, MemoryOrder),
    (maps, lane): ((TokenMap, TokenMap), usize),
) {
    let sizes = (maps.0.page_size(), maps.1.page_size());
    // Byte `w` of a token (counted head by head) on a side: a head-major item holds head
    // `w / head` at `(w / head) * page_size * head`, one token every head bytes; a token-major
    // item at `w`, one token every token bytes of that side. All inside the item (checked).
    let place = |order: MemoryOrder, size: u64, token: u64, w: u64| match order {
        MemoryOrder::Hnd => ((w / head) * size * head + w % head, head),
        MemoryOrder::Nhd => (w, token),
    };
    let piece = |f: Fragment| {
        let (src_off, src_slot) = place(orders.0, sizes.0, tokens.0, f.src_off);
        let (dst_off, dst_slot) = place(orders.1, sizes.1, tokens.1, f.dst_off);
        let side = |base: u64, stride: u64, slot: u64, map: TokenMap| PieceSide {
            base,
            page_stride: stride,
            slot_stride: slot,
            map,
        };
        Piece {
            src: side(pair.src_base + src_off, pair.src_stride, src_slot, maps.0),
            dst: side(pair.dst_base + dst_off, pair.dst_stride, dst_slot, maps.1),
            len: f.len,
            lane,
        }
    };
    for &range in ranges {
        if orders == (MemoryOrder::Nhd, MemoryOrder::Nhd) {
            pieces.push(piece(range));
            continue;
        }
        // Cut at every head edge of either side.
        let mut at = 0;
        while at < range.len {
            let left = |off: u64| head - (off + at) % head;
            let n = left(range.src_off)
                .min(left(range.dst_off))
                .min(range.len - at);
            pieces.push(piece(Fragment {
                src_off: range.src_off + at,
                dst_off: range.dst_off + at,
                len: n,
            }));
            at += n;
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Segment {
    /// First token.
    t: u64,
    /// Tokens.
    n: u64,
    /// Position of its page in each side's page list.
    src_pos: usize,
    dst_pos: usize,
    /// Slot of its first token in each page.
    src_slot: u64,
    dst_slot: u64,
    /// Whether its first local token on each side does not follow the previous segment's last
    /// (a dealt side skips the tokens the other side's rank does not hold).
    src_gap: bool,
    dst_gap: bool,
}

/// Segments of global tokens `first..n_tokens` both maps hold, in token order.
#[inline]
fn segments(
    first: u64,
    n_tokens: u64,
    maps: (TokenMap, TokenMap),
) -> impl Iterator<Item = Segment> {
    match maps {
        (TokenMap::Paged { page_size: ps }, TokenMap::Paged { page_size: pd }) => {
            Segments::Paged(paged_segments(first, n_tokens, (ps, pd)))
        }
        _ => {
            Segments::Dealt(dealt_segments(n_tokens, maps).filter_map(move |seg| clip(seg, first)))
        }
    }
}

/// The part of `seg` from global token `first` on (None when it ends before): a segment's tokens
/// are consecutive on both sides, so its slots move with its first token. The clipped segment
/// opens the walk, so it has no gap before it.
fn clip(seg: Segment, first: u64) -> Option<Segment> {
    if seg.t + seg.n <= first {
        return None;
    }
    if seg.t >= first {
        return Some(seg);
    }
    let cut = first - seg.t;
    Some(Segment {
        t: first,
        n: seg.n - cut,
        src_slot: seg.src_slot + cut,
        dst_slot: seg.dst_slot + cut,
        src_gap: false,
        dst_gap: false,
        ..seg
    })
}

/// One of the two segment walks (paged sides keep their incremental walk).
enum Segments<P, D> {
    Paged(P),
    Dealt(D),
}

impl<P: Iterator<Item = Segment>, D: Iterator<Item = Segment>> Iterator for Segments<P, D> {
    type Item = Segment;

    // Inlined into every walk: called once per segment, and an out-of-line call returning
    // the segment through memory costs more than the segment's own work.
    #[inline]
    fn next(&mut self) -> Option<Segment> {
        match self {
            Segments::Paged(walk) => walk.next(),
            Segments::Dealt(walk) => walk.next(),
        }
    }
}

/// The dealt walk (module `dcp`) as segments: page, slot and gap of each side's local tokens.
fn dealt_segments(n_tokens: u64, maps: (TokenMap, TokenMap)) -> impl Iterator<Item = Segment> {
    let mut ends: Option<(u64, u64)> = None;
    crate::rules::dcp::dealt_segments(n_tokens, maps).map(move |d| {
        let (ls, ld) = d.local;
        let (src_gap, dst_gap) = ends.map_or((false, false), |(es, ed)| (es != ls, ed != ld));
        ends = Some((ls + d.n, ld + d.n));
        Segment {
            t: d.t,
            n: d.n,
            // Below the page counts the request was validated against, so they fit usize.
            src_pos: d.page.0 as usize,
            dst_pos: d.page.1 as usize,
            src_slot: d.slot.0,
            dst_slot: d.slot.1,
            src_gap,
            dst_gap,
        }
    })
}

/// Segments of tokens `first..n_tokens` over pages of `sizes` tokens, in token order (the walk
/// starts at `first` directly: a delta request costs its own tokens, not the skipped ones).
#[inline]
fn paged_segments(first: u64, n_tokens: u64, sizes: (u64, u64)) -> impl Iterator<Item = Segment> {
    let (ps, pd) = sizes;
    // Positions below the validated page counts, so they fit usize.
    let mut seg = Segment {
        t: first,
        n: 0,
        src_pos: (first / ps) as usize,
        dst_pos: (first / pd) as usize,
        src_slot: first % ps,
        dst_slot: first % pd,
        src_gap: false,
        dst_gap: false,
    };
    std::iter::from_fn(move || {
        // Advance past the previous segment.
        if seg.n > 0 {
            seg.t += seg.n;
            seg.src_slot += seg.n;
            seg.dst_slot += seg.n;
            if seg.src_slot == ps {
                (seg.src_slot, seg.src_pos) = (0, seg.src_pos + 1);
            }
            if seg.dst_slot == pd {
                (seg.dst_slot, seg.dst_pos) = (0, seg.dst_pos + 1);
            }
        }
        if seg.t >= n_tokens {
            return None;
        }
        seg.n = (ps - seg.src_slot)
            .min(pd - seg.dst_slot)
            .min(n_tokens - seg.t);
        Some(seg)
    })
}

/// A side's page list as far as block counting reads it: whether the page at position `pos`
/// (at least 1) is the one at `pos - 1` plus one.
pub(crate) trait PageSteps {
    fn steps(&self, pos: usize) -> bool;
}

impl<T: PageIndex> PageSteps for [T] {
    #[inline]
    fn steps(&self, pos: usize) -> bool {
        self[pos - 1].steps_to(self[pos])
    }
}

/// The page lists a count without the caller's pages assumes, without holding them: `0, 1,
/// 2, …` (`consecutive`) or `0, 2, 4, …` (no two pages consecutive).
pub(crate) struct ModelPages {
    pub(crate) consecutive: bool,
}

impl PageSteps for ModelPages {
    #[inline]
    fn steps(&self, _pos: usize) -> bool {
        self.consecutive
    }
}

/// Why a segment (not the first) cannot join the block before it, per side: `(edge, stepped)`
/// where `edge` says it starts a new page on that side and `stepped` that the page index is the
/// previous one plus one.
#[inline]
fn edges<S: PageSteps + ?Sized, D: PageSteps + ?Sized>(
    seg: &Segment,
    src: &S,
    dst: &D,
) -> [(bool, bool); 2] {
    let side = |slot: u64, pos: usize, step: &dyn Fn(usize) -> bool| {
        let edge = slot == 0 && pos > 0;
        (edge, edge && step(pos))
    };
    [
        side(seg.src_slot, seg.src_pos, &|p| src.steps(p)),
        side(seg.dst_slot, seg.dst_pos, &|p| dst.steps(p)),
    ]
}

/// Whether a segment starts a new block for a contiguous piece of class `class` (1..=4 within
/// its lane).
#[inline]
fn breaks(
    class: usize,
    seg: &Segment,
    [(src_edge, src_step), (dst_edge, dst_step)]: [(bool, bool); 2],
) -> bool {
    let (src_packed, dst_packed) = ((class - 1) & 2 != 0, (class - 1) & 1 != 0);
    seg.src_gap
        || seg.dst_gap
        || (src_edge && !(src_packed && src_step))
        || (dst_edge && !(dst_packed && dst_step))
}

/// Blocks per piece class, segments, blocks and bytes of a request of `n` global tokens over
/// `lists` (pages in token order, at least [`TokenTemplate::pages_needed`] of each; values
/// are not checked). Each lane walks its own tokens over its own lists.
pub(crate) fn count_blocks<S: PageSteps + ?Sized, D: PageSteps + ?Sized>(
    tokens: &TokenTemplate,
    lists: &LaneLists<'_, S, D>,
    first: u64,
    n: u64,
) -> Result<([usize; TOKEN_CLASSES], usize, usize, u64)> {
    count_blocks_in(tokens, lists, &[(first, n); POOLS])
}

/// [`count_blocks`] with each lane walking the range of its pool in `ranges`.
pub(crate) fn count_blocks_in<S: PageSteps + ?Sized, D: PageSteps + ?Sized>(
    tokens: &TokenTemplate,
    lists: &LaneLists<'_, S, D>,
    ranges: &PoolRanges,
) -> Result<([usize; TOKEN_CLASSES], usize, usize, u64)> {
    finish_counts(tokens, walk_counts(tokens, lists, ranges, &|_| true))
}

/// Blocks per piece class (class 0 of a lane: the tokens it moves) and segments of the first
/// `n` global tokens, walking every segment.
fn walk_counts<S: PageSteps + ?Sized, D: PageSteps + ?Sized>(
    tokens: &TokenTemplate,
    lists: &LaneLists<'_, S, D>,
    ranges: &PoolRanges,
    walks: &dyn Fn(Walk) -> bool,
) -> ([u64; TOKEN_CLASSES], u64) {
    let mut class_blocks = [0u64; TOKEN_CLASSES];
    let mut n_segments = 0u64;
    let walked = |at: usize, lane: &Lane| walks(lane.walk) && tokens.reads_pages(at, lane);
    for (at, lane) in tokens.lanes().filter(|&(at, lane)| walked(at, lane)) {
        let classes = &mut class_blocks[at * PIECE_CLASSES..(at + 1) * PIECE_CLASSES];
        let (first, n) = ranges[lane_pool(lane).index()];
        let (start, end) = lane.slots(first, n);
        let (src, dst) = lists.of(lane);
        for (k, seg) in segments(start, end, lane.maps).enumerate() {
            n_segments += 1;
            classes[0] += seg.n;
            let edges = edges(&seg, src, dst);
            for (class, count) in classes.iter_mut().enumerate().skip(1) {
                *count += u64::from(k == 0 || breaks(class, &seg, edges));
            }
        }
    }
    (class_blocks, n_segments)
}

/// The same counts over [`ModelPages`] on both sides, without walking every segment of a long
/// request: token placement and page edges repeat every `period` global tokens (a multiple of
/// every side's page, and of its deal cycle `ranks × lcm(interleave, page)`), and over model
/// pages whether a segment starts a block depends only on where it sits in that cycle. So past
/// the first period every period adds the same counts: `f(q·P + r) = f(P + r) + (q − 1)·(f(2P) −
/// f(P))`, three walks of at most two periods each.
pub(crate) fn model_counts(
    tokens: &TokenTemplate,
    n: u64,
    consecutive: bool,
) -> Result<([usize; TOKEN_CLASSES], usize, usize, u64)> {
    let pages = ModelPages { consecutive };
    let lists = LaneLists::same(&pages, &pages);
    // A window lane walks at most one window's tokens, at the request's end: walked directly.
    let periodic = |walk: Walk| walk.periodic();
    let period = tokens
        .lanes()
        .filter(|&(_, lane)| periodic(lane.walk))
        .try_fold(1u64, |acc, (_, lane)| {
            // A lane of rows repeats every period of its maps' rows, in tokens.
            let rows = lane.tokens_per_row.max(1);
            let acc = lcm(acc, map_period(lane.maps.0)?.checked_mul(rows)?)?;
            lcm(acc, map_period(lane.maps.1)?.checked_mul(rows)?)
        });
    let walk = |len: u64| walk_counts(tokens, &lists, &[(0, len); POOLS], &periodic);
    let (mut classes, mut segments) = match period {
        Some(p) if n / 3 >= p => {
            let (q, r) = (n / p, n % p);
            let (first, second) = (walk(p), walk(2 * p));
            let (head, head_segments) = walk(p + r);
            let overflow = || PlanError::Overflow {
                what: "block count",
            };
            let grow = |base: u64, once: u64, twice: u64| -> Result<u64> {
                (twice - once)
                    .checked_mul(q - 1)
                    .and_then(|more| more.checked_add(base))
                    .ok_or_else(overflow)
            };
            let mut classes = [0u64; TOKEN_CLASSES];
            for c in 0..TOKEN_CLASSES {
                classes[c] = grow(head[c], first.0[c], second.0[c])?;
            }
            (classes, grow(head_segments, first.1, second.1)?)
        }
        _ => walk(n),
    };
    let (direct_classes, direct_segments) =
        walk_counts(tokens, &lists, &[(0, n); POOLS], &|walk| !periodic(walk));
    for (count, more) in classes.iter_mut().zip(direct_classes) {
        *count += more; // only the direct lanes' classes, which the periodic walks left at 0
    }
    segments += direct_segments;
    finish_counts(tokens, (classes, segments))
}

/// Global tokens after which a side's placement and page edges repeat (`None`: past u64).
fn map_period(map: TokenMap) -> Option<u64> {
    match map {
        TokenMap::Paged { page_size } => Some(page_size),
        TokenMap::Dealt {
            page_size,
            ranks,
            interleave,
            ..
        } => lcm(interleave, page_size)?.checked_mul(ranks),
    }
}

fn lcm(a: u64, b: u64) -> Option<u64> {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    (a / gcd(a, b).max(1)).checked_mul(b)
}

/// The counts of [`walk_counts`] as a token shape's fields: blocks per class, segments, blocks
/// and bytes.
fn finish_counts(
    tokens: &TokenTemplate,
    (raw, segments): ([u64; TOKEN_CLASSES], u64),
) -> Result<([usize; TOKEN_CLASSES], usize, usize, u64)> {
    let overflow = |what| PlanError::Overflow { what };
    let mut class_blocks = [0usize; TOKEN_CLASSES];
    for (out, &count) in class_blocks.iter_mut().zip(&raw) {
        *out = usize::try_from(count).map_err(|_| overflow("block count"))?;
    }
    let n_segments = usize::try_from(segments).map_err(|_| overflow("segments"))?;
    let mut total_bytes = 0u64;
    for (lane, _) in tokens.lanes() {
        total_bytes = raw[lane * PIECE_CLASSES]
            .checked_mul(tokens.lane_bytes[lane])
            .and_then(|b| b.checked_add(total_bytes))
            .ok_or(overflow("total bytes"))?;
    }
    let n_blocks = tokens
        .class_pieces
        .iter()
        .zip(class_blocks)
        .try_fold(0usize, |acc, (&pieces, blocks)| {
            acc.checked_add(pieces.checked_mul(blocks)?)
        })
        .ok_or(overflow("block count"))?;
    Ok((class_blocks, n_segments, n_blocks, total_bytes))
}

/// Emits a validated token request (`lists`: the pages holding its tokens, per pool; every
/// index below the `limits` of its pool's list, per pool and side) into `out`, at least `shape.n_blocks` long. A piece with the same shape as the last
/// piece of its lane is that piece's blocks shifted by the difference of their bases.
///
/// # Errors
/// [`PlanError::InputChanged`] when an index changed since validation.
pub(crate) fn emit_tokens<S: PageIndex, D: PageIndex>(
    tokens: &TokenTemplate,
    lists: &LaneLists<'_, [S], [D]>,
    limits: [(u64, u64); POOLS],
    shape: &TokenShape,
    mut out: Columns<'_>,
) -> Result<()> {
    let mut at = 0usize;
    // The last piece emitted of each lane: window and full layers alternate in a hybrid-window
    // model, so the piece before is often of the other lane while the one before it matches.
    let mut previous: [Option<(usize, &Piece)>; MAX_LANES] = [None; MAX_LANES];
    for piece in &tokens.pieces {
        let class = piece.class();
        let expected = shape.class_blocks[class];
        let start = at;
        if at + expected > out.capacity() {
            return Err(PlanError::InputChanged);
        }
        match previous[piece.lane] {
            Some((from, prev)) if prev.same_shape(piece) => {
                let (ds, dd) = (
                    piece.src.base.wrapping_sub(prev.src.base),
                    piece.dst.base.wrapping_sub(prev.dst.base),
                );
                for k in 0..expected {
                    out.src_addrs[at + k] = out.src_addrs[from + k].wrapping_add(ds);
                    out.dst_addrs[at + k] = out.dst_addrs[from + k].wrapping_add(dd);
                    out.lengths[at + k] = out.lengths[from + k];
                }
                at += expected;
            }
            _ => {
                let lane = &tokens.lanes[piece.lane];
                at = emit_piece(
                    piece,
                    class % PIECE_CLASSES,
                    lists.of(lane),
                    (
                        limits[lane.pools.0.index()].0,
                        limits[lane.pools.1.index()].1,
                    ),
                    {
                        let (first, n) = shape.pool_ranges[lane_pool(lane).index()];
                        lane.slots(first, n)
                    },
                    at,
                    &mut out,
                )?;
                if at - start != expected {
                    return Err(PlanError::InputChanged);
                }
            }
        }
        previous[piece.lane] = Some((start, piece));
    }
    Ok(())
}

/// Emits a validated token request (as [`emit_tokens`]) as one member of a segment of fused
/// token requests laid out piece major, each piece's blocks request after request: piece `p`'s
/// blocks go from `cursor[p]` and stay below `starts[p + 1]`; for a class in `joins` the piece's
/// first block is joined to the block before `cursor[p]` (the previous member's last block of
/// that piece, checked to end on both sides where this one starts). Advances `cursor`. Writes
/// only into `out`: no scratch columns.
///
/// # Errors
/// [`PlanError::InputChanged`] when an index changed since validation (a block count, a
/// limit or a join that no longer holds).
pub(crate) fn emit_tokens_joined<S: PageIndex, D: PageIndex>(
    tokens: &TokenTemplate,
    lists: &LaneLists<'_, [S], [D]>,
    limits: [(u64, u64); POOLS],
    shape: &TokenShape,
    joins: u64,
    (cursor, starts): (&mut [usize], &[usize]),
    out: &mut Columns<'_>,
) -> Result<()> {
    if cursor.len() != tokens.pieces.len() || starts.len() != tokens.pieces.len() + 1 {
        return Err(PlanError::InputChanged);
    }
    // As in `emit_tokens`: a piece of the same shape as the last of its lane copies its blocks
    // (from where that piece's blocks of this member begin), shifted by the bases' difference.
    let mut previous: [Option<(usize, &Piece)>; MAX_LANES] = [None; MAX_LANES];
    for (p, piece) in tokens.pieces.iter().enumerate() {
        let class = piece.class();
        let expected = shape.class_blocks[class];
        let joined = expected > 0 && joins >> class & 1 != 0;
        let at = if joined {
            // The previous member's last block of this piece: inside this piece's blocks.
            match cursor[p].checked_sub(1) {
                Some(at) if at >= starts[p] => at,
                _ => return Err(PlanError::InputChanged),
            }
        } else {
            cursor[p]
        };
        let end = starts[p + 1];
        if at > end || end - at < expected || end > out.capacity() {
            return Err(PlanError::InputChanged);
        }
        // A joined piece writes at least one block, so `at` is below `end` here.
        let kept = if joined {
            (out.src_addrs[at], out.dst_addrs[at], out.lengths[at])
        } else {
            (0, 0, 0)
        };
        match previous[piece.lane] {
            Some((from, prev)) if prev.same_shape(piece) => {
                let (ds, dd) = (
                    piece.src.base.wrapping_sub(prev.src.base),
                    piece.dst.base.wrapping_sub(prev.dst.base),
                );
                for k in 0..expected {
                    out.src_addrs[at + k] = out.src_addrs[from + k].wrapping_add(ds);
                    out.dst_addrs[at + k] = out.dst_addrs[from + k].wrapping_add(dd);
                    out.lengths[at + k] = out.lengths[from + k];
                }
                // The copied first block is already the joined one (same shape, same class):
                // it starts where the previous member's block of this piece started.
                if joined && (out.src_addrs[at], out.dst_addrs[at]) != (kept.0, kept.1) {
                    return Err(PlanError::InputChanged);
                }
            }
            _ => {
                let lane = &tokens.lanes[piece.lane];
                let written = emit_piece(
                    piece,
                    class % PIECE_CLASSES,
                    lists.of(lane),
                    (
                        limits[lane.pools.0.index()].0,
                        limits[lane.pools.1.index()].1,
                    ),
                    {
                        let (first, n) = shape.pool_ranges[lane_pool(lane).index()];
                        lane.slots(first, n)
                    },
                    0,
                    &mut out.range(at..end),
                )?;
                if written != expected {
                    return Err(PlanError::InputChanged);
                }
                if joined {
                    let continues = kept.0.checked_add(kept.2) == Some(out.src_addrs[at])
                        && kept.1.checked_add(kept.2) == Some(out.dst_addrs[at]);
                    let Some(len) = kept.2.checked_add(out.lengths[at]).filter(|_| continues)
                    else {
                        return Err(PlanError::InputChanged);
                    };
                    (out.src_addrs[at], out.dst_addrs[at], out.lengths[at]) = (kept.0, kept.1, len);
                }
            }
        }
        previous[piece.lane] = Some((at, piece));
        cursor[p] = at + expected;
    }
    Ok(())
}

/// Writes one piece's blocks from position `at`; returns the position after them.
#[allow(clippy::too_many_arguments)]
fn emit_piece<S: PageIndex, D: PageIndex>(
    piece: &Piece,
    class: usize,
    (src, dst): (&[S], &[D]),
    limits: (u64, u64),
    (first, n_tokens): (u64, u64),
    mut at: usize,
    out: &mut Columns<'_>,
) -> Result<usize> {
    // Re-checked while writing: an index changed since validation must not make an address.
    // The error is built only on failure: an eagerly built `PlanError` is dropped on every
    // segment (a call, since the enum owns strings), a fifth of a token-major plan's time.
    let page = |value: i64, limit: u64| -> Result<u64> {
        match u64::try_from(value) {
            Ok(v) if v < limit => Ok(v),
            _ => Err(PlanError::InputChanged),
        }
    };
    let capacity = out.capacity();
    let push = |out: &mut Columns<'_>, at: usize, s: u64, d: u64, len: u64| -> Result<usize> {
        if at >= capacity {
            return Err(PlanError::InputChanged);
        }
        out.src_addrs[at] = s;
        out.dst_addrs[at] = d;
        out.lengths[at] = len;
        Ok(at + 1)
    };
    let (ps, pd, len) = (piece.src, piece.dst, piece.len); // in registers for the loop
    let mut open = false; // whether the last block written may be extended
    for seg in segments(first, n_tokens, (ps.map, pd.map)) {
        let sp = page(src[seg.src_pos].get(), limits.0)?;
        let dp = page(dst[seg.dst_pos].get(), limits.1)?;
        // In bounds (checked just above), so inside the buffer: no overflow.
        let s = ps.base + sp * ps.page_stride + seg.src_slot * ps.slot_stride;
        let d = pd.base + dp * pd.page_stride + seg.dst_slot * pd.slot_stride;
        if class == 0 {
            for k in 0..seg.n {
                let (s, d) = (s + k * ps.slot_stride, d + k * pd.slot_stride);
                at = push(out, at, s, d, len)?;
            }
            continue;
        }
        let bytes = seg.n * len;
        if open && !breaks(class, &seg, edges(&seg, src, dst)) {
            out.lengths[at - 1] += bytes;
        } else {
            at = push(out, at, s, d, bytes)?;
            open = true;
        }
    }
    Ok(at)
}

// A mask of token classes holds every class.
const _: () = assert!(TOKEN_CLASSES <= 64);

/// The token classes whose blocks continue from one validated token request (`prev`) into
/// the next (`next`) of a batch, as a bit mask over [`TOKEN_CLASSES`]: a class is in it when
/// both requests emit blocks of it and, for every piece of the class, `next`'s first block
/// starts on both sides exactly where `prev`'s last block ends, so the two blocks are one block
/// of the same bytes. Only contiguous classes (a block per run of tokens) can continue; a
/// class whose pieces disagree stays out (one count per class describes a merged plan).
/// Indices are read without their limits: emission checks the merge again and refuses an
/// index that changed.
pub(crate) fn boundary_merges<S: PageIndex, D: PageIndex>(
    tokens: &TokenTemplate,
    prev: (&LaneLists<'_, [S], [D]>, &TokenShape),
    next: (&LaneLists<'_, [S], [D]>, &TokenShape),
) -> u64 {
    // Each moving lane's last segment in `prev` and first in `next`.
    let mut ends: [Option<(Segment, Segment)>; MAX_LANES] = [None; MAX_LANES];
    for (at, lane) in tokens.lanes().filter(|&(at, _)| tokens.moving(at)) {
        let walk = |shape: &TokenShape| {
            let (first, n) = shape.pool_ranges[lane_pool(lane).index()];
            let (start, end) = lane.slots(first, n);
            segments(start, end, lane.maps)
        };
        let last = match lane.maps {
            (TokenMap::Paged { page_size: ps }, TokenMap::Paged { page_size: pd }) => {
                let (first, n) = prev.1.pool_ranges[lane_pool(lane).index()];
                let (start, end) = lane.slots(first, n);
                // The paged walk's last segment starts at the later of the last page edges.
                let t = (end.saturating_sub(1) / ps * ps)
                    .max(end.saturating_sub(1) / pd * pd)
                    .max(start);
                paged_segments(t, end, (ps, pd)).next()
            }
            _ => walk(prev.1).last(),
        };
        if let (Some(last), Some(first)) = (last, walk(next.1).next()) {
            ends[at] = Some((last, first));
        }
    }
    let (mut adjacent, mut apart) = (0u64, 0u64);
    // A piece of the same shape as a head has the head's answer: its blocks are the head's,
    // shifted by the difference of their bases on both sides.
    for piece in tokens.shape_heads.iter().map(|&k| &tokens.pieces[k]) {
        let class = piece.class();
        if prev.1.class_blocks[class] == 0 || next.1.class_blocks[class] == 0 {
            continue;
        }
        let lane = &tokens.lanes[piece.lane];
        let touches = ends[piece.lane].is_some_and(|(last, first)| {
            let (ps, pd) = prev.0.of(lane);
            let (ns, nd) = next.0.of(lane);
            let place = |side: &PieceSide, page: Option<i64>, slot: u64| {
                let page = u64::try_from(page?).ok()?;
                side.base
                    .checked_add(page.checked_mul(side.page_stride)?)?
                    .checked_add(slot.checked_mul(side.slot_stride)?)
            };
            let get = |list: &[S], pos: usize| list.get(pos).map(|p| p.get());
            let getd = |list: &[D], pos: usize| list.get(pos).map(|p| p.get());
            // Contiguous pieces: a block's bytes end where its last segment's tokens end.
            let prev_end = (
                place(&piece.src, get(ps, last.src_pos), last.src_slot + last.n),
                place(&piece.dst, getd(pd, last.dst_pos), last.dst_slot + last.n),
            );
            let next_start = (
                place(&piece.src, get(ns, first.src_pos), first.src_slot),
                place(&piece.dst, getd(nd, first.dst_pos), first.dst_slot),
            );
            prev_end.0.is_some() && prev_end.1.is_some() && prev_end == next_start
        });
        let bit = 1u64 << class;
        if touches {
            adjacent |= bit;
        } else {
            apart |= bit;
        }
    }
    adjacent & !apart
}

/// Where one segment of a lane's walk sits on the destination side: position in the page list,
/// first slot, tokens.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DstSegment {
    pos: usize,
    slot: u64,
    n: u64,
}

/// One lane's walk over a validated token request (module `pack`, row gathers): the source row
/// of every token it moves, in token order (`row = source page index × tokens per page + slot`),
/// and its segments' destination places. Every index read is re-checked against `limits`.
///
/// # Errors
/// [`PlanError::InputChanged`] when an index changed since validation.
pub(crate) fn lane_rows<S: PageIndex, D: PageIndex>(
    maps: (TokenMap, TokenMap),
    src: &[S],
    dst: &[D],
    limits: (u64, u64),
    n_tokens: u64,
) -> Result<(Vec<u64>, Vec<DstSegment>)> {
    let rows_per_page = maps.0.page_size();
    let local = maps
        .0
        .local_count(n_tokens)
        .min(maps.1.local_count(n_tokens));
    let mut rows = Vec::new();
    rows.try_reserve_exact(usize::try_from(local).unwrap_or(usize::MAX))
        .map_err(|_| PlanError::out_of_memory::<u64>("gather rows", local as usize))?;
    let mut places = Vec::new();
    for seg in segments(0, n_tokens, maps) {
        let (Some(s), Some(d)) = (src.get(seg.src_pos), dst.get(seg.dst_pos)) else {
            return Err(PlanError::InputChanged);
        };
        match (u64::try_from(s.get()), u64::try_from(d.get())) {
            (Ok(s), Ok(d)) if s < limits.0 && d < limits.1 => {
                // In bounds, so row × item stays inside the buffer: no overflow.
                let first = s * rows_per_page + seg.src_slot;
                rows.extend(first..first + seg.n);
            }
            _ => return Err(PlanError::InputChanged),
        }
        places.push(DstSegment {
            pos: seg.dst_pos,
            slot: seg.dst_slot,
            n: seg.n,
        });
    }
    Ok((rows, places))
}

/// The destination bytes of `piece` over a lane's segments, in token order, as `(address,
/// bytes)` chunks contiguous on the destination side (a segment whole when the piece's bytes
/// fill its slots, else one chunk per token). Every index read is re-checked against `limit`.
///
/// # Errors
/// [`PlanError::InputChanged`] when an index changed since validation.
pub(crate) fn dst_chunks<D: PageIndex>(
    piece: &Piece,
    places: &[DstSegment],
    dst: &[D],
    limit: u64,
    mut chunk: impl FnMut(u64, u64) -> Result<()>,
) -> Result<()> {
    let (side, len) = (piece.dst, piece.len);
    let whole = len == side.slot_stride;
    for seg in places {
        let page = match dst.get(seg.pos).map(|v| u64::try_from(v.get())) {
            Some(Ok(v)) if v < limit => v,
            _ => return Err(PlanError::InputChanged),
        };
        // In bounds (checked just above), so inside the buffer: no overflow.
        let d = side.base + page * side.page_stride + seg.slot * side.slot_stride;
        if whole {
            chunk(d, seg.n * len)?;
        } else {
            for k in 0..seg.n {
                chunk(d + k * side.slot_stride, len)?;
            }
        }
    }
    Ok(())
}
