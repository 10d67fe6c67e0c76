//! Readable traces of the checker's examples and counterexamples.

use stateright::actor::{ActorModelAction, Id};
use stateright::{Expectation, Model, Path};

use crate::node::{DECODE, PREFILL, ROUTER};
use crate::properties;
use crate::{Action, HandoffModel, State};

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
    if steps.len() == 1 {
        out.push_str("(the initial state)\n");
    }
    for (i, action) in steps.iter().filter_map(|(_, a)| a.as_ref()).enumerate() {
        out.push_str(&format!("{:2}. {}\n", i + 1, describe_action(action)));
    }
    out.push_str(&describe_answers(path.last_state()));
    out
}

/// A locally minimal version of a discovery of property `name`: stateright reports the last
/// violating state it happened to visit, with steps that play no part in the violation. This
/// cuts the path at the first violating state (first example, for `sometimes`), then drops
/// single steps for as long as what remains still runs and still violates.
pub fn minimize(
    model: &HandoffModel,
    name: &'static str,
    path: &Path<State, Action>,
) -> Path<State, Action> {
    let property = model.property(name);
    let init = path.clone().into_states().swap_remove(0);
    // The shortest prefix of `actions` that is a discovery, if any.
    let discovery = |actions: &[Action]| -> Option<Path<State, Action>> {
        let path = Path::from_actions(model, init.clone(), actions)?;
        let states = path.clone().into_states();
        let holds = |s: &State| (property.condition)(model, s);
        match property.expectation {
            Expectation::Always => {
                let k = states.iter().position(|s| !holds(s))?;
                Path::from_actions(model, init.clone(), &actions[..k])
            }
            Expectation::Sometimes => {
                let k = states.iter().position(holds)?;
                Path::from_actions(model, init.clone(), &actions[..k])
            }
            Expectation::Eventually => {
                let last = states.last()?;
                let terminal = model.next_steps(last).is_empty();
                (terminal && !states.iter().any(holds)).then_some(path)
            }
        }
    };
    let mut best = match discovery(&path.clone().into_actions()) {
        Some(p) => p,
        None => return path.clone(),
    };
    'shrink: loop {
        let actions = best.clone().into_actions();
        for i in 0..actions.len() {
            let mut fewer = actions.clone();
            fewer.remove(i);
            if let Some(p) = discovery(&fewer) {
                best = p;
                continue 'shrink;
            }
        }
        return best;
    }
}
