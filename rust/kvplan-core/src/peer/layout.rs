//! A peer's registered transfer entries (its layout) and constructors for the pool shapes
//! serving engines use: MLA, MHA (K block then V block), hybrid-linear, NPU buffer groups,
//! draft entries and per-request state entries.

use std::collections::HashMap;

use crate::error::{PlanError, Result};
use crate::peer::entry::{Entry, EntryKind, Indexing, POOLS, Pool, PoolId};
use crate::peer::kv_format::{MX_BLOCK, Representation, ScaleLayout, scale_role};

/// Roles of the separate K and V entries of an MHA layout ([`Layout::mha`]): K/V heads are
/// sharded between TP ranks (an MLA latent, role `kv`, and NPU buffer groups are not).
pub const MHA_ROLES: [&str; 2] = [K_ROLE, V_ROLE];

/// How the tokens and heads of one page are laid out inside a KV item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryOrder {
    /// `[tokens][heads][head_dim]`: one token's heads are contiguous (vLLM's and SGLang's
    /// default).
    Nhd,
    /// `[heads][tokens][head_dim]`: one head's tokens are contiguous.
    Hnd,
}

impl MemoryOrder {
    /// `"NHD"` or `"HND"`, as Python and the wire spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryOrder::Nhd => "NHD",
            MemoryOrder::Hnd => "HND",
        }
    }

    /// Parses [`MemoryOrder::as_str`] output (case-insensitive).
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] for any other string.
    pub fn parse(name: &str) -> Result<Self> {
        match name.to_ascii_uppercase().as_str() {
            "NHD" => Ok(MemoryOrder::Nhd),
            "HND" => Ok(MemoryOrder::Hnd),
            _ => Err(PlanError::InvalidLayout {
                what: format!("unknown memory order {name:?}; expected \"NHD\" or \"HND\""),
            }),
        }
    }
}

/// KV heads one rank holds when a model's `total_kv_heads` are split over `tp_size` ranks:
/// `max(1, total_kv_heads / tp_size)` (heads divided over the ranks, one head replicated over
/// several ranks when there are fewer heads than ranks). The one place of the rule: layouts
/// default to it, [`TpSplit`](crate::TpSplit) splits by it, and Python reads it through the
/// bindings. A TP size of 0 (unset) counts as 1.
pub fn heads_per_rank_at(total_kv_heads: u32, tp_size: u32) -> u32 {
    (total_kv_heads / tp_size.max(1)).max(1)
}

/// The attention geometry of a peer's KV items: what a receiver must know to slice heads when
/// the two sides use different tensor-parallel sizes (tokens per page is the context's
/// `page_size`). For MLA the latent is one "head" of `head_dim` elements, replicated on every
/// TP rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttentionGeometry {
    /// KV heads of the whole model (all TP ranks together).
    pub total_kv_heads: u32,
    /// KV heads this rank holds: `max(1, total_kv_heads / tp_size)` in the usual split.
    pub heads_per_rank: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element (2 for bf16, 1 for fp8…).
    pub dtype_size: u32,
    /// Token-major (`NHD`) or head-major (`HND`) items.
    pub memory_order: MemoryOrder,
}

impl AttentionGeometry {
    /// The geometry of one rank of a model with `total_kv_heads` heads over `tp_size` ranks,
    /// with the usual defaults: heads divided over the ranks and replicated when fewer
    /// (`max(1, total_kv_heads / tp_size)`), token-major items.
    pub fn for_rank(
        total_kv_heads: u32,
        head_dim: u32,
        dtype_size: u32,
        tp_size: u32,
        heads_per_rank: Option<u32>,
        memory_order: Option<MemoryOrder>,
    ) -> Self {
        Self {
            total_kv_heads,
            heads_per_rank: heads_per_rank.unwrap_or(heads_per_rank_at(total_kv_heads, tp_size)),
            head_dim,
            dtype_size,
            memory_order: memory_order.unwrap_or(MemoryOrder::Nhd),
        }
    }

    /// Bytes of one head of one token: `head_dim * dtype_size`.
    pub fn head_bytes(&self) -> u64 {
        u64::from(self.head_dim) * u64::from(self.dtype_size)
    }

    /// Bytes of one token of this rank's heads: `heads_per_rank * head_dim * dtype_size`.
    pub(crate) fn token_bytes(&self) -> u64 {
        u64::from(self.heads_per_rank) * self.head_bytes()
    }
}

/// Everything about a peer that is not per entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutContext {
    /// Tokens per page.
    pub page_size: u64,
    /// `cpu`, `cuda` or `npu`.
    pub device: String,
    /// Layers of the whole model (not just this PP stage), when known.
    pub num_model_layers: Option<u64>,
    /// Pipeline-parallel rank of this peer.
    pub pp_rank: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Tensor-parallel rank of this peer.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Heads, head size and memory order of the KV items, when the peer publishes them.
    pub attention: Option<AttentionGeometry>,
    /// Decode context parallelism: how the request's tokens are dealt over this peer's
    /// context-parallel ranks (module `dcp`; size 1 = not dealt).
    pub dcp: DcpContext,
}

impl Default for LayoutContext {
    fn default() -> Self {
        Self {
            page_size: 1,
            device: "cpu".into(),
            num_model_layers: None,
            pp_rank: 0,
            pp_size: 1,
            tp_rank: 0,
            tp_size: 1,
            attention: None,
            dcp: DcpContext::default(),
        }
    }
}

/// The raw parallel lists a layout is built from (SGLang's `KVArgs` registration lists plus
/// roles and kinds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayoutParts {
    /// Base address of each buffer.
    pub data_ptrs: Vec<u64>,
    /// Bytes of each buffer.
    pub data_lens: Vec<u64>,
    /// Bytes of one page or slot of each buffer (the stride between consecutive indices).
    pub item_lens: Vec<u64>,
    /// Global layer id per entry (`None` = not published for that entry).
    pub layer_ids: Vec<Option<i64>>,
    /// Role per entry (`""` = not published).
    pub roles: Vec<String>,
    /// Kind per entry.
    pub kinds: Vec<Indexing>,
    /// Whether each entry belongs to the draft model (speculative decoding). Empty: derived
    /// from the roles, a role starting with `draft` marking a draft entry (the names
    /// [`Layout::with_draft`] gives).
    pub drafts: Vec<bool>,
}

/// Role of the K entries of an MHA layout.
pub(crate) const K_ROLE: &str = "k";
/// Role of the V entries of an MHA layout.
pub(crate) const V_ROLE: &str = "v";

/// Whether `role` names an entry that belongs to its layer's KV entry rather than standing
/// alone: a sparse-attention indexer cache (`indexer`) or quantization scales (a role ending in
/// `scale` or `scales`, such as `k_scale`). Such an entry is only transferred with its partner.
pub fn is_sidecar_role(role: &str) -> bool {
    role == "indexer" || role.ends_with("scale") || role.ends_with("scales")
}

