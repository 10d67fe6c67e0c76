//! Where a pool's nodes are: fixed addresses, or every address behind a DNS name (a
//! Kubernetes headless Service's A/AAAA records), looked up again periodically so that a
//! pool grows and shrinks without a router restart.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::TokioResolver;

/// How the router looks names up.
#[derive(Debug, Clone)]
pub struct Discovery {
    /// The DNS server to ask (UDP, then TCP for long answers); `None`: the system's
    /// (`/etc/resolv.conf`).
    pub nameserver: Option<SocketAddr>,
    /// How often every name is looked up again.
    pub interval: Duration,
}

impl Default for Discovery {
    fn default() -> Self {
        Self {
            nameserver: None,
            interval: Duration::from_secs(5),
        }
    }
}

/// One `--prefill` or `--decode` argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeSource {
    /// One node at `host:port`, kept for the router's lifetime (down while unreachable).
    Address(String),
    /// `dns:NAME:PORT`: a node at `PORT` on every address `NAME` resolves to. A node whose
    /// address disappears from the answer is drained: no new request goes to it, and the
    /// requests it holds finish there.
    Dns { name: String, port: u16 },
}

impl NodeSource {
    pub fn parse(arg: &str) -> Result<Self, String> {
        let Some(rest) = arg.strip_prefix("dns:") else {
            return Ok(Self::Address(arg.to_owned()));
        };
        let (name, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("{arg:?}: expected dns:NAME:PORT"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{arg:?}: {port:?} is not a port number"))?;
        let valid = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        let labels = name.strip_suffix('.').unwrap_or(name);
        if name.len() > 253 || !labels.split('.').all(valid) {
            return Err(format!("{arg:?}: {name:?} is not a DNS name"));
        }
        if port == 0 {
            return Err(format!("{arg:?}: port 0"));
        }
        Ok(Self::Dns {
            name: name.to_owned(),
            port,
        })
    }
}

impl std::fmt::Display for NodeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Address(a) => f.write_str(a),
            Self::Dns { name, port } => write!(f, "dns:{name}:{port}"),
        }
    }
}

/// A node's address as the router names it (`ip:port`, `[ipv6]:port`).
pub(crate) fn address(ip: IpAddr, port: u16) -> String {
    SocketAddr::new(ip, port).to_string()
}

pub(crate) struct Resolver(TokioResolver);

impl Resolver {
    pub(crate) fn new(discovery: &Discovery) -> Result<Self, String> {
        let builder = match discovery.nameserver {
            Some(server) => {
                let mut ns = NameServerConfig::udp_and_tcp(server.ip());
                for connection in &mut ns.connections {
                    connection.port = server.port();
                }
                TokioResolver::builder_with_config(
                    ResolverConfig::from_name_servers(vec![ns]),
                    TokioRuntimeProvider::default(),
                )
            }
            None => TokioResolver::builder_tokio()
                .map_err(|e| format!("reading the system's DNS configuration: {e}"))?,
        };
        let mut builder = builder;
        // Every look-up asks the server: a pool's membership is what it says now, not what a
        // cached answer said up to a TTL ago.
        builder.options_mut().cache_size = 0;
        builder.options_mut().timeout = Duration::from_secs(2);
        builder
            .build()
            .map(Self)
            .map_err(|e| format!("building the DNS resolver: {e}"))
    }

    /// The addresses behind `name`: `Ok` with the set (empty when the name has no such
    /// records: the pool has no node now), `Err` when the question went unanswered (the
    /// pool is then left as it was).
    pub(crate) async fn addresses(
        &self,
        name: &str,
        port: u16,
    ) -> Result<BTreeSet<String>, String> {
        match self.0.lookup_ip(name).await {
            Ok(lookup) => Ok(lookup.iter().map(|ip| address(ip, port)).collect()),
            Err(e) if e.is_no_records_found() => Ok(BTreeSet::new()),
            Err(e) => Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_as_addresses_or_dns_names() {
        assert_eq!(
            NodeSource::parse("10.0.0.1:7000").unwrap(),
            NodeSource::Address("10.0.0.1:7000".into())
        );
        assert_eq!(
            NodeSource::parse("dns:decode.kvwarden.svc.cluster.local:7000").unwrap(),
            NodeSource::Dns {
                name: "decode.kvwarden.svc.cluster.local".into(),
                port: 7000
            }
        );
        assert_eq!(
            NodeSource::parse("dns:decode.:1").unwrap().to_string(),
            "dns:decode.:1"
        );
        for bad in [
            "dns:decode",
            "dns:decode:x",
            "dns:decode:70000",
            "dns:decode:0",
            "dns::7000",
            "dns:a..b:7000",
            "dns:a b:7000",
            "dns:10.0.0.1:7000:1",
        ] {
            assert!(NodeSource::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn addresses_name_ipv6_in_brackets() {
        assert_eq!(address("10.1.2.3".parse().unwrap(), 7), "10.1.2.3:7");
        assert_eq!(address("::1".parse().unwrap(), 7), "[::1]:7");
    }
}
