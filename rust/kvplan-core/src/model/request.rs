//! One transfer request, the value every planner takes: the pages (or the state slot) of each
//! side, how many tokens move, and how many leading tokens the decode holds already. Planners read it; none takes loose index arguments, so a new
//! request field reaches every planner through this one type.

use crate::error::{PlanError, Result, Side};
use crate::model::runs::PageIndex;
use crate::peer::entry::{POOLS, PoolId};

/// Each side's page list of one pool (`None`: that side gives none).
pub type PoolLists<'a, S, D> = (Option<&'a [S]>, Option<&'a [D]>);

/// What a request indexes on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Indices<'a, S, D> {
    /// Page indices: page `src[i]` to page `dst[i]` for a page plan, or each side's pages in
    /// token order (of any lengths) for a token plan.
    Pages {
        /// Prefill (source) page indices.
        src: &'a [S],
        /// Decode (destination) page indices.
        dst: &'a [D],
    },
    /// One state slot per side (hybrid models' per-request state).
    Slot {
        /// Prefill (source) slot.
        src: i64,
        /// Decode (destination) slot.
        dst: i64,
    },
}

/// One request to plan.
///
/// A page request (`n_tokens` is `None` on a template that does not plan by token) copies whole
/// pages; a token request (`n_tokens` given, or a template that plans by token) moves the first
/// `n_tokens` tokens of the two page lists (default: the full pages of the shorter side); a slot
/// request moves one state slot per state pair.
///
/// A *delta* request (`skip_tokens` K > 0) is a token request whose first K tokens the decode
/// holds already (a prefix it cached): it moves tokens `K..n_tokens` only, K any count (not
/// only a page multiple), the page lists still the request's whole lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a, S = i64, D = i64> {
    /// The pages or slots of each side.
    pub indices: Indices<'a, S, D>,
    /// Tokens to move (page lists only).
    pub n_tokens: Option<u64>,
    /// Leading tokens the decode holds already, not moved (page lists only; 0: none).
    pub skip_tokens: u64,
    /// Each side's pages of its layout's further pools ([`crate::Layout::with_pool`],
    /// [`crate::Layout::with_window_pool`]), by [`PoolId::index`]: for a side that keeps the
    /// pool, that pool's pages of the request in token order from its first token (pages
    /// before the first token a lane moves are not read); `None` for a side without that pool.
    /// The request's own pages (pool [`PoolId::PAGES`]) are `indices`, so that pool's place
    /// here stays `(None, None)` ([`Request::pool_lists`] reads either).
    pub pool_pages: [PoolLists<'a, S, D>; POOLS],
    /// Per further pool ([`PoolId::index`]), that pool's own token range `(n_tokens,
    /// skip_tokens)`: its entries move tokens `skip_tokens..n_tokens` of its page lists instead
    /// of the request's range (`None`: the request's range). Groups of one model hold different
    /// token counts (a state group keeps one page, a prefix hit cuts each group apart), so
    /// one range cannot size every pool; `(0, 0)` with empty lists moves nothing of that pool.
    pub pool_tokens: [Option<(u64, u64)>; POOLS],
    /// A page request's state slot on each side `(src, dst)`: a hybrid model's whole request
    /// in one value. Its plan is the page (or token) plan followed by the state plan of
    /// `Request::slot(src, dst)` (with the ring rows of the last `min(R_p, R_d, n_tokens)`
    /// positions when `n_tokens` is given and the template has ring-state pairs), exactly as
    /// the two requests planned one after the other. `None`: no state moves; always `None`
    /// for a slot request, whose slots are its indices.
    pub state_slot: Option<(i64, i64)>,
}

impl<'a, S: PageIndex, D: PageIndex> Request<'a, S, D> {
    /// Page lists with an optional token count (the form callers that forward one use).
    pub fn new(src: &'a [S], dst: &'a [D], n_tokens: Option<u64>) -> Self {
        Self {
            indices: Indices::Pages { src, dst },
            n_tokens,
            skip_tokens: 0,
            pool_pages: [(None, None); POOLS],
            pool_tokens: [None; POOLS],
            state_slot: None,
        }
    }

    /// The same request with each side's pages of pool `pool` (a further pool: the request's
    /// own pages are given to [`Request::new`] and stay as they are).
    #[must_use]
    pub fn with_pool_pages(
        mut self,
        pool: PoolId,
        src: Option<&'a [S]>,
        dst: Option<&'a [D]>,
    ) -> Self {
        if pool != PoolId::PAGES {
            self.pool_pages[pool.index()] = (src, dst);
        }
        self
    }

    /// The same request with pool `pool`'s own token range: its entries move tokens
    /// `skip_tokens..n_tokens` of that pool's lists (a further pool; pool 0's range is the
    /// request's own, so it stays as it is).
    #[must_use]
    pub fn with_pool_tokens(mut self, pool: PoolId, n_tokens: u64, skip_tokens: u64) -> Self {
        if pool != PoolId::PAGES {
            self.pool_tokens[pool.index()] = Some((n_tokens, skip_tokens));
        }
        self
    }

