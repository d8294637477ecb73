//! `kvplan.Layout`: a peer's transfer entries, built from SGLang-style registration lists or
//! from the named constructors of the core.

use kvplan_core::{Indexing, Layout, LayoutParts};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyTuple};

use crate::errors::{KvPlanError, short_repr, to_py_err};
use crate::options::context_from;

/// Bytes per item: one value for every entry, or one per entry.
pub(crate) enum ItemLens {
    One(u64),
    Many(Vec<u64>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for ItemLens {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        // One clear message instead of PyO3's report of every enum variant that failed.
        if let Ok(one) = obj.extract::<u64>() {
            return Ok(ItemLens::One(one));
        }
        if let Ok(many) = obj.extract::<Vec<u64>>() {
            return Ok(ItemLens::Many(many));
        }
        Err(PyTypeError::new_err(format!(
            "item_lens must be a non-negative int below 2**64 or a sequence of them, got {}",
            obj.repr()?
        )))
    }
}

/// What an entry of an unsigned 64-bit list field must be.
const U64: &str = "an int in 0..2**64";

/// An int that is not a bool (JSON `true` is not a pointer).
fn plain_int(obj: &Bound<'_, PyAny>) -> bool {
    obj.cast::<PyInt>().is_ok() && obj.cast::<PyBool>().is_err()
}

fn u64_value(obj: &Bound<'_, PyAny>) -> Option<u64> {
    plain_int(obj).then(|| obj.extract().ok()).flatten()
}

/// Layout dict field `key` holding one value, or a `TypeError` naming the field and the value.
fn field_value<T>(
    key: &str,
    obj: &Bound<'_, PyAny>,
    must: &str,
    convert: &dyn Fn(&Bound<'_, PyAny>) -> Option<T>,
) -> PyResult<T> {
    convert(obj).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "layout dict field {key} {must}, got {}",
            short_repr(obj)
        ))
    })
}

/// Layout dict field `key` as a list of `what`, converted entry by entry: a `TypeError` names
/// the field, and the entry and its value when one entry is bad.
fn field_list<T>(
    key: &str,
    obj: &Bound<'_, PyAny>,
    what: &str,
    convert: &dyn Fn(&Bound<'_, PyAny>) -> Option<T>,
) -> PyResult<Vec<T>> {
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = obj.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(PyTypeError::new_err(format!(
            "layout dict field {key} must be a list, each entry {what}, got {}",
            short_repr(obj)
        )));
    };
    items
        .iter()
        .enumerate()
        .map(|(k, item)| {
            convert(item).ok_or_else(|| {
                PyTypeError::new_err(format!(
                    "layout dict field {key}[{k}] must be {what}, got {}",
                    short_repr(item)
                ))
            })
        })
        .collect()
}

