//! Many requests to one peer planned as one plan: one set of columns for one engine
//! submission, with each request's place in it, so that a failed engine call names exactly the
//! requests whose bytes it held.
//!
//! Every request is validated by [`Template::prepare`] (the one request path); on top of that a
//! batch refuses two requests that write one destination page or slot. Consecutive page
//! requests whose pages touch on both sides (the last page pair of one and the first of the
//! next step by +1 on each side, and neither boundary run descends) form one **segment**: their
//! boundary runs merge into one run, so the blocks that cross from one request into the next
//! are one block. A segment's blocks are those of its merged runs, entry-pair major as a single
//! request's plan. Consecutive token requests (a token range, further pools, per-pool ranges)
//! form a segment the same way: where, for every piece of a token class, the next request's
//! first block starts on both sides where the previous one's last block ends, those two blocks
//! are one block; a segment's blocks are piece major as a single token plan's, each piece's
//! blocks request after request. Every other request is a segment of its own, planned as it
//! would be alone. Segments follow the request order, so a segment's blocks and a segment's
//! requests are both contiguous ranges.

use crate::error::{PlanError, Result, try_vec};
use crate::model::plan::{AsColumns, Columns, FlatBuffer, PlanSummary, PlanUnit};
use crate::model::request::{Indices, Request};
use crate::model::runs::{DESCENDING, PageIndex};
use crate::peer::entry::{POOLS, PoolId};
use crate::peer_pair::template::Template;
use crate::rules::capabilities::Planner;

/// A batch given flat: every request's pages concatenated in one slice per side, and offsets
/// as CSR row pointers. Request `r` moves pages `src[offsets[r]..offsets[r + 1]]` to
/// `dst[d[r]..d[r + 1]]`, where `d` is `dst_offsets` when given and `offsets` otherwise (a page
/// request has as many pages on each side; a token request between different page sizes does
/// not). [`FlatRequests::requests`] borrows the slices as the requests every planner takes, so a
/// flat batch is planned by the same path as any other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlatRequests<'a, S = i64, D = i64> {
    /// Every request's source pages, request after request.
    pub src: &'a [S],
    /// Every request's destination pages, request after request.
    pub dst: &'a [D],
    /// `n_requests + 1` offsets into `src`, and into `dst` when `dst_offsets` is `None`: the
    /// first 0, none decreasing, the last the slice's length.
    pub offsets: &'a [i64],
    /// `n_requests + 1` offsets into `dst`, when they differ from `offsets`.
    pub dst_offsets: Option<&'a [i64]>,
    /// Tokens to move, one count per request (each request then a token request), or `None`
    /// (the template's default: whole pages, or every full page of a token template).
    pub n_tokens: Option<&'a [i64]>,
}

impl<'a, S: PageIndex, D: PageIndex> FlatRequests<'a, S, D> {
    /// Page requests sharing one set of offsets.
    pub fn new(src: &'a [S], dst: &'a [D], offsets: &'a [i64]) -> Self {
        Self {
            src,
            dst,
            offsets,
            dst_offsets: None,
            n_tokens: None,
        }
    }

    /// Requests in the batch (0 for offsets that are not even one value).
    pub fn n_requests(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// The requests, each borrowing its pages from the flat slices (nothing is copied).
    ///
    /// # Errors
    /// [`PlanError::FlatBatch`] naming the values: offsets that are empty, do not start at 0,
    /// are negative or decrease, or whose last value is not its slice's length; `dst_offsets`
    /// of another length than `offsets`; `n_tokens` of another length than the requests, or
    /// negative. [`PlanError::OutOfMemory`] if the requests cannot be allocated.
    pub fn requests(&self) -> Result<Vec<Request<'a, S, D>>> {
        let n = self.n_requests();
        check_offsets(self.offsets, "offsets", "src_pages", self.src.len(), "")?;
        match self.dst_offsets {
            Some(dst_offsets) => {
                if dst_offsets.len() != self.offsets.len() {
                    return Err(flat_error(format!(
                        "offsets has {} values but dst_offsets has {}; both need n_requests + 1 \
                         values",
                        self.offsets.len(),
                        dst_offsets.len()
                    )));
                }
                check_offsets(dst_offsets, "dst_offsets", "dst_pages", self.dst.len(), "")?;
            }
            None => check_offsets(
                self.offsets,
                "offsets",
                "dst_pages",
                self.dst.len(),
                " (offsets serve both sides when dst_offsets is not given)",
            )?,
        }
        if let Some(n_tokens) = self.n_tokens {
            if n_tokens.len() != n {
                return Err(flat_error(format!(
                    "n_tokens has {} values for {n} requests; give one token count per request",
                    n_tokens.len()
                )));
            }
            if let Some(r) = n_tokens.iter().position(|&t| t < 0) {
                return Err(flat_error(format!(
                    "n_tokens[{r}] = {} is negative",
                    n_tokens[r]
                )));
            }
        }
        let dst_offsets = self.dst_offsets.unwrap_or(self.offsets);
        let mut requests = Vec::new();
        requests
            .try_reserve_exact(n)
            .map_err(|_| PlanError::out_of_memory::<Request<'a, S, D>>("batch", n))?;
        // Checked above: every offset lies in 0..=len and none decreases.
        let range = |o: &[i64], r: usize| o[r] as usize..o[r + 1] as usize;
        for r in 0..n {
            let n_tokens = self.n_tokens.map(|t| t[r] as u64);
            requests.push(Request::new(
                &self.src[range(self.offsets, r)],
                &self.dst[range(dst_offsets, r)],
                n_tokens,
            ));
        }
        Ok(requests)
    }
}

/// Checks CSR offsets `name` into a slice `pages` of `len` values: at least one value, the
/// first 0, none negative or below the one before, the last `len` (`note` ends that message).
fn check_offsets(offsets: &[i64], name: &str, pages: &str, len: usize, note: &str) -> Result<()> {
    let Some((&first, &last)) = offsets.first().zip(offsets.last()) else {
        return Err(flat_error(format!(
            "{name} is empty; it needs n_requests + 1 values, the first 0 and the last \
             len({pages})"
        )));
    };
    if first != 0 {
        return Err(flat_error(format!(
            "{name}[0] is {first}; offsets start at 0"
        )));
    }
    if let Some(i) = (1..offsets.len()).find(|&i| offsets[i] < offsets[i - 1]) {
        let (value, before) = (offsets[i], offsets[i - 1]);
        return Err(flat_error(if value < 0 {
            format!("{name}[{i}] = {value} is negative")
        } else {
            format!(
                "{name}[{i}] = {value} is less than {name}[{}] = {before}; offsets must not \
                 decrease",
                i - 1
            )
        }));
    }
    if u64::try_from(last).ok() != Some(len as u64) {
        return Err(flat_error(format!(
            "{name}[{}] = {last} but {pages} has {len} values; the last offset must be its \
             length{note}",
            offsets.len() - 1
        )));
    }
    Ok(())
}

fn flat_error(what: String) -> PlanError {
    PlanError::FlatBatch { what }
}

/// Plans batches of requests with a borrowed template.
#[derive(Debug, Clone)]
pub struct BatchPlanner<'t> {
    template: &'t Template,
}

