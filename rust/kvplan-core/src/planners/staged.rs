//! Staged plans: a request's direct plan as a gather into a prefill staging region, a few large
//! network blocks from it into a decode staging region, and a scatter from there into the
//! decode's pages.
//!
//! Prefill TP ≠ decode TP on token-major (NHD) pages makes one direct block per token per head
//! slice; staging turns the network part into one block per (writer, contiguous slot range),
//! at the price of two local copies (GPU kernels in production, [`crate::exchange::local`] on CPU).
//!
//! All three plans derive from the direct plan of the request, so every byte lands where the
//! direct plan puts it. Direct block `k` of pair range `p` (a range of `pair_offsets`) is placed
//! at offset `off_k` of its range (the bytes of the range's blocks before it):
//! - `gather`: `src_k → src_staging + S_p + off_k`, the ranges back to back in plan order from
//!   the region's start (the gather rewrite of [`crate::planners::pack`]);
//! - `network`: one block `src_staging + S_p → dst_staging + D_p` per range, merged with the
//!   previous one when it continues on both sides, so the network plan's pair offsets are one
//!   range of all its blocks (not per entry pair);
//! - `scatter`: `dst_staging + D_p + off_k → dst_k`, merged within a range when both sides
//!   continue.
//!
//! The decode offsets `D_p` follow SGLang 0.5.23's staging layout (`compute_staging_layout`).
//! A decode region is filled by one or several *writers* ([`crate::rules::heads::staging_writer`]:
//! `tp_p / tp_d` prefill ranks when the prefill TP is larger) and, under prefill PP, by every
//! prefill stage. With one writer and prefill PP 1, `D_p = S_p` (plain back-to-back packing).
//! Otherwise every writer owns `writer_bytes = slot_bytes × slots` bytes at `writer_index ×
//! writer_bytes`, holding one *slot* per decode page entry (the decode layout's page entries in
//! its order: SGLang's K entries then V entries), and range `p` lands in the slot of its decode
//! entry: `D_p = writer_index × writer_bytes + slot(p) × slot_bytes`, so PP stages fill disjoint
//! slots. Every entry pair of the request must then move the same `slot_bytes`
//! ([`PlanError::StagingSlotSizes`] otherwise). A coalesced group (one range for several pairs)
//! takes as many consecutive slots as it has pairs.
//!
//! Within a range, blocks keep plan order. For a head-sliced NHD request that order is
//! token-major (`[token][sent heads][head_dim]` per entry: SGLang's staging layout), because
//! a page request is staged from the template's token plan whenever that plan moves the same
//! bytes in no more blocks (the page plan of a sliced NHD pair is slot-major instead).
//!
//! Regions are checked before any output exists: the prefill region must hold the plan's
//! bytes, the decode region every writer's share (`writers × writer_bytes`), else
//! [`PlanError::StagingTooSmall`] naming both sizes; no block ever reaches past a region's end.
//!
//! State slots are staged as more ranges of the direct plan: a slot request's ranges are its
//! state (and ring) pairs, and a page request that carries a state slot has them after its
//! page pairs ([`Template::pair_offsets`]), possibly in other buffers than the pages. With one
//! writer and prefill PP 1 they are packed back to back like every range. A decode region laid
//! out in page-entry slots (several writers or prefill PP) has no slot for them, so a request
//! that moves state bytes there is refused ([`PlanError::Geometry`]); rounds
//! ([`crate::planners::rounds`]) place bytes by stream offset and take it.

use crate::error::{PlanError, Result};
use crate::model::layer_groups::PeerRanks;
use crate::model::plan::{AsColumns, Columns, FlatBuffer, Plan, PlanPart, PlanSummary, PlanUnit};
use crate::model::request::Request;
use crate::model::runs::PageIndex;
use crate::peer::entry::Indexing;
use crate::peer_pair::template::Template;
use crate::planners::pack::{PackBuffer, PairBounds, PlanBuilder, gather_in_place, plan_bytes};
use crate::rules::capabilities::Planner;
use crate::rules::heads::staging_writer;

/// Registered memory a staged plan stages bytes in: `(addr, size)`, like a pack buffer.
pub type StagingRegion = PackBuffer;

