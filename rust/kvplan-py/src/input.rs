//! Argument conversion: index arrays taken zero-copy as int32 or int64 slices, and entry pair
//! lists handed back as `(n, 2)` int64 arrays.

use kvplan_core::{Indices, POOLS, PageIndex, PlanError, PoolId, Request};
use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayDescrMethods, PyArrayMethods, PyReadonlyArray1,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::{KvPlanError, to_py_err};

/// A borrowed 1-D index array of either supported dtype (kept alive by the borrow).
pub(crate) enum IndexArray<'py> {
    I32(PyReadonlyArray1<'py, i32>),
    I64(PyReadonlyArray1<'py, i64>),
}

/// A request's two borrowed index arrays (prefill pages, decode pages) and their argument
/// names, so every entry point borrows and checks them the same way.
pub(crate) struct RequestArrays<'py> {
    src: IndexArray<'py>,
    dst: IndexArray<'py>,
    names: (&'static str, &'static str),
}

impl<'py> RequestArrays<'py> {
    /// Borrows both arrays (see [`IndexArray::extract`]); `names` are the argument names the
    /// errors cite.
    pub(crate) fn extract(
        src: &Bound<'py, PyAny>,
        dst: &Bound<'py, PyAny>,
        names: (&'static str, &'static str),
    ) -> PyResult<Self> {
        Ok(Self {
            src: IndexArray::extract(src, names.0)?,
            dst: IndexArray::extract(dst, names.1)?,
            names,
        })
    }

    /// Both arrays with their argument names.
    pub(crate) fn named(&self) -> [(&IndexArray<'py>, &'static str); 2] {
        [(&self.src, self.names.0), (&self.dst, self.names.1)]
    }

    /// Both arrays as slices (see [`IndexArray::as_slice`]).
    pub(crate) fn slices(&self) -> PyResult<(IndexSlice<'_>, IndexSlice<'_>)> {
        Ok((
            self.src.as_slice(self.names.0)?,
            self.dst.as_slice(self.names.1)?,
        ))
    }
}

