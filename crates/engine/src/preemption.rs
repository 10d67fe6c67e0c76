//! Which running request gives its pages back when another cannot grow, or its slot when
//! another tenant's request waits.
//!
//! Fair between tenants, in proportion to their weights (`GenerateRequest::weight`): the
//! victim is the youngest request of the tenant that holds the most pages per unit of
//! weight, among the requests younger than the one asking (or the one asking itself when
//! it is the youngest). So a tenant that floods the engine preempts its own requests
//! before anyone else's, while the guarantee that keeps every request finishing stays: a
//! request never loses its pages to a younger one, so the oldest always makes progress.

use std::collections::HashMap;

/// An amount (requests, pages) a tenant holds, against its weight: compared as
/// `amount / weight` without dividing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Load {
    amount: u64,
    weight: u64,
}

impl Load {
    pub(crate) fn new(amount: usize, weight: u32) -> Self {
        Self {
            amount: amount as u64,
            weight: u64::from(weight.max(1)),
        }
    }

    /// A smaller share than `other`'s, for its weight.
    pub(crate) fn lighter_than(self, other: Load) -> bool {
        u128::from(self.amount) * u128::from(other.weight)
            < u128::from(other.amount) * u128::from(self.weight)
    }
}

/// What the choices need of one running request.
pub(crate) struct Holding<'a> {
    pub tenant: &'a str,
    pub weight: u32,
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
    let mut best: Option<(usize, Load)> = None;
    for i in candidates.rev() {
        let r = &running[i];
        let load = Load::new(held.get(r.tenant).copied().unwrap_or(0), r.weight);
        if best.is_none_or(|(_, most)| most.lighter_than(load)) {
            best = Some((i, load));
        }
    }
    best.map(|(i, _)| i)
}

/// Which running request gives its slot back when every slot is taken and a request of a
/// tenant with weight `weight`, which runs `runs` requests, waits: the youngest request of
/// the tenant running the most per unit of weight, if that tenant would still run at least
/// as much per unit of weight as the waiting one after the move (with equal weights: runs
/// at least two more; one more would only swap the two tenants' places). `running` holds
/// each running request's tenant and weight (`pages` unused), oldest first.
///
/// Max-min fair: slots move only towards the tenant with less, so two tenants never take
/// a slot back and forth, and a tenant keeps its oldest request running (it runs two or
/// more when it gives one up), which keeps every request finishing.
pub(crate) fn slot_victim(running: &[Holding<'_>], runs: usize, weight: u32) -> Option<usize> {
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for r in running {
        *counts.entry(r.tenant).or_default() += 1;
    }
    // Youngest first: among tenants running as much, the youngest request's gives way.
    let mut best: Option<(usize, usize, u32)> = None;
    for (i, r) in running.iter().enumerate().rev() {
        let count = counts[r.tenant];
        if best
            .is_none_or(|(_, most, w)| Load::new(most, w).lighter_than(Load::new(count, r.weight)))
        {
            best = Some((i, count, r.weight));
        }
    }
    best.filter(|&(_, most, w)| {
        most >= 2 && !Load::new(most - 1, w).lighter_than(Load::new(runs + 1, weight))
    })
    .map(|(i, _, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(spec: &[(&'static str, usize)]) -> Vec<Holding<'static>> {
        spec.iter()
            .map(|&(tenant, pages)| Holding {
                tenant,
                weight: 1,
                pages,
            })
            .collect()
    }

    fn slots(tenants: &[&'static str]) -> Vec<Holding<'static>> {
        let spec: Vec<_> = tenants.iter().map(|&t| (t, 0)).collect();
        running(&spec)
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
        let r = slots(&["flood", "flood", "quiet", "flood", "flood"]);
        // A quiet request waits: the flood's youngest gives its slot.
        assert_eq!(slot_victim(&r, 1, 1), Some(4));
        assert_eq!(slot_victim(&r, 0, 1), Some(4));
        // A flood request waits: nobody runs two more than the flood does.
        assert_eq!(slot_victim(&r, 4, 1), None);
        // One more only would swap places: no slot moves.
        assert_eq!(slot_victim(&slots(&["a", "a", "b"]), 1, 1), None);
        assert_eq!(slot_victim(&slots(&["a", "a", "b"]), 0, 1), Some(1));
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
            match slot_victim(&slots(&running), b_runs, 1) {
                Some(v) => {
                    assert_eq!(running[v], "a");
                    running.remove(v);
                    running.push("b");
                    waiting_b -= 1;
                    moves += 1;
                    // The preempted "a" waits now: it must not get its slot back.
                    let a_runs = running.iter().filter(|t| **t == "a").count();
                    assert_eq!(slot_victim(&slots(&running), a_runs, 1), None);
                }
                None => break,
            }
        }
        assert_eq!(moves, 3);
        assert_eq!(running.iter().filter(|t| **t == "a").count(), 5);
    }

    /// Weighted: a tenant of weight 3 waiting beside one of weight 1 that holds every slot
    /// ends with three quarters of them, and no slot then moves back either way; pages go
    /// from the tenant holding the most per unit of weight.
    #[test]
    fn shares_follow_the_weights() {
        let holding = |spec: &[(&'static str, u32)]| -> Vec<Holding<'static>> {
            spec.iter()
                .map(|&(tenant, weight)| Holding {
                    tenant,
                    weight,
                    pages: 0,
                })
                .collect()
        };
        let mut running: Vec<(&str, u32)> = vec![("light", 1); 8];
        loop {
            let heavy_runs = running.iter().filter(|t| t.0 == "heavy").count();
            let Some(v) = slot_victim(&holding(&running), heavy_runs, 3) else {
                break;
            };
            assert_eq!(running[v].0, "light");
            running.remove(v);
            running.push(("heavy", 3));
        }
        assert_eq!(running.iter().filter(|t| t.0 == "heavy").count(), 6);
        let light_runs = running.iter().filter(|t| t.0 == "light").count();
        assert_eq!(slot_victim(&holding(&running), light_runs, 1), None);
        // Pages: 6 held by weight 3 (2 per unit) against 4 by weight 1: the light one gives.
        let pages = vec![
            Holding {
                tenant: "heavy",
                weight: 3,
                pages: 6,
            },
            Holding {
                tenant: "light",
                weight: 1,
                pages: 4,
            },
            Holding {
                tenant: "heavy",
                weight: 3,
                pages: 0,
            },
        ];
        assert_eq!(victim(&pages, 0), Some(1));
    }
}
