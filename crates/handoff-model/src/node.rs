//! The three actors as one stateright [`Actor`], and their timers.

use std::borrow::Cow;
use std::sync::Arc;

use stateright::actor::{Actor, Id, Out};

use crate::decode::{self, DecodeState};
use crate::prefill::{self, PrefillChoice, PrefillState};
use crate::protocol::{Msg, Req, Ticket};
use crate::router::{self, RouterState};
use crate::Config;

/// Actor index of the router.
pub const ROUTER: usize = 0;
/// Actor index of the prefill node.
pub const PREFILL: usize = 1;
/// Actor index of the decode node.
pub const DECODE: usize = 2;

/// A node of the deployment; each carries the model's configuration.
#[derive(Clone, Debug)]
pub enum Node {
    Router(Arc<Config>),
    Prefill(Arc<Config>),
    Decode(Arc<Config>),
}

/// A node's state. (A crash keeps the state as it was; a crashed node never acts again.)
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NodeState {
    Router(RouterState),
    Prefill(PrefillState),
    Decode(DecodeState),
}

/// Timers fire nondeterministically: any time while set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Timer {
    /// The router's deadline for a request.
    Deadline(Req),
    /// The decode node's deadline for a reservation to get its push (and `Generate`).
    Reservation(Ticket),
    /// The decode node's next decode step for a streaming reservation.
    DecodeStep(Ticket),
}

impl Actor for Node {
    type Msg = Msg;
    type State = NodeState;
    type Timer = Timer;
    type Random = PrefillChoice;
    type Storage = ();

    fn on_start(&self, _id: Id, _storage: &Option<()>, o: &mut Out<Self>) -> NodeState {
        match self {
            Node::Router(cfg) => NodeState::Router(router::on_start(cfg, o)),
            Node::Prefill(_) => NodeState::Prefill(prefill::on_start()),
            Node::Decode(cfg) => NodeState::Decode(decode::on_start(cfg)),
        }
    }

    fn on_msg(&self, _id: Id, state: &mut Cow<NodeState>, src: Id, msg: Msg, o: &mut Out<Self>) {
        match self {
            Node::Router(cfg) => router::on_msg(cfg, state, src, msg, o),
            Node::Prefill(cfg) => prefill::on_msg(cfg, state, src, msg, o),
            Node::Decode(cfg) => decode::on_msg(cfg, state, src, msg, o),
        }
    }

    fn on_timeout(&self, _id: Id, state: &mut Cow<NodeState>, timer: &Timer, o: &mut Out<Self>) {
        match self {
            Node::Router(_) => router::on_timeout(state, timer, o),
            Node::Prefill(_) => {}
            Node::Decode(_) => decode::on_timeout(state, timer, o),
        }
    }

    fn on_random(
        &self,
        _id: Id,
        state: &mut Cow<NodeState>,
        random: &PrefillChoice,
        o: &mut Out<Self>,
    ) {
        if let Node::Prefill(cfg) = self {
            prefill::on_random(cfg, state, random, o);
        }
    }

    fn name(&self) -> String {
        match self {
            Node::Router(_) => "router",
            Node::Prefill(_) => "prefill",
            Node::Decode(_) => "decode",
        }
        .to_string()
    }
}