/// A plain slice view of an [`IndexArray`]; `Send`, so it may cross into `Python::detach`.
#[derive(Clone, Copy)]
pub(crate) enum IndexSlice<'a> {
    I32(&'a [i32]),
    I64(&'a [i64]),
}

impl<'py> IndexArray<'py> {
    /// Borrows `obj` as a 1-D C-contiguous int32 or int64 numpy array, or raises a `TypeError`
    /// that names the argument and what it was.
    pub(crate) fn extract(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Self> {
        // `cast` checks type, ndim and dtype without building a Python exception on failure,
        // which matters for the per-call overhead of small requests.
        let borrow_error = |_| {
            PyTypeError::new_err(format!(
                "{name} is being written elsewhere (mutably borrowed)"
            ))
        };
        // int32 first: SGLang's page tables are int32.
        if let Ok(array) = obj.cast::<PyArray1<i32>>() {
            return Ok(IndexArray::I32(array.try_readonly().map_err(borrow_error)?));
        }
        if let Ok(array) = obj.cast::<PyArray1<i64>>() {
            return Ok(IndexArray::I64(array.try_readonly().map_err(borrow_error)?));
        }
        let (what, advice) = match obj.cast::<PyUntypedArray>() {
            Ok(array) => {
                let dtype = array.dtype();
                // Unsigned arrays are refused rather than range-checked: a uint64 index of
                // 2**63 or more has no int64 value to report or plan with, and accepting only
                // the small ones would make a dtype valid or not depending on the data.
                let advice = if dtype.kind() == b'u' {
                    "; unsigned dtypes are not accepted: check the values are below 2**63 and \
                     convert with .astype(np.int64)"
                } else {
                    ""
                };
                (
                    format!("a {}-D numpy array of dtype {}", array.ndim(), dtype.str()?),
                    advice,
                )
            }
            Err(_) => (format!("{}", obj.get_type().name()?), ""),
        };
        Err(PyTypeError::new_err(format!(
            "{name} must be a 1-D numpy array of dtype int32 or int64 (native byte order), got {what}{advice}"
        )))
    }

    /// The slice view; a `TypeError` for non-contiguous or misaligned arrays (no hidden copy),
    /// whose advice produces an array that is accepted.
    pub(crate) fn as_slice(&self, name: &str) -> PyResult<IndexSlice<'_>> {
        let layout_error = |_| self.layout_error(name);
        Ok(match self {
            IndexArray::I32(a) => IndexSlice::I32(a.as_slice().map_err(layout_error)?),
            IndexArray::I64(a) => IndexSlice::I64(a.as_slice().map_err(layout_error)?),
        })
    }

    /// Why the array has no slice view. A C-contiguous array can still be misaligned (e.g.
    /// `np.frombuffer(raw, np.int64, offset=1)`), and np.ascontiguousarray returns such an
    /// array unchanged, so that case gets advice of its own.
    #[cold]
    fn layout_error(&self, name: &str) -> PyErr {
        let (aligned, itemsize) = match self {
            IndexArray::I32(a) => (a.is_aligned(), 4),
            IndexArray::I64(a) => (a.is_aligned(), 8),
        };
        if aligned {
            PyTypeError::new_err(format!(
                "{name} must be C-contiguous (use np.ascontiguousarray)"
            ))
        } else {
            PyTypeError::new_err(format!(
                "{name} is unaligned (its data address is not a multiple of {itemsize}, e.g. \
                 np.frombuffer at an odd offset); pass an aligned copy: {name}.copy()"
            ))
        }
    }

    /// The address range `[start, end)` of the array's data (the array is contiguous: call
    /// after [`IndexArray::as_slice`] succeeded).
    pub(crate) fn byte_range(&self) -> (usize, usize) {
        let (ptr, bytes) = match self {
            IndexArray::I32(a) => (a.data() as usize, a.len() * 4),
            IndexArray::I64(a) => (a.data() as usize, a.len() * 8),
        };
        (ptr, ptr + bytes)
    }
}

/// Work that is generic over the two index dtypes of a request.
pub(crate) trait IndexVisitor {
    type Output;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output;

    /// With each side's pages of each further pool, in the element type of that side's pages
    /// (only a request visitor reads them).
    fn visit_windowed<S: PageIndex, D: PageIndex>(
        self,
        src: &[S],
        dst: &[D],
        _pools: PoolSides<'_, S, D>,
    ) -> Self::Output
    where
        Self: Sized,
    {
        self.visit(src, dst)
    }
}

/// Calls `visitor` with the concrete slice types (four monomorphised variants).
pub(crate) fn dispatch<V: IndexVisitor>(
    src: IndexSlice<'_>,
    dst: IndexSlice<'_>,
    visitor: V,
) -> V::Output {
    match (src, dst) {
        (IndexSlice::I32(s), IndexSlice::I32(d)) => visitor.visit(s, d),
        (IndexSlice::I32(s), IndexSlice::I64(d)) => visitor.visit(s, d),
        (IndexSlice::I64(s), IndexSlice::I32(d)) => visitor.visit(s, d),
        (IndexSlice::I64(s), IndexSlice::I64(d)) => visitor.visit(s, d),
    }
}

/// Calls `visitor` with the concrete slice types and each side's window pages, which
/// [`WindowSlices::new`] checked to have the element type of that side's pages.
// Each pool's slices are read once, on the way to the visitor.
#[allow(clippy::large_types_passed_by_value)]
fn dispatch_windowed<V: IndexVisitor>(
    src: IndexSlice<'_>,
    dst: IndexSlice<'_>,
    window: WindowSlices<'_>,
    visitor: V,
) -> V::Output {
    // A window slice of the other element type cannot reach here (checked at construction);
    // were it to, it would read as no pages: a typed error about missing pages, never a copy.
    fn i32s(w: IndexSlice<'_>) -> &[i32] {
        match w {
            IndexSlice::I32(s) => s,
            IndexSlice::I64(_) => &[],
        }
    }
    fn i64s(w: IndexSlice<'_>) -> &[i64] {
        match w {
            IndexSlice::I64(s) => s,
            IndexSlice::I32(_) => &[],
        }
    }
    let pools = window.pools;
    match (src, dst) {
        (IndexSlice::I32(s), IndexSlice::I32(d)) => {
            visitor.visit_windowed(s, d, pools.map(|(ws, wd)| (ws.map(i32s), wd.map(i32s))))
        }
        (IndexSlice::I32(s), IndexSlice::I64(d)) => {
            visitor.visit_windowed(s, d, pools.map(|(ws, wd)| (ws.map(i32s), wd.map(i64s))))
        }
        (IndexSlice::I64(s), IndexSlice::I32(d)) => {
            visitor.visit_windowed(s, d, pools.map(|(ws, wd)| (ws.map(i64s), wd.map(i32s))))
        }
        (IndexSlice::I64(s), IndexSlice::I64(d)) => {
            visitor.visit_windowed(s, d, pools.map(|(ws, wd)| (ws.map(i64s), wd.map(i64s))))
        }
    }
}

/// Each side's page list of each further pool, in the element type of that side's pages
/// (place 0, the request's own pages, stays `(None, None)`).
pub(crate) type PoolSides<'a, S, D> = [(Option<&'a [S]>, Option<&'a [D]>); POOLS];

/// A request's pages of each further pool: each side's, for a side that keeps that pool (pool
/// 1: a window pool's window pages), in the element type of that side's pages.
#[derive(Clone, Copy, Default)]
pub(crate) struct WindowSlices<'a> {
    pools: [(Option<IndexSlice<'a>>, Option<IndexSlice<'a>>); POOLS],
}

