//! `kvplan.Request`: one transfer request as a value (each side's pages, a state slot, or both, with
//! its window pages and token range), and [`RequestInput`], what every planner method reads
//! from either a `Request` or its loose arguments before the one conversion into the core's
//! request (`input::plan_request`).
//!
//! A `Request` keeps the caller's arrays (a reference, never a copy) and checks at
//! construction what needs no template: dtypes, memory layout, the window pages' dtypes,
//! non-negative counts and slots, and `skip_tokens` within `n_tokens`. Which planner plans
//! which request feature is the core's answer (`Template::admit`), not this module's.

use numpy::{PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyTuple};

use crate::errors::{IndexBoundsError, KvPlanError, short_repr};
use crate::input::{
    IndexArray, RequestArrays, RequestPlanner, TokenArgs, plan_request, plan_slot_request,
};
use crate::window_pages::WindowPages;

/// The argument names a `Request`'s page arrays have in errors.
const PAGE_NAMES: (&str, &str) = ("Request.src", "Request.dst");

/// One transfer request: each side's pages (or one state slot per side), each side's pages of
/// each further pool (a window pool's as window pages), and the token range (`n_tokens`,
/// `skip_tokens`).
#[pyclass(frozen, name = "Request", module = "kvplan._core")]
pub struct PyRequest {
    /// The caller's `(src, dst)` page arrays, held as given.
    pages: Option<(Py<PyAny>, Py<PyAny>)>,
    /// The caller's `(src, dst)` window page tuple, held as given.
    window_pages: Option<Py<PyAny>>,
    /// The caller's `{pool id: (src, dst)}` dict, held as given.
    pool_pages: Option<Py<PyAny>>,
    slot: Option<(i64, i64)>,
    n_tokens: Option<u64>,
    skip_tokens: u64,
    /// Per further pool, its own `(n_tokens, skip_tokens)` (`None`: the request's range).
    pool_tokens: [Option<(u64, u64)>; kvplan_core::POOLS],
}

/// A count argument: a non-negative int, named with its value when it is not one.
fn count_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<u64> {
    if !obj.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be a non-negative int, got {}",
            obj.get_type().name()?
        )));
    }
    obj.extract::<u64>().map_err(|_| {
        KvPlanError::new_err(format!(
            "{name} must be a non-negative int below 2**64, got {}",
            short_repr(obj)
        ))
    })
}

/// `slot=(src_slot, dst_slot)`: two non-negative ints.
fn slot_arg(obj: &Bound<'_, PyAny>) -> PyResult<(i64, i64)> {
    let shape_error = || {
        PyTypeError::new_err(format!(
            "slot must be a tuple (src_slot, dst_slot) of two ints, got {}",
            short_repr(obj)
        ))
    };
    let tuple = obj.cast::<PyTuple>().map_err(|_| shape_error())?;
    if tuple.len() != 2 {
        return Err(shape_error());
    }
    let side = |k: usize| -> PyResult<i64> {
        let item = tuple.get_item(k)?;
        if !item.is_instance_of::<PyInt>() {
            return Err(shape_error());
        }
        let value = item.extract::<i64>().map_err(|_| {
            IndexBoundsError::new_err(format!(
                "slot[{k}] must be an int in 0..2**63, got {}",
                short_repr(&item)
            ))
        })?;
        if value < 0 {
            return Err(IndexBoundsError::new_err(format!(
                "slot[{k}] must be non-negative, got {value}"
            )));
        }
        Ok(value)
    };
    Ok((side(0)?, side(1)?))
}

/// `int64[8]`: an array's dtype and length, for the repr.
fn array_summary(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<PyUntypedArray>() {
        Ok(array) => {
            let dtype = array.dtype();
            let name = dtype
                .getattr("name")
                .map_or_else(|_| "?".into(), |n| n.to_string());
            format!("{name}[{}]", array.len())
        }
        Err(_) => "None".into(),
    }
}

