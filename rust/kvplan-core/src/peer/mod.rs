//! One peer's side: the KV formats an entry can hold, one entry and its pools, and the layout a
//! peer registers.

pub mod entry;
pub mod kv_format;
pub mod layout;
