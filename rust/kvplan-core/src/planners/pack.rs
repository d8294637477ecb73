//! Pack plans: a request's plan split in two, so the network moves few large blocks.
//!
//! When the source rows a decode rank needs are strided (a prefill at DCP 1 sending to a decode
//! at DCP N holds the rank's tokens one row apart in every page: the direct plan is one block per
//! token per layer), the prefill first gathers those rows into a *pack buffer* of its own memory
//! (a local copy: a GPU kernel in production), laid out so that every run of blocks contiguous on
//! the decode side is contiguous in the pack buffer too; the network then moves one block per
//! destination-contiguous run.
//!
//! Both plans derive from the direct plan, block for block, so the decode receives exactly the
//! bytes the direct plan would write:
//! - `gather`: direct block `k` (`src → dst`, `len`) becomes `src → pack + offset_k`, with the
//!   blocks packed back to back in plan order (`offset_k` = bytes of the blocks before `k`);
//!   consecutive blocks contiguous on both the source and the pack side are merged;
//! - `network`: consecutive direct blocks contiguous on the decode side (hence in the pack
//!   buffer) become one block `pack + offset → dst`.
//!
//! A token request's gather can also be planned as rows ([`PackPlanner::row_gather`]): per
//! token lane the source rows moved and per piece one [`RowCopy`], the form a gather kernel
//! takes, with the same pack layout and the same network plan (both built by one merging
//! `PlanBuilder`),
//! without building the direct plan or one block per row.
//!
//! Merges never cross a page pair (a pair's blocks stay a range of `pair_offsets`), and the
//! pack buffer must hold the plan's bytes, checked before the plan's output is requested. The
//! gather is the direct plan's columns rewritten in place (no second large allocation); the
//! network plan is small and allocated. State slots
//! are not packed (one block per state pair already): plan them with
//! a slot request of [`Template::plan`].

use crate::error::{PlanError, Result};
use crate::kernels::tokens::{LaneLists, count_blocks, dst_chunks, emit_tokens, lane_rows};
use crate::model::pieces::{MAX_LANES, Walk};
use crate::model::plan::{
    AsColumns, Columns, FlatBuffer, Plan, PlanPart, PlanSummary, PlanUnit, TokenShape,
};
use crate::model::request::Request;
use crate::model::runs::PageIndex;
use crate::peer::entry::PoolId;
use crate::peer_pair::template::{Template, model_pages};
use crate::rules::capabilities::{Feature, Planner};

/// Caller-owned memory on the prefill side that receives the gathered rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackBuffer {
    /// First byte of the buffer.
    pub addr: u64,
    /// Bytes the buffer holds.
    pub size: u64,
}

/// A request's plan as a local gather into the pack buffer and a network plan out of it. The
/// gather is an owned [`Plan`], or (`G` = [`PlanPart`], from [`PackPlanner::plan_into`]) the
/// size and offsets of the gather written into the caller's output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PackedPlan<G = Plan> {
    /// Prefill memory → pack buffer (executed locally by the caller before the transfer).
    pub gather: G,
    /// Pack buffer → decode memory, one block per destination-contiguous run (small: it is
    /// always owned).
    pub network: Plan,
    /// Bytes of the pack buffer the plans use (from its start): the plan's bytes.
    pub pack_bytes: u64,
}

/// Pack plans of one template (see the [`crate::planners::pack`] module); borrows the template.
#[derive(Debug, Clone)]
pub struct PackPlanner<'t> {
    template: &'t Template,
}

impl<'t> PackPlanner<'t> {
    /// The pack planner of `template`.
    pub fn new(template: &'t Template) -> Self {
        Self { template }
    }
}

