//! Prepped descriptor tables: a template's transfers as one table of `(addr, len)` descriptors
//! per side, registered with an engine once per peer pair, and each request as two index arrays
//! into them (NIXL's `prep_xfer_dlist` / `make_prepped_xfer`, the form vLLM's connector uses).
//!
//! The tables come from the template's own emission pieces, so they share the plan's address
//! model: strides (cross-layer pools), head fragments between TP sizes, coalesced groups, and
//! nothing at all for a pair that moves no page bytes. A prepped request moves exactly the bytes
//! of the plan of the same request; it costs one descriptor per page where the plan may merge a
//! run into one block.
//!
//! A side's table has two sections:
//! - pages: descriptor `j * pages + k` is page `k` of piece `j` (`len` bytes at
//!   `base_j + k * stride_j`), for every piece `j` and every page `k` below the side's index
//!   limit (the smallest capacity of the emitting pairs, [`Template::index_limits`]);
//! - state: descriptor `state_start + m * slots + k` is slot `k` of the `m`-th state pair that
//!   moves bytes, for every slot `k` below the smallest capacity of those pairs.
//!
//! Token plans (different page sizes or memory orders) move a page's tokens to several pages
//! or several places of the other side's page, which no table of whole-page descriptors can
//! express: they are refused, naming the plan path.

use crate::error::{PlanError, Result, Side, try_vec};
use crate::model::pieces::PairSpec;
use crate::model::plan::PlanUnit;
use crate::model::request::{Indices, Request};
use crate::model::runs::PageIndex;
use crate::peer_pair::template::Template;
use crate::rules::capabilities::{Feature, Planner};

/// How a template's prepped tables are laid out (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreppedShape {
    /// Page pieces ([`Template::pieces`]), each with one descriptor per page.
    pub pieces: usize,
    /// Descriptors per piece in the source and the destination table (each side's index
    /// limit; 0 when no piece moves bytes).
    pub pages: (u64, u64),
    /// State pairs that move bytes (non-zero item length), each with one descriptor per slot.
    pub state_pairs: usize,
    /// Descriptors per state pair in each table (the smallest capacity over those pairs).
    pub slots: (u64, u64),
    /// First descriptor of the state section of each table.
    pub state_start: (u64, u64),
    /// Descriptors in each table (at most `i64::MAX`, so every index fits an int64).
    pub rows: (u64, u64),
}

/// One side's descriptors: descriptor `i` is the `lens[i]` bytes at `addrs[i]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DescriptorTable {
    /// Start address of each descriptor.
    pub addrs: Vec<u64>,
    /// Bytes of each descriptor.
    pub lens: Vec<u64>,
}

/// One run of a side's table: `count` descriptors of `len` bytes, the `k`-th at
/// `base + k * stride` (a strided descriptor list's row: NIXL's `(addr, len, dev, stride,
/// count)` without the device). A side's runs, in order, are its table: run `r`'s descriptors
/// follow those of the runs before it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DescriptorRun {
    /// Address of the run's first descriptor.
    pub base: u64,
    /// Bytes of each descriptor.
    pub len: u64,
    /// Bytes from one descriptor's start to the next one's.
    pub stride: u64,
    /// Descriptors in the run.
    pub count: u64,
}

/// A request as indices into the two tables: descriptor `src[i]` of the source table goes to
/// descriptor `dst[i]` of the destination table (equal lengths by construction).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreppedIndices {
    /// Indices into the source table.
    pub src: Vec<i64>,
    /// Indices into the destination table.
    pub dst: Vec<i64>,
}

/// A template's prepped tables and its requests as indices into them; borrows the template.
#[derive(Debug, Clone)]
pub struct DescriptorTables<'t> {
    template: &'t Template,
}

impl<'t> DescriptorTables<'t> {
    /// The prepped tables of `template`.
    pub fn new(template: &'t Template) -> Self {
        Self { template }
    }
}

fn overflow() -> PlanError {
    PlanError::Overflow {
        what: "prepped descriptor table size",
    }
}

