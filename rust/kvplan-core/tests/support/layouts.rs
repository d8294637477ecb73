//! Layout builders for the shapes the tests plan between: MLA latent entries or MHA K and V
//! entries per layer (with attention geometry, TP, PP and DCP context), cross-layer pools, and
//! bare strided entries. Each builder spells out where every buffer sits, so a test states its
//! addresses, sizes and strides in one line and two tests building the same shape build it the
//! same way.

use kvplan_core::{AttentionGeometry, DcpContext, Layout, LayoutContext, LayoutParts, MemoryOrder};

/// Bytes of one head of one token in most tests: `head_dim` 2 × 2-byte elements. Small heads
/// keep byte-level references cheap; nothing in the planner depends on their size.
pub const HEAD_BYTES: u64 = 4;

/// A context of `page_size` tokens per page, everything else default (TP 1, PP 1, DCP 1, no
/// geometry).
pub fn paged(page_size: u64) -> LayoutContext {
    LayoutContext {
        page_size,
        ..LayoutContext::default()
    }
}

/// Chained setters for the context fields tests vary, so a context reads as one expression.
pub trait ContextBuilder {
    /// Tensor-parallel rank `rank` of `size`.
    fn tp(self, rank: u32, size: u32) -> Self;
    /// Pipeline-parallel stage `rank` of `size`.
    fn pp(self, rank: u32, size: u32) -> Self;
    /// Layers of the whole model (not just this stage).
    fn model_layers(self, layers: u64) -> Self;
    /// Published attention geometry (or none).
    fn attention(self, geometry: impl Into<Option<AttentionGeometry>>) -> Self;
    /// How the request's tokens are dealt over this peer's context-parallel ranks.
    fn dcp(self, dcp: DcpContext) -> Self;
}

impl ContextBuilder for LayoutContext {
    fn tp(self, rank: u32, size: u32) -> Self {
        Self {
            tp_rank: rank,
            tp_size: size,
            ..self
        }
    }

    fn pp(self, rank: u32, size: u32) -> Self {
        Self {
            pp_rank: rank,
            pp_size: size,
            ..self
        }
    }

    fn model_layers(self, layers: u64) -> Self {
        Self {
            num_model_layers: Some(layers),
            ..self
        }
    }

    fn attention(self, geometry: impl Into<Option<AttentionGeometry>>) -> Self {
        Self {
            attention: geometry.into(),
            ..self
        }
    }

    fn dcp(self, dcp: DcpContext) -> Self {
        Self { dcp, ..self }
    }
}

/// Decode-context-parallel rank `rank` of `size`, dealt `interleave` tokens at a time.
pub fn dcp(size: u32, rank: u32, interleave: u64) -> DcpContext {
    DcpContext {
        size,
        rank,
        interleave,
    }
}

/// Geometry of `heads_per_rank` of `total_kv_heads` heads of [`HEAD_BYTES`] each.
pub fn heads(
    total_kv_heads: u32,
    heads_per_rank: u32,
    memory_order: MemoryOrder,
) -> AttentionGeometry {
    AttentionGeometry {
        total_kv_heads,
        heads_per_rank,
        head_dim: 2,
        dtype_size: 2,
        memory_order,
    }
}

/// Heads one rank of TP `tp` holds under the usual split: `total / tp`, and every rank holds
/// one (replicated) when there are fewer heads than ranks. Written out here rather than taken
/// from the core, so the layouts do not follow a change to the rule under test.
pub fn heads_per_rank(total_kv_heads: u32, tp: u32) -> u32 {
    (total_kv_heads / tp).max(1)
}

/// Geometry of one rank of TP `tp` under the usual split ([`heads_per_rank`]).
pub fn tp_heads(total_kv_heads: u32, tp: u32, memory_order: MemoryOrder) -> AttentionGeometry {
    heads(
        total_kv_heads,
        heads_per_rank(total_kv_heads, tp),
        memory_order,
    )
}

/// Page entries of one peer, one buffer per entry: MLA (one `kv` latent entry per layer) or
/// MHA (every layer's K entry, then every layer's V entry). Entry `e`'s buffer starts at
/// `base + e × spacing` (back to back unless [`KvLayout::spaced`] says otherwise); the V block
/// may start elsewhere ([`KvLayout::v_at`]) and hold other items ([`KvLayout::v_items`]).
#[derive(Clone, Debug)]
pub struct KvLayout {
    mha: bool,
    base: u64,
    ids: Vec<i64>,
    item: u64,
    len: u64,
    v_item: u64,
    v_len: u64,
    spacing: u64,
    v_base: Option<u64>,
    stride: Option<u64>,
    context: LayoutContext,
}

impl KvLayout {
    fn of(mha: bool, base: u64, ids: impl IntoIterator<Item = i64>, item: u64, len: u64) -> Self {
        Self {
            mha,
            base,
            ids: ids.into_iter().collect(),
            item,
            len,
            v_item: item,
            v_len: len,
            spacing: len,
            v_base: None,
            stride: None,
            context: LayoutContext::default(),
        }
    }

    /// One latent entry per layer id, `len` bytes of `item`-byte items each.
    pub fn mla(base: u64, ids: impl IntoIterator<Item = i64>, item: u64, len: u64) -> Self {
        Self::of(false, base, ids, item, len)
    }

