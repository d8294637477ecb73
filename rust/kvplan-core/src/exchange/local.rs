//! Local plans on CPU memory: the buffers of one side as byte slices with their addresses,
//! which buffer holds a block, and [`copy_local`], which executes a local plan (the gather and
//! scatter of a staged or pack plan) between two sets of buffers.
//!
//! Everything is safe Rust over slices: a block is copied only when it lies inside one given
//! buffer on each side, checked for every block before the first byte moves, so a bad plan
//! copies nothing. Callers that make slices from foreign memory (the Python bindings) check
//! with [`check_local_buffers`] first that no destination buffer shares memory with another
//! buffer, which the slices' borrows then state.

use crate::error::{PlanError, Result, Side};

/// One buffer of a side's memory: the address of its first byte and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Region<'a> {
    /// Address of `bytes[0]` in the address space the plan's addresses use.
    pub base: u64,
    /// The buffer's bytes.
    pub bytes: &'a [u8],
}

/// One writable buffer of a side's memory: the address of its first byte and its bytes.
#[derive(Debug)]
pub struct RegionMut<'a> {
    /// Address of `bytes[0]` in the address space the plan's addresses use.
    pub base: u64,
    /// The buffer's bytes.
    pub bytes: &'a mut [u8],
}

/// Finds the buffer holding each block among one side's buffers, given as `(base, size)`
/// (sorted by base once; the last hit is tried first, since consecutive blocks usually come
/// from the same buffer).
pub(crate) struct RegionFinder {
    spans: Vec<(u64, u128)>,
    by_base: Vec<usize>,
    last: usize,
}

impl RegionFinder {
    pub(crate) fn new(spans: impl IntoIterator<Item = (u64, usize)>) -> Self {
        let spans: Vec<(u64, u128)> = spans
            .into_iter()
            .map(|(base, len)| (base, u128::from(base) + len as u128))
            .collect();
        let mut by_base: Vec<usize> = (0..spans.len()).collect();
        by_base.sort_by_key(|&i| spans[i].0);
        Self {
            spans,
            by_base,
            last: 0,
        }
    }

    fn holds(&self, i: usize, addr: u64, len: u64) -> bool {
        let (base, end) = self.spans[i];
        addr >= base && u128::from(addr) + u128::from(len) <= end
    }

    /// The buffer holding `len` bytes at `addr` and the block's offset in it.
    pub(crate) fn find(&mut self, addr: u64, len: u64) -> Option<(usize, usize)> {
        let found = if self.last < self.spans.len() && self.holds(self.last, addr, len) {
            self.last
        } else {
            // The last buffer starting at or before `addr`; with overlapping buffers another
            // one may hold the block, so fall back to trying them all.
            let after = self.by_base.partition_point(|&i| self.spans[i].0 <= addr);
            let candidate = after.checked_sub(1).map(|k| self.by_base[k]);
            candidate
                .filter(|&i| self.holds(i, addr, len))
                .or_else(|| (0..self.spans.len()).find(|&i| self.holds(i, addr, len)))?
        };
        self.last = found;
        // Inside a buffer, so the offset fits in usize (it indexes a slice).
        Some((found, (addr - self.spans[found].0) as usize))
    }

    /// "buffer i at [start, end)" for the buffer nearest to `addr`, for messages.
    fn nearest(&self, addr: u64) -> String {
        let distance = |&(base, end): &(u64, u128)| -> u128 {
            if addr < base {
                u128::from(base - addr)
            } else {
                u128::from(addr).saturating_sub(end)
            }
        };
        (0..self.spans.len())
            .min_by_key(|&i| distance(&self.spans[i]))
            .map_or_else(
                || "no buffers were given".to_string(),
                |i| {
                    let (base, end) = self.spans[i];
                    format!(
                        "nearest is buffer {i} at [{base:#x}, {end:#x}), {} bytes",
                        end - u128::from(base)
                    )
                },
            )
    }