/// What validating a batch found: its size and where each request's blocks lie, known before
/// any output exists.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchSummary {
    /// Blocks of the whole batch.
    pub n_blocks: usize,
    /// Bytes of the whole batch.
    pub total_bytes: u64,
    /// `n_segments + 1` block offsets: segment `s` holds blocks `segment_offsets[s]..
    /// segment_offsets[s + 1]`.
    pub segment_offsets: Vec<usize>,
    /// `n_segments + 1` request offsets: segment `s` holds requests `segment_requests[s]..
    /// segment_requests[s + 1]`.
    pub segment_requests: Vec<usize>,
    /// Each request as it would be planned alone (its blocks, bytes and unit).
    pub requests: Vec<PlanSummary>,
    /// Per request of a segment of token requests, the token classes (a bit mask over
    /// [`crate::model::pieces::TOKEN_CLASSES`]) whose first block of each piece is one block
    /// with the previous request's last block of that piece; empty when no token requests fuse
    /// (every request then 0).
    pub merges: Vec<u64>,
}

impl BatchSummary {
    /// Requests in the batch.
    pub fn n_requests(&self) -> usize {
        self.requests.len()
    }

    /// Segments in the batch.
    pub fn n_segments(&self) -> usize {
        self.segment_offsets.len().saturating_sub(1)
    }

    /// The token classes whose first blocks request `request` shares with the request before
    /// it (0 for a request that shares none).
    pub fn merged_classes(&self, request: usize) -> u64 {
        self.merges.get(request).copied().unwrap_or(0)
    }

    /// The segment request `request` was planned in (`None` past the last request).
    pub fn segment_of(&self, request: usize) -> Option<usize> {
        if request >= self.n_requests() {
            return None;
        }
        Some(
            self.segment_requests
                .partition_point(|&first| first <= request)
                - 1,
        )
    }

    /// The summary segment `segment`'s blocks are laid out by: its request's own for a request
    /// alone, and for fused page requests one page plan of all their pages in their merged
    /// runs (a segment's blocks are entry-pair major as a single request's plan), so the
    /// template's block accounting reads a segment as it reads a plan. `None` past the last.
    pub fn segment_summary(&self, segment: usize) -> Option<PlanSummary> {
        if segment >= self.n_segments() {
            return None;
        }
        let (first, end) = (
            self.segment_requests[segment],
            self.segment_requests[segment + 1],
        );
        let members = &self.requests[first..end];
        if members.len() == 1 {
            return Some(members[0]);
        }
        if let PlanUnit::Tokens(shape) = members[0].unit {
            let mut merged = shape;
            merged.class_blocks = self.token_class_blocks(first..end)?;
            merged.n_segments = 0;
            merged.n_tokens = 0;
            for member in members {
                let PlanUnit::Tokens(found) = member.unit else {
                    return None;
                };
                merged.n_segments = merged.n_segments.checked_add(found.n_segments)?;
                merged.n_tokens = merged
                    .n_tokens
                    .checked_add(found.n_tokens.checked_sub(found.first_token)?)?;
            }
            merged.first_token = 0;
            merged.n_blocks = self.segment_offsets[segment + 1] - self.segment_offsets[segment];
            merged.total_bytes = members
                .iter()
                .try_fold(0u64, |sum, m| sum.checked_add(m.total_bytes))?;
            return Some(PlanSummary {
                n_blocks: merged.n_blocks,
                total_bytes: merged.total_bytes,
                unit: PlanUnit::Tokens(merged),
                state: None,
            });
        }
        let (runs, pages) = segment_runs(members)?;
        let mut scan = crate::model::runs::RunScan {
            n_pages: pages,
            n_runs: runs,
            max_src: 0,
            max_dst: 0,
            descending_runs: 0,
        };
        for member in members {
            if let PlanUnit::Pages(found) = member.unit {
                scan.max_src = scan.max_src.max(found.max_src);
                scan.max_dst = scan.max_dst.max(found.max_dst);
                scan.descending_runs += found.descending_runs;
            }
        }
        Some(PlanSummary {
            n_blocks: self.segment_offsets[segment + 1] - self.segment_offsets[segment],
            total_bytes: members.iter().map(|m| m.total_bytes).sum(),
            unit: PlanUnit::Pages(scan),
            state: None,
        })
    }

