//! Page pools: a window pool, further pools, and each entry's page size and rows per page.

#[cfg(doc)]
use crate::error::PlanError;
use crate::error::Result;
use crate::peer::entry::{Entry, EntryKind, POOLS, Pool, PoolId};

use super::{Layout, invalid, too_many_pools};

impl Layout {
    /// The same layout with its window entries in a pool of their own (as an engine keeps
    /// sliding-window layers in a separate, smaller pool): they are indexed by a request's
    /// *window pages* (its own page list, in token order from the request's first token, the
    /// pages before the window never read), each page holding `page_size` tokens, which may
    /// differ from the full-attention pages' size.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] for a page size of 0, a layout without window entries, a
    /// layout that deals its tokens over decode context-parallel ranks, or a window wider than
    /// the tokens its pool buffer holds at that page size.
    pub fn with_window_pool(mut self, page_size: u64) -> Result<Self> {
        let problem = if page_size == 0 {
            "a window pool's page_size must be at least 1, got 0"
        } else if !self.has_windows() {
            "a window pool needs window entries (with_windows first)"
        } else if self.context.dcp.dealt() {
            "a window pool is not supported on a layout that deals its tokens over decode \
             context-parallel ranks"
        } else {
            // The window pool keeps its id when set again; else it is the next pool.
            let id = self
                .entries
                .iter()
                .find(|e| e.window().is_some() && e.pool() != Some(PoolId::PAGES))
                .and_then(Entry::pool)
                .unwrap_or(PoolId(self.pools.len() as u8));
            if id.index() >= POOLS {
                return Err(too_many_pools());
            }
            let pool = Pool {
                id,
                page_size,
                tokens_per_row: 1,
            };
            match self.pools.iter_mut().find(|p| p.id == id) {
                Some(existing) => *existing = pool,
                None => self.pools.push(pool),
            }
            for entry in &mut self.entries {
                if let EntryKind::Page {
                    window: Some(window),
                    ..
                } = entry.kind
                {
                    entry.kind = EntryKind::Page {
                        pool: id,
                        window: Some(window),
                    };
                }
            }
            self.check_windows_fit()?;
            return Ok(self);
        };
        Err(invalid(problem.into()))
    }

