//! What may be planned: entry pairing, TP head slicing, the DCP token deal, every rule a
//! template is built under, what each planner supports, and a model's manifest.

pub mod capabilities;
pub mod check;
pub mod dcp;
pub mod heads;
pub mod manifest;
pub mod pairing;
pub mod state_split;
