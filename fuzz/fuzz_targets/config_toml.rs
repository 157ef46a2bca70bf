//! Any bytes as a run configuration: an error or a config, never a panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = oxrl_train::RunConfig::from_str(text, std::path::Path::new("fuzz.toml"));
    }
});
