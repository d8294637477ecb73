//! pair_entries / pair_each (identity, role-keyed, positional) and legacy_pp_pairs over the full
//! usize range: every accepted pairing pairs each source entry once with a distinct, in-range
//! destination entry of the same id (and role).
#![no_main]
use kvplan_core_fuzz::{PairingInput, check_pairing};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: PairingInput| check_pairing(&input));
