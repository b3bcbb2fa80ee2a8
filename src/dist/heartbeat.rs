//! A heartbeat between rank 0 and every other rank, so that a rank that died or
//! can no longer be reached is named within seconds, while a slow step still waits.
//!
//! MPI notices a dead process only through its launcher (Hydra then tears the job
//! down with its own messages and none of ours), and a stopped process, a hung host
//! or a cut link not at all: the others would wait in their next collective until
//! `collective_timeout_s`. So each rank keeps one TCP connection to rank 0 (rank 0
//! listens on a port it tells the others through MPI at start-up), and a thread at
//! each end writes a line every `interval()` and reads the other's:
//!
//! - a connection that closes without a `bye` is a process that is gone (killed,
//!   crashed, out of memory): the kernel closes its sockets at once;
//! - no line for `heartbeat_timeout_s` is a process that is stopped or hung, or a
//!   host that is down or cut off.
//!
//! Either ends the job with one message naming the rank, its host and the
//! checkpoint to resume from. The threads run beside the computation, so a long
//! step keeps beating. When the launcher ends the job first (SIGTERM: Open MPI's
//! runtime notices a lost host by its own keepalive, sometimes sooner than the
//! heartbeat's timeout), a peer already silent for a few beats is named then. A rank that ends normally says `bye`; one that aborts the
//! job says `abort` (its own message explains), so neither is reported as lost.
//! Rank 0 passes each checkpoint it writes on (`ckpt ITER PATH`), so every rank can
//! name it.

use super::wire::{random_token, Invitation, Lines};
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// What ends the job when a peer is lost: prints the message and aborts.
type OnLost = Box<dyn Fn(String) + Send + Sync>;

/// The default `heartbeat_timeout_s`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The heartbeat of this process, once [`start`] ran.
static HEARTBEAT: OnceLock<Arc<Shared>> = OnceLock::new();

/// The last checkpoint rank 0 wrote (or resumed from): (path, resume iteration).
static LAST_CHECKPOINT: Mutex<Option<(String, u64)>> = Mutex::new(None);

struct Shared {
    rank: usize,
    /// Every rank's host, in rank order.
    hosts: Vec<String>,
    /// Silence after which a peer is lost, ms; 0 = never.
    timeout_ms: AtomicU64,
    /// Set when this process ends or aborts: no more reports.
    ending: AtomicBool,
    /// Set once a loss was reported.
    fired: AtomicBool,
    /// The open connections (rank 0: one per peer; others: the one to rank 0).
    links: Mutex<Vec<TcpStream>>,
    /// When each peer was last heard from (None: not connected, or said goodbye).
    heard: Mutex<Vec<Option<Instant>>>,
    on_lost: OnLost,
}

impl Shared {
    fn new(rank: usize, hosts: Vec<String>, on_lost: OnLost) -> Shared {
        let n = hosts.len();
        Shared {
            rank,
            hosts,
            timeout_ms: AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64),
            ending: AtomicBool::new(false),
            fired: AtomicBool::new(false),
            links: Mutex::new(Vec::new()),
            heard: Mutex::new(vec![None; n]),
            on_lost,
        }
    }

    fn heard(&self, peer: usize, at: Option<Instant>) {
        if let Some(slot) = self
            .heard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(peer)
        {
            *slot = at;
        }
    }
}

/// Rank 0's listening socket, before the others know of it.
pub struct Host {
    listener: TcpListener,
    pub invitation: Invitation,
}

/// Rank 0: opens the port the others will connect to. None when no socket can be
/// opened (the job then runs without a heartbeat).
pub fn listen() -> Option<Host> {
    let listener = TcpListener::bind(("0.0.0.0", 0)).ok()?;
    let port = listener.local_addr().ok()?.port();
    let mut addrs: Vec<IpAddr> = super::route::interfaces()
        .into_iter()
        .map(|(_, ip)| ip)
        .filter(|ip| ip.is_ipv4() && !ip.is_loopback())
        .collect();
    addrs.dedup();
    Some(Host {
        listener,
        invitation: Invitation {
            addrs,
            port,
            token: random_token(),
        },
    })
}

