//! A training config: TOML text, then `key=value` overrides (the lines after the
//! first NUL byte), merged and validated as `nanogpt train` does.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nanogpt::config::TrainConfig;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let (toml, overrides) = text.split_once('\0').unwrap_or((&text, ""));
    let overrides: Vec<String> = overrides.lines().map(str::to_string).collect();
    if let Ok(cfg) = TrainConfig::parse(toml, "fuzz.toml", &overrides) {
        let _ = cfg.tokens_per_iter();
        let _ = cfg.check_world_size(3);
        let _ = cfg.init();
    }
});
