//! Before `launch` starts MPI, every host is asked over SSH, the way the launcher
//! will reach it, for the identity of the nanogpt binary at this binary's path and
//! for its networks (the hidden `nanogpt host-info`, run there). A host that cannot
//! be reached, whose SSH host key is not known, that lacks the binary or has
//! another build is named with the fix before any rank starts; so is a network
//! setting that would make MPI's start-up hang (the same bridge address, such as
//! docker0's, on every host).

use super::{shell_line, Flavour};
use crate::dist::identity;
use crate::dist::route;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::net::IpAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What `nanogpt host-info` prints about its host, as one line of JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostInfo {
    pub host: String,
    /// [`identity::binary_id`].
    pub binary: String,
    pub build: String,
    /// The linked MPI's `MPI_Get_library_version` (None: built without MPI).
    pub mpi: Option<String>,
    /// The networks MPI may use: running, non-loopback IPv4 interfaces.
    pub networks: Vec<Network>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Network {
    pub name: String,
    pub ip: IpAddr,
}

/// This host's [`HostInfo`].
pub fn this_host() -> HostInfo {
    HostInfo {
        host: crate::dist::this_host(),
        binary: identity::binary_id(),
        build: identity::build_hash().to_string(),
        mpi: mpi_version(),
        networks: route::candidates()
            .into_iter()
            .map(|a| Network {
                name: a.name,
                ip: a.ip,
            })
            .collect(),
    }
}

/// The linked MPI library's version, where built with MPI.
pub fn mpi_version() -> Option<String> {
    #[cfg(feature = "mpi")]
    return Some(crate::dist::mpi_library_version());
    #[cfg(not(feature = "mpi"))]
    None
}

/// How the launcher reaches a host: its SSH program (or stand-in) and the options
/// added before the host name.
#[derive(Clone, Debug, PartialEq)]
pub struct Agent {
    pub program: String,
    pub args: Vec<String>,
}

/// The agent `flavour`'s launcher will use: Open MPI's `plm_rsh_agent`, Hydra's
/// `HYDRA_LAUNCHER_EXEC`, else `ssh`. Plain ssh is told never to prompt
/// (BatchMode: a password or an unknown host key fails at once) and to give up on
/// an unreachable host after 10 s.
pub fn agent(flavour: Flavour, get: impl Fn(&str) -> Option<String>) -> Agent {
    let set = match flavour {
        Flavour::OpenMpi => get("OMPI_MCA_plm_rsh_agent"),
        Flavour::Hydra => get("HYDRA_LAUNCHER_EXEC"),
    };
    // Open MPI's default is "ssh : rsh" (the first one found).
    let set = set.and_then(|s| s.split(':').next().map(|w| w.trim().to_string()));
    let mut words: Vec<String> = set
        .unwrap_or_else(|| "ssh".into())
        .split_whitespace()
        .map(String::from)
        .collect();
    if words.is_empty() {
        words.push("ssh".into());
    }
    let program = words.remove(0);
    let mut args = words;
    if Path::new(&program).file_name().is_some_and(|n| n == "ssh") {
        for o in ["BatchMode=yes", "ConnectTimeout=10"] {
            args.extend(["-o".to_string(), o.to_string()]);
        }
    }
    Agent { program, args }
}

/// What one host's probe gave: its exit status (None: it did not end in time or
/// could not be run), standard output and error.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub status: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// How long a host may take to answer (ssh's own connect timeout is 10 s).
const PROBE_LIMIT: Duration = Duration::from_secs(30);

/// Runs `binary host-info` on every host through `agent`, all at once.
pub fn probe_all(agent: &Agent, hosts: &[String], binary: &str) -> Vec<Outcome> {
    let remote = shell_line(&[binary.to_string(), "host-info".to_string()]);
    let (tx, rx) = mpsc::channel();
    let mut pids = vec![None; hosts.len()];
    for (i, host) in hosts.iter().enumerate() {
        let child = Command::new(&agent.program)
            .args(&agent.args)
            .arg(host)
            .arg(&remote)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let tx = tx.clone();
        match child {
            Ok(child) => {
                pids[i] = Some(child.id());
                std::thread::spawn(move || {
                    let out = child.wait_with_output();
                    let outcome = match out {
                        Ok(o) => Outcome {
                            status: o.status.code(),
                            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
                            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
                        },
                        Err(e) => Outcome {
                            stderr: e.to_string(),
                            ..Outcome::default()
                        },
                    };
                    let _ = tx.send((i, outcome));
                });
            }
            Err(e) => {
                let _ = tx.send((
                    i,
                    Outcome {
                        stderr: format!("cannot run {}: {e}", agent.program),
                        ..Outcome::default()
                    },
                ));
            }
        }
    }
    drop(tx);
    let mut outcomes: Vec<Option<Outcome>> = vec![None; hosts.len()];
    let deadline = Instant::now() + PROBE_LIMIT;
    while outcomes.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((i, o)) => outcomes[i] = Some(o),
            Err(_) => break,
        }
    }
    outcomes
        .into_iter()
        .zip(pids)
        .map(|(o, pid)| {
            o.unwrap_or_else(|| {
                if let Some(pid) = pid {
                    // SAFETY: kill has no memory-safety preconditions; the pid is our
                    // child's, still unreaped (its waiting thread has not returned).
                    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                }
                Outcome {
                    stderr: format!("no answer in {} s", PROBE_LIMIT.as_secs()),
                    ..Outcome::default()
                }
            })
        })
        .collect()
}