    /// Blocks per token class of the fused token requests `members`: each member's own, less
    /// one per block it shares with the member before. `None` for a member not planned by
    /// token, or counts that do not add up.
    fn token_class_blocks(
        &self,
        members: std::ops::Range<usize>,
    ) -> Option<[usize; crate::model::pieces::TOKEN_CLASSES]> {
        let mut blocks = [0usize; crate::model::pieces::TOKEN_CLASSES];
        for r in members.clone() {
            let PlanUnit::Tokens(shape) = self.requests.get(r)?.unit else {
                return None;
            };
            let shared = if r == members.start {
                0
            } else {
                self.merged_classes(r)
            };
            for (c, count) in blocks.iter_mut().enumerate() {
                *count = count.checked_add(shape.class_blocks[c])?;
                if shared >> c & 1 != 0 {
                    *count = count.checked_sub(1)?;
                }
            }
        }
        Some(blocks)
    }

    /// The blocks holding request `request`'s bytes: its segment's blocks.
    pub fn request_blocks(&self, request: usize) -> Option<std::ops::Range<usize>> {
        let s = self.segment_of(request)?;
        Some(self.segment_offsets[s]..self.segment_offsets[s + 1])
    }

    /// The requests whose bytes blocks `blocks` hold: those of every segment with a block in
    /// the range, in order; none for an empty range or past the end.
    pub fn requests_in(&self, blocks: std::ops::Range<usize>) -> Vec<usize> {
        let mut held = Vec::new();
        for (s, _) in self.segments_in(blocks) {
            held.extend(self.segment_requests[s]..self.segment_requests[s + 1]);
        }
        held
    }

    /// The segments with a block in `blocks`, in order, each with its own block range; none
    /// for an empty range or past the end (segments without blocks hold none).
    fn segments_in(
        &self,
        blocks: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        // The first segment ending after the range starts (none for an empty range).
        let first = if blocks.is_empty() {
            self.n_segments()
        } else {
            self.segment_offsets[1..].partition_point(|&end| end <= blocks.start)
        };
        (first..self.n_segments())
            .map(|s| (s, self.segment_offsets[s]..self.segment_offsets[s + 1]))
            .take_while(move |(_, segment)| segment.start < blocks.end)
            .filter(|(_, segment)| !segment.is_empty())
    }

    /// The requests with bytes in blocks `blocks`, exactly, for a batch planned by a template of
    /// page pieces `pieces` ([`Template::pieces`]): as [`BatchSummary::requests_in`], except
    /// that inside a segment of fused requests only the members whose runs (per-run pieces) or
    /// pages (per-page pieces) the range's blocks cover are named. A fused segment's blocks are
    /// piece major: a per-run piece has one block per merged run (member `i`'s runs follow the
    /// runs of those before it, its first merged with the previous member's last), a per-page
    /// piece one block per page in request order. A segment of fused token requests is read
    /// over the token pieces `token_pieces` ([`crate::kernels::tokens::TokenTemplate::pieces`]):
    /// piece major, each piece's blocks member after member, a member's first block shared with
    /// the member before for the classes it merged. A segment whose block count does not match
    /// that shape names all its members (never fewer requests than hold bytes).
    pub fn requests_with_bytes_in(
        &self,
        blocks: std::ops::Range<usize>,
        pieces: &[crate::model::pieces::Piece],
        token_pieces: &[crate::model::pieces::Piece],
    ) -> Vec<usize> {
        let mut held = Vec::new();
        for (s, std::ops::Range { start, end }) in self.segments_in(blocks.clone()) {
            let members = self.segment_requests[s]..self.segment_requests[s + 1];
            let covered = blocks.start.max(start) - start..blocks.end.min(end) - start;
            if members.len() == 1 || covered == (0..end - start) {
                held.extend(members);
                continue;
            }
            let named = if matches!(self.requests[members.start].unit, PlanUnit::Tokens(_)) {
                self.fused_token_members_in(members.clone(), end - start, covered, token_pieces)
            } else {
                self.fused_members_in(members.clone(), end - start, covered, pieces)
            };
            match named {
                Some(named) => held.extend(named),
                None => held.extend(members),
            }
        }
        held
    }

