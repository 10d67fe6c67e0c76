//! `kvwarden audit --scenario incident`: the incident, replayed against kvwarden itself on a
//! synthetic model, as a short report a person can follow. Steps that need no compute use
//! the incident's own numbers; the steps that run prompts use a pool scaled down by 128 with
//! the same context-to-pool ratio, so the prefill fits in CI time.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::auditor::Auditor;
use crate::config::Config;
use crate::deploy::{Deployment, LaunchError, Topology};
use crate::error::AuditError;
use crate::report::{CheckName, Verdict};
use crate::text::clip;
use oai_client::Rng;
use oai_client::{Api, Call, Client, Prompt};

/// The incident's numbers (described at the top of README.md).
pub const ADVERTISED: usize = 1_048_576;
pub const POOL: usize = 681_280;
/// The scaled-down steps divide both by this: 8,192 advertised over 5,322 tokens, the
/// incident's ratio (0.6497) to four digits, small enough that prompts at the limit
/// prefill in seconds on two cores.
pub const SCALE: usize = 128;

/// 1234567 -> "1,234,567".
pub fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Sum of the samples of `name` (any labels) across the deployment's metrics pages.
async fn metric(client: &Client, dep: &dyn Deployment, name: &str) -> Option<f64> {
    metric_at(client, &dep.metrics_urls(), name).await
}

async fn metric_at(client: &Client, urls: &[String], name: &str) -> Option<f64> {
    let mut total = None;
    for url in urls {
        // A node's metrics page may live on another origin than the endpoint under test
        // (the nodes behind a router).
        let Some(at) = url.find("/metrics") else {
            continue;
        };
        let (origin, path) = url.split_at(at);
        let other;
        let c = if origin == client.base {
            client
        } else {
            let Ok(c) = Client::new(origin, Duration::from_secs(10)) else {
                continue;
            };
            other = c;
            &other
        };
        let Ok((200, text)) = c.get_text(path, None).await else {
            continue;
        };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let metric_name = key.split('{').next().unwrap_or(key);
            if metric_name == name {
                if let Ok(v) = value.parse::<f64>() {
                    *total.get_or_insert(0.0) += v;
                }
            }
        }
    }
    total
}

struct Replay<'a, W: Write> {
    out: &'a mut W,
    topology: &'a dyn Topology,
    model: PathBuf,
    failures: Vec<String>,
    step: usize,
}

impl<W: Write> Replay<'_, W> {
    fn say(&mut self, text: impl AsRef<str>) {
        // The report goes to stdout; a closed pipe must not abort the replay itself.
        let _ = writeln!(self.out, "{}", text.as_ref());
        let _ = self.out.flush();
    }

    fn step(&mut self, title: &str) {
        self.step += 1;
        self.say(format!("\nStep {}. {title}", self.step));
    }

    fn check(&mut self, ok: bool, what: String) {
        self.say(format!("   {} {what}", if ok { "ok  " } else { "FAIL" }));
        if !ok {
            self.failures.push(what);
        }
    }

    /// A launch that must be refused, naming both numbers.
    fn expect_refusal(&mut self, flags: &[String], context: usize, pool: usize) {
        match self.topology.launch(&self.model, flags) {
            Err(LaunchError::Refused { stderr, .. }) => {
                let line = stderr
                    .lines()
                    .find(|l| l.contains("error"))
                    .unwrap_or(stderr.as_str())
                    .trim()
                    .to_owned();
                self.say(format!("   kvwarden: {line}"));
                let both =
                    stderr.contains(&context.to_string()) && stderr.contains(&pool.to_string());
                self.check(
                    both,
                    format!(
                        "refused to start, naming both {} and {}",
                        thousands(context),
                        thousands(pool)
                    ),
                );
            }
            Err(e) => self.check(false, format!("expected a refusal to start, got: {e}")),
            Ok(mut dep) => {
                let url = dep.url().to_owned();
                dep.stop();
                self.check(
                    false,
                    format!(
                        "started (at {url}) while promising {} tokens over a {}-token pool",
                        thousands(context),
                        thousands(pool)
                    ),
                );
            }
        }
    }
}

