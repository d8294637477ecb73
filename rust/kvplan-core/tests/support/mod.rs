//! Shared test support: the byte-level reference every plan is compared with.
pub mod reference;
