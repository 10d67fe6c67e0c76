//! Exhaustive checks of the handoff model, and mutations that prove the checks can fail.
//!
//! Run with `--nocapture` to see state counts, times and the counterexamples.

use std::collections::BTreeSet;
use std::time::Instant;

use handoff_model::properties::*;
use handoff_model::router::ClientEvent;
use handoff_model::trace::{describe_path, minimize};
use handoff_model::{
    Config, DecodeBehaviour, HandoffModel, PrefillBehaviour, Req, RouterBehaviour, Token,
};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

/// Explores the whole state space and checks that no `always`/`eventually` property has a
/// counterexample and that each of `examples` (sometimes properties) has an example.
fn assert_holds(label: &str, cfg: Config, examples: &[&'static str]) {
    let checker = explore(label, cfg);
    for property in checker.model().properties() {
        if property.expectation == Expectation::Sometimes {
            continue;
        }
        if let Some(path) = checker.discovery(property.name) {
            panic!(
                "{label}: counterexample to \"{}\":\n{}",
                property.name,
                describe_path(&minimize(checker.model(), property.name, &path))
            );
        }
    }
    for &name in examples {
        assert!(
            checker.discovery(name).is_some(),
            "{label}: no example of \"{name}\": the model is vacuous there"
        );
    }
}

/// Runs until every one of `wanted` has a discovery (or the space is exhausted); returns the
/// checker after printing each discovery.
fn find(label: &str, cfg: Config, wanted: &[&'static str]) -> impl Checker<HandoffModel> {
    let start = Instant::now();
    let checker = cfg
        .into_model()
        .checker()
        .finish_when(HasDiscoveries::AllOf(wanted.iter().copied().collect()))
        .spawn_bfs()
        .join();
    eprintln!(
        "{label}: {} unique states, {:?}",
        checker.unique_state_count(),
        start.elapsed()
    );
    for &name in wanted {
        print_counterexample(label, &checker, name);
    }
    checker
}

/// Explores the whole state space.
fn explore(label: &str, cfg: Config) -> impl Checker<HandoffModel> {
    let start = Instant::now();
    let checker = cfg.into_model().checker().spawn_bfs().join();
    eprintln!(
        "{label}: {} unique states ({} generated), depth {}, {:?}",
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        start.elapsed()
    );
    assert!(checker.is_done(), "{label}: the check did not finish");
    checker
}

fn print_counterexample(label: &str, checker: &impl Checker<HandoffModel>, name: &'static str) {
    let path = checker
        .discovery(name)
        .map(|path| minimize(checker.model(), name, &path))
        .unwrap_or_else(|| panic!("{label}: the checker found no counterexample to \"{name}\""));
    eprintln!(
        "{label}: counterexample to \"{name}\":\n{}\n",
        describe_path(&path)
    );
}

fn always_and_eventually_except(cfg: &Config, broken: &[&str]) -> Vec<&'static str> {
    cfg.clone()
        .into_model()
        .properties()
        .into_iter()
        .filter(|p| p.expectation != Expectation::Sometimes && !broken.contains(&p.name))
        .map(|p| p.name)
        .collect()
}

/// The checker must have explored everything and found none of `names`.
fn assert_none_found(label: &str, checker: &impl Checker<HandoffModel>, names: &[&'static str]) {
    for &name in names {
        if let Some(path) = checker.discovery(name) {
            panic!(
                "{label}: unexpected counterexample to \"{name}\":\n{}",
                describe_path(&minimize(checker.model(), name, &path))
            );
        }
    }
}

#[test]
fn the_protocol_holds_for_an_over_length_request_with_faults_losses_and_a_crash() {
    assert_holds(
        "over-length",
        Config::over_length(),
        &[
            SOME_SUCCESS,
            SOME_PREFILL_REJECTION,
            SOME_PUSH_REFUSED,
            SOME_ERROR_AFTER_TOKENS,
            SOME_RESERVATION_TIMEOUT,
        ],
    );
}

/// Two requests through one small decode pool with an adversarial prefill node. Crashes and
/// losses are left out to keep this in the default suite; for the safety properties they add
/// nothing (see [`Config::max_losses`]), only paths that end for the liveness check. With one
/// of each, the same check explores about 2.1 million states: see the ignored test below.
#[test]
fn the_protocol_holds_when_two_tenants_share_the_decode_pool() {
    let cfg = Config {
        max_losses: 0,
        max_crashes: 0,
        ..Config::contention()
    };
    assert_holds(
        "contention",
        cfg,
        &[
            SOME_SUCCESS,
            SOME_ALL_SUCCEED,
            SOME_PUSH_REFUSED,
            SOME_CAPACITY_REFUSAL,
            SOME_ERROR_AFTER_TOKENS,
            SOME_RESERVATION_TIMEOUT,
        ],
    );
}

#[test]
#[ignore = "about 2 million states: a minute or so; run with --ignored"]
fn the_protocol_holds_when_two_tenants_share_the_decode_pool_with_losses_and_a_crash() {
    assert_holds(
        "contention, one loss, one crash",
        Config::contention(),
        &[
            SOME_SUCCESS,
            SOME_ALL_SUCCEED,
            SOME_PUSH_REFUSED,
            SOME_CAPACITY_REFUSAL,
            SOME_ERROR_AFTER_TOKENS,
            SOME_RESERVATION_TIMEOUT,
        ],
    );
}

/// The tokens a client was sent that were computed from another request's data.
fn leaked_tokens(checker: &impl Checker<HandoffModel>, name: &'static str) -> Vec<(Req, Req)> {
    let path = minimize(checker.model(), name, &checker.discovery(name).unwrap());
    router(path.last_state())
        .reqs
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.client.iter().filter_map(move |e| match e {
                ClientEvent::Token(Token::From(from)) if *from != Req(i as u8) => {
                    Some((Req(i as u8), *from))
                }
                _ => None,
            })
        })
        .collect()
}

