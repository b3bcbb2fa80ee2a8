//! `nanogpt launch`: the MPI command line of a job of one rank per host, for the
//! MPI this binary links (Open MPI, or Hydra: MPICH and Intel MPI), printed so that
//! it can be run by hand; every host checked over SSH ([`probe`]); then the job
//! checked with `nanogpt doctor` and run.

pub mod probe;

use crate::dist::launcher::Library;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// The two launcher families, whose flags differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    OpenMpi,
    /// MPICH's and Intel MPI's `mpiexec.hydra`.
    Hydra,
}

/// The flavour of `mpirun --version`'s output.
pub fn flavour_of(version: &str) -> Option<Flavour> {
    if version.contains("Open MPI") || version.contains("OpenRTE") {
        Some(Flavour::OpenMpi)
    } else if version.contains("HYDRA")
        || version.contains("Intel(R) MPI")
        || version.contains("MPICH")
    {
        Some(Flavour::Hydra)
    } else {
        None
    }
}

/// Runs `mpirun --version` and names its flavour.
pub fn detect(mpirun: &str) -> Result<Flavour> {
    let out = Command::new(mpirun)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run `{mpirun} --version`: install Open MPI or MPICH"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    flavour_of(&text).with_context(|| {
        format!(
            "`{mpirun} --version` names neither Open MPI nor Hydra (MPICH, Intel MPI): {}",
            text.lines().next().unwrap_or("")
        )
    })
}

/// The launcher flavour that starts a library's processes.
pub fn flavour_for(library: Library) -> Option<Flavour> {
    match library {
        Library::OpenMpi => Some(Flavour::OpenMpi),
        Library::Mpich | Library::IntelMpi => Some(Flavour::Hydra),
        Library::Other => None,
    }
}

/// The launchers to try for each flavour, the ones named after their MPI first:
/// with both MPIs installed (Debian, Ubuntu), plain `mpirun` and `mpiexec` are
/// whichever the alternatives system picked.
fn candidates(flavour: Flavour) -> &'static [&'static str] {
    match flavour {
        Flavour::OpenMpi => &["mpirun.openmpi", "mpiexec.openmpi", "mpirun", "mpiexec"],
        Flavour::Hydra => &[
            "mpiexec.hydra",
            "mpirun.mpich",
            "mpiexec.mpich",
            "mpirun",
            "mpiexec",
        ],
    }
}

/// The launcher to use and its flavour: `explicit` (`--mpirun`, `$NANOGPT_MPIRUN`)
/// if given, else the first launcher of the linked `library`'s flavour found on
/// `PATH`, else `mpirun`. Refuses a launcher of the other MPI, naming both.
pub fn pick(explicit: Option<&str>, library: Option<(Library, &str)>) -> Result<(String, Flavour)> {
    let wanted = library.and_then(|(lib, _)| flavour_for(lib));
    let mpirun = match (explicit, wanted) {
        (Some(m), _) => m.to_string(),
        (None, Some(w)) => candidates(w)
            .iter()
            .find(|c| on_path(c) && detect(c).ok() == Some(w))
            .map(|c| c.to_string())
            .with_context(|| {
                let (lib, version) = library.expect("a wanted flavour comes from a library");
                format!(
                    "this nanogpt is built against {} ({}), and no launcher of it is installed \
                     here (tried {}): install it (Debian/Ubuntu: {}), or name one with --mpirun",
                    lib.name(),
                    version.lines().next().unwrap_or("").trim(),
                    candidates(w).join(", "),
                    match w {
                        Flavour::OpenMpi => "apt-get install openmpi-bin",
                        Flavour::Hydra => "apt-get install mpich",
                    }
                )
            })?,
        (None, None) => "mpirun".into(),
    };
    let flavour = detect(&mpirun)?;
    if let (Some(w), Some((lib, _))) = (wanted, library) {
        if flavour != w {
            bail!(
                "{mpirun} is {}, but this nanogpt is built against {}: each process would \
                 train alone. Use {} (or leave --mpirun out: launch picks it)",
                match flavour {
                    Flavour::OpenMpi => "Open MPI's launcher",
                    Flavour::Hydra => "Hydra, the launcher of MPICH and Intel MPI",
                },
                lib.name(),
                lib.launchers()
            );
        }
    }
    Ok((mpirun, flavour))
}

/// Whether `program` is an executable file in a folder of `PATH` (or a path to one).
fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        p.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        return executable(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| executable(&dir.join(program))))
}

/// Environment variables forwarded to every rank when set here (with nanogpt's
/// own: [`crate::tuning::env::Settings::forwarded`]).
const FORWARD: [&str; 5] = [
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "RUST_BACKTRACE",
    "LD_LIBRARY_PATH",
];

/// What the job is.
pub struct Job<'a> {
    pub flavour: Flavour,
    pub mpirun: &'a str,
    pub hosts: &'a Path,
    pub ranks: usize,
    /// The network interface joining the hosts (e.g. eth0), if given.
    pub iface: Option<&'a str>,
    /// The binary, at the same path on every host.
    pub binary: &'a str,
    /// `train CONFIG.toml key=value ...` (or `doctor ...`).
    pub command: &'a [String],
    /// Variables set here (of `FORWARD`), to forward.
    pub env: Vec<String>,
    /// Open MPI refuses root unless told.
    pub as_root: bool,
}