    /// The same layout with `entries` (page entries of the request's pages) in a pool of their
    /// own, the next pool id ([`Layout::pools`]): one page index space with its own page size,
    /// as an engine keeps each KV-cache group in its own block table. Each page holds
    /// `page_size` tokens as `page_size / tokens_per_row` rows of `tokens_per_row` tokens each
    /// (a compressed cache keeps one row per several tokens; 1: a row per token). A request
    /// gives each side's pages of the pool in token order from its first token
    /// ([`crate::Request::with_pool_pages`]); a token plan moves the rows of that pool whose
    /// tokens are all in the request's range ([`Pool::tokens_per_row`]).
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] naming the values for a page size or row of 0 tokens, a
    /// page size that is not a multiple of `tokens_per_row`, no entries, an entry out of
    /// range, a state entry, an entry already in a pool of its own, a layout that deals its
    /// tokens over decode context-parallel ranks, or more than [`POOLS`] pools.
    pub fn with_pool(
        mut self,
        entries: &[usize],
        page_size: u64,
        tokens_per_row: u64,
    ) -> Result<Self> {
        let id = PoolId(self.pools.len().min(POOLS) as u8);
        let problem = if page_size == 0 || tokens_per_row == 0 {
            format!(
                "a pool's page_size and tokens_per_row must be at least 1, got page_size \
                 {page_size}, tokens_per_row {tokens_per_row}"
            )
        } else if !page_size.is_multiple_of(tokens_per_row) {
            format!(
                "a pool's page_size must be a multiple of its tokens_per_row (a row never spans \
                 pages), got page_size {page_size}, tokens_per_row {tokens_per_row}"
            )
        } else if entries.is_empty() {
            "a pool needs at least one entry".into()
        } else if self.context.dcp.dealt() {
            "a pool of its own is not supported on a layout that deals its tokens over decode \
             context-parallel ranks"
                .into()
        } else if id.index() >= POOLS {
            return Err(too_many_pools());
        } else if let Some((&entry, why)) = entries.iter().find_map(|e| {
            let why = match self.entries.get(*e) {
                None => "is out of range",
                Some(x) if !x.is_page() => "is a state entry (a pool holds page entries)",
                Some(x) if x.pool() != Some(PoolId::PAGES) => "is already in a pool of its own",
                Some(_) => return None,
            };
            Some((e, why))
        }) {
            format!("entry {entry} {why} ({} entries)", self.entries.len())
        } else {
            self.pools.push(Pool {
                id,
                page_size,
                tokens_per_row,
            });
            for &entry in entries {
                if let EntryKind::Page { window, .. } = self.entries[entry].kind {
                    self.entries[entry].kind = EntryKind::Page { pool: id, window };
                }
            }
            self.check_windows_fit()?;
            return Ok(self);
        };
        Err(invalid(problem))
    }

    /// The same layout with exactly `pools` beside its request pages (ids 1, 2, … in order)
    /// and each entry's pool (`members`, [`PoolId::PAGES`] for the request's pages and for
    /// state entries) and window as given: the form for a caller that names every pool and
    /// member (the wire form, the C ABI) rather than the builder calls that made them, since a
    /// window pool made after a further pool, or a window entry in a further pool, cannot be
    /// replayed through them.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] naming the values for a pool id out of order, a page size
    /// or row of 0 tokens, a page size that is not a multiple of its row, more than [`POOLS`]
    /// pools, a layout that deals its tokens over decode context-parallel ranks, an entry in a
    /// pool the layout does not keep, a state entry in a pool or with a window, a window of 0
    /// tokens, or a window wider than its buffer holds at its pool's page size.
    pub fn with_pool_table(
        mut self,
        pools: &[Pool],
        members: &[PoolId],
        windows: &[Option<u64>],
    ) -> Result<Self> {
        let n = self.entries.len();
        if members.len() != n || windows.len() != n {
            return Err(invalid(format!(
                "a pool table needs one pool and one window per entry ({n} entries), got {} \
                 pools and {} windows",
                members.len(),
                windows.len()
            )));
        }
        if pools.len() >= POOLS {
            return Err(too_many_pools());
        }
        if !pools.is_empty() && self.context.dcp.dealt() {
            return Err(invalid(
                "a pool of its own is not supported on a layout that deals its tokens over \
                 decode context-parallel ranks"
                    .into(),
            ));
        }
        for (k, pool) in pools.iter().enumerate() {
            let problem = if usize::from(pool.id.0) != k + 1 {
                format!(
                    "pool {k} of the table has id {}, expected {}",
                    pool.id.0,
                    k + 1
                )
            } else if pool.page_size == 0 || pool.tokens_per_row == 0 {
                format!(
                    "pool {}: page_size and tokens_per_row must be at least 1, got page_size \
                     {}, tokens_per_row {}",
                    pool.id.0, pool.page_size, pool.tokens_per_row
                )
            } else if !pool.page_size.is_multiple_of(pool.tokens_per_row) {
                format!(
                    "pool {}: page_size must be a multiple of tokens_per_row, got page_size {}, \
                     tokens_per_row {}",
                    pool.id.0, pool.page_size, pool.tokens_per_row
                )
            } else {
                continue;
            };
            return Err(invalid(problem));
        }
        for (entry, (&pool, &window)) in members.iter().zip(windows).enumerate() {
            let page = self.entries[entry].is_page();
            let problem = if usize::from(pool.0) > pools.len() {
                format!(
                    "is in pool {}, which the layout does not keep ({} pools)",
                    pool.0,
                    pools.len() + 1
                )
            } else if !page && pool != PoolId::PAGES {
                format!(
                    "is a state entry in pool {} (a pool holds page entries)",
                    pool.0
                )
            } else if !page && window.is_some() {
                "is a state entry with a sliding window (a window applies to page entries)".into()
            } else if window == Some(0) {
                "has a sliding window of 0 tokens (at least 1)".into()
            } else {
                continue;
            };
            return Err(invalid(format!(
                "entry {entry} ({}) {problem}",
                self.role_label(entry)
            )));
        }
        self.pools.truncate(1);
        self.pools.extend_from_slice(pools);
        for ((entry, &pool), &window) in self.entries.iter_mut().zip(members).zip(windows) {
            if entry.is_page() {
                entry.kind = EntryKind::Page { pool, window };
            }
        }
        self.check_windows_fit()?;
        Ok(self)
    }

    /// The page pools its page entries index, the request's pages first.
    pub fn pools(&self) -> &[Pool] {
        &self.pools
    }

    /// The pool `id` (`None`: this layout keeps no such pool).
    pub fn pool(&self, id: PoolId) -> Option<&Pool> {
        self.pools.iter().find(|p| p.id == id)
    }

    /// Tokens per page of the window entries' own pool, when they have one
    /// ([`Layout::with_window_pool`]).
    pub fn window_page_size(&self) -> Option<u64> {
        self.window_pool().map(|p| p.page_size)
    }

    /// The pool its window entries keep of their own ([`Layout::with_window_pool`]), if any.
    pub fn window_pool(&self) -> Option<&Pool> {
        self.entries
            .iter()
            .find(|e| e.window().is_some() && e.pool() != Some(PoolId::PAGES))
            .and_then(Entry::pool)
            .and_then(|id| self.pool(id))
    }

    /// Whether some page entry is in a pool other than the request's pages.
    pub fn has_further_pools(&self) -> bool {
        self.entries
            .iter()
            .any(|e| e.pool().is_some_and(|p| p != PoolId::PAGES))
    }

    /// Rows one page of entry `i` holds: its pool's [`Pool::rows_per_page`] (the layout's
    /// page size for an entry of the request's pages).
    pub fn entry_rows_per_page(&self, i: usize) -> u64 {
        self.entries[i]
            .pool()
            .and_then(|id| self.pool(id))
            .map_or(self.context.page_size, Pool::rows_per_page)
    }

    /// Whether entry `i` is indexed by a request's window pages (a window entry of a layout
    /// with a window pool).
    pub fn in_window_pool(&self, i: usize) -> bool {
        self.entries[i].window().is_some() && self.entries[i].pool() != Some(PoolId::PAGES)
    }

    /// Tokens one page of entry `i` holds: its pool's page size (the window pool's for an
    /// entry in it, else the layout's).
    pub fn entry_page_size(&self, i: usize) -> u64 {
        self.entries[i]
            .pool()
            .and_then(|id| self.pool(id))
            .map_or(self.context.page_size, |p| p.page_size)
    }
}