/// Starts this rank's heartbeat: rank 0 with its `host` socket, every other rank
/// with rank 0's invitation. `hosts` names every rank's host; `on_lost` ends the
/// job with the message it is given. Call once.
pub fn start(
    rank: usize,
    hosts: Vec<String>,
    host: Option<Host>,
    invitation: Option<Invitation>,
    on_lost: impl Fn(String) + Send + Sync + 'static,
) {
    let shared = Arc::new(Shared::new(rank, hosts, Box::new(on_lost)));
    if HEARTBEAT.set(Arc::clone(&shared)).is_err() {
        return;
    }
    let watched = Arc::clone(&shared);
    let _ = std::thread::Builder::new()
        .name("heartbeat-watch".into())
        .spawn(move || watch_for_termination(&watched));
    let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
        let _ = std::thread::Builder::new().name(name.into()).spawn(f);
    };
    match (rank, host, invitation) {
        (0, Some(host), _) => spawn("heartbeat-accept", Box::new(move || accept(shared, host))),
        (r, _, Some(inv)) if r > 0 => {
            spawn("heartbeat", Box::new(move || connect_to_root(shared, inv)))
        }
        _ => {}
    }
}

/// When this process gets SIGTERM (the launcher ending the job, or a scheduler),
/// names the peers silent for three beats or more: Open MPI's runtime, noticing a
/// lost host by TCP keepalive, can end the job before the heartbeat's timeout, and
/// then nobody would say which host and checkpoint. Says nothing when every peer
/// is beating (an ordinary stop: the training loop writes its checkpoint).
fn watch_for_termination(hb: &Shared) {
    let term = Arc::new(AtomicBool::new(false));
    if signal_hook::flag::register(libc::SIGTERM, Arc::clone(&term)).is_err() {
        return;
    }
    while !term.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let every = interval(hb.timeout_ms.load(Ordering::SeqCst).max(1));
    let silent: Vec<(usize, Duration)> = hb
        .heard
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .enumerate()
        .filter_map(|(peer, at)| Some((peer, at.as_ref()?.elapsed())))
        .filter(|(_, quiet)| *quiet >= every * 3)
        .collect();
    if silent.is_empty()
        || hb.ending.load(Ordering::SeqCst)
        || hb.fired.swap(true, Ordering::SeqCst)
    {
        return;
    }
    let host = |r: usize| hb.hosts.get(r).map_or("?", |h| h.as_str());
    let named: Vec<String> = silent
        .iter()
        .map(|&(r, quiet)| {
            format!(
                "rank {r} (host {}) for {:.0} s",
                host(r),
                quiet.as_secs_f64()
            )
        })
        .collect();
    crate::errln!(
        "error: rank {} of {} (host {}): the launcher is ending the job (SIGTERM) while no \
         heartbeat has come from {}: its process is stopped or hung, or its host is down or \
         cut off the network; {}",
        hb.rank,
        hb.hosts.len(),
        host(hb.rank),
        named.join(", "),
        resume_hint()
    );
}

/// Sets the silence after which a peer is lost (zero: never).
pub fn set_timeout(timeout: Duration) {
    if let Some(hb) = HEARTBEAT.get() {
        let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        hb.timeout_ms.store(ms, Ordering::SeqCst);
    }
}

/// How often each end writes a line: a tenth of the timeout, between 0.1 and 1 s.
fn interval(timeout_ms: u64) -> Duration {
    Duration::from_millis((timeout_ms / 10).clamp(100, 1000))
}

/// This process ends normally: tells the peers, and stops reporting.
pub fn bye() {
    say_to_all("bye");
}

/// This process aborts the job (its message says why): tells the peers, so that
/// they do not report it as lost, and stops reporting.
pub fn aborting() {
    say_to_all("abort");
}

fn say_to_all(word: &str) {
    let Some(hb) = HEARTBEAT.get() else {
        return;
    };
    hb.ending.store(true, Ordering::SeqCst);
    for link in hb.links.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = (&*link).write_all(format!("{word}\n").as_bytes());
    }
}

/// Held while a checkpoint is written and recorded ([`saving`]); taken for good when
/// this process reports a lost peer, so that no checkpoint starts after the report.
static SAVES: Mutex<()> = Mutex::new(());

/// The checkpoint being written (its path and iteration) while [`SAVES`] is held.
static WRITING: Mutex<Option<(String, u64)>> = Mutex::new(None);

/// A checkpoint of iteration `iter` is being written to `path` until this is dropped
/// (after [`checkpoint_written`] has recorded it).
pub struct Saving {
    _held: MutexGuard<'static, ()>,
}

