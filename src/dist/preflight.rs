//! Before a job of several ranks trains: rank 0's config is every rank's config, and
//! every rank must read the same inputs.
//!
//! - [`shared_config`]: rank 0 reads the config file and the `key=value` overrides
//!   and sends the text to every rank, which parses the same text. A config file or
//!   overrides given to another rank that differ are reported in a note, never used:
//!   only rank 0's host needs the config.
//! - [`check_same_inputs`]: every rank fingerprints what it will read (the dataset's
//!   files: size and a hash of evenly spaced samples; the binary's version, build
//!   and features) and compares with rank 0's; any difference refuses the job before
//!   step 1 and before any checkpoint, naming the rank, host and file.
//!
//! The init weights (a checkpoint or a pretrained model) need no check: rank 0
//! alone reads them and broadcasts the weights.

use super::Collective;
use crate::config::TrainConfig;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// What rank 0 sends: the config file's text and the overrides.
#[derive(Serialize, Deserialize)]
struct ConfigText {
    /// The config file's path on rank 0 (None: the built-in quick start).
    path: Option<String>,
    text: String,
    overrides: Vec<String>,
}

/// The run's config, read on rank 0 and parsed from the same text on every rank.
/// `path` and `overrides` are this rank's command line; on other ranks they are
/// only compared with rank 0's (a difference is a note).
pub fn shared_config(
    comm: &dyn Collective,
    path: Option<&str>,
    overrides: &[String],
) -> Result<TrainConfig> {
    let load = |p: Option<&str>, o: &[String]| match p {
        Some(p) => TrainConfig::load(Some(Path::new(p)), o),
        None => TrainConfig::quick_start_with(o),
    };
    if comm.world_size() == 1 {
        return load(path, overrides);
    }
    let mut bytes = Vec::new();
    let mut root_cfg = None;
    if comm.rank() == 0 {
        // Loaded first for its error messages; the text read again is what was loaded.
        root_cfg = Some(load(path, overrides)?);
        let text = match path {
            Some(p) => std::fs::read_to_string(p).with_context(|| format!("cannot read {p}"))?,
            None => String::new(),
        };
        bytes = serde_json::to_vec(&ConfigText {
            path: path.map(String::from),
            text,
            overrides: overrides.to_vec(),
        })?;
    }
    comm.broadcast_bytes(&mut bytes, 0);
    if let Some(cfg) = root_cfg {
        return Ok(cfg);
    }
    let root: ConfigText =
        serde_json::from_slice(&bytes).context("internal error: bad config from rank 0")?;
    let who = format!("rank {} (host {})", comm.rank(), comm.host());
    for note in config_differences(&root, path, overrides) {
        crate::errln!("note: {who}: {note}; using rank 0's (the config is read on rank 0 only)");
    }
    let cfg = match &root.path {
        Some(p) => TrainConfig::parse(&root.text, &format!("{p} (rank 0's)"), &root.overrides),
        None => TrainConfig::quick_start_with(&root.overrides),
    };
    cfg.context("internal error: rank 0's config does not parse here")
}

/// How this rank's command line differs from rank 0's.
fn config_differences(root: &ConfigText, path: Option<&str>, overrides: &[String]) -> Vec<String> {
    let mut notes = Vec::new();
    match (path, &root.path) {
        (Some(p), _) => match std::fs::read(p) {
            Ok(text) if Some(p) != root.path.as_deref() || text != root.text.as_bytes() => {
                let theirs = root.path.as_deref().unwrap_or("the built-in quick start");
                notes.push(format!("config {p} here differs from rank 0's {theirs}"));
            }
            Ok(_) | Err(_) => {}
        },
        (None, Some(theirs)) => notes.push(format!("no config given here, rank 0 has {theirs}")),
        (None, None) => {}
    }
    if overrides != root.overrides {
        notes.push(format!(
            "overrides [{}] here differ from rank 0's [{}]",
            overrides.join(" "),
            root.overrides.join(" ")
        ));
    }
    notes
}

/// What one rank will read, as compared across ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// `nanogpt VERSION (build HASH, features: ...)` ([`super::identity::binary_id`]).
    pub binary: String,
    /// The dataset's files: name within the dataset folder, size, sampled hash.
    pub files: Vec<FilePrint>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FilePrint {
    pub name: String,
    /// None: the file does not exist here.
    pub size: Option<u64>,
    pub hash: u64,
}

/// The dataset files a run reads from its folder. The loss masks exist for
/// instruction data only: one missing on every rank is the same on every rank, one
/// present on some ranks only is a difference.
pub const DATA_FILES: [&str; 5] = [
    "meta.json",
    "train.bin",
    "val.bin",
    "train.mask",
    "val.mask",
];

