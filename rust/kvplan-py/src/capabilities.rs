//! The core's declaration of what each planner supports, as plain Python data for the docs'
//! generated table and for callers choosing a planner.

use kvplan_core::{Feature, Planner};
use pyo3::prelude::*;

/// `[(planner, [(feature, supported), …]), …]` in the core's order, from `kvplan_core::SUPPORT`.
#[pyfunction]
pub fn planner_support() -> Vec<(&'static str, Vec<(&'static str, bool)>)> {
    Planner::ALL
        .into_iter()
        .map(|planner| {
            let row = Feature::ALL
                .into_iter()
                .map(|feature| (feature.name(), planner.supports(feature)))
                .collect();
            (planner.name(), row)
        })
        .collect()
}

/// `(feature, what it is)` for every request feature, in the core's order.
#[pyfunction]
pub fn feature_descriptions() -> Vec<(&'static str, &'static str)> {
    Feature::ALL
        .into_iter()
        .map(|feature| (feature.name(), feature.describe()))
        .collect()
}