/// `pool_tokens={pool id: (n_tokens, skip_tokens)}`: per further pool (1..POOLS), its own
/// token range; the request's own pages (pool 0) keep `n_tokens`/`skip_tokens`.
fn pool_tokens_arg(obj: &Bound<'_, PyAny>) -> PyResult<[Option<(u64, u64)>; kvplan_core::POOLS]> {
    let dict = obj.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "pool_tokens must be a dict {{pool id: (n_tokens, skip_tokens)}}, got {}",
            short_repr(obj)
        ))
    })?;
    let mut ranges = [None; kvplan_core::POOLS];
    for (key, value) in dict.iter() {
        let pool = count_arg(&key, "a pool_tokens pool id")?;
        if pool == 0 || pool >= kvplan_core::POOLS as u64 {
            return Err(KvPlanError::new_err(format!(
                "pool_tokens pool id {pool} is not a further pool (1..{}); pool 0's range is the \
                 request's n_tokens and skip_tokens",
                kvplan_core::POOLS - 1
            )));
        }
        let shape_error = || {
            PyTypeError::new_err(format!(
                "pool_tokens[{pool}] must be a tuple (n_tokens, skip_tokens) of two ints, got {}",
                short_repr(&value)
            ))
        };
        let tuple = value.cast::<PyTuple>().map_err(|_| shape_error())?;
        if tuple.len() != 2 {
            return Err(shape_error());
        }
        let n = count_arg(
            &tuple.get_item(0)?,
            &format!("pool_tokens[{pool}] n_tokens"),
        )?;
        let k = count_arg(
            &tuple.get_item(1)?,
            &format!("pool_tokens[{pool}] skip_tokens"),
        )?;
        if k > n {
            return Err(KvPlanError::new_err(format!(
                "pool_tokens[{pool}]: skip_tokens {k} is past its {n} tokens (n_tokens)"
            )));
        }
        ranges[pool as usize] = Some((n, k));
    }
    Ok(ranges)
}

