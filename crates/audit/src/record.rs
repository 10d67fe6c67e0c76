//! One request sent and what came back: what every check and the report read.

use crate::canary::Canary;
use crate::report::Kind;
use oai_client::{Call, Exchange};

/// One request sent and what came back.
#[derive(Debug, Clone)]
pub struct Record {
    pub id: usize,
    pub tenant: usize,
    pub kind: Kind,
    pub call: Call,
    pub canary: Option<Canary>,
    /// Replays carry the id of the request they repeat: the same request, the same canary.
    pub replay_of: Option<usize>,
    pub ex: Exchange,
}

impl Record {
    pub(crate) fn owner(&self) -> usize {
        self.replay_of.unwrap_or(self.id)
    }
}

/// Hand-made records for the tests of the modules that judge them.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;
    use oai_client::{Api, Prompt, UsageSeen};

    pub(crate) fn record(
        id: usize,
        tenant: usize,
        kind: Kind,
        ex: Exchange,
        canary: Option<Canary>,
    ) -> Record {
        Record {
            id,
            tenant,
            kind,
            call: Call {
                api: Api::Completions,
                prompt: Prompt::Tokens(vec![100; 10]),
                max_tokens: 4,
                temperature: 0.0,
                stream: false,
                logprobs: false,
                ignore_eos: false,
                cancel_after: None,
                key: None,
                extra: Default::default(),
            },
            canary,
            replay_of: None,
            ex,
        }
    }

    pub(crate) fn ok(content: &str, finish: &str, completion: u64) -> Exchange {
        Exchange {
            status: Some(200),
            content: content.into(),
            finish_reason: Some(finish.into()),
            usage: Some(UsageSeen {
                prompt_tokens: Some(10),
                completion_tokens: Some(completion),
                cached_tokens: None,
            }),
            ..Default::default()
        }
    }
}