/// [`field_list`] for a field that may also be null (not published).
fn nullable_list<T>(
    key: &str,
    obj: &Bound<'_, PyAny>,
    what: &str,
    convert: &dyn Fn(&Bound<'_, PyAny>) -> Option<T>,
) -> PyResult<Option<Vec<T>>> {
    if obj.is_none() {
        return Ok(None);
    }
    field_list(key, obj, what, convert).map(Some)
}

impl ItemLens {
    fn expand(self, n: usize) -> Vec<u64> {
        match self {
            ItemLens::One(len) => vec![len; n],
            ItemLens::Many(lens) => lens,
        }
    }
}

/// `strides=`: `None` (every stride equals its item length), one int for every entry, or one
/// per entry.
fn strides_arg(strides: Option<&Bound<'_, PyAny>>, n: usize) -> PyResult<Vec<u64>> {
    let Some(obj) = strides.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    if let Ok(one) = obj.extract::<u64>() {
        return Ok(vec![one; n]);
    }
    if let Ok(many) = obj.extract::<Vec<u64>>() {
        return Ok(many);
    }
    Err(PyTypeError::new_err(format!(
        "strides must be None, a non-negative int below 2**64 or a sequence of them, got {}",
        obj.repr()?
    )))
}

/// Applies `strides=` to a freshly built layout (all its entries).
fn strided(
    layout: kvplan_core::Result<Layout>,
    strides: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyLayout> {
    let layout = layout.map_err(to_py_err)?;
    let strides = strides_arg(strides, layout.n_entries())?;
    wrap(layout.with_strides(strides))
}

/// `windows=` / `rings=`: `None`, or one positive int (or `None`) per entry.
fn per_entry_arg(
    name: &str,
    what: &str,
    list: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<Option<u64>>> {
    let Some(obj) = list.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    obj.extract::<Vec<Option<u64>>>().map_err(|_| {
        PyTypeError::new_err(format!(
            "{name} must be None or a sequence of one value per entry ({what}), got {}",
            obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
        ))
    })
}

fn windows_arg(windows: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<u64>>> {
    per_entry_arg(
        "windows",
        "a positive int of tokens, or None for a full entry",
        windows,
    )
}

fn rings_arg(rings: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<u64>>> {
    per_entry_arg(
        "rings",
        "a positive int of rows per request slot, or None for an entry that is no ring",
        rings,
    )
}

/// Applies `windows=`, `window_page_size=` and `rings=` to a built layout.
fn windowed(
    layout: PyLayout,
    windows: Option<&Bound<'_, PyAny>>,
    window_page_size: Option<u64>,
    rings: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyLayout> {
    let (windows, rings) = (windows_arg(windows)?, rings_arg(rings)?);
    if windows.is_empty() && rings.is_empty() && window_page_size.is_none() {
        return Ok(layout);
    }
    wrap(
        layout
            .inner
            .with_windows_in_pool(windows, window_page_size)
            .and_then(|l| l.with_rings(rings)),
    )
}

/// Applies `strides=` to the entries `appended` added after the `before` entries of `base`.
fn strided_tail(
    base: &Layout,
    appended: kvplan_core::Result<Layout>,
    strides: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyLayout> {
    let layout = appended.map_err(to_py_err)?;
    let before = base.n_entries();
    let tail = strides_arg(strides, layout.n_entries() - before)?;
    wrap(layout.with_tail_strides(before, tail))
}

/// One entry of a layout, as `Layout.entries()` lists it (read-only).
#[pyclass(frozen, eq, get_all, name = "LayoutEntry", module = "kvplan")]
#[derive(PartialEq)]
pub struct PyLayoutEntry {
    /// Position in the layout.
    index: usize,
    /// `"page"` or `"state"`.
    kind: &'static str,
    /// Global layer id, `None` when not published.
    layer_id: Option<i64>,
    /// Role, `None` when not published.
    role: Option<String>,
    /// Whether the entry belongs to the draft model.
    is_draft: bool,
    data_ptr: u64,
    data_len: u64,
    item_len: u64,
    /// Bytes between consecutive items (`item_len` for packed buffers).
    stride: u64,
    /// Whole items (pages or slots) the entry holds (0 when item_len is 0).
    capacity: u64,
    /// Sliding window in tokens (`None`: a full entry).
    window: Option<u64>,
    /// Tokens per page of this entry: the window pool's for an entry in it, else the layout's.
    page_size: u64,
    /// Whether the entry is indexed by a request's window pages (a window pool's entry).
    in_window_pool: bool,
    /// Ring rows per request slot (`None`: not a ring-state entry).
    ring: Option<u64>,
    /// Whether the entry belongs to its layer's KV entry (an indexer or scales: the core's
    /// sidecar roles), moving only with it.
    sidecar: bool,
}

#[pymethods]
impl PyLayoutEntry {
    fn __repr__(&self) -> String {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "None".into());
        // Python's quoting, so the repr reads like Python.
        let quoted = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
        format!(
            "LayoutEntry(index={}, kind={}, layer_id={}, role={}, is_draft={}, data_ptr={:#x}, data_len={}, item_len={}, stride={}, capacity={}, window={}, page_size={}, in_window_pool={}, ring={})",
            self.index,
            quoted(self.kind),
            opt(self.layer_id.map(|i| i.to_string())),
            opt(self.role.as_deref().map(quoted)),
            if self.is_draft { "True" } else { "False" },
            self.data_ptr,
            self.data_len,
            self.item_len,
            self.stride,
            self.capacity,
            opt(self.window.map(|w| w.to_string())),
            self.page_size,
            if self.in_window_pool { "True" } else { "False" },
            opt(self.ring.map(|r| r.to_string()))
        )
    }
}

impl PyLayout {
    /// Role per entry, `None` where not published.
    fn entry_roles(&self) -> Vec<Option<&str>> {
        (0..self.inner.n_entries())
            .map(|i| self.inner.role(i))
            .collect()
    }
}

/// An immutable list of one peer's transfer entries plus its context (page size, device, PP/TP).
#[pyclass(frozen, eq, name = "Layout", module = "kvplan")]
#[derive(PartialEq)]
pub struct PyLayout {
    pub(crate) inner: Layout,
}

fn wrap(layout: kvplan_core::Result<Layout>) -> PyResult<PyLayout> {
    layout.map(|inner| PyLayout { inner }).map_err(to_py_err)
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
        let n = data_ptrs.len();
        let kinds = kinds
            .unwrap_or_default()
            .iter()
            .map(|k| Indexing::parse(k))
            .collect::<Result<Vec<_>, _>>()
            .map_err(to_py_err)?;
        let parts = LayoutParts {
            data_ptrs,
            data_lens,
            item_lens: item_lens.expand(n),
            layer_ids: layer_ids.unwrap_or_default(),
            // None and "" both mean "not published".
            roles: roles
                .unwrap_or_default()
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect(),
            kinds,
            drafts: drafts.unwrap_or_default(),
        };
        windowed(
            strided(Layout::new(parts, context_from(context)?), strides)?,
            windows,
            window_page_size,
            rings,
        )
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

    /// The same layout with KV representations: one per entry, `None` for an entry that
    /// publishes none (and for scale and state entries), else `"dtype"` or `"dtype:scales"`
    /// (`"bf16"`, `"fp8_e4m3:per_token"`; dtypes `bf16`, `fp16`, `fp8_e4m3`, `fp8_e5m2`,
    /// `int8`; scales `none`, `per_tensor`, `per_token`, `per_token_head`, `mx`). Per-token
    /// and `mx` scales live in the page entry of the same layer whose role is the entry's
    /// role + `_scale` (see docs/api.md, "KV representations"). A `LayoutError` names the entry and the values
    /// for a representation its sizes contradict.
    fn with_representations(&self, representations: &Bound<'_, PyAny>) -> PyResult<Self> {
        let texts: Vec<Option<String>> = representations.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "representations must be a sequence of one str or None per entry, got {}",
                representations
                    .repr()
                    .map_or_else(|_| "?".into(), |r| r.to_string())
            ))
        })?;
        let mut list = Vec::with_capacity(texts.len());
        for (entry, text) in texts.iter().enumerate() {
            list.push(match text {
                None => None,
                Some(t) => Some(kvplan_core::Representation::parse(t).ok_or_else(|| {
                    let names = |all: &mut dyn Iterator<Item = &'static str>| {
                        all.collect::<Vec<_>>().join(", ")
                    };
                    crate::errors::LayoutError::new_err(format!(
                        "entry {entry}: unknown representation {t:?}; give \"dtype\" or \
                         \"dtype:scales\" with a dtype of {} and scales of {}",
                        names(&mut kvplan_core::KvDtype::ALL.iter().map(|d| d.as_str())),
                        names(&mut kvplan_core::ScaleLayout::ALL.iter().map(|s| s.as_str())),
                    ))
                })?),
            });
        }
        wrap(self.inner.clone().with_representations(list))
    }

    /// KV representation per entry (`None`: none published), as `with_representations` takes.
    #[getter]
    fn representations(&self) -> Vec<Option<String>> {
        self.inner
            .entries()
            .iter()
            .map(|e| e.format.map(|r| r.text()))
            .collect()
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
        strided(layout, strides)
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
        strided(layout, strides)
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
        strided(layout, strides)
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
        strided(layout, strides)
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
        strided_tail(&self.inner, layout, strides)
    }

    /// A new layout with per-request state entries appended (kind "state", role = name).
    #[pyo3(signature = (name, data_ptrs, data_lens, item_lens, layer_ids, *, strides=None))]
    fn with_state(
        &self,
        name: &str,
        data_ptrs: Vec<u64>,
        data_lens: Vec<u64>,
        item_lens: ItemLens,
        layer_ids: Vec<i64>,
        strides: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let n = data_ptrs.len();
        let layout =
            self.inner
                .with_state(name, data_ptrs, data_lens, item_lens.expand(n), layer_ids);
        strided_tail(&self.inner, layout, strides)
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
        // Copied so the GIL can be released while decoding; the copy is as large as the input.
        let mut owned = Vec::new();
        owned.try_reserve_exact(data.len()).map_err(|_| {
            to_py_err(kvplan_core::PlanError::out_of_memory::<u8>(
                "a copy of the wire data",
                data.len(),
            ))
        })?;
        owned.extend_from_slice(data);
        let data = owned;
        wrap(py.detach(move || kvplan_core::exchange::wire::decode(&data)))
    }

    /// A JSON-able dict: exactly `Layout(**d)`'s arguments plus `"version"`.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let parts = self.inner.parts();
        let ctx = self.inner.context();
        let dict = PyDict::new(py);
        dict.set_item("version", kvplan_core::exchange::wire::WIRE_VERSION)?;
        dict.set_item("data_ptrs", &parts.data_ptrs)?;
        dict.set_item("data_lens", &parts.data_lens)?;
        dict.set_item("item_lens", &parts.item_lens)?;
        dict.set_item("layer_ids", &parts.layer_ids)?;
        dict.set_item("roles", self.entry_roles())?;
        dict.set_item("kinds", self.kinds())?;
        dict.set_item("drafts", &parts.drafts)?;
        dict.set_item("strides", self.inner.strides())?;
        if self.inner.has_windows() {
            dict.set_item("windows", self.inner.windows())?;
        }
        if let Some(page_size) = self.inner.window_page_size() {
            dict.set_item("window_page_size", page_size)?;
        }
        if self.inner.entries().iter().any(|e| e.ring().is_some()) {
            dict.set_item("rings", self.inner.rings())?;
        }
        if self.inner.has_representations() {
            dict.set_item("representations", self.representations())?;
        }
        dict.set_item("page_size", ctx.page_size)?;
        dict.set_item("device", &ctx.device)?;
        dict.set_item("num_model_layers", ctx.num_model_layers)?;
        dict.set_item("pp_rank", ctx.pp_rank)?;
        dict.set_item("pp_size", ctx.pp_size)?;
        dict.set_item("tp_rank", ctx.tp_rank)?;
        dict.set_item("tp_size", ctx.tp_size)?;
        dict.set_item("dcp_size", ctx.dcp.size)?;
        dict.set_item("dcp_rank", ctx.dcp.rank)?;
        dict.set_item("dcp_interleave", ctx.dcp.interleave)?;
        let attention = ctx.attention.as_ref();
        dict.set_item("kv_heads", attention.map(|g| g.total_kv_heads))?;
        dict.set_item("heads_per_rank", attention.map(|g| g.heads_per_rank))?;
        dict.set_item("head_dim", attention.map(|g| g.head_dim))?;
        dict.set_item("dtype_size", attention.map(|g| g.dtype_size))?;
        dict.set_item("memory_order", attention.map(|g| g.memory_order.as_str()))?;
        Ok(dict)
    }

    /// Builds a layout from [`to_dict`] output (e.g. parsed from a JSON config file).
    #[staticmethod]
    fn from_dict(data: &Bound<'_, PyDict>) -> PyResult<Self> {
        let data = data.copy()?;
        let version: u16 = match data.get_item("version")? {
            Some(v) => field_value("version", &v, "must be an int in 0..2**16", &|o| {
                plain_int(o).then(|| o.extract().ok()).flatten()
            })?,
            None => return Err(KvPlanError::new_err("layout dict has no \"version\" key")),
        };
        if version != kvplan_core::exchange::wire::WIRE_VERSION
            && version != kvplan_core::exchange::wire::WIRE_VERSION_1
        {
            return Err(KvPlanError::new_err(format!(
                "unknown layout dict version {version} (this build reads versions {} and {})",
                kvplan_core::exchange::wire::WIRE_VERSION_1,
                kvplan_core::exchange::wire::WIRE_VERSION
            )));
        }
        data.del_item("version")?;
        let take = |key: &str| -> PyResult<Bound<'_, PyAny>> {
            let value = data
                .get_item(key)?
                .ok_or_else(|| KvPlanError::new_err(format!("layout dict has no {key:?} key")))?;
            data.del_item(key)?;
            Ok(value)
        };
        let (ptrs, lens, items) = (take("data_ptrs")?, take("data_lens")?, take("item_lens")?);
        let (ids, roles, kinds) = (take("layer_ids")?, take("roles")?, take("kinds")?);
        // Optional keys of version 2 documents: without "drafts" draft-ness follows from the
        // roles (as in version 1); without "strides" every stride is the item length.
        let optional = |key: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
            let value = data.get_item(key)?;
            if value.is_some() {
                data.del_item(key)?;
            }
            Ok(value)
        };
        let drafts = match optional("drafts")? {
            Some(v) if !v.is_none() => Some(field_list("drafts", &v, "a bool", &|o| {
                o.cast::<PyBool>().ok().map(PyBoolMethods::is_true)
            })?),
            _ => None,
        };
        let strides = optional("strides")?;
        let windows = optional("windows")?;
        let window_page_size = match optional("window_page_size")? {
            Some(v) if !v.is_none() => Some(u64_value(&v).ok_or_else(|| {
                PyTypeError::new_err(format!(
                    "window_page_size must be a positive int, got {}",
                    v.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                ))
            })?),
            _ => None,
        };
        let rings = optional("rings")?;
        let representations = optional("representations")?;
        // Each field is converted here, element by element, so that a bad document is refused
        // naming the field, the entry and the value (PyO3's own conversion errors name none).
        let item_lens = if items.cast::<PyList>().is_ok() || items.cast::<PyTuple>().is_ok() {
            ItemLens::Many(field_list("item_lens", &items, U64, &u64_value)?)
        } else {
            items.extract()?
        };
        Self::new(
            field_list("data_ptrs", &ptrs, U64, &u64_value)?,
            field_list("data_lens", &lens, U64, &u64_value)?,
            item_lens,
            nullable_list("layer_ids", &ids, "a 64-bit int or null", &|o| {
                if o.is_none() {
                    Some(None)
                } else {
                    plain_int(o)
                        .then(|| o.extract::<i64>().ok().map(Some))
                        .flatten()
                }
            })?,
            nullable_list("roles", &roles, "a str or null", &|o| {
                if o.is_none() {
                    Some(None)
                } else {
                    o.extract::<String>().ok().map(Some)
                }
            })?,
            nullable_list("kinds", &kinds, "a str", &|o| o.extract::<String>().ok())?,
            drafts,
            strides.as_ref(),
            windows.as_ref(),
            window_page_size,
            rings.as_ref(),
            Some(&data),
        )
        .and_then(|layout| match representations {
            Some(list) if !list.is_none() => layout.with_representations(&list),
            _ => Ok(layout),
        })
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
        let roles = self.entry_roles();
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
        Ok(layout
            .entries()
            .iter()
            .enumerate()
            .filter(|(_, e)| kind.is_none_or(|k| e.indexing() == k))
            .map(|(i, e)| PyLayoutEntry {
                index: i,
                kind: e.indexing().as_str(),
                layer_id: e.layer,
                role: layout.role(i).map(str::to_owned),
                is_draft: e.draft,
                data_ptr: e.buffer.0,
                data_len: e.buffer.1,
                item_len: e.item_len,
                stride: e.stride,
                capacity: layout.capacity(i),
                window: e.window(),
                page_size: layout.entry_page_size(i),
                in_window_pool: layout.in_window_pool(i),
                ring: e.ring(),
                sidecar: layout
                    .role(i)
                    .is_some_and(kvplan_core::peer::layout::is_sidecar_role),
            })
            .collect())
    }

    /// Bytes between consecutive items of each entry (`item_len` unless set).
    #[getter]
    fn strides(&self) -> Vec<u64> {
        self.inner.strides()
    }

    #[getter]
    fn kinds(&self) -> Vec<&'static str> {
        self.inner
            .entries()
            .iter()
            .map(|e| e.indexing().as_str())
            .collect()
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
        let pages = self.inner.entries().iter().filter(|e| e.is_page()).count();
        let ctx = self.inner.context();
        let dcp = if ctx.dcp.dealt() {
            format!(
                ", dcp={}/{} (interleave {})",
                ctx.dcp.rank, ctx.dcp.size, ctx.dcp.interleave
            )
        } else {
            String::new()
        };
        format!(
            "Layout({} entries: {} page, {} state; page_size={}, device={:?}, pp={}/{}, tp={}/{}{dcp})",
            self.inner.n_entries(),
            pages,
            self.inner.n_entries() - pages,
            ctx.page_size,
            ctx.device,
            ctx.pp_rank,
            ctx.pp_size,
            ctx.tp_rank,
            ctx.tp_size
        )
    }
}
