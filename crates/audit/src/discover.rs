//! Discovery: the model, the advertised context and the tenants of the server under test.

use std::sync::{Arc, Mutex};

use serde_json::Value;

use crate::auditor::{Auditor, Ledger, Tenant};
use crate::canary::CanaryMint;
use crate::config::Config;
use crate::error::AuditError;
use crate::progress::Progress;
use oai_client::Client;
use oai_client::Rng;

impl Auditor {
    /// Finds the model and the advertised context.
    pub async fn connect(config: Config) -> Result<Self, AuditError> {
        let mut client = Client::new(&config.endpoint, config.timeout)?;
        let key = config.api_keys.first().map(String::as_str);
        let health = match client.get_json("/health", key).await {
            Ok((_, v)) => v,
            Err(e) => {
                return Err(AuditError::Unreachable {
                    url: client.base.clone(),
                    message: e,
                })
            }
        };
        let models = client.get_json("/v1/models", key).await.ok();
        let first = models
            .as_ref()
            .and_then(|(_, v)| v.get("data"))
            .and_then(|d| d.get(0))
            .cloned();
        let model = match (&config.model, &first) {
            (Some(m), _) => m.clone(),
            (None, Some(m)) => m
                .get("id")
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| AuditError::NoModel("/v1/models lists no id".into()))?,
            (None, None) => {
                return Err(AuditError::NoModel(format!(
                    "/v1/models answered {:?}",
                    models.map(|m| m.0)
                )))
            }
        };
        let as_usize = |v: Option<&Value>| v.and_then(Value::as_u64).map(|n| n as usize);
        let (max_context, context_source) = if let Some(c) = config.max_context {
            (c, "--max-context".to_owned())
        } else if let Some(c) = as_usize(first.as_ref().and_then(|m| m.get("max_model_len"))) {
            (c, "/v1/models max_model_len".to_owned())
        } else {
            let props = client.get_json("/props", key).await.ok();
            let n_ctx = props.as_ref().and_then(|(_, p)| {
                as_usize(
                    p.get("default_generation_settings")
                        .and_then(|g| g.get("n_ctx")),
                )
                .or_else(|| as_usize(p.get("n_ctx")))
            });
            match n_ctx {
                Some(c) => (c, "/props n_ctx (llama.cpp, per slot)".to_owned()),
                None => {
                    return Err(AuditError::NoContext(
                        "neither /v1/models max_model_len nor /props n_ctx".into(),
                    ))
                }
            }
        };
        if max_context < 64 {
            return Err(AuditError::NoContext(format!(
                "a context of {max_context} tokens is too small to audit"
            )));
        }
        client.model = model;
        let real_tenants = config.api_keys.len() >= 2;
        let tenants: Vec<Tenant> = if real_tenants {
            config
                .api_keys
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    let model = config.tenant_models.get(i).cloned();
                    Tenant {
                        name: match &model {
                            Some(m) => format!("key-{} ({m})", i + 1),
                            None => format!("key-{}", i + 1),
                        },
                        key: Some(k.clone()),
                        model,
                    }
                })
                .collect()
        } else {
            (0..config.synthetic_tenants.max(2))
                .map(|i| Tenant {
                    name: format!("identity-{}", i + 1),
                    key: config.api_keys.first().cloned(),
                    model: None,
                })
                .collect()
        };
        let mut rng = Rng::new(config.seed);
        let mint = CanaryMint::new(Rng::new(rng.next_u64()));
        let progress = Progress::new(config.progress);
        Ok(Self {
            client: Arc::new(client),
            tenants,
            real_tenants,
            max_context,
            context_source,
            health,
            ledger: Arc::new(Mutex::new(Ledger {
                records: Vec::new(),
                canaries: Vec::new(),
                next_id: 1,
                leaks: Vec::new(),
                wrong_statuses: 0,
            })),
            progress,
            rng,
            mint,
            findings: Vec::new(),
            bytes_per_token: 1.0,
            words_per_token: 1.0,
            config,
        })
    }
}
