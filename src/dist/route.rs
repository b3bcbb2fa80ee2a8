//! Which network interface a rank uses to reach the others, as `nanogpt doctor`
//! reports it: the kernel's route to each other rank's host (a UDP socket
//! "connected" to the peer's address sends nothing but gets the source address the
//! route would use), mapped to its interface; and the interface settings the MPI
//! launcher passed to the rank (Open MPI's `--mca btl_tcp_if_include`, UCX's and
//! libfabric's device variables), since MPI itself does not say what it picked.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};

/// The interfaces (with this host's address on each) whose routes reach the hosts
/// in `hosts` other than `me`, e.g. `eth0 10.0.0.1`; several joined by `, `;
/// `local` when there is no other host; `?` with the reason for a host that
/// cannot be resolved or routed to.
pub fn interface_to(hosts: &[String], me: &str) -> String {
    let mut seen: Vec<String> = Vec::new();
    for peer in hosts.iter().filter(|h| h.as_str() != me) {
        let found = match source_address(peer) {
            Ok(ip) => match interface_of(ip) {
                Some(name) => format!("{name} {ip}"),
                None => format!("? {ip}"),
            },
            Err(why) => format!("? ({peer}: {why})"),
        };
        if !seen.contains(&found) {
            seen.push(found);
        }
    }
    match seen.is_empty() {
        true => "local".into(),
        false => seen.join(", "),
    }
}

/// This host's address on the route to `host`.
fn source_address(host: &str) -> Result<IpAddr, String> {
    let peer: SocketAddr = (host, 9)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve: {e}"))?
        .next()
        .ok_or("resolves to no address")?;
    let any: SocketAddr = match peer {
        SocketAddr::V4(_) => ([0, 0, 0, 0], 0).into(),
        SocketAddr::V6(_) => ([0u16; 8], 0).into(),
    };
    let socket = UdpSocket::bind(any).map_err(|e| e.to_string())?;
    // UDP connect only picks the route and the source address: nothing is sent.
    socket.connect(peer).map_err(|e| format!("no route: {e}"))?;
    Ok(socket.local_addr().map_err(|e| e.to_string())?.ip())
}

/// The name of the interface holding `ip`, if any.
fn interface_of(ip: IpAddr) -> Option<String> {
    interfaces()
        .into_iter()
        .find(|(_, addr)| *addr == ip)
        .map(|(name, _)| name)
}

/// Every (interface, address) pair of this host (`getifaddrs`).
pub fn interfaces() -> Vec<(String, IpAddr)> {
    addresses().into_iter().map(|a| (a.name, a.ip)).collect()
}

/// One address of one of this host's interfaces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    pub name: String,
    pub ip: IpAddr,
    /// Up and with a carrier (`IFF_UP` and `IFF_RUNNING`): usable.
    pub running: bool,
}

/// The networks MPI may choose between on this host: the running interfaces'
/// IPv4 addresses, loopback left out (`eth0 10.0.0.1`, `docker0 172.17.0.1`).
pub fn candidates() -> Vec<Address> {
    addresses()
        .into_iter()
        .filter(|a| a.running && a.ip.is_ipv4() && !a.ip.is_loopback())
        .collect()
}

/// `eth0 10.0.0.1, docker0 172.17.0.1`.
pub fn describe(addrs: &[Address]) -> String {
    addrs
        .iter()
        .map(|a| format!("{} {}", a.name, a.ip))
        .collect::<Vec<_>>()
        .join(", ")
}

fn addresses() -> Vec<Address> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head to `list` on success (return 0); the list
    // is only read below and freed once with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut at = list;
    while !at.is_null() {
        // SAFETY: `at` is a node of the list getifaddrs returned, not yet freed; its
        // name is a NUL-terminated string and its address, when not null, a sockaddr
        // whose family says which sockaddr_in/sockaddr_in6 it is.
        unsafe {
            let node = &*at;
            if !node.ifa_addr.is_null() {
                let name = std::ffi::CStr::from_ptr(node.ifa_name)
                    .to_string_lossy()
                    .into_owned();
                let flags = node.ifa_flags as libc::c_int;
                let running = flags & libc::IFF_UP != 0 && flags & libc::IFF_RUNNING != 0;
                let ip = match (*node.ifa_addr).sa_family as i32 {
                    libc::AF_INET => {
                        let a = &*(node.ifa_addr as *const libc::sockaddr_in);
                        Some(IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(
                            a.sin_addr.s_addr,
                        ))))
                    }
                    libc::AF_INET6 => {
                        let a = &*(node.ifa_addr as *const libc::sockaddr_in6);
                        Some(IpAddr::V6(std::net::Ipv6Addr::from(a.sin6_addr.s6_addr)))
                    }
                    _ => None,
                };
                if let Some(ip) = ip {
                    out.push(Address { name, ip, running });
                }
            }
            at = node.ifa_next;
        }
    }
    // SAFETY: `list` came from a successful getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// Variables through which a launcher tells MPI which network to use: Open MPI
/// passes `--mca KEY VALUE` to the ranks as `OMPI_MCA_KEY`; UCX (MPICH's transport
/// in Debian, Open MPI's `pml ucx`) and libfabric (Intel MPI) read their own.
const INTERFACE_VARIABLES: [&str; 7] = [
    "OMPI_MCA_btl_tcp_if_include",
    "OMPI_MCA_btl_tcp_if_exclude",
    "OMPI_MCA_oob_tcp_if_include",
    "UCX_NET_DEVICES",
    "FI_TCP_IFACE",
    "FI_PROVIDER",
    "MPIR_CVAR_CH4_OFI_IFNAME",
];

/// The interface settings in this process's environment, as `name=value` (the
/// `OMPI_MCA_` prefix left out).
pub fn mpi_interface_settings() -> Vec<String> {
    settings_of(|name| std::env::var(name).ok())
}

fn settings_of(get: impl Fn(&str) -> Option<String>) -> Vec<String> {
    INTERFACE_VARIABLES
        .iter()
        .filter_map(|name| {
            let value = get(name)?;
            let short = name.strip_prefix("OMPI_MCA_").unwrap_or(name);
            Some(format!("{short}={value}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_route_is_found_and_named() {
        let lo = std::net::Ipv4Addr::LOCALHOST;
        assert_eq!(source_address("127.0.0.1"), Ok(IpAddr::V4(lo)));
        assert_eq!(interface_of(IpAddr::V4(lo)).as_deref(), Some("lo"));
        assert_eq!(
            interface_to(&["127.0.0.1".into(), "me".into()], "me"),
            "lo 127.0.0.1"
        );
        assert_eq!(interface_to(&["me".into(), "me".into()], "me"), "local");
        let bad = interface_to(&["no-such-host.invalid".into()], "me");
        assert!(
            bad.starts_with("? (no-such-host.invalid: cannot resolve"),
            "{bad}"
        );
    }

    #[test]
    fn launcher_settings_are_named_without_the_mca_prefix() {
        let env = |name: &str| match name {
            "OMPI_MCA_btl_tcp_if_include" => Some("10.0.0.0/24".to_string()),
            "UCX_NET_DEVICES" => Some("eth1".to_string()),
            _ => None,
        };
        assert_eq!(
            settings_of(env),
            ["btl_tcp_if_include=10.0.0.0/24", "UCX_NET_DEVICES=eth1"]
        );
        assert!(settings_of(|_| None).is_empty());
    }
}
