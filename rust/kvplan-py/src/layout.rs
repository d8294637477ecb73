//! `kvplan.Layout`: a peer's transfer entries, built from SGLang-style registration lists or
//! from the named constructors of the core.

use kvplan_core::{Indexing, Layout};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::to_py_err;
use crate::layout_args::{
    ItemLens, registered, representations_arg, rings_arg, state_channels_arg, strided,
    strided_tail, windows_arg,
};
use crate::layout_dict::{from_bytes, from_dict, to_dict};
use crate::layout_entry::{PyLayoutEntry, describe, entry_roles, kind_names, representation_texts};
use crate::options::context_from;

/// An immutable list of one peer's transfer entries plus its context (page size, device, PP/TP).
#[pyclass(frozen, eq, name = "Layout", module = "kvplan")]
#[derive(PartialEq)]
pub struct PyLayout {
    pub(crate) inner: Layout,
}

impl From<Layout> for PyLayout {
    fn from(inner: Layout) -> Self {
        Self { inner }
    }
}

fn wrap(layout: kvplan_core::Result<Layout>) -> PyResult<PyLayout> {
    layout.map(PyLayout::from).map_err(to_py_err)
}

#[pymethods]
impl PyLayout {
    #[new]
    #[pyo3(signature = (data_ptrs, data_lens, item_lens, layer_ids=None, roles=None, *, kinds=None, drafts=None, strides=None, windows=None, window_page_size=None, rings=None, **context))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: ItemLens,
        layer_ids: Option<Vec<Option<i64>>>,
        roles: Option<Vec<Option<String>>>,
        kinds: Option<Vec<String>>,
        drafts: Option<Vec<bool>>,
        strides: Option<&Bound<'_, PyAny>>,
        windows: Option<&Bound<'_, PyAny>>,
        window_page_size: Option<u64>,
        rings: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        registered(
            data_ptrs,
            data_lens,
            item_lens,
            layer_ids,
            roles,
            kinds,
            drafts,
            strides,
            windows,
            window_page_size,
            rings,
            context,
        )
        .map(|inner| Self { inner })
    }

    /// The same layout with sliding-window entries: one window in tokens per entry (`None`
    /// for a full entry). A window entry moves only the last `window` tokens of a request (and
    /// of a delta request only those the decode lacks). Its pages are the request's pages, or,
    /// with `window_page_size`, a pool of its own: the request's window pages
    /// (`Template.plan(..., window_pages=)`), `window_page_size` tokens each.
    #[pyo3(signature = (windows, *, window_page_size=None))]
    fn with_windows(
        &self,
        windows: &Bound<'_, PyAny>,
        window_page_size: Option<u64>,
    ) -> PyResult<Self> {
        let list = windows_arg(Some(windows))?;
        wrap(
            self.inner
                .clone()
                .with_windows_in_pool(list, window_page_size),
        )
    }

    /// Tokens per page of the window entries' own pool (`None`: they index the request's
    /// pages).
    #[getter]
    fn window_page_size(&self) -> Option<u64> {
        self.inner.window_page_size()
    }

    /// The same layout with `entries` in a pool of their own, the next pool id (1 on a layout
    /// with no further pool): one page index space with its own page size, as an engine keeps
    /// each KV-cache group in its own block table. `entries` are entry indices, or role names
    /// (every page entry of the request's pages with that role). Each page holds `page_size`
    /// tokens as `page_size / tokens_per_row` rows (a compressed cache keeps one row per
    /// `tokens_per_row` tokens); a token plan moves a row once all its tokens are in the
    /// request's range. A request gives each side's pages of the pool in token order as
    /// `Request(..., pool_pages={pool: (src, dst)})`. A `LayoutError` names the values for a
    /// page size that is not a multiple of `tokens_per_row`, an entry already in a pool, a
    /// state entry, or no entry.
    #[pyo3(signature = (entries, page_size, *, tokens_per_row=1))]
    fn with_pool(
        &self,
        entries: &Bound<'_, PyAny>,
        page_size: u64,
        tokens_per_row: u64,
    ) -> PyResult<Self> {
        let picked = pool_entries(&self.inner, entries)?;
        wrap(
            self.inner
                .clone()
                .with_pool(&picked, page_size, tokens_per_row),
        )
    }

    /// The page pools: `(pool id, page_size, tokens_per_row)` each, the request's pages first.
    #[getter]
    fn pools(&self) -> Vec<(u8, u64, u64)> {
        self.inner
            .pools()
            .iter()
            .map(|p| (p.id.0, p.page_size, p.tokens_per_row))
            .collect()
    }

    /// The pool id of each entry (`None` for a state entry).
    #[getter]
    fn entry_pools(&self) -> Vec<Option<u8>> {
        (0..self.inner.n_entries())
            .map(|i| self.inner.entry(i).pool().map(|p| p.0))
            .collect()
    }

    /// The same layout with KV representations: one per entry, `None` for an entry that
    /// publishes none (and for scale and state entries), else `"dtype"` or `"dtype:scales"`
    /// (`"bf16"`, `"fp8_e4m3:per_token"`; dtypes `bf16`, `fp16`, `fp8_e4m3`, `fp8_e5m2`,
    /// `int8`; scales `none`, `per_tensor`, `per_token`, `per_token_head`, `mx`). Per-token
    /// and `mx` scales live in the page entry of the same layer whose role is the entry's
    /// role + `_scale` (see docs/api.md, "KV representations"). A `LayoutError` names the entry and the values
    /// for a representation its sizes contradict.
    fn with_representations(&self, representations: &Bound<'_, PyAny>) -> PyResult<Self> {
        let list = representations_arg(representations)?;
        wrap(self.inner.clone().with_representations(list))
    }

    /// KV representation per entry (`None`: none published), as `with_representations` takes.
    #[getter]
    fn representations(&self) -> Vec<Option<String>> {
        representation_texts(&self.inner)
    }

    /// Sliding window in tokens per entry (`None`: a full entry).
    #[getter]
    fn windows(&self) -> Vec<Option<u64>> {
        self.inner.windows()
    }

    /// The same layout with ring-state entries: one ring size in rows per request slot per
    /// entry (`None` for an entry that is no ring; state entries only). Position `p` of a
    /// request lives in row `slot * rows + p % rows`; `Template.plan_ring` moves the live rows.
    fn with_rings(&self, rings: &Bound<'_, PyAny>) -> PyResult<Self> {
        let list = rings_arg(Some(rings))?;
        wrap(self.inner.clone().with_rings(list))
    }

    /// Ring rows per request slot per entry (`None`: not a ring-state entry).
    #[getter]
    fn rings(&self) -> Vec<Option<u64>> {
        self.inner.rings()
    }

    /// One `kv` entry per layer (MLA latent buffers).
    #[staticmethod]
    #[pyo3(signature = (data_ptrs, data_lens, item_lens, layer_ids=None, *, strides=None, **context))]
    fn mla(
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: ItemLens,
        layer_ids: Option<Vec<i64>>,
        strides: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let n = data_ptrs.len();
        let layout = Layout::mla(
            data_ptrs,
            data_lens,
            item_lens.expand(n),
            layer_ids,
            context_from(context)?,
        );
        strided(layout, strides).map(Self::from)
    }

    /// All K entries then all V entries; K and V item lengths may differ.
    #[staticmethod]
    #[pyo3(signature = (k_ptrs, v_ptrs, k_data_lens, v_data_lens, k_item_lens, v_item_lens, layer_ids=None, *, strides=None, **context))]
    #[allow(clippy::too_many_arguments)]
    fn mha(
        k_ptrs: Vec<u64>,
        v_ptrs: Vec<u64>,
        k_data_lens: Vec<u64>,
        v_data_lens: Vec<u64>,
        k_item_lens: ItemLens,
        v_item_lens: ItemLens,
        layer_ids: Option<Vec<i64>>,
        strides: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let (nk, nv) = (k_ptrs.len(), v_ptrs.len());
        let layout = Layout::mha(
            k_ptrs,
            v_ptrs,
            k_data_lens,
            v_data_lens,
            k_item_lens.expand(nk),
            v_item_lens.expand(nv),
            layer_ids,
            context_from(context)?,
        );
        strided(layout, strides).map(Self::from)
    }

    /// Hybrid-linear pool: KV only for full-attention layers, published under global ids.
    #[staticmethod]
    #[pyo3(signature = (full_attention_layer_ids, data_ptrs, data_lens, item_lens, *, mla=true, strides=None, **context))]
    fn hybrid_linear(
        full_attention_layer_ids: Vec<i64>,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: ItemLens,
        mla: bool,
        strides: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let n = data_ptrs.len();
        let layout = Layout::hybrid_linear(
            full_attention_layer_ids,
            data_ptrs,
            data_lens,
            item_lens.expand(n),
            mla,
            context_from(context)?,
        );
        strided(layout, strides).map(Self::from)
    }

    /// NPU pool with several buffer groups per layer (group-major), ids repeated per group.
    #[staticmethod]
    #[pyo3(signature = (layer_ids, data_ptrs, data_lens, item_lens, *, group_roles=None, strides=None, **context))]
    fn npu_groups(
        layer_ids: Vec<i64>,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: ItemLens,
        group_roles: Option<Vec<String>>,
        strides: Option<&Bound<'_, PyAny>>,
        context: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let n = data_ptrs.len();
        let layout = Layout::npu_groups(
            layer_ids,
            data_ptrs,
            data_lens,
            item_lens.expand(n),
            group_roles,
            context_from(context)?,
        );
        strided(layout, strides).map(Self::from)
    }

    /// One allocation holding every layer of a page side by side (a cross-layer pool):
    /// entry `j`'s item of page `i` is at `pool_ptr + i * sum(item_lens) + sum(item_lens[:j])`.
    #[staticmethod]
    #[pyo3(signature = (pool_ptr, pool_len, layer_ids, item_lens, *, roles=None, **context))]
    fn cross_layer(
        pool_ptr: u64,
        pool_len: u64,
        layer_ids: Option<Vec<i64>>,
        item_lens: ItemLens,
        roles: Option<Vec<String>>,
        context: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let n = layer_ids
            .as_ref()
            .map(Vec::len)
            .or_else(|| roles.as_ref().map(Vec::len))
            .unwrap_or(0);
        wrap(Layout::cross_layer(
            pool_ptr,
            pool_len,
            layer_ids,
            item_lens.expand(n),
            roles,
            context_from(context)?,
        ))
    }

    /// A new layout with draft KV entries appended (ids remapped into the band above the model).
    #[pyo3(signature = (data_ptrs, data_lens, item_lens, *, draft_layer_ids, num_hidden_layers, roles=None, strides=None))]
    #[allow(clippy::too_many_arguments)]
    fn with_draft(
        &self,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: ItemLens,
        draft_layer_ids: Vec<i64>,
        num_hidden_layers: i64,
        roles: Option<Vec<String>>,
        strides: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let n = data_ptrs.len();
        let layout = self.inner.with_draft(
            data_ptrs,
            data_lens,
            item_lens.expand(n),
            &draft_layer_ids,
            num_hidden_layers,
            roles,
        );
        strided_tail(&self.inner, layout, strides).map(Self::from)
    }

    /// A new layout with per-request state entries appended (kind "state", role = name); with
    /// `channels`, each new entry's TP channel split (`outer_rows`, `shard_groups` per entry).
    #[pyo3(signature = (name, data_ptrs, data_lens, item_lens, layer_ids, *, strides=None, channels=None, outer_rows=None, shard_groups=None))]
    #[allow(clippy::too_many_arguments)]
    fn with_state(
        &self,
        name: &str,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: ItemLens,
        layer_ids: Vec<i64>,
        strides: Option<&Bound<'_, PyAny>>,
        channels: Option<&Bound<'_, PyAny>>,
        outer_rows: Option<&Bound<'_, PyAny>>,
        shard_groups: Option<Vec<Option<Vec<u64>>>>,
    ) -> PyResult<Self> {
        let n = data_ptrs.len();
        let layout =
            self.inner
                .with_state(name, data_ptrs, data_lens, item_lens.expand(n), layer_ids);
        let layout = strided_tail(&self.inner, layout, strides)?;
        let before = self.inner.n_entries();
        let splits = state_channels_arg(before, n, channels, outer_rows, shard_groups)?;
        if splits.is_empty() {
            return Ok(Self::from(layout));
        }
        let mut all = layout.state_channels();
        all.truncate(before);
        all.extend(splits);
        wrap(layout.with_state_channels(all))
    }

    /// Each entry's TP channel split, `(channels per rank, outer rows, shard groups)` (`None`:
    /// none; 0 channels: replicated).
    #[getter]
    fn state_channels(&self) -> Vec<Option<(u64, u64, Vec<u64>)>> {
        self.inner
            .state_channels()
            .into_iter()
            .map(|s| s.map(|s| (s.channels, s.outer_rows, s.groups().to_vec())))
            .collect()
    }

    /// XXH3-64 of the layout's wire encoding: equal on two peers exactly when they agree on
    /// every field the handshake carries.
    fn fingerprint(&self) -> PyResult<u64> {
        kvplan_core::layout_fingerprint(&self.inner).map_err(to_py_err)
    }

    /// The versioned binary encoding exchanged in the handshake (exact round trip).
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = kvplan_core::exchange::wire::encode(&self.inner).map_err(to_py_err)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Decodes [`to_bytes`] output; truncated, corrupted, oversized or unknown-version data
    /// raises `KvPlanError` (nothing is allocated beyond a small multiple of the input).
    #[staticmethod]
    fn from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        from_bytes(py, data).map(Self::from)
    }

    /// A JSON-able dict: exactly `Layout(**d)`'s arguments plus `"version"`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        to_dict(py, &self.inner)
    }

    /// Builds a layout from [`to_dict`] output (e.g. parsed from a JSON config file).
    #[staticmethod]
    fn from_dict(data: &Bound<'_, PyDict>) -> PyResult<Self> {
        from_dict(data).map(Self::from)
    }

    #[getter]
    fn n_entries(&self) -> usize {
        self.inner.n_entries()
    }

    fn __len__(&self) -> usize {
        self.inner.n_entries()
    }

    #[getter]
    fn data_ptrs(&self) -> Vec<u64> {
        self.inner.entries().iter().map(|e| e.buffer.0).collect()
    }

    #[getter]
    fn data_lens(&self) -> Vec<u64> {
        self.inner.entries().iter().map(|e| e.buffer.1).collect()
    }

    #[getter]
    fn item_lens(&self) -> Vec<u64> {
        self.inner.entries().iter().map(|e| e.item_len).collect()
    }

    /// Global layer id per entry; `None` when no entry publishes one (`None` items for entries
    /// of a kind that publishes none while another kind does).
    #[getter]
    fn layer_ids(&self) -> Option<Vec<Option<i64>>> {
        let ids: Vec<Option<i64>> = self.inner.entries().iter().map(|e| e.layer).collect();
        ids.iter().any(Option::is_some).then_some(ids)
    }

    /// Role per entry; `None` when no entry publishes one (`None` items for entries of a
    /// kind that publishes none while another kind does).
    #[getter]
    fn roles(&self) -> Option<Vec<Option<&str>>> {
        let roles = entry_roles(&self.inner);
        roles.iter().any(Option::is_some).then_some(roles)
    }

    /// Whether each entry belongs to the draft model.
    #[getter]
    fn drafts(&self) -> Vec<bool> {
        self.inner.entries().iter().map(|e| e.draft).collect()
    }

    /// One read-only record per entry, in layout order; only the entries of `kind`
    /// (`"page"` or `"state"`) when given.
    #[pyo3(signature = (kind=None))]
    fn entries(&self, kind: Option<&str>) -> PyResult<Vec<PyLayoutEntry>> {
        let kind = kind.map(Indexing::parse).transpose().map_err(to_py_err)?;
        let layout = &self.inner;
        Ok((0..layout.n_entries())
            .filter(|&i| kind.is_none_or(|k| layout.entry(i).indexing() == k))
            .map(|i| PyLayoutEntry::of(layout, i))
            .collect())
    }

    /// Bytes between consecutive items of each entry (`item_len` unless set).
    #[getter]
    fn strides(&self) -> Vec<u64> {
        self.inner.strides()
    }

    #[getter]
    fn kinds(&self) -> Vec<&'static str> {
        kind_names(&self.inner)
    }

    /// Items (pages or slots) each entry holds: the whole items that fit,
    /// `(data_len - item_len) // stride + 1` (0 when item_len is 0 or exceeds data_len).
    #[getter]
    fn capacities(&self) -> Vec<u64> {
        (0..self.inner.n_entries())
            .map(|i| self.inner.capacity(i))
            .collect()
    }

    #[getter]
    fn page_size(&self) -> u64 {
        self.inner.context().page_size
    }

    #[getter]
    fn device(&self) -> String {
        self.inner.context().device.clone()
    }

    #[getter]
    fn num_model_layers(&self) -> Option<u64> {
        self.inner.context().num_model_layers
    }

    #[getter]
    fn pp_rank(&self) -> u32 {
        self.inner.context().pp_rank
    }

    #[getter]
    fn pp_size(&self) -> u32 {
        self.inner.context().pp_size
    }

    #[getter]
    fn tp_rank(&self) -> u32 {
        self.inner.context().tp_rank
    }

    #[getter]
    fn tp_size(&self) -> u32 {
        self.inner.context().tp_size
    }

    /// Decode context-parallel ranks this peer's tokens are dealt over (1: not dealt).
    #[getter]
    fn dcp_size(&self) -> u32 {
        self.inner.context().dcp.size
    }

    /// This peer's decode context-parallel rank.
    #[getter]
    fn dcp_rank(&self) -> u32 {
        self.inner.context().dcp.rank
    }

    /// Consecutive tokens per deal over the DCP ranks (1: token round robin).
    #[getter]
    fn dcp_interleave(&self) -> u64 {
        self.inner.context().dcp.interleave
    }

    /// KV heads of the whole model, when the layout publishes its attention geometry.
    #[getter]
    fn kv_heads(&self) -> Option<u32> {
        self.inner.context().attention.map(|g| g.total_kv_heads)
    }

    /// KV heads this rank holds, when published.
    #[getter]
    fn heads_per_rank(&self) -> Option<u32> {
        self.inner.context().attention.map(|g| g.heads_per_rank)
    }

    /// Elements per head, when published.
    #[getter]
    fn head_dim(&self) -> Option<u32> {
        self.inner.context().attention.map(|g| g.head_dim)
    }

    /// Bytes per element, when published.
    #[getter]
    fn dtype_size(&self) -> Option<u32> {
        self.inner.context().attention.map(|g| g.dtype_size)
    }

    /// `"NHD"` or `"HND"`, when published.
    #[getter]
    fn memory_order(&self) -> Option<&'static str> {
        self.inner
            .context()
            .attention
            .map(|g| g.memory_order.as_str())
    }

    fn __repr__(&self) -> String {
        describe(&self.inner)
    }
}

/// `Layout.with_pool`'s entries: entry indices, or role names (the request's-pages entries of
/// each role).
fn pool_entries(layout: &Layout, entries: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let bad = || {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "with_pool entries must be a list of entry indices or of role names, got {}",
            entries
                .repr()
                .map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    };
    if entries.is_instance_of::<pyo3::types::PyString>() {
        return Err(bad());
    }
    let mut picked = Vec::new();
    for item in entries.try_iter().map_err(|_| bad())? {
        let item = item?;
        if let Ok(role) = item.extract::<String>() {
            let before = picked.len();
            picked.extend((0..layout.n_entries()).filter(|&i| {
                let e = layout.entry(i);
                e.role == role && e.pool() == Some(kvplan_core::PoolId::PAGES)
            }));
            if picked.len() == before {
                return Err(to_py_err(kvplan_core::PlanError::InvalidLayout {
                    what: format!(
                        "with_pool: no page entry of the request's pages has role {role:?}"
                    ),
                }));
            }
        } else if let Ok(index) = item.extract::<usize>() {
            picked.push(index);
        } else {
            return Err(bad());
        }
    }
    Ok(picked)
}
