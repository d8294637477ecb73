//! The one address model: where the bytes of a pair of entries live, and the pieces that move
//! them.
//!
//! Item `i` of an entry is the `item_len` bytes at `base + i × stride`. A template turns its
//! entry pairs ([`PairSpec`]) into [`Piece`]s once; a request only multiplies pieces by pages,
//! runs or tokens. A piece says, per side, where token `t` of a request sits: the side's
//! [`TokenMap`] turns `t` into (position in that side's page list, slot in the page), and the
//! byte address is `base + page × page_stride + slot × slot_stride`; `len` bytes move per token.
//!
//! Every way kvplan moves bytes is a piece:
//! - a page plan is a token plan whose "token" is the whole page (one slot per page, slot stride
//!   = page stride): a whole item, a coalesced group of items (`len` = the group's width) or a
//!   fragment (bases shifted by the fragment's offsets, head slices included);
//! - a token plan between different page sizes or memory orders has one piece per pair (or per
//!   head) with each side's own tokens per page;
//! - a state slot is a one-page request of a piece whose "token" is the slot.
//!
//! A piece is contiguous on both sides across slots when `len` equals both slot strides; then a
//! run of consecutive pages (or tokens) is one block. That is a property of the piece, not a
//! separate type.

use crate::peer::entry::PoolId;

/// How one side places the tokens of a request: token `t` → (index into that side's page list,
/// slot inside the page). A decode context-parallel rank holds only the tokens dealt to it
/// ([`TokenMap::Dealt`], module `dcp`), at consecutive local positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenMap {
    /// Tokens fill pages of `page_size` slots in order: `t → (t / page_size, t % page_size)`.
    Paged {
        /// Tokens (slots) per page, at least 1.
        page_size: u64,
    },
    /// Deals of `interleave` consecutive tokens go to `ranks` ranks in turn; this side is rank
    /// `rank` and holds global token `t` when `(t / interleave) % ranks == rank`, at local token
    /// `l = (t / (interleave·ranks))·interleave + t % interleave`, page `l / page_size`, slot
    /// `l % page_size` (arithmetic in module `dcp`).
    Dealt {
        /// Local tokens (slots) per page, at least 1.
        page_size: u64,
        /// Ranks the tokens are dealt over.
        ranks: u64,
        /// This side's rank, below `ranks`.
        rank: u64,
        /// Tokens per deal, at least 1.
        interleave: u64,
    },
}

impl TokenMap {
    /// Slots per page.
    pub fn page_size(self) -> u64 {
        match self {
            TokenMap::Paged { page_size } | TokenMap::Dealt { page_size, .. } => page_size,
        }
    }

    /// Where token `t` (held by this side) sits: (position in the side's page list, slot in
    /// that page).
    pub fn locate(self, t: u64) -> (u64, u64) {
        let local = self.local(t);
        let page_size = self.page_size();
        (local / page_size, local % page_size)
    }

    /// Pages of the side's list holding its share of the first `n_tokens` tokens.
    pub fn pages_for(self, n_tokens: u64) -> u64 {
        self.local_count(n_tokens).div_ceil(self.page_size())
    }
}

/// One side of a piece: token `t` at (page `p`, slot `s`) is at `base + p × page_stride + s ×
/// slot_stride`, with `(p, s)` from `map`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PieceSide {
    /// Address of slot 0 of page 0 (a fragment's or head's offset included).
    pub base: u64,
    /// Bytes between consecutive pages (the entry's stride).
    pub page_stride: u64,
    /// Bytes between consecutive slots of a page.
    pub slot_stride: u64,
    /// Token → (page, slot).
    pub map: TokenMap,
}

impl PieceSide {
    /// A side of a page piece: one slot per page, so the slot stride is the page stride.
    pub(crate) fn of_pages(base: u64, stride: u64) -> Self {
        Self {
            base,
            page_stride: stride,
            slot_stride: stride,
            map: TokenMap::Paged { page_size: 1 },
        }
    }

    /// Whether consecutive pages continue each other when the piece covers whole pages
    /// (`page_stride == page_size × slot_stride`).
    pub fn packed(&self) -> bool {
        self.map.page_size().checked_mul(self.slot_stride) == Some(self.page_stride)
    }
}

/// One emission unit: `len` bytes of every token of a request, from the source side to the
/// destination side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Where the bytes come from.
    pub src: PieceSide,
    /// Where they go.
    pub dst: PieceSide,
    /// Bytes per token (per page for a page piece).
    pub len: u64,
    /// The position of the [`Lane`] it follows in its token template's list (0, the request's
    /// tokens, for a page piece).
    pub lane: usize,
}