/// Whether `role` names the K or V half of a layer (an MHA layout).
pub(crate) fn is_mha_role(role: &str) -> bool {
    role == K_ROLE || role == V_ROLE
}

/// The error for a list of `len` values where `expected` are needed.
fn check_len(field: &'static str, len: usize, expected: usize) -> Result<()> {
    if len == expected {
        Ok(())
    } else {
        Err(PlanError::ListLength {
            field,
            len,
            expected,
        })
    }
}

/// A validated, immutable list of one peer's transfer entries plus its context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// One value per entry, in registration order.
    entries: Vec<Entry>,
    /// The page pools its page entries index: the request's pages first (at the context's page
    /// size), then a window pool when its window entries keep one.
    pools: Vec<Pool>,
    context: LayoutContext,
}

impl Layout {
    /// Validates `parts` and builds a layout.
    ///
    /// Empty `layer_ids`, `roles` or `kinds` mean "none published" / "all pages". Within each
    /// entry kind, ids and roles are all-or-none, so that pairing can tell whether a peer
    /// publishes them.
    ///
    /// # Errors
    /// [`PlanError::ListLength`], [`PlanError::BufferOverflow`] or [`PlanError::InvalidLayout`].
    pub fn new(mut parts: LayoutParts, context: LayoutContext) -> Result<Self> {
        let n = parts.data_ptrs.len();
        if parts.layer_ids.is_empty() {
            parts.layer_ids = vec![None; n];
        }
        if parts.roles.is_empty() {
            parts.roles = vec![String::new(); n];
        }
        if parts.kinds.is_empty() {
            parts.kinds = vec![Indexing::Page; n];
        }
        if parts.drafts.is_empty() {
            parts.drafts = parts.roles.iter().map(|r| r.starts_with("draft")).collect();
        }
        for (field, len) in [
            ("data_lens", parts.data_lens.len()),
            ("item_lens", parts.item_lens.len()),
            ("layer_ids", parts.layer_ids.len()),
            ("roles", parts.roles.len()),
            ("kinds", parts.kinds.len()),
            ("drafts", parts.drafts.len()),
        ] {
            check_len(field, len, n)?;
        }
        for (entry, (&base, &len)) in parts.data_ptrs.iter().zip(&parts.data_lens).enumerate() {
            if base.checked_add(len).is_none() {
                return Err(PlanError::BufferOverflow { entry, base, len });
            }
        }
        if context.page_size == 0 {
            return Err(invalid("page_size must be at least 1".into()));
        }
        if context.pp_size == 0 || context.pp_rank >= context.pp_size {
            return Err(invalid(format!(
                "pp_rank {} must be below pp_size {}",
                context.pp_rank, context.pp_size
            )));
        }
        if context.tp_size == 0 || context.tp_rank >= context.tp_size {
            return Err(invalid(format!(
                "tp_rank {} must be below tp_size {}",
                context.tp_rank, context.tp_size
            )));
        }
        if let Some(geometry) = &context.attention {
            check_attention(geometry)?;
        }
        check_dcp_context(&context, &parts)?;
        for kind in [Indexing::Page, Indexing::State] {
            let of_kind: Vec<usize> = (0..n).filter(|&i| parts.kinds[i] == kind).collect();
            let with_ids = of_kind
                .iter()
                .filter(|&&i| parts.layer_ids[i].is_some())
                .count();
            let with_roles = of_kind
                .iter()
                .filter(|&&i| !parts.roles[i].is_empty())
                .count();
            let total = of_kind.len();
            if with_ids != 0 && with_ids != total {
                return Err(invalid(format!(
                    "{with_ids} of {total} {} entries have a layer id; publish ids for all of them or none",
                    kind.as_str()
                )));
            }
            if with_roles != 0 && with_roles != total {
                return Err(invalid(format!(
                    "{with_roles} of {total} {} entries have a role; publish roles for all of them or none",
                    kind.as_str()
                )));
            }
        }
        let LayoutParts {
            data_ptrs,
            data_lens,
            item_lens,
            layer_ids,
            roles,
            kinds,
            drafts,
        } = parts;
        let entries = data_ptrs
            .into_iter()
            .zip(data_lens)
            .zip(item_lens)
            .zip(layer_ids)
            .zip(roles)
            .zip(kinds)
            .zip(drafts)
            .map(
                |((((((ptr, len), item_len), layer), role), kind), draft)| Entry {
                    buffer: (ptr, len),
                    item_len,
                    stride: item_len,
                    layer,
                    role,
                    draft,
                    format: None,
                    kind: EntryKind::of(kind),
                },
            )
            .collect();
        let pools = vec![Pool {
            id: PoolId::PAGES,
            page_size: context.page_size,
            tokens_per_row: 1,
        }];
        Ok(Self {
            entries,
            pools,
            context,
        })
    }

    /// A layout of whole entries, each carrying its stride, window or ring, and
    /// representation, with its window entries in a pool of `window_page_size` tokens per page
    /// when given: every rule of [`Layout::new`] and of the `with_*` setters holds of it.
    ///
    /// # Errors
    /// As [`Layout::new`], [`Layout::with_strides`], [`Layout::with_windows_in_pool`],
    /// [`Layout::with_rings`] and [`Layout::with_representations`]; [`PlanError::InvalidLayout`]
    /// for an entry in the window pool of a layout without one, or a window entry outside the
    /// window pool of a layout with one.
    pub fn from_entries(
        entries: Vec<Entry>,
        context: LayoutContext,
        window_page_size: Option<u64>,
    ) -> Result<Self> {
        for (i, entry) in entries.iter().enumerate() {
            let in_pool = entry.pool().is_some_and(|p| p != PoolId::PAGES);
            let problem = match window_page_size {
                _ if in_pool && entry.window().is_none() => {
                    "is in a further pool; entries build the window pool only (add further \
                     pools with Layout::with_pool)"
                }
                None if in_pool => "is in the window pool, but the layout keeps none",
                Some(_) if !in_pool && entry.window().is_some() => {
                    "has a window but is not in the window pool; a layout with a window pool \
                     keeps every window entry in it"
                }
                _ => continue,
            };
            return Err(invalid(format!("entry {i} ({}) {problem}", entry.role)));
        }
        let listed = |values: Vec<Option<u64>>| {
            if values.iter().any(Option::is_some) {
                values
            } else {
                Vec::new()
            }
        };
        let windows = listed(entries.iter().map(Entry::window).collect());
        let rings = listed(entries.iter().map(Entry::ring).collect());
        let formats: Vec<Option<Representation>> = entries.iter().map(|e| e.format).collect();
        let formats = if formats.iter().any(Option::is_some) {
            formats
        } else {
            Vec::new()
        };
        let strides = entries.iter().map(|e| e.stride).collect();
        Self::new(parts_of(&entries), context)?
            .with_strides(strides)?
            .with_windows_in_pool(windows, window_page_size)?
            .with_rings(rings)?
            .with_representations(formats)
    }