/// A request's plan as a local gather, a network plan between staging regions and a local
/// scatter (see the [`crate::planners::staged`] module). The gather and scatter are owned [`Plan`]s, or
/// (`P` = [`PlanPart`], from [`StagedPlanner::plan_into`]) the sizes and offsets of what was
/// written into the caller's two outputs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StagedPlan<P = Plan> {
    /// Prefill memory → prefill staging region (run locally by the prefill before the network).
    pub gather: P,
    /// Prefill staging region → decode staging region (moved by the engine; small, always
    /// owned).
    pub network: Plan,
    /// Decode staging region → decode memory (run locally by the decode after the network).
    pub scatter: P,
    /// Bytes of the prefill staging region the plan uses, from its start: the plan's bytes,
    /// which the gather, the network and the scatter each move.
    pub src_staging_bytes: u64,
    /// Offsets `[start, end)` of the decode staging region this writer's share covers (its
    /// bytes are written at slots inside it).
    pub dst_staging_range: (u64, u64),
    /// Bytes the decode staging region must hold for all writers.
    pub dst_staging_bytes: u64,
    /// Blocks of the request's direct plan ([`Template::plan`]), for a direct-or-staged choice.
    pub direct_blocks: usize,
    /// `(writer index, number of writers)` of this prefill rank in the decode region.
    pub writer: (u32, u32),
}

/// Staged plans of one template; borrows the template.
#[derive(Debug, Clone)]
pub struct StagedPlanner<'t> {
    template: &'t Template,
}

impl<'t> StagedPlanner<'t> {
    /// The staged planner of `template`.
    pub fn new(template: &'t Template) -> Self {
        Self { template }
    }
}

/// A staged plan's counts, known without planning it (what the direct-or-staged advice needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedCounts {
    /// Blocks of the request's direct plan.
    pub direct_blocks: usize,
    /// Blocks of the staged network plan (this template's writer position included).
    pub network_blocks: usize,
    /// Bytes of the request: what the network moves either way, and what the gather and the
    /// scatter each copy.
    pub bytes: u64,
}

/// Everything of a staged plan that is known before its gather and scatter are emitted: the
/// one derivation [`StagedPlanner::plan_into`] emits from and [`StagedPlanner::counts`]
/// counts from.
struct StagedLayout<'a, S, D> {
    /// The request the gather and scatter are derived from (the caller's, or its token form).
    request: Request<'a, S, D>,
    /// The shape of that plan.
    shape: PlanSummary,
    /// Its pair offsets, and the block ranges they make.
    pair_offsets: Vec<usize>,
    bounds: PairBounds,
    /// Bytes of every range.
    range_bytes: Vec<u64>,
    /// Offset of every range in the decode region.
    placement: DecodePlacement,
    network: Plan,
    direct_blocks: usize,
    writer: (u32, u32),
}

/// Where each pair range of a direct plan lands in the decode region.
struct DecodePlacement {
    /// Per pair range, its offset in the decode region.
    offsets: Vec<u64>,
    /// This writer's share of the region.
    range: (u64, u64),
    /// Bytes the region must hold for all writers.
    need: u64,
    /// What the need is made of, for messages.
    layout: String,
}