/// What one host's probe means: its [`HostInfo`], or why it cannot run this job
/// (with the fix). `local` is this host's, whose build every host must run.
pub fn judge(
    host: &str,
    binary: &str,
    agent: &Agent,
    out: &Outcome,
    local: &HostInfo,
) -> Result<HostInfo, String> {
    let last = |text: &str| {
        text.lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim()
            .to_string()
    };
    let err = &out.stderr;
    let ssh = Path::new(&agent.program)
        .file_name()
        .is_some_and(|n| n == "ssh");
    let copy = format!("copy this binary there (e.g. `scp {binary} {host}:{binary}`)");
    match out.status {
        Some(0) => {}
        None => {
            return Err(format!(
                "did not answer over {} ({}): is it up and reachable?",
                agent.program,
                last(err)
            ))
        }
        Some(_) if err.contains("REMOTE HOST IDENTIFICATION HAS CHANGED") => {
            return Err(format!(
                "its SSH host key differs from the one in known_hosts (a reinstalled host, or \
                 someone in between): check the new key, then drop the old one with \
                 `ssh-keygen -R {host}` and accept the new one with `ssh {host} true`"
            ))
        }
        Some(_) if err.contains("Host key verification failed") => {
            return Err(format!(
                "its SSH host key is not in known_hosts, so ssh refuses it without asking \
                 (BatchMode, as MPI's launcher runs it): check the key's fingerprint and accept \
                 it once with `ssh {host} true`, or add it with `ssh-keyscan {host} >> \
                 ~/.ssh/known_hosts`"
            ))
        }
        Some(_) if err.contains("Permission denied") => {
            return Err(format!(
                "SSH login without a password is not set up ({}): add your public key to \
                 {host}'s ~/.ssh/authorized_keys, e.g. `ssh-copy-id {host}`",
                last(err)
            ))
        }
        Some(_) if err.contains("Could not resolve hostname") => {
            return Err(format!(
                "its name does not resolve here ({}): fix the hosts file or DNS",
                last(err)
            ))
        }
        Some(255) if ssh => {
            return Err(format!(
                "ssh cannot reach it ({}): is it up, is sshd running, does a firewall block \
                 port 22?",
                last(err)
            ))
        }
        Some(_) if err.contains("error while loading shared libraries") => {
            return Err(format!(
                "the nanogpt at {binary} cannot start there ({}): install the MPI library it \
                 was built against",
                last(err)
            ))
        }
        Some(127) => return Err(format!("there is no nanogpt at {binary}: {copy}")),
        Some(126) => {
            return Err(format!(
                "{binary} there is not an executable for that host ({}): {copy}",
                last(err)
            ))
        }
        Some(_) if err.contains("unrecognized subcommand") => {
            return Err(format!(
                "the nanogpt at {binary} there is another version (it does not know \
                 `host-info`): {copy}"
            ));
        }
        Some(code) => {
            return Err(format!(
                "running {binary} host-info there failed (status {code}: {})",
                last(err)
            ))
        }
    }
    let line = out.stdout.lines().rev().find(|l| l.starts_with('{'));
    let Some(info) = line.and_then(|l| serde_json::from_str::<HostInfo>(l).ok()) else {
        return Err(format!(
            "the nanogpt at {binary} there did not answer `host-info` as this one does (another \
             version?): {copy}"
        ));
    };
    if info.build != local.build {
        return Err(format!(
            "another build of nanogpt is at {binary} there ({}; here: {}): {copy}",
            info.binary, local.binary
        ));
    }
    Ok(info)
}

