//! Constructors for the shapes engines register: MLA, MHA, hybrid-linear, NPU, draft, state.

use std::collections::HashMap;

use crate::error::{PlanError, Result};
use crate::peer::entry::Indexing;

use super::{K_ROLE, Layout, LayoutContext, LayoutParts, V_ROLE, check_len, invalid};

impl Layout {
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
}