impl PackPlanner<'_> {
    /// Plans one request (as [`Template::plan_into`]) into columns from `make_output`, then
    /// rewrites them in place into the gather plan and returns the network plan (see the
    /// [`crate::planners::pack`] module). The pack buffer is checked against the plan's bytes before
    /// `make_output` is called.
    ///
    /// # Errors
    /// As [`Template::plan_into`]; [`PlanError::PackTooSmall`]; [`PlanError::Overflow`] when
    /// the pack buffer's end overflows u64.
    pub fn plan_into<'o, S: PageIndex, D: PageIndex, O>(
        &self,
        request: &Request<'_, S, D>,
        pack: PackBuffer,
        make_output: impl FnOnce(&PlanSummary) -> Result<O>,
    ) -> Result<(O, PackedPlan<PlanPart>)>
    where
        O: AsColumns<'o>,
    {
        self.template.admit(Planner::Packed, request)?;
        pack.addr
            .checked_add(pack.size)
            .ok_or(PlanError::Overflow {
                what: "pack buffer end",
            })?;
        let (mut output, summary) = self.template.plan_into(request, |shape| {
            if shape.total_bytes > pack.size {
                return Err(PlanError::PackTooSmall {
                    need: shape.total_bytes,
                    have: pack.size,
                    blocks: shape.n_blocks,
                });
            }
            make_output(shape)
        })?;
        let offsets = self.template.blocks.pair_offsets(&summary);
        let packed = pack_columns(output.columns(), summary.n_blocks, &offsets, pack)?;
        Ok((output, packed))
    }

    /// Allocating convenience over [`PackPlanner::plan_into`].
    ///
    /// # Errors
    /// As [`PackPlanner::plan_into`].
    pub fn plan<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        pack: PackBuffer,
    ) -> Result<PackedPlan> {
        let (buffer, packed) = self.plan_into(request, pack, |shape| {
            FlatBuffer::try_zeroed(shape.n_blocks)
        })?;
        Ok(PackedPlan {
            gather: packed.gather.into_plan(buffer)?,
            network: packed.network,
            pack_bytes: packed.pack_bytes,
        })
    }
}

/// Blocks of a token request planned directly and through a pack buffer, counted without the
/// caller's page lists (see [`PackPlanner::counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PackedCounts {
    /// Blocks of the direct plan (every one a network descriptor).
    pub direct: usize,
    /// Blocks of the gather into the pack buffer (local copies).
    pub gather: usize,
    /// Blocks of the network plan out of the pack buffer.
    pub network: usize,
}

impl PackPlanner<'_> {
    /// What a token request of `n_tokens` tokens costs planned directly and through a pack
    /// buffer (as [`PackPlanner::plan`] plans it), with pages consecutive on both sides or
    /// (`fragmented`) no two pages consecutive on either side, as
    /// [`crate::BlockRequest::Tokens`] counts direct blocks. The request is planned on those
    /// model page lists into scratch memory (only the counts leave: the model pages need not lie
    /// inside the registered buffers).
    ///
    /// # Errors
    /// The template's token error; [`PlanError::Overflow`] when a model page's address would
    /// not fit u64; [`PlanError::OutOfMemory`].
    pub fn counts(&self, n_tokens: u64, fragmented: bool) -> Result<PackedCounts> {
        let tokens = self.template.token_template()?;
        let model = model_pages(tokens, n_tokens, fragmented)?;
        let mut lists = LaneLists::same(&model.pools[0].0[..], &model.pools[0].1[..]);
        for (k, (src, dst)) in model.pools.iter().enumerate() {
            lists.pools[k] = (&src[..], &dst[..]);
        }
        let limit = |pages: &[i64]| pages.last().map_or(0, |&p| p as u64 + 1);
        let limits = lists.pools.map(|(src, dst)| (limit(src), limit(dst)));
        for piece in &tokens.pieces {
            let pools = tokens.lanes[piece.lane].pools;
            let (src_limit, dst_limit) = (limits[pools.0.index()].0, limits[pools.1.index()].1);
            for (side, pages) in [(piece.src, src_limit), (piece.dst, dst_limit)] {
                // The last byte of the last model page stays addressable.
                pages
                    .saturating_sub(1)
                    .checked_mul(side.page_stride)
                    .and_then(|a| a.checked_add(side.base))
                    .and_then(|a| {
                        a.checked_add(side.map.page_size().checked_mul(side.slot_stride)?)
                    })
                    .and_then(|a| a.checked_add(piece.len))
                    .ok_or(PlanError::Overflow {
                        what: "model page address",
                    })?;
            }
        }
        let (class_blocks, n_segments, n_blocks, total_bytes) =
            count_blocks(tokens, &lists, 0, n_tokens)?;
        let shape = TokenShape {
            n_tokens,
            first_token: 0,
            pool_ranges: [(0, n_tokens); crate::peer::entry::POOLS],
            first_pages: (0, 0),
            src_pages: model.pools[0].0.len(),
            dst_pages: model.pools[0].1.len(),
            pool_pages: std::array::from_fn(|k| {
                let (src, dst) = &model.pools[k];
                ((src.len(), dst.len()), (0, 0))
            }),
            n_segments,
            class_blocks,
            n_blocks,
            total_bytes,
        };
        let mut scratch = FlatBuffer::try_zeroed(n_blocks)?;
        emit_tokens(tokens, &lists, limits, &shape, scratch.columns())?;
        let summary = PlanSummary {
            n_blocks,
            total_bytes,
            unit: PlanUnit::Tokens(shape),
            state: None,
        };
        let offsets = self.template.blocks.pair_offsets(&summary);
        let pack = PackBuffer {
            addr: 0,
            size: total_bytes,
        };
        let packed = pack_columns(scratch.columns(), n_blocks, &offsets, pack)?;
        Ok(PackedCounts {
            direct: n_blocks,
            gather: packed.gather.n_blocks,
            network: packed.network.lengths.len(),
        })
    }
}

