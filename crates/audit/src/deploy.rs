//! Deployments of kvwarden that the incident replay launches and tests over HTTP. One trait,
//! so a disaggregated deployment (router + prefill + decode) plugs in next to the
//! monolithic one without touching the scenario.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a node may take to load its model and allocate its pool.
const STARTUP: Duration = Duration::from_secs(180);

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot run {exe}: {source}")]
    Spawn {
        exe: PathBuf,
        source: std::io::Error,
    },
    /// The node exited before listening: a refusal to start, with what it said.
    #[error("kvwarden refused to start (exit status {code:?}): {stderr}")]
    Refused { code: Option<i32>, stderr: String },
    #[error("kvwarden did not start listening within {secs} s: {stderr}")]
    Timeout { secs: u64, stderr: String },
}

/// A running deployment under test.
pub trait Deployment: Send {
    /// The OpenAI-compatible endpoint clients talk to (the router, when there is one).
    fn url(&self) -> &str;
    /// Every node's `/metrics` URL; counters are summed across them.
    fn metrics_urls(&self) -> Vec<String>;
    /// One line for the report, e.g. "monolithic kvwarden at http://127.0.0.1:41234".
    fn describe(&self) -> String;
    /// Stops every process of the deployment.
    fn stop(&mut self);
}

/// A way to launch kvwarden: monolithic today; router + prefill + decode later.
pub trait Topology {
    fn name(&self) -> &'static str;
    /// Starts a deployment serving `model` with these `kvwarden serve` flags (pool size,
    /// advertised context, body limit...). A node that refuses its configuration is
    /// [`LaunchError::Refused`], with its message.
    fn launch(&self, model: &Path, flags: &[String]) -> Result<Box<dyn Deployment>, LaunchError>;
}

/// One `kvwarden serve` process.
pub struct Monolithic {
    pub exe: PathBuf,
}

impl Topology for Monolithic {
    fn name(&self) -> &'static str {
        "monolithic"
    }

    fn launch(&self, model: &Path, flags: &[String]) -> Result<Box<dyn Deployment>, LaunchError> {
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--model".into(),
            model.to_string_lossy().into_owned(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            "0".into(),
        ];
        args.extend(flags.iter().cloned());
        let node = Node::start(&self.exe, &args, listening_url)?;
        Ok(Box::new(MonolithicDeployment { node }))
    }
}

/// `kvwarden router` in front of one prefill and one decode node, over mutual TLS with a
/// throwaway cluster CA: the deployment the incident happened in.
pub struct Disaggregated {
    pub exe: PathBuf,
    /// Where the cluster's certificates are written.
    pub workdir: PathBuf,
}

/// Flags the router takes; every other flag configures both nodes. `--max-context` goes to
/// both: each node refuses a context its own pool cannot hold, and so does the router.
const ROUTER_FLAGS: [&str; 2] = ["--max-body-bytes", "--max-context"];

impl Topology for Disaggregated {
    fn name(&self) -> &'static str {
        "disaggregated (router + prefill node + decode node)"
    }

    fn launch(&self, model: &Path, flags: &[String]) -> Result<Box<dyn Deployment>, LaunchError> {
        let certs = self.workdir.join("certs");
        if !certs.join("ca.pem").is_file() {
            let out = Command::new(&self.exe)
                .args(["certs", "--out"])
                .arg(&certs)
                .args(["--name", "router", "--name", "prefill", "--name", "decode"])
                .output()
                .map_err(|source| LaunchError::Spawn {
                    exe: self.exe.clone(),
                    source,
                })?;
            if !out.status.success() {
                return Err(LaunchError::Refused {
                    code: out.status.code(),
                    stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
                });
            }
        }
        let tls = |name: &str| -> Vec<String> {
            let path = |ext: &str| {
                certs
                    .join(format!("{name}.{ext}"))
                    .to_string_lossy()
                    .into_owned()
            };
            vec![
                "--tls-ca".into(),
                certs.join("ca.pem").to_string_lossy().into_owned(),
                "--tls-cert".into(),
                path("pem"),
                "--tls-key".into(),
                path("key"),
            ]
        };
        let mut router_flags = Vec::new();
        let mut pairs = flags.iter();
        while let Some(flag) = pairs.next() {
            if ROUTER_FLAGS.contains(&flag.as_str()) {
                router_flags.push(flag.clone());
                router_flags.extend(pairs.next().cloned());
            }
        }
        let model = model.to_string_lossy().into_owned();
        let mut nodes = Vec::new();
        let mut addresses = Vec::new();
        for role in ["prefill", "decode"] {
            let mut args: Vec<String> = vec![
                "--threads".into(),
                "1".into(),
                "serve".into(),
                "--role".into(),
                role.into(),
                "--model".into(),
                model.clone(),
                "--port".into(),
                "0".into(),
                "--metrics-port".into(),
                "0".into(),
            ];
            args.extend(tls(role));
            args.extend(flags.iter().cloned());
            let node = Node::start(&self.exe, &args, |log| {
                after(log, "internal API on ").filter(|_| log.contains("node metrics on http://"))
            })?;
            addresses.push(node.url.clone());
            nodes.push(node);
        }
        let metrics = nodes
            .iter()
            .filter_map(|n| after(&n.stderr(), "node metrics on "))
            .map(|url| format!("{url}/metrics"))
            .collect();
        let mut args: Vec<String> = vec![
            "router".into(),
            "--model".into(),
            model,
            "--port".into(),
            "0".into(),
            "--prefill".into(),
            addresses[0].clone(),
            "--decode".into(),
            addresses[1].clone(),
        ];
        args.extend(tls("router"));
        args.extend(router_flags);
        let router = Node::start(&self.exe, &args, listening_url)?;
        Ok(Box::new(ClusterDeployment {
            router,
            nodes,
            metrics,
        }))
    }
}

