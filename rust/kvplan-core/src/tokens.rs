//! Token-exact planning: prefill and decode with different tokens per page (or a partial last
//! page at the same page size).
//!
//! Token `t` of a request lives at source page `src_pages[t / P_s]`, slot `t % P_s`, and at
//! destination page `dst_pages[t / P_d]`, slot `t % P_d`. The request is cut into *segments*:
//! maximal token ranges inside one source page and one destination page (their edges are the
//! multiples of `P_s` and of `P_d`, so every segment is a whole number of `gcd(P_s, P_d)`-token
//! units, except a partial last one). Each entry pair becomes one or more [`TokenPiece`]s,
//! fixed at template time:
//!
//! - token-major items (`NHD`, also every layout that publishes no attention geometry, and MLA
//!   latents): one piece per pair, the whole token (`token bytes = item_len / page_size`);
//! - head-major items (`HND`: `[heads][tokens][head bytes]`, on either side): one piece per
//!   head, `head_dim * dtype_size` bytes per token.
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
//! (a piece with the same strides as the one before it is that piece's blocks shifted by the
//! difference of their bases).

use crate::error::{PlanError, Result, Side};
use crate::heads::{HeadSlicing, SlicedHeads};
use crate::layout::{AttentionGeometry, Layout, MemoryOrder};
use crate::plan::{Columns, PlanSummary};
use crate::runs::PageIndex;
use crate::template::{Fragments, PairSpec, Template, check_unique};

/// Piece classes: 0 = one block per token; `1 + 2 * src_packed + dst_packed` = one block per
/// run of tokens contiguous on both sides (a page edge on a side joins only when that side's
/// pages are packed and its next page index is the previous plus one).
pub const TOKEN_CLASSES: usize = 5;

/// One emission unit of a token plan: `len` bytes of every token of one entry pair (the whole
/// token, or one head of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenPiece {
    /// Source address of slot 0 of page 0 (the head's offset included).
    pub src_base: u64,
    /// Destination address of slot 0 of page 0.
    pub dst_base: u64,
    /// Bytes between consecutive source pages (the entry's stride).
    pub src_page_stride: u64,
    /// Bytes between consecutive destination pages.
    pub dst_page_stride: u64,
    /// Bytes between consecutive source tokens of the piece.
    pub src_slot: u64,
    /// Bytes between consecutive destination tokens of the piece.
    pub dst_slot: u64,
    /// Bytes per token.
    pub len: u64,
    /// Its class (see [`TOKEN_CLASSES`]).
    pub class: usize,
}

impl TokenPiece {
    fn new(
        bases: (u64, u64),
        page_strides: (u64, u64),
        slots: (u64, u64),
        len: u64,
        page_sizes: (u64, u64),
    ) -> Self {
        let contiguous = len == slots.0 && len == slots.1;
        // Both products are at most the item length (checked at template time).
        let packed = |stride: u64, size: u64, slot: u64| stride == size * slot;
        let class = if contiguous {
            1 + 2 * usize::from(packed(page_strides.0, page_sizes.0, slots.0))
                + usize::from(packed(page_strides.1, page_sizes.1, slots.1))
        } else {
            0
        };
        Self {
            src_base: bases.0,
            dst_base: bases.1,
            src_page_stride: page_strides.0,
            dst_page_stride: page_strides.1,
            src_slot: slots.0,
            dst_slot: slots.1,
            len,
            class,
        }
    }

    /// Same strides, slots, length and class: blocks differ only by the bases.
    fn same_shape(&self, other: &Self) -> bool {
        (
            self.src_page_stride,
            self.dst_page_stride,
            self.src_slot,
            self.dst_slot,
            self.len,
            self.class,
        ) == (
            other.src_page_stride,
            other.dst_page_stride,
            other.src_slot,
            other.dst_slot,
            other.len,
            other.class,
        )
    }
}

/// A template's token pieces, built once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenTemplate {
    /// Tokens per source page.
    pub src_page_size: u64,
    /// Tokens per destination page.
    pub dst_page_size: u64,
    /// Pieces in block order (page pairs in planning order, heads next).
    pub pieces: Vec<TokenPiece>,
    /// Per page pair: its pieces, `pieces[start..end]` (empty for an elided pair).
    pub pair_pieces: Vec<(usize, usize)>,
    /// Pieces per class.
    pub class_pieces: [usize; TOKEN_CLASSES],
    /// Bytes moved per token (sum of piece lengths).
    pub bytes_per_token: u64,
}