/// The gather of a token request's pack plan in the form a gather kernel takes: per token lane,
/// the source rows of the tokens it moves, and per piece one row copy. Row copy `c` copies
/// `c.len` bytes of each row `r = rows[c.lane][k]` from [`RowCopy::src_addr`] to
/// `c.pack_addr + k × c.len`: exactly what the block gather of [`PackPlanner::plan`] copies
/// (same pack layout), without one block per row.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RowGather {
    /// Per token lane (0: the target tokens, dealt on a DCP layout; 1: the draft tokens a DCP
    /// template sends whole), the source row of every token moved, in token order: `row =
    /// source page index × rows_per_page + slot`. A lane without pieces has no rows.
    pub rows: Vec<Vec<u64>>,
    /// One per piece, in plan order (entry pairs, then heads).
    pub copies: Vec<RowCopy>,
    /// Bytes of the pack buffer used, from its start.
    pub pack_bytes: u64,
}

impl RowGather {
    /// Lanes of a row gather: the target tokens and the draft tokens.
    pub const LANES: usize = 2;

    /// The row gather's lane of a token walk.
    ///
    /// # Errors
    /// [`PlanError::Unsupported`] for a walk a row gather does not move (a sliding window).
    fn lane(walk: Walk) -> Result<usize> {
        match walk {
            Walk::All => Ok(0),
            Walk::DraftWhole => Ok(1),
            Walk::Window(window) => Err(PlanError::Unsupported {
                planner: Planner::RowGather.name(),
                feature: Feature::Window.name(),
                why: format!("a row gather moves every token; window lane of {window} tokens"),
            }),
            // Ring lanes belong to slot plans, never to a token template's lanes.
            Walk::Ring { src_rows, dst_rows } => Err(PlanError::Unsupported {
                planner: Planner::RowGather.name(),
                feature: Feature::Ring.name(),
                why: format!(
                    "a row gather moves pages; ring lane of {src_rows} -> {dst_rows} rows"
                ),
            }),
        }
    }
}

/// One piece of a [`RowGather`]: where its rows are on the source side and in the pack buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCopy {
    /// The lane whose rows it copies.
    pub lane: usize,
    /// Source address of row 0 (slot 0 of page 0, the piece's offset included).
    pub src_base: u64,
    /// Bytes between source pages.
    pub page_stride: u64,
    /// Bytes between rows (slots) of a source page.
    pub row_stride: u64,
    /// Rows (slots) per source page.
    pub rows_per_page: u64,
    /// Bytes copied per row.
    pub len: u64,
    /// Pack address of the lane's first row.
    pub pack_addr: u64,
}

impl RowCopy {
    /// Source address of row `row`: `src_base + (row / rows_per_page) × page_stride + (row %
    /// rows_per_page) × row_stride`.
    pub fn src_addr(&self, row: u64) -> u64 {
        self.src_base
            + row / self.rows_per_page * self.page_stride
            + row % self.rows_per_page * self.row_stride
    }
}