/// Writes the scatter of a direct plan's blocks (`dst_addrs`, `lengths`: its destination and
/// length columns) into `out`: range `r`'s blocks read back to back from `base +
/// offsets[r]`, merged within a range when both sides continue. Returns the scatter's blocks
/// and range offsets.
///
/// # Errors
/// [`PlanError::InputChanged`] when a range's blocks do not add up to its bytes (the emitted
/// plan differs from the validated shape), so no block reaches past the range's place.
fn scatter_into<S: ScatterSources>(
    (dst_addrs, lengths): (&[u64], &[u64]),
    out: Columns<'_>,
    bounds: &PairBounds,
    (base, offsets): (u64, &[u64]),
    range_bytes: &[u64],
    sources: &mut S,
) -> Result<(usize, Vec<usize>)> {
    let bounds = bounds.get();
    let mut pair_offsets = Vec::with_capacity(bounds.len());
    pair_offsets.push(0);
    let mut written = 0usize; // <= blocks read, and the output holds every direct block
    // Where the current range starts in the stream (the ranges back to back, as gathered).
    let mut stream = 0u64;
    // The current round's bound in the stream and the shift from a stream offset to a source,
    // kept here so that the walk reads no state of `sources` per block.
    let (mut limit, mut shift) = sources.round();
    // What a block's decode staging address is moved by to become its stream offset (nothing
    // when the sources are the decode staging addresses).
    let mut to_stream = 0u64;
    let mut put = |written: &mut usize, to_stream: u64, (s, d, l): (u64, u64, u64)| {
        let at = s.wrapping_add(to_stream);
        let end = at.wrapping_add(l);
        if end > limit {
            (limit, shift) = sources.cut(*written, at, end);
        }
        (
            out.src_addrs[*written],
            out.dst_addrs[*written],
            out.lengths[*written],
        ) = (at.wrapping_add(shift), d, l);
        *written += 1;
    };
    for (r, range) in bounds.windows(2).enumerate() {
        let (start, bytes) = (base + offsets[r], range_bytes[r]);
        if S::BY_STREAM {
            to_stream = stream.wrapping_sub(start);
        }
        let mut at = start;
        // The open scatter block of this range (written out when the next does not continue it).
        let mut open: Option<(u64, u64, u64)> = None;
        for (&d, &l) in dst_addrs[range[0]..range[1]]
            .iter()
            .zip(&lengths[range[0]..range[1]])
        {
            open = match open {
                Some((os, od, ol)) if od.wrapping_add(ol) == d => Some((os, od, ol + l)),
                Some(done) => {
                    put(&mut written, to_stream, done);
                    Some((at, d, l))
                }
                None => Some((at, d, l)),
            };
            at = at.saturating_add(l);
        }
        // Each range's blocks add up to its bytes, so every block stays inside its place (else
        // the whole plan is refused).
        if at - start != bytes {
            return Err(PlanError::InputChanged);
        }
        if let Some(done) = open {
            put(&mut written, to_stream, done);
        }
        stream = stream.wrapping_add(bytes);
        pair_offsets.push(written);
    }
    Ok((written, pair_offsets))
}

/// What a staged scatter's sources are written as while it is emitted: the decode staging
/// addresses ([`StagingSources`]), or, for a caller that cuts the stream the gather writes
/// into rounds, each block's stream offset plus its round's shift (so the caller need not walk
/// the scatter a second time).
pub(crate) trait ScatterSources {
    /// Whether sources derive from stream offsets (else they are the decode staging
    /// addresses, and [`ScatterSources::round`] must be `(u64::MAX, 0)`).
    const BY_STREAM: bool;
    /// Called once before the scatter is emitted, with the bytes of the plan.
    ///
    /// # Errors
    /// When the caller cannot prepare for that many bytes (memory).
    fn begin(&mut self, total: u64) -> Result<()>;
    /// The current round: the stream offset no block may end past without a call of
    /// [`ScatterSources::cut`], and what a stream offset is shifted by (wrapping) to become
    /// a source.
    fn round(&self) -> (u64, u64);
    /// Scatter block `index` (blocks in stream order) at stream offset `at` ends at `end`,
    /// past the current round's bound; returns the round it belongs to (as
    /// [`ScatterSources::round`]).
    fn cut(&mut self, index: usize, at: u64, end: u64) -> (u64, u64);
}

/// The staged plan's own scatter sources: the decode staging addresses.
pub(crate) struct StagingSources;

impl ScatterSources for StagingSources {
    const BY_STREAM: bool = false;
    fn begin(&mut self, _total: u64) -> Result<()> {
        Ok(())
    }
    fn round(&self) -> (u64, u64) {
        (u64::MAX, 0)
    }
    fn cut(&mut self, _index: usize, _at: u64, _end: u64) -> (u64, u64) {
        (u64::MAX, 0)
    }
}

