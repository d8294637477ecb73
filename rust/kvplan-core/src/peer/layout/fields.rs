//! Per-entry fields set on a layout: strides, sliding windows, rings and KV representations.

#[cfg(doc)]
use crate::error::PlanError;
use crate::error::Result;
use crate::peer::entry::{Entry, EntryKind, Indexing, PoolId, StateChannels};
use crate::peer::kv_format::{MX_BLOCK, Representation, ScaleLayout, scale_role};

use super::{Layout, check_len, invalid, is_mha_role, is_sidecar_role};

impl Layout {
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
    pub(super) fn check_windows_fit(&self) -> Result<()> {
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
            if let EntryKind::State { channels, .. } = entry.kind {
                if ring.is_some() && channels.is_some() {
                    return Err(invalid(format!(
                        "a state entry ({}) keeps a ring of rows or a TP channel split, not both",
                        entry.role
                    )));
                }
                entry.kind = EntryKind::State { ring, channels };
            }
        }
        Ok(self)
    }

    /// The same layout with a TP channel split on state entries: one per entry (`None` for an
    /// entry without one; every page entry). An empty list sets none.
    ///
    /// Rules, checked here against this layout's TP size `tp`: a split is set on a state entry
    /// that is not a ring; a sharded split (channels > 0) divides the item into `outer_rows`
    /// rows of `channels` channels of whole bytes; its shard groups, when given, sum to
    /// `channels × tp` and each divides by `tp`.
    ///
    /// # Errors
    /// [`PlanError::InvalidLayout`] naming the entry and the values.
    pub fn with_state_channels(mut self, splits: Vec<Option<StateChannels>>) -> Result<Self> {
        if splits.is_empty() {
            return Ok(self);
        }
        check_len("state channel splits", splits.len(), self.n_entries())?;
        let tp = u64::from(self.context().tp_size.max(1));
        for (i, split) in splits.iter().enumerate() {
            let Some(split) = split else { continue };
            let entry = &self.entries[i];
            let label = || format!("entry {i} ({})", self.role_label(i));
            let problem = if entry.indexing() != Indexing::State {
                Some(
                    "a TP channel split applies to state entries; a page entry is split by \
                      its attention geometry"
                        .to_owned(),
                )
            } else if entry.ring().is_some() {
                Some("a state entry keeps a ring of rows or a TP channel split, not both".into())
            } else if split.replicated() {
                None
            } else if !entry
                .item_len
                .is_multiple_of(split.channels.saturating_mul(split.outer_rows))
            {
                Some(format!(
                    "item length {} bytes is not {} rows of {} channels of whole bytes",
                    entry.item_len, split.outer_rows, split.channels
                ))
            } else {
                let groups = split.groups();
                let sum = groups.iter().try_fold(0u64, |a, &g| a.checked_add(g));
                if groups.is_empty() {
                    None
                } else if sum != split.channels.checked_mul(tp) {
                    Some(format!(
                        "shard groups {groups:?} sum to {} channels, but {} channels per rank at \
                         TP size {tp} make {} channels",
                        sum.map_or_else(|| "more than u64".into(), |s| s.to_string()),
                        split.channels,
                        u128::from(split.channels) * u128::from(tp)
                    ))
                } else {
                    groups.iter().find(|g| !g.is_multiple_of(tp)).map(|g| {
                        format!(
                            "shard group of {g} channels (of {groups:?}) does not divide over TP \
                             size {tp}"
                        )
                    })
                }
            };
            if let Some(problem) = problem {
                return Err(invalid(format!("{}: {problem}", label())));
            }
        }
        for (entry, split) in self.entries.iter_mut().zip(splits) {
            if let EntryKind::State { ring, .. } = entry.kind {
                entry.kind = EntryKind::State {
                    ring,
                    channels: split,
                };
            }
        }
        Ok(self)
    }

    /// Each entry's TP channel split (`None`: none).
    pub fn state_channels(&self) -> Vec<Option<StateChannels>> {
        self.entries.iter().map(Entry::channels).collect()
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
    pub(super) fn check_representation(&self, entry: usize, repr: Representation) -> Result<()> {
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
}