/// The network settings that would make MPI's start-up hang or fail, and the ones
/// to note, from every host's networks (`infos`, with the hosts file's names) and
/// `--iface`: (problems, warnings).
pub fn networks(infos: &[(String, HostInfo)], iface: Option<&str>) -> (Vec<String>, Vec<String>) {
    let (mut problems, mut warnings) = (Vec::new(), Vec::new());
    let list = |nets: &[Network]| {
        nets.iter()
            .map(|n| format!("{} {}", n.name, n.ip))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(iface) = iface {
        for (host, info) in infos {
            if !info.networks.iter().any(|n| matches_iface(n, iface)) {
                problems.push(format!(
                    "host {host} has no running network {iface} (it has {}): name one that \
                     every host has with --iface",
                    match info.networks.is_empty() {
                        true => "none but loopback".to_string(),
                        false => list(&info.networks),
                    }
                ));
            }
        }
        return (problems, warnings);
    }
    // The same address on several machines (as their own host names tell them
    // apart): MPI takes it for a way to reach the others and connects each host to
    // itself.
    let mut shared: Vec<(IpAddr, String, Vec<&str>, Vec<&str>)> = Vec::new();
    for (host, info) in infos {
        for n in &info.networks {
            match shared.iter_mut().find(|(ip, ..)| *ip == n.ip) {
                Some((_, _, hosts, machines)) => {
                    hosts.push(host);
                    if !machines.contains(&info.host.as_str()) {
                        machines.push(&info.host);
                    }
                }
                None => shared.push((n.ip, n.name.clone(), vec![host], vec![&info.host])),
            }
        }
    }
    let suggestion = suggest(infos);
    for (ip, name, hosts, _) in shared.iter().filter(|(.., m)| m.len() > 1) {
        problems.push(format!(
            "hosts {} all have the address {ip} ({name}): MPI would take it for a way to the \
             other hosts and connect each host to itself, so start-up hangs (Open MPI) or fails \
             (MPICH's UCX: connect ... refused); {}",
            hosts.join(", "),
            suggestion
        ));
    }
    if problems.is_empty() {
        if let Some((host, info)) = infos.iter().find(|(_, i)| i.networks.len() > 1) {
            warnings.push(format!(
                "host {host} has several networks ({}) and MPI was told none: it picks by \
                 itself; {}",
                list(&info.networks),
                suggestion
            ));
        }
    }
    (problems, warnings)
}

/// "add --iface NAME (...)": the interface names every host has, each with its
/// own address there.
fn suggest(infos: &[(String, HostInfo)]) -> String {
    let Some((_, first)) = infos.first() else {
        return "name the network that joins them with --iface".into();
    };
    let names: Vec<&str> = first
        .networks
        .iter()
        .map(|n| n.name.as_str())
        .filter(|name| {
            let ips: Vec<IpAddr> = infos
                .iter()
                .filter_map(|(_, i)| i.networks.iter().find(|n| n.name == *name).map(|n| n.ip))
                .collect();
            let mut distinct = ips.clone();
            distinct.sort();
            distinct.dedup();
            ips.len() == infos.len() && distinct.len() == ips.len()
        })
        .collect();
    match names.as_slice() {
        [one] => format!("add --iface {one}, the network every host has an address of its own on"),
        [] => "name the network that joins them with --iface NAME".into(),
        several => format!(
            "add --iface NAME with the one that joins them ({})",
            several.join(" or ")
        ),
    }
}

/// Whether `n` is the `--iface` network: by name, or (Open MPI) a subnet holding it.
fn matches_iface(n: &Network, iface: &str) -> bool {
    match iface.split_once('/') {
        Some((base, bits)) => match (base.parse::<IpAddr>(), bits.parse::<u32>(), n.ip) {
            (Ok(IpAddr::V4(base)), Ok(bits), IpAddr::V4(ip)) if bits <= 32 => {
                let mask = u32::MAX.checked_shl(32 - bits).unwrap_or(0);
                u32::from(base) & mask == u32::from(ip) & mask
            }
            _ => false,
        },
        None => n.name == iface,
    }
}

/// Probes `hosts` (the first rank's host first) and refuses to start when any
/// cannot run this job, naming each with the fix; prints what is only a warning.
pub fn check_hosts(
    flavour: Flavour,
    hosts: &[String],
    binary: &str,
    iface: Option<&str>,
) -> Result<()> {
    let agent = agent(flavour, |name| std::env::var(name).ok());
    let local = this_host();
    let outcomes = probe_all(&agent, hosts, binary);
    let mut problems = Vec::new();
    let mut infos = Vec::new();
    for (host, out) in hosts.iter().zip(&outcomes) {
        match judge(host, binary, &agent, out, &local) {
            Ok(info) => infos.push((host.clone(), info)),
            Err(why) => problems.push(format!("host {host}: {why}")),
        }
    }
    if problems.is_empty() {
        let (nets, warnings) = networks(&infos, iface);
        problems.extend(nets);
        for w in warnings {
            crate::errln!("launch: warning: {w}");
        }
    }
    if problems.is_empty() {
        crate::outln!(
            "launch: {} host(s) reached over {}, each with this build ({}) at {binary}",
            hosts.len(),
            agent.program,
            local.build
        );
        return Ok(());
    }
    for p in &problems {
        crate::errln!("launch: {p}");
    }
    bail!(
        "refusing to start: {} problem(s) above, found before MPI started; fix them, then \
         launch again",
        problems.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(build: &str, nets: &[(&str, &str)]) -> HostInfo {
        HostInfo {
            host: nets
                .first()
                .map_or("x".into(), |(_, ip)| format!("machine {ip}")),
            binary: format!("nanogpt 0.1.0 (build {build}, features: mpi)"),
            build: build.into(),
            mpi: Some("MPICH Version: 4.0.2".into()),
            networks: nets
                .iter()
                .map(|(n, ip)| Network {
                    name: n.to_string(),
                    ip: ip.parse().unwrap(),
                })
                .collect(),
        }
    }

    #[test]
    fn plain_ssh_never_prompts_and_the_launchers_agent_is_used() {
        let a = agent(Flavour::Hydra, |_| None);
        assert_eq!(a.program, "ssh");
        assert_eq!(
            a.args,
            ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"].map(String::from)
        );
        let a = agent(Flavour::OpenMpi, |n| {
            (n == "OMPI_MCA_plm_rsh_agent").then(|| "/opt/my-ssh -q : rsh".into())
        });
        assert_eq!(
            (a.program.as_str(), a.args.as_slice()),
            ("/opt/my-ssh", &["-q".to_string()][..])
        );
    }

    #[test]
    fn each_failure_is_named_with_its_fix() {
        let local = info("aaaaaaaaaaaa", &[]);
        let ssh = agent(Flavour::Hydra, |_| None);
        let judge = |status: Option<i32>, stdout: &str, stderr: &str| {
            let out = Outcome {
                status,
                stdout: stdout.into(),
                stderr: stderr.into(),
            };
            judge("h3", "/opt/nanogpt", &ssh, &out, &local)
        };
        let err = judge(Some(255), "", "Host key verification failed.\r\n").unwrap_err();
        assert!(
            err.contains("host key is not in known_hosts") && err.contains("`ssh h3 true`"),
            "{err}"
        );
        let err = judge(
            Some(255),
            "",
            "@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.",
        )
        .unwrap_err();
        assert!(err.contains("ssh-keygen -R h3"), "{err}");
        let err = judge(Some(255), "", "root@h3: Permission denied (publickey).").unwrap_err();
        assert!(err.contains("ssh-copy-id h3"), "{err}");
        let err = judge(
            Some(255),
            "",
            "ssh: connect to host h3 port 22: Connection refused",
        )
        .unwrap_err();
        assert!(err.contains("ssh cannot reach it (ssh: connect"), "{err}");
        let err = judge(Some(127), "", "sh: 1: /opt/nanogpt: not found").unwrap_err();
        assert_eq!(
            err,
            "there is no nanogpt at /opt/nanogpt: copy this binary there (e.g. `scp \
             /opt/nanogpt h3:/opt/nanogpt`)"
        );
        let err = judge(
            Some(127),
            "",
            "/opt/nanogpt: error while loading shared libraries: libmpich.so.12: cannot open",
        )
        .unwrap_err();
        assert!(err.contains("install the MPI library"), "{err}");
        let err = judge(Some(2), "", "error: unrecognized subcommand 'host-info'").unwrap_err();
        assert!(err.contains("another version"), "{err}");
        let err = judge(None, "", "").unwrap_err();
        assert!(err.starts_with("did not answer over ssh"), "{err}");
        // Another build: both named.
        let other = serde_json::to_string(&info("bbbbbbbbbbbb", &[])).unwrap();
        let err = judge(Some(0), &other, "").unwrap_err();
        assert!(
            err.contains("(build bbbbbbbbbbbb")
                && err.contains("here: nanogpt 0.1.0 (build aaaaaaaaaaaa"),
            "{err}"
        );
        let same = serde_json::to_string(&info("aaaaaaaaaaaa", &[])).unwrap();
        assert!(judge(Some(0), &format!("motd\n{same}\n"), "").is_ok());
    }

    #[test]
    fn a_bridge_address_on_every_host_is_refused_with_the_interface_to_name() {
        let host = |i: u8| {
            let eth = format!("10.0.0.{i}");
            (
                format!("h{i}"),
                info("a", &[("eth0", &eth), ("docker0", "172.17.0.1")]),
            )
        };
        let hosts = vec![host(1), host(2), host(3)];
        let (problems, warnings) = networks(&hosts, None);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("hosts h1, h2, h3 all have the address 172.17.0.1 (docker0)"),
            "{problems:?}"
        );
        assert!(
            problems[0]
                .ends_with("add --iface eth0, the network every host has an address of its own on"),
            "{problems:?}"
        );
        assert!(warnings.is_empty());
        // Named: every host has it (by name or, for Open MPI, by subnet).
        assert_eq!(networks(&hosts, Some("eth0")), (vec![], vec![]));
        assert_eq!(networks(&hosts, Some("10.0.0.0/24")), (vec![], vec![]));
        let (problems, _) = networks(&hosts, Some("ib0"));
        assert_eq!(problems.len(), 3);
        assert!(
            problems[0].starts_with(
                "host h1 has no running network ib0 (it has eth0 10.0.0.1, docker0 172.17.0.1)"
            ),
            "{problems:?}"
        );
        // Several networks, none shared: a warning only.
        let apart = vec![
            (
                "h1".to_string(),
                info("a", &[("eth0", "10.0.0.1"), ("eth1", "10.1.0.1")]),
            ),
            (
                "h2".to_string(),
                info("a", &[("eth0", "10.0.0.2"), ("eth1", "10.1.0.2")]),
            ),
        ];
        let (problems, warnings) = networks(&apart, None);
        assert!(problems.is_empty(), "{problems:?}");
        assert!(
            warnings[0].contains("host h1 has several networks (eth0 10.0.0.1, eth1 10.1.0.1)")
                && warnings[0].contains("--iface NAME with the one that joins them (eth0 or eth1)"),
            "{warnings:?}"
        );
        let single = vec![("h1".to_string(), info("a", &[("eth0", "10.0.0.1")]))];
        assert_eq!(networks(&single, None), (vec![], vec![]));
        // One machine listed twice (localhost, 127.0.0.1) shares nothing with itself.
        let twice = vec![host(1), (String::from("localhost"), host(1).1)];
        assert!(networks(&twice, None).0.is_empty());
    }
}