    /// The same layout with explicit strides: item `i` of entry `e` is the `item_len` bytes at
    /// `data_ptr + i * stride`. An empty list keeps the default (`stride = item_len`).
    ///
    /// # Errors
    /// [`PlanError::ListLength`] for a list of the wrong length, [`PlanError::InvalidLayout`]
    /// for a stride smaller than its entry's item length.
    pub fn with_strides(mut self, strides: Vec<u64>) -> Result<Self> {
        if strides.is_empty() {
            return Ok(self);
        }
        check_len("strides", strides.len(), self.n_entries())?;
        for (entry, (&stride, e)) in strides.iter().zip(&self.entries).enumerate() {
            let item_len = e.item_len;
            if stride < item_len {
                return Err(invalid(format!(
                    "entry {entry} ({}): stride {stride} is smaller than its item_len {item_len}; consecutive items would overlap",
                    self.role_label(entry)
                )));
            }
        }
        for (entry, stride) in self.entries.iter_mut().zip(strides) {
            entry.stride = stride;
        }
        Ok(self)
    }

    /// The same layout with strides for the entries after the first `before` (the ones an
    /// `append` added); the earlier entries keep theirs. An empty list keeps the defaults.
    ///
    /// # Errors
    /// As [`Layout::with_strides`], the list counted against the appended entries.
    pub fn with_tail_strides(self, before: usize, tail: Vec<u64>) -> Result<Self> {
        if tail.is_empty() {
            return Ok(self);
        }
        let appended = self.n_entries().saturating_sub(before);
        check_len("strides", tail.len(), appended)?;
        let mut all: Vec<u64> = self.entries[..before.min(self.n_entries())]
            .iter()
            .map(|e| e.stride)
            .collect();
        all.extend(tail);
        self.with_strides(all)
    }

    /// Bytes between consecutive items of each entry (equal to `item_len` unless set).
    pub fn strides(&self) -> Vec<u64> {
        self.entries.iter().map(|e| e.stride).collect()
    }

    /// The same layout with sliding-window entries: entry `e` with `Some(w)` holds only the
    /// last `w` tokens of a request live (a sliding-window attention layer), so a transfer moves
    /// only those (and, for a delta request, only those the decode lacks). Its pages are the
    /// request's pages (the same index space as the full-attention entries); the pages before
    /// the window are not read. An empty list keeps every entry full.
    ///
    /// # Errors
    /// [`PlanError::ListLength`] for a list of the wrong length, [`PlanError::InvalidLayout`]
    /// for a window of 0 tokens, a window on a state entry, or a window wider than the tokens
    /// its entry's buffer holds.
    pub fn with_windows(self, windows: Vec<Option<u64>>) -> Result<Self> {
        self.with_windows_in_pool(windows, None)
    }

    /// [`Layout::with_windows`], then, with `pool_page_size`, [`Layout::with_window_pool`]:
    /// each window is checked against its buffer once, at the page size its entry ends up with
    /// (a pool of small pages can hold a window its buffer could not at the layout's page size).
    ///
    /// # Errors
    /// As [`Layout::with_windows`] and [`Layout::with_window_pool`].
    pub fn with_windows_in_pool(
        mut self,
        windows: Vec<Option<u64>>,
        pool_page_size: Option<u64>,
    ) -> Result<Self> {
        let fresh = !windows.is_empty();
        if fresh {
            self.check_per_entry(
                "windows",
                &windows,
                Indexing::Page,
                "a sliding window must hold at least 1 token, got 0",
                "a sliding window applies to page entries; a state entry holds one slot per \
                 request, sent whole",
            )?;
            // A window entry of a layout that keeps a window pool is in that pool.
            let window_pool = self.window_page_size().is_some();
            for (entry, window) in self.entries.iter_mut().zip(windows) {
                if let EntryKind::Page { .. } = entry.kind {
                    let pool = match window {
                        Some(_) if window_pool => PoolId::WINDOW,
                        _ => PoolId::PAGES,
                    };
                    entry.kind = EntryKind::Page { pool, window };
                }
            }
        }
        match pool_page_size {
            Some(page_size) => self.with_window_pool(page_size),
            None if fresh => {
                self.check_windows_fit()?;
                Ok(self)
            }
            None => Ok(self),
        }
    }

    /// Every window entry's buffer holds at least one window: a window wider than the tokens
    /// its buffer can ever hold never slides (the layer is full attention over that context),
    /// and is most often a window given in other units than tokens.
    fn check_windows_fit(&self) -> Result<()> {
        // A dealt layout holds one in `size` of a request's tokens per rank.
        let dealt = u64::from(self.context.dcp.size.max(1));
        for (entry, e) in self.entries.iter().enumerate() {
            let Some(window) = e.window() else { continue };
            let (pages, page_size) = (self.capacity(entry), self.entry_page_size(entry));
            let tokens = pages.saturating_mul(page_size).saturating_mul(dealt);
            if window > tokens {
                let pool = if self.in_window_pool(entry) {
                    " of the window pool"
                } else {
                    ""
                };
                return Err(invalid(format!(
                    "entry {entry} (layer {}, role {}): a sliding window of {window} tokens is \
                     wider than the {tokens} tokens its buffer holds ({pages} pages of \
                     {page_size} tokens{pool}{}); give the window in tokens, or describe the \
                     entry without one (full attention) when the context is shorter than the \
                     window",
                    self.layer_label(entry),
                    self.role_label(entry),
                    if dealt > 1 {
                        format!(", dealt over {dealt} context-parallel ranks")
                    } else {
                        String::new()
                    },
                )));
            }
        }
        Ok(())
    }

    /// The same layout with ring-state entries: state entry `e` with `Some(r)` keeps, per
    /// request slot, a ring of `r` rows (its items): position `p` of the request is row
    /// `slot × r + p mod r` (a ring buffer of the last `r` positions, e.g. a compressor's or
    /// a speculative decoder's state). A slot request moves the live rows of each ring pair
    /// (module `rings`), relaying them between rings of different sizes. An empty list marks
    /// no ring.
    ///
    /// # Errors
    /// [`PlanError::ListLength`] for a list of the wrong length, [`PlanError::InvalidLayout`]
    /// for a ring of 0 rows or a ring on a page entry.
    pub fn with_rings(mut self, rings: Vec<Option<u64>>) -> Result<Self> {
        if rings.is_empty() {
            return Ok(self);
        }
        self.check_per_entry(
            "rings",
            &rings,
            Indexing::State,
            "a ring must hold at least 1 row per request, got 0",
            "a ring applies to state entries (one ring per request slot); a page entry is \
             indexed by the request's pages",
        )?;
        for (entry, ring) in self.entries.iter_mut().zip(rings) {
            if let EntryKind::State { .. } = entry.kind {
                entry.kind = EntryKind::State { ring };
            }
        }
        Ok(self)
    }