/// MUTATION: a decode node that accepts any push. The checker must find tokens emitted from
/// an unverified push, another request's data in an answer, and a success built on it.
#[test]
fn a_decode_node_that_skips_verification_is_caught() {
    let cfg = Config {
        decode: DecodeBehaviour::SkipVerification,
        ..Config::over_length()
    };
    let checker = find(
        "skip verification",
        cfg,
        &[
            TOKENS_ONLY_FROM_VERIFIED_PUSH,
            NO_FOREIGN_DATA,
            SUCCESS_ONLY_FROM_OWN_VERIFIED_KV,
        ],
    );
    assert!(!leaked_tokens(&checker, NO_FOREIGN_DATA).is_empty());
}

/// MUTATION, with two tenants sharing the pool: skipping verification lets one tenant's
/// answer be computed from the other's KV (pushed by mistake, or left in a reused page).
#[test]
fn a_decode_node_that_skips_verification_leaks_between_tenants() {
    let cfg = Config {
        decode: DecodeBehaviour::SkipVerification,
        max_losses: 0,
        max_crashes: 0,
        ..Config::contention()
    };
    let checker = find("skip verification, two tenants", cfg, &[NO_FOREIGN_DATA]);
    let leaks = leaked_tokens(&checker, NO_FOREIGN_DATA);
    assert!(
        leaks.iter().any(|(to, from)| from.0 < 2 && to != from),
        "expected a leak between the model's two tenants, got {leaks:?}"
    );
}

/// MUTATION (a late writer): a push that arrives after its reservation timed out is written
/// into pages that another tenant's request may now own and have verified.
#[test]
fn a_decode_node_that_writes_late_pushes_is_caught() {
    let cfg = Config {
        decode: DecodeBehaviour::WriteLatePushes,
        prefill: PrefillBehaviour::Honest,
        max_losses: 0,
        max_crashes: 0,
        ..Config::contention()
    };
    let checker = find("late writer", cfg, &[NO_FOREIGN_DATA]);
    assert!(!leaked_tokens(&checker, NO_FOREIGN_DATA).is_empty());
}

