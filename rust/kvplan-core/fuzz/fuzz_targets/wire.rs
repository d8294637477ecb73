//! wire::decode never panics on any bytes; accepted layouts are valid and round-trip;
//! encode → mutate (with or without fixing the CRC) → decode.
#![no_main]
use kvplan_core_fuzz::{WireInput, check_wire};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: WireInput| check_wire(&input));