    /// One optional positive count per entry, set only on entries of `kind` (windows, rings):
    /// `zero` and `wrong_kind` say what is wrong with a 0 or with a count on another kind.
    fn check_per_entry(
        &self,
        field: &'static str,
        list: &[Option<u64>],
        kind: Indexing,
        zero: &str,
        wrong_kind: &str,
    ) -> Result<()> {
        check_len(field, list.len(), self.n_entries())?;
        for (entry, &value) in list.iter().enumerate() {
            let Some(count) = value else { continue };
            let problem = if count == 0 {
                zero
            } else if self.entries[entry].indexing() != kind {
                wrong_kind
            } else {
                continue;
            };
            return Err(invalid(format!(
                "entry {entry} ({}): {problem}",
                self.role_label(entry)
            )));
        }
        Ok(())
    }

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

    /// The same layout with KV representations: one per entry (`None` for an entry that
    /// publishes none, and for every scale and state entry). An empty list publishes none.
    ///
    /// Rules, checked here: a representation is set on page entries that are not sidecars
    /// ([`is_sidecar_role`]); its dtype's size equals the attention geometry's `dtype_size`
    /// (when the layout has one) and divides the entry's item length; only a quantized dtype
    /// (`fp8_e4m3`, `fp8_e5m2`, `int8`) has scales (the geometry describes the `k`/`v`
    /// entries, so its `dtype_size` is checked against theirs); per-token scales (`per_token`,
    /// `per_token_head`, `mx`) live in the entry's *scale entry*: the page entry of the same layer id
    /// and draft-ness whose role is the entry's role + `_scale` (`k` → `k_scale`, `kv` →
    /// `kv_scale`), holding per page `page_size` tokens × groups scales, token-major (groups: 1
    /// for `per_token`, the rank's KV heads for `per_token_head`, the token's elements / 32 for
    /// `mx`), so its item length is `page_size × groups × scale bytes` (4 for the float32
    /// scales of `per_token` and `per_token_head`, 1 for the E8M0 scales of `mx`:
    /// [`ScaleLayout::scale_bytes`]). `per_token_head` needs the attention geometry (its heads
    /// per rank); every per-token layout needs the entry's item length to be a whole number of
    /// tokens; `mx` is for `fp8_e4m3` only and needs a token's elements to be a multiple of
    /// [`MX_BLOCK`].
    ///
    /// # Errors
    /// [`PlanError::ListLength`] for a list of the wrong length, [`PlanError::InvalidLayout`]
    /// naming the entry and the values for any broken rule.
    pub fn with_representations(
        mut self,
        representations: Vec<Option<Representation>>,
    ) -> Result<Self> {
        if representations.is_empty() {
            for entry in &mut self.entries {
                entry.format = None;
            }
            return Ok(self);
        }
        check_len("representations", representations.len(), self.n_entries())?;
        for (entry, repr) in representations.iter().enumerate() {
            let Some(repr) = *repr else { continue };
            self.check_representation(entry, repr)?;
        }
        for (entry, format) in self.entries.iter_mut().zip(representations) {
            entry.format = format;
        }
        Ok(self)
    }

    /// One entry's representation against the rules of [`Layout::with_representations`].
    fn check_representation(&self, entry: usize, repr: Representation) -> Result<()> {
        let label = self.role_label(entry);
        let fail = |why: String| Err(invalid(format!("entry {entry} ({label}): {why}")));
        let role = self.entries[entry].role.as_str();
        if !self.entries[entry].is_page() || is_sidecar_role(role) {
            return fail(format!(
                "representation {} is set on a {} entry; representations describe KV page \
                 entries (scale entries hold scales, state entries are sent whole)",
                repr.text(),
                if is_sidecar_role(role) {
                    "sidecar"
                } else {
                    "state"
                }
            ));
        }
        let size = u64::from(repr.dtype.size());
        let item_len = self.entries[entry].item_len;
        if let Some(g) = &self.context.attention
            && is_mha_role(role)
            && g.dtype_size != repr.dtype.size()
        {
            return fail(format!(
                "dtype {} has {size} byte(s) per element but the layout's dtype_size is {}",
                repr.dtype.as_str(),
                g.dtype_size
            ));
        }
        if !item_len.is_multiple_of(size) {
            return fail(format!(
                "item_len {item_len} is not a whole number of {} elements ({size} bytes each)",
                repr.dtype.as_str()
            ));
        }
        if repr.scales != ScaleLayout::None && !repr.dtype.quantized() {
            return fail(format!(
                "{} values carry no scales, got scale layout {}",
                repr.dtype.as_str(),
                repr.scales.as_str()
            ));
        }
        if !repr.consistent() {
            return fail(format!(
                "scale layout {} is defined for fp8_e4m3 only (MXFP8), got dtype {}",
                repr.scales.as_str(),
                repr.dtype.as_str()
            ));
        }
        if !repr.scales.per_token() {
            return Ok(());
        }
        let page_size = self.context.page_size;
        if !item_len.is_multiple_of(page_size) {
            return fail(format!(
                "item_len {item_len} is not a whole number of tokens of page_size {page_size}, \
                 so it has no per-token scales"
            ));
        }
        let groups = match repr.scales {
            ScaleLayout::Mx => {
                let token_elems = item_len / page_size / size;
                if !token_elems.is_multiple_of(MX_BLOCK) {
                    return fail(format!(
                        "mx scales cover blocks of {MX_BLOCK} elements of a token, but a token \
                         holds {token_elems} elements (item_len {item_len} / page_size \
                         {page_size} / {size} byte(s)), not a multiple of {MX_BLOCK}"
                    ));
                }
                token_elems / MX_BLOCK
            }
            ScaleLayout::PerTokenHead => match &self.context.attention {
                Some(g) => u64::from(g.heads_per_rank),
                None => {
                    return fail(
                        "per_token_head scales need the attention geometry (kv_heads, \
                         head_dim, dtype_size) to know the heads per token"
                            .into(),
                    );
                }
            },
            _ => 1,
        };
        let want_role = scale_role(role);
        let Some(scale) = self.partner(entry, &want_role) else {
            return fail(format!(
                "{} scales live in a page entry of role {want_role:?} and the same layer id; \
                 the layout has none",
                repr.scales.as_str()
            ));
        };
        let scale_bytes = repr.scales.scale_bytes();
        let want = page_size * groups * scale_bytes;
        if self.entries[scale].item_len != want {
            return fail(format!(
                "its scale entry {scale} ({want_role}) has item_len {}, {} scales need \
                 page_size {page_size} × {groups} scale(s) per token × {scale_bytes} byte(s) = {want}",
                self.entries[scale].item_len,
                repr.scales.as_str()
            ));
        }
        Ok(())
    }

