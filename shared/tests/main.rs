//! The integration tests of `xdistill-shared`, one binary (one link): GGUF files, model loading
//! and decoders against references, the training pass, and the decoders fuzzed. Each file is a
//! module; `cargo nextest run -E 'test(/^gguf::/)'` runs one.

mod decode_fuzz;
mod gguf;
mod model;
mod train_pass;
