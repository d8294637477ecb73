//! `kvplan.LayoutEntry`, one entry of a layout as `Layout.entries()` lists it, and the
//! per-entry views `Layout`'s getters, `to_dict` and `repr` share.

use kvplan_core::Layout;
use pyo3::prelude::*;

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

impl PyLayoutEntry {
    /// Entry `i` of `layout`.
    pub(crate) fn of(layout: &Layout, i: usize) -> Self {
        let e = layout.entry(i);
        Self {
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
        }
    }
}

/// Role per entry, `None` where not published.
pub(crate) fn entry_roles(layout: &Layout) -> Vec<Option<&str>> {
    (0..layout.n_entries()).map(|i| layout.role(i)).collect()
}

/// `"page"` or `"state"` per entry.
pub(crate) fn kind_names(layout: &Layout) -> Vec<&'static str> {
    layout
        .entries()
        .iter()
        .map(|e| e.indexing().as_str())
        .collect()
}

/// KV representation per entry as `with_representations` takes it (`None`: none published).
pub(crate) fn representation_texts(layout: &Layout) -> Vec<Option<String>> {
    layout
        .entries()
        .iter()
        .map(|e| e.format.map(|r| r.text()))
        .collect()
}

/// `repr(layout)`: its entry counts by kind and its context.
pub(crate) fn describe(layout: &Layout) -> String {
    let pages = layout.entries().iter().filter(|e| e.is_page()).count();
    let ctx = layout.context();
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
        layout.n_entries(),
        pages,
        layout.n_entries() - pages,
        ctx.page_size,
        ctx.device,
        ctx.pp_rank,
        ctx.pp_size,
        ctx.tp_rank,
        ctx.tp_size
    )
}
