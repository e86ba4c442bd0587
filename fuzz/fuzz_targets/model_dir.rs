//! A model directory (`config.json` and `model.safetensors`, packed as `pack_model_dir` says;
//! the tokenizer fixed) through what a teacher's start does with it.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(init: xdistill_fuzz::allow_caught_panics(), |data: &[u8]| {
    if let Some(dir) = xdistill_fuzz::unpack_model_dir(data) {
        xdistill_fuzz::teacher_start(&dir);
    }
});
