//! Building a layout: the checks of `Layout::new`, whole entries, and appended entries.

use crate::error::{PlanError, Result};
use crate::peer::entry::{Entry, EntryKind, Indexing, Pool, PoolId};
use crate::peer::kv_format::Representation;

use super::context::{check_attention, check_dcp_context};
use super::{Layout, LayoutContext, LayoutParts, check_len, invalid, parts_of};

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

    /// A layout of whole entries, each carrying its stride, window or ring, TP channel split
    /// and representation, with its window entries in a pool of `window_page_size` tokens per page
    /// when given: every rule of [`Layout::new`] and of the `with_*` setters holds of it.
    ///
    /// # Errors
    /// As [`Layout::new`], [`Layout::with_strides`], [`Layout::with_windows_in_pool`],
    /// [`Layout::with_rings`], [`Layout::with_representations`] and
    /// [`Layout::with_state_channels`]; [`PlanError::InvalidLayout`]
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
        let channels: Vec<_> = entries.iter().map(Entry::channels).collect();
        let channels = if channels.iter().any(Option::is_some) {
            channels
        } else {
            Vec::new()
        };
        let strides = entries.iter().map(|e| e.stride).collect();
        Self::new(parts_of(&entries), context)?
            .with_strides(strides)?
            .with_windows_in_pool(windows, window_page_size)?
            .with_rings(rings)?
            .with_representations(formats)?
            .with_state_channels(channels)
    }

    pub(super) fn appended(&self, extra: LayoutParts) -> Result<Self> {
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
