//! A GGUF file through what a teacher's start does with it (its metadata, the tokenizer
//! rebuilt from it, the tensors dequantized and kept quantized, a forward pass).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(init: xdistill_fuzz::allow_caught_panics(), |data: &[u8]| {
    let path = xdistill_fuzz::scratch().join("model.gguf");
    if std::fs::write(&path, data).is_ok() {
        xdistill_fuzz::teacher_start(&path);
    }
});
