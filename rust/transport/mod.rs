//! Element frames and the Python codec over them (TRANSPORT.md §6).

#[cfg(feature = "python")]
pub mod codec;
pub mod frame;
