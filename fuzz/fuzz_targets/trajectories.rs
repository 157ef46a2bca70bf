//! Any text as a `--rollouts` file: an error naming a line, or trajectories, never a panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = oxrl_train::trajectory::parse_trajectories(text, "fuzz.jsonl");
    }
});
