//! Check 4, status honesty: the verdict over every response of the run (the rules for one
//! response are `inspect::status_problems`, which the ledger also applies live).

use crate::auditor::Auditor;
use crate::inspect::status_problems;
use crate::record::Record;
use crate::report::{CheckName, CheckResult, Severity, Verdict};

impl Auditor {
    pub(crate) fn status(&mut self, records: &[Record]) -> CheckResult {
        let mut bad = 0;
        let mut checked = 0;
        for r in records {
            checked += 1;
            for (sev, msg) in status_problems(r, self.max_context) {
                if sev == Severity::Failure {
                    bad += 1;
                }
                self.find(CheckName::Status, sev, Some(r.id), msg);
            }
        }
        let warnings = self
            .findings
            .iter()
            .filter(|f| f.check == CheckName::Status && f.severity == Severity::Warning)
            .count();
        CheckResult {
            check: CheckName::Status,
            title: CheckName::Status.title(),
            verdict: if bad > 0 {
                Verdict::Fail
            } else if warnings > 0 {
                Verdict::Warn
            } else {
                Verdict::Pass
            },
            summary: format!(
                "{checked} responses: {bad} dishonest statuses or bodies, {warnings} warnings"
            ),
        }
    }
}
