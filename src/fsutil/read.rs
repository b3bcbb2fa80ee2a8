//! Opening files the user names: only regular files, without blocking, and JSON
//! within a size limit. A named pipe opened for reading blocks until a writer comes
//! (forever), and `/dev/zero` or a huge file read whole runs the machine out of
//! memory; every file nanogpt reads from user input is opened here.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// The most bytes a JSON file read whole may have (`config.json`, `meta.json`,
/// `adapter_config.json`, a shard index, `tokenizer.json`): far above any real one.
pub const JSON_LIMIT: u64 = 64 << 20;

/// Opens `path` for reading, refusing anything but a regular file (a device such as
/// `/dev/zero`, a named pipe, a folder). The file is opened non-blocking and
/// inspected before anything is read, so a pipe never blocks; a symbolic link is
/// followed. `what` names the file for messages (e.g. "--data", "adapter config").
pub fn open_regular(path: &Path, what: &str) -> Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("cannot open {what} {}", path.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    if !meta.is_file() {
        bail!(not_regular(path, what));
    }
    Ok(file)
}

fn not_regular(path: &Path, what: &str) -> String {
    format!(
        "{what} {} is not a regular file (a device, a pipe or a folder); give a file",
        path.display()
    )
}

/// Refuses a `path` that exists and is not a regular file, without opening it, for
/// callers that open it later themselves. A path that cannot be inspected (missing,
/// say) is left to the caller's open, whose message names the fix.
pub fn check_regular_file(path: &Path, what: &str) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() => bail!(not_regular(path, what)),
        _ => Ok(()),
    }
}

/// The whole of the regular file `path`, refused if it holds more than `limit`
/// bytes (checked before reading, and again while reading, in case it grows).
pub fn read_limited(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>> {
    let file = open_regular(path, what)?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let too_large = |n: u64| {
        anyhow::anyhow!(
            "{what} {} holds {n} bytes, more than the {limit} such a file can have; is it \
             the right file?",
            path.display()
        )
    };
    if len > limit {
        return Err(too_large(len));
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read {what} {}", path.display()))?;
    if bytes.len() as u64 > limit {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// The text of the JSON file `path` ([`read_limited`] to [`JSON_LIMIT`]), which must
/// be UTF-8; a UTF-8 byte-order mark, which some editors write, is dropped.
pub fn read_json(path: &Path, what: &str) -> Result<String> {
    let mut bytes = read_limited(path, what, JSON_LIMIT)?;
    if bytes.starts_with(BOM) {
        bytes.drain(..BOM.len());
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{what} {} is not UTF-8 text (invalid byte at offset {}); save it as UTF-8",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// The UTF-8 byte-order mark (U+FEFF).
pub const BOM: &[u8] = b"\xEF\xBB\xBF";

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_pipe_a_device_and_a_folder_are_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.json");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = Instant::now();
        for path in [fifo.as_path(), Path::new("/dev/zero"), dir.path()] {
            let err = format!("{:#}", read_json(path, "config").unwrap_err());
            assert!(err.contains("is not a regular file"), "{err}");
            assert!(check_regular_file(path, "config").is_err());
        }
        assert!(started.elapsed() < Duration::from_secs(5), "nothing blocks");
    }

    #[test]
    fn json_is_read_within_its_limit_and_without_a_bom() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        std::fs::write(&path, b"\xEF\xBB\xBF{\"r\": 4}").unwrap();
        assert_eq!(read_json(&path, "adapter config").unwrap(), "{\"r\": 4}");
        let err = format!("{:#}", read_limited(&path, "x", 4).unwrap_err());
        assert!(err.contains("holds 11 bytes, more than the 4"), "{err}");
        std::fs::write(&path, b"{\"r\": \xff}").unwrap();
        let err = format!("{:#}", read_json(&path, "adapter config").unwrap_err());
        assert!(
            err.contains("not UTF-8 text (invalid byte at offset 6)"),
            "{err}"
        );
        let err = format!(
            "{:#}",
            read_json(&dir.path().join("no"), "config").unwrap_err()
        );
        assert!(err.contains("cannot open config"), "{err}");
    }
}
