//! A layout's two exchange forms as Python sees them: the JSON-able dict (`Layout.to_dict`,
//! `Layout.from_dict`) and the handshake bytes (`Layout.from_bytes`).

use kvplan_core::Layout;
use pyo3::IntoPyObjectExt;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple};

use crate::errors::{KvPlanError, to_py_err};
use crate::layout_args::{
    ItemLens, U64, field_list, field_value, nullable_list, plain_int, registered,
    representations_arg, u64_value,
};
use crate::layout_entry::{entry_roles, kind_names, representation_texts};

/// `Layout.to_dict`: a JSON-able dict, exactly `Layout(**d)`'s arguments plus `"version"`.
pub(crate) fn to_dict<'py>(py: Python<'py>, layout: &Layout) -> PyResult<Bound<'py, PyDict>> {
    let parts = layout.parts();
    let ctx = layout.context();
    let dict = PyDict::new(py);
    dict.set_item("version", kvplan_core::exchange::wire::WIRE_VERSION)?;
    dict.set_item("data_ptrs", &parts.data_ptrs)?;
    dict.set_item("data_lens", &parts.data_lens)?;
    dict.set_item("item_lens", &parts.item_lens)?;
    dict.set_item("layer_ids", &parts.layer_ids)?;
    dict.set_item("roles", entry_roles(layout))?;
    dict.set_item("kinds", kind_names(layout))?;
    dict.set_item("drafts", &parts.drafts)?;
    dict.set_item("strides", layout.strides())?;
    if layout.has_windows() {
        dict.set_item("windows", layout.windows())?;
    }
    if let Some(page_size) = layout.window_page_size() {
        dict.set_item("window_page_size", page_size)?;
    }
    let further = further_pools(layout)?;
    if !further.is_empty() {
        // Lists, not tuples: the document is JSON.
        let lists = PyList::empty(py);
        for (page_size, per_row, entries) in further {
            let item = [
                page_size.into_py_any(py)?,
                per_row.into_py_any(py)?,
                entries.into_py_any(py)?,
            ];
            lists.append(PyList::new(py, item)?)?;
        }
        dict.set_item("pools", lists)?;
    }
    if layout.entries().iter().any(|e| e.ring().is_some()) {
        dict.set_item("rings", layout.rings())?;
    }
    if layout.has_representations() {
        dict.set_item("representations", representation_texts(layout))?;
    }
    if layout.entries().iter().any(|e| e.channels().is_some()) {
        // Lists, not tuples: the document is JSON.
        let splits = PyList::empty(py);
        for split in layout.state_channels() {
            match split {
                None => splits.append(py.None())?,
                Some(s) => {
                    let item = [
                        s.channels.into_py_any(py)?,
                        s.outer_rows.into_py_any(py)?,
                        s.groups().to_vec().into_py_any(py)?,
                    ];
                    splits.append(PyList::new(py, item)?)?;
                }
            }
        }
        dict.set_item("state_channels", splits)?;
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

/// `Layout.from_dict`: a layout from `to_dict` output, each field converted element by element.
pub(crate) fn from_dict(data: &Bound<'_, PyDict>) -> PyResult<Layout> {
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
    let state_channels = match optional("state_channels")? {
        Some(v) if !v.is_none() => {
            let bad = || {
                PyTypeError::new_err(format!(
                    "state_channels must be a list of [channels, outer_rows, [shard groups]] or \
                     null per entry, got {}",
                    v.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                ))
            };
            // each split as any sequence of three (to_dict writes tuples, JSON gives lists)
            let items: Vec<Option<Vec<Bound<'_, PyAny>>>> = v.extract().map_err(|_| bad())?;
            let mut splits = Vec::with_capacity(items.len());
            for item in items {
                let Some(parts) = item else {
                    splits.push(None);
                    continue;
                };
                let [c, r, g] = parts.as_slice() else {
                    return Err(bad());
                };
                let (c, r, g): (u64, u64, Vec<u64>) = (
                    c.extract().map_err(|_| bad())?,
                    r.extract().map_err(|_| bad())?,
                    g.extract().map_err(|_| bad())?,
                );
                splits.push(Some(
                    kvplan_core::StateChannels::new(c, r, &g).map_err(to_py_err)?,
                ));
            }
            splits
        }
        _ => Vec::new(),
    };
    let pools = match optional("pools")? {
        Some(v) if !v.is_none() => {
            let bad = || {
                PyTypeError::new_err(format!(
                    "pools must be a list of [page_size, tokens_per_row, [entry indices]], got {}",
                    v.repr().map_or_else(|_| "?".into(), |r| r.to_string())
                ))
            };
            let items: Vec<Vec<Bound<'_, PyAny>>> = v.extract().map_err(|_| bad())?;
            items
                .into_iter()
                .map(|item| match item.as_slice() {
                    [a, b, c] => Ok((
                        a.extract::<u64>().map_err(|_| bad())?,
                        b.extract::<u64>().map_err(|_| bad())?,
                        c.extract::<Vec<usize>>().map_err(|_| bad())?,
                    )),
                    _ => Err(bad()),
                })
                .collect::<PyResult<Vec<_>>>()?
        }
        _ => Vec::new(),
    };
    // Each field is converted here, element by element, so that a bad document is refused
    // naming the field, the entry and the value (PyO3's own conversion errors name none).
    let item_lens = if items.cast::<PyList>().is_ok() || items.cast::<PyTuple>().is_ok() {
        ItemLens::Many(field_list("item_lens", &items, U64, &u64_value)?)
    } else {
        items.extract()?
    };
    registered(
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
        Some(list) if !list.is_none() => layout
            .with_representations(representations_arg(&list)?)
            .map_err(to_py_err),
        _ => Ok(layout),
    })
    .and_then(|layout| {
        pools
            .into_iter()
            .try_fold(layout, |layout, (page_size, per_row, entries)| {
                layout.with_pool(&entries, page_size, per_row)
            })
            .map_err(to_py_err)
    })
    .and_then(|layout| {
        layout
            .with_state_channels(state_channels)
            .map_err(to_py_err)
    })
}

/// The further pools other than the window pool, in id order, as `to_dict` writes them:
/// `(page_size, tokens_per_row, entries)` each. `from_dict` adds the window pool first (pool
/// 1), then these, so a window pool with another id cannot round-trip and is refused.
fn further_pools(layout: &Layout) -> PyResult<Vec<(u64, u64, Vec<usize>)>> {
    let window = layout.window_pool().map(|p| p.id);
    let mut out = Vec::new();
    for pool in layout.pools().iter().skip(1) {
        if Some(pool.id) == window {
            if pool.id != kvplan_core::PoolId::WINDOW {
                return Err(KvPlanError::new_err(format!(
                    "the layout's window pool is pool {}, after a pool of its own: the dict \
                     form keeps the window pool as pool 1 (set with_window_pool before \
                     with_pool)",
                    pool.id.0
                )));
            }
            continue;
        }
        let entries = (0..layout.n_entries())
            .filter(|&i| layout.entry(i).pool() == Some(pool.id))
            .collect();
        out.push((pool.page_size, pool.tokens_per_row, entries));
    }
    Ok(out)
}

/// `Layout.from_bytes`: decodes the handshake encoding with the GIL released.
pub(crate) fn from_bytes(py: Python<'_>, data: &[u8]) -> PyResult<Layout> {
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
    py.detach(move || kvplan_core::exchange::wire::decode(&data))
        .map_err(to_py_err)
}