#[pymethods]
impl PyRequest {
    #[new]
    #[pyo3(signature = (src=None, dst=None, *, window_pages=None, pool_pages=None, slot=None, n_tokens=None, skip_tokens=None, pool_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn new<'py>(
        src: Option<&Bound<'py, PyAny>>,
        dst: Option<&Bound<'py, PyAny>>,
        window_pages: Option<&Bound<'py, PyAny>>,
        pool_pages: Option<&Bound<'py, PyAny>>,
        slot: Option<&Bound<'py, PyAny>>,
        n_tokens: Option<&Bound<'py, PyAny>>,
        skip_tokens: Option<&Bound<'py, PyAny>>,
        pool_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let given = |o: Option<&Bound<'py, PyAny>>| o.filter(|o| !o.is_none()).cloned();
        let (src, dst) = (given(src), given(dst));
        let window_pages = given(window_pages);
        let pool_pages = given(pool_pages);
        let slot = given(slot).map(|s| slot_arg(&s)).transpose()?;
        let n_tokens = given(n_tokens)
            .map(|n| count_arg(&n, "n_tokens"))
            .transpose()?;
        let skip_tokens = given(skip_tokens)
            .map(|k| count_arg(&k, "skip_tokens"))
            .transpose()?
            .unwrap_or(0);
        let pool_tokens_given = given(pool_tokens);
        let pool_tokens = pool_tokens_given
            .as_ref()
            .map(pool_tokens_arg)
            .transpose()?
            .unwrap_or([None; kvplan_core::POOLS]);
        let pages = match (src, dst) {
            (Some(src), Some(dst)) => Some((src, dst)),
            (None, None) => None,
            (src, _) => {
                let (has, lacks) = if src.is_some() {
                    ("src", "dst")
                } else {
                    ("dst", "src")
                };
                return Err(PyTypeError::new_err(format!(
                    "Request got {has} pages but no {lacks} pages; give both sides' page arrays"
                )));
            }
        };
        // Pages and a slot together are a hybrid model's whole request: its pages, then its
        // state slots (and ring rows) in one plan.
        if pages.is_none() && slot.is_none() {
            return Err(PyTypeError::new_err(
                "Request needs page arrays (src, dst) or a state slot (slot=(src_slot, dst_slot))",
            ));
        }
        if pages.is_none() && window_pages.is_some() {
            return Err(PyTypeError::new_err(
                "Request got window_pages for a state slot; window pages belong to a page request",
            ));
        }
        if pages.is_none() && pool_tokens_given.is_some() {
            return Err(PyTypeError::new_err(
                "Request got pool_tokens for a state slot; pool token ranges belong to a page \
                 request",
            ));
        }
        if pages.is_none() && pool_pages.is_some() {
            return Err(PyTypeError::new_err(
                "Request got pool_pages for a state slot; pool pages belong to a page request",
            ));
        }
        if let Some(n) = n_tokens
            && skip_tokens > n
        {
            return Err(KvPlanError::new_err(format!(
                "skip_tokens {skip_tokens} is past the request's {n} tokens (n_tokens): the \
                 decode cannot hold more tokens than the request has"
            )));
        }
        if let Some((src, dst)) = &pages {
            // Borrowed once to check dtype, layout and the window pages' dtypes now, where the
            // error points at the construction; planning borrows them again.
            let arrays = RequestArrays::extract(src, dst, PAGE_NAMES)?;
            let window = WindowPages::extract_pools(window_pages.as_ref(), pool_pages.as_ref())?;
            window.slices(arrays.slices()?)?;
        }
        Ok(Self {
            pages: pages.map(|(s, d)| (s.unbind(), d.unbind())),
            window_pages: window_pages.map(Bound::unbind),
            pool_pages: pool_pages.map(Bound::unbind),
            slot,
            n_tokens,
            skip_tokens,
            pool_tokens,
        })
    }

    /// Each further pool's own `(n_tokens, skip_tokens)`, by pool id; `None` when no pool
    /// has a range of its own.
    #[getter]
    fn pool_tokens(&self) -> Option<std::collections::BTreeMap<usize, (u64, u64)>> {
        let ranges: std::collections::BTreeMap<usize, (u64, u64)> = self
            .pool_tokens
            .iter()
            .enumerate()
            .filter_map(|(k, r)| r.map(|r| (k, r)))
            .collect();
        (!ranges.is_empty()).then_some(ranges)
    }

    /// The prefill (source) page array, the caller's own (not a copy); `None` for a slot.
    #[getter]
    fn src(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.pages.as_ref().map(|(s, _)| s.clone_ref(py))
    }

    /// The decode (destination) page array, the caller's own; `None` for a slot.
    #[getter]
    fn dst(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.pages.as_ref().map(|(_, d)| d.clone_ref(py))
    }

    /// `(src, dst)` window pages as given, or `None`.
    #[getter]
    fn window_pages(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.window_pages.as_ref().map(|w| w.clone_ref(py))
    }

    /// `{pool id: (src, dst)}` pool pages as given, or `None`.
    #[getter]
    fn pool_pages(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.pool_pages.as_ref().map(|w| w.clone_ref(py))
    }

    /// `(src_slot, dst_slot)` of a state slot request, or `None`.
    #[getter]
    fn slot(&self) -> Option<(i64, i64)> {
        self.slot
    }

    #[getter]
    fn n_tokens(&self) -> Option<u64> {
        self.n_tokens
    }

    #[getter]
    fn skip_tokens(&self) -> u64 {
        self.skip_tokens
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let mut parts = Vec::new();
        if let Some((src, dst)) = &self.pages {
            parts.push(format!("src={}", array_summary(src.bind(py))));
            parts.push(format!("dst={}", array_summary(dst.bind(py))));
        }
        if let Some(window) = &self.window_pages {
            let side = |k: usize| {
                window
                    .bind(py)
                    .get_item(k)
                    .map_or_else(|_| "?".into(), |a| array_summary(&a))
            };
            parts.push(format!("window_pages=({}, {})", side(0), side(1)));
        }
        if let Some(pools) = &self.pool_pages {
            parts.push(format!("pool_pages={}", short_repr(pools.bind(py))));
        }
        if let Some((s, d)) = self.slot {
            parts.push(format!("slot=({s}, {d})"));
        }
        if let Some(n) = self.n_tokens {
            parts.push(format!("n_tokens={n}"));
        }
        if let Some(ranges) = self.pool_tokens() {
            parts.push(format!("pool_tokens={ranges:?}"));
        }
        if self.skip_tokens > 0 {
            parts.push(format!("skip_tokens={}", self.skip_tokens));
        }
        format!("Request({})", parts.join(", "))
    }
}

