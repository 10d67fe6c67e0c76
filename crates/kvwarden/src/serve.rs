//! `kvwarden serve`: the monolithic OpenAI API, or one side (`--role prefill|decode`) of
//! the disaggregated mode.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use engine::EngineConfig;

use crate::open_model;
use crate::serve_args::{KvDtypeArg, RoleArg, ScrubArg, ServeArgs, SpeculationArg};

pub fn serve(#[allow(unused_mut)] mut args: ServeArgs) -> Result<()> {
    #[cfg(feature = "fault-injection")]
    crate::fault::apply(&mut args);
    let auth = args.edge.auth()?;
    let model_name = served_model_name(&args.served_model_name, &args.model);
    if args.role.is_some() {
        for (flag, given) in [
            ("--lora-access", args.edge.lora_access.is_some()),
            ("--admin-listen", args.admin_listen.is_some()),
        ] {
            if given {
                bail!("{flag} is for monolithic serve: a node has no tenants' API (give the router the adapters' access), and the operator API is not yet available on nodes");
            }
        }
    }
    crate::adapters::check_names(&args.lora, &model_name)?;
    // Checked before the model loads, so a missing token fails fast.
    let admin_token = args
        .admin_token_file
        .as_deref()
        .map(server::admin::AdminToken::load)
        .transpose()?;
    let load = if args.no_mmap {
        gguf::Load::Read
    } else {
        gguf::Load::Map
    };
    let file = open_model(&args.model, load)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)?;
    let template = args.edge.chat_template(&tok)?;
    let public_prefixes = match &args.public_prefixes {
        None => Vec::new(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let texts: Vec<String> = serde_json::from_str(&text)
                .with_context(|| format!("{}: expected a JSON list of strings", path.display()))?;
            texts
                .iter()
                .map(|t| tok.encode(t))
                .filter(|t| !t.is_empty())
                .collect()
        }
    };
    let (model, repacks) = model::Model::load_deferring_repack(&file)?;
    drop(file);
    // The server answers from the file's rows while the weights are repacked into tiles
    // beside it, matrix by matrix (every layout gives the same bits): start is the time to
    // map the file, not to rewrite it. "weights ready" says when products run at full
    // speed (bench/serve.py waits for it).
    let matrices = repacks.len();
    if matrices == 0 {
        tracing::info!(matrices, "weights ready");
    } else {
        std::thread::Builder::new()
            .name("kvwarden-repack".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let bytes = repacks.run();
                tracing::info!(
                    matrices,
                    repacked_mib = bytes >> 20,
                    seconds = started.elapsed().as_secs_f64(),
                    "weights ready"
                );
            })
            .context("starting the repack thread")?;
    }
    // Before the model moves into the engine: the adapters are checked against it.
    let adapters = crate::adapters::load_all(&args.lora, &model)?;
    let loader = admin_token
        .is_some()
        .then(|| crate::adapters::FileLoader::new(&model, adapters.clone()));
    let draft = match &args.draft_model {
        Some(path) if args.role != Some(RoleArg::Prefill) => Some(load_draft(path, load, &tok)?),
        Some(_) => {
            tracing::info!("a prefill node never decodes: --draft-model is not loaded");
            None
        }
        None => None,
    };
    let kv_dtype = match args.kv_dtype {
        KvDtypeArg::F16 => kv::KvDtype::F16,
        KvDtypeArg::F32 => kv::KvDtype::F32,
        KvDtypeArg::Q8_0 => kv::KvDtype::Q8_0,
        KvDtypeArg::Q4_0 => kv::KvDtype::Q4_0,
    };
    let layout = model.kv_layout(args.kv_page_tokens.max(1), kv_dtype);
    let pool_tokens = match args.kv_pool_mib {
        None => args.kv_pool_tokens,
        Some(mib) => {
            let pages = (mib << 20) / layout.page_bytes().max(1);
            if pages == 0 {
                bail!(
                    "--kv-pool-mib {mib} holds no page of {} bytes",
                    layout.page_bytes()
                );
            }
            pages * layout.page_tokens
        }
    };
    let role = args.role;
    let engine = engine::start_with_draft(
        model,
        draft.map(|model| engine::DraftModel {
            model: Box::new(model),
            pool_tokens,
            relative_cost: args.draft_cost,
        }),
        EngineConfig {
            max_context: args.max_context,
            pool_tokens,
            page_tokens: args.kv_page_tokens,
            kv_dtype,
            scrub: match args.kv_scrub {
                ScrubArg::Zero => kv::ScrubPolicy::Zero,
                ScrubArg::Poison => kv::ScrubPolicy::Poison,
                ScrubArg::None => kv::ScrubPolicy::None,
            },
            max_batch_tokens: args.max_batch_tokens,
            max_running: args.max_running,
            max_waiting: args.max_waiting,
            // A decode node only runs received sequences: nothing to share between them.
            prefix_cache: !args.no_prefix_cache && role != Some(RoleArg::Decode),
            public_prefixes,
            speculation: engine::SpeculationConfig {
                mode: match args.speculation {
                    SpeculationArg::Auto => engine::SpeculationMode::Auto,
                    SpeculationArg::On => engine::SpeculationMode::Always,
                    SpeculationArg::Off => engine::SpeculationMode::Off,
                },
                max_draft: usize::from(args.max_draft_tokens),
            },
        },
    )?;
    if let Some(role) = role {
        let identity = transfer::NodeIdentity {
            role: match role {
                RoleArg::Prefill => transfer::Role::Prefill,
                RoleArg::Decode => transfer::Role::Decode,
            },
            model_checksum: model_checksum(&args.model)?,
            pool_tokens: engine.pool_counts().total * layout.page_tokens,
            page_tokens: layout.page_tokens,
            n_layers: layout.n_layers,
            kv_dim: layout.kv_dim,
            kv_dtype: layout.dtype,
        };
        let eos = tok.eos_id();
        let vocabulary =
            constraint::Vocabulary::new(Arc::new(tok), engine.admission().vocab_size(), eos);
        return crate::node::run(args, engine, identity, Arc::new(vocabulary), adapters);
    }
    let catalog = Arc::new(crate::adapters::catalog(
        &model_name,
        adapters.clone(),
        &args.lora,
    )?);
    let mut state = server::AppState::new(
        Arc::new(engine.clone()),
        Arc::new(tok),
        template,
        model_name,
        auth,
        args.edge.max_body_bytes,
    );
    state.adapters = catalog.clone();
    args.edge.configure(&mut state)?;
    let state = Arc::new(state);
    let admin = match (admin_token, loader) {
        (Some(token), Some(loader)) => Some(Arc::new(server::admin::Admin::new(
            token,
            catalog,
            adapters,
            Arc::new(loader),
        ))),
        _ => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let stopper = engine.clone();
    let max_context = engine.max_context();
    runtime.block_on(async {
        if let (Some(admin), Some(at)) = (admin, &args.admin_listen) {
            serve_operator_api(admin, at).await?;
        }
        args.edge
            .serve(
                state.clone(),
                |addr| {
                    format!(
                        "listening on http://{addr} (model {:?}, max context {max_context})",
                        state.model_name
                    )
                },
                move || stopper.shutdown(),
            )
            .await
    })?;
    engine.shutdown();
    Ok(())
}

