//! `nanogpt launch`: the MPI command line of a job of one rank per host, for the
//! MPI installed here (Open MPI, or Hydra: MPICH and Intel MPI), printed so that it
//! can be run by hand, then checked with `nanogpt doctor` and run.

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

/// Environment variables forwarded to every rank when set here.
const FORWARD: [&str; 6] = [
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "NANOGPT_START_TIMEOUT_S",
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
                    push(&[
                        "--mca",
                        "btl_tcp_if_include",
                        i,
                        "--mca",
                        "oob_tcp_if_include",
                        i,
                    ]);
                }
                // A host that is down fails ssh in 10 s; a host lost mid-run is
                // noticed in seconds (else mpirun can hang after an abort).
                push(&["--mca", "plm_rsh_args", "-o ConnectTimeout=10"]);
                push(&["--mca", "oob_tcp_keepalive_time", "5"]);
                push(&["--mca", "oob_tcp_keepalive_intvl", "1"]);
                push(&["--mca", "oob_tcp_keepalive_probes", "3"]);
            }
            Flavour::Hydra => {
                push(&[
                    "-f", &hosts, "-n", &n, "-ppn", "1", "-bind-to", "none", "-genvall",
                ]);
                if let Some(i) = self.iface {
                    push(&["-iface", i]);
                }
            }
        }
        a.push(self.binary.into());
        a.extend(self.command.iter().cloned());
        a
    }
}

/// The variables of `FORWARD` set in this environment.
pub fn forwarded_env() -> Vec<String> {
    FORWARD
        .iter()
        .filter(|v| std::env::var_os(v).is_some())
        .map(|v| v.to_string())
        .collect()
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
            "mpirun -f hosts -n 3 -ppn 1 -bind-to none -genvall -iface eth0 /opt/nanogpt train c.toml"
        );
        job.flavour = Flavour::OpenMpi;
        job.env = vec!["HF_HOME".into()];
        let line = shell_line(&job.argv());
        assert!(
            line.starts_with(
                "mpirun --hostfile hosts -n 3 --map-by node --bind-to none -x HF_HOME \
                 --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
                 --mca plm_rsh_args '-o ConnectTimeout=10'"
            ),
            "{line}"
        );
        assert!(line.ends_with(" /opt/nanogpt train c.toml"), "{line}");
    }
}