    /// KV representation of each entry (`None`: none published).
    pub fn representations(&self) -> Vec<Option<Representation>> {
        self.entries.iter().map(|e| e.format).collect()
    }

    /// KV representation of entry `i` (`None`: none published).
    pub fn representation(&self, i: usize) -> Option<Representation> {
        self.entries[i].format
    }

    /// Whether any entry publishes a representation.
    pub fn has_representations(&self) -> bool {
        self.entries.iter().any(|e| e.format.is_some())
    }

    /// The first page entry of entry `entry`'s layer id and draft-ness with role `role`.
    fn partner(&self, entry: usize, role: &str) -> Option<usize> {
        let of = &self.entries[entry];
        self.entries.iter().position(|e| {
            e.is_page() && e.role == role && e.layer == of.layer && e.draft == of.draft
        })
    }

    /// The scale entry of entry `entry` (see [`Layout::with_representations`]), if it has
    /// per-token scales.
    pub fn scale_entry(&self, entry: usize) -> Option<usize> {
        let repr = self.entries.get(entry)?.format?;
        if !repr.scales.per_token() {
            return None;
        }
        self.partner(entry, &scale_role(&self.entries[entry].role))
    }

    /// Rows per request slot of each ring-state entry (`None`: not a ring).
    pub fn rings(&self) -> Vec<Option<u64>> {
        self.entries.iter().map(Entry::ring).collect()
    }

    /// Sliding-window size in tokens of each entry (`None`: a full entry).
    pub fn windows(&self) -> Vec<Option<u64>> {
        self.entries.iter().map(Entry::window).collect()
    }

    /// Whether any entry is a sliding-window entry.
    pub fn has_windows(&self) -> bool {
        self.entries.iter().any(|e| e.window().is_some())
    }

    /// One allocation holding every layer of a page side by side,
    /// `[page 0: entry 0 item | entry 1 item | ...][page 1: ...]...` (a cross-layer pool).
    /// Every entry's stride is the page stride `sum(item_lens)`; entry `j` starts at
    /// `pool_ptr + item_lens[0] + ... + item_lens[j-1]`. The pool holds
    /// `pool_len / page_stride` whole pages (a partial page at the end is not used).
    /// `roles` default to `kv` for every entry; give one per entry (e.g. `k`, `v`, `k`, `v`…)
    /// for K and V entries, with the layer id repeated per entry.
    ///
    /// # Errors
    /// [`PlanError::ListLength`] for lists of different lengths, [`PlanError::Overflow`] when
    /// the page stride overflows, then as [`Layout::new`].
    pub fn cross_layer(
        pool_ptr: u64,
        pool_len: u64,
        layer_ids: Option<Vec<i64>>,
        item_lens: Vec<u64>,
        roles: Option<Vec<String>>,
        context: LayoutContext,
    ) -> Result<Self> {
        let n = item_lens.len();
        check_len("layer_ids", layer_ids.as_ref().map_or(n, Vec::len), n)?;
        check_len("roles", roles.as_ref().map_or(n, Vec::len), n)?;
        let stride = item_lens
            .iter()
            .try_fold(0u64, |acc, &l| acc.checked_add(l))
            .ok_or(PlanError::Overflow {
                what: "cross-layer page stride",
            })?;
        let pages = pool_len.checked_div(stride).unwrap_or(0);
        let used = pages * stride; // <= pool_len
        let mut offset = 0u64;
        let (mut data_ptrs, mut data_lens) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &item in &item_lens {
            data_ptrs.push(
                pool_ptr
                    .checked_add(offset)
                    .ok_or(PlanError::BufferOverflow {
                        entry: data_ptrs.len(),
                        base: pool_ptr,
                        len: offset,
                    })?,
            );
            data_lens.push(used.saturating_sub(offset));
            offset += item; // bounded by the checked sum above
        }
        let parts = LayoutParts {
            data_ptrs,
            data_lens,
            item_lens,
            layer_ids: layer_ids.map_or_else(Vec::new, |ids| ids.into_iter().map(Some).collect()),
            roles: roles.unwrap_or_else(|| vec!["kv".into(); n]),
            kinds: vec![],
            drafts: vec![],
        };
        Self::new(parts, context)?.with_strides(vec![stride; n])
    }

    /// Number of entries.
    pub fn n_entries(&self) -> usize {
        self.entries.len()
    }

    /// The entries, in registration order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Entry `i`.
    pub fn entry(&self, i: usize) -> &Entry {
        &self.entries[i]
    }

    /// The entries as the parallel lists a layout is built from (a copy: the ingestion form,
    /// for callers that hand lists on, such as Python and the wire).
    pub fn parts(&self) -> LayoutParts {
        parts_of(&self.entries)
    }

    /// The peer context.
    pub fn context(&self) -> &LayoutContext {
        &self.context
    }

    /// How many items (pages or slots) entry `i` holds: the whole items that fit in its buffer,
    /// `(data_len - item_len) / stride + 1` (`data_len / item_len` when the stride is the item
    /// length); 0 for an elided entry (`item_len == 0`) or a buffer smaller than one item.
    pub fn capacity(&self, i: usize) -> u64 {
        let entry = &self.entries[i];
        let (len, item) = (entry.buffer.1, entry.item_len);
        if item == 0 || len < item {
            return 0;
        }
        // stride >= item > 0 (checked when the strides were set).
        (len - item) / entry.stride + 1
    }

    /// The entry's layer id as text (`None` when unpublished, as Python shows it), for messages.
    pub(crate) fn layer_label(&self, i: usize) -> String {
        self.entries[i]
            .layer
            .map_or_else(|| "None".into(), |id| id.to_string())
    }

    /// The entry's role (`None` when unpublished).
    pub fn role(&self, i: usize) -> Option<&str> {
        Some(self.entries[i].role.as_str()).filter(|r| !r.is_empty())
    }

    /// The entry's role as text (`None` when unpublished, as Python shows it), for messages.
    pub(crate) fn role_label(&self, i: usize) -> String {
        self.role(i).unwrap_or("None").to_string()
    }

    /// Whether entry `i` belongs to the draft model.
    pub fn is_draft(&self, i: usize) -> bool {
        self.entries[i].draft
    }

    /// Indices of the entries of one kind, in layout order.
    pub fn entries_of_kind(&self, kind: Indexing) -> Vec<usize> {
        (0..self.n_entries())
            .filter(|&i| self.entries[i].indexing() == kind)
            .collect()
    }

