//! Shared test support: the byte-level reference every plan is compared with, the layout
//! builders the tests plan between, and block helpers to compare plans with.
//!
//! Each test binary compiles the whole module and uses its own part of it.
#![allow(dead_code)]

pub mod blocks;
pub mod layouts;
pub mod reference;
pub mod staged_cases;