    /// The members of a segment of fused token requests (`members`, `n_blocks` blocks) with
    /// bytes in its blocks `covered` (segment-relative), laid out over the token pieces
    /// `pieces`; `None` when the segment's shape is not theirs (the caller then names every
    /// member).
    fn fused_token_members_in(
        &self,
        members: std::ops::Range<usize>,
        n_blocks: usize,
        covered: std::ops::Range<usize>,
        pieces: &[crate::model::pieces::Piece],
    ) -> Option<Vec<usize>> {
        let classes = self.token_class_blocks(members.clone())?;
        let shape = pieces
            .iter()
            .try_fold(0usize, |sum, p| sum.checked_add(classes[p.class()]))?;
        if shape != n_blocks {
            return None;
        }
        let mut hit = vec![false; members.len()];
        let mut at = 0usize;
        for piece in pieces {
            if at >= covered.end {
                break;
            }
            let class = piece.class();
            for (k, r) in members.clone().enumerate() {
                let PlanUnit::Tokens(shape) = self.requests[r].unit else {
                    return None;
                };
                let count = shape.class_blocks[class];
                if count == 0 {
                    continue;
                }
                // A merged member's first block is the last block so far.
                let from = if k > 0 && self.merged_classes(r) >> class & 1 != 0 {
                    at.checked_sub(1)?
                } else {
                    at
                };
                let to = from + count;
                if from < covered.end && covered.start < to {
                    hit[k] = true;
                }
                at = to;
            }
        }
        Some(
            hit.iter()
                .enumerate()
                .filter(|&(_, &h)| h)
                .map(|(k, _)| members.start + k)
                .collect(),
        )
    }

    /// The members of a fused segment (`members`, `n_blocks` blocks) with bytes in its blocks
    /// `covered` (segment-relative); `None` when the segment's shape is not the one `pieces`
    /// give (the caller then names every member).
    fn fused_members_in(
        &self,
        members: std::ops::Range<usize>,
        n_blocks: usize,
        covered: std::ops::Range<usize>,
        pieces: &[crate::model::pieces::Piece],
    ) -> Option<Vec<usize>> {
        let summaries = &self.requests[members.clone()];
        let (runs, pages) = segment_runs(summaries)?;
        let per_run = pieces.iter().filter(|p| p.per_run()).count();
        let shape = per_run
            .checked_mul(runs)?
            .checked_add((pieces.len() - per_run).checked_mul(pages)?)?;
        if shape != n_blocks || runs == 0 {
            return None;
        }
        // Member k's first run and first page in the segment's merged order.
        let (mut run_starts, mut page_starts) = (Vec::new(), Vec::new());
        let (mut run_at, mut page_at) = (0usize, 0usize);
        for (k, summary) in summaries.iter().enumerate() {
            if k > 0 {
                run_at -= 1; // the boundary run is shared with the previous member
            }
            run_starts.push(run_at);
            page_starts.push(page_at);
            run_at += summary.n_runs();
            page_at += summary.n_pages();
        }
        let mut hit = vec![false; summaries.len()];
        // Members whose `[starts[k], starts[k] + len(k))` meets `[a, b)`.
        let mark = |hit: &mut [bool], starts: &[usize], len: &dyn Fn(usize) -> usize, a, b| {
            let from = starts.partition_point(|&s| s < a).saturating_sub(1);
            for k in from..starts.len() {
                if starts[k] >= b {
                    break;
                }
                if starts[k] + len(k) > a {
                    hit[k] = true;
                }
            }
        };
        let n_runs = |k: usize| summaries[k].n_runs();
        let n_pages = |k: usize| summaries[k].n_pages();
        let mut at = 0usize;
        for piece in pieces {
            let n = if piece.per_run() { runs } else { pages };
            let (a, b) = (covered.start.max(at), covered.end.min(at + n));
            if a < b {
                if piece.per_run() {
                    mark(&mut hit, &run_starts, &n_runs, a - at, b - at);
                } else {
                    mark(&mut hit, &page_starts, &n_pages, a - at, b - at);
                }
            }
            at += n;
            if at >= covered.end || hit.iter().all(|&h| h) {
                break;
            }
        }
        Some(
            hit.iter()
                .enumerate()
                .filter(|&(_, &h)| h)
                .map(|(k, _)| members.start + k)
                .collect(),
        )
    }

    /// Block ranges of at most `max_blocks` blocks each, covering the batch in order, for one
    /// engine call each: whole segments packed while they fit, and a segment larger than
    /// `max_blocks` split alone. A failed call then holds as few requests as the sizes allow.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for `max_blocks` 0.
    pub fn call_ranges(&self, max_blocks: usize) -> Result<Vec<std::ops::Range<usize>>> {
        if max_blocks == 0 {
            return Err(PlanError::Geometry {
                what: "max_blocks must be at least 1, got 0".into(),
            });
        }
        let mut calls = Vec::new();
        let mut start = 0;
        for s in 0..self.n_segments() {
            let (seg_start, seg_end) = (self.segment_offsets[s], self.segment_offsets[s + 1]);
            if seg_end - start <= max_blocks {
                continue;
            }
            if seg_start > start {
                calls.push(start..seg_start);
                start = seg_start;
            }
            while seg_end - start > max_blocks {
                calls.push(start..start + max_blocks);
                start += max_blocks;
            }
        }
        if self.n_blocks > start {
            calls.push(start..self.n_blocks);
        }
        Ok(calls)
    }
}

/// An owned batch plan: the columns and where each request lies in them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchPlan {
    /// Source addresses.
    pub src_addrs: Vec<u64>,
    /// Destination addresses.
    pub dst_addrs: Vec<u64>,
    /// Lengths in bytes.
    pub lengths: Vec<u64>,
    /// Sizes, segments and requests.
    pub summary: BatchSummary,
}

impl<'t> BatchPlanner<'t> {
    /// A batch planner over `template`.
    pub fn new(template: &'t Template) -> Self {
        Self { template }
    }