/// MUTATION (the incident's queue): the router proceeds after the prefill node rejected the
/// request. The checker must find the rejected request at the decode node. Nothing worse
/// follows: the prefill node refuses to prefill what it rejected, and the decode node would
/// refuse a push that does not match.
#[test]
fn a_router_that_proceeds_after_a_prefill_rejection_is_caught() {
    let cfg = Config {
        router: RouterBehaviour::ProceedOnPrefillRejection,
        prefill: PrefillBehaviour::Honest,
        max_losses: 0,
        ..Config::over_length()
    };
    let label = "router proceeds after rejection";
    let checker = explore(label, cfg.clone());
    print_counterexample(label, &checker, P_REJECTED_NEVER_AT_DECODE);
    assert_none_found(
        label,
        &checker,
        &always_and_eventually_except(&cfg, &[P_REJECTED_NEVER_AT_DECODE]),
    );
}

/// MUTATION (the incident's engine): the prefill node replaces an over-length prompt by a
/// one-token placeholder and carries on. The checker must find the rejected request at the
/// decode node; the decode node's verification (prompt length) still keeps every answer
/// clean.
#[test]
fn a_placeholder_for_a_rejected_prompt_is_caught_and_verification_contains_it() {
    let cfg = Config {
        prefill: PrefillBehaviour::PlaceholderOnOverLength,
        max_losses: 0,
        ..Config::over_length()
    };
    let label = "placeholder";
    let checker = explore(label, cfg.clone());
    print_counterexample(label, &checker, P_REJECTED_NEVER_AT_DECODE);
    assert!(checker.discovery(SOME_PUSH_REFUSED).is_some());
    assert_none_found(
        label,
        &checker,
        &always_and_eventually_except(&cfg, &[P_REJECTED_NEVER_AT_DECODE]),
    );
}

/// Both guards gone: the incident, reproduced. A prompt the prefill node rejected is answered
/// with success, built on KV that is not its own.
#[test]
fn without_either_guard_the_incident_happens() {
    let cfg = Config {
        prefill: PrefillBehaviour::PlaceholderOnOverLength,
        decode: DecodeBehaviour::SkipVerification,
        ..Config::over_length()
    };
    let checker = find(
        "the incident",
        cfg,
        &[
            P_REJECTED_NEVER_AT_DECODE,
            NO_TOKEN_FOR_P_REJECTED,
            SUCCESS_ONLY_FROM_OWN_VERIFIED_KV,
            NO_FOREIGN_DATA,
        ],
    );
    let path = checker
        .discovery(SUCCESS_ONLY_FROM_OWN_VERIFIED_KV)
        .unwrap();
    let rejected = Req(1);
    let answer = &router(path.last_state()).req(rejected).unwrap().client;
    assert_eq!(answer.last(), Some(&ClientEvent::Success), "{answer:?}");
    assert!(
        answer
            .iter()
            .any(|e| matches!(e, ClientEvent::Token(Token::From(r)) if *r != rejected)),
        "{answer:?}"
    );
}

/// MUTATION: a router that passes on a failure arriving after the terminal answer (a
/// reservation timing out after the router's own deadline answered): two terminal answers.
#[test]
fn a_router_that_answers_twice_is_caught() {
    let cfg = Config {
        router: RouterBehaviour::ForwardAfterAnswer,
        prefill: PrefillBehaviour::Honest,
        ..Config::over_length()
    };
    find("answers twice", cfg, &[ONE_TERMINAL_ANSWER]);
}

/// MUTATION: a router without deadlines. With a crash or a lost message, a client waits
/// forever: the checker must find it.
#[test]
fn a_router_without_deadlines_is_caught() {
    let cfg = Config {
        router: RouterBehaviour::NoDeadline,
        prefill: PrefillBehaviour::Honest,
        ..Config::over_length()
    };
    find(
        "no deadline",
        cfg,
        &[DEADLINE_ARMED, EVERY_REQUEST_ANSWERED],
    );
}

/// The properties' names are distinct (stateright keys discoveries by name).
#[test]
fn property_names_are_distinct() {
    let names: BTreeSet<_> = ALL.iter().map(|(_, name, _)| *name).collect();
    assert_eq!(names.len(), ALL.len());
}