impl<'a> WindowSlices<'a> {
    /// Sets pool `id`'s pages of each side, checked to have the dtype of that side's pages
    /// (`pages`): one request, one index type per side, so nothing is converted.
    pub(crate) fn set(
        &mut self,
        id: usize,
        pages: (IndexSlice<'_>, IndexSlice<'_>),
        lists: (Option<IndexSlice<'a>>, Option<IndexSlice<'a>>),
        names: (&str, &str),
    ) -> PyResult<()> {
        let check = |name: &str, side: &str, main: IndexSlice<'_>, w: Option<IndexSlice<'a>>| match (
            main, w,
        ) {
            (IndexSlice::I32(_), Some(IndexSlice::I64(_)))
            | (IndexSlice::I64(_), Some(IndexSlice::I32(_))) => Err(PyTypeError::new_err(format!(
                "{name} must have the dtype of the {side} pages ({}), got {}",
                main.dtype_name(),
                w.map_or("none", IndexSlice::dtype_name)
            ))),
            _ => Ok(w),
        };
        self.pools[id] = (
            check(names.0, "source", pages.0, lists.0)?,
            check(names.1, "destination", pages.1, lists.1)?,
        );
        Ok(())
    }

    /// Each further pool's pages of each side (`None` for a side without that pool).
    pub(crate) fn pools(self) -> [(Option<IndexSlice<'a>>, Option<IndexSlice<'a>>); POOLS] {
        self.pools
    }
}

impl IndexSlice<'_> {
    fn dtype_name(self) -> &'static str {
        match self {
            IndexSlice::I32(_) => "int32",
            IndexSlice::I64(_) => "int64",
        }
    }

    fn len(self) -> usize {
        match self {
            IndexSlice::I32(s) => s.len(),
            IndexSlice::I64(s) => s.len(),
        }
    }
}

/// Requests with fewer index pairs than this are planned without releasing the GIL: for a
/// handful of pages, releasing and re-acquiring it costs more than the planning itself.
const DETACH_MIN_PAGES: usize = 1024;

/// Runs `visitor` over two index arrays, with the GIL released unless they are tiny.
pub(crate) fn visit_request<V>(
    py: Python<'_>,
    src: IndexSlice<'_>,
    dst: IndexSlice<'_>,
    visitor: V,
) -> V::Output
where
    V: IndexVisitor + Send,
    V::Output: Send,
{
    if src.len().max(dst.len()) < DETACH_MIN_PAGES {
        dispatch(src, dst, visitor)
    } else {
        py.detach(|| dispatch(src, dst, visitor))
    }
}