struct ClusterDeployment {
    router: Node,
    nodes: Vec<Node>,
    metrics: Vec<String>,
}

impl Deployment for ClusterDeployment {
    fn url(&self) -> &str {
        &self.router.url
    }

    /// The nodes': the engine counters live there.
    fn metrics_urls(&self) -> Vec<String> {
        self.metrics.clone()
    }

    fn describe(&self) -> String {
        format!(
            "kvwarden router at {} over a prefill node at {} and a decode node at {}",
            self.router.url, self.nodes[0].url, self.nodes[1].url
        )
    }

    fn stop(&mut self) {
        self.router.stop();
        for n in &mut self.nodes {
            n.stop();
        }
    }
}

struct MonolithicDeployment {
    node: Node,
}

impl Deployment for MonolithicDeployment {
    fn url(&self) -> &str {
        &self.node.url
    }

    fn metrics_urls(&self) -> Vec<String> {
        vec![format!("{}/metrics", self.node.url)]
    }

    fn describe(&self) -> String {
        format!("monolithic kvwarden at {}", self.node.url)
    }

    fn stop(&mut self) {
        self.node.stop();
    }
}

/// A kvwarden process, its stderr collected, stopped on drop.
pub struct Node {
    child: Child,
    pub url: String,
    stderr: Arc<Mutex<String>>,
}

impl Node {
    /// Runs `exe args...` and waits until `ready` finds its address in what it printed.
    pub fn start(
        exe: &Path,
        args: &[String],
        ready: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, LaunchError> {
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| LaunchError::Spawn {
                exe: exe.to_owned(),
                source,
            })?;
        let stderr = Arc::new(Mutex::new(String::new()));
        let reader = child.stderr.take().map(|pipe| {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
                    s.push_str(&line);
                    s.push('\n');
                }
            })
        });
        let text = |s: &Arc<Mutex<String>>| s.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let deadline = Instant::now() + STARTUP;
        loop {
            if let Some(url) = ready(&text(&stderr)) {
                return Ok(Self { child, url, stderr });
            }
            if let Ok(Some(status)) = child.try_wait() {
                // The process is gone: read the rest of what it said before answering.
                if let Some(r) = reader {
                    let _ = r.join();
                }
                return Err(LaunchError::Refused {
                    code: status.code(),
                    stderr: text(&stderr).trim().to_owned(),
                });
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(LaunchError::Timeout {
                    secs: STARTUP.as_secs(),
                    stderr: text(&stderr),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop();
    }
}

fn listening_url(stderr: &str) -> Option<String> {
    after(stderr, "listening on ").filter(|url| url.starts_with("http://"))
}

/// The word that follows the first `marker` in `text`.
fn after(text: &str, marker: &str) -> Option<String> {
    let at = text.find(marker)? + marker.len();
    let word: String = text[at..]
        .chars()
        .take_while(|c| !c.is_whitespace())
        .collect();
    (!word.is_empty()).then_some(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_address_comes_from_the_listening_line() {
        let log =
            "loading\nkvwarden: listening on http://127.0.0.1:4242 (model \"m\", max context 8)\n";
        assert_eq!(listening_url(log).as_deref(), Some("http://127.0.0.1:4242"));
        assert_eq!(listening_url("starting"), None);
    }

    #[test]
    fn a_process_that_exits_early_is_a_refusal_with_its_message() {
        let r = Node::start(
            Path::new("sh"),
            &[
                "-c".into(),
                "echo 'error: pool too small: 42 < 43' >&2; exit 3".into(),
            ],
            listening_url,
        );
        match r {
            Err(LaunchError::Refused { code, stderr }) => {
                assert_eq!(code, Some(3));
                assert!(stderr.contains("42 < 43"), "{stderr}");
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a process that exits must not count as started"),
        }
    }
}
