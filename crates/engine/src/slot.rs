//! A request's place in the engine, the refusal a client gets when none is free, and how
//! the places are shared between tenants.
//!
//! The engine holds at most `max_running + max_waiting` requests (its *places*). A first-come
//! pool of places would let one tenant take them all, after which every other tenant gets
//! 429s until that tenant's queue drains; refusing a waiting request to make room is not an
//! option either, since a streamed request's client already has its 200. So the last
//! [`Places::reserve`] places (1/16 of them, none below 16 places) are shared by the
//! *dynamic threshold* rule of shared-buffer switches: a tenant that holds `h` places may
//! take one of them only while `h < 2 × (places still free after it)`, and a tenant holding
//! none may always take one. A flood therefore stops at `capacity - reserve` places, and
//! the reserve goes out to the other tenants in shrinking shares (each takes at most about
//! two thirds of what is left), so a tenant with nothing in the engine always finds a place
//! while any is free. A lone tenant's reach is `capacity - reserve`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// The engine holds as many requests as it may (running plus waiting), or as many as the
/// request's tenant may while others could need the rest: retry later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueFull {
    #[error("the engine's queue is full ({limit} requests running or waiting)")]
    Full { limit: usize },
    #[error(
        "your requests hold {held} of the engine's {limit} places; the last {reserve} are \
         kept for other tenants' requests"
    )]
    TenantShare {
        limit: usize,
        held: usize,
        reserve: usize,
    },
}

/// The engine's places and who holds them.
#[derive(Debug)]
pub(crate) struct Places {
    capacity: usize,
    reserve: usize,
    held: Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_tenant: HashMap<String, usize>,
}

impl Places {
    pub(crate) fn new(capacity: usize) -> Arc<Self> {
        Arc::new(Self {
            capacity,
            reserve: if capacity >= 16 { capacity / 16 } else { 0 },
            held: Mutex::default(),
        })
    }

    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// A place for a request of `tenant`, or why not (see the module documentation).
    pub(crate) fn take(self: &Arc<Self>, tenant: &str) -> Result<Slot, QueueFull> {
        // The counts stay consistent under a panic elsewhere (each update is one step).
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let free = self.capacity - held.total;
        if free == 0 {
            return Err(QueueFull::Full {
                limit: self.capacity,
            });
        }
        let mine = held.by_tenant.get(tenant).copied().unwrap_or(0);
        if free <= self.reserve && mine > 0 && mine >= 2 * (free - 1) {
            return Err(QueueFull::TenantShare {
                limit: self.capacity,
                held: mine,
                reserve: self.reserve,
            });
        }
        held.total += 1;
        *held.by_tenant.entry(tenant.to_owned()).or_default() += 1;
        Ok(Slot {
            places: self.clone(),
            tenant: tenant.to_owned(),
        })
    }

    fn give_back(&self, tenant: &str) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.total -= 1;
        if let Some(n) = held.by_tenant.get_mut(tenant) {
            *n -= 1;
            if *n == 0 {
                held.by_tenant.remove(tenant);
            }
        }
    }

    #[cfg(test)]
    fn held_by(&self, tenant: &str) -> usize {
        let held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.by_tenant.get(tenant).copied().unwrap_or(0)
    }
}

/// One of the engine's places for a request, held from `submit` until the request ends
/// (whichever way: finished, failed, cancelled, or the command dropped undelivered).
/// Dropping it frees the place.
#[derive(Debug)]
pub(crate) struct Slot {
    places: Arc<Places>,
    tenant: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.places.give_back(&self.tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fill(places: &Arc<Places>, tenant: &str, out: &mut Vec<Slot>) -> Option<QueueFull> {
        loop {
            match places.take(tenant) {
                Ok(s) => out.push(s),
                Err(e) => return Some(e),
            }
        }
    }

    #[test]
    fn a_flood_leaves_the_reserve_to_other_tenants() {
        let places = Places::new(288);
        let mut slots = Vec::new();
        let refusal = fill(&places, "alice", &mut slots);
        assert_eq!(slots.len(), 288 - 18);
        assert_eq!(
            refusal,
            Some(QueueFull::TenantShare {
                limit: 288,
                held: 270,
                reserve: 18
            })
        );
        // Bob takes about two thirds of the reserve, then Carol, then Dave: each finds one.
        let mut bobs = Vec::new();
        fill(&places, "bob", &mut bobs);
        assert!((10..=13).contains(&bobs.len()), "{}", bobs.len());
        for tenant in ["carol", "dave", "erin"] {
            let mut theirs = Vec::new();
            fill(&places, tenant, &mut theirs);
            assert!(!theirs.is_empty(), "{tenant} found no place");
            slots.extend(theirs);
        }
        // A place Alice's finished request frees stays for a tenant holding fewer.
        slots.drain(..1);
        assert_eq!(places.held_by("alice"), 269);
        assert!(places.take("alice").is_err());
        assert!(places.take("frank").is_ok());
    }

    #[test]
    fn a_small_engine_is_one_first_come_pool() {
        let places = Places::new(15);
        let mut slots = Vec::new();
        assert_eq!(
            fill(&places, "alice", &mut slots),
            Some(QueueFull::Full { limit: 15 })
        );
        assert_eq!(slots.len(), 15);
        drop(slots);
        assert_eq!(places.held_by("alice"), 0);
        assert!(places.take("bob").is_ok());
    }

    proptest! {
        /// Under any order of takes and drops by any tenants: the total never passes the
        /// capacity, a tenant holding nothing is refused only when every place is taken,
        /// no one is refused while more than the reserve is free, and every place comes back.
        #[test]
        fn places_are_never_overcommitted_and_newcomers_get_in(
            capacity in 1usize..80,
            ops in proptest::collection::vec((0u8..6, any::<bool>(), any::<u16>()), 1..400),
        ) {
            let places = Places::new(capacity);
            let mut slots: Vec<Slot> = Vec::new();
            for (tenant, take, pick) in ops {
                let name = format!("t{tenant}");
                if take || slots.is_empty() {
                    let free = capacity - slots.len();
                    let mine = places.held_by(&name);
                    match places.take(&name) {
                        Ok(s) => slots.push(s),
                        Err(QueueFull::Full { .. }) => prop_assert_eq!(free, 0),
                        Err(QueueFull::TenantShare { held, .. }) => {
                            prop_assert!(mine > 0 && held == mine);
                            prop_assert!(free >= 1 && free <= capacity / 16);
                        }
                    }
                    prop_assert!(slots.len() <= capacity);
                } else {
                    slots.swap_remove(usize::from(pick) % slots.len());
                }
            }
            drop(slots);
            let held = places.held.lock().unwrap();
            prop_assert_eq!(held.total, 0);
            prop_assert!(held.by_tenant.is_empty());
        }
    }
}
