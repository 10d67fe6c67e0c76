//! Check 3, differential content: each greedy answer of the mix replayed alone must not change.

use crate::auditor::{Auditor, Planned};
use crate::record::Record;
use crate::report::{CheckName, CheckResult, Differential, Kind, Severity, Verdict};
use crate::text::clip;

impl Auditor {
    /// Replays each successful greedy request of the mix alone; the answer must not change.
    pub async fn differential(&mut self, ids: &[usize]) -> (CheckResult, Differential) {
        let originals: Vec<Record> = ids
            .iter()
            .filter_map(|&id| self.record(id))
            .filter(|r| {
                r.ex.succeeded()
                    && !r.ex.cancelled
                    && r.call.temperature == 0.0
                    && !r.kind.over_length()
            })
            .collect();
        let mut d = Differential {
            batch_invariance_claimed: self.config.batch_invariant,
            ..Default::default()
        };
        for orig in originals {
            let mut call = orig.call.clone();
            call.stream = false;
            call.logprobs = false;
            let replay = self
                .send_one(Planned {
                    tenant: orig.tenant,
                    kind: Kind::Replay,
                    call,
                    canary: orig.canary.clone(),
                    replay_of: Some(orig.id),
                })
                .await;
            if !replay.ex.succeeded() {
                continue;
            }
            d.compared += 1;
            if replay.ex.content == orig.ex.content {
                d.identical += 1;
            } else {
                d.differing.push((orig.id, replay.id));
                let msg = format!(
                    "request #{} alone gave a different answer than in the batch (#{}): batched {:?}, alone {:?}",
                    orig.id,
                    replay.id,
                    clip(&orig.ex.content, 100),
                    clip(&replay.ex.content, 100)
                );
                let sev = if self.config.batch_invariant {
                    Severity::Failure
                } else {
                    Severity::Warning
                };
                self.find(CheckName::Differential, sev, Some(replay.id), msg);
            }
        }
        let differing = d.compared - d.identical;
        let verdict = match (differing, self.config.batch_invariant, d.compared) {
            (_, _, 0) => Verdict::Skipped,
            (0, _, _) => Verdict::Pass,
            (_, true, _) => Verdict::Fail,
            (_, false, _) => Verdict::Warn,
        };
        let summary = format!(
            "{}/{} greedy answers identical alone and batched ({:.0}% differ){}",
            d.identical,
            d.compared,
            if d.compared == 0 {
                0.0
            } else {
                100.0 * differing as f64 / d.compared as f64
            },
            if self.config.batch_invariant {
                "; batch invariance claimed"
            } else {
                "; reported as a rate (no batch invariance claimed)"
            }
        );
        (
            CheckResult {
                check: CheckName::Differential,
                title: CheckName::Differential.title(),
                verdict,
                summary,
            },
            d,
        )
    }
}
