//! The emission kernels: a request's page runs × page pieces, and the token walks.

pub mod emit;
pub mod tokens;