/// Flags of a node whose pool holds exactly `pool` tokens: pages of 16 tokens, or of 2 for
/// the scaled pool of 5,322 = 2 x 2,661 tokens.
fn pool_flags(pool: usize) -> Vec<String> {
    let page = if pool.is_multiple_of(16) { 16 } else { 2 };
    vec![
        "--kv-pool-tokens".into(),
        pool.to_string(),
        "--kv-page-tokens".into(),
        page.to_string(),
        // A 681,281-token prompt as JSON ids is about 3 MB.
        "--max-body-bytes".into(),
        (32usize << 20).to_string(),
    ]
}

/// Writes the synthetic model: 2 layers, kv_dim 32, f16 K/V = 256 bytes per token, so the
/// full 681,280-token pool takes 166 MiB; context 1,048,576.
fn synth_model(exe: &Path, dir: &Path) -> Result<PathBuf, AuditError> {
    let path = dir.join("incident-synthetic.gguf");
    let out = Command::new(exe)
        .args([
            "synth-model",
            "--layers",
            "2",
            "--dim",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "512",
            "--context",
            &ADVERTISED.to_string(),
            "--weight-type",
            "f16",
            "-o",
        ])
        .arg(&path)
        .output()
        .map_err(|source| LaunchError::Spawn {
            exe: exe.to_owned(),
            source,
        })?;
    if !out.status.success() {
        return Err(AuditError::Launch(LaunchError::Refused {
            code: out.status.code(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }));
    }
    Ok(path)
}

/// Runs the replay, writing the report to `out`. Ok(true) when every step held.
pub async fn incident(
    topology: &dyn Topology,
    exe: &Path,
    workdir: &Path,
    out: &mut impl Write,
) -> Result<bool, AuditError> {
    let started = Instant::now();
    std::fs::create_dir_all(workdir).map_err(|source| AuditError::Write {
        path: workdir.to_owned(),
        source,
    })?;
    let model = synth_model(exe, workdir)?;
    let mut r = Replay {
        out,
        topology,
        model,
        failures: Vec::new(),
        step: 0,
    };
    r.say(format!(
        "Incident replay: a {} deployment of kvwarden on a synthetic model (2 layers, kv_dim 32, f16 K/V: 256 bytes per token; context {}).",
        topology.name(),
        thousands(ADVERTISED)
    ));
    r.say(format!(
        "The incident: a context of {} tokens advertised over a KV pool of {}; longer prompts were kept alive on a placeholder and answered with HTTP 200 from other customers' stale KV pages.",
        thousands(ADVERTISED),
        thousands(POOL)
    ));

    // 1. The incident's configuration.
    r.step(&format!(
        "Configure a node as in the incident: advertise {} tokens over a {}-token pool.",
        thousands(ADVERTISED),
        thousands(POOL)
    ));
    let mut flags = pool_flags(POOL);
    flags.extend(["--max-context".into(), ADVERTISED.to_string()]);
    r.expect_refusal(&flags, ADVERTISED, POOL);

    // 2 and 3. The same pool with an honest context; the incident's over-length prompt.
    r.step(&format!(
        "Lower the advertised context to the pool: start with a {}-token pool and no --max-context.",
        thousands(POOL)
    ));
    match topology.launch(&r.model, &pool_flags(POOL)) {
        Err(e) => r.check(false, format!("the node did not start: {e}")),
        Ok(mut dep) => {
            let result = over_length_at_full_scale(&mut r, dep.as_ref()).await;
            dep.stop();
            result?;
        }
    }

    // 4 and 5. Scaled down, same ratio: prompts that run.
    let (adv, pool) = (ADVERTISED / SCALE, POOL / SCALE);
    r.step(&format!(
        "Scale down by {SCALE} with the same ratio: advertise {} over a {}-token pool, so prompts at the limit run in seconds.",
        thousands(adv),
        thousands(pool)
    ));
    let mut flags = pool_flags(pool);
    flags.extend(["--max-context".into(), adv.to_string()]);
    r.expect_refusal(&flags, adv, pool);

    r.step(&format!(
        "Serve the {}-token pool with its honest context, and run `kvwarden audit` against it.",
        thousands(pool)
    ));
    match topology.launch(&r.model, &pool_flags(pool)) {
        Err(e) => r.check(false, format!("the node did not start: {e}")),
        Ok(mut dep) => {
            let result = scaled_audit(&mut r, dep.as_ref(), pool).await;
            dep.stop();
            result?;
        }
    }

    let ok = r.failures.is_empty();
    r.say(format!(
        "\nVerdict: {} ({} steps in {:.0} s). {}",
        if ok { "PASS" } else { "FAIL" },
        r.step,
        started.elapsed().as_secs_f64(),
        if ok {
            "The incident's configuration cannot start, an over-length prompt is refused with 400 before any work, and under pool pressure no answer carries another request's canary."
        } else {
            "See the FAIL lines above."
        }
    ));
    Ok(ok)
}

async fn over_length_at_full_scale<W: Write>(
    r: &mut Replay<'_, W>,
    dep: &dyn Deployment,
) -> Result<(), AuditError> {
    let mut client = Client::new(dep.url(), Duration::from_secs(300))?;
    let advertised = client
        .get_json("/v1/models", None)
        .await
        .ok()
        .and_then(|(_, v)| v.pointer("/data/0/max_model_len").and_then(|m| m.as_u64()))
        .map(|m| m as usize);
    client.model = client
        .get_json("/v1/models", None)
        .await
        .ok()
        .and_then(|(_, v)| {
            v.pointer("/data/0/id")
                .and_then(|m| m.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_default();
    r.say(format!(
        "   {} started; /v1/models says max_model_len = {}",
        dep.describe(),
        advertised.map_or("nothing".into(), thousands)
    ));
    r.check(
        advertised == Some(POOL),
        format!(
            "the node advertises exactly its pool, {} tokens",
            thousands(POOL)
        ),
    );

    r.step(&format!(
        "Send the incident's prompt: {} tokens (one over the pool), as token ids.",
        thousands(POOL + 1)
    ));
    let before = (
        metric(&client, dep, "kvwarden_prompt_tokens_total").await,
        metric(&client, dep, "kvwarden_engine_steps_total").await,
    );
    let ids = crate::prompts::token_ids(&mut Rng::new(681_281), POOL + 1);
    let ex = client
        .call(&Call {
            api: Api::Completions,
            prompt: Prompt::Tokens(ids),
            max_tokens: 1,
            temperature: 0.0,
            stream: false,
            logprobs: false,
            ignore_eos: false,
            cancel_after: None,
            key: None,
            extra: Default::default(),
        })
        .await;
    let after = (
        metric(&client, dep, "kvwarden_prompt_tokens_total").await,
        metric(&client, dep, "kvwarden_engine_steps_total").await,
    );
    let code = serde_json::from_str::<serde_json::Value>(&ex.raw)
        .ok()
        .and_then(|v| {
            v.pointer("/error/code")
                .and_then(|c| c.as_str())
                .map(str::to_owned)
        });
    r.say(format!(
        "   HTTP {} in {:.0} ms: {}",
        ex.status.map_or("-".to_owned(), |s| s.to_string()),
        ex.total.as_secs_f64() * 1e3,
        clip(
            ex.error_message
                .as_deref()
                .or(ex.transport_error.as_deref())
                .unwrap_or(&ex.content),
            240
        )
    ));
    r.check(
        ex.status == Some(400) && code.as_deref() == Some("context_length_exceeded"),
        "rejected with HTTP 400 context_length_exceeded, not a 200".into(),
    );
    let fmt = |v: Option<f64>| v.map_or("?".to_owned(), |v| thousands(v as usize));
    r.say(format!(
        "   engine counters before -> after: prompt tokens admitted {} -> {}, engine steps {} -> {}",
        fmt(before.0),
        fmt(after.0),
        fmt(before.1),
        fmt(after.1)
    ));
    r.check(
        before.0.is_some() && before == after,
        "rejected before any work: no prompt token admitted, no engine step, no KV page touched"
            .into(),
    );
    Ok(())
}

async fn scaled_audit<W: Write>(
    r: &mut Replay<'_, W>,
    dep: &dyn Deployment,
    pool: usize,
) -> Result<(), AuditError> {
    let mut config = Config::new(dep.url());
    config.checks = vec![
        CheckName::Capacity,
        CheckName::Canaries,
        CheckName::Differential,
        CheckName::Status,
    ];
    config.progress = false;
    config.batch_invariant = true;
    config.requests = 12;
    config.concurrency = 4;
    config.pressure_pairs = 2;
    config.max_tokens = 16;
    config.seed = 64;
    let mut auditor = Auditor::connect(config).await?;
    r.say(format!(
        "   {} started; advertised context {} tokens",
        dep.describe(),
        thousands(auditor.max_context())
    ));
    r.check(
        auditor.max_context() == pool,
        format!(
            "the node advertises exactly its pool, {} tokens",
            thousands(pool)
        ),
    );
    let client = Client::new(dep.url(), Duration::from_secs(30))?;
    let preempt_before = metric(&client, dep, "kvwarden_preemptions_total").await;
    // Pool pressure shows as requests queued for pages: sample the gauge while the audit
    // runs and keep the peak.
    let peak_waiting = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = {
        let (client, urls, peak) = (client.clone(), dep.metrics_urls(), peak_waiting.clone());
        tokio::spawn(async move {
            loop {
                if let Some(w) = metric_at(&client, &urls, "kvwarden_requests_waiting").await {
                    peak.fetch_max(w as u64, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let report = auditor.run_checks().await;
    sampler.abort();
    let report = report?;
    let preempt_after = metric(&client, dep, "kvwarden_preemptions_total").await;
    r.say("   capacity (token-id prompts, exact lengths):");
    for c in &report.capacity {
        r.say(format!(
            "     {:<44} expected {}  got {}  {}",
            c.case,
            c.expected,
            c.status.map_or("-".to_owned(), |s| format!("HTTP {s}")),
            c.verdict.label()
        ));
    }
    let cap_ok =
        report.capacity.len() == 4 && report.capacity.iter().all(|c| c.verdict == Verdict::Pass);
    r.check(
        cap_ok,
        format!(
            "a prompt at the limit ({} + 1 = {}) succeeds; one over and 1.5x over are refused with 4xx",
            thousands(pool - 1),
            thousands(pool)
        ),
    );
    r.step("The canary check under pool pressure (several tenants, near-limit prompts, over-length prompts, cancelled streams).");
    for c in report
        .checks
        .iter()
        .filter(|c| c.check != CheckName::Capacity)
    {
        r.say(format!(
            "   {:<26} {}  {}",
            c.title,
            c.verdict.label(),
            c.summary
        ));
    }
    let preemptions = match (preempt_before, preempt_after) {
        (Some(a), Some(b)) => Some((b - a) as usize),
        _ => None,
    };
    r.say(format!(
        "   pool pressure: up to {} requests queued for KV pages at once; {} preemptions (running requests that gave their pages back and recomputed)",
        peak_waiting.load(std::sync::atomic::Ordering::Relaxed),
        preemptions.map_or("?".to_owned(), thousands)
    ));
    r.check(
        report.leaks.is_empty(),
        format!(
            "zero leaks: no response carried another request's canary ({} requests)",
            report.requests.len()
        ),
    );
    let failures = report.failures();
    r.check(
        failures == 0,
        format!("no failed check ({failures} failures)"),
    );
    for f in report
        .findings
        .iter()
        .filter(|f| f.severity == crate::report::Severity::Failure)
    {
        r.say(format!("     - {}: {}", f.check.title(), f.message));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_like_the_incident_report() {
        assert_eq!(thousands(ADVERTISED), "1,048,576");
        assert_eq!(thousands(POOL + 1), "681,281");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        // The scaled pool keeps the incident's ratio to four digits, in whole pages.
        let ratio = |pool: usize, adv: usize| pool as f64 / adv as f64;
        let scaled = ratio(POOL / SCALE, ADVERTISED / SCALE);
        assert!((scaled - ratio(POOL, ADVERTISED)).abs() < 1e-4, "{scaled}");
        assert_eq!(pool_flags(POOL / SCALE)[3], "2");
        assert!((POOL / SCALE).is_multiple_of(2));
        assert_eq!(pool_flags(POOL)[3], "16");
    }
}
