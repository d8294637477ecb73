//! What may be planned: entry pairing, TP head slicing, the DCP token deal, every rule a
//! template is built under, and what each planner supports.

pub mod capabilities;
pub mod check;
pub mod dcp;
pub mod heads;
pub mod pairing;