impl Piece {
    /// A page piece: page `k` is `len` bytes at `src_base + k × src_stride` and `dst_base + k ×
    /// dst_stride`.
    pub(crate) fn of_pages(src: (u64, u64), dst: (u64, u64), len: u64) -> Self {
        Self {
            src: PieceSide::of_pages(src.0, src.1),
            dst: PieceSide::of_pages(dst.0, dst.1),
            len,
            lane: 0,
        }
    }

    /// Whether consecutive slots are contiguous on both sides (`len` equals both slot strides):
    /// a run of consecutive pages of a page piece is one block of `n × len` bytes; otherwise one
    /// block per page (per token).
    pub fn per_run(&self) -> bool {
        self.len == self.src.slot_stride && self.len == self.dst.slot_stride
    }

    /// The piece's class among [`TOKEN_CLASSES`]: its lane (which token walk it follows) times
    /// [`PIECE_CLASSES`] plus its class within the lane.
    pub fn class(&self) -> usize {
        self.lane * PIECE_CLASSES + self.token_class()
    }

    /// The piece's token class within its lane (see [`PIECE_CLASSES`]).
    pub(crate) fn token_class(&self) -> usize {
        if self.per_run() {
            1 + 2 * usize::from(self.src.packed()) + usize::from(self.dst.packed())
        } else {
            0
        }
    }

    /// Same strides, maps and length: the blocks of the two pieces differ only by their bases.
    pub(crate) fn same_shape(&self, other: &Self) -> bool {
        let shape = |p: &Self| {
            (
                (p.src.page_stride, p.src.slot_stride, p.src.map),
                (p.dst.page_stride, p.dst.slot_stride, p.dst.map),
                p.len,
                p.lane,
            )
        };
        shape(self) == shape(other)
    }
}

/// Token classes of pieces: 0 = one block per token; `1 + 2 × src_packed + dst_packed` = one
/// block per run of tokens contiguous on both sides (a page edge on a side joins only when that
/// side's pages are packed and its next page index is the previous plus one).
pub const PIECE_CLASSES: usize = 5;

/// Which tokens of a request a lane walks. The token maps a lane walks them over (dealt over
/// decode context-parallel ranks, or paged) are the lane's own data, so dealing is not a walk:
/// a new kind of walk (a chunked-local span) is one arm here, as a ring's last positions are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Walk {
    /// Every moved token of the request (`first..n`).
    All,
    /// The draft tokens a decode-context-parallel template sends whole (module `dcp`): every
    /// moved token, over each side's undealt virtual pages.
    DraftWhole,
    /// A sliding window of this many tokens: the request's last ones (from its first moved
    /// token when that is later).
    Window(u64),
    /// The live positions of a ring-state pair (module `rings`): each side keeps position `p`
    /// of a request in row `p mod rows` of the request's slot, so both hold the last
    /// `min(src_rows, dst_rows)` positions: a window of that many tokens over a modular token
    /// map. Its lane is a ring lane of the template's slot plan ([`crate::RingLane`]), whose
    /// rows are addressed by request slot, not by page.
    Ring {
        /// Rows per request slot of the source (prefill) ring.
        src_rows: u64,
        /// Rows per request slot of the destination (decode) ring.
        dst_rows: u64,
    },
}

impl Walk {
    /// The first global token the walk moves of a request moving tokens `first..n`.
    pub(crate) fn start(self, first: u64, n: u64) -> u64 {
        match self {
            Walk::Window(window) => first.max(n.saturating_sub(window)),
            // The same rule as a window: the positions both rings hold.
            Walk::Ring { src_rows, dst_rows } => {
                Walk::Window(src_rows.min(dst_rows)).start(first, n)
            }
            Walk::All | Walk::DraftWhole => first,
        }
    }

    /// Whether the walk's block counts repeat with its token maps' period (a window walks at
    /// most one window at the request's end, so it is counted directly; so does a ring).
    pub(crate) fn periodic(self) -> bool {
        !matches!(self, Walk::Window(_) | Walk::Ring { .. })
    }

    /// Each side's rows per request slot of a ring walk (`None`: not a ring).
    pub fn ring_rows(self) -> Option<(u64, u64)> {
        match self {
            Walk::Ring { src_rows, dst_rows } => Some((src_rows, dst_rows)),
            Walk::All | Walk::DraftWhole | Walk::Window(_) => None,
        }
    }
}

/// One token walk of a token template: which tokens it moves, how each side places them, and
/// which of each side's page lists holds them. Every token piece follows one lane (its
/// [`Piece::lane`] is the lane's position in the template's list), and each lane's walk counts
/// its own blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lane {
    /// Which tokens it moves.
    pub walk: Walk,
    /// How each side places them.
    pub maps: (TokenMap, TokenMap),
    /// Which page list of each side holds them.
    pub pools: (PoolId, PoolId),
    /// Tokens per slot of its maps (1: a slot per token; a pool of rows: its
    /// [`crate::Pool::tokens_per_row`]), the same on both sides.
    pub tokens_per_row: u64,
}

