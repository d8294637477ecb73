//! What leaves the planner: the wire encoding of a layout, integrity digests, and plans carried
//! out on local CPU memory.

pub mod digest;
pub mod identity;
pub mod local;
pub mod wire;