impl Fingerprint {
    /// The fingerprint of the dataset in `data_dir` and of this binary.
    pub fn of(data_dir: &Path) -> Result<Fingerprint> {
        let files = DATA_FILES
            .iter()
            .map(|name| file_print(&data_dir.join(name), name))
            .collect::<Result<_>>()?;
        Ok(Fingerprint {
            binary: super::identity::binary_id(),
            files,
        })
    }

    /// One hash of the dataset's files, for a table column (the binary has a
    /// column of its own).
    pub fn digest(&self) -> u64 {
        let mut h = Fnv::new();
        for f in &self.files {
            h.write(f.name.as_bytes());
            h.write(&f.size.unwrap_or(u64::MAX).to_le_bytes());
            h.write(&f.hash.to_le_bytes());
        }
        h.0
    }

    /// How `self` (this rank's, data in `data_dir`) differs from rank 0's `root`.
    pub fn differences(&self, root: &Fingerprint, data_dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        if self.binary != root.binary {
            out.push(format!(
                "the binary is {} here, {} on rank 0",
                self.binary, root.binary
            ));
        }
        for (mine, theirs) in self.files.iter().zip(&root.files) {
            let path = data_dir.join(&mine.name);
            let size = |s: Option<u64>| s.map_or("missing".to_string(), |s| format!("{s} bytes"));
            if mine.size != theirs.size {
                out.push(format!(
                    "{} is {} here, {} on rank 0",
                    path.display(),
                    size(mine.size),
                    size(theirs.size)
                ));
            } else if mine.hash != theirs.hash {
                out.push(format!(
                    "{} has other content than rank 0's (same size, {} bytes; content hash \
                     {:016x} here, {:016x} on rank 0)",
                    path.display(),
                    mine.size.unwrap_or(0),
                    mine.hash,
                    theirs.hash
                ));
            }
        }
        out
    }
}

/// Files up to this size are hashed whole (a few tens of ms); larger ones by
/// `SAMPLES` evenly spaced pieces of `SAMPLE` bytes.
const WHOLE: u64 = 64 << 20;
const SAMPLE: u64 = 4096;
const SAMPLES: u64 = 1024;

/// A file's fingerprint: its size and the hash of its bytes, or of `SAMPLES`
/// evenly spaced pieces (the first and the last included) when larger than `WHOLE`.
fn file_print(path: &Path, name: &str) -> Result<FilePrint> {
    file_print_with(path, name, WHOLE, SAMPLES)
}

fn file_print_with(path: &Path, name: &str, whole: u64, samples: u64) -> Result<FilePrint> {
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(FilePrint {
                name: name.into(),
                size: None,
                hash: 0,
            })
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let size = file.metadata()?.len();
    let mut h = Fnv::new();
    let read_err = || format!("cannot read {}", path.display());
    if size <= whole.max(SAMPLE * samples) {
        let mut all = Vec::new();
        file.read_to_end(&mut all).with_context(read_err)?;
        h.write(&all);
    } else {
        let mut buf = vec![0u8; SAMPLE as usize];
        let last = size - SAMPLE;
        for i in 0..samples {
            let at = match i {
                i if i == samples - 1 => last,
                i => last / (samples - 1) * i,
            };
            file.seek(SeekFrom::Start(at)).with_context(read_err)?;
            file.read_exact(&mut buf).with_context(read_err)?;
            h.write(&buf);
        }
    }
    Ok(FilePrint {
        name: name.into(),
        size: Some(size),
        hash: h.0,
    })
}

/// FNV-1a, 64 bits: the same on every host and version.
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Every rank's `mine`, in rank order, on every rank (a collective).
pub fn all_gather_text(comm: &dyn Collective, mine: &str) -> Vec<String> {
    let lens = comm.all_gather_u64(mine.len() as u64);
    let mut out = Vec::with_capacity(lens.len());
    for (r, &len) in lens.iter().enumerate() {
        if len == 0 {
            out.push(String::new());
            continue;
        }
        let mut buf = match r == comm.rank() {
            true => mine.as_bytes().to_vec(),
            false => Vec::new(),
        };
        comm.broadcast_bytes(&mut buf, r);
        out.push(String::from_utf8_lossy(&buf).into_owned());
    }
    out
}