/// The size of a token request's plan, known before any output exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenShape {
    /// Tokens planned.
    pub n_tokens: u64,
    /// Leading source pages holding them (`ceil(n_tokens / P_s)`).
    pub src_pages: usize,
    /// Leading destination pages holding them.
    pub dst_pages: usize,
    /// Segments (token ranges inside one page on each side).
    pub n_segments: usize,
    /// Blocks one piece of each class emits.
    pub class_blocks: [usize; TOKEN_CLASSES],
    /// Blocks of the whole plan.
    pub n_blocks: usize,
    /// Bytes the plan moves.
    pub total_bytes: u64,
}

/// Whether whole pages cannot be copied as they are: the page sizes differ, or one side is
/// token-major and the other head-major. Every page plan between such layouts is a token plan.
pub fn needs_tokens(src: &Layout, dst: &Layout) -> bool {
    src.context().page_size != dst.context().page_size || memory_order(src) != memory_order(dst)
}

fn memory_order(layout: &Layout) -> MemoryOrder {
    layout
        .context()
        .attention
        .map_or(MemoryOrder::Nhd, |g| g.memory_order)
}

/// Which heads of a token one pair moves and where they sit on each side: `count` heads of
/// `head` bytes, starting `skip` heads into what each side's rank holds, in tokens of `token`
/// bytes per side.
#[derive(Debug, Clone, Copy)]
struct HeadRange {
    skip: (u64, u64),
    count: u64,
    head: u64,
    token: (u64, u64),
}

impl HeadRange {
    /// The heads a head-sliced pair moves (its items were checked against each side's
    /// geometry by [`HeadSlicing::check_page_items`]).
    fn sliced(heads: SlicedHeads) -> Self {
        Self {
            skip: (heads.src_skip, heads.dst_skip),
            count: heads.count,
            head: heads.head_bytes,
            token: (
                heads.src_heads * heads.head_bytes,
                heads.dst_heads * heads.head_bytes,
            ),
        }
    }

    /// Every head of a token whose bytes are the same on both sides.
    fn whole(token_bytes: u64, head: u64) -> Self {
        Self {
            skip: (0, 0),
            count: token_bytes / head,
            head,
            token: (token_bytes, token_bytes),
        }
    }
}

impl TokenTemplate {
    /// Token pieces for `page_pairs`; an error says why tokens cannot be mapped (items that
    /// are not whole tokens, different token sizes, a head-major item whose size disagrees with
    /// its geometry, fragments). With a head slicing, only the heads it sends move, at each
    /// side's own offsets; a pair that is not the elected sender, or holds no head of the
    /// decode rank, has no pieces.
    ///
    /// # Errors
    /// [`PlanError::TokenSize`], [`PlanError::TokenBytes`], [`PlanError::HeadLayout`],
    /// [`PlanError::HeadMismatch`], [`PlanError::Geometry`].
    pub(crate) fn build(
        src: &Layout,
        dst: &Layout,
        page_pairs: &[PairSpec],
        fragments: &Fragments,
        heads: Option<&HeadSlicing>,
        labels: (&[String], &[String]),
    ) -> Result<Self> {
        if *fragments != Fragments::Whole {
            return Err(PlanError::Geometry {
                what: "fragments are offsets inside whole items and do not apply to token plans \
                       (different page sizes, or n_tokens given); build the template without \
                       fragments"
                    .into(),
            });
        }
        let sizes = (src.context().page_size, dst.context().page_size);
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
        let mut pieces = Vec::new();
        let mut pair_pieces = Vec::with_capacity(page_pairs.len());
        for pair in page_pairs {
            let start = pieces.len();
            // Elided pairs (source item 0, as page plans elide them) and pairs of a rank pair
            // that moves no heads have no pieces.
            if pair.item_len == 0 || !moves {
                pair_pieces.push((start, start));
                continue;
            }
            let range = match (sliced, heads) {
                (Some(sliced), Some(slicing)) => {
                    // Each side's item is what its own geometry implies (checked by
                    // `check_pairs` too; re-checked here because every offset below relies on it).
                    slicing
                        .check_page_items(pair.item_len, pair.dst_item_len)
                        .map_err(|what| PlanError::HeadMismatch { what })?;
                    HeadRange::sliced(sliced)
                }
                _ => whole_tokens(pair, sizes, orders, attention, &label)?,
            };
            push_pieces(&mut pieces, pair, range, orders, sizes);
            pair_pieces.push((start, pieces.len()));
        }
        let mut class_pieces = [0; TOKEN_CLASSES];
        for piece in &pieces {
            class_pieces[piece.class] += 1;
        }
        let bytes_per_token = pieces
            .iter()
            .try_fold(0u64, |acc, p| acc.checked_add(p.len))
            .ok_or(PlanError::Overflow {
                what: "bytes per token",
            })?;
        Ok(Self {
            src_page_size: sizes.0,
            dst_page_size: sizes.1,
            pieces,
            pair_pieces,
            class_pieces,
            bytes_per_token,
        })
    }
}

