//! Every file of tests/ as one test binary (one link per crate).
mod emulated;
