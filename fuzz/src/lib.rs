//! Helpers shared by the fuzz targets.

use std::path::PathBuf;

/// A file named `name` holding `bytes`, in a per-process scratch folder (tmpfs
/// when there is one): for loaders whose entry point is a path, so that the fuzzer
/// drives exactly the code a user's file goes through.
pub fn scratch_file(name: &str, bytes: &[u8]) -> PathBuf {
    let root = match std::path::Path::new("/dev/shm").is_dir() {
        true => PathBuf::from("/dev/shm"),
        false => std::env::temp_dir(),
    };
    let dir = root.join(format!("nanogpt-fuzz-{}", std::process::id()));
    // A fresh folder each time: no file of the previous input is left to be read.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch folder");
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("scratch file");
    path
}
