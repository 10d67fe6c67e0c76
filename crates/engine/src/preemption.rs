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
}
