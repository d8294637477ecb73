//! Python bindings for `kvplan-core`. Only glue lives here: convert arguments, release the GIL
//! around the work, hand buffers to NumPy without copying, and map core errors to exceptions.
//! Modules mirror the core's, one file per job: `layout` (+ `layout_args`, `layout_dict`,
//! `layout_entry`), `pairing` (+ `pair_tables`:
//! `check_pairs`, `needs_tokens`), `template` (the `Template` class; its methods hand their work
//! to `compile`, `one_request`, `slots`, `coalescing` and `block_counts`), one file per derived
//! planner (`batch`, `pack`, `staged`, `rounds`, `stages` (every multi-stage plan's stages), `advice`, `convert` for `ConversionTemplate`,
//! `descriptors`, `slices`, `runs`, `nixl_ids`, `heads`), `plan` (+ the output `pool`), `digest`,
//! `local` (`copy_local`), `identity` (`LayoutIdentity`, `compatibility`), `mooncake`, `capabilities`, with `request` (`kvplan.Request`, and the
//! request every planner method reads from one or from its loose arguments), `input` (Python
//! arguments as index slices and the one conversion into the core's request; `out_arg` and
//! `window_pages` for `out=` and `window_pages=`), `ids`, `errors` and
//! `options` (keyword parsing) shared. No module imports one that imports it back
//! (`tests/module_graph.rs`).

mod advice;
mod batch;
mod block_counts;
mod capabilities;
mod coalescing;
mod compile;
mod convert;
mod descriptors;
mod digest;
mod errors;
mod failures;
mod heads;
mod identity;
mod ids;
mod input;
mod layout;
mod layout_args;
mod layout_dict;
mod layout_entry;
mod local;
mod manifest;
mod mooncake;
mod nixl_ids;
mod one_request;
mod options;
mod out_arg;
mod pack;
mod pair_tables;
mod pairing;
mod plan;
mod pool;
mod request;
mod rounds;
mod runs;
mod slices;
mod slots;
mod staged;
mod stages;
mod template;
mod window_pages;

#[pyo3::pymodule]
mod _core {
    #[pymodule_export]
    use crate::advice::{PyAdvice, PyTransferCost, advise};
    #[pymodule_export]
    use crate::batch::PyBatchPlan;
    #[pymodule_export]
    use crate::capabilities::{feature_descriptions, planner_support};
    #[pymodule_export]
    use crate::compile::PyTemplate;
    #[pymodule_export]
    use crate::convert::{PyConversionPlan, PyConversionTemplate};
    #[pymodule_export]
    use crate::digest::{combine_pair_digests, index_digest, leased_plan_digest};
    #[pymodule_export]
    use crate::errors::{
        IndexBoundsError, KvPlanError, LayoutError, ManifestError, PairingError, SizeMismatchError,
        UnsupportedError,
    };
    #[pymodule_export]
    use crate::failures::{failed_batch_pages, failed_pages};
    #[pymodule_export]
    use crate::heads::{PyTpPeers, heads_per_rank, staging_replicas_write, tp_peers};
    #[pymodule_export]
    use crate::identity::{PyLayoutIdentity, PyVerdict, compatibility, layout_identity};
    #[pymodule_export]
    use crate::ids::index_array;
    #[pymodule_export]
    use crate::layout::PyLayout;
    #[pymodule_export]
    use crate::layout_entry::PyLayoutEntry;
    #[pymodule_export]
    use crate::local::copy_local;
    #[pymodule_export]
    use crate::manifest::{check_manifest, pack_manifest};
    #[pymodule_export]
    use crate::mooncake::{PyMooncakeBatch, PyMooncakeNative};
    #[pymodule_export]
    use crate::nixl_ids::nixl_desc_ids;
    #[pymodule_export]
    use crate::pack::PyRowGather;
    #[pymodule_export]
    use crate::pair_tables::{check_pairs, needs_tokens};
    #[pymodule_export]
    use crate::pairing::{PyPairing, legacy_pp_pairs, pair_entries};
    #[pymodule_export]
    use crate::plan::{PyBlockSlice, PyBlocks, PyPlanBuffer, PyTransferPlan};
    #[pymodule_export]
    use crate::pool::pool_stats;
    #[pymodule_export]
    use crate::request::PyRequest;
    #[pymodule_export]
    use crate::rounds::{PyRoundManifest, PyStagedRound, PyStagedRounds};
    #[pymodule_export]
    use crate::runs::{group_contiguous, reverse_descending_runs};
    #[pymodule_export]
    use crate::slices::{
        PyBatchSlices, PyLayerGroups, PyLayerSlices, PyPlanSlices, PyWorkManifest,
    };
    #[pymodule_export]
    use crate::staged::PyStagedPlan;
    #[pymodule_export]
    use crate::stages::plan_stages;

    /// Module attributes the core owns: its role classification, and the default `kind` and
    /// `requests` of a `KvPlanError` raised by Python code.
    #[pymodule_init]
    fn init(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
        use pyo3::prelude::*;
        m.add("MHA_ROLES", kvplan_core::MHA_ROLES.to_vec())?;
        m.add("DTYPES", crate::convert::dtype_names())?;
        m.add("SCALE_FORMATS", crate::convert::scale_format_names())?;
        // `BlockSlice`'s old name, kept for this release so existing imports keep working.
        m.add("PlanBatch", m.py().get_type::<crate::plan::PyBlockSlice>())?;
        m.py()
            .get_type::<crate::errors::KvPlanError>()
            .setattr("kind", "other")?;
        m.py()
            .get_type::<crate::errors::KvPlanError>()
            .setattr("requests", pyo3::types::PyTuple::empty(m.py()))?;
        Ok(())
    }

    #[allow(non_upper_case_globals)]
    #[pymodule_export]
    const __version__: &str = env!("CARGO_PKG_VERSION");
}