impl DescriptorTables<'_> {
    /// State pairs that move bytes, in planning order (the pairs a slot plan emits).
    fn moving_state_pairs(&self) -> impl Iterator<Item = &'_ PairSpec> {
        self.template
            .state_pairs()
            .iter()
            .filter(|p| p.item_len > 0)
    }

    /// The layout of this template's prepped tables.
    ///
    /// # Errors
    /// [`PlanError::Unsupported`] for a token template ([`Template::by_token`]: the
    /// `window` or `token_plan` feature);
    /// [`PlanError::Unsupported`] for a template whose state pairs move several byte slices of
    /// a slot (the `sliced_state` feature: a TP channel split);
    /// [`PlanError::Overflow`] when a table would hold more than `i64::MAX` descriptors.
    pub fn shape(&self) -> Result<PreppedShape> {
        // the tables hold every state pair's descriptors, whatever a request later asks
        let asked = self.template.asked();
        let asked = asked.with(Feature::SlicedState, asked.sliced_state_pairs > 0);
        crate::rules::capabilities::check(Planner::Descriptors, &asked)?;
        let pieces = self.template.pieces().len();
        let limits = self.template.index_limits();
        let pages = if pieces == 0 {
            (0, 0)
        } else {
            (limits.src, limits.dst)
        };
        let state_pairs = self.moving_state_pairs().count();
        let slot_limit = |side: Side| {
            self.moving_state_pairs()
                .map(|p| side.pick(p.src_capacity, p.dst_capacity))
                .min()
                .unwrap_or(0)
        };
        let slots = (slot_limit(Side::Src), slot_limit(Side::Dst));
        let section = |count: usize, per: u64| (count as u64).checked_mul(per).ok_or_else(overflow);
        let (src_start, dst_start) = (section(pieces, pages.0)?, section(pieces, pages.1)?);
        let total = |start: u64, per: u64| {
            section(state_pairs, per)?
                .checked_add(start)
                .filter(|&rows| i64::try_from(rows).is_ok())
                .ok_or_else(overflow)
        };
        Ok(PreppedShape {
            pieces,
            pages,
            state_pairs,
            slots,
            state_start: (src_start, dst_start),
            rows: (total(src_start, slots.0)?, total(dst_start, slots.1)?),
        })
    }

    /// One side's prepped descriptor table as runs, one per emission piece (its pages) and one
    /// per state pair that moves bytes (its slots): the table without expanding it, the form
    /// of a strided descriptor list. Expanding the runs in order gives [`Self::table`].
    ///
    /// # Errors
    /// As [`DescriptorTables::shape`]; [`PlanError::Overflow`] when a run's last descriptor
    /// would lie past the address space.
    pub fn runs(&self, side: Side) -> Result<Vec<DescriptorRun>> {
        let shape = self.shape()?;
        let pages = side.pick(shape.pages.0, shape.pages.1);
        let slots = side.pick(shape.slots.0, shape.slots.1);
        // Page pieces have one slot per page and state pieces one per slot: the side's page
        // stride steps from one descriptor to the next.
        let place = |p: &crate::model::pieces::Piece, count: u64| {
            let at = side.pick(&p.src, &p.dst);
            DescriptorRun {
                base: at.base,
                len: p.len,
                stride: at.page_stride,
                count,
            }
        };
        let pieces = self.template.pieces().iter().map(|p| place(p, pages));
        // the state pairs that move bytes (a pair of empty items has no descriptors)
        let states = self
            .template
            .state_pieces
            .iter()
            .filter(|p| p.len > 0)
            .map(|p| place(p, slots));
        let n = shape.pieces + shape.state_pairs;
        let mut out = try_vec(n, DescriptorRun::default(), "prepped descriptor runs")?;
        let mut written = 0;
        for (slot, run) in out.iter_mut().zip(pieces.chain(states)) {
            // In range of every paired buffer, so inside a buffer whose end fits in u64;
            // checked all the same, since the runs are built once per peer pair.
            run.count
                .checked_sub(1)
                .map_or(Some(0), |last| last.checked_mul(run.stride))
                .and_then(|off| off.checked_add(run.base))
                .ok_or(PlanError::Overflow {
                    what: "a prepped descriptor address",
                })?;
            *slot = run;
            written += 1;
        }
        if written != n {
            return Err(overflow());
        }
        Ok(out)
    }

    /// One side's prepped descriptor table (see the module documentation): its
    /// [`Self::runs`], expanded. Every descriptor lies inside its entry's buffer (a coalesced
    /// piece's: inside its group's buffers).
    ///
    /// # Errors
    /// As [`DescriptorTables::shape`]; [`PlanError::OutOfMemory`] when the table cannot be
    /// allocated.
    pub fn table(&self, side: Side) -> Result<DescriptorTable> {
        let shape = self.shape()?;
        let rows =
            usize::try_from(side.pick(shape.rows.0, shape.rows.1)).map_err(|_| overflow())?;
        let mut table = DescriptorTable {
            addrs: try_vec(rows, 0, "prepped descriptor addresses")?,
            lens: try_vec(rows, 0, "prepped descriptor lengths")?,
        };
        let mut rows = table.addrs.iter_mut().zip(table.lens.iter_mut());
        for run in self.runs(side)? {
            for k in 0..run.count {
                // `runs` checked the run's last address
                let addr = run.base + k * run.stride;
                let (a, l) = rows.next().ok_or_else(overflow)?;
                (*a, *l) = (addr, run.len);
            }
        }
        Ok(table)
    }

    /// A page request as indices into the prepped tables: piece major, page minor (for
    /// per-page pieces the order of [`Template::plan`]'s blocks); a slot request as one index
    /// per state pair that moves bytes. Validated exactly as a plan of the same request.
    ///
    /// # Errors
    /// As [`DescriptorTables::shape`] and [`Template::prepare`] (unequal lengths, a negative
    /// index, an index outside a paired buffer, a repeated destination when the template
    /// checks overlap); [`PlanError::OutOfMemory`]; [`PlanError::InputChanged`] when the
    /// indices changed during the call.
    pub fn indices<S: PageIndex, D: PageIndex>(
        &self,
        request: &Request<'_, S, D>,
    ) -> Result<PreppedIndices> {
        let shape = self.shape()?;
        self.template.admit(Planner::Descriptors, request)?;
        let (src, dst) = match request.indices {
            Indices::Slot { src, dst } => {
                return self.slot_indices(&shape, request, src, dst);
            }
            Indices::Pages { src, dst } => (src, dst),
        };
        // A page request: `prepped_shape` has refused templates that plan by token.
        let n_pages = match self.template.prepare(request)?.unit {
            PlanUnit::Pages(scan) => scan.n_pages,
            _ => return Err(PlanError::InputChanged),
        };
        let n = shape
            .pieces
            .checked_mul(n_pages)
            .ok_or(PlanError::Overflow {
                what: "prepped index count",
            })?;
        let mut out = PreppedIndices {
            src: try_vec(n, 0, "prepped source indices")?,
            dst: try_vec(n, 0, "prepped destination indices")?,
        };
        fill_indices(&mut out.src, src, 0, shape.pages.0)?;
        fill_indices(&mut out.dst, dst, 0, shape.pages.1)?;
        Ok(out)
    }

    /// A slot request as indices into the prepped tables, one per state pair that moves bytes
    /// (the blocks of its plan, in order), validated exactly as that plan.
    fn slot_indices<S: PageIndex, D: PageIndex>(
        &self,
        shape: &PreppedShape,
        request: &Request<'_, S, D>,
        src_slot: i64,
        dst_slot: i64,
    ) -> Result<PreppedIndices> {
        let n = shape.state_pairs;
        self.template.prepare(request)?;
        let mut out = PreppedIndices {
            src: try_vec(n, 0, "prepped source indices")?,
            dst: try_vec(n, 0, "prepped destination indices")?,
        };
        fill_indices(
            &mut out.src,
            &[src_slot],
            shape.state_start.0,
            shape.slots.0,
        )?;
        fill_indices(
            &mut out.dst,
            &[dst_slot],
            shape.state_start.1,
            shape.slots.1,
        )?;
        Ok(out)
    }
}

/// `out[j * n + i] = start + j * per + values[i]` for every section `j` of `out` (`n` values
/// each). The values were validated against `per`; they are checked again as they are read,
/// so an array changed by another thread meanwhile is an error, never an index into another
/// section. Every result is below the table's row count, which fits an int64.
fn fill_indices<T: PageIndex>(out: &mut [i64], values: &[T], start: u64, per: u64) -> Result<()> {
    if values.is_empty() {
        return Ok(());
    }
    for (j, section) in out.chunks_exact_mut(values.len()).enumerate() {
        let first = start + j as u64 * per;
        for (slot, value) in section.iter_mut().zip(values) {
            let v = u64::try_from(value.get()).map_err(|_| PlanError::InputChanged)?;
            if v >= per {
                return Err(PlanError::InputChanged);
            }
            *slot = (first + v) as i64;
        }
    }
    Ok(())
}