impl PackPlanner<'_> {
    /// Plans one token request (as [`PackPlanner::plan`]) as a [`RowGather`] and the
    /// network plan out of the pack buffer; the network plan is the one `plan_packed` returns,
    /// block for block, and the row gather copies what its gather copies. No direct plan is
    /// built: one walk of each lane's tokens gives the rows and the decode places.
    ///
    /// # Errors
    /// As [`PackPlanner::plan`]; [`PlanError::Geometry`] when the request is a page plan
    /// (no `n_tokens` on a template that plans by page).
    pub fn row_gather<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        pack: PackBuffer,
    ) -> Result<(RowGather, Plan)> {
        self.template.admit(Planner::RowGather, request)?;
        let ((src, dst), n_tokens) = (request.page_lists("a row gather")?, request.n_tokens);
        if !self.template.by_token() && n_tokens.is_none() {
            return Err(PlanError::Geometry {
                what: "a row gather is a token plan's: give n_tokens (or use plan_packed for a \
                       page plan)"
                    .into(),
            });
        }
        let pack_end = pack
            .addr
            .checked_add(pack.size)
            .ok_or(PlanError::Overflow {
                what: "pack buffer end",
            })?;
        let tokens = self.template.token_template()?;
        // Rows are gathered from the request's pages: a lane reading a pool of its own (window
        // pool, further pool) has no row list here.
        if let Some(lane) = tokens
            .lanes
            .iter()
            .find(|l| l.pools != (PoolId::PAGES, PoolId::PAGES))
        {
            return Err(PlanError::Geometry {
                what: format!(
                    "a row gather gathers the rows of the request's pages; this template has \
                     entries in a pool of their own (prefill pool {}, decode pool {}): plan it \
                     with Template::plan",
                    lane.pools.0.0, lane.pools.1.0
                ),
            });
        }
        let (n, src_pages, dst_pages) = self.template.validate_tokens(src, dst, n_tokens)?;
        let (src, dst) = (&src[..src_pages], &dst[..dst_pages]);
        let limits = self.template.index_limits();
        let limits = (limits.src, limits.dst);
        // The gather's lanes are the target and draft tokens: a window template is refused
        // above.
        let mut rows = vec![Vec::new(); RowGather::LANES];
        let mut places = vec![Vec::new(); RowGather::LANES];
        let mut gather_lanes = [0usize; MAX_LANES];
        for (at, lane) in tokens.lanes() {
            gather_lanes[at] = RowGather::lane(lane.walk)?;
        }
        if !tokens.pieces.is_empty() {
            for (at, lane) in tokens.lanes() {
                let gather = gather_lanes[at];
                (rows[gather], places[gather]) = lane_rows(lane.maps, src, dst, limits, n)?;
            }
        }
        let lane_of = |piece: &crate::model::pieces::Piece| gather_lanes[piece.lane];
        // Pack layout: piece after piece, each piece's rows back to back.
        let mut need = 0u64;
        let mut copies = Vec::with_capacity(tokens.pieces.len());
        for piece in &tokens.pieces {
            let lane = lane_of(piece);
            copies.push(RowCopy {
                lane,
                src_base: piece.src.base,
                page_stride: piece.src.page_stride,
                row_stride: piece.src.slot_stride,
                rows_per_page: piece.src.map.page_size(),
                len: piece.len,
                pack_addr: pack.addr.wrapping_add(need), // checked below
            });
            need = (rows[lane].len() as u64)
                .checked_mul(piece.len)
                .and_then(|b| b.checked_add(need))
                .ok_or(PlanError::Overflow { what: "pack bytes" })?;
        }
        if need > pack.size {
            return Err(PlanError::PackTooSmall {
                need,
                have: pack.size,
                blocks: rows.iter().map(Vec::len).sum(),
            });
        }
        debug_assert!(pack.addr + need <= pack_end); // need <= size, end checked above
        // Network: the decode chunks of each piece in pack order, merged within a group (a
        // group's blocks are one range of the plan's pair offsets, as plan_packed merges).
        let mut network = PlanBuilder::default();
        let mut per_pair = vec![0usize; self.template.blocks.pair_groups().len()];
        let mut previous: Option<(usize, Vec<Chunk>)> = None;
        for group in self.template.blocks.groups() {
            let before = network.plan.lengths.len();
            let first = tokens.pair_pieces[group.first_pair].0;
            let last = tokens.pair_pieces[group.last_pair].1;
            for k in first..last {
                let (piece, copy) = (&tokens.pieces[k], &copies[k]);
                // A piece shaped like the one before it has that piece's chunks, shifted.
                let chunks = match previous {
                    Some((p, ref chunks))
                        if tokens.pieces[p].same_shape(piece) && copies[p].lane == copy.lane =>
                    {
                        let (dp, dd) = (
                            copy.pack_addr.wrapping_sub(copies[p].pack_addr),
                            piece.dst.base.wrapping_sub(tokens.pieces[p].dst.base),
                        );
                        chunks
                            .iter()
                            .map(|&(a, d, l)| (a.wrapping_add(dp), d.wrapping_add(dd), l))
                            .collect()
                    }
                    _ => {
                        let mut chunks = Vec::new();
                        let mut at = copy.pack_addr;
                        dst_chunks(piece, &places[copy.lane], dst, limits.1, |d, l| {
                            match chunks.last_mut() {
                                Some((_, nd, nl)) if *nd + *nl == d => *nl += l,
                                _ => chunks.push((at, d, l)),
                            }
                            at += l;
                            Ok(())
                        })?;
                        chunks
                    }
                };
                for &chunk in &chunks {
                    network.push_merged(chunk)?;
                }
                previous = Some((k, chunks));
            }
            network.end_pair(); // offsets per group, replaced by per page pair below
            per_pair[group.last_pair] = network.plan.lengths.len() - before;
        }
        let mut plan = network.finish(need);
        plan.pair_offsets = vec![0];
        let mut at = 0;
        for blocks in per_pair {
            at += blocks;
            plan.pair_offsets.push(at);
        }
        for (lane, lane_rows) in rows.iter_mut().enumerate() {
            if !copies.iter().any(|c| c.lane == lane) {
                lane_rows.clear(); // walked (lane 0 always is), but no piece copies them
            }
        }
        Ok((
            RowGather {
                rows,
                copies,
                pack_bytes: need,
            },
            plan,
        ))
    }
}

