//! The start-up check-in: before MPI starts, every rank tells a small TCP server
//! (the hub) that it runs, on which host, with which build; once MPI is up it says
//! so, and a rank that refuses to start says why. When MPI start-up hangs, the
//! start-up timer asks the hub who never checked in (never started: the launcher's
//! output says why, e.g. Hydra's `execvp error`) and who did (then the network
//! between the hosts is at fault), and rank 0 ends the job early when a rank never
//! started or refused.
//!
//! The hub is `nanogpt launch` (it passes `NANOGPT_CHECKIN=PORT TOKEN ADDRS` to the
//! ranks and knows every rank's host), or, when the job is started by hand, rank 0
//! itself if it runs on the launcher's host (the article's `mpirun -f hosts ...` on
//! the first host), at a port and token derived from the launcher's own job
//! address, which every rank sees (Open MPI's `OMPI_MCA_orte_hnp_uri`, Hydra's
//! `--control-port` of the proxy that started it). Without a hub the timer still
//! fires, saying less. Everything here is best effort and never delays start-up.

use super::launcher::{Launcher, Started};
use super::wire::{random_token, Invitation, Lines};
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the hub knows of one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Seen {
    /// Not heard from.
    Never,
    /// Running, in MPI start-up.
    Started { host: String, build: String },
    /// MPI start-up completed.
    Up { host: String },
    /// Refused to start (its message says why).
    Failed { host: String, why: String },
}

/// What the hub knows of every rank, and the hosts it expects them on (`launch`
/// knows them; by hand, only the ranks that checked in say).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Board {
    pub ranks: Vec<Seen>,
    pub expected_hosts: Vec<Option<String>>,
}

impl Board {
    pub fn new(size: usize, expected_hosts: Vec<Option<String>>) -> Board {
        let mut expected_hosts = expected_hosts;
        expected_hosts.resize(size, None);
        Board {
            ranks: vec![Seen::Never; size],
            expected_hosts,
        }
    }

    /// The ranks never heard from.
    pub fn never_started(&self) -> Vec<usize> {
        (0..self.ranks.len())
            .filter(|&r| self.ranks[r] == Seen::Never)
            .collect()
    }

    /// The first rank that refused to start, with its reason.
    pub fn failed(&self) -> Option<(usize, String)> {
        self.ranks.iter().enumerate().find_map(|(r, s)| match s {
            Seen::Failed { why, .. } => Some((r, why.clone())),
            _ => None,
        })
    }

    /// `rank R (host H)`, the host as the rank said, else as expected, else unknown.
    fn named(&self, r: usize) -> String {
        let host = match &self.ranks[r] {
            Seen::Started { host, .. } | Seen::Up { host } | Seen::Failed { host, .. } => {
                Some(host.clone())
            }
            Seen::Never => self.expected_hosts[r].clone(),
        };
        match host {
            Some(h) => format!("rank {r} (host {h})"),
            None => format!("rank {r}"),
        }
    }

    /// The ranks that started and wait in MPI start-up, named.
    pub fn waiting(&self) -> String {
        (0..self.ranks.len())
            .filter(|&r| matches!(self.ranks[r], Seen::Started { .. }))
            .map(|r| self.named(r))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Who never started (first) and who is still in MPI start-up, for the
    /// start-up timer's message; empty when every rank is up.
    pub fn summary(&self) -> String {
        let list = |ranks: Vec<usize>| {
            ranks
                .into_iter()
                .map(|r| self.named(r))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        let never = self.never_started();
        if !never.is_empty() {
            parts.push(format!(
                "never started (see the launcher's output for why, e.g. a missing binary or \
                 library): {}",
                list(never)
            ));
        }
        if let Some((r, why)) = self.failed() {
            parts.push(format!("refused to start: {}: {why}", self.named(r)));
        }
        let waiting = self.waiting();
        if !waiting.is_empty() {
            parts.push(format!("started, still waiting in MPI start-up: {waiting}"));
        }
        parts.join("; ")
    }

    fn record(&mut self, rank: usize, seen: Seen) {
        if let Some(slot) = self.ranks.get_mut(rank) {
            // A rank that failed stays failed.
            if !matches!(slot, Seen::Failed { .. }) {
                *slot = seen;
            }
        }
    }
}

/// A hub: a listening socket and the board its connections fill.
pub struct Hub {
    board: Arc<Mutex<Board>>,
    pub invitation: Invitation,
}

impl Hub {
    /// Listens on `port` (0: any) of every address, for `size` ranks expected on
    /// `expected_hosts`, advertising `addrs`; None if the port cannot be opened.
    pub fn serve(
        port: u16,
        token: u64,
        addrs: Vec<IpAddr>,
        size: usize,
        expected_hosts: Vec<Option<String>>,
    ) -> Option<Hub> {
        let listener = TcpListener::bind(("0.0.0.0", port)).ok()?;
        let port = listener.local_addr().ok()?.port();
        let board = Arc::new(Mutex::new(Board::new(size, expected_hosts)));
        let shared = Arc::clone(&board);
        std::thread::Builder::new()
            .name("checkin-hub".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let board = Arc::clone(&shared);
                    let _ = std::thread::Builder::new()
                        .name("checkin".into())
                        .spawn(move || answer(Lines::new(stream), token, &board));
                }
            })
            .ok()?;
        Some(Hub {
            board,
            invitation: Invitation { addrs, port, token },
        })
    }

