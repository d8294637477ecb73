//! One peer's side: the KV formats an entry can hold and the layout a peer registers.

pub mod kv_format;
pub mod layout;
