//! Check 5, the prefix-cache timing side channel: can one tenant time another's cached prompt.

use crate::auditor::{Auditor, Planned};
use crate::prompts;
use crate::record::Record;
use crate::report::{
    CheckName, CheckResult, Kind, Severity, SideChannel, SideChannelTrial, Verdict,
};
use oai_client::Rng;
use oai_client::{Api, Prompt};

impl Auditor {
    /// Time to first token of a long prefix: tenant A cold and again, then tenant B on the
    /// same prefix and on a fresh one of the same length.
    pub async fn side_channel(&mut self) -> (CheckResult, SideChannel) {
        let l = self.max_context;
        let len = self
            .config
            .side_channel_tokens
            .unwrap_or((l / 2).min(1024))
            .clamp(32, l.saturating_sub(16).max(32));
        let (a, b) = (0, 1 % self.tenants.len());
        let mut sc = SideChannel {
            tenants: (self.tenants[a].name.clone(), self.tenants[b].name.clone()),
            real_tenants: self.real_tenants,
            ..Default::default()
        };
        for _ in 0..self.config.side_channel_trials.max(1) {
            let prefix = prompts::token_ids(&mut self.rng, len);
            let fresh = prompts::token_ids(&mut self.rng, len);
            let probe = |tenant: usize, base: &[u32], rng: &mut Rng| {
                let mut ids = base.to_vec();
                ids.extend(prompts::token_ids(rng, 4));
                let mut call = self.call(Api::Completions, Prompt::Tokens(ids), tenant);
                call.stream = true;
                call.max_tokens = 1;
                Planned {
                    tenant,
                    kind: Kind::SideChannel,
                    call,
                    canary: None,
                    replay_of: None,
                }
            };
            let mut rng = self.rng.clone();
            let steps = [
                probe(a, &prefix, &mut rng),
                probe(a, &prefix, &mut rng),
                probe(b, &prefix, &mut rng),
                probe(b, &fresh, &mut rng),
            ];
            self.rng = rng;
            let mut got = Vec::new();
            for p in steps {
                got.push(self.send_one(p).await);
            }
            let ms = |r: &Record| r.ex.ttft.unwrap_or(r.ex.total).as_secs_f64() * 1e3;
            let cached = |r: &Record| r.ex.usage.and_then(|u| u.cached_tokens);
            sc.trials.push(SideChannelTrial {
                prefix_tokens: len,
                a_cold_ms: ms(&got[0]),
                a_repeat_ms: ms(&got[1]),
                b_same_prefix_ms: ms(&got[2]),
                b_fresh_ms: ms(&got[3]),
                a_repeat_cached: cached(&got[1]),
                b_same_prefix_cached: cached(&got[2]),
                b_fresh_cached: cached(&got[3]),
            });
        }
        let median = |f: &dyn Fn(&SideChannelTrial) -> f64| {
            let mut v: Vec<f64> = sc.trials.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let (a1, a2, bs, bf) = (
            median(&|t| t.a_cold_ms),
            median(&|t| t.a_repeat_ms),
            median(&|t| t.b_same_prefix_ms),
            median(&|t| t.b_fresh_ms),
        );
        // A fresh prefix costs the same for anyone; what matters is whether B's request for
        // A's prefix costs less than a fresh one. "Less" is a factor of 2, far outside the
        // noise of one machine, and only counted when A's own repeat shows the cache at all.
        sc.reported_cross_hit = sc
            .trials
            .iter()
            .any(|t| t.b_same_prefix_cached.is_some_and(|c| c > 0));
        sc.own_cache_visible = sc
            .trials
            .iter()
            .any(|t| t.a_repeat_cached.is_some_and(|c| c > 0))
            || a2 * 2.0 < a1;
        sc.timing_cross_hit = sc.own_cache_visible && bs * 2.0 < bf;
        let timings = format!(
            "TTFT medians over {} trials of {len} tokens: A cold {a1:.0} ms, A again {a2:.0} ms, B same prefix {bs:.0} ms, B fresh {bf:.0} ms",
            sc.trials.len()
        );
        let (verdict, summary) = if sc.reported_cross_hit {
            let cached = sc
                .trials
                .iter()
                .filter_map(|t| t.b_same_prefix_cached)
                .max()
                .unwrap_or(0);
            if self.real_tenants {
                let msg = format!(
                    "cross-tenant prefix cache hit: {} reused {cached} cached tokens of {}'s prefix ({timings})",
                    sc.tenants.1, sc.tenants.0
                );
                self.find(CheckName::SideChannel, Severity::Failure, None, msg.clone());
                (Verdict::Fail, msg)
            } else {
                let msg = format!(
                    "prefix cache shared across requesters: {} reused {cached} cached tokens of {}'s prefix; with no API keys the server cannot tell tenants apart, so its users can time each other's prompts ({timings})",
                    sc.tenants.1, sc.tenants.0
                );
                self.find(CheckName::SideChannel, Severity::Warning, None, msg.clone());
                (Verdict::Warn, msg)
            }
        } else if sc.timing_cross_hit {
            let msg = format!(
                "timings suggest {} hit {}'s cached prefix (B same prefix at least twice as fast as fresh): {timings}",
                sc.tenants.1, sc.tenants.0
            );
            self.find(CheckName::SideChannel, Severity::Warning, None, msg.clone());
            (Verdict::Warn, msg)
        } else if sc.own_cache_visible {
            (Verdict::Pass, format!("no cross-tenant hit; {timings}"))
        } else {
            (
                Verdict::Pass,
                format!("no cross-tenant hit and no visible prefix cache; {timings}"),
            )
        };
        (
            CheckResult {
                check: CheckName::SideChannel,
                title: CheckName::SideChannel.title(),
                verdict,
                summary,
            },
            sc,
        )
    }
}