impl Drop for Saving {
    fn drop(&mut self) {
        *WRITING.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// A checkpoint of iteration `iter` is about to be written to `path`: a lost peer
/// reported meanwhile is reported with it. Once this process has
/// reported a lost peer (the job is ending), it never returns.
pub fn saving(path: &std::path::Path, iter: u64) -> Saving {
    let held = SAVES.lock().unwrap_or_else(|e| e.into_inner());
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    *WRITING.lock().unwrap_or_else(|e| e.into_inner()) = Some((path.display().to_string(), iter));
    Saving { _held: held }
}

/// Keeps any checkpoint from starting after a lost peer's report; returns the one
/// being written at that moment, if any (the report cannot wait for it: a launcher
/// may end the job within milliseconds of a rank's death).
fn stop_saves() -> Option<(String, u64)> {
    match SAVES.try_lock() {
        Ok(held) => std::mem::forget(held),
        Err(TryLockError::Poisoned(p)) => std::mem::forget(p.into_inner()),
        Err(TryLockError::WouldBlock) => {}
    }
    WRITING.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Rank 0 has written the checkpoint at `path`, from which iteration `iter`
/// resumes (or resumed from it): remembered, and passed on to every rank.
pub fn checkpoint_written(path: &std::path::Path, iter: u64) {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let path = path.display().to_string();
    *LAST_CHECKPOINT.lock().unwrap_or_else(|e| e.into_inner()) = Some((path.clone(), iter));
    let Some(hb) = HEARTBEAT.get().filter(|hb| hb.rank == 0) else {
        return;
    };
    for link in hb.links.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        let _ = (&*link).write_all(format!("ckpt {iter} {path}\n").as_bytes());
    }
}

/// Where the job can resume from, for a message.
pub fn resume_hint() -> String {
    match &*LAST_CHECKPOINT.lock().unwrap_or_else(|e| e.into_inner()) {
        Some((path, iter)) => format!(
            "resume from {path} (iteration {iter}) with init_from=resume, on any number of \
             ranks"
        ),
        None => "no checkpoint has been written by this run yet".into(),
    }
}

/// Rank 0: accepts the other ranks' connections, each checked by the token, and
/// beats with each on a thread of its own.
fn accept(hb: Arc<Shared>, host: Host) {
    for stream in host.listener.incoming() {
        let Ok(stream) = stream else { continue };
        let hb = Arc::clone(&hb);
        let token = host.invitation.token;
        let _ = std::thread::Builder::new()
            .name("heartbeat".into())
            .spawn(move || {
                let mut lines = Lines::new(stream);
                let hello = lines.wait_line(Duration::from_secs(5));
                let peer = hello.as_deref().and_then(|h| parse_hello(h, token));
                let Some(peer) = peer.filter(|&p| p > 0 && p < hb.hosts.len()) else {
                    return; // not this job's
                };
                if lines.send(&format!("welcome {token:016x}")).is_err() {
                    return;
                }
                let last = LAST_CHECKPOINT
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                if let Some((path, iter)) = last {
                    let _ = lines.send(&format!("ckpt {iter} {path}"));
                }
                beat(&hb, peer, lines);
            });
    }
}

/// `hello TOKEN RANK` with this job's token: the rank.
fn parse_hello(line: &str, token: u64) -> Option<usize> {
    let mut w = line.split_whitespace();
    (w.next()? == "hello").then_some(())?;
    (u64::from_str_radix(w.next()?, 16).ok()? == token).then_some(())?;
    w.next()?.parse().ok()
}

/// A rank other than 0: connects to rank 0 (trying its addresses, the ones it
/// shares a host or a name with first), then beats. Gives up with a warning when
/// rank 0 cannot be reached: the collective watchdog is then the only guard.
fn connect_to_root(hb: Arc<Shared>, inv: Invitation) {
    let candidates = candidates(&inv, &hb.hosts[0], &hb.hosts[hb.rank]);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut why = String::from("no address to try");
    while Instant::now() < deadline && !hb.ending.load(Ordering::SeqCst) {
        for addr in &candidates {
            match greet(addr, hb.rank, inv.token) {
                Ok(lines) => return beat(&hb, 0, lines),
                Err(e) => why = format!("{addr}: {e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    if !hb.ending.load(Ordering::SeqCst) {
        crate::errln!(
            "warning: rank {} (host {}): cannot open the heartbeat connection to rank 0 (host \
             {}) on port {} ({why}): a lost rank will be noticed only after \
             collective_timeout_s",
            hb.rank,
            hb.hosts[hb.rank],
            hb.hosts[0],
            inv.port
        );
    }
}

/// The addresses at which to try rank 0, most likely first: loopback when it runs
/// on this host, then what its host name resolves to, then every address it has.
fn candidates(inv: &Invitation, root_host: &str, my_host: &str) -> Vec<SocketAddr> {
    let mut ips: Vec<IpAddr> = Vec::new();
    if root_host == my_host {
        ips.push(IpAddr::from([127, 0, 0, 1]));
    }
    if let Ok(resolved) = (root_host, inv.port).to_socket_addrs() {
        ips.extend(resolved.map(|a| a.ip()).filter(|ip| inv.addrs.contains(ip)));
    }
    ips.extend(inv.addrs.iter().copied());
    let mut seen = Vec::new();
    for ip in ips {
        if !seen.contains(&ip) {
            seen.push(ip);
        }
    }
    seen.into_iter()
        .map(|ip| SocketAddr::new(ip, inv.port))
        .collect()
}

/// Connects to `addr` and checks that rank 0 of this job answers there.
fn greet(addr: &SocketAddr, rank: usize, token: u64) -> std::io::Result<Lines> {
    let stream = TcpStream::connect_timeout(addr, Duration::from_secs(2))?;
    let mut lines = Lines::new(stream);
    lines.send(&format!("hello {token:016x} {rank}"))?;
    match lines.wait_line(Duration::from_secs(3)) {
        Some(w) if w == format!("welcome {token:016x}") => Ok(lines),
        _ => Err(std::io::Error::other("another program answered")),
    }
}

/// Why a peer is lost.
#[derive(Debug, PartialEq)]
enum Loss {
    /// Its connection closed without `bye`.
    Gone,
    /// No line for this long.
    Silent(Duration),
}

/// Beats with `peer` over `lines` until either end says `bye` or `abort`, or the
/// peer is lost (then ends the job).
fn beat(hb: &Shared, peer: usize, mut lines: Lines) {
    if let Ok(clone) = lines.stream.try_clone() {
        hb.links
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(clone);
    }
    let mut heard = Instant::now();
    hb.heard(peer, Some(heard));
    let end = |hb: &Shared| hb.heard(peer, None);
    let mut sent = Instant::now() - Duration::from_secs(10);
    let mut looked = Instant::now();
    loop {
        let timeout_ms = hb.timeout_ms.load(Ordering::SeqCst);
        let every = interval(timeout_ms.max(1));
        if sent.elapsed() >= every && !hb.ending.load(Ordering::SeqCst) {
            // A failed write is noticed by the read below (closed) or by the silence.
            let _ = lines.send("hb");
            sent = Instant::now();
        }
        let line = lines.next(every / 4);
        // This thread itself did not run for seconds (the process was stopped, or
        // the host swapped): the silence is ours, not the peer's.
        if looked.elapsed() > every * 3 + Duration::from_secs(2) {
            heard = Instant::now();
            hb.heard(peer, Some(heard));
        }
        looked = Instant::now();
        match line {
            Ok(Some(l)) => {
                heard = Instant::now();
                hb.heard(peer, Some(heard));
                match l.split_whitespace().next() {
                    Some("bye") | Some("abort") => return end(hb),
                    Some("ckpt") => remember_checkpoint(&l),
                    _ => {}
                }
            }
            Ok(None) => {}
            Err(()) => {
                end(hb);
                return lost(hb, peer, Loss::Gone);
            }
        }
        if timeout_ms > 0 && heard.elapsed() > Duration::from_millis(timeout_ms) {
            return lost(hb, peer, Loss::Silent(heard.elapsed()));
        }
        if hb.ending.load(Ordering::SeqCst) {
            return end(hb);
        }
    }
}

/// `ckpt ITER PATH` from rank 0.
fn remember_checkpoint(line: &str) {
    let mut w = line.splitn(3, ' ');
    let (_, iter, path) = (w.next(), w.next(), w.next());
    if let (Some(Ok(iter)), Some(path)) = (iter.map(str::parse::<u64>), path) {
        *LAST_CHECKPOINT.lock().unwrap_or_else(|e| e.into_inner()) = Some((path.into(), iter));
    }
}

/// Reports `peer` as lost, once, unless this process is ending anyway.
fn lost(hb: &Shared, peer: usize, loss: Loss) {
    if hb.ending.load(Ordering::SeqCst) || hb.fired.swap(true, Ordering::SeqCst) {
        return;
    }
    // This process's own heartbeat (not a test's): no checkpoint after the report.
    let writing = HEARTBEAT
        .get()
        .is_some_and(|own| std::ptr::eq(&**own, hb))
        .then(stop_saves)
        .flatten();
    let timeout_s = hb.timeout_ms.load(Ordering::SeqCst) as f64 / 1e3;
    let mut msg = loss_message(hb, peer, &loss, timeout_s);
    if let Some((path, iter)) = writing {
        msg.push_str(&format!(
            "; the checkpoint of iteration {iter} was being written to {path}: if that \
             completed, the run resumes from iteration {iter}"
        ));
    }
    (hb.on_lost)(msg);
}

fn loss_message(hb: &Shared, peer: usize, loss: &Loss, timeout_s: f64) -> String {
    let host = |r: usize| hb.hosts.get(r).map_or("?", |h| h.as_str());
    let who = format!(
        "rank {} of {} (host {})",
        hb.rank,
        hb.hosts.len(),
        host(hb.rank)
    );
    let what = match loss {
        Loss::Gone => format!(
            "rank {peer} (host {}) is gone: its heartbeat connection closed without a goodbye \
             (the process was killed, crashed or ran out of memory, or its host restarted)",
            host(peer)
        ),
        Loss::Silent(d) => format!(
            "no heartbeat from rank {peer} (host {}) for {:.0} s (heartbeat_timeout_s = \
             {timeout_s:.0}): the process is stopped or hung, or its host is down or cut off \
             the network",
            host(peer),
            d.as_secs_f64()
        ),
    };
    format!(
        "{who}: {what}; the job cannot go on and is ended; {}",
        resume_hint()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// Two ends over loopback, as rank 0 and rank 1: lines pass; a closed end is
    /// seen as gone, a silent one after the timeout, and `bye` ends quietly.
    fn pair(timeout_ms: u64) -> (Arc<Shared>, Lines, mpsc::Receiver<String>) {
        let (tx, rx) = mpsc::channel();
        let tx = Mutex::new(tx);
        let on_lost = Box::new(move |msg| {
            let _ = tx.lock().unwrap().send(msg);
        });
        let hb = Arc::new(Shared::new(0, vec!["h1".into(), "h2".into()], on_lost));
        hb.timeout_ms.store(timeout_ms, Ordering::SeqCst);
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let peer = Lines::new(TcpStream::connect(addr).unwrap());
        let (mine, _) = listener.accept().unwrap();
        let beating = Arc::clone(&hb);
        std::thread::spawn(move || beat(&beating, 1, Lines::new(mine)));
        (hb, peer, rx)
    }

    #[test]
    fn a_closed_connection_is_a_gone_rank_and_silence_a_silent_one() {
        *LAST_CHECKPOINT.lock().unwrap() = None;
        // Gone: the peer's end closes without a word.
        let (_hb, mut peer, rx) = pair(60_000);
        assert_eq!(
            peer.wait_line(Duration::from_secs(5)).as_deref(),
            Some("hb")
        );
        drop(peer);
        let msg = rx.recv_timeout(Duration::from_secs(5)).expect("reported");
        assert!(
            msg.starts_with("rank 0 of 2 (host h1): rank 1 (host h2) is gone"),
            "{msg}"
        );
        // Silent: the peer's end stays open but says nothing.
        let (_hb, _peer, rx) = pair(400);
        let start = Instant::now();
        let msg = rx.recv_timeout(Duration::from_secs(5)).expect("reported");
        assert!(start.elapsed() >= Duration::from_millis(400));
        assert!(
            msg.contains("no heartbeat from rank 1 (host h2) for 0 s"),
            "{msg}"
        );
        // A peer that keeps beating is never lost; one that says bye ends quietly.
        let (_hb, mut peer, rx) = pair(400);
        for _ in 0..12 {
            peer.send("hb").unwrap();
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(rx.try_recv().is_err(), "a beating peer is alive");
        peer.send("bye").unwrap();
        drop(peer);
        std::thread::sleep(Duration::from_millis(300));
        assert!(rx.try_recv().is_err(), "bye is not a loss");
    }

    #[test]
    fn a_loss_names_the_checkpoint_to_resume_from() {
        let hosts = vec!["h1".into(), "h2".into(), "h3".into()];
        let hb = Shared::new(1, hosts, Box::new(|_| {}));
        remember_checkpoint("ckpt 40 /runs/out dir/ckpt.safetensors");
        let msg = loss_message(&hb, 0, &Loss::Silent(Duration::from_secs(11)), 10.0);
        assert!(
            msg.starts_with("rank 1 of 3 (host h2): no heartbeat from rank 0 (host h1) for 11 s"),
            "{msg}"
        );
        assert!(
            msg.ends_with(
                "resume from /runs/out dir/ckpt.safetensors (iteration 40) with \
                 init_from=resume, on any number of ranks"
            ),
            "{msg}"
        );
    }
}