/// Rewrites the first `n` blocks of a direct plan in place into the gather plan (sources kept,
/// destinations packed back to back from `pack.addr`, merged where both sides continue) and
/// returns it with the network plan. `offsets` are the direct plan's pair offsets.
///
/// # Errors
/// [`PlanError::PackTooSmall`], [`PlanError::Overflow`], [`PlanError::OutOfMemory`].
pub(crate) fn pack_columns(
    out: Columns<'_>,
    n: usize,
    offsets: &[usize],
    pack: PackBuffer,
) -> Result<PackedPlan<PlanPart>> {
    let n = n.min(out.capacity());
    let need = plan_bytes(&out.lengths[..n])?;
    if need > pack.size {
        return Err(PlanError::PackTooSmall {
            need,
            have: pack.size,
            blocks: n,
        });
    }
    pack.addr
        .checked_add(pack.size)
        .ok_or(PlanError::Overflow {
            what: "pack buffer end",
        })?;
    let bounds = PairBounds::of(offsets, n);
    // The network plan reads the direct destinations, so it is built before the gather
    // rewrite overwrites them: one block per destination-contiguous run of a pair (the pack
    // side continues with it, the blocks being packed back to back).
    let mut network = PlanBuilder::default();
    let mut at = pack.addr;
    for pair in bounds.get().windows(2) {
        for k in pair[0]..pair[1] {
            network.push_merged((at, out.dst_addrs[k], out.lengths[k]))?;
            at += out.lengths[k]; // at most pack.addr + need <= pack.addr + pack.size
        }
        network.end_pair();
    }
    let (written, gather_offsets) = gather_in_place(out, &bounds, pack.addr);
    let mut network = network.finish(need);
    let gather_pair_offsets = if bounds.by_pair {
        gather_offsets
    } else {
        // No pair structure to follow: keep the direct plan's (empty or trivial) offsets.
        network.pair_offsets = offsets.to_vec();
        offsets.to_vec()
    };
    Ok(PackedPlan {
        gather: PlanPart {
            n_blocks: written,
            total_bytes: need,
            pair_offsets: gather_pair_offsets,
        },
        network,
        pack_bytes: need,
    })
}

/// `(pack address, destination address, bytes)` of a destination-contiguous run.
type Chunk = (u64, u64, u64);

/// Bytes of blocks of these lengths.
///
/// # Errors
/// [`PlanError::Overflow`].
pub(crate) fn plan_bytes(lengths: &[u64]) -> Result<u64> {
    lengths.iter().try_fold(0u64, |sum, &l| {
        sum.checked_add(l)
            .ok_or(PlanError::Overflow { what: "plan bytes" })
    })
}

