//! `window_pages=` and `pool_pages=` of a request: each side's pages of its layout's further
//! pools (pool 1, a window pool, as `window_pages=`), borrowed and checked against the dtype of
//! that side's pages, with the names errors give them.

use kvplan_core::POOLS;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::KvPlanError;

use crate::input::{IndexArray, IndexSlice, WindowSlices};

/// The argument names of each pool's two page lists, for errors: pool 1's as `window_pages=`
/// gives them, the others' (and pool 1's given in `pool_pages=`) as `pool_pages=` does.
const WINDOW_NAMES: (&str, &str) = ("window_pages[0]", "window_pages[1]");
const POOL_NAMES: [(&str, &str); POOLS] = [
    ("pool_pages[0][0]", "pool_pages[0][1]"),
    ("pool_pages[1][0]", "pool_pages[1][1]"),
    ("pool_pages[2][0]", "pool_pages[2][1]"),
    ("pool_pages[3][0]", "pool_pages[3][1]"),
    ("pool_pages[4][0]", "pool_pages[4][1]"),
    ("pool_pages[5][0]", "pool_pages[5][1]"),
    ("pool_pages[6][0]", "pool_pages[6][1]"),
    ("pool_pages[7][0]", "pool_pages[7][1]"),
];

/// One further pool's page arrays: its id, each side's array (`None` for a side without the
/// pool) and their argument names.
type PoolArrays<'py> = (
    usize,
    Option<IndexArray<'py>>,
    Option<IndexArray<'py>>,
    (&'static str, &'static str),
);

/// Each side's page arrays of each further pool given (pool 1 also as `window_pages=`).
pub(crate) struct WindowPages<'py>(Vec<PoolArrays<'py>>);

impl<'py> WindowPages<'py> {
    /// `window_pages=` only (the loose form of the planner methods).
    pub(crate) fn extract(window_pages: Option<&Bound<'py, PyAny>>) -> PyResult<Self> {
        Self::extract_pools(window_pages, None)
    }

    /// `window_pages=` (pool 1's pages) and `pool_pages=` (a dict from pool id, 1 to
    /// `POOLS - 1`, to a `(src, dst)` tuple of index arrays or `None`s), borrowed.
    pub(crate) fn extract_pools(
        window_pages: Option<&Bound<'py, PyAny>>,
        pool_pages: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let mut pools = Vec::new();
        if let Some(obj) = window_pages.filter(|o| !o.is_none()) {
            let (src, dst) = pair(obj, "window_pages", WINDOW_NAMES)?;
            pools.push((1, src, dst, WINDOW_NAMES));
        }
        let Some(obj) = pool_pages.filter(|o| !o.is_none()) else {
            return Ok(Self(pools));
        };
        let dict = obj.cast::<PyDict>().map_err(|_| {
            PyTypeError::new_err(format!(
                "pool_pages must be None or a dict {{pool id: (src, dst)}}, got {}",
                short(obj)
            ))
        })?;
        for (key, value) in dict.iter() {
            let id = key
                .extract::<i64>()
                .ok()
                .filter(|&k| (1..POOLS as i64).contains(&k));
            let Some(id) = id else {
                return Err(KvPlanError::new_err(format!(
                    "pool_pages key {} is not a further pool id: pools are numbered 1 to {} \
                     (pool 0 is the request's own pages, src and dst)",
                    short(&key),
                    POOLS - 1
                )));
            };
            let id = id as usize;
            if pools.iter().any(|p| p.0 == id) {
                return Err(PyTypeError::new_err(
                    "pool 1's pages were given both as window_pages and in pool_pages; give \
                     them once",
                ));
            }
            let (src, dst) = pair(&value, "a pool_pages value", POOL_NAMES[id])?;
            pools.push((id, src, dst, POOL_NAMES[id]));
        }
        pools.sort_by_key(|p| p.0);
        Ok(Self(pools))
    }

    /// Each further pool's slices of a request whose pages are `pages` (each side's dtype
    /// checked).
    pub(crate) fn slices(
        &self,
        pages: (IndexSlice<'_>, IndexSlice<'_>),
    ) -> PyResult<WindowSlices<'_>> {
        let mut out = WindowSlices::default();
        for (id, src, dst, names) in &self.0 {
            out.set(
                *id,
                pages,
                (slice(src.as_ref(), names.0)?, slice(dst.as_ref(), names.1)?),
                *names,
            )?;
        }
        Ok(out)
    }

    /// The arrays given, with their argument names (inputs an `out=` array must not overlap).
    pub(crate) fn named(&self) -> impl Iterator<Item = (&IndexArray<'py>, &'static str)> {
        self.0.iter().flat_map(|(_, src, dst, names)| {
            [
                src.as_ref().map(|a| (a, names.0)),
                dst.as_ref().map(|a| (a, names.1)),
            ]
            .into_iter()
            .flatten()
        })
    }
}

/// A `(src, dst)` tuple of index arrays or `None`s (`what`: its name in errors).
fn pair<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    names: (&str, &str),
) -> PyResult<(Option<IndexArray<'py>>, Option<IndexArray<'py>>)> {
    let shape_error = || {
        PyTypeError::new_err(format!(
            "{what} must be None or a tuple (src, dst) of two index arrays (or None for a side \
             without that pool), got {}",
            short(obj)
        ))
    };
    let tuple = obj.cast::<PyTuple>().map_err(|_| shape_error())?;
    if tuple.len() != 2 {
        return Err(shape_error());
    }
    let side = |k: usize, name: &str| -> PyResult<Option<IndexArray<'py>>> {
        let item = tuple.get_item(k)?;
        if item.is_none() {
            return Ok(None);
        }
        IndexArray::extract(&item, name).map(Some)
    };
    Ok((side(0, names.0)?, side(1, names.1)?))
}

fn short(obj: &Bound<'_, PyAny>) -> String {
    obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
}

/// One side's pool slice, when that side has the pool.
fn slice<'a>(array: Option<&'a IndexArray<'_>>, name: &str) -> PyResult<Option<IndexSlice<'a>>> {
    array.map(|a| a.as_slice(name)).transpose()
}
