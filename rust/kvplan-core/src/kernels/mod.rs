//! The emission kernels: a request's page runs × page pieces, the token walks, and the ring rows.

pub mod emit;
pub mod rings;
pub mod tokens;