/// The block ranges a plan's blocks are walked in: its pair offsets when they cover its `n`
/// blocks, else one range of all of them.
pub(crate) struct PairBounds {
    /// Whether the ranges are the plan's pairs.
    pub(crate) by_pair: bool,
    bounds: Vec<usize>,
}

impl PairBounds {
    pub(crate) fn of(offsets: &[usize], n: usize) -> Self {
        let by_pair = offsets.len() >= 2 && offsets[0] == 0 && offsets.last() == Some(&n);
        let bounds = if by_pair {
            offsets.to_vec()
        } else {
            vec![0, n]
        };
        Self { by_pair, bounds }
    }

    /// `ranges + 1` block offsets.
    pub(crate) fn get(&self) -> &[usize] {
        &self.bounds
    }
}

/// The one gather rewrite (pack and staged plans): rewrites the blocks `bounds` covers in place
/// into a gather from their sources into memory from `start`, the blocks back to back in plan
/// order, consecutive blocks of a range merged when they continue on the source side (the
/// packed side always does). Returns the gather's block count and its range offsets. The caller
/// has checked that `start` plus the blocks' bytes does not pass its region's end.
pub(crate) fn gather_in_place(
    out: Columns<'_>,
    bounds: &PairBounds,
    start: u64,
) -> (usize, Vec<usize>) {
    let (src, dst, len) = (out.src_addrs, out.dst_addrs, out.lengths);
    let bounds = bounds.get();
    let mut gather_offsets = Vec::with_capacity(bounds.len());
    gather_offsets.push(0);
    let mut written = 0usize; // gather blocks so far (<= blocks read: the rewrite stays behind)
    let mut at = start;
    for pair in bounds.windows(2) {
        // The open gather block of this range, kept in locals and written out when the next
        // block does not continue it (the rewrite index stays behind the read index, so every
        // block is read before its slot is overwritten).
        let mut gather: Option<(u64, u64, u64)> = None;
        for k in pair[0]..pair[1] {
            let (s, l) = (src[k], len[k]);
            gather = match gather {
                Some((gs, gd, gl)) if gs + gl == s && gd + gl == at => Some((gs, gd, gl + l)),
                Some(done) => {
                    (src[written], dst[written], len[written]) = done;
                    written += 1;
                    Some((s, at, l))
                }
                None => Some((s, at, l)),
            };
            at += l; // inside the region (checked by the caller)
        }
        if let Some(done) = gather {
            (src[written], dst[written], len[written]) = done;
            written += 1;
        }
        gather_offsets.push(written);
    }
    (written, gather_offsets)
}

/// A small plan as it grows (network and scatter plans), blocks merged within a pair range.
#[derive(Default)]
pub(crate) struct PlanBuilder {
    plan: Plan,
    /// First block of the current pair range.
    pair_start: usize,
}

impl PlanBuilder {
    /// Appends a block, merged into the previous one when it belongs to the same pair range
    /// and continues it on both sides.
    pub(crate) fn push_merged(&mut self, (src, dst, len): (u64, u64, u64)) -> Result<()> {
        let p = &mut self.plan;
        let n = p.lengths.len();
        if n > self.pair_start {
            let (ls, ld, ll) = (p.src_addrs[n - 1], p.dst_addrs[n - 1], p.lengths[n - 1]);
            if ls.checked_add(ll) == Some(src) && ld.checked_add(ll) == Some(dst) {
                p.lengths[n - 1] = ll + len; // both blocks lie in one region: no overflow
                return Ok(());
            }
        }
        for (column, value) in [
            (&mut p.src_addrs, src),
            (&mut p.dst_addrs, dst),
            (&mut p.lengths, len),
        ] {
            column
                .try_reserve(1)
                .map_err(|_| PlanError::out_of_memory::<u64>("plan column", column.len() + 1))?;
            column.push(value);
        }
        Ok(())
    }

    /// Ends a pair range: records its end offset (later blocks never merge into it).
    pub(crate) fn end_pair(&mut self) {
        if self.plan.pair_offsets.is_empty() {
            self.plan.pair_offsets.push(0);
        }
        self.pair_start = self.plan.lengths.len();
        self.plan.pair_offsets.push(self.pair_start);
    }

    pub(crate) fn finish(self, total_bytes: u64) -> Plan {
        let mut plan = self.plan;
        plan.n_runs = plan.lengths.len();
        plan.total_bytes = total_bytes;
        plan
    }
}