/// Binds `--admin-listen` and serves the operator API there for the process's life (it
/// ends with the runtime, after the tenants' API has shut down).
async fn serve_operator_api(admin: Arc<server::admin::Admin>, at: &str) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(at)
        .await
        .with_context(|| format!("binding --admin-listen {at}"))?;
    eprintln!(
        "kvwarden: operator API on http://{}/v1/adapters",
        listener.local_addr()?
    );
    // A few operators, not the tenants' crowd.
    let limits = server::ConnectionLimits {
        max_connections: 16,
        max_per_address: 16,
        ..server::ConnectionLimits::default()
    };
    tokio::spawn(async move {
        if let Err(e) =
            server::admin::serve_admin(listener, admin, limits, std::future::pending()).await
        {
            tracing::error!("the operator API failed: {e}");
        }
    });
    Ok(())
}

/// The draft model of `--draft-model`, refused unless its token ids mean what the served
/// model's do.
fn load_draft(
    path: &std::path::Path,
    load: gguf::Load,
    target_tokens: &tokenizer::Tokenizer,
) -> Result<model::Model> {
    let file = open_model(&path.to_path_buf(), load)?;
    let tok = tokenizer::Tokenizer::from_gguf(&file)
        .with_context(|| format!("--draft-model {}", path.display()))?;
    if let Some(difference) = target_tokens.vocabulary_difference(&tok) {
        bail!(
            "--draft-model {}: its vocabulary is not the model's ({difference}); a draft model must share the model's tokens",
            path.display()
        );
    }
    model::Model::load(&file).with_context(|| format!("--draft-model {}", path.display()))
}

/// The model id clients must send: the flag, else the file's name without `.gguf`.
pub fn served_model_name(flag: &Option<String>, model: &std::path::Path) -> String {
    flag.clone().unwrap_or_else(|| {
        model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "kvwarden".to_owned())
    })
}

/// xxh3-64 of the whole model file: the identity nodes of one cluster must share.
pub fn model_checksum(path: &std::path::Path) -> Result<u64> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(xxhash_rust::xxh3::xxh3_64(&bytes))
}
