//! Python bindings for `kvplan-core`. Only glue lives here: convert arguments, release the GIL
//! around the work, hand buffers to NumPy without copying, and map core errors to exceptions.

mod convert;
mod errors;
mod layout;
mod plan;
mod pool;

#[pyo3::pymodule]
mod _core {
    #[pymodule_export]
    use crate::errors::{
        IndexBoundsError, KvPlanError, LayoutError, PairingError, SizeMismatchError,
    };
    #[pymodule_export]
    use crate::layout::PyLayout;
    #[pymodule_export]
    use crate::plan::{
        PyPlanBuffer, PyTemplate, check_pairs, group_contiguous, legacy_pp_pairs, pair_entries,
        pool_stats,
    };

    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");
}