    /// One `kv` entry per layer (MLA latent buffers).
    ///
    /// # Errors
    /// As [`Layout::new`].
    pub fn mla(
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: Vec<u64>,
        layer_ids: Option<Vec<i64>>,
        context: LayoutContext,
    ) -> Result<Self> {
        let n = data_ptrs.len();
        let layer_ids = layer_ids.map_or_else(Vec::new, |ids| ids.into_iter().map(Some).collect());
        let parts = LayoutParts {
            data_ptrs,
            data_lens,
            item_lens,
            layer_ids,
            roles: vec!["kv".into(); n],
            kinds: vec![],
            drafts: vec![],
        };
        Self::new(parts, context)
    }

    /// All K entries, then all V entries (roles `k` then `v`); ids are repeated K block then V
    /// block. K and V item lengths may differ.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] when K and V lists differ in length; otherwise as [`Layout::new`].
    #[allow(clippy::too_many_arguments)]
    pub fn mha(
        k_ptrs: Vec<u64>,
        v_ptrs: Vec<u64>,
        k_data_lens: Vec<u64>,
        v_data_lens: Vec<u64>,
        k_item_lens: Vec<u64>,
        v_item_lens: Vec<u64>,
        layer_ids: Option<Vec<i64>>,
        context: LayoutContext,
    ) -> Result<Self> {
        let layers = k_ptrs.len();
        if v_ptrs.len() != layers {
            return Err(invalid(format!(
                "MHA layout needs one V entry per K entry: {} K, {} V",
                layers,
                v_ptrs.len()
            )));
        }
        if let Some(ids) = &layer_ids {
            check_len("layer_ids", ids.len(), layers)?;
        }
        let concat = |a: Vec<u64>, b: Vec<u64>| a.into_iter().chain(b).collect::<Vec<_>>();
        let layer_ids = layer_ids.map_or_else(Vec::new, |ids| {
            ids.iter().chain(&ids).copied().map(Some).collect()
        });
        let roles = std::iter::repeat_n(K_ROLE, layers)
            .chain(std::iter::repeat_n(V_ROLE, layers))
            .map(String::from)
            .collect();
        let parts = LayoutParts {
            data_ptrs: concat(k_ptrs, v_ptrs),
            data_lens: concat(k_data_lens, v_data_lens),
            item_lens: concat(k_item_lens, v_item_lens),
            layer_ids,
            roles,
            kinds: vec![],
            drafts: vec![],
        };
        Self::new(parts, context)
    }

    /// Hybrid-linear pool: only full-attention layers carry KV, published under their global ids
    /// (strictly increasing). MLA: one entry per full-attention layer; MHA: K entries then V
    /// entries.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] for unsorted ids or a pointer count that does not match.
    pub fn hybrid_linear(
        full_attention_layer_ids: Vec<i64>,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: Vec<u64>,
        mla: bool,
        context: LayoutContext,
    ) -> Result<Self> {
        if full_attention_layer_ids.windows(2).any(|w| w[0] >= w[1])
            || full_attention_layer_ids.first().is_some_and(|&x| x < 0)
        {
            return Err(invalid(format!(
                "full-attention layer ids must be non-negative and strictly increasing, got {full_attention_layer_ids:?}"
            )));
        }
        let layers = full_attention_layer_ids.len();
        let per_layer = if mla { 1 } else { 2 };
        if data_ptrs.len() != layers * per_layer {
            return Err(invalid(format!(
                "hybrid-linear {} pool with {layers} full-attention layers needs {} buffers, got {}",
                if mla { "MLA" } else { "MHA" },
                layers * per_layer,
                data_ptrs.len()
            )));
        }
        if mla {
            return Self::mla(
                data_ptrs,
                data_lens,
                item_lens,
                Some(full_attention_layer_ids),
                context,
            );
        }
        let split = |mut v: Vec<u64>| {
            let tail = v.split_off(layers.min(v.len()));
            (v, tail)
        };
        let (k_ptrs, v_ptrs) = split(data_ptrs);
        let (k_lens, v_lens) = split(data_lens);
        let (k_items, v_items) = split(item_lens);
        Self::mha(
            k_ptrs,
            v_ptrs,
            k_lens,
            v_lens,
            k_items,
            v_items,
            Some(full_attention_layer_ids),
            context,
        )
    }

    /// NPU pool with G buffer groups per layer, group-major (`[g0 per layer…, g1 per layer…]`);
    /// each layer id is published once per group. A buffer count that is not a whole multiple
    /// of the layer count is an error, never a truncation (SGLang truncates with `//`).
    ///
    /// # Errors
    /// [`PlanError::GroupsNotWhole`], or [`PlanError::InvalidLayout`] for bad group roles.
    pub fn npu_groups(
        layer_ids: Vec<i64>,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: Vec<u64>,
        group_roles: Option<Vec<String>>,
        context: LayoutContext,
    ) -> Result<Self> {
        let (entries, layers) = (data_ptrs.len(), layer_ids.len());
        if layers == 0 || entries == 0 || entries % layers != 0 {
            return Err(PlanError::GroupsNotWhole { entries, layers });
        }
        let groups = entries / layers;
        let group_roles =
            group_roles.unwrap_or_else(|| (0..groups).map(|g| format!("g{g}")).collect());
        if group_roles.len() != groups || group_roles.iter().any(String::is_empty) {
            return Err(invalid(format!(
                "{groups} buffer groups need {groups} non-empty group roles, got {group_roles:?}"
            )));
        }
        let roles = group_roles
            .iter()
            .flat_map(|r| std::iter::repeat_n(r.clone(), layers))
            .collect();
        let ids = (0..groups)
            .flat_map(|_| layer_ids.iter().copied().map(Some))
            .collect();
        Self::new(
            LayoutParts {
                data_ptrs,
                data_lens,
                item_lens,
                layer_ids: ids,
                roles,
                kinds: vec![],
                drafts: vec![],
            },
            context,
        )
    }

