//! Block counts of a request shape without planning one (`Template.n_blocks_for`,
//! `n_token_blocks`, `packed_block_counts`): the core's counts for sizing and for choosing
//! between a direct and a packed plan.

use kvplan_core::{BlockRequest, PackPlanner, PageIndex, Request, Template};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use crate::errors::to_py_err;
use crate::input::RequestPlanner;
use crate::request::{PyRequest, RequestInput};

/// A request's block count, from the core's one gate (`Template::prepare`), nothing planned.
struct Prepared<'t>(&'t Template);

impl RequestPlanner for Prepared<'_> {
    type Output = kvplan_core::Result<usize>;
    fn plan<S: PageIndex, D: PageIndex>(self, request: &Request<'_, S, D>) -> Self::Output {
        self.0.prepare(request).map(|summary| summary.n_blocks)
    }
}

/// `Template.n_blocks_for`: the blocks of a `kvplan.Request` (as `plan` would plan it), or of
/// a page request of `n_pages` index pairs in `n_runs` runs (default 1).
pub(crate) fn blocks_for(
    template: &Template,
    n_pages: &Bound<'_, PyAny>,
    n_runs: Option<usize>,
) -> PyResult<usize> {
    if let Ok(request) = n_pages.cast::<PyRequest>() {
        if let Some(runs) = n_runs {
            return Err(PyTypeError::new_err(format!(
                "n_blocks_for(request) counts the Request's own runs; give no n_runs (got {runs})"
            )));
        }
        let input = RequestInput::of_request(request)?;
        return input
            .plan(n_pages.py(), Prepared(template))?
            .map_err(to_py_err);
    }
    page_blocks(template, n_pages.extract()?, n_runs.unwrap_or(1))
}

/// Blocks of a page request of `pages` index pairs in `runs` runs contiguous on both sides.
pub(crate) fn page_blocks(template: &Template, pages: usize, runs: usize) -> PyResult<usize> {
    let request = BlockRequest::Pages { pages, runs };
    template.count_blocks(request).map_err(to_py_err)
}

/// Blocks of a token plan of `n_tokens` tokens, pages consecutive or (`fragmented`) never.
pub(crate) fn token_blocks(
    template: &Template,
    n_tokens: u64,
    fragmented: bool,
) -> PyResult<usize> {
    let request = BlockRequest::Tokens {
        n_tokens,
        fragmented,
    };
    template.count_blocks(request).map_err(to_py_err)
}

/// `(direct, gather, network)` blocks of the same token plan, directly and through a pack
/// buffer.
pub(crate) fn packed_counts(
    template: &Template,
    n_tokens: u64,
    fragmented: bool,
) -> PyResult<(usize, usize, usize)> {
    let c = PackPlanner::new(template)
        .counts(n_tokens, fragmented)
        .map_err(to_py_err)?;
    Ok((c.direct, c.gather, c.network))
}