    /// A hub for `nanogpt launch`: any port, a fresh token, this host's addresses
    /// (`first` before the others where given; loopback last, for ranks on this host).
    pub fn for_launch(size: usize, hosts: &[String], first: Option<IpAddr>) -> Option<Hub> {
        let mut addrs: Vec<IpAddr> = first.into_iter().collect();
        for (_, ip) in super::route::interfaces() {
            if ip.is_ipv4() && !ip.is_loopback() && !addrs.contains(&ip) {
                addrs.push(ip);
            }
        }
        addrs.push(IpAddr::from([127, 0, 0, 1]));
        let expected = hosts.iter().map(|h| Some(h.clone())).collect();
        Hub::serve(0, random_token(), addrs, size, expected)
    }

    pub fn board(&self) -> Board {
        self.board.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Serves one connection: `hello TOKEN RANK HOST BUILD`, then `up` or `fail WHY`;
/// or `query TOKEN`, answered with the board as one line of JSON.
fn answer(mut lines: Lines, token: u64, board: &Mutex<Board>) {
    let Some(first) = lines.wait_line(Duration::from_secs(5)) else {
        return;
    };
    let mut w = first.splitn(5, ' ');
    let (verb, their) = (w.next(), w.next().map(|t| u64::from_str_radix(t, 16)));
    if their != Some(Ok(token)) {
        return;
    }
    let lock = || board.lock().unwrap_or_else(|e| e.into_inner());
    match verb {
        Some("query") => {
            let text = serde_json::to_string(&*lock()).unwrap_or_default();
            let _ = lines.send(&text);
        }
        Some("hello") => {
            let (Some(Ok(rank)), Some(host), build) =
                (w.next().map(str::parse::<usize>), w.next(), w.next())
            else {
                return;
            };
            let host = host.to_string();
            let build = build.unwrap_or("?").to_string();
            lock().record(
                rank,
                Seen::Started {
                    host: host.clone(),
                    build,
                },
            );
            // Until MPI is up: `up` or `fail WHY`; a closed connection changes nothing
            // (a rank that died is the launcher's to report).
            while let Ok(line) = lines.next(Duration::from_secs(3600)) {
                match line
                    .as_deref()
                    .map(|l| l.split_once(' ').unwrap_or((l, "")))
                {
                    Some(("up", _)) => {
                        lock().record(rank, Seen::Up { host });
                        return;
                    }
                    Some(("fail", why)) => {
                        let why = why.to_string();
                        lock().record(rank, Seen::Failed { host, why });
                        return;
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

/// Where this rank checks in, derived from the launcher when started by hand.
struct Rendezvous {
    invitation: Invitation,
    /// This rank (rank 0, on the launcher's host) serves the hub itself.
    serve: bool,
}

/// The hub `launch` named (`named`: `NANOGPT_CHECKIN`), else the one derived from
/// the launcher's job address (see the module's doc; `get` reads the launcher's
/// variables), else None.
fn rendezvous(
    started: &Started,
    named: Option<&str>,
    get: &dyn Fn(&str) -> Option<String>,
) -> Option<Rendezvous> {
    if let Some(inv) = named.and_then(Invitation::decode) {
        return Some(Rendezvous {
            invitation: inv,
            serve: false,
        });
    }
    let (id, addrs) = launcher_address(started.launcher, get)?;
    let h = fnv(id.as_bytes());
    let here: Vec<IpAddr> = super::route::interfaces()
        .into_iter()
        .map(|(_, ip)| ip)
        .collect();
    Some(Rendezvous {
        serve: started.rank == Some(0) && addrs.iter().any(|a| here.contains(a)),
        invitation: Invitation {
            addrs,
            // Below Linux's ephemeral ports (32768-60999), where nothing else of the
            // job listens.
            port: 20000 + (h % 12000) as u16,
            token: fnv(format!("{id} token").as_bytes()),
        },
    })
}

/// The launcher's job address: a string unique to the job, and the launcher host's
/// addresses.
fn launcher_address(
    launcher: Launcher,
    get: &dyn Fn(&str) -> Option<String>,
) -> Option<(String, Vec<IpAddr>)> {
    match launcher {
        // "3425435648.0;tcp://10.0.0.1,172.17.0.1:41237"
        Launcher::OpenMpi => {
            let uri = get("OMPI_MCA_orte_hnp_uri")?;
            let tcp = uri.split(';').find_map(|p| p.strip_prefix("tcp://"))?;
            let (list, _) = tcp.rsplit_once(':')?;
            let addrs = list.split(',').filter_map(|a| a.parse().ok()).collect();
            Some((uri, addrs))
        }
        // The proxy that started this process: hydra_pmi_proxy --control-port HOST:PORT
        Launcher::Hydra => {
            let parent = std::os::unix::process::parent_id();
            let cmdline = std::fs::read(format!("/proc/{parent}/cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let at = args.iter().position(|a| a == "--control-port")?;
            let control = args.get(at + 1)?.clone();
            let (host, port) = control.rsplit_once(':')?;
            let addrs = (host, port.parse::<u16>().ok()?)
                .to_socket_addrs()
                .ok()?
                .map(|a| a.ip())
                .collect();
            Some((control, addrs))
        }
        Launcher::Srun => {
            let ip = get("SLURM_LAUNCH_NODE_IPADDR")?.parse().ok()?;
            let id = format!(
                "{}.{}",
                get("SLURM_JOB_ID").unwrap_or_default(),
                get("SLURM_STEP_ID").unwrap_or_default()
            );
            Some((id, vec![ip]))
        }
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// This rank's check-in, from before `MPI_Init` until MPI is up.
pub struct Checkin {
    rank: Option<usize>,
    invitation: Option<Invitation>,
    /// The hub, when this rank serves it.
    hub: Option<Hub>,
    /// The connection to the hub, once made.
    link: Arc<Mutex<Option<Lines>>>,
    done: Arc<AtomicBool>,
}

impl Checkin {
    /// No hub: nothing to tell, nobody to ask.
    pub fn none() -> Checkin {
        Checkin {
            rank: None,
            invitation: None,
            hub: None,
            link: Arc::new(Mutex::new(None)),
            done: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Checks in (on a thread of its own, retrying until the hub answers or MPI is
    /// up), and serves the hub first where this rank is to.
    pub fn start(started: &Started) -> Checkin {
        let get = |name: &str| std::env::var(name).ok();
        let named = crate::tuning::env::get().checkin.as_deref();
        let Some(rv) = rendezvous(started, named, &get) else {
            return Checkin::none();
        };
        let hub = match rv.serve {
            true => {
                let inv = &rv.invitation;
                let size = started.size.unwrap_or(1);
                Hub::serve(inv.port, inv.token, inv.addrs.clone(), size, vec![])
            }
            false => None,
        };
        let checkin = Checkin {
            rank: started.rank,
            invitation: Some(rv.invitation.clone()),
            hub,
            link: Arc::new(Mutex::new(None)),
            done: Arc::new(AtomicBool::new(false)),
        };
        let (link, done, inv) = (
            Arc::clone(&checkin.link),
            Arc::clone(&checkin.done),
            rv.invitation,
        );
        let hello = format!(
            "hello {:016x} {} {} {}",
            inv.token,
            started.rank.unwrap_or(0),
            super::this_host().replace(' ', "_"),
            super::identity::build_hash()
        );
        let _ = std::thread::Builder::new()
            .name("checkin".into())
            .spawn(move || {
                while !done.load(Ordering::SeqCst) {
                    if let Some(mut lines) = connect(&inv) {
                        if lines.send(&hello).is_ok() {
                            *link.lock().unwrap_or_else(|e| e.into_inner()) = Some(lines);
                            return;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
            });
        checkin
    }

    /// This rank refuses to start: tells the hub why (waiting up to 2 s for the
    /// connection, as the process is about to end anyway).
    pub fn fail(&self, why: &str) {
        self.finish(&format!("fail {}", why.replace('\n', " ")), 20);
    }

    /// MPI start-up completed (never waits: the hub may be out of reach).
    pub fn up(&self) {
        self.finish("up", 1);
    }

    /// Sends `line` and ends the check-in, trying `tries` times 100 ms apart.
    fn finish(&self, line: &str, tries: usize) {
        if self.done.swap(true, Ordering::SeqCst) || self.invitation.is_none() {
            return;
        }
        for attempt in 0..tries {
            if let Some(mut lines) = self.link.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = lines.send(line);
                return;
            }
            if attempt + 1 < tries {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// What the hub knows: read here where this rank serves it, else asked (None
    /// without a hub or an answer).
    pub fn board(&self) -> Option<Board> {
        if let Some(hub) = &self.hub {
            return Some(hub.board());
        }
        let inv = self.invitation.as_ref()?;
        let mut lines = connect(inv)?;
        lines.send(&format!("query {:016x}", inv.token)).ok()?;
        let text = lines.wait_line(Duration::from_secs(3))?;
        serde_json::from_str(&text).ok()
    }

    /// Whether this rank is rank 0 (the one that ends the job early).
    pub fn is_root(&self) -> bool {
        self.rank == Some(0)
    }
}

/// A connection to the hub at the first of its addresses that answers.
fn connect(inv: &Invitation) -> Option<Lines> {
    inv.addrs.iter().find_map(|ip| {
        let addr = SocketAddr::new(*ip, inv.port);
        TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .ok()
            .map(Lines::new)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_board_lists_who_never_started_first() {
        let mut b = Board::new(3, vec![Some("h1".into()), Some("h2".into())]);
        assert_eq!(b.never_started(), [0, 1, 2]);
        b.record(
            0,
            Seen::Started {
                host: "h1".into(),
                build: "abc".into(),
            },
        );
        b.record(1, Seen::Up { host: "h2".into() });
        assert_eq!(
            b.summary(),
            "never started (see the launcher's output for why, e.g. a missing binary or \
             library): rank 2; started, still waiting in MPI start-up: rank 0 (host h1)"
        );
        b.record(
            2,
            Seen::Failed {
                host: "h3".into(),
                why: "built against MPICH".into(),
            },
        );
        b.record(2, Seen::Up { host: "h3".into() });
        assert_eq!(b.failed(), Some((2, "built against MPICH".into())));
        assert!(b
            .summary()
            .starts_with("refused to start: rank 2 (host h3): built against MPICH"));
    }

    #[test]
    fn ranks_check_in_with_a_hub_that_answers_queries() {
        let hub = Hub::serve(
            0,
            7,
            vec![IpAddr::from([127, 0, 0, 1])],
            2,
            vec![None, Some("far".into())],
        )
        .unwrap();
        // As `Checkin::start` does, with this hub.
        let checkin = |rank: usize| {
            let mut lines = connect(&hub.invitation).unwrap();
            let hello = format!("hello {:016x} {rank} here b1", hub.invitation.token);
            lines.send(&hello).unwrap();
            lines
        };
        let mut zero = checkin(0);
        let asker = Checkin {
            rank: Some(1),
            invitation: Some(hub.invitation.clone()),
            hub: None,
            link: Arc::new(Mutex::new(None)),
            done: Arc::new(AtomicBool::new(true)),
        };
        let until = |want: &dyn Fn(&Board) -> bool| {
            for _ in 0..100 {
                if let Some(b) = asker.board() {
                    if want(&b) {
                        return b;
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            panic!("the hub never got there: {:?}", hub.board());
        };
        let b = until(&|b| b.ranks[0] != Seen::Never);
        assert_eq!(b.never_started(), [1]);
        assert!(b.summary().contains("rank 1 (host far)"), "{}", b.summary());
        zero.send("up").unwrap();
        until(&|b| matches!(b.ranks[0], Seen::Up { .. }));
        // A wrong token is not this job's.
        let mut stranger = connect(&hub.invitation).unwrap();
        stranger.send("hello 0000000000000008 1 x y").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(hub.board().ranks[1], Seen::Never);
    }

    #[test]
    fn by_hand_the_hub_is_derived_from_the_launchers_address() {
        let started = Started {
            launcher: Launcher::OpenMpi,
            size: Some(3),
            rank: Some(1),
        };
        let uri = "3425435648.0;tcp://10.9.9.9,172.17.0.1:41237";
        let env = |name: &str| (name == "OMPI_MCA_orte_hnp_uri").then(|| uri.to_string());
        let rv = rendezvous(&started, None, &env).unwrap();
        assert_eq!(
            rv.invitation.addrs,
            [
                "10.9.9.9".parse::<IpAddr>().unwrap(),
                "172.17.0.1".parse().unwrap()
            ]
        );
        assert!((20000..32000).contains(&rv.invitation.port));
        assert!(!rv.serve, "only rank 0 serves");
        // The same job gives every rank the same hub; `launch`'s variable wins.
        assert_eq!(
            rendezvous(&started, None, &env).unwrap().invitation,
            rv.invitation
        );
        let named = Some("4000 00000000000000aa 10.1.1.1");
        let rv = rendezvous(&started, named, &env).unwrap();
        assert_eq!(rv.invitation.port, 4000);
        assert!(rendezvous(&started, None, &|_| None).is_none());
    }
}