    /// Appends draft (speculative decoding) KV entries. Raw draft layer ids are remapped into
    /// the band above the model: each distinct raw id, numbered by first appearance, becomes
    /// `num_hidden_layers + number` (SGLang 0.5.23), so K and V of one draft layer share an id.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] when this layout publishes no page ids, or on list lengths.
    pub fn with_draft(
        &self,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: Vec<u64>,
        draft_layer_ids: &[i64],
        num_hidden_layers: i64,
        roles: Option<Vec<String>>,
    ) -> Result<Self> {
        let n = data_ptrs.len();
        if draft_layer_ids.len() != n {
            return Err(invalid(format!(
                "Draft KV layer ids must cover every registered entry: ids={}, entries={n}",
                draft_layer_ids.len()
            )));
        }
        let pages = self.entries_of_kind(Indexing::Page);
        if !pages.is_empty() && self.entries[pages[0]].layer.is_none() {
            return Err(invalid("draft entries are published in the id band above the model; this layout publishes no layer ids".into()));
        }
        // Number of each distinct raw id, by first appearance: a map, not a search of the ids
        // seen so far, which made this quadratic in the number of distinct draft ids.
        let mut band: HashMap<i64, usize> = HashMap::new();
        let mut ids = Vec::with_capacity(n);
        for &raw in draft_layer_ids {
            let next = band.len();
            let number = *band.entry(raw).or_insert(next);
            let id = num_hidden_layers
                .checked_add(number as i64)
                .ok_or(PlanError::Overflow {
                    what: "draft layer id band",
                })?;
            ids.push(Some(id));
        }
        let has_roles = pages
            .first()
            .is_some_and(|&i| !self.entries[i].role.is_empty());
        if let Some(r) = &roles {
            check_len("roles", r.len(), n)?;
        }
        let draft_roles = match roles {
            Some(r) => r.into_iter().map(|x| format!("draft_{x}")).collect(),
            None if has_roles || pages.is_empty() => vec!["draft".to_string(); n],
            None => vec![String::new(); n],
        };
        self.appended(LayoutParts {
            data_ptrs,
            data_lens,
            item_lens,
            layer_ids: ids,
            roles: draft_roles,
            kinds: vec![Indexing::Page; n],
            drafts: vec![true; n],
        })
    }

    /// Appends per-request state entries (kind `state`, role = `name`), e.g. Mamba conv or
    /// temporal state with one slot per request.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] for an empty name; otherwise as [`Layout::new`].
    pub fn with_state(
        &self,
        name: &str,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: Vec<u64>,
        layer_ids: Vec<i64>,
    ) -> Result<Self> {
        if name.is_empty() {
            return Err(invalid(
                "state entries need a non-empty name (e.g. \"mamba_conv\")".into(),
            ));
        }
        let n = data_ptrs.len();
        check_len("layer_ids", layer_ids.len(), n)?;
        let extra = LayoutParts {
            data_ptrs,
            data_lens,
            item_lens,
            layer_ids: layer_ids.into_iter().map(Some).collect(),
            roles: vec![name.to_string(); n],
            kinds: vec![Indexing::State; n],
            drafts: vec![false; n],
        };
        self.appended(extra)
    }

    fn appended(&self, extra: LayoutParts) -> Result<Self> {
        let n = extra.data_ptrs.len();
        check_len("data_lens", extra.data_lens.len(), n)?;
        check_len("item_lens", extra.item_lens.len(), n)?;
        let mut parts = self.parts();
        parts.data_ptrs.extend(extra.data_ptrs);
        parts.data_lens.extend(extra.data_lens);
        parts.item_lens.extend(extra.item_lens);
        parts.layer_ids.extend(extra.layer_ids);
        parts.roles.extend(extra.roles);
        parts.kinds.extend(extra.kinds);
        parts.drafts.extend(extra.drafts);
        // Appended entries are packed (stride = item_len), full, not rings and without a
        // representation; the existing ones keep theirs, and the layout its pools.
        let mut layout = Self::new(parts, self.context.clone())?;
        for (entry, before) in layout.entries.iter_mut().zip(&self.entries) {
            entry.stride = before.stride;
            entry.format = before.format;
            entry.kind = before.kind;
        }
        layout.pools.clone_from(&self.pools);
        layout.check_windows_fit()?;
        for (entry, before) in self.entries.iter().enumerate() {
            if let Some(format) = before.format {
                layout.check_representation(entry, format)?;
            }
        }
        Ok(layout)
    }
}

/// The parallel lists of `entries` (the ingestion form).
fn parts_of(entries: &[Entry]) -> LayoutParts {
    let list = |field: fn(&Entry) -> u64| entries.iter().map(field).collect();
    LayoutParts {
        data_ptrs: list(|e| e.buffer.0),
        data_lens: list(|e| e.buffer.1),
        item_lens: list(|e| e.item_len),
        layer_ids: entries.iter().map(|e| e.layer).collect(),
        roles: entries.iter().map(|e| e.role.clone()).collect(),
        kinds: entries.iter().map(Entry::indexing).collect(),
        drafts: entries.iter().map(|e| e.draft).collect(),
    }
}

/// The attention geometry on its own: every count positive, a rank holding no more heads than
/// the model has.
fn check_attention(g: &AttentionGeometry) -> Result<()> {
    for (name, value) in [
        ("kv_heads", g.total_kv_heads),
        ("heads_per_rank", g.heads_per_rank),
        ("head_dim", g.head_dim),
        ("dtype_size", g.dtype_size),
    ] {
        if value == 0 {
            return Err(invalid(format!("{name} must be at least 1, got 0")));
        }
    }
    if g.heads_per_rank > g.total_kv_heads {
        return Err(invalid(format!(
            "heads_per_rank {} exceeds kv_heads {} (the model's KV heads)",
            g.heads_per_rank, g.total_kv_heads
        )));
    }
    Ok(())
}

fn invalid(what: String) -> PlanError {
    PlanError::InvalidLayout { what }
}

fn too_many_pools() -> PlanError {
    invalid(format!(
        "a layout keeps at most {POOLS} pools (its pages and {} further ones)",
        POOLS - 1
    ))
}

/// A peer's decode-context-parallel coordinates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DcpContext {
    /// Context-parallel ranks the request's tokens are dealt over (1: not dealt).
    pub size: u32,
    /// This peer's rank, below `size`.
    pub rank: u32,
    /// Consecutive tokens per deal, at least 1.
    pub interleave: u64,
}

impl Default for DcpContext {
    fn default() -> Self {
        Self {
            size: 1,
            rank: 0,
            interleave: 1,
        }
    }
}

impl DcpContext {
    /// Whether tokens are dealt (more than one rank).
    pub fn dealt(&self) -> bool {
        self.size > 1
    }

    /// `"rank r of N (interleave I)"`, for messages.
    pub fn describe(&self) -> String {
        format!(
            "DCP rank {} of {} (interleave {})",
            self.rank, self.size, self.interleave
        )
    }
}

