//! Which running request gives its pages back when another cannot grow.
//!
//! Fair between tenants: the victim is the youngest request of the tenant that holds the
//! most pages, among the requests younger than the one asking (or the one asking itself
//! when it is the youngest). So a tenant that floods the engine preempts its own requests
//! before anyone else's, while the guarantee that keeps every request finishing stays: a
//! request never loses its pages to a younger one, so the oldest always makes progress.

use std::collections::HashMap;

/// What the choice needs of one running request.
pub(crate) struct Holding<'a> {
    pub tenant: &'a str,
    /// Pages that giving this request's pages back would return to the pool.
    pub pages: usize,
}

/// `running` is in arrival order (oldest first); `asking` is the index of the request
/// that needs a page. Returns the index of the request to preempt, or `None` when
/// `asking` is out of range.
pub(crate) fn victim(running: &[Holding<'_>], asking: usize) -> Option<usize> {
    if asking >= running.len() {
        return None;
    }
    let candidates = if asking + 1 < running.len() {
        asking + 1..running.len()
    } else {
        asking..running.len()
    };
    let mut held: HashMap<&str, usize> = HashMap::new();
    for r in running {
        *held.entry(r.tenant).or_default() += r.pages;
    }
    // Youngest first, so that among tenants holding as much, the youngest request's goes
    // (the policy before tenants were counted).
    let mut best: Option<(usize, usize)> = None;
    for i in candidates.rev() {
        let load = held.get(running[i].tenant).copied().unwrap_or(0);
        if best.is_none_or(|(_, most)| load > most) {
            best = Some((i, load));
        }
    }
    best.map(|(i, _)| i)
}

/// Which running request gives its slot back when every slot is taken and a request
/// waits whose tenant runs `waiting_tenant_runs` requests: the youngest request of the
/// tenant running the most, if that tenant runs at least two more (one more would only
/// swap the two tenants' places). `running` holds each running request's tenant, oldest
/// first.
///
/// Max-min fair: slots move only towards the tenant with fewer, so two tenants never take
/// a slot back and forth, and a tenant keeps its oldest request running (it runs two or
/// more when it gives one up), which keeps every request finishing.
pub(crate) fn slot_victim(running: &[&str], waiting_tenant_runs: usize) -> Option<usize> {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for t in running {
        *counts.entry(t).or_default() += 1;
    }
    // Youngest first: among tenants running as many, the youngest request's gives way.
    let mut best: Option<(usize, usize)> = None;
    for (i, t) in running.iter().enumerate().rev() {
        let count = counts[t];
        if best.is_none_or(|(_, most)| count > most) {
            best = Some((i, count));
        }
    }
    best.filter(|&(_, most)| most >= waiting_tenant_runs + 2)
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(spec: &[(&'static str, usize)]) -> Vec<Holding<'static>> {
        spec.iter()
            .map(|&(tenant, pages)| Holding { tenant, pages })
            .collect()
    }

    /// The quiet tenant's request is the youngest, but the flooder holds the most pages:
    /// the flooder's youngest goes (global youngest-first would take the quiet one).
    #[test]
    fn the_largest_holders_youngest_goes() {
        let r = running(&[
            ("flood", 3),
            ("flood", 3),
            ("flood", 3),
            ("quiet", 2),
            ("flood", 3),
            ("quiet", 2),
        ]);
        assert_eq!(victim(&r, 0), Some(4));
        assert_eq!(victim(&r, 4), Some(5), "only younger ones are candidates");
    }

    /// Pages held by requests older than the asking one still count for their tenant.
    #[test]
    fn load_counts_every_request_of_the_tenant() {
        let r = running(&[("flood", 9), ("quiet", 1), ("flood", 1), ("quiet", 2)]);
        assert_eq!(victim(&r, 1), Some(2));
    }

    #[test]
    fn never_an_older_request_and_the_youngest_may_give_way_itself() {
        let r = running(&[("a", 1), ("b", 50), ("a", 1)]);
        // b is older than the asker: not a candidate, however much it holds.
        assert_eq!(victim(&r, 1), Some(2));
        assert_eq!(victim(&r, 2), Some(2));
        assert_eq!(victim(&r, 3), None);
        for asking in 0..r.len() {
            assert!(victim(&r, asking).is_some_and(|v| v >= asking));
        }
    }

    /// Equal loads: the youngest request overall, as before.
    #[test]
    fn ties_take_the_youngest() {
        let r = running(&[("a", 2), ("b", 2), ("a", 2), ("b", 2)]);
        assert_eq!(victim(&r, 0), Some(3));
    }

    #[test]
    fn a_slot_goes_from_the_tenant_running_the_most_to_one_running_two_fewer() {
        let r = ["flood", "flood", "quiet", "flood", "flood"];
        // A quiet request waits: the flood's youngest gives its slot.
        assert_eq!(slot_victim(&r, 1), Some(4));
        assert_eq!(slot_victim(&r, 0), Some(4));
        // A flood request waits: nobody runs two more than the flood does.
        assert_eq!(slot_victim(&r, 4), None);
        // One more only would swap places: no slot moves.
        assert_eq!(slot_victim(&["a", "a", "b"], 1), None);
        assert_eq!(slot_victim(&["a", "a", "b"], 0), Some(1));
    }

    /// After a slot moves, the request it went back for cannot take it back: counts only
    /// ever even out.
    #[test]
    fn slots_never_move_back_and_forth() {
        let mut running = vec!["a"; 8];
        let mut waiting_b = 3;
        let mut moves = 0;
        while waiting_b > 0 {
            let b_runs = running.iter().filter(|t| **t == "b").count();
            match slot_victim(&running, b_runs) {
                Some(v) => {
                    assert_eq!(running[v], "a");
                    running.remove(v);
                    running.push("b");
                    waiting_b -= 1;
                    moves += 1;
                    // The preempted "a" waits now: it must not get its slot back.
                    let a_runs = running.iter().filter(|t| **t == "a").count();
                    assert_eq!(slot_victim(&running, a_runs), None);
                }
                None => break,
            }
        }
        assert_eq!(moves, 3);
        assert_eq!(running.iter().filter(|t| **t == "a").count(), 5);
    }
}
