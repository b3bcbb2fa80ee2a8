//! Small text messages over TCP between nanogpt processes (the start-up check-in,
//! the heartbeat): one line each, every wait under a time limit.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::{Duration, Instant};

/// Where a server of this job listens (its addresses and port), and the token that
/// proves a connection belongs to this job: what rank 0 tells every rank for the
/// heartbeat, and what `nanogpt launch` tells them for the start-up check-in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Invitation {
    pub addrs: Vec<IpAddr>,
    pub port: u16,
    pub token: u64,
}

impl Invitation {
    /// `port token addr,addr,...`.
    pub fn encode(&self) -> String {
        let addrs: Vec<String> = self.addrs.iter().map(|a| a.to_string()).collect();
        format!("{} {:016x} {}", self.port, self.token, addrs.join(","))
    }

    pub fn decode(text: &str) -> Option<Invitation> {
        let mut words = text.split_whitespace();
        let port = words.next()?.parse().ok()?;
        let token = u64::from_str_radix(words.next()?, 16).ok()?;
        let addrs = words
            .next()
            .unwrap_or("")
            .split(',')
            .filter_map(|a| a.parse().ok())
            .collect();
        Some(Invitation { addrs, port, token })
    }
}

/// A token no other job will guess by chance: the clock and the process id, mixed.
pub fn random_token() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = nanos ^ ((std::process::id() as u64) << 32) ^ 0x9e37_79b9_7f4a_7c15;
    // splitmix64's finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Lines over a TCP stream, with a time limit on each wait.
pub struct Lines {
    pub stream: TcpStream,
    pending: Vec<u8>,
}

impl Lines {
    pub fn new(stream: TcpStream) -> Lines {
        let _ = stream.set_nodelay(true);
        let _ = stream.set_write_timeout(Some(Duration::from_secs(2)));
        Lines {
            stream,
            pending: Vec::new(),
        }
    }

    pub fn send(&mut self, line: &str) -> std::io::Result<()> {
        self.stream.write_all(format!("{line}\n").as_bytes())
    }

    /// The next whole line, `Ok(None)` if none came within `wait`, `Err` when the
    /// connection closed or failed.
    pub fn next(&mut self, wait: Duration) -> Result<Option<String>, ()> {
        if let Some(line) = self.take_line() {
            return Ok(Some(line));
        }
        let _ = self
            .stream
            .set_read_timeout(Some(wait.max(Duration::from_millis(1))));
        let mut buf = [0u8; 512];
        match self.stream.read(&mut buf) {
            Ok(0) => Err(()),
            Ok(n) => {
                self.pending.extend_from_slice(&buf[..n]);
                Ok(self.take_line())
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(None),
            Err(_) => Err(()),
        }
    }

    /// The first line that comes within `wait`.
    pub fn wait_line(&mut self, wait: Duration) -> Option<String> {
        let start = Instant::now();
        while start.elapsed() < wait {
            match self.next(Duration::from_millis(100)) {
                Ok(Some(line)) => return Some(line),
                Ok(None) => {}
                Err(()) => return None,
            }
        }
        None
    }

    fn take_line(&mut self) -> Option<String> {
        let end = self.pending.iter().position(|&b| b == b'\n')?;
        let line: Vec<u8> = self.pending.drain(..=end).collect();
        Some(String::from_utf8_lossy(&line[..end]).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invitations_round_trip_and_lines_arrive_whole() {
        let inv = Invitation {
            addrs: vec!["10.0.0.1".parse().unwrap(), "172.17.0.1".parse().unwrap()],
            port: 40123,
            token: 0xdead_beef_0123_4567,
        };
        assert_eq!(Invitation::decode(&inv.encode()), Some(inv));
        assert_eq!(Invitation::decode("x"), None);
        assert_ne!(random_token(), random_token());

        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let mut a = Lines::new(TcpStream::connect(listener.local_addr().unwrap()).unwrap());
        let mut b = Lines::new(listener.accept().unwrap().0);
        assert_eq!(b.next(Duration::from_millis(50)), Ok(None), "nothing yet");
        // Half a line is held until its end comes.
        a.stream.write_all(b"one\ntw").unwrap();
        assert_eq!(b.wait_line(Duration::from_secs(5)).as_deref(), Some("one"));
        assert_eq!(b.next(Duration::from_millis(50)), Ok(None));
        a.send("o").unwrap();
        assert_eq!(b.wait_line(Duration::from_secs(5)).as_deref(), Some("two"));
        drop(a);
        assert_eq!(b.next(Duration::from_secs(5)), Err(()), "closed");
    }
}