/// One core planner call on a request, generic over the request's index dtypes.
pub(crate) trait RequestPlanner {
    type Output;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output;
}

/// A request's token arguments as Python passes them: `n_tokens`, `skip_tokens` (the
/// leading tokens a delta request does not move) and the window pages of each side whose
/// window entries keep a pool of their own.
#[derive(Clone, Copy, Default)]
pub(crate) struct TokenArgs<'a> {
    pub(crate) n_tokens: Option<u64>,
    pub(crate) skip_tokens: u64,
    pub(crate) window: WindowSlices<'a>,
    /// Per further pool, its own `(n_tokens, skip_tokens)` (`None`: the request's).
    pub(crate) pool_tokens: [Option<(u64, u64)>; POOLS],
    /// The state slot a page request carries too (`None`: none).
    pub(crate) state_slot: Option<(i64, i64)>,
}

impl From<Option<u64>> for TokenArgs<'static> {
    fn from(n_tokens: Option<u64>) -> Self {
        Self {
            n_tokens,
            ..Self::default()
        }
    }
}

/// The core's request from two index arrays and its token arguments, for a planner.
struct WithRequest<'a, P>(P, TokenArgs<'a>);

impl<P: RequestPlanner> IndexVisitor for WithRequest<'_, P> {
    type Output = P::Output;
    fn visit<S: PageIndex, D: PageIndex>(self, src: &[S], dst: &[D]) -> Self::Output {
        self.visit_windowed(src, dst, [(None, None); POOLS])
    }

    fn visit_windowed<S: PageIndex, D: PageIndex>(
        self,
        src: &[S],
        dst: &[D],
        window: PoolSides<'_, S, D>,
    ) -> Self::Output {
        let tokens = self.1;
        let pages = Indices::Pages { src, dst };
        let mut request = core_request(pages, tokens.n_tokens, tokens.skip_tokens, window);
        request.pool_tokens = tokens.pool_tokens;
        request.state_slot = tokens.state_slot;
        self.0.plan(&request)
    }
}

/// The one path from a Python request to a core planner: the index arrays (borrowed without
/// copying) and the token arguments become one `Request`, planned with the GIL released unless
/// tiny.
pub(crate) fn plan_request<'a, P>(
    py: Python<'_>,
    (src, dst): (IndexSlice<'_>, IndexSlice<'_>),
    tokens: impl Into<TokenArgs<'a>>,
    planner: P,
) -> P::Output
where
    P: RequestPlanner + Send,
    P::Output: Send,
{
    let tokens = tokens.into();
    let visitor = WithRequest(planner, tokens);
    if src.len().max(dst.len()) < DETACH_MIN_PAGES {
        dispatch_windowed(src, dst, tokens.window, visitor)
    } else {
        py.detach(|| dispatch_windowed(src, dst, tokens.window, visitor))
    }
}

/// The core's request from its Python parts: the one conversion every planner method (one
/// request's or a batch's, `kvplan.Request` or loose arguments) goes through.
pub(crate) fn core_request<'a, S: PageIndex, D: PageIndex>(
    indices: Indices<'a, S, D>,
    n_tokens: Option<u64>,
    skip_tokens: u64,
    pools: PoolSides<'a, S, D>,
) -> Request<'a, S, D> {
    let mut request = Request {
        indices,
        n_tokens,
        skip_tokens,
        pool_pages: Default::default(),
        pool_tokens: [None; POOLS],
        state_slot: None,
    };
    for (pool, (src, dst)) in PoolId::ALL.into_iter().zip(pools).skip(1) {
        request = request.with_pool_pages(pool, src, dst);
    }
    request
}

/// A state slot request (`src`, `dst` slots) planned by `planner`: slots index no arrays, so
/// nothing is borrowed and the GIL is kept (the work is one block per state pair).
pub(crate) fn plan_slot_request<P: RequestPlanner>(
    (src, dst): (i64, i64),
    n_tokens: Option<u64>,
    skip_tokens: u64,
    planner: P,
) -> P::Output {
    let slot: Indices<'_, i64, i64> = Indices::Slot { src, dst };
    planner.plan(&core_request(
        slot,
        n_tokens,
        skip_tokens,
        [(None, None); POOLS],
    ))
}

