//! A compiled peer pair: the template (built once, one request path), its coalesced page
//! groups and its block accounting.

pub mod accounting;
pub mod coalesce;
pub mod template;
