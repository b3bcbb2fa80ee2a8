//! What a nanogpt binary is, as ranks and hosts compare it: its version, the
//! features compiled in, and a hash of the binary file itself. Two builds of the
//! same version (another commit, other features, another MPI linked, another
//! compiler) differ in the hash, so a host with an older copy is named before it
//! trains a different program.

use std::io::Read;
use std::path::Path;
use std::sync::OnceLock;

/// The hash of this process's binary file (`/proc/self/exe`) as 12 hex digits, or
/// `unknown` where it cannot be read. Computed once (about 50 ms for a 200 MB
/// debug binary).
pub fn build_hash() -> &'static str {
    static HASH: OnceLock<String> = OnceLock::new();
    HASH.get_or_init(|| {
        std::env::current_exe()
            .and_then(|exe| hash_file(&exe))
            .map_or_else(|_| "unknown".into(), |h| format!("{:012x}", h >> 16))
    })
}

/// The cargo features compiled in that change what the binary does across hosts.
pub fn features() -> Vec<&'static str> {
    let mut features = Vec::new();
    if cfg!(feature = "mpi") {
        features.push("mpi");
    }
    if cfg!(feature = "download") {
        features.push("download");
    }
    if cfg!(feature = "onednn") {
        features.push("onednn");
    }
    features
}

/// `nanogpt VERSION (build HASH, features: ...)`.
pub fn binary_id() -> String {
    let features = features();
    format!(
        "nanogpt {} (build {}, features: {})",
        env!("CARGO_PKG_VERSION"),
        build_hash(),
        match features.is_empty() {
            true => "none".to_string(),
            false => features.join(", "),
        }
    )
}

/// A 64-bit hash of a file's bytes (FNV-1a over little-endian 8-byte words, the
/// last one padded with zeros, then the length): not cryptographic, but any changed
/// byte changes it.
pub fn hash_file(path: &Path) -> std::io::Result<u64> {
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut h, mut len) = (0xcbf2_9ce4_8422_2325u64, 0u64);
    loop {
        let n = fill(&mut file, &mut buf)?;
        len += n as u64;
        let mut words = buf[..n].chunks_exact(8);
        for w in &mut words {
            let w = u64::from_le_bytes(w.try_into().expect("8 bytes"));
            h = (h ^ w).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            let mut last = [0u8; 8];
            last[..tail.len()].copy_from_slice(tail);
            h = (h ^ u64::from_le_bytes(last)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        if n < buf.len() {
            break;
        }
    }
    Ok((h ^ len).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Reads until `buf` is full or the file ends; returns the bytes read. Only the
/// last read of a file comes back short, so every earlier one is whole words.
fn fill(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut at = 0;
    while at < buf.len() {
        match file.read(&mut buf[at..]) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(at)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_changed_byte_or_length_changes_the_file_hash() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bin");
        // More than one read buffer, and a partial last word.
        let data: Vec<u8> = (0..(1usize << 20) + 13).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let base = hash_file(&path).unwrap();
        assert_eq!(
            base,
            hash_file(&path).unwrap(),
            "the same bytes, the same hash"
        );
        for at in [0, 7, 1 << 19, (1 << 20) + 12] {
            let mut changed = data.clone();
            changed[at] ^= 0x40;
            std::fs::write(&path, &changed).unwrap();
            assert_ne!(base, hash_file(&path).unwrap(), "byte {at}");
        }
        // A trailing zero byte is not the zero padding of the last word.
        let mut longer = data.clone();
        longer.push(0);
        std::fs::write(&path, &longer).unwrap();
        assert_ne!(base, hash_file(&path).unwrap(), "one byte longer");
    }

    #[test]
    fn the_binary_id_names_version_build_and_features() {
        let id = binary_id();
        assert!(
            id.starts_with(&format!("nanogpt {} (build ", env!("CARGO_PKG_VERSION"))),
            "{id}"
        );
        let hash = build_hash();
        assert!(
            hash.len() == 12 && hash.chars().all(|c| c.is_ascii_hexdigit()),
            "{hash}"
        );
        assert!(id.contains(hash) && id.contains("features: "), "{id}");
    }
}