    /// A K and a V entry per layer id, `len` bytes of `item`-byte items each.
    pub fn mha(base: u64, ids: impl IntoIterator<Item = i64>, item: u64, len: u64) -> Self {
        Self::of(true, base, ids, item, len)
    }

    /// Entry buffers start `spacing` bytes apart (instead of back to back).
    pub fn spaced(self, spacing: u64) -> Self {
        Self { spacing, ..self }
    }

    /// The V block starts at `v_base` (instead of right after the K block), same spacing.
    pub fn v_at(self, v_base: u64) -> Self {
        Self {
            v_base: Some(v_base),
            ..self
        }
    }

    /// V entries hold `len` bytes of `item`-byte items (K keeps its own).
    pub fn v_items(self, item: u64, len: u64) -> Self {
        Self {
            v_item: item,
            v_len: len,
            ..self
        }
    }

    /// Every entry's items sit `stride` bytes apart (set with `Layout::with_strides`).
    pub fn stride(self, stride: u64) -> Self {
        Self {
            stride: Some(stride),
            ..self
        }
    }

    /// The peer's context (default: `LayoutContext::default()`).
    pub fn context(self, context: LayoutContext) -> Self {
        Self { context, ..self }
    }

    /// The address right after the last entry's spacing: where a test may place the buffers
    /// that follow the page entries (state, drafts).
    pub fn end(&self) -> u64 {
        let n = self.ids.len() as u64;
        match (self.mha, self.v_base) {
            (true, Some(v)) => v + n * self.spacing,
            (true, None) => self.base + 2 * n * self.spacing,
            (false, _) => self.base + n * self.spacing,
        }
    }

    /// The layout; panics where the core refuses it (these shapes are meant to be valid).
    pub fn build(self) -> Layout {
        let n = self.ids.len();
        let at =
            |from: u64| -> Vec<u64> { (0..n as u64).map(|i| from + i * self.spacing).collect() };
        let ids = Some(self.ids.clone());
        let layout = if self.mha {
            let v_base = self.v_base.unwrap_or(self.base + n as u64 * self.spacing);
            Layout::mha(
                at(self.base),
                at(v_base),
                vec![self.len; n],
                vec![self.v_len; n],
                vec![self.item; n],
                vec![self.v_item; n],
                ids,
                self.context,
            )
        } else {
            Layout::mla(
                at(self.base),
                vec![self.len; n],
                vec![self.item; n],
                ids,
                self.context,
            )
        }
        .unwrap();
        match self.stride {
            Some(stride) => {
                let entries = layout.n_entries();
                layout.with_strides(vec![stride; entries]).unwrap()
            }
            None => layout,
        }
    }
}

/// One cross-layer pool at `base` of `pages` pages: entry `e` (layer `ids[e]`) holds the
/// `items[e]` bytes of each page after the entries before it. Roles are the default `kv`.
pub fn layer_pool(
    base: u64,
    pages: u64,
    ids: Vec<i64>,
    items: Vec<u64>,
    context: LayoutContext,
) -> Layout {
    let stride: u64 = items.iter().sum();
    Layout::cross_layer(base, pages * stride, Some(ids), items, None, context).unwrap()
}

/// One cross-layer pool at `base` of `pages` pages holding a K and a V item of `item` bytes per
/// layer of `layers`, side by side in the order K0 V0 K1 V1 …
pub fn kv_pool(
    base: u64,
    pages: u64,
    layers: std::ops::Range<i64>,
    item: u64,
    context: LayoutContext,
) -> Layout {
    let ids: Vec<i64> = layers.flat_map(|l| [l, l]).collect();
    let n = ids.len();
    let roles = (0..n).map(|e| ["k", "v"][e % 2].to_string()).collect();
    Layout::cross_layer(
        base,
        pages * item * n as u64,
        Some(ids),
        vec![item; n],
        Some(roles),
        context,
    )
    .unwrap()
}

/// Entries without roles or context: entry `e` (layer id `e`) at `base + offsets[e]`, `lens[e]`
/// bytes of `items[e]`-byte items `strides[e]` apart.
pub fn bare_entries(
    base: u64,
    items: &[u64],
    offsets: &[u64],
    lens: Vec<u64>,
    strides: Vec<u64>,
) -> Layout {
    Layout::new(
        LayoutParts {
            data_ptrs: offsets.iter().map(|o| base + o).collect(),
            data_lens: lens,
            item_lens: items.to_vec(),
            layer_ids: (0..items.len() as i64).map(Some).collect(),
            ..Default::default()
        },
        LayoutContext::default(),
    )
    .unwrap()
    .with_strides(strides)
    .unwrap()
}

/// Appends one state entry named `name` per layer of `ids`, at `ptrs`, each `slots` slots of
/// `item` bytes.
pub fn with_slots(
    layout: Layout,
    name: &str,
    ptrs: Vec<u64>,
    slots: u64,
    item: u64,
    ids: Vec<i64>,
) -> Layout {
    let n = ptrs.len();
    layout
        .with_state(name, ptrs, vec![slots * item; n], vec![item; n], ids)
        .unwrap()
}