/// The pieces of one pair moving `range`: one piece of `count` heads when both sides are
/// token-major (contiguous within a token on each side), else one piece per head.
fn push_pieces(
    pieces: &mut Vec<TokenPiece>,
    pair: &PairSpec,
    range: HeadRange,
    orders: (MemoryOrder, MemoryOrder),
    sizes: (u64, u64),
) {
    let head = range.head;
    // Head number `k` of a side's rank (counted from its first head): a head-major item holds
    // it at k * page_size * head bytes, one token every head bytes; a token-major item at
    // k * head bytes, one token every token bytes of that side. All inside the item (checked).
    let place = |order: MemoryOrder, size: u64, token: u64, k: u64| match order {
        MemoryOrder::Hnd => (k * size * head, head),
        MemoryOrder::Nhd => (k * head, token),
    };
    let page_strides = (pair.src_stride, pair.dst_stride);
    let piece = |k: u64, len: u64| {
        let (src_off, src_slot) = place(orders.0, sizes.0, range.token.0, range.skip.0 + k);
        let (dst_off, dst_slot) = place(orders.1, sizes.1, range.token.1, range.skip.1 + k);
        TokenPiece::new(
            (pair.src_base + src_off, pair.dst_base + dst_off),
            page_strides,
            (src_slot, dst_slot),
            len,
            sizes,
        )
    };
    if orders == (MemoryOrder::Nhd, MemoryOrder::Nhd) {
        pieces.push(piece(0, range.count * head));
    } else {
        pieces.extend((0..range.count).map(|k| piece(k, head)));
    }
}

/// Why paired page entries `s` and `d` cannot be planned token by token, if they cannot:
/// items that are not whole tokens, different bytes per token, or a head-major item that
/// disagrees with its geometry. What `check_pairs` reports when the page sizes differ.
pub(crate) fn pair_problem(src: &Layout, dst: &Layout, pair: &PairSpec) -> Option<PlanError> {
    if (pair.item_len, pair.dst_item_len) == (0, 0) {
        return None;
    }
    let label = |side: Side, entry: usize| {
        let layout = side.pick(src, dst);
        format!(
            "layer {}, role {}",
            layout.layer_label(entry),
            layout.role_label(entry)
        )
    };
    let sizes = (src.context().page_size, dst.context().page_size);
    let orders = (memory_order(src), memory_order(dst));
    let attention = (src.context().attention, dst.context().attention);
    whole_tokens(pair, sizes, orders, attention, &label).err()
}

/// The heads of a pair that moves whole tokens: the same bytes per token on both sides, and,
/// when either side is head-major, heads that agree with the published geometry.
fn whole_tokens(
    pair: &PairSpec,
    sizes: (u64, u64),
    orders: (MemoryOrder, MemoryOrder),
    attention: (Option<AttentionGeometry>, Option<AttentionGeometry>),
    label: &dyn Fn(Side, usize) -> String,
) -> Result<HeadRange> {
    let items = (pair.item_len, pair.dst_item_len);
    let token_bytes = token_bytes(pair, items, sizes, label)?;
    let head = if orders == (MemoryOrder::Nhd, MemoryOrder::Nhd) {
        token_bytes
    } else {
        head_bytes(pair, token_bytes, orders, attention, label)?
    };
    Ok(HeadRange::whole(token_bytes, head))
}

/// Bytes per token of one pair: each item a whole number of tokens, the same on both sides.
fn token_bytes(
    pair: &PairSpec,
    items: (u64, u64),
    sizes: (u64, u64),
    label: &dyn Fn(Side, usize) -> String,
) -> Result<u64> {
    for (side, entry, item, size) in [
        (Side::Src, pair.src_entry, items.0, sizes.0),
        (Side::Dst, pair.dst_entry, items.1, sizes.1),
    ] {
        if !item.is_multiple_of(size) {
            return Err(PlanError::TokenSize {
                side,
                entry,
                label: label(side, entry),
                item_len: item,
                page_size: size,
            });
        }
    }
    let (src_token, dst_token) = (items.0 / sizes.0, items.1 / sizes.1);
    if src_token != dst_token {
        return Err(PlanError::TokenBytes {
            label: label(Side::Src, pair.src_entry),
            src_entry: pair.src_entry,
            dst_entry: pair.dst_entry,
            src_item_len: items.0,
            src_page_size: sizes.0,
            dst_item_len: items.1,
            dst_page_size: sizes.1,
        });
    }
    Ok(src_token)
}

