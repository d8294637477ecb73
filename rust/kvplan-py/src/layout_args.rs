//! The Python arguments of `kvplan.Layout`'s constructors and setters (`item_lens=`,
//! `strides=`, `windows=`, `rings=`, representations, the registration lists and a layout
//! dict's fields), read into the core's values with a `TypeError` naming the argument and the
//! value when one is wrong.

use kvplan_core::{Indexing, Layout, LayoutParts, Representation};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyList, PyTuple};

use crate::errors::{short_repr, to_py_err};
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
pub(crate) const U64: &str = "an int in 0..2**64";

/// An int that is not a bool (JSON `true` is not a pointer).
pub(crate) fn plain_int(obj: &Bound<'_, PyAny>) -> bool {
    obj.cast::<PyInt>().is_ok() && obj.cast::<PyBool>().is_err()
}

pub(crate) fn u64_value(obj: &Bound<'_, PyAny>) -> Option<u64> {
    plain_int(obj).then(|| obj.extract().ok()).flatten()
}

/// Layout dict field `key` holding one value, or a `TypeError` naming the field and the value.
pub(crate) fn field_value<T>(
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
pub(crate) fn field_list<T>(
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
pub(crate) fn nullable_list<T>(
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
    pub(crate) fn expand(self, n: usize) -> Vec<u64> {
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
pub(crate) fn strided(
    layout: kvplan_core::Result<Layout>,
    strides: Option<&Bound<'_, PyAny>>,
) -> PyResult<Layout> {
    let layout = layout.map_err(to_py_err)?;
    let strides = strides_arg(strides, layout.n_entries())?;
    layout.with_strides(strides).map_err(to_py_err)
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

pub(crate) fn windows_arg(windows: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<u64>>> {
    per_entry_arg(
        "windows",
        "a positive int of tokens, or None for a full entry",
        windows,
    )
}

pub(crate) fn rings_arg(rings: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<u64>>> {
    per_entry_arg(
        "rings",
        "a positive int of rows per request slot, or None for an entry that is no ring",
        rings,
    )
}

/// Applies `windows=`, `window_page_size=` and `rings=` to a built layout.
pub(crate) fn windowed(
    layout: Layout,
    windows: Option<&Bound<'_, PyAny>>,
    window_page_size: Option<u64>,
    rings: Option<&Bound<'_, PyAny>>,
) -> PyResult<Layout> {
    let (windows, rings) = (windows_arg(windows)?, rings_arg(rings)?);
    if windows.is_empty() && rings.is_empty() && window_page_size.is_none() {
        return Ok(layout);
    }
    layout
        .with_windows_in_pool(windows, window_page_size)
        .and_then(|l| l.with_rings(rings))
        .map_err(to_py_err)
}

/// Applies `strides=` to the entries `appended` added after the `before` entries of `base`.
pub(crate) fn strided_tail(
    base: &Layout,
    appended: kvplan_core::Result<Layout>,
    strides: Option<&Bound<'_, PyAny>>,
) -> PyResult<Layout> {
    let layout = appended.map_err(to_py_err)?;
    let before = base.n_entries();
    let tail = strides_arg(strides, layout.n_entries() - before)?;
    layout.with_tail_strides(before, tail).map_err(to_py_err)
}

/// `Layout(...)`: the registration lists, read into the core's ingestion form and validated,
/// then `strides=`, `windows=`, `window_page_size=` and `rings=`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn registered(
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
) -> PyResult<Layout> {
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

/// `with_representations`'s list: one representation text or `None` per entry, parsed; an
/// unknown text is a `LayoutError` naming the entry and the names it may use.
pub(crate) fn representations_arg(
    representations: &Bound<'_, PyAny>,
) -> PyResult<Vec<Option<Representation>>> {
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
            Some(t) => Some(Representation::parse(t).ok_or_else(|| {
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
    Ok(list)
}

/// One int per entry, or one int for all `n`: `channels=` and `outer_rows=` of `with_state`.
fn per_entry_counts(name: &'static str, n: usize, value: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(one) = value.extract::<u64>() {
        return Ok(vec![one; n]);
    }
    if let Ok(many) = value.extract::<Vec<u64>>() {
        return Ok(many);
    }
    Err(PyTypeError::new_err(format!(
        "{name} must be a non-negative int below 2**64 or a sequence of them, got {}",
        value.repr()?
    )))
}

/// `with_state(..., channels=, outer_rows=, shard_groups=)`: one TP channel split per new
/// entry (empty when `channels` is not given), checked by the core.
pub(crate) fn state_channels_arg(
    first: usize,
    n: usize,
    channels: Option<&Bound<'_, PyAny>>,
    outer_rows: Option<&Bound<'_, PyAny>>,
    shard_groups: Option<Vec<Option<Vec<u64>>>>,
) -> PyResult<Vec<Option<kvplan_core::StateChannels>>> {
    let Some(channels) = channels else {
        if outer_rows.is_some() || shard_groups.is_some() {
            return Err(PyTypeError::new_err(
                "outer_rows and shard_groups describe a TP channel split: give channels too",
            ));
        }
        return Ok(Vec::new());
    };
    let channels = per_entry_counts("channels", n, channels)?;
    let rows = match outer_rows {
        Some(rows) => per_entry_counts("outer_rows", n, rows)?,
        None => vec![1; n],
    };
    let groups = shard_groups.unwrap_or_else(|| vec![None; n]);
    for (name, len) in [
        ("channels", channels.len()),
        ("outer_rows", rows.len()),
        ("shard_groups", groups.len()),
    ] {
        if len != n {
            let field = name;
            return Err(to_py_err(kvplan_core::PlanError::ListLength {
                field,
                len,
                expected: n,
            }));
        }
    }
    channels
        .into_iter()
        .zip(rows)
        .zip(groups)
        .enumerate()
        .map(|(i, ((c, r), g))| {
            kvplan_core::StateChannels::new(c, r, g.as_deref().unwrap_or(&[]))
                .map(Some)
                .map_err(|err| {
                    let groups = g.as_deref().map_or("None".to_owned(), |g| format!("{g:?}"));
                    to_py_err(in_entry(
                        err,
                        &format!(
                            "entry {} (channels[{i}] = {c}, outer_rows[{i}] = {r}, \
                             shard_groups[{i}] = {groups})",
                            first + i
                        ),
                    ))
                })
        })
        .collect()
}

/// `err` with `context` (which entry, which values) before its message; the error's kind and
/// class are unchanged.
fn in_entry(err: kvplan_core::PlanError, context: &str) -> kvplan_core::PlanError {
    match err {
        kvplan_core::PlanError::InvalidLayout { what } => kvplan_core::PlanError::InvalidLayout {
            what: format!("{context}: {what}"),
        },
        other => other,
    }
}
