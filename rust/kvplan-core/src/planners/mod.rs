//! The planners that borrow a template: batches, packed and staged plans, descriptor tables,
//! staged rounds through bounded arenas, layer slices, failure verdicts, conversions, the
//! direct-or-staged advice and the coalescing report; and the stages every multi-stage plan
//! runs, in order.

pub mod advice;
pub mod batch;
pub mod coalescing;
pub mod compatibility;
pub mod convert;
pub mod descriptors;
pub mod failures;
pub mod nixl_ids;
pub mod pack;
pub mod rounds;
pub mod slices;
pub mod staged;
pub mod stages;