/// Every rank compares what it will read (the dataset in `data_dir`, the binary)
/// with rank 0's; any difference refuses the job, on rank 0, naming each rank, its
/// host and the files. A collective: every rank calls it.
pub fn check_same_inputs(comm: &dyn Collective, data_dir: &Path) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mine = Fingerprint::of(data_dir)?;
    let mut bytes = match comm.rank() {
        0 => serde_json::to_vec(&mine)?,
        _ => Vec::new(),
    };
    comm.broadcast_bytes(&mut bytes, 0);
    let root: Fingerprint =
        serde_json::from_slice(&bytes).context("internal error: bad fingerprint from rank 0")?;
    let problems = mine.differences(&root, data_dir).join("; ");
    let all = all_gather_text(comm, &problems);
    if all.iter().all(String::is_empty) {
        return Ok(());
    }
    let hosts = all_gather_text(comm, &comm.host());
    if comm.rank() != 0 {
        // Rank 0 reports and ends the job; this rank waits for that.
        comm.barrier_patient();
        bail!("the ranks would read different inputs (see rank 0's message)");
    }
    let listed: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.is_empty())
        .map(|(r, p)| format!("rank {r} (host {}): {p}", hosts[r]))
        .collect();
    bail!(
        "refusing to start: the ranks would read different inputs, and would train a model \
         none of them describes. {}. Every host needs the same binary and the same dataset \
         files as rank 0 (host {}) at the same paths: copy them from there (e.g. rsync -a), \
         or point `dataset` at a shared folder",
        listed.join(". "),
        hosts[0]
    )
}

/// Rank 0 prints which rank runs on which host, and warns (on stderr) when the
/// ranks are spread unevenly over the hosts or a host has more threads than cores.
/// A collective: every rank calls it with its number of worker threads.
pub fn report_placement(comm: &dyn Collective, threads: usize) {
    if comm.world_size() == 1 {
        return;
    }
    let hosts = comm.hosts();
    let threads = comm.all_gather_u64(threads as u64);
    let cores = comm.all_gather_u64(crate::threads::host_cores().unwrap_or(0) as u64);
    if comm.rank() != 0 {
        return;
    }
    let (line, warnings) = placement(&hosts, &threads, &cores);
    crate::outln!("{line}");
    for w in warnings {
        crate::errln!("warning: {w}");
    }
}

