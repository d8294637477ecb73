//! The data model of a plan: the address pieces, the request and its page runs, the plan's
//! output types, and the caller's layer groups.

pub mod layer_groups;
pub mod pieces;
pub mod plan;
pub mod request;
pub mod runs;