    /// The error for block `block` of `side`, `len` bytes at `addr`, that no buffer holds.
    pub(crate) fn outside(&self, side: Side, block: usize, addr: u64, len: u64) -> PlanError {
        PlanError::BlockOutsideBuffers {
            side,
            block,
            addr,
            len,
            n_buffers: self.spans.len(),
            nearest: self.nearest(addr),
        }
    }
}

/// Checks that no destination buffer shares a byte with another destination buffer, a source
/// buffer or the memory of the plan's own columns (`(base, size)` each; empty spans share
/// nothing). Source buffers may overlap each other and the columns: they are only read.
///
/// # Errors
/// [`PlanError::BuffersOverlap`] naming the first two spans found to overlap.
pub fn check_local_buffers(
    src: &[(u64, u64)],
    dst: &[(u64, u64)],
    columns: &[(u64, u64)],
) -> Result<()> {
    #[derive(Clone, Copy, PartialEq)]
    enum Kind {
        Source,
        Destination,
        Column,
    }
    let end = |(base, size): (u64, u64)| u128::from(base) + u128::from(size);
    let name = |kind: Kind, i: usize, span: (u64, u64)| {
        let what = match kind {
            Kind::Source => format!("source buffer {i}"),
            Kind::Destination => format!("destination buffer {i}"),
            Kind::Column => format!("the plan's column {i}"),
        };
        format!("{what} at [{:#x}, {:#x})", span.0, end(span))
    };
    let listed = |kind: Kind, spans: &[(u64, u64)]| -> Vec<(Kind, usize, (u64, u64))> {
        spans
            .iter()
            .enumerate()
            .map(|(i, &s)| (kind, i, s))
            .collect()
    };
    let mut all: Vec<(Kind, usize, (u64, u64))> = [
        listed(Kind::Source, src),
        listed(Kind::Destination, dst),
        listed(Kind::Column, columns),
    ]
    .concat();
    all.retain(|&(_, _, (_, size))| size > 0);
    all.sort_by_key(|&(_, _, (base, _))| base);
    // Sweep by base: each span is compared with the open spans it starts inside of.
    let mut open: Vec<(Kind, usize, (u64, u64))> = Vec::new();
    for &(kind, i, span) in &all {
        open.retain(|&(_, _, o)| end(o) > u128::from(span.0));
        let clash = open
            .iter()
            .find(|&&(other, _, _)| kind == Kind::Destination || other == Kind::Destination);
        if let Some(&(other, j, other_span)) = clash {
            return Err(PlanError::BuffersOverlap {
                first: name(other, j, other_span),
                second: name(kind, i, span),
            });
        }
        open.push((kind, i, span));
    }
    Ok(())
}

/// Below this many bytes a plan is copied on one thread when the caller leaves the count to
/// [`copy_local_threads`]: starting a thread costs about as much as copying this much.
pub const SMALL_COPY_BYTES: u64 = 1 << 20;

/// The fewest bytes worth one more copying thread (a thread with less to do costs more to
/// start than it saves).
const BYTES_PER_THREAD: u64 = 256 << 10;

/// Most threads [`copy_local_threads`] picks on its own: small-block copies are bound by
/// memory latency, which a few threads hide; more only contend for the memory bus.
pub const MAX_DEFAULT_COPY_THREADS: usize = 4;

/// The threads a copy of `total` bytes uses: `requested`, or when `None`, the available cores
/// up to [`MAX_DEFAULT_COPY_THREADS`], one for a plan under [`SMALL_COPY_BYTES`]; never more
/// than one per [`BYTES_PER_THREAD`] (nor more than one per block) whatever was requested.
#[must_use]
pub fn copy_threads(requested: Option<usize>, total: u64, n_blocks: usize) -> usize {
    let wanted = requested.unwrap_or_else(|| {
        if total < SMALL_COPY_BYTES {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(1, std::num::NonZeroUsize::get)
                .min(MAX_DEFAULT_COPY_THREADS)
        }
    });
    let by_bytes = usize::try_from(total / BYTES_PER_THREAD).unwrap_or(usize::MAX);
    wanted.min(by_bytes).min(n_blocks).max(1)
}