impl Job<'_> {
    /// The launcher's argument vector (mpirun first).
    pub fn argv(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![self.mpirun.into()];
        let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
        let hosts = self.hosts.display().to_string();
        let n = self.ranks.to_string();
        match self.flavour {
            Flavour::OpenMpi => {
                push(&[
                    "--hostfile",
                    &hosts,
                    "-n",
                    &n,
                    "--map-by",
                    "node",
                    "--bind-to",
                    "none",
                ]);
                if self.as_root {
                    push(&["--allow-run-as-root"]);
                }
                for v in &self.env {
                    push(&["-x", v]);
                }
                if let Some(i) = self.iface {
                    // TCP for the data (btl) and the runtime (oob), by name or subnet;
                    // UCX (pml ucx) by name.
                    push(&[
                        "--mca",
                        "btl_tcp_if_include",
                        i,
                        "--mca",
                        "oob_tcp_if_include",
                        i,
                    ]);
                    if !i.contains('/') {
                        push(&["-x", &format!("UCX_NET_DEVICES={i}")]);
                    }
                }
                // A host that is down fails ssh in 10 s, one that asks for a password
                // at once; a host lost mid-run is noticed in seconds (else mpirun can
                // hang after an abort).
                push(&[
                    "--mca",
                    "plm_rsh_args",
                    "-o ConnectTimeout=10 -o BatchMode=yes",
                ]);
                push(&["--mca", "oob_tcp_keepalive_time", "5"]);
                push(&["--mca", "oob_tcp_keepalive_intvl", "1"]);
                push(&["--mca", "oob_tcp_keepalive_probes", "3"]);
            }
            Flavour::Hydra => {
                push(&[
                    "-f", &hosts, "-n", &n, "-ppn", "1", "-bind-to", "none", "-genvall",
                ]);
                // Hydra kills every rank within a fraction of a second of one dying,
                // often before rank 0's message (which host, which checkpoint) gets
                // out; rank 0's heartbeat ends the job itself (MPI_Abort), at once.
                push(&["-disable-auto-cleanup"]);
                if let Some(i) = self.iface {
                    // Hydra's own connections (-iface); the data: UCX (Debian's MPICH
                    // ignores -iface) and libfabric's TCP provider (Intel MPI).
                    push(&[
                        "-iface",
                        i,
                        "-genv",
                        "UCX_NET_DEVICES",
                        i,
                        "-genv",
                        "FI_TCP_IFACE",
                        i,
                    ]);
                }
            }
        }
        a.push(self.binary.into());
        a.extend(self.command.iter().cloned());
        a
    }
}

/// The variables of `FORWARD`, and nanogpt's own to forward, set in this environment.
pub fn forwarded_env() -> Vec<String> {
    let ours = crate::tuning::env::get().forwarded();
    let set = FORWARD.iter().filter(|v| std::env::var_os(v).is_some());
    set.chain(&ours).map(|v| v.to_string()).collect()
}

/// The hosts of a hostfile (first word of each line, `#` comments skipped),
/// refusing the other flavour's slot syntax.
pub fn read_hosts(path: &Path, flavour: Flavour) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the hosts file {}", path.display()))?;
    let mut hosts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        match flavour {
            Flavour::OpenMpi if line.contains(':') => bail!(
                "{}: `{line}` is Hydra's syntax (MPICH, Intel MPI); Open MPI's hosts file wants \
                 `HOST` or `HOST slots=N`: write one host name per line",
                at()
            ),
            Flavour::Hydra if line.contains("slots=") => bail!(
                "{}: `{line}` is Open MPI's syntax; Hydra's hosts file (MPICH, Intel MPI) wants \
                 `HOST` or `HOST:N`: write one host name per line",
                at()
            ),
            _ => {}
        }
        let host = line.split([' ', '\t', ':']).next().unwrap_or(line);
        hosts.push(host.to_string());
    }
    if hosts.is_empty() {
        bail!("the hosts file {} lists no host", path.display());
    }
    Ok(hosts)
}

/// A command line as a shell would take it back.
pub fn shell_line(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            let plain = !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c));
            match plain {
                true => a.clone(),
                false => format!("'{}'", a.replace('\'', "'\\''")),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_flavour_gets_its_own_flags() {
        assert_eq!(
            flavour_of("mpirun (Open MPI) 4.1.4"),
            Some(Flavour::OpenMpi)
        );
        assert_eq!(
            flavour_of("HYDRA build details:\n Version: 4.0.2"),
            Some(Flavour::Hydra)
        );
        assert_eq!(
            flavour_of("Intel(R) MPI Library for Linux"),
            Some(Flavour::Hydra)
        );
        assert_eq!(flavour_of("something else"), None);
        let command = ["train".to_string(), "c.toml".to_string()];
        let mut job = Job {
            flavour: Flavour::Hydra,
            mpirun: "mpirun",
            hosts: Path::new("hosts"),
            ranks: 3,
            iface: Some("eth0"),
            binary: "/opt/nanogpt",
            command: &command,
            env: vec![],
            as_root: false,
        };
        assert_eq!(
            shell_line(&job.argv()),
            "mpirun -f hosts -n 3 -ppn 1 -bind-to none -genvall -disable-auto-cleanup -iface eth0 \
             -genv UCX_NET_DEVICES eth0 -genv FI_TCP_IFACE eth0 /opt/nanogpt train c.toml"
        );
        job.flavour = Flavour::OpenMpi;
        job.env = vec!["HF_HOME".into()];
        let line = shell_line(&job.argv());
        assert!(
            line.starts_with(
                "mpirun --hostfile hosts -n 3 --map-by node --bind-to none -x HF_HOME \
                 --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
                 -x UCX_NET_DEVICES=eth0 \
                 --mca plm_rsh_args '-o ConnectTimeout=10 -o BatchMode=yes'"
            ),
            "{line}"
        );
        assert!(line.ends_with(" /opt/nanogpt train c.toml"), "{line}");
    }
}