/// The DCP fields of a layout context on their own, and with the entries: rank below size,
/// interleave at least 1, a page that holds whole deals or a deal that holds whole pages, and,
/// when there are draft page entries, deals that divide the page (a draft item is the virtual
/// page of `P·N` tokens, which only then is what the ranks' page `k` cover together).
pub(crate) fn check_dcp_context(context: &LayoutContext, parts: &LayoutParts) -> Result<()> {
    let d = context.dcp;
    let invalid = |what: String| PlanError::InvalidLayout { what };
    if d.size == 0 {
        return Err(invalid(
            "dcp_size must be at least 1 (the decode context-parallel ranks that share a \
             request's tokens), got 0"
                .into(),
        ));
    }
    if d.rank >= d.size {
        return Err(invalid(format!(
            "dcp_rank {} must be below dcp_size {}",
            d.rank, d.size
        )));
    }
    if d.interleave == 0 {
        return Err(invalid(
            "dcp_interleave must be at least 1 (tokens per deal)".into(),
        ));
    }
    if !d.dealt() {
        return Ok(());
    }
    let page = context.page_size;
    if !page.is_multiple_of(d.interleave) && !d.interleave.is_multiple_of(page) {
        return Err(invalid(format!(
            "dcp_interleave {} and page_size {page}: one must divide the other (a page holds \
             whole deals, or a deal whole pages)",
            d.interleave
        )));
    }
    u64::from(d.size)
        .checked_mul(page)
        .and_then(|v| v.checked_mul(d.interleave))
        .ok_or(PlanError::Overflow {
            what: "DCP virtual page",
        })?;
    let draft =
        (0..parts.data_ptrs.len()).find(|&i| parts.drafts[i] && parts.kinds[i] == Indexing::Page);
    if let Some(entry) = draft
        && !page.is_multiple_of(d.interleave)
    {
        return Err(invalid(format!(
            "entry {entry} is a draft entry, which DCP does not deal: its item holds the virtual \
             page of page_size x dcp_size tokens, which needs dcp_interleave {} to divide \
             page_size {page}",
            d.interleave
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> LayoutContext {
        LayoutContext::default()
    }

    /// Two MLA entries at page size 1; entry 1's buffer holds 4 items.
    fn two_layers() -> Layout {
        Layout::mla(
            vec![1 << 30, 1 << 31],
            vec![32, 64],
            vec![8, 16],
            Some(vec![0, 1]),
            LayoutContext {
                page_size: 1,
                ..ctx()
            },
        )
        .unwrap()
    }

    #[test]
    fn a_window_is_checked_at_its_pools_page_size() {
        // 4 pool pages of 2 tokens hold a 5-token window, though 4 pages of the layout's 1 token
        // do not: the check runs once, at the page size the entry ends up with.
        let windows = vec![None, Some(5)];
        let pooled = two_layers()
            .with_windows_in_pool(windows.clone(), Some(2))
            .unwrap();
        assert_eq!(pooled.window_page_size(), Some(2));
        assert_eq!(pooled.entry_page_size(1), 2);
        // A layout with entries appended keeps the pool.
        let appended = pooled
            .with_state("mamba", vec![1 << 40], vec![64], vec![64], vec![9])
            .unwrap();
        assert_eq!(appended.window_page_size(), Some(2));
        // Without the pool, or with one too narrow, the window is refused.
        for pool in [None, Some(1)] {
            let err = two_layers()
                .with_windows_in_pool(windows.clone(), pool)
                .unwrap_err();
            assert!(
                err.to_string()
                    .contains("a sliding window of 5 tokens is wider than the 4 tokens"),
                "{err}"
            );
        }
        // The pool's own rules still come first for a pool of page size 0.
        let err = two_layers()
            .with_windows_in_pool(windows, Some(0))
            .unwrap_err();
        assert!(
            err.to_string().contains("page_size must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn mha_orders_k_then_v() {
        let l = Layout::mha(
            vec![1, 2],
            vec![3, 4],
            vec![10; 2],
            vec![20; 2],
            vec![5; 2],
            vec![10; 2],
            Some(vec![3, 7]),
            ctx(),
        )
        .unwrap();
        assert_eq!(l.parts().data_ptrs, vec![1, 2, 3, 4]);
        assert_eq!(
            l.parts().layer_ids,
            vec![Some(3), Some(7), Some(3), Some(7)]
        );
        assert_eq!(l.parts().roles, vec!["k", "k", "v", "v"]);
        assert_eq!(l.capacity(3), 2);
    }

    #[test]
    fn npu_groups_refuse_truncation() {
        let l = Layout::npu_groups(
            vec![3, 7],
            vec![1, 2, 3, 4, 5, 6],
            vec![8; 6],
            vec![4; 6],
            None,
            ctx(),
        )
        .unwrap();
        assert_eq!(
            l.parts()
                .layer_ids
                .iter()
                .map(|x| x.unwrap())
                .collect::<Vec<_>>(),
            vec![3, 7, 3, 7, 3, 7]
        );
        assert_eq!(
            Layout::npu_groups(
                vec![3, 7],
                vec![1, 2, 3, 4, 5],
                vec![8; 5],
                vec![4; 5],
                None,
                ctx()
            ),
            Err(PlanError::GroupsNotWhole {
                entries: 5,
                layers: 2
            })
        );
    }

    #[test]
    fn draft_band_remap() {
        let base = Layout::mla(vec![1], vec![8], vec![8], Some(vec![0]), ctx()).unwrap();
        let l = base
            .with_draft(
                vec![2; 6],
                vec![8; 6],
                vec![8; 6],
                &[0, 1, 2, 0, 1, 2],
                48,
                None,
            )
            .unwrap();
        let ids: Vec<i64> = l.parts().layer_ids[1..]
            .iter()
            .map(|x| x.unwrap())
            .collect();
        assert_eq!(ids, vec![48, 49, 50, 48, 49, 50]);
        let l = base
            .with_draft(vec![2; 4], vec![8; 4], vec![8; 4], &[5, 2, 5, 2], 48, None)
            .unwrap();
        let ids: Vec<i64> = l.parts().layer_ids[1..]
            .iter()
            .map(|x| x.unwrap())
            .collect();
        assert_eq!(ids, vec![48, 49, 48, 49]);
    }

    #[test]
    fn draft_band_of_many_distinct_ids_completes() {
        // A quarter of a million distinct draft ids: a search of the ids seen so far per id
        // (the old numbering) is ~3e10 comparisons, hours in a debug build; a map is instant.
        let n = 1 << 18;
        let base = Layout::mla(vec![1], vec![8], vec![8], Some(vec![0]), ctx()).unwrap();
        let raw: Vec<i64> = (0..n as i64).rev().collect();
        let l = base
            .with_draft(vec![2; n], vec![8; n], vec![8; n], &raw, 10, None)
            .unwrap();
        assert_eq!(l.parts().layer_ids[1], Some(10));
        assert_eq!(l.parts().layer_ids[n], Some(10 + n as i64 - 1));
    }

    #[test]
    fn list_lengths_and_overflow_are_checked() {
        let parts = LayoutParts {
            data_ptrs: vec![1, 2],
            data_lens: vec![1],
            item_lens: vec![1, 1],
            ..Default::default()
        };
        assert_eq!(
            Layout::new(parts, ctx()),
            Err(PlanError::ListLength {
                field: "data_lens",
                len: 1,
                expected: 2
            })
        );
        let parts = LayoutParts {
            data_ptrs: vec![u64::MAX],
            data_lens: vec![2],
            item_lens: vec![1],
            ..Default::default()
        };
        assert!(matches!(
            Layout::new(parts, ctx()),
            Err(PlanError::BufferOverflow { .. })
        ));
    }
}