/// Bytes of one head when either side is head-major: both sides that publish a geometry agree
/// on it, a head-major side's tokens are exactly its heads per rank times that, and a token is a
/// whole number of heads.
fn head_bytes(
    pair: &PairSpec,
    token_bytes: u64,
    orders: (MemoryOrder, MemoryOrder),
    attention: (Option<AttentionGeometry>, Option<AttentionGeometry>),
    label: &dyn Fn(Side, usize) -> String,
) -> Result<u64> {
    let fail = |side: Side, entry: usize, heads: u64, head: u64| PlanError::HeadLayout {
        side,
        entry,
        label: label(side, entry),
        token_bytes,
        heads,
        head_bytes: head,
    };
    // A head-major side always publishes its geometry (that is where its order comes from).
    let sides = [
        (Side::Src, pair.src_entry, orders.0, attention.0),
        (Side::Dst, pair.dst_entry, orders.1, attention.1),
    ];
    let head = sides
        .iter()
        .find_map(|&(_, _, order, g)| (order == MemoryOrder::Hnd).then_some(g).flatten())
        .map_or(token_bytes, |g| g.head_bytes());
    for (side, entry, order, geometry) in sides {
        let Some(g) = geometry else { continue };
        let heads = u64::from(g.heads_per_rank);
        let exact = order == MemoryOrder::Nhd || heads * g.head_bytes() == token_bytes;
        if g.head_bytes() != head || !exact || !token_bytes.is_multiple_of(head) {
            return Err(fail(side, entry, heads, g.head_bytes()));
        }
    }
    Ok(head)
}

/// One segment of a token request: `n` tokens inside one page on each side.
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
}

