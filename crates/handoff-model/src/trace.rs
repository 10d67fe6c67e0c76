//! Readable traces of the checker's examples and counterexamples.

use stateright::actor::{ActorModelAction, Id};
use stateright::Path;

use crate::node::{DECODE, PREFILL, ROUTER};
use crate::properties;
use crate::{Action, State};

/// The node's name in a trace.
pub fn node_name(id: Id) -> &'static str {
    match usize::from(id) {
        ROUTER => "router",
        PREFILL => "prefill",
        DECODE => "decode",
        _ => "?",
    }
}

/// One line per step.
pub fn describe_action(action: &Action) -> String {
    match action {
        ActorModelAction::Deliver { src, dst, msg } => {
            format!("{} -> {}: {msg:?}", node_name(*src), node_name(*dst))
        }
        ActorModelAction::Drop(env) => format!(
            "lost {} -> {}: {:?}",
            node_name(env.src),
            node_name(env.dst),
            env.msg
        ),
        ActorModelAction::Timeout(id, timer) => {
            format!("{} timer fires: {timer:?}", node_name(*id))
        }
        ActorModelAction::Crash(id) => format!("{} crashes", node_name(*id)),
        ActorModelAction::Recover(id) => format!("{} recovers", node_name(*id)),
        ActorModelAction::SelectRandom { actor, random, .. } => format!(
            "{} chooses {:?} for {:?}",
            node_name(*actor),
            random.outcome,
            random.req
        ),
    }
}

/// What each client was told, in the given state.
pub fn describe_answers(state: &State) -> String {
    properties::router(state)
        .reqs
        .iter()
        .enumerate()
        .map(|(i, r)| format!("client of request {i}: {:?}", r.client))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A whole path: numbered steps, then the answers in its last state.
pub fn describe_path(path: &Path<State, Action>) -> String {
    let mut out = String::new();
    let steps = path.clone().into_vec();
    for (i, action) in steps.iter().filter_map(|(_, a)| a.as_ref()).enumerate() {
        out.push_str(&format!("{:2}. {}\n", i + 1, describe_action(action)));
    }
    out.push_str(&describe_answers(path.last_state()));
    out
}
