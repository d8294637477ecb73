//! Random layouts (every constructor, draft and state entries, addresses up to u64::MAX, item
//! lengths including 0) → check_pairs / Template::new → plan, plan_into (caller buffers of
//! random size) and plan_state_into with random int32/int64 indices.
#![no_main]
use kvplan_core_fuzz::{PlanInput, check_plan};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: PlanInput| check_plan(&input));