/// The placement line (`placement: h1: rank 0 | h2: ranks 1, 2`) and its warnings,
/// from every rank's host, threads and host cores (0: unknown).
pub fn placement(hosts: &[String], threads: &[u64], cores: &[u64]) -> (String, Vec<String>) {
    // Hosts in order of their first rank.
    let mut order: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        match order.iter_mut().find(|(name, _)| name == h) {
            Some((_, ranks)) => ranks.push(r),
            None => order.push((h, vec![r])),
        }
    }
    let list = |ranks: &[usize]| {
        let s: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
        format!(
            "rank{} {}",
            if ranks.len() > 1 { "s" } else { "" },
            s.join(", ")
        )
    };
    let line = order
        .iter()
        .map(|(h, ranks)| format!("{h}: {}", list(ranks)))
        .collect::<Vec<_>>()
        .join(" | ");
    let mut warnings = Vec::new();
    let most = order.iter().map(|(_, r)| r.len()).max().unwrap_or(0);
    let least = order.iter().map(|(_, r)| r.len()).min().unwrap_or(0);
    if order.len() > 1 && most != least {
        let (busy, ranks) = order.iter().find(|(_, r)| r.len() == most).unwrap();
        warnings.push(format!(
            "the ranks are spread unevenly: host {busy} runs {} while another runs {least}; \
             for one rank per host use `--map-by node` (Open MPI) or `-ppn 1` (MPICH, Intel \
             MPI), or `nanogpt launch`",
            list(ranks)
        ));
    }
    for (h, ranks) in &order {
        let r0 = ranks[0];
        let used: u64 = ranks.iter().map(|&r| threads[r]).sum();
        if cores[r0] > 0 && used > cores[r0] {
            warnings.push(format!(
                "host {h} runs {} × {} threads = {used} threads on {} cores: the ranks slow each \
                 other down; set `threads` to at most {} (cores / ranks on the host)",
                ranks.len(),
                threads[r0],
                cores[r0],
                (cores[r0] / ranks.len() as u64).max(1)
            ));
        }
    }
    (format!("placement: {line}"), warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_byte_anywhere_in_a_small_file_or_a_sample_changes_the_print() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("meta.json");
        std::fs::write(&small, b"{\"vocab_size\": 65}").unwrap();
        let a = file_print(&small, "meta.json").unwrap();
        std::fs::write(&small, b"{\"vocab_size\": 66}").unwrap();
        assert_ne!(a, file_print(&small, "meta.json").unwrap());

        // A large file, sampled: the first, a middle and the last sample are seen,
        // a byte between samples is not.
        let big = dir.path().join("train.bin");
        let (samples, n) = (8, (SAMPLE * 8 * 3 + 7) as usize);
        let print = |p: &Path| file_print_with(p, "train.bin", 0, samples).unwrap();
        let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        std::fs::write(&big, &data).unwrap();
        let base = print(&big);
        assert_eq!(base.size, Some(n as u64));
        let step = (n as u64 - SAMPLE) / (samples - 1);
        for (at, seen) in [
            (0, true),
            (step * 3, true),
            (n as u64 - 1, true),
            (SAMPLE + 1, false),
        ] {
            let mut changed = data.clone();
            changed[at as usize] ^= 1;
            std::fs::write(&big, &changed).unwrap();
            assert_eq!(base.hash != print(&big).hash, seen, "byte {at}");
        }
        std::fs::write(&big, &data).unwrap();
        assert_eq!(base, print(&big));
    }

    #[test]
    fn placement_warns_on_uneven_hosts_and_oversubscribed_cores() {
        let hosts: Vec<String> = ["h1", "h1", "h2"].iter().map(|s| s.to_string()).collect();
        let (line, w) = placement(&hosts, &[1, 1, 1], &[2, 2, 2]);
        assert_eq!(line, "placement: h1: ranks 0, 1 | h2: rank 2");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("host h1 runs ranks 0, 1 while another runs 1"),
            "{w:?}"
        );
        assert!(
            w[0].contains("--map-by node") && w[0].contains("-ppn 1"),
            "{w:?}"
        );
        let (_, w) = placement(&hosts, &[2, 2, 2], &[2, 2, 2]);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[1].contains("host h1 runs 2 × 2 threads = 4 threads on 2 cores"),
            "{w:?}"
        );
        let even: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let (line, w) = placement(&even, &[2, 2, 2], &[2, 2, 0]);
        assert_eq!(line, "placement: a: rank 0 | b: rank 1 | c: rank 2");
        assert!(w.is_empty(), "{w:?}");
    }

    #[test]
    fn differences_name_the_file_and_both_sides() {
        let dir = tempfile::tempdir().unwrap();
        for name in DATA_FILES {
            std::fs::write(dir.path().join(name), name.as_bytes()).unwrap();
        }
        let root = Fingerprint::of(dir.path()).unwrap();
        assert!(root.differences(&root, dir.path()).is_empty());
        std::fs::write(dir.path().join("val.bin"), b"VAL.BIN").unwrap();
        std::fs::remove_file(dir.path().join("train.bin")).unwrap();
        let mine = Fingerprint::of(dir.path()).unwrap();
        let diff = mine.differences(&root, dir.path());
        assert_eq!(diff.len(), 2, "{diff:?}");
        assert!(
            diff[0].contains("train.bin is missing here, 9 bytes on rank 0"),
            "{diff:?}"
        );
        assert!(diff[1].contains("val.bin has other content"), "{diff:?}");
        assert_ne!(mine.digest(), root.digest());
        // Another build reads the same data: named as a difference, but the data's
        // digest (doctor's `data` column) stays.
        let other_build = Fingerprint {
            binary: "nanogpt 0.1.0 (build 000000000000, features: none)".into(),
            ..root.clone()
        };
        let diff = other_build.differences(&root, dir.path());
        assert_eq!(diff.len(), 1, "{diff:?}");
        assert!(
            diff[0].starts_with("the binary is nanogpt 0.1.0 (build 000000000000"),
            "{diff:?}"
        );
        assert_eq!(other_build.digest(), root.digest());
    }

    #[test]
    fn loss_masks_count_when_present_on_any_rank() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["meta.json", "train.bin", "val.bin"] {
            std::fs::write(dir.path().join(name), name.as_bytes()).unwrap();
        }
        let plain = Fingerprint::of(dir.path()).unwrap();
        std::fs::write(dir.path().join("train.mask"), [1u8, 0, 1]).unwrap();
        let masked = Fingerprint::of(dir.path()).unwrap();
        // Neither side has masks: no difference; one side only: named, both ways.
        assert!(plain.differences(&plain, dir.path()).is_empty());
        let diff = masked.differences(&plain, dir.path());
        assert_eq!(diff.len(), 1, "{diff:?}");
        assert!(
            diff[0].contains("train.mask is 3 bytes here, missing on rank 0"),
            "{diff:?}"
        );
        let diff = plain.differences(&masked, dir.path());
        assert!(
            diff[0].contains("train.mask is missing here, 3 bytes on rank 0"),
            "{diff:?}"
        );
        // Same size, other mask bytes.
        std::fs::write(dir.path().join("train.mask"), [1u8, 1, 1]).unwrap();
        let other = Fingerprint::of(dir.path()).unwrap();
        let diff = other.differences(&masked, dir.path());
        assert_eq!(diff.len(), 1, "{diff:?}");
        assert!(diff[0].contains("train.mask has other content"), "{diff:?}");
        assert_ne!(other.digest(), masked.digest());
        assert_ne!(plain.digest(), masked.digest());
    }
}