/// Segments of `n_tokens` tokens over pages of `sizes` tokens, in token order.
fn segments(n_tokens: u64, sizes: (u64, u64)) -> impl Iterator<Item = Segment> {
    let (ps, pd) = sizes;
    let mut seg = Segment {
        t: 0,
        n: 0,
        src_pos: 0,
        dst_pos: 0,
        src_slot: 0,
        dst_slot: 0,
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

/// Why a segment (not the first) cannot join the block before it, per side: `(edge, stepped)`
/// where `edge` says it starts a new page on that side and `stepped` that the page index is the
/// previous one plus one.
fn edges<S: PageIndex, D: PageIndex>(seg: &Segment, src: &[S], dst: &[D]) -> [(bool, bool); 2] {
    let side = |slot: u64, pos: usize, step: &dyn Fn(usize) -> bool| {
        let edge = slot == 0 && pos > 0;
        (edge, edge && step(pos))
    };
    [
        side(seg.src_slot, seg.src_pos, &|p| src[p - 1].steps_to(src[p])),
        side(seg.dst_slot, seg.dst_pos, &|p| dst[p - 1].steps_to(dst[p])),
    ]
}

/// Whether a segment starts a new block for a contiguous piece of class `class` (1..=4).
fn breaks(class: usize, [(src_edge, src_step), (dst_edge, dst_step)]: [(bool, bool); 2]) -> bool {
    let (src_packed, dst_packed) = ((class - 1) & 2 != 0, (class - 1) & 1 != 0);
    (src_edge && !(src_packed && src_step)) || (dst_edge && !(dst_packed && dst_step))
}

/// Blocks per piece class, segments and blocks of a request of `n` tokens over `src`/`dst`
/// (pages in token order, at least `ceil(n / page size)` of each; values are not checked).
fn count_blocks<S: PageIndex, D: PageIndex>(
    tokens: &TokenTemplate,
    src: &[S],
    dst: &[D],
    n: u64,
) -> Result<([usize; TOKEN_CLASSES], usize, usize)> {
    let sizes = (tokens.src_page_size, tokens.dst_page_size);
    let mut class_blocks = [0usize; TOKEN_CLASSES];
    let mut n_segments = 0usize;
    for seg in segments(n, sizes) {
        n_segments += 1;
        let edges = edges(&seg, src, dst);
        for (class, count) in class_blocks.iter_mut().enumerate().skip(1) {
            *count += usize::from(seg.t == 0 || breaks(class, edges));
        }
    }
    class_blocks[0] = usize::try_from(n).map_err(|_| PlanError::Overflow {
        what: "block count",
    })?;
    let n_blocks = tokens
        .class_pieces
        .iter()
        .zip(class_blocks)
        .try_fold(0usize, |acc, (&pieces, blocks)| {
            acc.checked_add(pieces.checked_mul(blocks)?)
        })
        .ok_or(PlanError::Overflow {
            what: "block count",
        })?;
    Ok((class_blocks, n_segments, n_blocks))
}

/// The first position of `values` below 0 or at/above `limit`, as the error to report.
fn check_pages<T: PageIndex>(
    template: &Template,
    side: Side,
    values: &[T],
    limit: u64,
) -> Result<()> {
    if let Some((position, index)) = values
        .iter()
        .map(|v| v.get())
        .enumerate()
        .find(|&(_, v)| v < 0 || v as u64 >= limit)
    {
        if index < 0 {
            return Err(PlanError::NegativeIndex {
                side,
                index,
                position,
            });
        }
        return Err(template.out_of_range(side, values));
    }
    Ok(())
}

impl Template {
    /// Token pieces, or why this template cannot plan by token.
    ///
    /// # Errors
    /// The reason the pairs' items cannot be cut into tokens.
    pub fn token_template(&self) -> Result<&TokenTemplate> {
        self.tokens.as_ref().map_err(Clone::clone)
    }

    /// Whether every page plan of this template is a token plan: the two layouts have
    /// different tokens per page, or different memory orders ([`needs_tokens`]).
    pub fn by_token(&self) -> bool {
        self.by_token
    }

    /// Tokens per page of the source and destination layouts.
    pub fn page_sizes(&self) -> (u64, u64) {
        self.page_sizes
    }

    /// Validates a token request (through [`Template::prepare`]) and returns the size of its
    /// plan. `src` and `dst` are the
    /// request's pages in token order on each side (their lengths may differ); `n_tokens`
    /// defaults to the full pages of the shorter side. Only the pages holding the first
    /// `n_tokens` tokens are read (and validated); later ones are ignored.
    ///
    /// # Errors
    /// [`PlanError::TokenCount`] when a side has too few pages; a negative index or one outside
    /// a paired buffer; a repeated destination page (when the template checks overlap); the
    /// template's token error; overflow.
    pub(crate) fn prepare_tokens<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        n_tokens: Option<u64>,
    ) -> Result<TokenShape> {
        let tokens = self.token_template()?;
        let sizes = (tokens.src_page_size, tokens.dst_page_size);
        let full = |pages: usize, size: u64| (pages as u64).checked_mul(size);
        let (src_full, dst_full) = (full(src.len(), sizes.0), full(dst.len(), sizes.1));
        let n = match n_tokens {
            Some(n) => n,
            None => src_full
                .zip(dst_full)
                .map(|(a, b)| a.min(b))
                .ok_or(PlanError::Overflow { what: "tokens" })?,
        };
        let (src_pages, dst_pages) = (n.div_ceil(sizes.0), n.div_ceil(sizes.1));
        for (side, pages, needed, size) in [
            (Side::Src, src.len(), src_pages, sizes.0),
            (Side::Dst, dst.len(), dst_pages, sizes.1),
        ] {
            if needed > pages as u64 {
                return Err(PlanError::TokenCount {
                    side,
                    n_tokens: n,
                    page_size: size,
                    needed,
                    given: pages,
                });
            }
        }
        // At most the given lengths (checked above), so they fit usize.
        let (src_pages, dst_pages) = (src_pages as usize, dst_pages as usize);
        let (src, dst) = (&src[..src_pages], &dst[..dst_pages]);
        if !tokens.pieces.is_empty() && n > 0 {
            check_pages(self, Side::Src, src, self.src_limit)?;
            check_pages(self, Side::Dst, dst, self.dst_limit)?;
            if self.check_dst_overlap {
                check_unique(dst)?;
            }
        }
        let (class_blocks, n_segments, n_blocks) = count_blocks(tokens, src, dst, n)?;
        let total_bytes = n
            .checked_mul(tokens.bytes_per_token)
            .ok_or(PlanError::Overflow {
                what: "total bytes",
            })?;
        Ok(TokenShape {
            n_tokens: n,
            src_pages,
            dst_pages,
            n_segments,
            class_blocks,
            n_blocks,
            total_bytes,
        })
    }

    /// Blocks of a token request of `n_tokens` tokens without planning it: pages consecutive
    /// on both sides, or (`fragmented`) no two pages consecutive on either side. Returns
    /// `(blocks, segments)`.
    ///
    /// # Errors
    /// The template's token error; [`PlanError::OutOfMemory`] or [`PlanError::Overflow`] for
    /// absurd counts.
    pub fn token_blocks(&self, n_tokens: u64, fragmented: bool) -> Result<(usize, usize)> {
        let tokens = self.token_template()?;
        let step = if fragmented { 2 } else { 1 };
        let pages = |size: u64| -> Result<Vec<i64>> {
            let n = usize::try_from(n_tokens.div_ceil(size))
                .map_err(|_| PlanError::Overflow { what: "pages" })?;
            let mut v = crate::error::try_vec(n, 0i64, "page list")?;
            v.iter_mut().zip(0i64..).for_each(|(x, k)| *x = k * step);
            Ok(v)
        };
        let (src, dst) = (pages(tokens.src_page_size)?, pages(tokens.dst_page_size)?);
        let (_, segments, blocks) = count_blocks(tokens, &src, &dst, n_tokens)?;
        Ok((blocks, segments))
    }

    /// Emits a validated token request into `out` (at least `shape.n_blocks` long).
    pub(crate) fn emit_token_request<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        shape: &TokenShape,
        out: Columns<'_>,
    ) -> Result<PlanSummary> {
        self.emit_tokens(&src[..shape.src_pages], &dst[..shape.dst_pages], shape, out)?;
        Ok(PlanSummary {
            n_runs: shape.n_segments,
            n_blocks: shape.n_blocks,
            total_bytes: shape.total_bytes,
            n_pages: 0,
            tokens: Some(*shape),
        })
    }

    fn emit_tokens<S: PageIndex, D: PageIndex>(
        &self,
        src: &[S],
        dst: &[D],
        shape: &TokenShape,
        mut out: Columns<'_>,
    ) -> Result<()> {
        let tokens = self.token_template()?;
        let sizes = (tokens.src_page_size, tokens.dst_page_size);
        let limits = (self.src_limit, self.dst_limit);
        let mut at = 0usize;
        let mut previous: Option<(usize, &TokenPiece)> = None;
        for piece in &tokens.pieces {
            let expected = shape.class_blocks[piece.class];
            let start = at;
            if at + expected > out.capacity() {
                return Err(PlanError::InputChanged);
            }
            match previous {
                Some((from, prev)) if prev.same_shape(piece) => {
                    let (ds, dd) = (
                        piece.src_base.wrapping_sub(prev.src_base),
                        piece.dst_base.wrapping_sub(prev.dst_base),
                    );
                    for k in 0..expected {
                        out.src_addrs[at + k] = out.src_addrs[from + k].wrapping_add(ds);
                        out.dst_addrs[at + k] = out.dst_addrs[from + k].wrapping_add(dd);
                        out.lengths[at + k] = out.lengths[from + k];
                    }
                    at += expected;
                }
                _ => {
                    at = emit_piece(piece, src, dst, sizes, limits, shape.n_tokens, at, &mut out)?;
                    if at - start != expected {
                        return Err(PlanError::InputChanged);
                    }
                }
            }
            previous = Some((start, piece));
        }
        Ok(())
    }
}

