//! `window_pages=` of `Template.plan`: each side's pages of a window pool, borrowed and
//! checked against the dtype of that side's pages, with the names errors give them.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::input::{IndexArray, IndexSlice, WindowSlices};

/// The argument names of the two window page lists, for errors.
const WINDOW_NAMES: (&str, &str) = ("window_pages[0]", "window_pages[1]");

/// Each side's window page array, or `None` for a side without a window pool.
pub(crate) struct WindowPages<'py>(Option<IndexArray<'py>>, Option<IndexArray<'py>>);

impl<'py> WindowPages<'py> {
    /// `window_pages=`: `None`, or a `(src, dst)` tuple of index arrays or `None`s, borrowed.
    pub(crate) fn extract(window_pages: Option<&Bound<'py, PyAny>>) -> PyResult<Self> {
        let Some(obj) = window_pages.filter(|o| !o.is_none()) else {
            return Ok(Self(None, None));
        };
        let shape_error = || {
            PyTypeError::new_err(format!(
                "window_pages must be None or a tuple (src, dst) of two index arrays (or None for \
                 a side without a window pool), got {}",
                obj.repr().map_or_else(|_| "?".into(), |r| r.to_string())
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
        Ok(Self(side(0, WINDOW_NAMES.0)?, side(1, WINDOW_NAMES.1)?))
    }

    /// The window slices of a request whose pages are `pages` (each side's dtype checked).
    pub(crate) fn slices(
        &self,
        pages: (IndexSlice<'_>, IndexSlice<'_>),
    ) -> PyResult<WindowSlices<'_>> {
        WindowSlices::new(
            pages,
            (
                slice(self.0.as_ref(), WINDOW_NAMES.0)?,
                slice(self.1.as_ref(), WINDOW_NAMES.1)?,
            ),
        )
    }

    /// The arrays given, with their argument names (inputs an `out=` array must not overlap).
    pub(crate) fn named(&self) -> impl Iterator<Item = (&IndexArray<'py>, &'static str)> {
        [
            self.0.as_ref().map(|a| (a, WINDOW_NAMES.0)),
            self.1.as_ref().map(|a| (a, WINDOW_NAMES.1)),
        ]
        .into_iter()
        .flatten()
    }
}

/// One side's window slice, when that side has a window pool.
fn slice<'a>(array: Option<&'a IndexArray<'_>>, name: &str) -> PyResult<Option<IndexSlice<'a>>> {
    array.map(|a| a.as_slice(name)).transpose()
}