/// Executes a local plan: copies block `k`, `lengths[k]` bytes, from address `src_addrs[k]` in
/// one of `src` to address `dst_addrs[k]` in one of `dst`, in plan order, on one thread. Every
/// block is located first, so nothing is copied when one lies outside the buffers. Returns the
/// bytes copied.
///
/// # Errors
/// [`PlanError::Geometry`] for columns of unequal lengths; [`PlanError::BlockOutsideBuffers`]
/// naming the first block that does not lie inside one buffer of its side.
pub fn copy_local(
    src_addrs: &[u64],
    dst_addrs: &[u64],
    lengths: &[u64],
    src: &[Region<'_>],
    dst: &mut [RegionMut<'_>],
) -> Result<u64> {
    copy_local_threads(src_addrs, dst_addrs, lengths, src, dst, Some(1))
}

/// [`copy_local`] on up to `threads` threads ([`copy_threads`] picks the count; `None` for
/// its default). Every block is located before the first byte moves, as on one thread. The
/// destination buffers are then cut at addresses no block straddles into one disjoint range
/// per thread, each thread copying, in plan order, the blocks whose destination lies in its
/// range; blocks that share destination bytes therefore land in one range and are written in
/// plan order, so the result is the one-thread result byte for byte.
///
/// # Errors
/// As [`copy_local`].
pub fn copy_local_threads(
    src_addrs: &[u64],
    dst_addrs: &[u64],
    lengths: &[u64],
    src: &[Region<'_>],
    dst: &mut [RegionMut<'_>],
    threads: Option<usize>,
) -> Result<u64> {
    if src_addrs.len() != lengths.len() || dst_addrs.len() != lengths.len() {
        return Err(PlanError::Geometry {
            what: format!(
                "a plan's columns must have equal lengths, got {} source addresses, {} \
                 destination addresses and {} lengths",
                src_addrs.len(),
                dst_addrs.len(),
                lengths.len()
            ),
        });
    }
    let mut sources = RegionFinder::new(src.iter().map(|r| (r.base, r.bytes.len())));
    let mut targets = RegionFinder::new(dst.iter().map(|r| (r.base, r.bytes.len())));
    // Where each destination buffer starts when the buffers are laid end to end in address
    // order: the byte histogram that places the cuts counts positions on that line, so that
    // gaps between buffers weigh nothing.
    let line = DestinationLine::new(dst);
    let mut histogram = [0u64; HISTOGRAM_BUCKETS];
    let blocks = src_addrs.iter().zip(dst_addrs).zip(lengths);
    let mut total = 0u64;
    for (block, ((&s, &d), &len)) in blocks.clone().enumerate() {
        if sources.find(s, len).is_none() {
            return Err(sources.outside(Side::Src, block, s, len));
        }
        let Some((j, to)) = targets.find(d, len) else {
            return Err(targets.outside(Side::Dst, block, d, len));
        };
        total = total.checked_add(len).ok_or(PlanError::Overflow {
            what: "bytes copied",
        })?;
        histogram[line.bucket(j, to)] += len;
    }
    let threads = copy_threads(threads, total, lengths.len());
    let cuts = if threads > 1 {
        line.cuts(&histogram, total, threads)
            .and_then(|cuts| settle_cuts(cuts, dst_addrs, lengths))
    } else {
        None
    };
    match cuts {
        Some(cuts) => copy_split(src_addrs, dst_addrs, lengths, src, dst, &cuts)?,
        None => copy_blocks(blocks, src, &mut sources, dst, &mut targets, |_| true)?,
    }
    Ok(total)
}

/// Buckets of the destination-byte histogram that places the cuts between threads.
const HISTOGRAM_BUCKETS: usize = 256;

/// Cuts settle in a few passes (a cut moves to the end of a block straddling it); a plan
/// whose cuts keep moving after this many is copied on one thread.
const SETTLE_PASSES: usize = 4;

/// The destination buffers laid end to end in address order.
struct DestinationLine {
    /// Per buffer (in the order given): its position on the line.
    starts: Vec<f64>,
    /// Histogram buckets per byte of the line.
    scale: f64,
    /// Buffers sorted by base address: `(base, size, position on the line)`.
    by_base: Vec<(u64, u64, u128)>,
    /// Sum of the buffers' sizes.
    length: u128,
    /// Whether the declared address ranges of the buffers are disjoint and end within the
    /// 64-bit address space; when they overlap, a block's buffer depends on the search order,
    /// and a range past the last address cannot be cut by address, so the copy stays on one
    /// thread.
    disjoint: bool,
}

impl DestinationLine {
    #[allow(clippy::cast_precision_loss)]
    fn new(dst: &[RegionMut<'_>]) -> Self {
        let mut order: Vec<usize> = (0..dst.len()).collect();
        order.sort_by_key(|&i| dst[i].base);
        let mut starts = vec![0f64; dst.len()];
        let mut by_base = Vec::with_capacity(dst.len());
        let mut at = 0u128;
        let mut disjoint = true;
        let mut prev_end = 0u128;
        for (k, &i) in order.iter().enumerate() {
            let (base, size) = (dst[i].base, dst[i].bytes.len() as u64);
            let end = u128::from(base) + u128::from(size);
            if (k > 0 && u128::from(base) < prev_end) || end > u128::from(u64::MAX) {
                disjoint = false;
            }
            prev_end = prev_end.max(end);
            starts[i] = at as f64;
            by_base.push((base, size, at));
            at += u128::from(size);
        }
        Self {
            starts,
            scale: HISTOGRAM_BUCKETS as f64 / (at.max(1) as f64),
            by_base,
            length: at,
            disjoint,
        }
    }

    /// The histogram bucket of the byte at `offset` in buffer `j` (in floating point: a
    /// bucket only weighs the cuts, and an integer division per block would cost more than
    /// the rest of the check).
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    fn bucket(&self, j: usize, offset: usize) -> usize {
        let position = self.starts[j] + offset as f64;
        ((position * self.scale) as usize).min(HISTOGRAM_BUCKETS - 1)
    }

    /// The address of the byte at `position` on the line.
    fn address(&self, position: u128) -> u64 {
        let k = self.by_base.partition_point(|&(_, _, at)| at <= position);
        let (base, size, at) = self.by_base[k.saturating_sub(1)];
        // Inside that buffer or at its end, so the sum is an address the caller gave.
        let offset = u64::try_from(position - at).map_or(size, |o| o.min(size));
        base.saturating_add(offset)
    }

    /// `threads - 1` ascending addresses splitting the copied bytes about evenly, at bucket
    /// boundaries; `None` when the buffers overlap or the bytes do not spread over buckets.
    fn cuts(&self, histogram: &[u64], total: u64, threads: usize) -> Option<Vec<u64>> {
        if !self.disjoint || self.by_base.is_empty() {
            return None;
        }
        let mut cuts = Vec::with_capacity(threads - 1);
        let mut seen = 0u64;
        let mut next = 1u64;
        for (b, &bytes) in histogram.iter().enumerate() {
            seen += bytes;
            while next < threads as u64 && seen >= total / threads as u64 * next {
                let position = (b as u128 + 1) * self.length / HISTOGRAM_BUCKETS as u128;
                cuts.push(self.address(position));
                next += 1;
            }
        }
        cuts.dedup();
        (!cuts.is_empty()).then_some(cuts)
    }
}

/// Moves each cut to the end of any block straddling it until none does; `None` when that
/// takes more than [`SETTLE_PASSES`] passes.
fn settle_cuts(mut cuts: Vec<u64>, dst_addrs: &[u64], lengths: &[u64]) -> Option<Vec<u64>> {
    for _ in 0..SETTLE_PASSES {
        let mut moved = false;
        for (&d, &len) in dst_addrs.iter().zip(lengths) {
            let end = d.saturating_add(len);
            for cut in &mut cuts {
                if d < *cut && end > *cut {
                    *cut = end;
                    moved = true;
                }
            }
        }
        if !moved {
            cuts.sort_unstable();
            cuts.dedup();
            return Some(cuts);
        }
    }
    None
}

/// Copies the blocks `owned` selects (by destination address), in plan order. Every block
/// was located before (the buffers have not changed since).
fn copy_blocks<'b>(
    blocks: impl Iterator<Item = ((&'b u64, &'b u64), &'b u64)>,
    src: &[Region<'_>],
    sources: &mut RegionFinder,
    dst: &mut [RegionMut<'_>],
    targets: &mut RegionFinder,
    owned: impl Fn(u64) -> bool,
) -> Result<()> {
    for ((&s, &d), &len) in blocks {
        // An empty block copies nothing, and one at the end of a buffer that ends at a cut
        // belongs to no range.
        if len == 0 || !owned(d) {
            continue;
        }
        let (Some((i, from)), Some((j, to))) = (sources.find(s, len), targets.find(d, len)) else {
            return Err(PlanError::InputChanged);
        };
        let len = len as usize; // inside a slice
        dst[j].bytes[to..to + len].copy_from_slice(&src[i].bytes[from..from + len]);
    }
    Ok(())
}

/// Splits the destination buffers at `cuts` (ascending addresses no block straddles) and
/// copies each range's blocks on its own thread.
fn copy_split(
    src_addrs: &[u64],
    dst_addrs: &[u64],
    lengths: &[u64],
    src: &[Region<'_>],
    dst: &mut [RegionMut<'_>],
    cuts: &[u64],
) -> Result<()> {
    // ranges[t] = [lo, hi) of addresses; the pieces of every buffer inside it.
    let mut bounds = Vec::with_capacity(cuts.len() + 2);
    bounds.push(0u64);
    bounds.extend_from_slice(cuts);
    bounds.push(u64::MAX);
    let mut pieces: Vec<Vec<RegionMut<'_>>> = (0..bounds.len() - 1).map(|_| Vec::new()).collect();
    for region in dst.iter_mut() {
        let mut base = region.base;
        let mut rest: &mut [u8] = &mut region.bytes[..];
        for (t, window) in bounds.windows(2).enumerate() {
            let hi = window[1];
            if rest.is_empty() || base >= hi {
                continue;
            }
            // The part of `rest` below `hi` (all of it when the buffer ends first).
            let take = usize::try_from(hi - base).map_or(rest.len(), |n| n.min(rest.len()));
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(take);
            pieces[t].push(RegionMut { base, bytes: head });
            base = base.saturating_add(take as u64);
            rest = tail;
        }
    }
    let blocks = || src_addrs.iter().zip(dst_addrs).zip(lengths);
    std::thread::scope(|scope| {
        let workers: Vec<_> = pieces
            .into_iter()
            .zip(bounds.windows(2))
            .filter(|(p, _)| !p.is_empty())
            .map(|(mut mine, window)| {
                let (lo, hi) = (window[0], window[1]);
                scope.spawn(move || {
                    let mut sources =
                        RegionFinder::new(src.iter().map(|r| (r.base, r.bytes.len())));
                    let mut targets =
                        RegionFinder::new(mine.iter().map(|r| (r.base, r.bytes.len())));
                    copy_blocks(blocks(), src, &mut sources, &mut mine, &mut targets, |d| {
                        lo <= d && d < hi
                    })
                })
            })
            .collect();
        // Every worker is joined before the first failure (if any) is returned.
        let outcomes: Vec<Result<()>> = workers
            .into_iter()
            .map(|w| w.join().unwrap_or(Err(PlanError::InputChanged)))
            .collect();
        outcomes.into_iter().collect::<Result<()>>()
    })
}
