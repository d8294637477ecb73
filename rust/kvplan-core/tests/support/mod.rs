//! Shared test support: the byte-level reference every plan is compared with, the layout
//! builders the tests plan between, and block helpers to compare plans with.
//!
//! Each test binary compiles the whole module and uses its own part of it.
#![allow(dead_code)]

pub mod blocks;
pub mod layouts;
pub mod reference;
pub mod staged_cases;

/// A byte-level property's proptest settings: `default` cases (its size in the test suite and
/// CI), or `PROPTEST_CASES` when set (a long run: `scripts/property-suites N`), with rejected
/// draws allowed in proportion to the cases (at least proptest's default).
pub fn property_config(default: u32) -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    let base = proptest::test_runner::Config::default();
    proptest::test_runner::Config {
        cases,
        max_global_rejects: base.max_global_rejects.max(cases / 8),
        ..base
    }
}
