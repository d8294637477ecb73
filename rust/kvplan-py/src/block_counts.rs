//! Block counts of a request shape without planning one (`Template.n_blocks_for`,
//! `n_token_blocks`, `packed_block_counts`): the core's counts for sizing and for choosing
//! between a direct and a packed plan.

use kvplan_core::{BlockRequest, PackPlanner, Template};
use pyo3::prelude::*;

use crate::errors::to_py_err;

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