/// Writes one piece's blocks from position `at`; returns the position after them.
#[allow(clippy::too_many_arguments)]
fn emit_piece<S: PageIndex, D: PageIndex>(
    piece: &TokenPiece,
    src: &[S],
    dst: &[D],
    sizes: (u64, u64),
    limits: (u64, u64),
    n_tokens: u64,
    mut at: usize,
    out: &mut Columns<'_>,
) -> Result<usize> {
    // Re-checked while writing: an index changed since validation must not make an address.
    let page = |value: i64, limit: u64| -> Result<u64> {
        u64::try_from(value)
            .ok()
            .filter(|&v| v < limit)
            .ok_or(PlanError::InputChanged)
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
    let mut open = false; // whether the last block written may be extended
    for seg in segments(n_tokens, sizes) {
        let sp = page(src[seg.src_pos].get(), limits.0)?;
        let dp = page(dst[seg.dst_pos].get(), limits.1)?;
        // In bounds (checked just above), so inside the buffer: no overflow.
        let s = piece.src_base + sp * piece.src_page_stride + seg.src_slot * piece.src_slot;
        let d = piece.dst_base + dp * piece.dst_page_stride + seg.dst_slot * piece.dst_slot;
        if piece.class == 0 {
            for k in 0..seg.n {
                let (s, d) = (s + k * piece.src_slot, d + k * piece.dst_slot);
                at = push(out, at, s, d, piece.len)?;
            }
            continue;
        }
        let bytes = seg.n * piece.len;
        if open && !breaks(piece.class, edges(&seg, src, dst)) {
            out.lengths[at - 1] += bytes;
        } else {
            at = push(out, at, s, d, bytes)?;
            open = true;
        }
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutContext;
    use crate::template::TemplateOptions;
    use proptest::prelude::*;

    const HEADS: u32 = 2;
    const HEAD_DIM: u32 = 2;
    const DTYPE: u32 = 2;
    const HEAD_BYTES: u64 = (HEAD_DIM * DTYPE) as u64;
    const TOKEN: u64 = HEADS as u64 * HEAD_BYTES;

    /// K and V of two layers at `page_size`, `pages` pages each, packed or with a padded
    /// stride, in an arena starting at `base`.
    fn layout(
        base: u64,
        page_size: u64,
        pages: u64,
        order: Option<MemoryOrder>,
        pad: u64,
    ) -> Layout {
        let item = page_size * TOKEN;
        let stride = item + pad;
        let len = pages * stride;
        let ptrs: Vec<u64> = (0..4).map(|i| base + i * len).collect();
        let context = LayoutContext {
            page_size,
            attention: order.map(|memory_order| AttentionGeometry {
                total_kv_heads: HEADS,
                heads_per_rank: HEADS,
                head_dim: HEAD_DIM,
                dtype_size: DTYPE,
                memory_order,
            }),
            ..LayoutContext::default()
        };
        Layout::mha(
            ptrs[..2].to_vec(),
            ptrs[2..].to_vec(),
            vec![len; 2],
            vec![len; 2],
            vec![item; 2],
            vec![item; 2],
            Some(vec![0, 1]),
            context,
        )
        .unwrap()
        .with_strides(vec![stride; 4])
        .unwrap()
    }

    /// Address of head `h` of token slot `slot` of page `page` of entry `e`.
    fn addr(l: &Layout, e: usize, page: u64, slot: u64, h: u64) -> u64 {
        let base = l.parts().data_ptrs[e] + page * l.strides()[e];
        match memory_order(l) {
            MemoryOrder::Nhd => base + slot * TOKEN + h * HEAD_BYTES,
            MemoryOrder::Hnd => base + h * l.context().page_size * HEAD_BYTES + slot * HEAD_BYTES,
        }
    }

    fn arena(l: &Layout) -> (u64, usize) {
        let p = l.parts();
        let base = p.data_ptrs[0];
        let end = p
            .data_ptrs
            .iter()
            .zip(&p.data_lens)
            .map(|(a, b)| a + b)
            .max()
            .unwrap();
        (base, (end - base) as usize)
    }

    fn check(
        sizes: (u64, u64),
        orders: (Option<MemoryOrder>, Option<MemoryOrder>),
        pads: (u64, u64),
        src_pages: &[i64],
        dst_pages: &[i64],
        n_tokens: Option<u64>,
    ) {
        let src = layout(0x1000, sizes.0, 16, orders.0, pads.0);
        let dst = layout(0x10_0000, sizes.1, 16, orders.1, pads.1);
        let template = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let plan = template.plan(src_pages, dst_pages, n_tokens).unwrap();
        let n = n_tokens.unwrap_or_else(|| {
            (src_pages.len() as u64 * sizes.0).min(dst_pages.len() as u64 * sizes.1)
        });
        let (sb, slen) = arena(&src);
        let (db, dlen) = arena(&dst);
        let source: Vec<u8> = (0..slen).map(|i| (i * 7 + 3) as u8).collect();
        let mut want = vec![0u8; dlen];
        let mut got = vec![0u8; dlen];
        for e in 0..4 {
            for tok in 0..n {
                let (sp, dp) = (
                    src_pages[(tok / sizes.0) as usize] as u64,
                    dst_pages[(tok / sizes.1) as usize] as u64,
                );
                for h in 0..u64::from(HEADS) {
                    let s = (addr(&src, e, sp, tok % sizes.0, h) - sb) as usize;
                    let d = (addr(&dst, e, dp, tok % sizes.1, h) - db) as usize;
                    let hb = HEAD_BYTES as usize;
                    want[d..d + hb].copy_from_slice(&source[s..s + hb]);
                }
            }
        }
        let mut written = vec![false; dlen];
        for k in 0..plan.lengths.len() {
            let (s, d, len) = (
                (plan.src_addrs[k] - sb) as usize,
                (plan.dst_addrs[k] - db) as usize,
                plan.lengths[k] as usize,
            );
            assert!(len > 0);
            assert!(written[d..d + len].iter().all(|w| !w), "byte written twice");
            written[d..d + len].iter_mut().for_each(|w| *w = true);
            got[d..d + len].copy_from_slice(&source[s..s + len]);
        }
        assert_eq!(got, want);
        assert_eq!(plan.total_bytes, n * TOKEN * 4);
    }

    fn pages(n: usize, swaps: &[bool]) -> Vec<i64> {
        // n distinct pages below 16: 0..16 with some positions swapped (runs and breaks).
        let mut v: Vec<i64> = (0..16).collect();
        for (k, &swap) in swaps.iter().enumerate() {
            if swap {
                v.swap(k, (k * 5 + 3) % 16);
            }
        }
        v.truncate(n);
        v
    }

    #[test]
    fn sixteen_to_sixty_four_nhd_contiguous_is_one_block_per_entry() {
        let src = layout(0x1000, 16, 16, Some(MemoryOrder::Nhd), 0);
        let dst = layout(0x10_0000, 64, 4, Some(MemoryOrder::Nhd), 0);
        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let plan = t
            .plan(&(0..8i64).collect::<Vec<_>>(), &[1i64, 2], None)
            .unwrap();
        assert_eq!(plan.lengths, vec![128 * TOKEN; 4]);
        // HND: one block per head per segment: 100 tokens over source pages of 16 are 7.
        let src = layout(0x1000, 16, 16, Some(MemoryOrder::Hnd), 0);
        let dst = layout(0x10_0000, 64, 4, Some(MemoryOrder::Hnd), 0);
        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let plan = t
            .plan(&(0..8i64).collect::<Vec<_>>(), &[1i64, 2], Some(100))
            .unwrap();
        assert_eq!(plan.lengths.len(), 4 * 2 * 7);
        check(
            (16, 64),
            (Some(MemoryOrder::Hnd), Some(MemoryOrder::Hnd)),
            (0, 0),
            &(0..8).collect::<Vec<_>>(),
            &[1, 2],
            Some(100),
        );
    }

    #[test]
    fn errors_carry_values() {
        let src = layout(0x1000, 16, 16, None, 0);
        let dst = layout(0x10_0000, 64, 4, None, 0);
        let t = Template::new(&src, &dst, TemplateOptions::default()).unwrap();
        let err = t.plan(&[0i64, 1], &[0i64], Some(40)).unwrap_err();
        assert_eq!(
            err,
            PlanError::TokenCount {
                side: Side::Src,
                n_tokens: 40,
                page_size: 16,
                needed: 3,
                given: 2
            }
        );
        let err = t.plan(&[0i64, 1], &[4i64], None).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::IndexOutOfRange {
                    side: Side::Dst,
                    index: 4,
                    ..
                }
            ),
            "{err}"
        );
        let err = t.plan(&[0i64, -1], &[0i64], None).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::NegativeIndex {
                    side: Side::Src,
                    index: -1,
                    position: 1
                }
            ),
            "{err}"
        );
        // Items of different bytes per token.
        let mut bad = layout(0x10_0000, 32, 4, None, 0);
        bad = Layout::new(
            bad.parts().clone(),
            LayoutContext {
                page_size: 64,
                ..LayoutContext::default()
            },
        )
        .unwrap();
        let err = Template::new(&src, &bad, TemplateOptions::default()).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::TokenBytes {
                    src_page_size: 16,
                    dst_page_size: 64,
                    ..
                }
            ),
            "{err}"
        );
        let odd = Layout::new(
            src.parts().clone(),
            LayoutContext {
                page_size: 3,
                ..LayoutContext::default()
            },
        )
        .unwrap();
        let err = Template::new(&odd, &dst, TemplateOptions::default()).unwrap_err();
        assert!(
            matches!(
                err,
                PlanError::TokenSize {
                    side: Side::Src,
                    page_size: 3,
                    ..
                }
            ),
            "{err}"
        );
    }

    fn order() -> impl Strategy<Value = Option<MemoryOrder>> {
        prop_oneof![
            Just(None),
            Just(Some(MemoryOrder::Nhd)),
            Just(Some(MemoryOrder::Hnd))
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn token_plans_match_a_per_token_reference(
            ps in prop::sample::select(vec![1u64, 2, 4, 16, 32, 64]),
            pd in prop::sample::select(vec![1u64, 2, 4, 16, 32, 64]),
            orders in (order(), order()),
            pads in (prop::sample::select(vec![0u64, 0, 8]), prop::sample::select(vec![0u64, 0, 8])),
            src_gaps in prop::collection::vec(any::<bool>(), 16),
            dst_gaps in prop::collection::vec(any::<bool>(), 16),
            per_mille in 0u64..=1000,
            given in any::<bool>(),
        ) {
            let max_tokens = (16 * ps).min(16 * pd).min(300);
            let n = max_tokens * per_mille / 1000;
            let src_pages = pages(n.div_ceil(ps) as usize, &src_gaps);
            let dst_pages = pages(n.div_ceil(pd) as usize, &dst_gaps);
            check((ps, pd), orders, pads, &src_pages, &dst_pages, given.then_some(n));
        }
    }
}