/// The arguments after a method's request when `first` is a `kvplan.Request`: the request
/// takes one positional place where the old form takes two (`src_pages`, `dst_pages`), so
/// the method's next positional argument arrives as `dst_pages` and moves up
/// (`transfer_advice(request, cost)`). Returns `(dst_pages, next)`.
pub(crate) fn shift_after<'a, 'py>(
    first: &Bound<'py, PyAny>,
    dst_pages: Option<&'a Bound<'py, PyAny>>,
    next: Option<&'a Bound<'py, PyAny>>,
) -> (Option<&'a Bound<'py, PyAny>>, Option<&'a Bound<'py, PyAny>>) {
    if next.is_none() && first.cast::<PyRequest>().is_ok() {
        (None, dst_pages)
    } else {
        (dst_pages, next)
    }
}

/// A request as a planner method received it, borrowed: each side's pages (or a slot), the
/// window pages and the token range.
pub(crate) struct RequestInput<'py> {
    pub(crate) pages: Option<RequestArrays<'py>>,
    pub(crate) slot: (i64, i64),
    /// The state slot a page request carries too (`Request(src, dst, slot=...)`).
    pub(crate) state_slot: Option<(i64, i64)>,
    pub(crate) window: WindowPages<'py>,
    pub(crate) n_tokens: Option<u64>,
    pub(crate) skip_tokens: u64,
    pub(crate) pool_tokens: [Option<(u64, u64)>; kvplan_core::POOLS],
}

/// The loose token arguments of a planner method's old form (`None`/0 where it has none).
#[derive(Default)]
pub(crate) struct Loose<'a, 'py> {
    pub(crate) n_tokens: Option<u64>,
    pub(crate) skip_tokens: u64,
    pub(crate) window_pages: Option<&'a Bound<'py, PyAny>>,
}

impl<'py> RequestInput<'py> {
    /// A `kvplan.Request`'s parts, borrowed.
    pub(crate) fn of_request(request: &Bound<'py, PyRequest>) -> PyResult<Self> {
        let py = request.py();
        let r = request.get();
        let pages = match &r.pages {
            Some((src, dst)) => Some(RequestArrays::extract(
                src.bind(py),
                dst.bind(py),
                PAGE_NAMES,
            )?),
            None => None,
        };
        let window = r.window_pages.as_ref().map(|w| w.bind(py).clone());
        let pools = r.pool_pages.as_ref().map(|w| w.bind(py).clone());
        Ok(Self {
            pages,
            slot: r.slot.unwrap_or_default(),
            state_slot: r.slot.filter(|_| r.pages.is_some()),
            window: WindowPages::extract_pools(window.as_ref(), pools.as_ref())?,
            n_tokens: r.n_tokens,
            skip_tokens: r.skip_tokens,
            pool_tokens: r.pool_tokens,
        })
    }