impl Lane {
    /// The slots it moves of a request moving global tokens `first..n`: its walk's tokens,
    /// as rows when a slot holds several tokens. A row moves once its last token is in the
    /// range: rows `start / R .. n / R` (rounded down), so a partial last row waits for the
    /// request that completes it, and a delta whose first token falls inside a row moves
    /// that row whole (the request before it, ending inside the row, did not move it).
    pub fn slots(&self, first: u64, n: u64) -> (u64, u64) {
        let per = self.tokens_per_row.max(1);
        (self.walk.start(first, n) / per, n / per)
    }
}

/// The most lanes one token template holds (the target tokens, a DCP template's draft tokens,
/// a sliding window, and one per further pool): the bound of the per-request class counts,
/// which stay on the stack.
pub const MAX_LANES: usize = 3 + crate::peer::entry::POOLS;

/// Classes of a token template's pieces: `lane × PIECE_CLASSES + piece class`.
pub const TOKEN_CLASSES: usize = PIECE_CLASSES * MAX_LANES;

/// Bytes the pieces move per page (per token), or overflow of `what`.
pub(crate) fn total_len(pieces: &[Piece], what: &'static str) -> crate::error::Result<u64> {
    let total = pieces
        .iter()
        .try_fold(0u64, |acc, p| acc.checked_add(p.len));
    total.ok_or(crate::error::PlanError::Overflow { what })
}

/// Everything planning needs about one source/destination entry pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairSpec {
    /// Index of the source entry in the source layout.
    pub src_entry: usize,
    /// Index of the destination entry in the destination layout.
    pub dst_entry: usize,
    /// Source buffer base address.
    pub src_base: u64,
    /// Destination buffer base address.
    pub dst_base: u64,
    /// Bytes per source item (equal to `dst_item_len` unless heads are re-sliced between
    /// different TP sizes or page sizes differ; checked at template time).
    pub item_len: u64,
    /// Bytes per destination item.
    pub dst_item_len: u64,
    /// Items the source buffer holds.
    pub src_capacity: u64,
    /// Items the destination buffer holds.
    pub dst_capacity: u64,
    /// Bytes between consecutive source items.
    pub src_stride: u64,
    /// Bytes between consecutive destination items.
    pub dst_stride: u64,
}

impl PairSpec {
    /// The page piece moving bytes `f.src_off..` of every source item to `f.dst_off..` of its
    /// destination item (the fragment lies inside both items: checked by the caller).
    pub fn piece(&self, f: Fragment) -> Piece {
        Piece::of_pages(
            (self.src_base + f.src_off, self.src_stride),
            (self.dst_base + f.dst_off, self.dst_stride),
            f.len,
        )
    }

    /// The fragment of the whole item.
    pub fn whole(&self) -> Fragment {
        Fragment {
            src_off: 0,
            dst_off: 0,
            len: self.item_len,
        }
    }
}

/// Bytes `src_off..src_off+len` of a source item go to `dst_off..dst_off+len` of its
/// destination item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fragment {
    /// Offset inside the source item.
    pub src_off: u64,
    /// Offset inside the destination item.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
}

impl Fragment {
    /// The bytes both `self` and `other` move to the same place (`None`: none): where both map
    /// a source byte, to the same destination byte.
    pub fn agree(&self, other: &Fragment) -> Option<Fragment> {
        // Same shift on both: the two maps agree on the overlap of their source ranges.
        if self.dst_off.wrapping_sub(self.src_off) != other.dst_off.wrapping_sub(other.src_off) {
            return None;
        }
        let start = self.src_off.max(other.src_off);
        let stop = (self.src_off + self.len).min(other.src_off + other.len);
        (start < stop).then(|| Fragment {
            src_off: start,
            dst_off: self.dst_off + (start - self.src_off),
            len: stop - start,
        })
    }
}

/// Which bytes of each item a template moves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Fragments {
    /// Every item whole (one fragment `(0, 0, item_len)` per pair).
    #[default]
    Whole,
    /// The same fragments for every emitting page pair.
    Every(Vec<Fragment>),
    /// Per page pair in planning order (elided pairs included); `None` = the whole item.
    PerPair(Vec<Option<Vec<Fragment>>>),
}

impl Fragments {
    /// The fragments given for page pair `index` (`None`: the whole item).
    pub(crate) fn of_pair(&self, index: usize) -> Option<&[Fragment]> {
        match self {
            Fragments::Whole => None,
            Fragments::Every(list) => Some(list),
            Fragments::PerPair(lists) => lists.get(index).and_then(|l| l.as_deref()),
        }
    }
}