/// `(n, 2)` int64 array of entry pairs; an index beyond int64 (only reachable with bare counts
/// of 2**63 or more) is an error, never a negative index.
pub(crate) fn pairs_array(
    py: Python<'_>,
    pairs: impl ExactSizeIterator<Item = [usize; 2]>,
) -> PyResult<Bound<'_, PyArray2<i64>>> {
    let n = pairs.len();
    // The pair count can come from bare integers (legacy_pp_pairs): this copy may not fit even
    // when the core's own list did, and must then raise, not abort.
    let values = n.saturating_mul(2);
    let mut flat: Vec<i64> = Vec::new();
    flat.try_reserve_exact(values)
        .map_err(|_| to_py_err(PlanError::out_of_memory::<i64>("entry pairs", values)))?;
    for [i, j] in pairs {
        let (Ok(i), Ok(j)) = (i64::try_from(i), i64::try_from(j)) else {
            return Err(KvPlanError::new_err("an entry index does not fit int64"));
        };
        flat.extend_from_slice(&[i, j]);
    }
    Ok(Array2::from_shape_vec((n, 2), flat)
        .expect("two columns by construction")
        .into_pyarray(py))
}

/// An `(addr, size)` memory region argument (`pack=`, `src_staging=`, `dst_staging=`) as two
/// u64 values. Shape problems are a `TypeError` naming the argument, the expected shape and
/// what was given (PyO3's own tuple conversion raises a bare `ValueError` naming neither); an
/// int outside `0..2**64` is an `OverflowError` naming the argument and the value.
fn region_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<(u64, u64)> {
    use pyo3::exceptions::PyOverflowError;
    use pyo3::types::{PyInt, PyTuple};
    let expected = "a tuple (addr, size) of two ints";
    let Ok(tuple) = obj.cast::<PyTuple>() else {
        let kind = obj.get_type().name()?;
        return Err(PyTypeError::new_err(format!(
            "{name} must be {expected}, got {kind}"
        )));
    };
    let items: Vec<Bound<'_, PyAny>> = tuple.iter().collect();
    if items.len() != 2 {
        return Err(PyTypeError::new_err(format!(
            "{name} must be {expected}, got a tuple of {} item{}",
            items.len(),
            if items.len() == 1 { "" } else { "s" }
        )));
    }
    let value = |k: usize, field: &str| -> PyResult<u64> {
        let item = &items[k];
        if !item.is_instance_of::<PyInt>() {
            let kind = item.get_type().name()?;
            return Err(PyTypeError::new_err(format!(
                "{name} must be {expected}: its {field} is a {kind}"
            )));
        }
        item.extract::<u64>().map_err(|_| {
            PyOverflowError::new_err(format!(
                "{name}'s {field} must be an int in 0..2**64, got {}",
                item.repr()
                    .map_or_else(|_| "?".to_string(), |r| r.to_string())
            ))
        })
    };
    Ok((value(0, "addr")?, value(1, "size")?))
}

/// `pack=(addr, size)` (see [`region_arg`]).
pub(crate) fn pack_arg(obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    region_arg(obj, "pack")
}

/// `staging=(addr, size)` of a conversion plan (see [`region_arg`]).
pub(crate) fn staging_arg(obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    region_arg(obj, "staging")
}

/// `src_staging=(addr, size)` (see [`region_arg`]).
pub(crate) fn src_staging_arg(obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    region_arg(obj, "src_staging")
}

/// `dst_staging=(addr, size)` (see [`region_arg`]).
pub(crate) fn dst_staging_arg(obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    region_arg(obj, "dst_staging")
}

/// `src_arena=(addr, size)` (see [`region_arg`]).
pub(crate) fn src_arena_arg(obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    region_arg(obj, "src_arena")
}

/// `dst_arena=(addr, size)` (see [`region_arg`]).
pub(crate) fn dst_arena_arg(obj: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    region_arg(obj, "dst_arena")
}