    /// Validates every request and the batch, and returns its size and segments.
    ///
    /// # Errors
    /// [`PlanError::InRequest`] wrapping the first request's error (as [`Template::prepare`]
    /// reports it); [`PlanError::RequestsOverlap`] naming two requests that write one
    /// destination page or slot; overflow or memory errors.
    pub fn prepare<S: PageIndex, D: PageIndex>(
        &self,
        requests: &[Request<'_, S, D>],
    ) -> Result<BatchSummary> {
        let mut summaries = Vec::new();
        summaries
            .try_reserve_exact(requests.len())
            .map_err(|_| PlanError::out_of_memory::<PlanSummary>("batch", requests.len()))?;
        for (r, request) in requests.iter().enumerate() {
            if let Err(err) = self.template.admit(Planner::Batch, request) {
                return Err(in_request(r)(err));
            }
            // A `match` rather than `map_err(..)?`: the summary is moved once, not re-wrapped.
            match self.template.prepare(request) {
                Ok(summary) => summaries.push(summary),
                Err(err) => return Err(in_request(r)(err)),
            }
        }
        check_disjoint(requests, &summaries)?;
        let overflow = |what| PlanError::Overflow { what };
        // At most one segment per request.
        let mut segment_offsets = Vec::new();
        let mut segment_requests = Vec::new();
        for offsets in [&mut segment_offsets, &mut segment_requests] {
            offsets
                .try_reserve_exact(requests.len() + 1)
                .map_err(|_| PlanError::out_of_memory::<usize>("batch", requests.len() + 1))?;
            offsets.push(0);
        }
        let (mut n_blocks, mut total_bytes) = (0usize, 0u64);
        let mut merges: Vec<u64> = Vec::new();
        // A request carrying a state slot is a segment of its own: its state blocks follow its
        // page blocks, so no later request's blocks can join them.
        let moves_tokens = |s: &PlanSummary| {
            matches!(s.unit, PlanUnit::Tokens(_)) && s.n_blocks > 0 && s.state.is_none()
        };
        let mut r = 0;
        while r < requests.len() {
            let mut end = r + 1;
            // Blocks the segment's token requests share across their boundaries.
            let mut shared = 0usize;
            while moves_tokens(&summaries[r])
                && end < requests.len()
                && moves_tokens(&summaries[end])
            {
                let mask = self.template.token_merges(
                    (&requests[end - 1], &summaries[end - 1]),
                    (&requests[end], &summaries[end]),
                );
                if mask == 0 {
                    break;
                }
                if merges.is_empty() {
                    merges = try_vec(requests.len(), 0u64, "batch merges")?;
                }
                merges[end] = mask;
                let Some(sum) = self.shared_blocks(mask).checked_add(shared) else {
                    return Err(overflow("block count"));
                };
                shared = sum;
                end += 1;
            }
            while end < requests.len()
                && [&summaries[end - 1], &summaries[end]].iter().all(|s| {
                    matches!(s.unit, PlanUnit::Pages(_)) && s.n_blocks > 0 && s.state.is_none()
                })
                && fuses(&requests[end - 1], &requests[end])
            {
                end += 1;
            }
            // `let … else` rather than `ok_or`: no error built and dropped per request.
            let blocks = if end - r == 1 {
                summaries[r].n_blocks
            } else if moves_tokens(&summaries[r]) {
                let mut blocks = 0usize;
                for summary in &summaries[r..end] {
                    let Some(sum) = blocks.checked_add(summary.n_blocks) else {
                        return Err(overflow("block count"));
                    };
                    blocks = sum;
                }
                let Some(blocks) = blocks.checked_sub(shared) else {
                    return Err(overflow("block count"));
                };
                blocks
            } else {
                let Some((runs, pages)) = segment_runs(&summaries[r..end]) else {
                    return Err(overflow("runs"));
                };
                let Some(blocks) = self.template.blocks.page_blocks(runs, pages) else {
                    return Err(overflow("block count"));
                };
                blocks
            };
            for summary in &summaries[r..end] {
                let Some(sum) = total_bytes.checked_add(summary.total_bytes) else {
                    return Err(overflow("total bytes"));
                };
                total_bytes = sum;
            }
            let Some(sum) = n_blocks.checked_add(blocks) else {
                return Err(overflow("block count"));
            };
            n_blocks = sum;
            segment_offsets.push(n_blocks);
            segment_requests.push(end);
            r = end;
        }
        Ok(BatchSummary {
            n_blocks,
            total_bytes,
            segment_offsets,
            segment_requests,
            requests: summaries,
            merges,
        })
    }

    /// Blocks one boundary of fused token requests saves: one per piece of each merged class.
    fn shared_blocks(&self, mask: u64) -> usize {
        let Ok(tokens) = self.template.token_template() else {
            return 0;
        };
        tokens
            .class_pieces
            .iter()
            .enumerate()
            .filter(|&(c, _)| mask >> c & 1 != 0)
            .map(|(_, &pieces)| pieces)
            .sum()
    }

    /// Plans a batch (see [`BatchPlanner::prepare`]) into columns from `make_output`, which
    /// receives the summary and returns at least `summary.n_blocks` values per column.
    ///
    /// # Errors
    /// As [`BatchPlanner::prepare`], whatever `make_output` returns,
    /// [`PlanError::OutputTooSmall`], or an input changed between validation and emission.
    pub fn plan_into<'o, S: PageIndex, D: PageIndex, O>(
        &self,
        requests: &[Request<'_, S, D>],
        make_output: impl FnOnce(&BatchSummary) -> Result<O>,
    ) -> Result<(O, BatchSummary)>
    where
        O: AsColumns<'o>,
    {
        let summary = self.prepare(requests)?;
        let mut output = make_output(&summary)?;
        let mut out = output.columns();
        if out.capacity() < summary.n_blocks {
            return Err(PlanError::OutputTooSmall {
                have: out.capacity(),
                need: summary.n_blocks,
            });
        }
        for s in 0..summary.n_segments() {
            let blocks = summary.segment_offsets[s]..summary.segment_offsets[s + 1];
            let (first, end) = (summary.segment_requests[s], summary.segment_requests[s + 1]);
            let segment = out.range(blocks);
            if end - first == 1 {
                self.template
                    .emit_prepared(&requests[first], &summary.requests[first], segment)
                    .map_err(in_request(first))?;
            } else if matches!(summary.requests[first].unit, PlanUnit::Tokens(_)) {
                self.emit_token_segment(requests, &summary, first..end, segment)?;
            } else {
                self.emit_segment(
                    &requests[first..end],
                    &summary.requests[first..end],
                    segment,
                )
                .map_err(in_request(first))?;
            }
        }
        Ok((output, summary))
    }

    /// Allocating convenience over [`BatchPlanner::plan_into`].
    ///
    /// # Errors
    /// As [`BatchPlanner::plan_into`].
    pub fn plan<S: PageIndex, D: PageIndex>(
        &self,
        requests: &[Request<'_, S, D>],
    ) -> Result<BatchPlan> {
        let (buffer, summary) =
            self.plan_into(requests, |summary| FlatBuffer::try_zeroed(summary.n_blocks))?;
        let (src_addrs, dst_addrs, lengths) = buffer.into_columns(summary.n_blocks)?;
        Ok(BatchPlan {
            src_addrs,
            dst_addrs,
            lengths,
            summary,
        })
    }

    /// Each request's plan digest as if it were planned alone (what a decode that verifies
    /// requests one by one recomputes), between layouts of fingerprints `fingerprints`. Plans
    /// every request again into one scratch buffer.
    ///
    /// `leases`: empty, or one per request (`None` for a request planned without one); a
    /// request's digest is then bound to its lease by [`crate::exchange::digest::request_plan_digest`],
    /// the rule `TransferPlan.digest(lease=)` applies to a plan alone.
    ///
    /// # Errors
    /// [`PlanError::DigestInput`] for `leases` of another length than the requests; as
    /// [`Template::plan_into`] for each request.
    pub fn request_digests<S: PageIndex, D: PageIndex>(
        &self,
        requests: &[Request<'_, S, D>],
        fingerprints: (u64, u64),
        leases: &[Option<crate::exchange::digest::LeaseRef<'_>>],
    ) -> Result<Vec<u64>> {
        if !leases.is_empty() && leases.len() != requests.len() {
            return Err(PlanError::DigestInput {
                what: format!(
                    "{} leases for {} requests; give one lease (or none) per request",
                    leases.len(),
                    requests.len()
                ),
            });
        }
        let mut digests = try_vec(requests.len(), 0u64, "request digests")?;
        let mut scratch = FlatBuffer::zeroed(0);
        for (r, request) in requests.iter().enumerate() {
            let summary = self.template.prepare(request).map_err(in_request(r))?;
            if scratch.capacity < summary.n_blocks {
                scratch = FlatBuffer::try_zeroed(summary.n_blocks)?;
            }
            let capacity = scratch.capacity;
            let mut columns = Columns::from_flat(&mut scratch.data, capacity);
            let n = summary.n_blocks;
            self.template
                .emit_prepared(request, &summary, columns.reborrow())
                .map_err(in_request(r))?;
            let offsets = self.template.pair_offsets(&summary);
            let blocks = crate::exchange::digest::PlanBlocks {
                src_addrs: &columns.src_addrs[..n],
                dst_addrs: &columns.dst_addrs[..n],
                lengths: &columns.lengths[..n],
                pair_offsets: &offsets,
            };
            let digest = crate::exchange::digest::plan_digest(fingerprints, &blocks)?;
            let lease = leases.get(r).copied().flatten();
            digests[r] =
                crate::exchange::digest::request_plan_digest(digest, summary.skip_tokens(), lease);
        }
        Ok(digests)
    }

    /// Emits a segment of fused token requests (`members` of `requests`) straight into `out`:
    /// each member writes each piece's blocks after the same piece's blocks of the members
    /// before, a merged class's first block joined to the block before it (checked to continue
    /// it on both sides). Nothing but the output grows with the blocks.
    fn emit_token_segment<S: PageIndex, D: PageIndex>(
        &self,
        requests: &[Request<'_, S, D>],
        summary: &BatchSummary,
        members: std::ops::Range<usize>,
        mut out: Columns<'_>,
    ) -> Result<()> {
        let first = members.start;
        let tokens = self.template.token_template().map_err(in_request(first))?;
        let Some(classes) = summary.token_class_blocks(members.clone()) else {
            return Err(in_request(first)(PlanError::InputChanged));
        };
        // Where each piece's blocks start in the segment, and the segment's end.
        let n_pieces = tokens.pieces.len();
        let mut starts = Vec::new();
        starts
            .try_reserve_exact(n_pieces + 1)
            .map_err(|_| PlanError::out_of_memory::<usize>("batch", n_pieces + 1))?;
        let mut at = 0usize;
        for piece in &tokens.pieces {
            starts.push(at);
            at = at
                .checked_add(classes[piece.class()])
                .ok_or(PlanError::Overflow {
                    what: "block count",
                })?;
        }
        starts.push(at);
        if at > out.capacity() {
            return Err(in_request(first)(PlanError::InputChanged));
        }
        let mut cursor = try_vec(n_pieces, 0usize, "batch")?;
        cursor.copy_from_slice(&starts[..n_pieces]);
        for r in members {
            let joins = if r == first {
                0
            } else {
                summary.merged_classes(r)
            };
            self.template
                .emit_prepared_joined(
                    &requests[r],
                    &summary.requests[r],
                    joins,
                    (&mut cursor, &starts),
                    &mut out,
                )
                .map_err(in_request(r))?;
        }
        if cursor[..] != starts[1..] {
            return Err(in_request(first)(PlanError::InputChanged));
        }
        Ok(())
    }

    /// Emits a segment of fused page requests: each request's runs written after the last,
    /// the boundary runs merged, then the merged runs expanded once.
    fn emit_segment<S: PageIndex, D: PageIndex>(
        &self,
        requests: &[Request<'_, S, D>],
        summaries: &[PlanSummary],
        mut out: Columns<'_>,
    ) -> Result<()> {
        let Some((expected, pages)) = segment_runs(summaries) else {
            return Err(PlanError::InputChanged);
        };
        let mut runs = 0usize;
        let mut descending = false;
        for (k, (request, summary)) in requests.iter().zip(summaries).enumerate() {
            let (Indices::Pages { src, dst }, PlanUnit::Pages(found)) =
                (request.indices, summary.unit)
            else {
                return Err(PlanError::InputChanged);
            };
            descending |= found.descending_runs > 0;
            let capacity = out.capacity().min(expected);
            if k == 0 {
                runs =
                    self.template
                        .write_request_runs(src, dst, &found, out.range(0..capacity))?;
                continue;
            }
            // Fused in `prepare`: the previous request's last run and this one's first touch.
            // This request's runs go over that last run (kept here), so the segment never needs
            // more slots than its merged runs.
            let last = runs - 1;
            let kept = (out.src_addrs[last], out.dst_addrs[last], out.lengths[last]);
            let written =
                self.template
                    .write_request_runs(src, dst, &found, out.range(last..capacity))?;
            let first_len = out.lengths[last];
            let touches = (kept.2 | first_len) & DESCENDING == 0
                && out.src_addrs[last] == kept.0 + kept.2
                && out.dst_addrs[last] == kept.1 + kept.2;
            if !touches {
                return Err(PlanError::InputChanged);
            }
            (out.src_addrs[last], out.dst_addrs[last]) = (kept.0, kept.1);
            out.lengths[last] = kept.2 + first_len;
            runs = last + written;
        }
        if runs != expected {
            return Err(PlanError::InputChanged);
        }
        self.template.expand_runs(runs, pages, descending, out);
        Ok(())
    }
}

impl Template {
    /// A batch planner over this template.
    pub fn batch(&self) -> BatchPlanner<'_> {
        BatchPlanner::new(self)
    }

    /// The requests of a batch this template planned (`summary`) with bytes in blocks
    /// `blocks`: [`BatchSummary::requests_with_bytes_in`] over this template's pieces.
    pub fn batch_requests_in(
        &self,
        summary: &BatchSummary,
        blocks: std::ops::Range<usize>,
    ) -> Vec<usize> {
        let token_pieces = self.token_template().map_or(&[][..], |t| &t.pieces[..]);
        summary.requests_with_bytes_in(blocks, &self.pieces, token_pieces)
    }
}

/// Wraps request `r`'s error so the caller learns which request failed.
fn in_request(r: usize) -> impl Fn(PlanError) -> PlanError {
    move |source| PlanError::InRequest {
        request: r,
        source: Box::new(source),
    }
}

/// Runs and pages of a segment of fused page requests (each boundary merges two runs).
fn segment_runs(summaries: &[PlanSummary]) -> Option<(usize, usize)> {
    let (mut runs, mut pages) = (0usize, 0usize);
    for summary in summaries {
        runs = runs.checked_add(summary.n_runs())?;
        pages = pages.checked_add(summary.n_pages())?;
    }
    Some((runs.checked_sub(summaries.len() - 1)?, pages))
}

/// Whether page request `next` continues page request `prev` (both planned by page and
/// moving something) on both sides: the step from
/// `prev`'s last pair to `next`'s first is +1 on each side, and neither boundary run descends
/// (a run descends when its pages step by -1 on both sides).
fn fuses<S: PageIndex, D: PageIndex>(prev: &Request<'_, S, D>, next: &Request<'_, S, D>) -> bool {
    let (Indices::Pages { src: ps, dst: pd }, Indices::Pages { src: ns, dst: nd }, None, None) =
        (prev.indices, next.indices, prev.n_tokens, next.n_tokens)
    else {
        return false;
    };
    let (Some(&s0), Some(&d0), Some(&s1), Some(&d1)) =
        (ps.last(), pd.last(), ns.first(), nd.first())
    else {
        return false;
    };
    let down = |s: &[S], d: &[D], i: usize| s[i].steps_to(s[i - 1]) && d[i].steps_to(d[i - 1]);
    let prev_descends = ps.len() >= 2 && down(ps, pd, ps.len() - 1);
    let next_descends = ns.len() >= 2 && down(ns, nd, 1);
    s0.steps_to(s1) && d0.steps_to(d1) && !prev_descends && !next_descends
}

/// Refuses a batch in which two requests write one destination page (of any pool), or one
/// state slot.
fn check_disjoint<S: PageIndex, D: PageIndex>(
    requests: &[Request<'_, S, D>],
    summaries: &[PlanSummary],
) -> Result<()> {
    // The destination pages each request writes of each pool (a token request only the pages
    // holding the tokens it moves: a delta request's cached prefix pages may be shared by
    // several); further pools' pages are only a token request's.
    let written = |r: usize, pool: PoolId| -> &[D] {
        match (requests[r].indices, &summaries[r].unit, pool) {
            (Indices::Pages { dst, .. }, PlanUnit::Pages(_), PoolId::PAGES) => dst,
            (Indices::Pages { dst, .. }, PlanUnit::Tokens(t), PoolId::PAGES) => {
                &dst[t.first_pages.1..t.dst_pages]
            }
            (Indices::Pages { .. }, PlanUnit::Tokens(t), pool) => {
                let ((_, read), (_, first)) = t.pool_pages[pool.index()];
                requests[r].pool_lists(pool).1.map_or(&[][..], |dst| {
                    &dst[first.min(dst.len())..read.min(dst.len())]
                })
            }
            _ => &[],
        }
    };
    for pool in PoolId::ALL {
        check_pages_disjoint(summaries, |r| written(r, pool), OVERLAP_NAMES[pool.index()])?;
    }
    check_slots_disjoint(requests, summaries)
}

/// What a batch refuses to write twice, per pool: its pages, then each further pool's.
const OVERLAP_NAMES: [&str; POOLS] = [
    "page",
    "pool 1 page",
    "pool 2 page",
    "pool 3 page",
    "pool 4 page",
    "pool 5 page",
    "pool 6 page",
    "pool 7 page",
];

/// Refuses two requests that write one destination page of one pool (`written(r)`: the pages
/// request `r` writes of it, `what`: the pages' name in the error).
fn check_pages_disjoint<'x, D: PageIndex + 'x>(
    summaries: &[PlanSummary],
    written: impl Fn(usize) -> &'x [D],
    what: &'static str,
) -> Result<()> {
    // Bounding ranges first: requests whose ranges do not overlap cannot share a page (the
    // common case, each request's pages allocated together), and then nothing else is read.
    let mut ranges: Vec<(i64, i64, usize)> = Vec::new();
    ranges
        .try_reserve_exact(summaries.len())
        .map_err(|_| PlanError::out_of_memory::<(i64, i64, usize)>("batch", summaries.len()))?;
    for (r, summary) in summaries.iter().enumerate() {
        let pages = written(r);
        if summary.n_blocks == 0 || pages.is_empty() {
            continue;
        }
        let (lo, hi) = pages.iter().fold((i64::MAX, i64::MIN), |(lo, hi), p| {
            (lo.min(p.get()), hi.max(p.get()))
        });
        ranges.push((lo, hi, r));
    }
    ranges.sort_unstable();
    // Sorted by start: some range overlaps an earlier one exactly when it starts at or before
    // the furthest end so far.
    let mut reach = i64::MIN;
    let overlapping = ranges.iter().any(|&(lo, hi, _)| {
        let hit = lo <= reach;
        reach = reach.max(hi);
        hit
    });
    if overlapping {
        let lo = ranges.first().map_or(0, |r| r.0);
        let hi = ranges.iter().map(|r| r.1).max().unwrap_or(0);
        // Validated pages lie inside the decode's buffers, so the span is a pool's page count.
        let span = (hi - lo) as usize + 1;
        let mut seen = try_vec(span.div_ceil(64), 0u64, "the batch overlap check")?;
        for &(_, _, r) in &ranges {
            for page in written(r) {
                let bit = (page.get() - lo) as usize;
                let (word, mask) = (bit / 64, 1u64 << (bit % 64));
                if seen[word] & mask != 0 {
                    // A repeat inside one request is the template's own check, not the batch's.
                    if let Some(first) = (0..summaries.len())
                        .filter(|&q| q != r)
                        .find(|&q| written(q).iter().any(|p| p.get() == page.get()))
                    {
                        let (first, second) = (first.min(r), first.max(r));
                        return Err(PlanError::RequestsOverlap {
                            what,
                            index: page.get(),
                            first,
                            second,
                        });
                    }
                }
                seen[word] |= mask;
            }
        }
    }
    Ok(())
}

/// Refuses two requests that write one state slot.
fn check_slots_disjoint<S: PageIndex, D: PageIndex>(
    requests: &[Request<'_, S, D>],
    summaries: &[PlanSummary],
) -> Result<()> {
    // State slots: a handful per batch.
    let mut slots: Vec<(i64, usize)> = requests
        .iter()
        .enumerate()
        .filter_map(|(r, request)| match (request.indices, request.state_slot) {
            (Indices::Slot { dst, .. }, _) if summaries[r].n_blocks > 0 => Some((dst, r)),
            (_, Some((_, dst))) if summaries[r].state.is_some_and(|t| t.n_blocks > 0) => {
                Some((dst, r))
            }
            _ => None,
        })
        .collect();
    slots.sort_unstable();
    if let Some(w) = slots.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(PlanError::RequestsOverlap {
            what: "state slot",
            index: w[0].0,
            first: w[0].1,
            second: w[1].1,
        });
    }
    Ok(())
}