    /// What `method` was given: `first` a `kvplan.Request` (then `dst` and the loose token
    /// arguments must be absent: the request carries them), or the old form's `src_pages`,
    /// `dst_pages` and token arguments.
    pub(crate) fn of_args(
        method: &str,
        first: &Bound<'py, PyAny>,
        dst: Option<&Bound<'py, PyAny>>,
        loose: Loose<'_, 'py>,
    ) -> PyResult<Self> {
        let dst = dst.filter(|d| !d.is_none());
        if let Ok(request) = first.cast::<PyRequest>() {
            let window = loose.window_pages.filter(|w| !w.is_none());
            let extra = [
                ("dst_pages", dst.is_some()),
                ("n_tokens", loose.n_tokens.is_some()),
                ("skip_tokens", loose.skip_tokens > 0),
                ("window_pages", window.is_some()),
            ];
            if let Some((name, _)) = extra.into_iter().find(|(_, given)| *given) {
                return Err(PyTypeError::new_err(format!(
                    "{method}(request) takes {name} from the Request; give it to \
                     Request(...), not to {method}"
                )));
            }
            return Self::of_request(request);
        }
        let Some(dst) = dst else {
            return Err(PyTypeError::new_err(format!(
                "{method}() needs dst_pages with src_pages (or one kvplan.Request), got {}",
                short_repr(first)
            )));
        };
        Ok(Self {
            pages: Some(RequestArrays::extract(
                first,
                dst,
                ("src_pages", "dst_pages"),
            )?),
            slot: (0, 0),
            state_slot: None,
            window: WindowPages::extract(loose.window_pages)?,
            n_tokens: loose.n_tokens,
            skip_tokens: loose.skip_tokens,
            pool_tokens: [None; kvplan_core::POOLS],
        })
    }

    /// A state slot method's request (`plan_state`, `prepped_state_indices`): a slot
    /// `kvplan.Request` in `src_slot`, or the old form's two slots.
    pub(crate) fn of_slots(
        method: &str,
        src_slot: &Bound<'py, PyAny>,
        dst_slot: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let dst_slot = dst_slot.filter(|d| !d.is_none());
        if let Ok(request) = src_slot.cast::<PyRequest>() {
            if dst_slot.is_some() {
                return Err(PyTypeError::new_err(format!(
                    "{method}(request) takes the slots from the Request; give no dst_slot"
                )));
            }
            let input = Self::of_request(request)?;
            if input.pages.is_some() {
                return Err(PyTypeError::new_err(format!(
                    "{method} plans a state slot; this Request holds page arrays: plan it with \
                     plan(request)"
                )));
            }
            return Ok(input);
        }
        let Some(dst_slot) = dst_slot else {
            return Err(PyTypeError::new_err(format!(
                "{method}() needs dst_slot with src_slot (or one kvplan.Request), got {}",
                short_repr(src_slot)
            )));
        };
        // An int beyond int64 overflows (as Python's own conversions say); anything else is
        // the wrong type.
        let slot = |obj: &Bound<'py, PyAny>, name: &str| {
            obj.extract::<i64>().map_err(|_| {
                let message = format!(
                    "{name} must be an int in -2**63..2**63, got {}",
                    short_repr(obj)
                );
                if obj.is_instance_of::<PyInt>() {
                    PyOverflowError::new_err(message)
                } else {
                    PyTypeError::new_err(message)
                }
            })
        };
        Ok(Self {
            pages: None,
            slot: (slot(src_slot, "src_slot")?, slot(dst_slot, "dst_slot")?),
            state_slot: None,
            window: WindowPages::extract(None)?,
            n_tokens: None,
            skip_tokens: 0,
            pool_tokens: [None; kvplan_core::POOLS],
        })
    }

    /// The arrays read, with their argument names (inputs an `out=` array must not overlap).
    pub(crate) fn named(&self) -> impl Iterator<Item = (&IndexArray<'py>, &'static str)> {
        let pages = self.pages.iter().flat_map(RequestArrays::named);
        pages.chain(self.window.named())
    }

    /// Plans the request with `planner` through the one conversion into the core's request
    /// (`input::plan_request`; a slot request through `input::plan_slot_request`).
    pub(crate) fn plan<P>(&self, py: Python<'_>, planner: P) -> PyResult<P::Output>
    where
        P: RequestPlanner + Send,
        P::Output: Send,
    {
        let Some(arrays) = &self.pages else {
            let (n, k) = (self.n_tokens, self.skip_tokens);
            return Ok(plan_slot_request(self.slot, n, k, planner));
        };
        let pages = arrays.slices()?;
        let tokens = TokenArgs {
            n_tokens: self.n_tokens,
            skip_tokens: self.skip_tokens,
            window: self.window.slices(pages)?,
            pool_tokens: self.pool_tokens,
            state_slot: self.state_slot,
        };
        Ok(plan_request(py, pages, tokens, planner))
    }
}