impl StagedPlanner<'_> {
    /// Plans one request (as [`Template::plan_into`]) as a staged plan through `src_staging`
    /// (prefill memory) and `dst_staging` (decode memory); see the [`crate::planners::staged`] module.
    ///
    /// Once both regions are checked, `make_outputs` receives the shape of the plan the stages
    /// derive from and returns two outputs of at least `shape.n_blocks` values per column (a
    /// pooled buffer, a caller's arrays…): the plan is emitted into the first and rewritten in
    /// place into the gather, the scatter is written into the second. Nothing else of the
    /// plan's size is allocated.
    ///
    /// # Errors
    /// As [`Template::plan_into`]; [`PlanError::StagingTooSmall`] for a region smaller than
    /// what the plan places in it; [`PlanError::StagingSlotSizes`] when decode slots are
    /// needed and the pairs move different bytes; [`PlanError::Geometry`] for a coalesced group
    /// whose decode entries are not consecutive page entries or TP sizes neither of which
    /// divides the other ([`crate::rules::heads::staging_writer`]); [`PlanError::OutputTooSmall`];
    /// [`PlanError::Overflow`].
    #[allow(clippy::too_many_arguments)] // the request, two regions and the output source
    pub fn plan_into<'o, 'p, S: PageIndex, D: PageIndex, O, P>(
        &self,
        request: &Request<'_, S, D>,
        src_staging: StagingRegion,
        dst_staging: StagingRegion,
        make_outputs: impl FnOnce(&PlanSummary) -> Result<(O, P)>,
    ) -> Result<(O, P, StagedPlan<PlanPart>)>
    where
        O: AsColumns<'o>,
        P: AsColumns<'p>,
    {
        self.plan_into_with(
            request,
            (src_staging, dst_staging),
            make_outputs,
            &mut StagingSources,
        )
    }

    /// [`StagedPlanner::plan_into`] with the scatter's sources written by `sources` (see
    /// [`ScatterSources`]); everything else as that.
    ///
    /// # Errors
    /// As [`StagedPlanner::plan_into`], and what `sources.begin` returns.
    pub(crate) fn plan_into_with<'o, 'p, S: PageIndex, D: PageIndex, O, P, Sources>(
        &self,
        request: &Request<'_, S, D>,
        (src_staging, dst_staging): (StagingRegion, StagingRegion),
        make_outputs: impl FnOnce(&PlanSummary) -> Result<(O, P)>,
        sources: &mut Sources,
    ) -> Result<(O, P, StagedPlan<PlanPart>)>
    where
        O: AsColumns<'o>,
        P: AsColumns<'p>,
        Sources: ScatterSources,
    {
        let layout = self.staged_layout(request, (src_staging, dst_staging), Sources::BY_STREAM)?;
        let mut second = None;
        let (mut output, summary) = self.template.plan_into(&layout.request, |shape| {
            if *shape != layout.shape {
                return Err(PlanError::InputChanged);
            }
            let (first, scatter) = make_outputs(shape)?;
            second = Some(scatter);
            Ok(first)
        })?;
        let mut scatter_output = second.ok_or(PlanError::InputChanged)?;
        let n = summary.n_blocks;
        let columns = output.columns();
        let scatter_columns = scatter_output.columns();
        if scatter_columns.capacity() < n {
            return Err(PlanError::OutputTooSmall {
                have: scatter_columns.capacity(),
                need: n,
            });
        }
        sources.begin(layout.shape.total_bytes)?;
        // The scatter reads the direct destinations, so it is written before the gather
        // rewrite overwrites them. Every address lies inside its region: the offsets plus the
        // range bytes are at most the sizes checked, and each range's blocks are checked to
        // add up to its bytes (the plan is refused otherwise).
        let (scatter_blocks, mut scatter_pair_offsets) = scatter_into(
            (&columns.dst_addrs[..n], &columns.lengths[..n]),
            scatter_columns,
            &layout.bounds,
            (dst_staging.addr, &layout.placement.offsets),
            &layout.range_bytes,
            sources,
        )?;
        let (gather_blocks, mut gather_pair_offsets) =
            gather_in_place(columns, &layout.bounds, src_staging.addr);
        if !layout.bounds.by_pair {
            // No pair structure (no page pairs): the direct plan's offsets, as pack plans keep.
            gather_pair_offsets.clone_from(&layout.pair_offsets);
            scatter_pair_offsets.clone_from(&layout.pair_offsets);
        }
        let total_bytes = layout.shape.total_bytes;
        let part = |n_blocks, pair_offsets| PlanPart {
            n_blocks,
            total_bytes,
            pair_offsets,
        };
        let staged = StagedPlan {
            gather: part(gather_blocks, gather_pair_offsets),
            scatter: part(scatter_blocks, scatter_pair_offsets),
            network: layout.network,
            src_staging_bytes: total_bytes,
            dst_staging_range: layout.placement.range,
            dst_staging_bytes: layout.placement.need,
            direct_blocks: layout.direct_blocks,
            writer: layout.writer,
        };
        Ok((output, scatter_output, staged))
    }

    /// Allocating convenience over [`StagedPlanner::plan_into`].
    ///
    /// # Errors
    /// As [`StagedPlanner::plan_into`].
    pub fn plan<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
        src_staging: StagingRegion,
        dst_staging: StagingRegion,
    ) -> Result<StagedPlan> {
        let (gather, scatter, staged) =
            self.plan_into(request, src_staging, dst_staging, |shape| {
                let output = || FlatBuffer::try_zeroed(shape.n_blocks);
                Ok((output()?, output()?))
            })?;
        Ok(StagedPlan {
            gather: staged.gather.into_plan(gather)?,
            scatter: staged.scatter.into_plan(scatter)?,
            network: staged.network,
            src_staging_bytes: staged.src_staging_bytes,
            dst_staging_range: staged.dst_staging_range,
            dst_staging_bytes: staged.dst_staging_bytes,
            direct_blocks: staged.direct_blocks,
            writer: staged.writer,
        })
    }

    /// The counts of the staged plan of one request ([`StagedPlanner::plan`]) without
    /// planning it: the direct plan's blocks from its shape, the network plan from the pairs'
    /// bytes and their decode placement (the same derivation the staged plan is built from),
    /// the bytes from the plan's shape.
    ///
    /// # Errors
    /// As [`StagedPlanner::plan`] for the same request, except that no staging region can be
    /// too small: the counts are taken with regions spanning the whole address space (blocks
    /// merge by offsets inside the regions, never by where the regions start, so these are the
    /// counts of any real regions).
    pub fn counts<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
    ) -> Result<StagedCounts> {
        let whole = StagingRegion {
            addr: 0,
            size: u64::MAX,
        };
        let layout = self.staged_layout(request, (whole, whole), false)?;
        Ok(StagedCounts {
            direct_blocks: layout.direct_blocks,
            network_blocks: layout.network.lengths.len(),
            bytes: layout.shape.total_bytes,
        })
    }

    /// Validates a staged request and derives everything but its gather and scatter columns
    /// (see [`StagedLayout`]), checking both regions before any output exists.
    ///
    /// `by_stream`: the caller places the decode's bytes by stream offset (rounds), so the
    /// decode region's layout only sizes the network plan and state ranges need no slot.
    fn staged_layout<'a, S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'a, S, D>,
        (src_staging, dst_staging): (StagingRegion, StagingRegion),
        by_stream: bool,
    ) -> Result<StagedLayout<'a, S, D>> {
        self.template.admit(Planner::Staged, request)?;
        for (region, what) in [
            (src_staging, "prefill staging region end"),
            (dst_staging, "decode staging region end"),
        ] {
            region
                .addr
                .checked_add(region.size)
                .ok_or(PlanError::Overflow { what })?;
        }
        let direct = self.template.prepare(request)?;
        let (staged_request, shape) = self.staging_tokens(request, direct);
        if shape.total_bytes > src_staging.size {
            return Err(PlanError::StagingTooSmall {
                region: "prefill",
                need: shape.total_bytes,
                have: src_staging.size,
                layout: format!("the gather of {} blocks", shape.n_blocks),
            });
        }
        // The ranges of the whole plan: its page (or token) pairs, then, for a request that
        // carries a state slot, its state and ring pairs (a slot request's are all state pairs).
        let pair_offsets = self.template.pair_offsets(&shape);
        let bounds = PairBounds::of(&pair_offsets, shape.n_blocks);
        let range_bytes = if bounds.by_pair {
            self.template.pair_bytes(&shape)?
        } else {
            vec![shape.total_bytes]
        };
        let page_ranges = self.template.page_pair_ranges(&shape);
        let (prefill, decode) = (
            PeerRanks::of(&self.template.layouts.0),
            PeerRanks::of(&self.template.layouts.1),
        );
        let writer = staging_writer(prefill.tp_size, prefill.tp_rank, decode.tp_size)?;
        let placement = self.place_decode(
            &bounds,
            (&range_bytes, page_ranges),
            writer,
            prefill.pp_size,
            by_stream,
        )?;
        if placement.need > dst_staging.size {
            return Err(PlanError::StagingTooSmall {
                region: "decode",
                need: placement.need,
                have: dst_staging.size,
                layout: placement.layout,
            });
        }
        // One block per moving range, merged with the previous one when it continues on both
        // sides (the prefill side always does: ranges back to back).
        let mut network = PlanBuilder::default();
        let mut at = src_staging.addr;
        for (r, &bytes) in range_bytes.iter().enumerate() {
            if bytes > 0 {
                let staged = dst_staging.addr + placement.offsets[r];
                network.push_merged((at, staged, bytes))?;
            }
            at += bytes;
        }
        network.end_pair();
        let network = network.finish(shape.total_bytes);
        Ok(StagedLayout {
            request: staged_request,
            shape,
            pair_offsets,
            bounds,
            range_bytes,
            placement,
            network,
            direct_blocks: direct.n_blocks,
            writer,
        })
    }

    /// The `n_tokens` the staged plan is derived with, and that plan's shape: a page request
    /// is staged from its token plan when that moves the same bytes in no more blocks
    /// (token-major order within each pair), else from its page plan; a token request as given.
    // The summary is consumed (and returned rewritten), once per request.
    #[allow(clippy::large_types_passed_by_value)]
    fn staging_tokens<'a, S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'a, S, D>,
        direct: PlanSummary,
    ) -> (Request<'a, S, D>, PlanSummary) {
        let PlanUnit::Pages(found) = direct.unit else {
            return (*request, direct);
        };
        let Ok((src, _)) = request.page_lists("a staged plan") else {
            return (*request, direct);
        };
        if found.n_pages == 0 || self.template.strategy.tokens().is_err() {
            return (*request, direct);
        }
        let Some(tokens) = (src.len() as u64).checked_mul(self.template.page_sizes().0) else {
            return (*request, direct);
        };
        let by_token = Request {
            n_tokens: Some(tokens),
            ..*request
        };
        match self.template.prepare(&by_token) {
            Ok(shape)
                if shape.total_bytes == direct.total_bytes && shape.n_blocks <= direct.n_blocks =>
            {
                (by_token, shape)
            }
            _ => (*request, direct),
        }
    }

    /// The decode offset of every pair range (see the module documentation). The first
    /// `page_ranges` ranges are page pairs'; the others (state and ring pairs') follow the
    /// page slots, back to back, when the caller places by stream offset (`by_stream`), and
    /// are refused otherwise once the region is laid out in slots.
    fn place_decode(
        &self,
        bounds: &PairBounds,
        (range_bytes, page_ranges): (&[u64], usize),
        (writer, writers): (u32, u32),
        prefill_pp_size: u32,
        by_stream: bool,
    ) -> Result<DecodePlacement> {
        let total = plan_bytes(range_bytes)?;
        if (writers == 1 && prefill_pp_size <= 1) || !bounds.by_pair {
            let mut offsets = Vec::with_capacity(range_bytes.len());
            let mut at = 0;
            for &bytes in range_bytes {
                offsets.push(at);
                at += bytes;
            }
            return Ok(DecodePlacement {
                offsets,
                range: (0, total),
                need: total,
                layout: format!("the plan's {total} bytes"),
            });
        }
        let state_bytes = plan_bytes(range_bytes.get(page_ranges..).unwrap_or_default())?;
        if state_bytes > 0 && !by_stream {
            return Err(PlanError::Geometry {
                what: format!(
                    "a staged plan lays the decode staging region out in one slot per decode \
                     page entry when several prefill ranks or PP stages write it ({writers} \
                     writer(s), prefill PP {prefill_pp_size}), and state slots have no slot \
                     there; this request moves {state_bytes} bytes of state: plan it with \
                     plan_rounds (rounds place bytes by stream offset), or plan its state slot \
                     with Template::plan"
                ),
            });
        }
        let (dst_slots, n_slots) = self.decode_slots();
        // Per moving range its first slot, and the bytes of one slot.
        let mut placed: Vec<Option<u64>> = vec![None; range_bytes.len()];
        let mut slot_bytes: Option<(usize, u64)> = None;
        for (pair, &bytes) in range_bytes.iter().enumerate().take(page_ranges) {
            if bytes == 0 {
                continue;
            }
            // The pairs whose blocks this range holds: its group's (one, unless coalesced).
            let pair_groups = self.template.blocks.pair_groups();
            let members: Vec<usize> = match pair_groups.get(pair).copied().flatten() {
                Some(g) => (self.template.blocks.groups()[g].first_pair..=pair)
                    .filter(|&q| pair_groups[q] == Some(g))
                    .collect(),
                None => vec![pair],
            };
            let first = dst_slots[members[0]];
            let consecutive = members
                .iter()
                .enumerate()
                .all(|(i, &q)| dst_slots[q] == first + i);
            let count = members.len() as u64;
            if !consecutive || !bytes.is_multiple_of(count) {
                return Err(PlanError::Geometry {
                    what: format!(
                        "page pairs {}..={pair} are coalesced into one block range but their \
                         decode entries are not consecutive page entries, so they have no \
                         staging slots; build the template with coalesce=False",
                        members[0]
                    ),
                });
            }
            let per_slot = bytes / count;
            match slot_bytes {
                None => slot_bytes = Some((pair, per_slot)),
                Some((first_pair, first_bytes)) if first_bytes != per_slot => {
                    return Err(PlanError::StagingSlotSizes {
                        first_pair,
                        first_bytes,
                        pair,
                        bytes: per_slot,
                    });
                }
                Some(_) => {}
            }
            placed[pair] = Some(first as u64);
        }
        let slot = slot_bytes.map_or(0, |(_, b)| b);
        let overflow = || PlanError::Overflow {
            what: "decode staging layout",
        };
        let writer_bytes = slot.checked_mul(n_slots).ok_or_else(overflow)?;
        let start = writer_bytes
            .checked_mul(u64::from(writer))
            .ok_or_else(overflow)?;
        let slots_need = writer_bytes
            .checked_mul(u64::from(writers))
            .ok_or_else(overflow)?;
        // Slots lie below `n_slots` and a range's slots are consecutive, so every range lies
        // inside this writer's share; two ranges never share a slot (one decode entry per pair).
        // State ranges (placed only by stream: `state_bytes` is 0 otherwise) follow every
        // writer's slots, back to back.
        let need = slots_need.checked_add(state_bytes).ok_or_else(overflow)?;
        let mut state_at = slots_need;
        let offsets = placed
            .iter()
            .zip(range_bytes)
            .enumerate()
            .map(|(r, (p, &bytes))| match p {
                Some(first) => start + first * slot,
                None if r >= page_ranges => {
                    state_at += bytes;
                    state_at - bytes
                }
                None => start,
            })
            .collect();
        Ok(DecodePlacement {
            offsets,
            range: (start, start + writer_bytes),
            need,
            layout: format!(
                "{writers} writer(s) × {n_slots} decode page entries × {slot} bytes per entry"
            ),
        })
    }

    /// Per page pair, the position of its decode entry among the decode layout's page entries,
    /// and their number: the decode staging slots.
    fn decode_slots(&self) -> (Vec<usize>, u64) {
        let dst = &self.template.layouts.1;
        let page_entries = dst.entries_of_kind(Indexing::Page);
        let mut slot_of = vec![0; dst.n_entries()];
        for (slot, &entry) in page_entries.iter().enumerate() {
            slot_of[entry] = slot;
        }
        let slots = self
            .template
            .page_pairs
            .iter()
            .map(|p| slot_of[p.dst_entry])
            .collect();
        (slots, page_entries.len() as u64)
    }
}