    /// The same request with the state slot of each side (`src`, `dst`): its plan moves the
    /// pages, then the state slots (see [`Request::state_slot`]). On a slot request the
    /// slots are its indices already, so it stays as it is.
    #[must_use]
    pub fn with_state_slot(mut self, src: i64, dst: i64) -> Self {
        if let Indices::Pages { .. } = self.indices {
            self.state_slot = Some((src, dst));
        }
        self
    }

    /// The page part of a request that carries a state slot too: the same request without
    /// it (see [`Request::state_slot`]).
    #[must_use]
    pub fn pages_part(&self) -> Self {
        Self {
            state_slot: None,
            ..*self
        }
    }

    /// The state part of a request that carries a state slot: `Request::slot(src, dst)` with
    /// the ring positions `n_tokens` when the template has ring-state pairs (`rings`); `None`
    /// for a request without a state slot.
    pub fn state_part(&self, rings: bool) -> Option<Request<'static>> {
        let (src, dst) = self.state_slot?;
        Some(Request {
            n_tokens: self.n_tokens.filter(|_| rings),
            ..Request::slot(src, dst)
        })
    }

    /// Whether some further pool has a token range of its own.
    pub fn has_pool_tokens(&self) -> bool {
        self.pool_tokens.iter().any(Option::is_some)
    }

    /// The same request with each side's window pages (for the sides whose window entries
    /// keep a pool of their own, pool 1): [`Request::with_pool_pages`] of [`PoolId::WINDOW`].
    #[must_use]
    pub fn with_window_pages(self, src: Option<&'a [S]>, dst: Option<&'a [D]>) -> Self {
        self.with_pool_pages(PoolId::WINDOW, src, dst)
    }

    /// The same request without its first `skip_tokens` tokens (the decode holds them).
    #[must_use]
    pub fn skipping(self, skip_tokens: u64) -> Self {
        Self {
            skip_tokens,
            ..self
        }
    }

    /// Whole pages: page `src[i]` to page `dst[i]`.
    pub fn pages(src: &'a [S], dst: &'a [D]) -> Self {
        Self::new(src, dst, None)
    }

    /// The first `n_tokens` tokens of each side's pages in token order.
    pub fn tokens(src: &'a [S], dst: &'a [D], n_tokens: u64) -> Self {
        Self::new(src, dst, Some(n_tokens))
    }

    /// The two page lists.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] for a slot request (a planner that needs pages names itself).
    pub fn page_lists(&self, planner: &str) -> Result<(&'a [S], &'a [D])> {
        match self.indices {
            Indices::Pages { src, dst } => Ok((src, dst)),
            Indices::Slot { .. } => Err(PlanError::Geometry {
                what: format!("{planner} plans page lists, not a state slot"),
            }),
        }
    }

    /// Each side's page list of pool `pool`: the request's pages for [`PoolId::PAGES`] (none
    /// for a slot request), else the lists given for that pool.
    pub fn pool_lists(&self, pool: PoolId) -> PoolLists<'a, S, D> {
        match (pool, self.indices) {
            (PoolId::PAGES, Indices::Pages { src, dst }) => (Some(src), Some(dst)),
            (PoolId::PAGES, Indices::Slot { .. }) => (None, None),
            (pool, _) => self.pool_pages[pool.index()],
        }
    }

    /// Whether this is a slot request.
    pub fn is_slot(&self) -> bool {
        matches!(self.indices, Indices::Slot { .. })
    }

    /// Refuses a delta request in a planner that plans whole requests only.
    ///
    /// # Errors
    /// [`PlanError::Geometry`] naming the planner and the skip count.
    pub fn refuse_delta(&self, planner: &str) -> Result<()> {
        if self.skip_tokens > 0 {
            return Err(PlanError::Geometry {
                what: format!(
                    "{planner} plans whole requests; this one skips its first {} tokens (a \
                     delta request): plan it with Template::plan",
                    self.skip_tokens
                ),
            });
        }
        Ok(())
    }
}

impl Request<'static> {
    /// One state slot per side.
    pub fn slot(src: i64, dst: i64) -> Self {
        Self {
            indices: Indices::Slot { src, dst },
            n_tokens: None,
            skip_tokens: 0,
            pool_pages: [(None, None); POOLS],
            pool_tokens: [None; POOLS],
            state_slot: None,
        }
    }
}

/// Both slots of a slot request as indices: a negative slot is [`PlanError::NegativeIndex`]
/// naming its side.
pub(crate) fn slot_indices(src: i64, dst: i64) -> Result<(u64, u64)> {
    for (side, slot) in [(Side::Src, src), (Side::Dst, dst)] {
        if slot < 0 {
            return Err(PlanError::NegativeIndex {
                side,
                index: slot,
                position: 0,
            });
        }
    }
    Ok((src as u64, dst as u64))
}
